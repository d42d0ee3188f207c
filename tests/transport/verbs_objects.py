"""Every pyverbs object `verbs_build` makes, built with one API and read back as plain values.

Run in-process for the software fabric and, as a script, in a subprocess
that imports real pyverbs from `pyverbs_prefix` (its libraries must be on
`LD_LIBRARY_PATH` at process start). The honesty test compares the two.
Also `surface()`: the names the backend reaches on the API and its enums.
"""

from __future__ import annotations

import json
import re
import sys
import types
from typing import Any

import numpy as np
from pdxfer.transport.verbs import build
from pdxfer.transport.verbs.api import load
from pdxfer.transport.verbs.sim import namespace as soft

GID = "fe80:0000:0000:0000:0000:ffff:7f00:0001"


def _recording(api: Any) -> tuple[Any, list]:
    """`api` with SGE construction recorded (real SendWRs cannot give their SGEs back)."""
    made: list = []
    ns = types.SimpleNamespace(**vars(api))

    def sge(addr: int, length: int, lkey: int) -> Any:
        made.append([addr, length, lkey])
        return api.SGE(addr, length, lkey)

    ns.SGE = sge
    return ns, made


def _attr(a: Any) -> dict:
    ah = a.ah_attr
    return {f: int(getattr(a, f)) for f in (
        "qp_access_flags", "dest_qp_num", "rq_psn", "sq_psn", "max_dest_rd_atomic", "max_rd_atomic",
        "min_rnr_timer", "timeout", "retry_cnt", "rnr_retry", "port_num", "path_mtu")} | {
        "ah": [int(ah.is_global), int(ah.dlid), int(ah.port_num), int(ah.sl),
               int(ah.sgid_index) if ah.is_global else None, str(ah.dgid) if ah.is_global else None,
               int(ah.hop_limit) if ah.is_global else None,
               int(ah.traffic_class) if ah.is_global else None]}


def objects(api: Any) -> dict:
    """Build each object the backend builds and read its fields back."""
    ns, sges = _recording(api)
    out: dict = {}
    init = build.qp_init_attr(ns, None, 64, 4, 8)
    out["qp_init_attr"] = [int(init.qp_type), int(init.sq_sig_all)] + [
        int(getattr(init.cap, f)) for f in
        ("max_send_wr", "max_recv_wr", "max_send_sge", "max_recv_sge", "max_inline_data")]
    for grh in (True, False):
        a = build.connect_attr(ns, port_num=1, mtu=5, access=3, dest_qpn=0x1234, rq_psn=77,
                               sq_psn=0xABCDE, lid=9, gid=GID, sgid_index=3, grh=grh, hop_limit=64,
                               traffic_class=106, sl=3)
        out[f"connect_attr grh={grh}"] = _attr(a)
    attr, mask = build.err_attr(ns)
    out["err_attr"] = [int(attr.qp_state), int(mask)]
    r = build.recv_wr(ns, 5, 0x10000, 4096, 0x77)
    out["recv_wr"] = [int(r.wr_id), int(r.num_sge)]
    table = np.array([[0, 0, 100], [500, 100, 50], [4096, 8192, 3 << 20]], np.int64)
    rows, starts = build.plan_wrs(table, 8, 1 << 20)
    wrs = build.write_wrs(ns, rows, starts, src_base=0x100000, lkey=0x11, dst_base=0x200000,
                          rkey=0x22, signal_every=2)
    wrs.append(build.note_wr(ns, build.note_frees(len(wrs), 2), 0x300000, 120, 0x11))
    build.link(wrs)
    out["send_wrs"] = [[int(w.wr_id), int(w.opcode), int(w.num_sge), int(w.send_flags)]
                       for w in wrs]
    out["sges"] = sges
    out["gid"] = str(api.GID(GID).gid)
    return out


def real_class(api: Any, name: str) -> Any:
    """The real pyverbs class called `name` (the API's, or a result type such as PortAttr)."""
    if hasattr(api, name):
        return getattr(api, name)
    import importlib

    for module in ("pyverbs.device", "pyverbs.cq"):
        found = getattr(importlib.import_module(module), name, None)
        if found is not None:
            return found
    raise AttributeError(name)


def check_surface(api: Any, request: dict) -> list[str]:
    """What of `request` (class attrs, enum values, constructor kwargs) real pyverbs lacks."""
    problems = []
    for cls, names in request["classes"].items():
        try:
            real = real_class(api, cls)
        except AttributeError:
            problems.append(f"pyverbs has no class {cls}")
            continue
        problems += [f"{cls}.{n} missing" for n in names if not hasattr(real, n)]
    for enum, member, value in request["enums"]:
        holder = api.E if enum is None else getattr(api.E, enum, None)
        got = getattr(holder, member, None)
        if got is None or int(got) != value:
            problems.append(f"E.{enum}.{member} is {got}, fabric says {value}")
    for cls, kws in request["kwargs"].items():
        doc = real_class(api, cls).__init__.__doc__ or ""
        params = {line.split(":param")[1].strip().split(":")[0].strip()
                  for line in doc.splitlines() if ":param" in line}
        params |= set(re.findall(r"\* \*(\w+)\*", doc))  # the `:param kwargs:` list style
        problems += [f"{cls}() has no documented parameter {k!r}" for k in kws if k not in params]
    return problems


if __name__ == "__main__":
    if sys.argv[1:] == ["surface"]:
        json.dump(check_surface(load(), json.load(sys.stdin)), sys.stdout)
    else:
        json.dump(objects(load() if sys.argv[1:] == ["real"] else soft()), sys.stdout)
