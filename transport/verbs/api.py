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
error (named by its WC status), and `probe()` (is there an active port? the registry lists "verbs"
only then) and `pick_port()` (device, port, GID/LID choice with options to
pin them), the one place that reads device and port attributes.
"""

from __future__ import annotations

import importlib
import os
import types
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Port:
    """The device port a verbs engine uses, with the limits the backend plans by."""

    device: str
    port_num: int
    gid_index: int
    gid: str
    lid: int
    mtu: int  # ibv_mtu enum value
    ethernet: bool
    max_qp_wr: int
    max_sge: int
    max_cqe: int
    max_msg_sz: int


def _no_devices_reason(exc: BaseException | None) -> str:
    if not os.path.isdir("/sys/class/infiniband"):
        return "no RDMA device: kernel has no InfiniBand support (/sys/class/infiniband is absent)"
    return f"no RDMA device found ({exc or 'ibv_get_device_list returned none'})"


def pick_port(api: Any, device: str | None = None, port_num: int | None = None,
              gid_index: int | None = None) -> tuple[Any, Port]:
    """Open the first device with an ACTIVE port (or the pinned one): `(Context, Port)`.

    The GID is `gid_index` if given, else the first RoCE v2 GID that is not
    all zeros (Ethernet); InfiniBand uses the LID with no GRH.
    """
    E = api.E
    try:
        devices = api.get_device_list()
    except api.PyverbsError as exc:
        raise CapabilityError(_no_devices_reason(exc)) from exc
    names = [d.name.decode() if isinstance(d.name, bytes) else d.name for d in devices]
    if device is not None:
        names = [n for n in names if n == device] or [device]
    if not names:
        raise CapabilityError(_no_devices_reason(None))
    tried = []
    for name in names:
        try:
            ctx = api.Context(name=name)
        except api.PyverbsError as exc:
            tried.append(f"{name}: {exc}")
            continue
        dev = ctx.query_device()
        for p in [port_num] if port_num else [1, 2]:
            try:
                attr = ctx.query_port(p)
            except api.PyverbsError:
                continue
            if attr.state != E.ibv_port_state.IBV_PORT_ACTIVE:
                tried.append(f"{name} port {p}: not active")
                continue
            ethernet = attr.link_layer == E.IBV_LINK_LAYER_ETHERNET
            gi = gid_index if gid_index is not None else (_roce_v2_gid(api, ctx, p, attr.gid_tbl_len)
                                                          if ethernet else 0)
            gid = ctx.query_gid(p, gi).gid
            return ctx, Port(name, p, gi, gid, int(attr.lid), int(attr.active_mtu), ethernet,
                             int(dev.max_qp_wr), int(dev.max_sge), int(dev.max_cqe),
                             int(attr.max_msg_sz))
        ctx.close()
    raise CapabilityError(f"no ACTIVE RDMA port ({'; '.join(tried) or 'none found'}); "
                          "bring a link up or pin device=/port_num=")


def _roce_v2_gid(api: Any, ctx: Any, port: int, count: int) -> int:
    zero = "0000:0000:0000:0000:0000:0000:0000:0000"
    v2 = api.E.ibv_gid_type_sysfs.IBV_GID_TYPE_SYSFS_ROCE_V2
    for i in range(count):
        try:
            if ctx.query_gid(port, i).gid != zero and ctx.query_gid_type(port, i) == v2:
                return i
        except api.PyverbsError:
            continue
    raise CapabilityError(f"no RoCE v2 GID with an address on port {port}; pass gid_index=")


def probe() -> str | None:
    """None when real pyverbs imports and an ACTIVE port exists, else the reason it does not."""
    if not os.path.isdir("/sys/class/infiniband"):  # no kernel RDMA: say so, import nothing
        return _no_devices_reason(None)
    try:
        api = load()
        ctx, _ = pick_port(api)
    except CapabilityError as exc:
        return str(exc)
    ctx.close()
    return None


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
