"""SGLang's disaggregation interface over pdxfer, without importing SGLang.

SGLang's prefill scheduler drives a `KVSender` per request (`init`, `send`
per chunk, `poll`, `failure_exception`) and its decode scheduler a
`KVReceiver` (`init`, `poll`, `abort`), both from one `KVManager` per worker.
This module is that shape over pdxfer, for a worker whose pools SGLang
already allocated: per-layer bf16 K/V tensors (`k_buffer[l]`, `v_buffer[l]`)
and a Mamba-style state pool (`conv[layer, slot]`, `temporal[layer, slot]`).
Both are adopted as they are (`layout.PerLayerArena`): no copy, no staging.

A request's id is SGLang's `bootstrap_room`; the decode learns the prefill's
`bootstrap_addr` from SGLang's bootstrap server (here: the caller passes it).
Chunked prefill sends pages as they are computed; the chunk that completes
`init(num_pages)` is the last one and carries the request's state slot.
`clear()` forgets a finished request (SGLang drops its sender/receiver).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdxfer import DecodeEngine, EngineConfig, KVPoll, PrefillEngine, layout

LAYERS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 4, 8, 64, 16
CONV_DIM, CONV_WINDOW, SSM_HEADS, SSM_DIM = 128, 3, 4, 16


def allocate_pools(num_pages: int, num_slots: int, device: str = "cpu") -> dict[str, dict]:
    """Tensors as SGLang allocates them: one K and one V tensor per layer, one tensor per state kind."""
    kv = {name: [torch.zeros(num_pages * PAGE_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16,
                             device=device) for _ in range(LAYERS)] for name in ("k", "v")}
    conv = torch.zeros(LAYERS, num_slots, CONV_DIM, CONV_WINDOW, dtype=torch.bfloat16, device=device)
    temporal = torch.zeros(LAYERS, num_slots, SSM_HEADS, SSM_DIM, SSM_DIM, dtype=torch.float32,
                           device=device)
    return {"kv": kv, "state": {"conv": list(conv), "temporal": list(temporal)}}


class KVManager:
    """One per worker: the pdxfer engine over the worker's pools."""

    def __init__(self, role: str, tensors: dict[str, dict], config: EngineConfig) -> None:
        pools = {"kv": layout.PerLayerArena(tensors["kv"], entry_rows=PAGE_SIZE),
                 "state": layout.PerLayerArena(tensors["state"])}
        engine_cls = {"prefill": PrefillEngine, "decode": DecodeEngine}[role]
        self.engine = engine_cls(pools, config)
        self.pools = pools

    @property
    def bootstrap_addr(self) -> str:
        """What the prefill registers with SGLang's bootstrap server (prefill only)."""
        return self.engine.bootstrap_address

    def close(self) -> None:
        self.engine.close()


class _Handle:
    def __init__(self, mgr: KVManager, bootstrap_room: str) -> None:
        self.engine, self.room = mgr.engine, bootstrap_room

    def poll(self) -> KVPoll:
        """Bootstrapping until the other side has announced the request."""
        state = self.engine.try_poll(self.room)
        return KVPoll.Bootstrapping if state is None else state

    def failure_exception(self) -> None:
        """Raise why the request failed (`RequestFailed`, the engine's cause attached)."""
        exc = self.engine.failure(self.room)
        if exc is not None:
            raise exc

    def clear(self) -> None:
        """Forget the finished request so its room can be reused."""
        self.engine.release(self.room)


class KVSender(_Handle):
    """Prefill side of one request."""

    def init(self, num_pages: int) -> None:
        self.num_pages, self.sent = num_pages, 0

    def send(self, page_indices: Sequence[int], state_indices: Sequence[int] = ()) -> None:
        """Ship one chunk of pages; the chunk reaching `num_pages` also ships the state slot."""
        self.sent += len(page_indices)
        last = self.sent >= self.num_pages
        indices = {"kv": list(page_indices), **({"state": list(state_indices)} if last else {})}
        self.engine.send(self.room, indices, last=last)


class KVReceiver(_Handle):
    """Decode side of one request."""

    def __init__(self, mgr: KVManager, bootstrap_addr: str, bootstrap_room: str) -> None:
        super().__init__(mgr, bootstrap_room)
        self.bootstrap_addr = bootstrap_addr

    def init(self, page_indices: Sequence[int], state_indices: Sequence[int]) -> None:
        self.engine.expect(self.room, self.bootstrap_addr,
                           {"kv": list(page_indices), "state": list(state_indices)})

    def abort(self) -> None:
        """Give up: poll() turns Failed once no byte of the request can still land."""
        self.engine.abort(self.room, "decode scheduler aborted the request")
