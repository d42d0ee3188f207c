"""The software verbs fabric behaves as an RC NIC where the verbs backend relies on it.

Verbs-level tests drive the software fabric (`verbs/sim/`) through the same builders the
backend uses (`verbs/build.py`), so they read like rdma-core's own tests: two QPs on one
PD, buffers registered by address, WRs posted and completions polled. Those
that need no fault injection also run on a real device where one is up (the
`two` fixture's "real" case, skipped elsewhere with the reason), so the first
hardware run shows where the fabric and a NIC disagree. The backend-level
tests live in test_verbs_backend.py.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from pdxfer.transport.verbs import build
from pdxfer.transport.verbs.api import load
from pdxfer.transport.verbs.nics import pick_port, probe
from pdxfer.transport.verbs.sim import namespace as soft
from pdxfer.transport.verbs.sim import verbs as soft_verbs

API = soft()
S = API.E.ibv_wc_status
RW = int(API.E.ibv_access_flags.IBV_ACCESS_LOCAL_WRITE | API.E.ibv_access_flags.IBV_ACCESS_REMOTE_WRITE)
WAIT = 10.0


class Two:
    """Two connected RC QPs `a` -> `b` (fabric, or a real port), a source and a destination buffer."""

    def __init__(self, *, cqe: int = 64, send_wr: int = 16, recv_wr: int = 4, b_access: int = RW,
                 rnr_retry: int = 7, real: bool = False) -> None:
        api = self.api = load() if real else API
        self.real = real
        self.ctx, port = pick_port(api)
        self.pd = api.PD(self.ctx)
        self.cq_a, self.cq_b = api.CQ(self.ctx, cqe), api.CQ(self.ctx, cqe)
        self.a = api.QP(self.pd, build.qp_init_attr(api, self.cq_a, send_wr, 1, 8))
        self.b = api.QP(self.pd, build.qp_init_attr(api, self.cq_b, 1, recv_wr, 1))
        self.src = np.random.default_rng(1).integers(0, 256, 4 << 20, dtype=np.uint8)
        self.dst = np.zeros(4 << 20, np.uint8)
        self.src_mr = api.MR(self.pd, self.src.nbytes, RW, address=self.src.ctypes.data)
        self.dst_mr = api.MR(self.pd, self.dst.nbytes, b_access, address=self.dst.ctypes.data)
        for qp, other, access in ((self.b, self.a, b_access), (self.a, self.b, 0)):
            attr = build.connect_attr(api, port_num=port.port_num, mtu=port.mtu, access=access,
                                      dest_qpn=other.qp_num, rq_psn=0, sq_psn=0, lid=port.lid,
                                      gid=port.gid, sgid_index=port.gid_index, grh=port.ethernet)
            attr.rnr_retry = rnr_retry
            qp.to_rts(attr)

    def write(self, wr_id: int, src: int, dst: int, n: int, rkey: int | None = None) -> object:
        rows = np.array([[src, dst, n]], np.int64)
        (wr,) = build.write_wrs(self.api, rows, np.zeros(1, np.int64), src_base=self.src.ctypes.data,
                                lkey=self.src_mr.lkey, dst_base=self.dst.ctypes.data,
                                rkey=self.dst_mr.rkey if rkey is None else rkey, signal_every=1)
        wr.wr_id = wr_id
        return wr

    def completion(self, cq: object) -> object:
        if self.real:  # a hardware CQ is polled, as the backend's progress thread does
            deadline = time.monotonic() + WAIT
            while time.monotonic() < deadline:
                n, wcs = cq.poll(1)
                if n:
                    return wcs[0]
                time.sleep(0.0005)
            raise AssertionError("no completion")
        fab = soft_verbs.fabric()
        with fab.lock:
            assert fab.lock.wait_for(lambda: cq.sim_state.entries, WAIT), "no completion"
        _, (wc,) = cq.poll(1)
        return wc

    def state(self, qp: object) -> int:
        """The QP's current state (pyverbs caches `qp_state`; a NIC's must be queried)."""
        if self.real:
            return qp.query(self.api.E.ibv_qp_attr_mask.IBV_QP_STATE)[0].qp_state
        return qp.qp_state

    def close(self) -> None:
        self.ctx.close()


HARDWARE = probe()


@pytest.fixture(params=["fabric", "real"])
def two(request: pytest.FixtureRequest):
    """Two QPs on the fabric, and on a real port where one is ACTIVE."""
    if request.param == "real" and HARDWARE is not None:
        pytest.skip(f"no real RDMA port: {HARDWARE}")
    t = Two(real=request.param == "real")
    yield t
    t.close()


@pytest.fixture
def soft_two():
    """Two QPs on the fabric, for tests that inject faults or rely on its small limits."""
    t = Two()
    yield t
    t.close()


def test_write_lands_in_order_and_completes(two: Two) -> None:
    two.a.post_send(build.link([two.write(1, 0, 0, 1 << 20), two.write(2, 100, 3 << 20, 5000)]))
    assert two.completion(two.cq_a).wr_id == 1
    assert two.completion(two.cq_a).wr_id == 2
    assert np.array_equal(two.dst[:1 << 20], two.src[:1 << 20])
    assert np.array_equal(two.dst[3 << 20:(3 << 20) + 5000], two.src[100:5100])


def test_posted_wrs_keep_landing_while_the_poster_is_blocked(two: Two) -> None:
    posted, release = threading.Event(), threading.Event()

    def poster() -> None:  # posts, then blocks: it never polls, never rings again
        two.a.post_send(build.link([two.write(i, i << 20, i << 20, 1 << 20) for i in range(4)]))
        posted.set()
        release.wait(WAIT)

    thread = threading.Thread(target=poster)
    thread.start()
    try:
        assert posted.wait(WAIT)
        for i in range(4):
            assert two.completion(two.cq_a).wr_id == i
        assert thread.is_alive(), "the poster was released before the bytes landed"
        assert np.array_equal(two.dst, two.src)
    finally:
        release.set()
        thread.join(WAIT)


def test_bad_rkey_and_bounds_are_remote_access_errors_that_stop_both_qps(two: Two) -> None:
    two.a.post_send(two.write(1, 0, (4 << 20) - 10, 20))  # past the MR's end
    wc = two.completion(two.cq_a)
    assert wc.status == S.IBV_WC_REM_ACCESS_ERR and soft_verbs.cqe_status_to_str(wc.status) == "remote access error"
    assert two.state(two.a) == two.state(two.b) == API.E.ibv_qp_state.IBV_QPS_ERR
    assert not two.dst.any()


def test_message_above_max_msg_size_is_a_local_length_error(soft_two: Two) -> None:
    wr = soft_two.write(1, 0, 0, 2 << 20)  # the fabric's port max_msg_sz is 1 MiB
    soft_two.a.post_send(wr)
    wc_ok = soft_two.completion(soft_two.cq_a)  # 2 MiB > 1 MiB: refused
    assert wc_ok.status == S.IBV_WC_LOC_LEN_ERR
    assert not soft_two.dst.any()


def test_sq_depth_is_enforced_at_post_time(soft_two: Two) -> None:
    soft_verbs.fabric().pause(soft_two.a.qp_num)
    try:
        soft_two.a.post_send(build.link([soft_two.write(i, 0, i * 64, 64) for i in range(16)]))
        with pytest.raises(soft_verbs.PyverbsRDMAError, match="Errno: 12"):
            soft_two.a.post_send(soft_two.write(99, 0, 0, 64))
    finally:
        soft_verbs.fabric().pause(soft_two.a.qp_num, False)
    for i in range(16):
        assert soft_two.completion(soft_two.cq_a).wr_id == i


def test_send_without_a_receive_is_rnr_then_retry_exceeded() -> None:
    t = Two(rnr_retry=3)
    fab = soft_verbs.fabric()
    try:
        note = build.note_wr(API, 5, t.src.ctypes.data, 100, t.src_mr.lkey)
        t.a.post_send(note)
        wc = t.completion(t.cq_a)
        assert wc.status == S.IBV_WC_RNR_RETRY_EXC_ERR and wc.wr_id == 5
        assert fab.retry_timeout > 0
    finally:
        t.close()


def test_cq_overrun_puts_the_qp_in_error() -> None:
    t = Two(cqe=4, send_wr=16)
    try:
        t.a.post_send(build.link([t.write(i, 0, i * 64, 64) for i in range(8)]))
        fab = soft_verbs.fabric()
        with fab.lock:
            assert fab.lock.wait_for(lambda: t.cq_a.sim_state.overrun, WAIT)
        assert t.a.qp_state == API.E.ibv_qp_state.IBV_QPS_ERR
    finally:
        t.close()


def test_fault_injection_fail_next_and_cut(soft_two: Two) -> None:
    fab = soft_verbs.fabric()
    fab.fail_next(soft_two.a.qp_num, S.IBV_WC_LOC_PROT_ERR)
    soft_two.a.post_send(build.link([soft_two.write(1, 0, 0, 64), soft_two.write(2, 0, 64, 64)]))
    assert soft_two.completion(soft_two.cq_a).status == S.IBV_WC_LOC_PROT_ERR
    assert soft_two.completion(soft_two.cq_a).status == S.IBV_WC_WR_FLUSH_ERR  # everything after flushes
    other = Two()
    try:
        fab.cut(other.a.qp_num, other.b.qp_num)
        other.a.post_send(other.write(1, 0, 0, 64))
        assert other.completion(other.cq_a).status == S.IBV_WC_RETRY_EXC_ERR
        assert not other.dst.any()
    finally:
        other.close()


def test_qp_outside_rts_refuses_post_send() -> None:
    ctx = API.Context(name="soft0")
    try:
        pd, cq = API.PD(ctx), API.CQ(ctx, 8)
        qp = API.QP(pd, build.qp_init_attr(API, cq, 4, 1, 1))
        with pytest.raises(soft_verbs.PyverbsRDMAError, match="Errno: 22"):
            qp.post_send(build.note_wr(API, 1, 4096, 8, 1))
        with pytest.raises(soft_verbs.PyverbsError, match="at least one SGE"):
            API.RecvWR(wr_id=1, num_sge=0)
    finally:
        ctx.close()
