"""The integrations' engine-free helpers refuse bad input with a `ConfigError`, never a raw exception.

Each case once raised something a launcher could not tell from a bug
(`OverflowError`, `ZeroDivisionError`, `KeyError`, issue #35 item 10); each
now names the value and the fix.
"""

from __future__ import annotations

import pytest
import torch

from pdxfer import ConfigError
from pdxfer.integrations import vllm as vl
from pdxfer.integrations.kit import buffer_fields, buffer_pool, engine_config


@pytest.mark.parametrize("text, match", [
    ('{"timeout": 1' + "0" * 400 + "}", r"PDXFER_CONFIG: timeout is an integer of 401 digits, past "
                                        r"any float; give seconds as a number such as 10"),
    ('{"connect_timeout": -1' + "0" * 400 + "}", r"connect_timeout is an integer of 402 digits"),
    ('{"timeout": 1' + "0" * 5000 + "}", r"PDXFER_CONFIG is not JSON .*set it to an object"),
    ("[" * 5000 + "]" * 5000, r"PDXFER_CONFIG is not JSON"),
])
def test_a_config_number_past_any_float_is_refused_by_name(text, match) -> None:
    with pytest.raises(ConfigError, match=match):
        engine_config(text)


@pytest.mark.parametrize("rows", [0, -2, 1.5, True])
def test_rows_below_one_are_refused_before_any_division(rows) -> None:
    match = rf"kv: rows must be an int >= 1 \(the rows one item spans: a page's tokens, or 1\), got {rows!r}"
    with pytest.raises(ConfigError, match=match):
        buffer_fields("kv", [64], rows=rows)
    buf = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(ConfigError, match=match):
        buffer_pool("kv", [buf.data_ptr()], [64], [64], rows=rows)


def test_a_cache_group_naming_a_missing_layer_is_refused_with_the_layers_there_are() -> None:
    caches = {"layer0": torch.zeros(4, 2, 8)}
    with pytest.raises(ConfigError, match=r"cache group 0 names layer 'layer9', which the registered "
                                          r"caches lack \(they have \['layer0'\]\); every group's "
                                          r"layers must be among those handed to register_kv_caches"):
        vl.group_pools(caches, [["layer0", "layer9"]], 4)
