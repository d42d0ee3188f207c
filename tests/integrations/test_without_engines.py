"""The integrations import, and their pure parts work, where neither SGLang nor vLLM is installed.

The SGLang sender/receiver run here over real pdxfer engines (loopback) behind a
stand-in for the manager, so their request logic (last-chunk rule, refusals,
the safe poll, release once finished) is checked in `make test`; SGLang's own
queues drive them in `make test-sglang`.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pdxfer import DecodeEngine, EngineConfig, KVPoll, PrefillEngine, RequestFailed, layout
from pdxfer.integrations import sglang as sg
from pdxfer.integrations import vllm as vl

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(e) for e in ("sglang", "vllm")),
    reason="an engine is installed here; tests/engines/ covers the classes with it")


def test_constructing_or_registering_without_the_engine_says_what_to_install(caplog) -> None:
    with pytest.raises(ImportError, match=r"pdxfer's SGLang backend needs SGLang installed \(pip install sglang\)"):
        sg.register()
    with pytest.raises(ImportError, match=r"needs SGLang installed"):
        sg.PdxferKVManager(None, "prefill", None)
    vl.register()  # vLLM calls plugins unguarded: this one only warns (#31)
    assert "pdxfer's vLLM connector needs vLLM installed (pip install 'vllm==0.33.*')" in caplog.text
    with pytest.raises(ImportError, match=r"needs vLLM installed"):
        vl.PdxferConnector(None, None, None)


# -- vLLM's caches viewed block by block --------------------------------------------
def test_block_views_split_kv_first_tensors_and_keep_block_first_ones() -> None:
    kv_first = torch.zeros(2, 8, 16, 2, 4)
    (k, v) = vl.block_views(kv_first, 8)
    assert (k.data_ptr(), v.data_ptr()) == (kv_first[0].data_ptr(), kv_first[1].data_ptr())
    block_first = torch.zeros(8, 2, 16, 2, 4)
    assert vl.block_views(block_first, 8)[0] is block_first
    with pytest.raises(vl.ConfigError, match=r"shape \[3, 5\] has no block dimension of 8 blocks"):
        vl.block_views(torch.zeros(3, 5), 8)


def test_mamba_states_sharing_a_page_are_taken_as_that_page_once() -> None:
    page = 512  # bytes per block, as the hybrid allocator pads every group's page
    raw = torch.arange(8 * page, dtype=torch.int32).view(torch.uint8)[: 8 * page]
    halfs = raw.view(torch.float16)
    conv = torch.as_strided(halfs, (8, 4, 3), (page // 2, 3, 1))
    ssm = torch.as_strided(halfs, (8, 2, 8), (page // 2, 8, 1), 12)
    (view,) = vl.block_views([conv, ssm], 8)
    assert view.shape == (8, page) and view.data_ptr() == raw.data_ptr()
    assert torch.equal(view[3], raw[3 * page:4 * page])
    too_wide = torch.as_strided(halfs, (8, 300), (page // 2, 1))
    with pytest.raises(vl.ConfigError, match=r"do not share one page of 512 B per block"):
        vl.block_views([too_wide], 8)


def test_group_pools_make_one_pool_per_group_with_fields_by_shape() -> None:
    caches = {"a.0": torch.zeros(2, 8, 16, 2, 4), "a.1": torch.zeros(2, 8, 16, 2, 4),
              "m.2": [torch.zeros(8, 4, 3), torch.zeros(8, 2, 8)]}
    pools = vl.group_pools(caches, [["a.0", "a.1"], ["m.2"]], 8)
    assert sorted(pools) == ["g0", "g1"]
    assert [(f.name, f.layers) for f in pools["g0"].fields] == [("f0", 4)]
    assert [(f.name, f.layers, f.shape) for f in pools["g1"].fields] == [
        ("f0", 1, (1, 4, 3)), ("f1", 1, (1, 2, 8))]
    assert all(p.entries == 8 for p in pools.values())


# -- SGLang's sender and receiver over real engines --------------------------------
@pytest.fixture
def managers():
    kv: list[torch.Tensor] = []  # each engine's K/V tensor, in the order made

    def pools():
        kv.append(torch.zeros(64, 16, dtype=torch.uint8))
        return {"kv": layout.PerLayerArena({"kv": [kv[-1]]}, entry_rows=4),
                "aux": layout.PerLayerArena({"aux": [torch.zeros(8, 8, dtype=torch.int64)]})}

    cfg = EngineConfig(transport="loopback", timeout=2.0)
    # two prefill TP ranks (an MLA replica group for a decode at TP 1), one decode
    pre, pre1, dec = PrefillEngine(pools(), cfg), PrefillEngine(pools(), cfg), DecodeEngine(pools(), cfg)
    indices = sg.PdxferKVManager.indices

    def mgr(engine, mode, rank=0):
        m = SimpleNamespace(engine=engine, mode=mode, config=cfg, state_pools=[], prefill_info_table={},
                            register_room=lambda room: None, enable_deferred_decode_kv_release=False,
                            reap=lambda: None, attn_tp_rank=rank, kv_args=SimpleNamespace(page_size=4),
                            expecting=lambda room, parts: None, forget_room=lambda room: None,
                            orphan=lambda rid: None)
        m.indices = lambda kv, aux, states: indices(m, kv, aux, states)
        return m

    p, d = mgr(pre, "prefill"), mgr(dec, "decode")
    d.prefill_info_table["pf:1"] = SimpleNamespace(refusal=None, ranks={0: [(0, pre.bootstrap_address)]})
    d.prefill_info_table["mla:1"] = SimpleNamespace(refusal=None, ranks={
        0: [(0, pre.bootstrap_address), (1, pre1.bootstrap_address)]})
    d.prefill_info_table["bad:1"] = SimpleNamespace(refusal="prefill attn_tp_size=2, decode 1", ranks={})
    p.rank1 = mgr(pre1, "prefill", rank=1)
    p.kv, d.kv = kv[0], kv[2]
    yield p, d
    pre.close()
    pre1.close()
    dec.close()


def _until_finished(handle) -> KVPoll:
    import time
    deadline = time.monotonic() + 10
    while not KVPoll(handle.poll()).finished:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    return KVPoll(handle.poll())


def test_a_full_first_chunk_is_not_the_last_one_the_chunk_with_state_indices_is(managers) -> None:
    p, d = managers
    rx = sg.PdxferKVReceiver(d, "pf:1", 7)
    assert rx.poll() is KVPoll.Bootstrapping
    rx.init(0)
    assert rx.poll() is KVPoll.WaitingForInput
    rx.send_metadata(np.array([5, 6], dtype=np.int32), 3, [], decode_prefix_len=0)
    tx = sg.PdxferKVSender(p, "127.0.0.1:1", 7)
    assert _poll_until(tx, KVPoll.WaitingForInput)
    tx.init(2, 1)
    tx.send(np.array([1, 2], dtype=np.int32), None)  # both pages; SGLang will still send a last chunk
    assert tx.poll() is not KVPoll.Success
    tx.send(np.array([], dtype=np.int32), [])  # the zero-page last chunk: aux (and state) travel
    assert _until_finished(rx) is KVPoll.Success and _until_finished(tx) is KVPoll.Success
    assert d.engine.try_poll(sg.request_id(7, 0)) is None  # released once the scheduler saw it finish
    assert rx.poll() is KVPoll.Success  # and remembered
    assert tx.get_transfer_metric is not None


def _poll_until(handle, state) -> bool:
    import time
    deadline = time.monotonic() + 10
    while handle.poll() is not state:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    return True


def test_refusals_fail_the_request_with_the_reason_not_the_scheduler(managers) -> None:
    p, d = managers
    rx = sg.PdxferKVReceiver(d, "bad:1", 8)
    rx.init(0)
    assert rx.poll() is KVPoll.Failed and rx.conclude_state is KVPoll.Failed
    with pytest.raises(RequestFailed, match=r"prefill attn_tp_size=2, decode 1"):
        rx.failure_exception()
    rx = sg.PdxferKVReceiver(d, "pf:1", 9)
    rx.init(0)
    rx.send_metadata(np.array([1]), 0, [], decode_prefix_len=6)
    with pytest.raises(RequestFailed, match=r"decode_prefix_len=6 is not a whole number of pages "
                                            r"\(page_size=4\)"):
        rx.failure_exception()
    # a sender whose chunks do not add up to init()'s count fails, and says so
    rx = sg.PdxferKVReceiver(d, "pf:1", 10)
    rx.init(0)
    rx.send_metadata(np.array([1, 2, 3]), 0, [])
    tx = sg.PdxferKVSender(p, "127.0.0.1:1", 10)
    _poll_until(tx, KVPoll.WaitingForInput)
    tx.init(3, 0)
    tx.send(np.array([1, 2]), [])
    assert _until_finished(tx) is KVPoll.Failed
    with pytest.raises(RequestFailed, match=r"last chunk brings the pages sent to 2, but init\(\) announced 3"):
        tx.failure_exception()
    assert _until_finished(rx) is KVPoll.Failed


def test_an_abort_before_the_expect_fails_locally_and_after_it_through_the_engine(managers) -> None:
    p, d = managers
    rx = sg.PdxferKVReceiver(d, "pf:1", 11)
    rx.init(0)
    rx.abort()
    assert rx.poll() is KVPoll.Failed  # nothing was expected: nothing can land
    rx = sg.PdxferKVReceiver(d, "pf:1", 12)
    rx.init(0)
    rx.send_metadata(np.array([1]), 0, [])
    rx.abort()
    assert _until_finished(rx) is KVPoll.Failed
    with pytest.raises(RequestFailed, match=r"aborted by decode: decode scheduler aborted the request"):
        rx.failure_exception()


def test_a_decode_prefix_hit_expects_and_receives_only_the_tail(managers) -> None:
    p, d = managers
    src, dst = p.kv, d.kv
    src.copy_(torch.arange(src.numel(), dtype=torch.uint8).view(src.shape))
    rx = sg.PdxferKVReceiver(d, "pf:1", 13)
    rx.init(0)
    rx.send_metadata(np.array([9]), 2, [], decode_prefix_len=8)  # two pages held: the tail is one
    tx = sg.PdxferKVSender(p, "127.0.0.1:1", 13)
    _poll_until(tx, KVPoll.WaitingForInput)
    tx.init(3, 1)  # SGLang's prefill sends every page (it is told no prefix)
    tx.send(np.array([4, 5, 6]), [])
    assert _until_finished(rx) is KVPoll.Success and _until_finished(tx) is KVPoll.Success
    rows = slice(9 * 4, 10 * 4)
    assert torch.equal(dst[rows], src[6 * 4:7 * 4])  # page 6, the third: the tail
    assert not dst[:9 * 4].any() and not dst[10 * 4:].any()  # nothing else written
    assert tx.outcome.stats.nbytes == 4 * 16 + 8 * 8  # one page + aux


def test_mla_replica_group_one_rank_sends_the_other_is_told_nothing(managers) -> None:
    p, d = managers
    rx = sg.PdxferKVReceiver(d, "mla:1", 15)  # room 15: rank 15 % 2 = 1 sends
    rx.init(0)
    assert [rid for rid, _ in rx.sources] == ["15#tp0", "15#tp1"] and rx.rid == "15#tp1"
    rx.send_metadata(np.array([2, 3]), 4, [])
    txs = [sg.PdxferKVSender(m, "127.0.0.1:1", 15) for m in (p, p.rank1)]
    for tx in txs:
        _poll_until(tx, KVPoll.WaitingForInput)
        tx.init(2, 5)
        tx.send(np.array([0, 1]), [])
    assert _until_finished(rx) is KVPoll.Success
    assert [_until_finished(tx) for tx in txs] == [KVPoll.Success] * 2
    moved = [tx.outcome.stats.nbytes for tx in txs]
    assert moved == [0, 2 * 4 * 16 + 8 * 8], moved  # the idle rank shipped nothing


# -- vLLM: a decode prefix hit loads only the tail (#31.1) ---------------------------------------
def test_a_prefix_hit_names_its_cached_blocks_per_group_and_the_tail_expect() -> None:
    assert vl.cached_blocks(0, [16, 32], [None, None]) == [0, 0]
    assert vl.cached_blocks(64, [16, 32], [None, None]) == [4, 2]  # whole blocks of each group
    assert vl.cached_blocks(32, [16, 16], [None, 0]) is None  # a Mamba group: computed locally
    assert vl.cached_blocks(0, [16, 16], [None, 0]) == [0, 0]
    indices, offsets = vl.tail_expect([[7, 8], [], []], [2, 3, 0])
    # a fully cached group is still named (its offset tells the prefill to skip it); an empty
    # one without an offset is left out; no offset is sent for a group with nothing cached
    assert indices == {"g0": [7, 8], "g1": []} and offsets == {"g0": 2, "g1": 3}
    assert vl.tail_expect([[1], [2]], [0, 0]) == ({"g0": [1], "g1": [2]}, {})
