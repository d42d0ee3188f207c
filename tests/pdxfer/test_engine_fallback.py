"""A GPU registration the host cannot do: the error names the missing piece, or the engine falls back.

No GPU here: the pools live in the software fabric's CUDA double (`verbs.sim`), on a GPU
whose dma-buf export fails, on a host without nvidia_peermem — so verbs-sim cannot
register them, as on a real host missing both. With `EngineConfig(fallback="tcp")` the
engine runs on tcp instead, with one warning; its peers must use tcp too, and a decode on
another transport is refused by name.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch
from pdxfer.transport import DeviceRegistrationError
from pdxfer.transport.verbs import sim
from pdxfer.transport.verbs.sim.net import SimGpu, Topology

from pdxfer import DecodeEngine, EngineConfig, KVPoll, PrefillEngine, RequestFailed, layout

WAIT = 30.0
NODMABUF = Topology(gpus=(SimGpu(("pci0000:00", "0000:00:01.0", "0000:05:00.0"), dmabuf=False),))
FIELDS = [layout.EntryField("k", 2, (8, 16), torch.float16), layout.EntryField("v", 2, (8, 16), torch.float16)]
ENTRIES = 16

pytestmark = pytest.mark.skipif(os.path.isdir("/sys/module/nvidia_peermem"),
                                reason="nvidia_peermem is loaded here: verbs would register by address")


def _gpu_pools(fab) -> dict:
    """One kv pool in soft-GPU memory, random bytes in every entry."""
    buf = fab.cuda.alloc(0, 1 << 20)
    buf.copy_(torch.from_numpy(np.random.default_rng(7).integers(0, 256, 1 << 20, dtype=np.uint8)))
    return {"kv": layout.EntryMajorArena(FIELDS, ENTRIES, "cpu", buf=buf)}


def _entry(arena, i: int) -> bytes:
    return b"".join(arena.view(f.name)[:, i].contiguous().view(torch.uint8).numpy().tobytes()
                    for f in FIELDS)


def test_without_fallback_the_error_names_the_missing_pieces() -> None:
    with sim.use(sim.Fabric(NODMABUF)) as fab:
        with pytest.raises(DeviceRegistrationError,
                           match=r"GPU memory for the verbs NIC .*missing on this host: the "
                                 r"nvidia_peermem kernel module is not loaded .*; dma-buf "
                                 r"export/registration failed \(.*CUresult 801.*\).*fallback='tcp'") as err:
            PrefillEngine(_gpu_pools(fab), EngineConfig(transport="verbs-sim"))
    assert err.value.missing == ("nvidia_peermem", "dma-buf")


def test_fallback_tcp_moves_the_bytes_with_one_warning_and_peers_pair_by_name(caplog) -> None:
    with sim.use(sim.Fabric(NODMABUF)) as fab:
        pools = _gpu_pools(fab)
        with caplog.at_level(logging.WARNING, logger="pdxfer"):
            prefill = PrefillEngine(pools, EngineConfig(transport="verbs-sim", fallback="tcp", timeout=10.0))
        try:
            warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
            assert len(warned) == 1, warned
            assert "transport 'verbs-sim' failed" in warned[0] and "falling back to 'tcp'" in warned[0]
            assert "nvidia_peermem" in warned[0]
            assert (prefill.config.transport, prefill.config.fallback) == ("tcp", None)
            assert prefill.engine_id.startswith("tcp-")

            dst = {"kv": layout.EntryMajorArena(FIELDS, ENTRIES, "cpu")}
            with DecodeEngine(dst, EngineConfig(transport="tcp", timeout=10.0)) as decode:
                decode.expect("r", prefill.bootstrap_address, {"kv": [0, 5]})
                prefill.send("r", {"kv": [3, 9]})
                assert decode.wait("r", WAIT) is KVPoll.Success
                assert _entry(dst["kv"], 0) == _entry(pools["kv"], 3)
                assert _entry(dst["kv"], 5) == _entry(pools["kv"], 9)

            # A decode still on verbs-sim is refused by name, not left hanging.
            with DecodeEngine({"kv": layout.EntryMajorArena(FIELDS, ENTRIES, "cpu")},
                              EngineConfig(transport="verbs-sim", timeout=10.0)) as other:
                other.expect("s", prefill.bootstrap_address, {"kv": [1]})
                with pytest.raises(RequestFailed, match=r"decode uses transport 'verbs-sim', this "
                                                        r"prefill 'tcp'"):
                    other.wait("s", WAIT)
        finally:
            prefill.close()


@pytest.mark.parametrize("fallback", ["verbs-sim", "", 3])
def test_a_fallback_must_be_another_backends_name(fallback) -> None:
    from pdxfer import ConfigError

    with pytest.raises(ConfigError, match=r"EngineConfig.fallback must be None or another backend's "
                                          r"name than transport 'verbs-sim'"):
        EngineConfig(transport="verbs-sim", fallback=fallback)
