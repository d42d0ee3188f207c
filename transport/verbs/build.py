"""Every pyverbs object the verbs backend builds, built here and nowhere else.

One module so the honesty test (tests/transport/test_verbs_pyverbs.py) can
build each object with real pyverbs and with the software fabric and compare
what reads back: a wrong keyword or field fails there, on a machine with no
RDMA device, instead of on the first hardware run.

Also the write plan (`plan_wrs`): the segment table sorted by destination,
coalesced, rows above the port's max message size split, and runs contiguous
at the destination gathered into multi-SGE WRs (at most `max_sge` SGEs and
`max_msg` bytes each). Planning is array arithmetic except the gather walk,
which visits each row once — no more than building its SGE costs anyway.
Python pays ~10-15 us per WR object, so WRs per request are the scale limit
(docs/benchmarks.md): entry-major tables make few, layer-major many.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..copying import coalesce
from ..segments import split_rows

# Retry counts as most RC users set them: 7 = retry RNR forever (we never
# post a SEND without a credit, so RNR means a stalled peer, which our own
# timeouts handle); timeout 14 ~ 67 ms per retry, retry_cnt 7.
RNR_RETRY, RETRY_CNT, TIMEOUT, MIN_RNR_TIMER = 7, 7, 14, 12


def qp_init_attr(api: Any, cq: Any, send_wr: int, recv_wr: int, send_sge: int) -> Any:
    """RC QP attributes with selective signalling (`sq_sig_all=0`; pyverbs defaults to 1)."""
    cap = api.QPCap(max_send_wr=send_wr, max_recv_wr=recv_wr, max_send_sge=send_sge,
                    max_recv_sge=1, max_inline_data=0)
    return api.QPInitAttr(qp_type=api.E.ibv_qp_type.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap,
                          sq_sig_all=0)


def connect_attr(api: Any, *, port_num: int, mtu: int, access: int, dest_qpn: int, rq_psn: int,
                 sq_psn: int, lid: int, gid: str, sgid_index: int, grh: bool, hop_limit: int = 64,
                 traffic_class: int = 0, sl: int = 0) -> Any:
    """What RESET->INIT->RTR->RTS needs (pyverbs' `to_rts` picks the masks per step).

    `grh`: address the peer by GID through a global routing header (always
    on RoCE; on InfiniBand across subnets), with `hop_limit` (pyverbs'
    default of 1 is dropped by the first router) and `traffic_class`;
    otherwise by LID alone. `sl` is the service level either way.
    """
    attr = api.QPAttr(port_num=port_num, path_mtu=mtu)
    attr.qp_access_flags = access
    attr.dest_qp_num = dest_qpn
    attr.rq_psn = rq_psn
    attr.sq_psn = sq_psn
    attr.max_dest_rd_atomic = 1
    attr.max_rd_atomic = 1
    attr.min_rnr_timer = MIN_RNR_TIMER
    attr.timeout = TIMEOUT
    attr.retry_cnt = RETRY_CNT
    attr.rnr_retry = RNR_RETRY
    if grh:
        gr = api.GlobalRoute(dgid=api.GID(gid), sgid_index=sgid_index, hop_limit=hop_limit,
                             traffic_class=traffic_class)
        attr.ah_attr = api.AHAttr(port_num=port_num, is_global=1, dlid=lid, sl=sl, gr=gr)
    else:
        attr.ah_attr = api.AHAttr(port_num=port_num, is_global=0, dlid=lid, sl=sl)
    return attr


def err_attr(api: Any) -> tuple[Any, int]:
    """`(attr, mask)` moving a QP to ERR: it stops and flushes every outstanding WR."""
    return (api.QPAttr(qp_state=api.E.ibv_qp_state.IBV_QPS_ERR),
            api.E.ibv_qp_attr_mask.IBV_QP_STATE)


def recv_wr(api: Any, wr_id: int, addr: int, length: int, lkey: int) -> Any:
    """One receive slot (rdma-core 44 refuses a RecvWR without an SGE)."""
    return api.RecvWR(wr_id=wr_id, num_sge=1, sg=[api.SGE(addr, length, lkey)])


def plan_wrs(table: np.ndarray, max_sge: int, max_msg: int) -> tuple[np.ndarray, np.ndarray]:
    """`(rows, starts)`: the table as WR-ready rows, and the first row of each WR."""
    if table.shape[0] == 0:
        return table, np.zeros(0, np.int64)
    order = np.argsort(table[:, 1], kind="stable")
    rows = split_rows(coalesce(table[order]), max_msg)
    d, n = rows[:, 1], rows[:, 2]
    new_run = np.ones(rows.shape[0], bool)
    new_run[1:] = d[1:] != d[:-1] + n[:-1]
    if new_run.all() or max_sge == 1:
        return rows, np.arange(rows.shape[0], dtype=np.int64)
    starts, count, size = [], 0, 0
    for i, (fresh, nb) in enumerate(zip(new_run.tolist(), n.tolist(), strict=True)):
        if fresh or count == max_sge or size + nb > max_msg:
            starts.append(i)
            count, size = 0, 0
        count += 1
        size += nb
    return rows, np.asarray(starts, dtype=np.int64)


def write_wrs(api: Any, rows: np.ndarray, starts: np.ndarray, *, src_base: int, lkey: int,
              dst_base: int, rkey: int, signal_every: int) -> list[Any]:
    """RDMA WRITE WRs for planned rows, unlinked; built off every lock (`VerbsLink.plan`).

    Every `signal_every`-th WR is signaled, and its wr_id is the number of
    SQ slots its completion frees (itself and the unsignaled WRs since the
    last signaled one: `signal_every`); unsignaled WRs carry 0. So a WR
    list needs no position in its rail's stream when it is built, and a
    completion needs no lookup. The caller's note that ends the transfer is
    always signaled (`note_frees`), so no slot waits forever for a completion.
    """
    opcode = api.E.ibv_wr_opcode.IBV_WR_RDMA_WRITE
    signaled = api.E.ibv_send_flags.IBV_SEND_SIGNALED
    src = (rows[:, 0] + src_base).tolist()
    dst = (rows[:, 1] + dst_base).tolist()
    size = rows[:, 2].tolist()
    bounds = starts.tolist() + [rows.shape[0]]
    SGE, SendWR = api.SGE, api.SendWR
    out = []
    for k in range(len(starts)):
        a, b = bounds[k], bounds[k + 1]
        sg = [SGE(src[i], size[i], lkey) for i in range(a, b)]
        last = (k + 1) % signal_every == 0
        wr = SendWR(wr_id=signal_every if last else 0, opcode=opcode, num_sge=b - a, sg=sg,
                    send_flags=signaled if last else 0)
        wr.set_wr_rdma(rkey, dst[a])
        out.append(wr)
    return out


def note_frees(writes: int, signal_every: int) -> int:
    """SQ slots the note after `writes` WRITE WRs frees: itself and the unsignaled WRITEs before it."""
    return writes % signal_every + 1


def note_wr(api: Any, wr_id: int, addr: int, length: int, lkey: int) -> Any:
    """The signaled SEND carrying a transfer's note; on RC it lands after every earlier WRITE.

    `wr_id`: the slots its completion frees (`note_frees`).
    """
    return api.SendWR(wr_id=wr_id, opcode=api.E.ibv_wr_opcode.IBV_WR_SEND, num_sge=1,
                      sg=[api.SGE(addr, length, lkey)],
                      send_flags=api.E.ibv_send_flags.IBV_SEND_SIGNALED)


def link(wrs: list[Any]) -> Any:
    """Chain `wrs` through `next_wr` for one doorbell; the caller keeps the list alive."""
    for prev, nxt in zip(wrs[:-1], wrs[1:], strict=True):
        prev.next_wr = nxt
    return wrs[0]
