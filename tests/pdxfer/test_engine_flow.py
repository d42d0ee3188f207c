"""Requests that succeed: many at once, chunked, checkpointed, many-to-many, every byte checked."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from pdxfer.transport.errors import RegistrationError
from pdxfer_testkit import (
    STATE_FIELDS,
    assert_buffers,
    build_pools,
    config,
    entries_crc,
    expected_after,
    fill,
    runs,
    snapshot,
)

from pdxfer import DecodeEngine, KVPoll, PrefillEngine, RequestStats, layout, transport

WAIT = 20.0
# Every request here succeeds, so the liveness bound plays no part but can only fail a run
# whose progress loops a busy host starved for 2 s (verbs-sim's 240 requests did once):
# the fault tests keep the short one.
FLOW = {"timeout": 10.0}
pytestmark = pytest.mark.engine_config(**FLOW)


def _plan_requests(n: int, pages: int, src_kv: int, src_state: int, dst_kv: int,
                   dst_state: int, seed: int) -> list[tuple[str, dict, dict]]:
    """n requests: distinct destinations across all of them, random (repeating) sources."""
    rng = np.random.default_rng(seed)
    kv_dst = rng.permutation(dst_kv)[: n * pages].reshape(n, pages)
    st_dst = rng.permutation(dst_state)[:n]
    out = []
    for i in range(n):
        # Half the requests get consecutive pages on both sides: those must merge into one run.
        if i % 2:
            start = int(rng.integers(0, src_kv - pages))
            src_kv_idx = np.arange(start, start + pages)
        else:
            src_kv_idx = rng.choice(src_kv, pages, replace=False)
        src = {"kv": src_kv_idx, "state": np.array([int(rng.integers(0, src_state))])}
        dst = {"kv": kv_dst[i], "state": st_dst[i:i + 1]}
        out.append((f"req-{i}", src, dst))
    return out


def test_many_concurrent_requests_every_byte_lands(pair) -> None:
    prefill, decode, src, dst = pair
    before = snapshot(dst)
    reqs = _plan_requests(240, 4, 512, 64, 1024, 256, seed=7)
    # Prefill sends from two threads while decode expects from this one, so
    # both orders happen: send before expect (queued) and expect before send.
    order = list(reqs)
    sent = threading.Barrier(3)

    def sender(part: list) -> None:
        sent.wait()
        for rid, s, _ in part:
            prefill.send(rid, s)

    threads = [threading.Thread(target=sender, args=(order[k::2],)) for k in range(2)]
    for t in threads:
        t.start()
    sent.wait()
    for rid, _, d in reqs:
        decode.expect(rid, prefill.bootstrap_address, d)
    for t in threads:
        t.join(WAIT)
    for rid, s, d in reqs:
        assert decode.wait(rid, WAIT) is KVPoll.Success
        assert prefill.wait(rid, WAIT) is KVPoll.Success
        stats = decode.stats(rid)
        assert isinstance(stats, RequestStats) and stats.transfers == 2  # one per pool
        assert stats.elapsed_s > 0
        assert stats.segments == runs(s["kv"], d["kv"]) + 1  # one run per kv run, one state entry
        assert stats.nbytes == 4 * src["kv"].entry_bytes + src["state"].entry_bytes
        p = prefill.stats(rid)
        assert (p.nbytes, p.segments, p.transfers) == (stats.nbytes, stats.segments, stats.transfers)
        for pool in ("kv", "state"):  # per request: the bytes that left are the bytes that landed
            assert entries_crc(dst, pool, d[pool]) == entries_crc(src, pool, s[pool]), (rid, pool)
    moves = [(pool, s[pool], d[pool]) for _, s, d in reqs for pool in ("kv", "state")]
    assert_buffers(dst, expected_after(dst, before, src, moves))


def test_consecutive_pages_ship_as_one_segment(pair) -> None:
    prefill, decode, src, dst = pair
    decode.expect("run", prefill.bootstrap_address, {"kv": np.arange(100, 116), "state": [9]})
    prefill.send("run", {"kv": np.arange(16, 32), "state": [3]})
    assert decode.wait("run", WAIT) is KVPoll.Success
    stats = decode.stats("run")
    assert (stats.segments, stats.transfers) == (2, 2)
    assert stats.nbytes == 16 * src["kv"].entry_bytes + src["state"].entry_bytes


def test_chunked_prefill_maps_chunks_onto_the_destination_list(pair) -> None:
    prefill, decode, src, dst = pair
    before = snapshot(dst)
    dst_kv = np.array([900, 901, 902, 40, 41, 7, 8, 9, 10, 500])
    # First chunk goes out before the decode even expects the request.
    prefill.send("chunky", {"kv": [1, 2, 3]}, last=False)
    decode.expect("chunky", prefill.bootstrap_address, {"kv": dst_kv, "state": [77]})
    prefill.send("chunky", {"kv": [4, 5]}, last=False)
    assert not decode.poll("chunky").finished  # the last chunk has not been sent
    prefill.send("chunky", {"kv": [10, 11, 12, 13, 14], "state": [5]}, last=True)
    assert decode.wait("chunky", WAIT) is KVPoll.Success
    assert prefill.wait("chunky", WAIT) is KVPoll.Success
    src_kv = np.array([1, 2, 3, 4, 5, 10, 11, 12, 13, 14])
    moves = [("kv", src_kv, dst_kv), ("state", np.array([5]), np.array([77]))]
    assert_buffers(dst, expected_after(dst, before, src, moves))
    assert decode.stats("chunky").transfers == 4  # chunks 1 and 2: kv only; chunk 3: kv + state


def test_chunk_that_overruns_the_destination_is_refused_before_posting(pair) -> None:
    prefill, decode, src, dst = pair
    decode.expect("over", prefill.bootstrap_address, {"kv": [1, 2], "state": [3]})
    prefill.send("warm", {"kv": [0]}, last=False)  # unrelated: just lets the Expect arrive
    _wait_state(prefill, "over")
    with pytest.raises(Exception, match="chunk sends 3 entries but decode expects only 2 more"):
        prefill.send("over", {"kv": [4, 5, 6]}, last=False)
    with pytest.raises(Exception, match="leaves pool 'state' with 1 of 1 destination entries unfilled"):
        prefill.send("over", {"kv": [4, 5]}, last=True)
    prefill.send("over", {"kv": [4, 5], "state": [0]})
    assert decode.wait("over", WAIT) is KVPoll.Success


def _wait_state(prefill, rid: str) -> None:
    """Until the prefill has heard the decode's Expect for `rid`."""
    import time

    until = time.monotonic() + WAIT
    while time.monotonic() < until:
        try:
            if prefill.poll(rid) is KVPoll.WaitingForInput:
                return
        except Exception:
            pass
        time.sleep(0.002)
    raise AssertionError(f"prefill never heard of {rid!r}")


def test_checkpoint_send_ships_only_checkpoint_ranges(pair) -> None:
    prefill, decode, src, dst = pair
    before = snapshot(dst)
    decode.expect("ckpt", prefill.bootstrap_address, {"state": [200]})
    prefill.send("ckpt", {"state": [11]}, checkpoint=True)
    assert decode.wait("ckpt", WAIT) is KVPoll.Success
    moves = [("state", np.array([11]), np.array([200]))]
    assert_buffers(dst, expected_after(dst, before, src, moves, checkpoint=True))
    # The ring (in_checkpoint=False) kept the decode's own bytes; the ssm state took the source's.
    def raw(pools: dict, name: str, entry: int) -> torch.Tensor:
        return pools["state"].view(name)[:, entry].contiguous().view(torch.uint8)

    assert not torch.equal(raw(dst, "ring", 200), raw(src, "ring", 11))
    assert torch.equal(raw(dst, "ssm", 200), raw(src, "ssm", 11))


@pytest.mark.parametrize("kind", ["layer", "split"])
def test_other_arena_kinds(backend, kind) -> None:
    if kind == "layer":
        src, dst = build_pools(64, 16, kind="layer", seed=3), build_pools(128, 16, kind="layer", seed=4)
    else:
        src, dst = _split_pools(3), _split_pools(4)
    before = snapshot(dst)
    with PrefillEngine(src, config(backend, **FLOW)) as prefill, DecodeEngine(dst, config(backend, **FLOW)) as decode:
        moves = []
        for i in range(6):
            s = {"kv": np.arange(4 * i, 4 * i + 4), "state": [i]}
            d = {"kv": np.arange(40 - 4 * i, 44 - 4 * i), "state": [15 - i]}
            decode.expect(f"r{i}", prefill.bootstrap_address, d)
            prefill.send(f"r{i}", s)
            moves += [(p, np.asarray(s[p]), np.asarray(d[p])) for p in s]
        for i in range(6):
            assert decode.wait(f"r{i}", WAIT) is KVPoll.Success
        if kind == "layer":  # one segment per field x layer x run: the baseline layout
            assert decode.stats("r0").segments == 3 * 2 + 1
        assert_buffers(dst, expected_after(dst, before, src, moves))


def _split_pools(seed: int) -> dict:
    planes, _rows = layout.plan_field_planes(STATE_FIELDS, [1024, 256])
    state = layout.SplitEntryMajorArena([layout.EntryMajorArena(f, 16, "cpu") for f in planes])
    pools = {"kv": layout.EntryMajorArena(build_pools(1, 1)["kv"].fields, 64, "cpu"), "state": state}
    fill(pools, seed)
    return pools


def test_many_to_many(backend) -> None:
    prefills = [PrefillEngine(build_pools(64, 16, seed=10 + i), config(backend, **FLOW)) for i in range(2)]
    dst_pools = [build_pools(256, 64, seed=20 + j) for j in range(2)]
    decodes = [DecodeEngine(p, config(backend, **FLOW)) for p in dst_pools]
    try:
        befores = [snapshot(p) for p in dst_pools]
        moves: list[list] = [[], []]
        for j, decode in enumerate(decodes):
            for i, prefill in enumerate(prefills):
                for k in range(10):
                    rid = f"d{j}-p{i}-{k}"
                    slot = i * 10 + k
                    d = {"kv": np.arange(4 * slot, 4 * slot + 4), "state": [slot]}
                    s = {"kv": [k, k + 20, k + 40], "state": [k]}
                    s["kv"].append(k + 3)
                    decode.expect(rid, prefill.bootstrap_address, d)
                    prefill.send(rid, s)
                    src_arena = prefills[i]._pools.arenas  # source pools, for the prediction
                    moves[j].append((src_arena, s, d))
        for j, decode in enumerate(decodes):
            for i in range(2):
                for k in range(10):
                    assert decode.wait(f"d{j}-p{i}-{k}", WAIT) is KVPoll.Success
        for j in range(2):
            expected = befores[j]
            for src_pools, s, d in moves[j]:
                expected = expected_after(dst_pools[j], expected, src_pools,
                                          [(p, np.asarray(s[p]), np.asarray(d[p])) for p in s])
            assert_buffers(dst_pools[j], expected)
    finally:
        for e in decodes + prefills:
            e.close()


def test_pools_carved_from_one_allocation_register_once(backend) -> None:
    kv_bytes = layout.entry_bytes_for(build_pools(1, 1)["kv"].fields) * 64
    st_bytes = layout.entry_bytes_for(STATE_FIELDS) * 16

    total = layout.plan_regions([kv_bytes, st_bytes])[1]

    def carved(seed: int) -> dict:
        raw = torch.zeros(total + 4096, dtype=torch.uint8)  # a tail no pool owns
        kv_buf, st_buf = layout.carve(raw, [kv_bytes, st_bytes])
        pools = {"kv": layout.EntryMajorArena(build_pools(1, 1)["kv"].fields, 64, "cpu", buf=kv_buf),
                 "state": layout.EntryMajorArena(STATE_FIELDS, 16, "cpu", buf=st_buf)}
        fill(pools, seed)
        return pools

    src, dst = carved(5), carved(6)
    before = snapshot(dst)
    with PrefillEngine(src, config(backend, **FLOW)) as prefill, DecodeEngine(dst, config(backend, **FLOW)) as decode:
        assert prefill.regions == 1 and decode.regions == 1
        # One registration spanning both pools, and not the tail of the allocation.
        assert decode._pools.regions[0].length == total
        decode.expect("c", prefill.bootstrap_address, {"kv": [60, 61, 62], "state": [15]})
        prefill.send("c", {"kv": [0, 1, 2], "state": [2]})
        assert decode.wait("c", WAIT) is KVPoll.Success
        assert decode.stats("c").segments == 2
    assert_buffers(dst, expected_after(dst, before, src, [("kv", [0, 1, 2], [60, 61, 62]),
                                                         ("state", [2], [15])]))


def test_pools_sharing_one_plane_register_once_where_naive_registration_is_refused(backend) -> None:
    """A unified plane: state at the front of each slot, pages in the rest; the boundary moves."""
    kv_fields = build_pools(1, 1)["kv"].fields
    slot = layout.entry_bytes_for(STATE_FIELDS) + layout.entry_bytes_for(kv_fields)

    state_bytes = layout.entry_bytes_for(STATE_FIELDS)

    def unified(seed: int | None, plane: torch.Tensor | None = None) -> dict:
        plane = torch.zeros(32 * slot, dtype=torch.uint8) if plane is None else plane
        pools = {
            "state": layout.EntryMajorArena(STATE_FIELDS, 32, "cpu", buf=plane, slot_stride=slot),
            "kv": layout.EntryMajorArena(kv_fields, 32, "cpu", buf=plane[state_bytes:], slot_stride=slot),
        }
        if seed is not None:
            fill(pools, seed)
        return pools

    naive = transport.create(backend)
    try:
        pools = unified(0)
        naive.register(pools["state"].buf)
        with pytest.raises(RegistrationError, match="overlaps registered|already registered"):
            naive.register(pools["kv"].buf)
    finally:
        naive.close()
    src, dst = unified(7), unified(8)
    # The prediction: both pools' moves applied through views over ONE copy of the plane.
    plane = torch.zeros_like(dst["state"].buf)
    want = unified(None, plane)
    plane.copy_(dst["state"].buf)
    with PrefillEngine(src, config(backend, **FLOW)) as prefill, DecodeEngine(dst, config(backend, **FLOW)) as decode:
        assert prefill.regions == 1 and decode.regions == 1
        decode.expect("u", prefill.bootstrap_address, {"kv": [20, 21], "state": [20]})
        prefill.send("u", {"kv": [3, 4], "state": [3]})
        assert decode.wait("u", WAIT) is KVPoll.Success
        # Pages a slot apart are not contiguous (the state sits between them): 2 + 1 segments.
        assert decode.stats("u").segments == 3
    for pool, s_idx, d_idx in (("kv", [3, 4], [20, 21]), ("state", [3], [20])):
        for field in want[pool].fields:
            want[pool].view(field.name)[:, d_idx] = src[pool].view(field.name)[:, s_idx]
    assert torch.equal(dst["state"].buf, plane)


def test_one_control_link_per_peer_is_cached_and_reused(pair) -> None:
    prefill, decode, src, dst = pair
    links = set()
    for i in range(3):
        decode.expect(f"s{i}", prefill.bootstrap_address, {"kv": [i]})
        prefill.send(f"s{i}", {"kv": [i]})
        assert decode.wait(f"s{i}", WAIT) is KVPoll.Success
        links |= {id(s.link) for s in decode._sessions.values()}
    assert len(links) == 1 and len(prefill._links) == 1
