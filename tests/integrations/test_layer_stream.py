"""`integrations.layer_stream.LayerStream`: what vLLM's save_kv_layer / wait_for_save drive (#33).

Real engines over loopback with per-layer pools (vLLM's shape: one tensor per
layer and K/V); the forward pass is the test calling `layer_done` per layer.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdxfer import DecodeEngine, EngineConfig, KVPoll, PrefillEngine, RequestError, layout
from pdxfer.integrations.layer_stream import LayerStream, group_ends

LAYERS = 6
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def pool(seed: int | None) -> dict:
    gen = torch.Generator().manual_seed(seed or 0)

    def tensor() -> torch.Tensor:
        t = torch.zeros(32, 4, 8, dtype=torch.float16)
        if seed is not None:
            t.view(torch.int16).copy_(torch.randint(-2**15, 2**15, t.shape, dtype=torch.int16, generator=gen))
        return t

    return {"g0": layout.PerLayerArena({"f0": [tensor() for _ in NAMES],
                                        "f1": [tensor() for _ in NAMES]})}


def test_group_ends_split_the_layers_evenly_and_refuse_nonsense() -> None:
    assert group_ends(6, 2) == [3, 6]
    assert group_ends(6, 4) == [1, 3, 4, 6]
    assert group_ends(6, 100) == [1, 2, 3, 4, 5, 6]
    with pytest.raises(RequestError, match="layer groups must be an int >= 1"):
        group_ends(6, 0)


def test_a_forward_pass_streams_its_requests_in_groups_and_the_decode_succeeds_at_the_end() -> None:
    src, dst = pool(1), pool(None)
    cfg = EngineConfig(transport="loopback", timeout=20.0)
    prefill, decode = PrefillEngine(src, cfg), DecodeEngine(dst, cfg)
    sent: list[tuple] = []
    failed: list[str] = []

    def send(rid, indices, **kw) -> None:
        sent.append((rid, kw["layers"]))
        prefill.send(rid, indices, **kw)

    stream = LayerStream(send, {n: i for i, n in enumerate(NAMES)}, LAYERS, 3,
                         lambda rid, exc: failed.append(rid))
    try:
        decode.expect("a", prefill.bootstrap_address, {"g0": [10, 11, 12]})
        decode.expect("b", prefill.bootstrap_address, {"g0": [20]})
        stream.begin("a", {"g0": [1, 2, 3]})
        stream.begin("b", {"g0": [4]})
        for name in NAMES[:-1]:  # the pass, minus its last layer
            stream.layer_done(name)
            stream.layer_done("model.layers.0.mlp")  # not a cache layer: ignored
        assert sent == [("a", (0, 2)), ("b", (0, 2)), ("a", (2, 4)), ("b", (2, 4))]
        assert decode.poll("a") is not KVPoll.Success  # the last group is not sent yet
        assert stream.finish() == ["a", "b"]  # wait_for_save: the last group goes now
        assert sent[-2:] == [("a", (4, 6)), ("b", (4, 6))] and not failed
        assert decode.wait("a", 20) is KVPoll.Success and decode.wait("b", 20) is KVPoll.Success
        for f in ("f0", "f1"):
            for layer in range(LAYERS):
                got = dst["g0"].view(f, layer)[[10, 11, 12, 20]].view(torch.int16)
                want = src["g0"].view(f, layer)[[1, 2, 3, 4]].view(torch.int16)
                assert torch.equal(got, want), (f, layer)
        # one run per layer tensor per group: 2 fields x 6 layers, runs of pages merged
        assert prefill.stats("a").segments == 2 * LAYERS
    finally:
        decode.close()
        prefill.close()


def test_a_refused_send_fails_that_request_alone() -> None:
    src = pool(1)
    prefill = PrefillEngine(src, EngineConfig(transport="loopback"))
    failed: list[str] = []
    stream = LayerStream(prefill.send, {n: i for i, n in enumerate(NAMES)}, LAYERS, 2,
                         lambda rid, exc: failed.append(rid))
    try:
        stream.begin("bad", {"g0": np.array([99])})  # outside the pool's 32 entries
        stream.begin("ok", {"g0": [1]})
        for name in NAMES:
            stream.layer_done(name)
        assert failed == ["bad"] and stream.finish() == ["ok"]
    finally:
        prefill.close()


def test_a_stride_maps_model_layers_onto_a_pool_that_keeps_k_and_v_as_two_tensors() -> None:
    sent: list[tuple] = []
    stream = LayerStream(lambda rid, idx, **kw: sent.append(kw["layers"]), {"l0": 0, "l1": 1}, 2,
                         2, lambda rid, exc: None, stride=2)
    stream.begin("r", {"g0": [1]})
    stream.layer_done("l0")
    stream.layer_done("l1")
    assert sent == [(0, 2), (2, 4)] and stream.finish() == ["r"]
