"""Heterogeneous TP through real engines: every rank its own engine, every byte checked."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pdxfer_testkit import config, until

from pdxfer import (
    ConfigError,
    DecodeEngine,
    HeteroTPDecode,
    HeteroTPPrefill,
    KVPoll,
    LayoutMismatchError,
    PrefillEngine,
    RequestError,
    RequestFailed,
    TransferTimeout,
    group_address,
    layout,
    sub_request_id,
)

WAIT = 20.0
HEADS = 4
FIELDS = {
    "kv": [layout.EntryField("k", 2, (4, HEADS, 8), torch.float32, tp_axis=1),
           layout.EntryField("v", 2, (4, HEADS, 8), torch.float32, tp_axis=1)],
    # Replicated state: goes from one chosen prefill rank to each decode rank.
    "state": [layout.EntryField("conv", 1, (3, 16), torch.float32),
              layout.EntryField("score", 1, (5,), torch.float32, fill=float("-inf"))],
}
ENTRIES = {"kv": 32, "state": 8}


def _global(seed: int) -> dict[str, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return {pool: {f.name: torch.randn((f.layers, ENTRIES[pool]) + f.shape, generator=gen)
                   for f in fields} for pool, fields in FIELDS.items()}


def _pools(tp: int, rank: int, values: dict | None) -> dict[str, layout.ShardMajorArena]:
    pools = {pool: layout.ShardMajorArena(FIELDS[pool], ENTRIES[pool], "cpu", tp=tp, rank=rank)
             for pool in FIELDS}
    if values is not None:
        for pool, arena in pools.items():
            for f in FIELDS[pool]:
                want = values[pool][f.name]
                if f.tp_axis is not None:
                    lo, hi = arena.heads(f.name)
                    want = want.narrow(2 + f.tp_axis, lo, hi - lo)
                arena.view(f.name).copy_(want)
    return pools


class Ranks:
    """P prefill and D decode engines, each rank with its own shard pools."""

    def __init__(self, backend: str, P: int, D: int, decode_cfg: dict | None = None,
                 **cfg) -> None:
        self.values = _global(seed=P * 10 + D)
        self.src = [_pools(P, p, self.values) for p in range(P)]
        self.dst = [_pools(D, q, None) for q in range(D)]
        self.prefill, self.decode = [], []
        try:
            for pools in self.src:
                eng = PrefillEngine(pools, config(backend, **cfg))
                self.prefill.append(HeteroTPPrefill(eng, pools))
            for pools in self.dst:
                eng = DecodeEngine(pools, config(backend, **{**cfg, **(decode_cfg or {})}))
                self.decode.append(HeteroTPDecode(eng, pools))
        except BaseException:
            self.close()
            raise
        self.group = group_address([g.engine.bootstrap_address for g in self.prefill])

    def close(self) -> None:
        for g in self.decode + self.prefill:
            g.engine.close()


@pytest.fixture
def ranks(request, backend):
    P, D = request.param
    r = Ranks(backend, P, D)
    try:
        yield r
    finally:
        r.close()


@pytest.mark.parametrize("ranks", [(4, 2), (2, 4), (2, 1)], indirect=True,
                         ids=["4to2", "2to4", "2to1"])
def test_every_decode_rank_gets_exactly_its_heads_and_the_replicas(ranks) -> None:
    P, D = len(ranks.prefill), len(ranks.decode)
    rng = np.random.default_rng(3)
    canary = [{p: a.buf.clone() for p, a in pools.items()} for pools in ranks.dst]
    reqs = []
    pages = 3
    dst_pages = rng.permutation(ENTRIES["kv"])[: 3 * pages].reshape(3, pages)
    for i in range(3):
        src = {"kv": rng.choice(ENTRIES["kv"], pages, replace=False), "state": np.array([i])}
        dst = {"kv": dst_pages[i], "state": np.array([7 - i])}
        reqs.append((f"r{i}", src, dst))
        for g in ranks.decode:
            g.expect(f"r{i}", ranks.group, dst)
        for g in ranks.prefill:
            g.send(f"r{i}", src, decode_tp=D)
    for rid, src, _dst in reqs:
        for q, g in enumerate(ranks.decode):
            assert g.wait(rid, WAIT) is KVPoll.Success
            pairs = layout.contributing_ranks(P, D, q)
            assert g.sub_requests(rid) == [sub_request_id(rid, p, q) for p in pairs]
            # One segment per kv entry per rank pair, one for the replicated state entry.
            assert g.stats(rid).segments == len(pairs) * len(src["kv"]) + 1
        for g in ranks.prefill:
            assert g.wait(rid, WAIT) is KVPoll.Success
    for q, pools in enumerate(ranks.dst):
        touched = {"kv": np.concatenate([d["kv"] for _, _, d in reqs]),
                   "state": np.concatenate([d["state"] for _, _, d in reqs])}
        for pool, arena in pools.items():
            for f in FIELDS[pool]:
                want = ranks.values[pool][f.name]
                if f.tp_axis is not None:
                    lo, hi = arena.heads(f.name)
                    want = want.narrow(2 + f.tp_axis, lo, hi - lo)
                for _, src, dst in reqs:
                    assert torch.equal(arena.view(f.name)[:, dst[pool]], want[:, src[pool]])
            keep = np.setdiff1d(np.arange(arena.entries), touched[pool])
            for e in keep:  # entries no request named are untouched, byte for byte
                assert torch.equal(arena.entry(int(e)), canary[q][pool][
                    e * arena.slot_stride:e * arena.slot_stride + arena.entry_bytes])


def test_a_failing_rank_fails_the_request_on_its_siblings_and_nothing_lands_late(backend) -> None:
    r = Ranks(backend, 2, 1)
    try:
        before = {p: a.buf.clone() for p, a in r.dst[0].items()}
        dst = {"kv": np.array([5, 6]), "state": np.array([2])}
        r.decode[0].expect("x", r.group, dst)
        # Rank 1 dies after the handshake and before sending anything: a prefill that dies
        # before the decode ever reached it is redialled instead (test_first_contact.py).
        until(lambda: r.decode[0].engine.poll(sub_request_id("x", 1, 0)) is KVPoll.WaitingForInput,
              "the decode reached rank 1")
        r.prefill[1].engine.close()
        with pytest.raises(RequestFailed, match=r"x#tp1>0"):
            r.decode[0].wait("x", WAIT)
        assert r.decode[0].engine.poll(sub_request_id("x", 0, 0)) is KVPoll.Failed
        # The surviving rank's part was aborted: its late send moves nothing.
        r.prefill[0].send("x", {"kv": np.array([1, 2]), "state": np.array([0])}, decode_tp=1)
        with pytest.raises(RequestFailed):
            r.prefill[0].wait("x", WAIT)
        for pool, arena in r.dst[0].items():
            assert torch.equal(arena.buf, before[pool]), f"a late byte landed in {pool}"
        r.decode[0].release("x")
        with pytest.raises(RequestError, match="no request 'x'"):
            r.decode[0].poll("x")
    finally:
        r.close()


def test_abort_on_decode_fails_every_pair(backend) -> None:
    r = Ranks(backend, 4, 2)
    try:
        r.decode[0].expect("y", r.group, {"kv": np.array([3]), "state": np.array([1])})
        r.decode[0].abort("y", "client went away")
        with pytest.raises(RequestFailed, match="client went away"):
            r.decode[0].wait("y", WAIT)
        assert [r.decode[0].engine.poll(s) for s in r.decode[0].sub_requests("y")] == [
            KVPoll.Failed, KVPoll.Failed]
    finally:
        r.close()


def test_bad_groups_and_inputs_are_refused_before_anything_exists() -> None:
    mixed = {"kv": _pools(2, 0, None)["kv"], "state": _pools(4, 1, None)["state"]}
    with pytest.raises(ConfigError, match=r"disagree on \(TP size, rank\)"):
        HeteroTPDecode(None, mixed)
    g = HeteroTPDecode(None, _pools(2, 0, None))
    with pytest.raises(RequestError, match="no pool"):
        g.expect("z", "127.0.0.1:1", {"other": [0]})
    with pytest.raises(RequestError, match="rank order"):
        g.expect("z", "", {"kv": [0]})
    p = HeteroTPPrefill(None, _pools(2, 0, None))
    with pytest.raises(RequestError, match="decode_tp must be a positive int"):
        p.send("z", {"kv": [0]}, decode_tp=0)


def test_an_incompatible_split_is_refused_in_the_handshake_by_name(backend) -> None:
    """Another head dim on decode: the handshake names the pool, field and shapes."""
    src = _pools(2, 0, None)
    other = [layout.EntryField(f.name, f.layers, (4, HEADS, 16), f.dtype, tp_axis=1)
             for f in FIELDS["kv"]]
    dst = {"kv": layout.ShardMajorArena(other, 8, "cpu", tp=4, rank=1), "state": _pools(4, 1, None)["state"]}
    with PrefillEngine(src, config(backend)) as prefill, DecodeEngine(dst, config(backend)) as decode:
        decode.expect("m", prefill.bootstrap_address, {"kv": [0]})
        with pytest.raises(RequestFailed) as info:
            decode.wait("m", WAIT)
        assert isinstance(info.value.__cause__, LayoutMismatchError)
        assert "pool 'kv': field 'k' differs in shape: [4, 4, 8] vs [4, 4, 16]" in str(info.value)


def test_a_dead_decode_rank_fails_the_request_on_the_other_decode_rank(backend) -> None:
    """1 -> 2: the prefill rank serves both decode ranks; one dies mid-request."""
    # The surviving decode rank's own no-progress wait is long, so only the
    # prefill's push (its failed pair aborting the sibling) can end its request:
    # with equal timers the two race, and a loaded machine picks the timeout.
    r = Ranks(backend, 1, 2, decode_cfg={"request_timeout": 60.0})
    try:
        dst = {"kv": np.array([4, 5]), "state": np.array([3])}
        for g in r.decode:
            g.expect("w", r.group, dst)
        # A first chunk only: neither decode rank can reach Success before the failure.
        r.prefill[0].send("w", {"kv": np.array([1]), "state": np.array([0])}, decode_tp=2,
                          last=False)
        r.decode[0].engine.close()
        with pytest.raises(RequestFailed, match=r"w#tp0>0"):
            r.prefill[0].wait("w", WAIT)  # its failed pair aborted the pair to rank 1
        with pytest.raises(RequestFailed, match="a sibling rank pair failed"):
            r.decode[1].wait("w", WAIT)  # told by the prefill, not timed out
        assert r.prefill[0].engine.poll(sub_request_id("w", 0, 1)) is KVPoll.Failed
    finally:
        r.close()


def test_a_refused_expect_leaves_no_request_behind(backend) -> None:
    """#25 item 3: after a refused `expect`, poll/wait say unknown, never a phantom Success."""
    from pdxfer import LayoutError, UnknownRequestError
    from pdxfer.requests import MAX_ID_BYTES

    r = Ranks(backend, 2, 1)
    g = r.decode[0]
    long_id = "y" * (MAX_ID_BYTES - 3)  # fits; its sub-request ids ("...#tp0>0") do not
    try:
        for rid, indices, refusal, match in [
            ("x", {"kv": [ENTRIES["kv"]]}, LayoutError, r"pool 'kv' destination index 32"),
            (long_id, {"kv": [1]}, RequestError, "exceeds the 1024-byte limit"),
            ("z", {}, RequestError, "non-empty mapping"),
        ]:
            with pytest.raises(refusal, match=match):
                g.expect(rid, r.group, indices)
            with pytest.raises(UnknownRequestError):
                g.poll(rid)
            with pytest.raises(UnknownRequestError):
                g.wait(rid, 1.0)
            for sub in (f"{rid}#tp{p}>0" for p in range(2)):  # no sub-request exists
                assert len(sub) > MAX_ID_BYTES or g.engine.try_poll(sub) is None
        with pytest.raises(LayoutError, match=r"pool 'kv' source index 32"):
            r.prefill[0].send("x", {"kv": [ENTRIES["kv"]]}, decode_tp=1)
        with pytest.raises(UnknownRequestError):
            r.prefill[0].poll("x")
        # The id is free on both sides: the same request, asked properly, goes through.
        g.expect("x", r.group, {"kv": np.array([5]), "state": np.array([2])})
        for p in r.prefill:
            p.send("x", {"kv": np.array([1]), "state": np.array([0])}, decode_tp=1)
        assert g.wait("x", WAIT) is KVPoll.Success
    finally:
        r.close()


def test_a_sub_request_refused_by_its_engine_takes_its_siblings_with_it(backend) -> None:
    """A refusal only the engine can see (a duplicate id): the expected sibling is aborted."""
    from pdxfer import UnknownRequestError

    r = Ranks(backend, 2, 1)
    g = r.decode[0]
    try:
        g.engine.expect(sub_request_id("d", 1, 0), r.prefill[1].engine.bootstrap_address, {"kv": [1]})
        with pytest.raises(RequestError, match="duplicate request id"):
            g.expect("d", r.group, {"kv": [3]})
        with pytest.raises(UnknownRequestError):
            g.poll("d")
        with pytest.raises(RequestFailed, match="a sibling expect was refused"):
            g.engine.wait(sub_request_id("d", 0, 0), WAIT)
    finally:
        r.close()


class _Subs:
    """An engine stand-in whose sub-requests sit in whatever state a test sets."""

    def __init__(self) -> None:
        self.states: dict[str, KVPoll] = {}

    def check_prefill(self, addr: str) -> str:
        return addr

    def expect(self, sub: str, addr: str, indices) -> None:
        self.states[sub] = KVPoll.WaitingForInput

    def poll(self, sub: str) -> KVPoll:
        return self.states[sub]

    def abort(self, sub: str, reason: str) -> None:
        if not self.states[sub].finished and self.states[sub] is not KVPoll.Quarantined:
            self.states[sub] = KVPoll.Failed

    def failure_reason(self, sub: str) -> str | None:
        return "quarantined" if self.states[sub] in (KVPoll.Failed, KVPoll.Quarantined) else None

    def wait(self, sub: str, timeout: float) -> KVPoll:
        raise TransferTimeout("still running")


def test_the_group_is_never_success_while_a_sub_request_is_quarantined() -> None:
    """Quarantined (5) sorts above Success (4): the least state must not be read as the group's."""
    engine = _Subs()
    g = HeteroTPDecode(engine, _pools(1, 0, None))
    g.expect("q", ["127.0.0.1:1", "127.0.0.1:2"], {"kv": [1]})
    a, b = g.sub_requests("q")
    engine.states[a], engine.states[b] = KVPoll.Success, KVPoll.Quarantined
    assert g.poll("q") is KVPoll.Quarantined
    with pytest.raises(TransferTimeout):
        g.wait("q", 0.2)
    engine.states[b] = KVPoll.Failed  # the quarantine ended
    assert g.poll("q") is KVPoll.Failed
