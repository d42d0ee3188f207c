"""Streamed sends (`PrefillEngine.send(layers=(a, b))`, #33) over real engines on every backend.

The prediction of what the decode holds is computed apart from the planner:
the decode's pools are built twice from one seed, and the twin receives each
move through the arenas' per-layer views (`view(name)[layer, entry]`); then
every byte of every buffer of the real decode must equal the twin's, so a
layer that landed early, a byte outside the named entries or their padding,
or a layer range that spilled into the next layer breaks the equality.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pdxfer_procs import Prefill, warm_up
from pdxfer_testkit import (
    BIG_KV_FIELDS,
    KV_FIELDS,
    STATE_FIELDS,
    build_pools,
    config,
    fill,
    poll_or_none,
    until,
)

from pdxfer import (
    DecodeEngine,
    KVPoll,
    LayoutError,
    PrefillEngine,
    RequestError,
    RequestFailed,
    layout,
)

WAIT = 20.0
# Four layers of K, V and a per-page scale (the FP8 case: scales travel with their pages).
DEEP = [layout.EntryField("k", 4, (2, 16), torch.float16),
        layout.EntryField("v", 4, (2, 16), torch.float16),
        layout.EntryField("k_scale", 4, (2,), torch.float32)]


def pools_of(kind: str, entries: int, seed: int) -> dict:
    """kv (4 layers, the kind under test) and state (2 layers, entry-major), seeded."""
    if kind == "per_layer":
        gen = torch.Generator().manual_seed(seed)
        kv = layout.PerLayerArena({f.name: [torch.zeros(entries, *f.shape, dtype=f.dtype)
                                            for _ in range(f.layers)] for f in DEEP})
        for f in DEEP:
            for layer in range(f.layers):
                raw = kv.view(f.name, layer).view(torch.uint8)
                raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
        state = layout.EntryMajorArena(STATE_FIELDS, 16, "cpu")
        fill({"state": state}, seed + 100)
        return {"kv": kv, "state": state}
    return build_pools(entries, 16, kind=kind, seed=seed, kv_fields=DEEP)


def layer_view(arena, name: str, layer: int) -> torch.Tensor:
    """`[entries, *shape]` of one layer of one field, whatever the arena kind."""
    if isinstance(arena, layout.PerLayerArena):
        return arena.view(name, layer)
    return arena.view(name)[layer]


def move(twin: dict, src: dict, pool: str, s, d, layers: tuple[int, int] | None = None) -> None:
    """What landing layers `layers` (all: None) of entries `s` into `d` does, through the views."""
    si, di = torch.as_tensor(np.asarray(s)), torch.as_tensor(np.asarray(d))
    for f in twin[pool].fields:
        lo, hi = layers or (0, f.layers)
        for layer in range(lo, min(hi, f.layers)):
            layer_view(twin[pool], f.name, layer)[di] = layer_view(src[pool], f.name, layer)[si]


def same(pools: dict, twin: dict) -> bool:
    return all(torch.equal(a, b) for name in pools for a, b in zip(
        layout.arena_buffers(pools[name]), layout.arena_buffers(twin[name]), strict=True))


def first_difference(pools: dict, twin: dict) -> str:
    for name in pools:
        for i, (a, b) in enumerate(zip(layout.arena_buffers(pools[name]),
                                       layout.arena_buffers(twin[name]), strict=True)):
            if not torch.equal(a, b):
                at = int(torch.nonzero(a != b)[0])
                return f"pool {name!r} buffer {i}: {int((a != b).sum())} bytes differ, first at {at}"
    return "none"


class Pair:
    def __init__(self, backend: str, kind: str = "interleaved") -> None:
        self.src = pools_of(kind, 64, seed=1)
        self.dst, self.twin = pools_of(kind, 128, seed=2), pools_of(kind, 128, seed=2)
        self.prefill = PrefillEngine(self.src, config(backend, timeout=WAIT))
        self.decode = DecodeEngine(self.dst, config(backend, timeout=WAIT))

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()

    def check(self) -> None:
        assert same(self.dst, self.twin), first_difference(self.dst, self.twin)


@pytest.fixture
def streamed(backend):
    pair = Pair(backend)
    yield pair
    pair.close()


def test_streamed_layer_groups_land_the_same_bytes_as_whole_entries_and_succeed_only_at_the_last(
        streamed) -> None:
    """Two spans — kv pages in three layer groups, then more pages with the state in two —
    against the twin after every group; Success comes with the last group and not before."""
    pair = streamed
    p, d = pair.prefill, pair.decode
    a_src, a_dst = np.array([3, 4, 5, 9]), np.array([10, 11, 12, 40])
    b_src, b_dst = np.array([20, 21]), np.array([50, 51])
    d.expect("r", p.bootstrap_address, {"kv": np.concatenate([a_dst, b_dst]), "state": [7]})
    for layers in [(0, 1), (1, 3)]:
        p.send("r", {"kv": a_src}, layers=layers, last=False)
        move(pair.twin, pair.src, "kv", a_src, a_dst, layers)
        until(lambda: same(pair.dst, pair.twin), f"layers {layers} landed")
        # The bytes land before their notify is handled: wait for the state, which must be
        # Transferring (Success is final, so reaching this proves it did not come early).
        until(lambda: d.poll("r") is KVPoll.Transferring, f"layers {layers} noted")
    p.send("r", {"kv": a_src}, layers=(3, 4), last=False)
    move(pair.twin, pair.src, "kv", a_src, a_dst, (3, 4))
    until(lambda: same(pair.dst, pair.twin), "the first span's last layer landed")
    p.send("r", {"kv": b_src, "state": [2]}, layers=(0, 2))  # state has 2 layers: all of it now
    move(pair.twin, pair.src, "kv", b_src, b_dst, (0, 2))
    move(pair.twin, pair.src, "state", [2], [7])
    until(lambda: same(pair.dst, pair.twin), "the second span's first group landed")
    assert d.poll("r") is KVPoll.Transferring, "Success before the last layer range"
    assert p.poll("r") is KVPoll.Transferring
    p.send("r", {"kv": b_src, "state": [2]}, layers=(2, 4))
    move(pair.twin, pair.src, "kv", b_src, b_dst, (2, 4))
    d.wait("r", WAIT)
    p.wait("r", WAIT)
    pair.check()
    # The same request whole lands the same bytes: a second decode range, one send.
    d.expect("w", p.bootstrap_address, {"kv": [60, 61, 62, 63, 64, 65], "state": [8]})
    p.send("w", {"kv": np.concatenate([a_src, b_src]), "state": [2]})
    move(pair.twin, pair.src, "kv", np.concatenate([a_src, b_src]), [60, 61, 62, 63, 64, 65])
    move(pair.twin, pair.src, "state", [2], [8])
    d.wait("w", WAIT)
    pair.check()
    stats = p.stats("r")
    assert stats.transfers >= 5  # one transfer per pool per group at least


@pytest.mark.parametrize("kind", ["per_layer", "layer", "entry"])
def test_streamed_groups_over_other_pool_orders(kind) -> None:
    """Per-layer pools (one run per layer tensor), layer-major and entry-major pools stream too."""
    for backend in ("loopback", "tcp"):
        pair = Pair(backend, kind)
        try:
            src, dst = np.array([1, 2, 3, 8]), np.array([5, 6, 7, 30])
            pair.decode.expect("r", pair.prefill.bootstrap_address, {"kv": dst})
            for layers in [(0, 2), (2, 3), (3, 4)]:
                pair.prefill.send("r", {"kv": src}, layers=layers)
                move(pair.twin, pair.src, "kv", src, dst, layers)
            pair.decode.wait("r", WAIT)
            pair.check()
        finally:
            pair.close()


def test_a_streamed_request_is_queued_before_the_expect_and_chunks_compose(streamed) -> None:
    """Ranges sent before the decode expects the request queue in order; chunked spans compose."""
    pair = streamed
    p, d = pair.prefill, pair.decode
    p.send("q", {"kv": [1, 2]}, layers=(0, 2), last=False)
    p.send("q", {"kv": [1, 2]}, layers=(2, 4), last=False)
    p.send("q", {"kv": [5]}, last=False)  # a whole-entry chunk between spans
    p.send("q", {"kv": [6], "state": [1]}, layers=(0, 3))
    p.send("q", {"kv": [6], "state": [1]}, layers=(3, 4))
    d.expect("q", p.bootstrap_address, {"kv": [90, 91, 92, 93], "state": [3]})
    move(pair.twin, pair.src, "kv", [1, 2, 5, 6], [90, 91, 92, 93])
    move(pair.twin, pair.src, "state", [1], [3])
    d.wait("q", WAIT)
    p.wait("q", WAIT)
    pair.check()


def test_bad_layer_ranges_are_refused_by_name_before_anything_moves(streamed) -> None:
    pair = streamed
    p, d = pair.prefill, pair.decode
    for bad in [(0, 0), (0, 5), (-1, 2), (1.0, 2), (True, 2), "ab"]:
        with pytest.raises(RequestError, match=r"layers must be a pair \(a, b\) of ints with "
                                               r"0 <= a < b <= 4"):
            p.send("x", {"kv": [1]}, layers=bad)
    with pytest.raises(RequestError, match=r"start a new set of entries, which streams from "
                                           r"layer 0; send layers \(0, 2\)"):
        p.send("x", {"kv": [1]}, layers=(2, 4))
    assert poll_or_none(p, "x") is None, "a refused first send left a record"
    d.expect("x", p.bootstrap_address, {"kv": [1, 2]})
    p.send("x", {"kv": [1]}, layers=(0, 2), last=False)
    with pytest.raises(RequestError, match=r"do not continue its streamed entries: layers "
                                           r"\[0, 2\) are sent; send layers \(2, b\) next"):
        p.send("x", {"kv": [1]}, layers=(3, 4), last=False)
    with pytest.raises(RequestError, match="name other entries than the ranges before them"):
        p.send("x", {"kv": [2]}, layers=(2, 4), last=False)
    with pytest.raises(RequestError, match="every range of a set of entries says the same"):
        p.send("x", {"kv": [1]}, layers=(2, 4), last=True)
    with pytest.raises(RequestError, match=r"layers \[0, 2\) of its streamed entries are sent and "
                                           r"layers \[2, 4\) are not"):
        p.send("x", {"kv": [3]}, last=True)
    # every refusal left the stream as it was: it finishes as sent, byte for byte
    p.send("x", {"kv": [1]}, layers=(2, 4), last=False)
    p.send("x", {"kv": [4]})
    move(pair.twin, pair.src, "kv", [1, 4], [1, 2])
    d.wait("x", WAIT)
    pair.check()


def test_a_page_major_pool_refuses_a_layer_range_by_name() -> None:
    pm = layout.PageMajorMHAArena(2, 1, 4, 4, torch.float16, 2, 8, "cpu")
    deep = layout.LayerInterleavedArena(DEEP, 8, "cpu")
    prefill = PrefillEngine({"kv": pm, "deep": deep}, config("loopback"))
    try:
        with pytest.raises(LayoutError, match=r"pool 'kv' cannot ship layers \(0, 1\).*declares "
                                              "each layer as a field of its own"):
            prefill.send("p", {"kv": [1], "deep": [1]}, layers=(0, 2))
        assert poll_or_none(prefill, "p") is None
    finally:
        prefill.close()


def test_an_abort_mid_stream_lands_no_byte_after_failed(streamed) -> None:
    """The decode aborts after the first group landed while the prefill keeps streaming:
    whatever landed by Failed stays, nothing lands after it, nothing outside the entries."""
    pair = streamed
    p, d = pair.prefill, pair.decode
    src, dst = np.arange(8, 40), np.arange(64, 96)
    d.expect("a", p.bootstrap_address, {"kv": dst})
    p.send("a", {"kv": src}, layers=(0, 1))
    move(pair.twin, pair.src, "kv", src, dst, (0, 1))
    until(lambda: same(pair.dst, pair.twin), "the first group landed")
    d.abort("a", "the scheduler preempted it")
    for layers in [(1, 2), (2, 3), (3, 4)]:
        p.send("a", {"kv": src}, layers=layers)  # ignored once the prefill heard: no error
    with pytest.raises(RequestFailed):
        d.wait("a", WAIT)
    at_failed = [b.clone() for b in layout.arena_buffers(pair.dst["kv"])]
    with pytest.raises(RequestFailed):
        p.wait("a", WAIT)
    pair.prefill.close()  # every transfer of it ended: nothing may have changed since Failed
    assert all(torch.equal(a, b) for a, b in zip(at_failed, layout.arena_buffers(pair.dst["kv"]),
                                                 strict=True)), "a byte landed after Failed"
    # Outside the request's entries, and in every layer no group of it reached, the canaries hold:
    # the twin gets every layer any group may have carried, the rest must equal it.
    for layers in [(1, 2), (2, 3), (3, 4)]:
        for f in pair.twin["kv"].fields:
            for layer in range(*layers):
                got = layer_view(pair.dst["kv"], f.name, layer)[torch.as_tensor(dst)]
                layer_view(pair.twin["kv"], f.name, layer)[torch.as_tensor(dst)] = got
    pair.check()


def test_a_prefill_killed_mid_stream_fails_the_request_with_no_late_byte(cross_backend) -> None:
    """SIGKILL the prefill process between layer groups: Failed (never Success), the layers
    no group reached keep their canaries, nothing changes after Failed."""
    dst_pools = build_pools(64, 16, kind="interleaved", seed=2, kv_fields=BIG_KV_FIELDS)
    canary = [b.clone() for b in layout.arena_buffers(dst_pools["kv"])]
    decode = DecodeEngine(dst_pools, config(cross_backend, timeout=WAIT))
    prefill = Prefill(cross_backend, 0, WAIT, "--kind", "interleaved", "--entries", "64")
    try:
        warm_up(decode, prefill, lambda k: 63 - k, 0, WAIT)
        src, dst = list(range(1, 17)), list(range(20, 36))
        decode.expect("k", prefill.address, {"kv": dst})
        prefill.stream("k", src, (0, 2))
        kv = dst_pools["kv"]
        d = torch.as_tensor(dst)
        until(lambda: not torch.equal(bits(kv.view("k")[0, d]), bits(canary_view(canary, kv)[0, d])),
              "the first group landed")
        # Its bytes land before its notify is handled: wait for the state the notify sets.
        until(lambda: decode.poll("k") is KVPoll.Transferring, "the first group noted")
        prefill.kill()
        with pytest.raises(RequestFailed):
            decode.wait("k", WAIT)
        at_failed = [b.clone() for b in layout.arena_buffers(kv)]
        decode.close()
        assert all(torch.equal(a, b) for a, b in zip(at_failed, layout.arena_buffers(kv),
                                                     strict=True)), "a byte landed after Failed"
        for name in ("k", "v"):  # layers 2, 3 were never sent: their canaries hold
            assert torch.equal(bits(kv.view(name)[2:, d]), bits(canary_view(canary, kv, name)[2:, d]))
    finally:
        prefill.stop()
        decode.close()


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a half tensor: random bytes hold NaNs, which never compare equal."""
    return t.contiguous().view(torch.int16)


def canary_view(canary: list[torch.Tensor], arena, name: str = "k") -> torch.Tensor:
    """`arena.view(name)` over the canary copy of its buffer."""
    twin = layout.LayerInterleavedArena(arena.fields, arena.entries, "cpu", buf=canary[0].clone(),
                                        slot_stride=arena.slot_stride)
    return twin.view(name)


def test_an_interleaved_decode_refuses_an_entry_major_prefill_by_name() -> None:
    """Mixed orderings across a handshake: refused before any write, the kind named."""
    prefill = PrefillEngine(build_pools(8, 4, kind="entry", kv_fields=KV_FIELDS), config("loopback"))
    decode = DecodeEngine(build_pools(8, 4, kind="interleaved", kv_fields=KV_FIELDS),
                          config("loopback"))
    try:
        decode.expect("m", prefill.bootstrap_address, {"kv": [1]})
        with pytest.raises(RequestFailed, match="kind differs: entry_major vs layer_interleaved"):
            decode.wait("m", WAIT)
    finally:
        decode.close()
        prefill.close()
