"""What every engine integration shares: the poll an engine may see, pools from its buffers, config.

Three facts each adapter would otherwise restate:

- **The safe poll** (`engine_poll`). An engine knows five states and acts on
  two of them at once: on `Failed` it frees the request's pages (SGLang,
  vLLM alike), and any value it does not know raises in its queue code.
  pdxfer's `Quarantined` (5) is "failed, but the prefill may still write into
  these entries" over a transport that cannot fence; handing the engine
  `Failed` then would let it reuse pages a late write still lands in. So a
  request that may still be written reads as `Transferring` until it is
  safe, and `Quarantined` never reaches an engine. A request the engine does
  not know yet (a prefill sender before the decode's Expect) reads as
  `Bootstrapping`.
- **Pools from an engine's buffer lists** (`buffer_pool`). Engines describe
  their memory as parallel lists of pointers, lengths and item lengths; a
  pool is declared from those (runs of equal item length are one field,
  every buffer a layer of it) and adopted through `layout.adopt_ranges`,
  which refuses any buffer that disagrees with the declaration.
- **The engine config** (`engine_config`). Serving engines build the
  transfer backend themselves, from their own arguments, so pdxfer's
  `EngineConfig` reaches the plugin through one environment variable,
  `PDXFER_CONFIG` (a JSON object of `EngineConfig` fields). This is the
  launcher edge where pdxfer reads the environment; nothing deeper does.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from pdxfer import layout

from ..config import EngineConfig, KVPoll
from ..errors import ConfigError

CONFIG_ENV = "PDXFER_CONFIG"


def engine_poll(state: KVPoll | None) -> KVPoll:
    """The state an engine that knows only Failed..Success may see for a pdxfer request.

    None (no record yet) is Bootstrapping; Quarantined (failed, entries still
    not the caller's) is Transferring, so the engine keeps the entries until
    pdxfer says Failed, which it does only once nothing can land in them.
    """
    if state is None:
        return KVPoll.Bootstrapping
    if state is KVPoll.Quarantined:
        return KVPoll.Transferring
    return state


def engine_config(text: str | None, **defaults: Any) -> EngineConfig:
    """`EngineConfig` from `PDXFER_CONFIG`'s JSON (None or empty: defaults only).

    `defaults` are the integration's own choices (a host the engine knows;
    a callable is called only when the JSON does not set that field); the
    JSON overrides them. An unknown key is refused with the valid ones.
    """
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    given: dict[str, Any] = {}
    if text:
        try:
            given = json.loads(text)
        except (ValueError, RecursionError) as exc:  # ValueError: also a >4,300-digit number
            raise ConfigError(f"{CONFIG_ENV} is not JSON ({exc}); set it to an object such as "
                              '{"transport": "tcp", "timeout": 10}') from exc
        if not isinstance(given, dict):
            raise ConfigError(f"{CONFIG_ENV} must be a JSON object of EngineConfig fields, got {text!r}")
    unknown = sorted(set(given) - fields)
    if unknown:
        raise ConfigError(f"{CONFIG_ENV} has unknown key(s) {unknown}; EngineConfig fields: "
                          f"{sorted(fields)}")
    for key, value in given.items():
        # JSON integers are unbounded; EngineConfig's checks compare them with floats, which
        # a 400-digit one overflows (OverflowError, not a refusal): refused here, named
        if isinstance(value, int) and not isinstance(value, bool):
            try:
                float(value)
            except OverflowError:
                raise ConfigError(f"{CONFIG_ENV}: {key} is an integer of {len(str(value))} digits, "
                                  f"past any float; give seconds as a number such as 10 (for "
                                  f"'no limit', a large one such as 1e6)") from None
    chosen = {k: v() if callable(v) else v for k, v in defaults.items() if k not in given}
    return EngineConfig(**chosen, **given)


def buffer_fields(name: str, item_lens: Sequence[int], *, rows: int = 1) -> list[layout.EntryField]:
    """The declaration of an engine's buffer list: one uint8 field per run of equal item length.

    An item (one entry of one buffer) spans `rows` rows (a page of tokens, or
    1) of equal bytes. Bytes, not dtypes: an engine's buffer lists say no
    more (SGLang's decode does not even state its head count), and the two
    sides must agree on the bytes a row holds; the engines check dtypes and
    head counts themselves.
    Fields are named `name` (one run) or `name0`, `name1`, ... in order.
    """
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ConfigError(f"{name}: rows must be an int >= 1 (the rows one item spans: a page's "
                          f"tokens, or 1), got {rows!r}")
    items = [int(n) for n in item_lens]
    if not items:
        raise ConfigError(f"{name}: the engine handed over no buffers")
    runs: list[list[int]] = []
    for n in items:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    fields = []
    for j, (item, layers) in enumerate(runs):
        fname = name if len(runs) == 1 else f"{name}{j}"
        if item <= 0 or item % rows:
            raise ConfigError(f"{fname}: an item of {item} B does not split into {rows} rows")
        fields.append(layout.EntryField(fname, layers, (rows, item // rows), torch.uint8))
    return fields


def buffer_pool(name: str, ptrs: Sequence[int], lens: Sequence[int], item_lens: Sequence[int],
                *, rows: int = 1, device: str | torch.device = "cpu") -> layout.PerLayerArena:
    """A pool over an engine's buffers, each `(ptr, len, item_len)` checked against its field."""
    if not (len(ptrs) == len(lens) == len(item_lens)):
        raise ConfigError(f"{name}: {len(ptrs)} pointers, {len(lens)} lengths and "
                          f"{len(item_lens)} item lengths; the engine's lists must be parallel")
    fields = buffer_fields(name, item_lens, rows=rows)
    ranges: dict[str, list[tuple[int, int, int]]] = {}
    triples = list(zip(ptrs, lens, item_lens, strict=True))
    at = 0
    for f in fields:
        ranges[f.name] = triples[at:at + f.layers]
        at += f.layers
    return layout.adopt_ranges(fields, ranges, device=device)


def pool_indices(indices: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """`{pool: int64 indices}` with empty pools left out (an engine's None or [] means 'nothing')."""
    out = {}
    for pool, idx in indices.items():
        if idx is None:
            continue
        arr = np.asarray(idx.cpu() if isinstance(idx, torch.Tensor) else idx, dtype=np.int64)
        if arr.size:
            out[pool] = arr.reshape(-1)
    return out
