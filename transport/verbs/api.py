"""Where the verbs backend gets its verbs: real pyverbs, or the software fabric, by one name set.

The backend never imports pyverbs itself: it asks `load()` (real pyverbs,
or `CapabilityError` with the install hint) or `sim.namespace()` (the software
fabric, `verbs/sim/`) for a namespace with the same names (`NAMES`) — `Context, PD, MR, DmaBufMR, CQ, QP, QPCap,
QPInitAttr, QPAttr, AHAttr, GlobalRoute, GID, SGE, SendWR, RecvWR, E,
PyverbsError, PyverbsRDMAError, get_device_list, cqe_status_to_str` — so the
same code runs on a NIC and on the fabric, and the honesty tests can hold the
two side by side.

Enums: rdma-core <= 58 ships `pyverbs.enums`, 59+ `pyverbs.libibverbs_enums`
(Cython 3.1); both carry the class-qualified names used here.

Also here: `wc_error`, the one place a failed work completion becomes our
error (named by its WC status). Which device, port and GID an engine uses,
and the registry's probe for an ACTIVE port, are `nics`'.
"""

from __future__ import annotations

import importlib
import types
from typing import Any

from ..errors import (
    CapabilityError,
    PeerLostError,
    ProtocolError,
    RegistrationError,
    TransportError,
)

INSTALL_HINT = (
    "install rdma-core's Python bindings (Debian/Ubuntu: apt install python3-pyverbs "
    "ibverbs-providers; they are cp311 builds) and load your NIC's driver"
)
NAMES = {
    "pyverbs.device": ("Context", "get_device_list"),
    "pyverbs.pd": ("PD",),
    "pyverbs.mr": ("MR", "DmaBufMR"),
    "pyverbs.cq": ("CQ", "cqe_status_to_str"),
    "pyverbs.qp": ("QP", "QPCap", "QPInitAttr", "QPAttr"),
    "pyverbs.addr": ("AHAttr", "GlobalRoute", "GID"),
    "pyverbs.wr": ("SGE", "SendWR", "RecvWR"),
    "pyverbs.pyverbs_error": ("PyverbsError", "PyverbsRDMAError"),
}
_loaded: types.SimpleNamespace | None = None


def load() -> types.SimpleNamespace:
    """Real pyverbs under the backend's names, or `CapabilityError` saying how to get it."""
    global _loaded
    if _loaded is not None:
        return _loaded
    ns = types.SimpleNamespace()
    try:
        for module, names in NAMES.items():
            mod = importlib.import_module(module)
            for name in names:
                setattr(ns, name, getattr(mod, name))
        try:
            ns.E = importlib.import_module("pyverbs.enums")
        except ImportError:
            ns.E = importlib.import_module("pyverbs.libibverbs_enums")
    except (ImportError, AttributeError) as exc:
        raise CapabilityError(f"pyverbs is not importable ({exc}); {INSTALL_HINT}") from exc
    _loaded = ns
    return ns


def wc_error(api: Any, wc: Any, peer: str) -> TransportError:
    """Our error for a failed work completion, naming its status."""
    S = api.E.ibv_wc_status
    status = int(wc.status)
    what = (f"verbs completion from/to {peer} failed: {api.cqe_status_to_str(status)} "
            f"(status {status}, vendor_err {int(wc.vendor_err):#x})")
    if status in (S.IBV_WC_RETRY_EXC_ERR, S.IBV_WC_RNR_RETRY_EXC_ERR):
        return PeerLostError(f"{what}: the peer is unreachable or dropped us")
    if status == S.IBV_WC_REM_ACCESS_ERR:
        return PeerLostError(f"{what}: the peer revoked access (fenced us or deregistered the region)")
    if status in (S.IBV_WC_REM_INV_REQ_ERR, S.IBV_WC_LOC_LEN_ERR):
        return ProtocolError(f"{what}: a message did not fit; the peers disagree on limits")
    if status == S.IBV_WC_LOC_PROT_ERR:
        return RegistrationError(f"{what}: a local SGE is outside its MR (deregistered mid-transfer?)")
    if status == S.IBV_WC_WR_FLUSH_ERR:
        return PeerLostError(f"{what}: the link had already failed")
    return TransportError(what)
