"""The engine-neutral kit every integration shares; none of it needs SGLang or vLLM."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdxfer import ConfigError, EngineConfig, KVPoll, layout
from pdxfer.integrations.kit import (
    buffer_fields,
    buffer_pool,
    engine_config,
    engine_poll,
    pool_indices,
)


def test_the_engine_sees_only_its_five_states_and_a_quarantine_as_transferring() -> None:
    # The engines act on Failed at once (free the pages) and raise on values they do not know.
    assert engine_poll(None) is KVPoll.Bootstrapping
    assert engine_poll(KVPoll.Quarantined) is KVPoll.Transferring
    for state in (KVPoll.Failed, KVPoll.Bootstrapping, KVPoll.WaitingForInput,
                  KVPoll.Transferring, KVPoll.Success):
        assert engine_poll(state) is state
    assert {int(engine_poll(s)) for s in [None, *KVPoll]} <= {0, 1, 2, 3, 4}


def test_the_config_comes_from_json_over_the_integrations_defaults() -> None:
    calls = []

    def host() -> str:
        calls.append(1)
        return "10.0.0.7"

    assert engine_config(None, host=host) == EngineConfig(host="10.0.0.7")
    cfg = engine_config('{"transport": "loopback", "host": "127.0.0.1", "timeout": 3}', host=host)
    assert (cfg.transport, cfg.host, cfg.timeout) == ("loopback", "127.0.0.1", 3)
    assert len(calls) == 1  # a default the JSON sets is never computed
    with pytest.raises(ConfigError, match=r"PDXFER_CONFIG has unknown key\(s\) \['timout'\]; EngineConfig fields"):
        engine_config('{"timout": 3}')
    with pytest.raises(ConfigError, match=r"PDXFER_CONFIG is not JSON .*; set it to an object such as"):
        engine_config("transport=tcp")
    with pytest.raises(ConfigError, match=r"must be a JSON object of EngineConfig fields, got '\[1\]'"):
        engine_config("[1]")
    with pytest.raises(ConfigError, match=r"EngineConfig.timeout must be a finite, positive number"):
        engine_config('{"timeout": -1}')


def test_buffer_lists_declare_one_field_per_run_of_equal_items() -> None:
    fields = buffer_fields("kv", [512, 512, 512, 512, 64, 64], rows=16)
    assert [(f.name, f.layers, f.shape, f.dtype) for f in fields] == [
        ("kv0", 4, (16, 32), torch.uint8), ("kv1", 2, (16, 4), torch.uint8)]
    assert [f.name for f in buffer_fields("aux", [64])] == ["aux"]
    with pytest.raises(ConfigError, match=r"kv: an item of 100 B does not split into 16 rows"):
        buffer_fields("kv", [100], rows=16)
    with pytest.raises(ConfigError, match=r"aux: the engine handed over no buffers"):
        buffer_fields("aux", [])


def test_a_pool_over_an_engines_pointers_is_its_memory() -> None:
    ks = [torch.arange(8 * 16 * 4, dtype=torch.int32).view(8 * 16, 4) + i for i in range(2)]
    pool = buffer_pool("kv", [t.data_ptr() for t in ks], [t.nbytes for t in ks],
                       [t[:16].nbytes for t in ks], rows=16)
    assert isinstance(pool, layout.PerLayerArena) and pool.entries == 8
    assert [b.data_ptr() for b in layout.arena_buffers(pool)] == [t.data_ptr() for t in ks]
    with pytest.raises(ConfigError, match=r"kv: 2 pointers, 2 lengths and 1 item lengths"):
        buffer_pool("kv", [t.data_ptr() for t in ks], [t.nbytes for t in ks], [256], rows=16)
    with pytest.raises(layout.LayoutError, match=r"field 'kv' layer 1: 2044 B is not a whole number of 256 B entries"):
        buffer_pool("kv", [t.data_ptr() for t in ks], [ks[0].nbytes, ks[1].nbytes - 4],
                    [256, 256], rows=16)


def test_pool_indices_drop_empty_pools_and_accept_what_engines_pass() -> None:
    out = pool_indices({"kv": np.array([3, 1], dtype=np.int32), "aux": [5], "state.mamba": None,
                        "state.swa": [], "t": torch.tensor([[2]]), "l": [np.array(7)]})
    assert set(out) == {"kv", "aux", "t", "l"}
    assert [out[k].tolist() for k in ("kv", "aux", "t", "l")] == [[3, 1], [5], [2], [7]]
    assert all(a.dtype == np.int64 for a in out.values())
