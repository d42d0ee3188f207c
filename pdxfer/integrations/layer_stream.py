"""Streamed layer groups for a serving engine's prefill: send each group as its layers finish.

A serving engine's forward pass reports layers one at a time (vLLM's
`save_kv_layer(layer_name, ...)` after each attention layer) and then waits
once at the end (`wait_for_save`). `LayerStream` turns those two calls into
`PrefillEngine.send(rid, indices, layers=(a, b))` per layer group for every
request the pass prefills to its end, so each group's transfer runs under the
next group's compute (#33). It knows nothing of the engine beyond layer
names: the adapter hands it where each name sits on the pools' layer axis,
the requests of the pass (`begin`), each finished layer (`layer_done`) and
the end of the pass (`finish`).

Groups split the layers as evenly as integers allow (`groups` of them, the
connector's `layer_groups` knob); a group is sent when its last layer is
reported, with `ready=None`, i.e. the caller's current CUDA stream at that
moment — which, called from the forward pass right after that layer, is the
event after the group's layers. `finish` sends whatever a pass did not
report (a layer the engine skipped), so a request is never left half sent:
its last range carries `last=True` and the decode is Success only once every
layer landed. A send the engine refuses fails that request alone
(`failed`), never the forward pass.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import PdxferError, RequestError

log = logging.getLogger("pdxfer")


def group_ends(depth: int, groups: int) -> list[int]:
    """The layer after each group's last: `groups` groups over `depth` layers, as even as can be."""
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise RequestError(f"layer groups must be an int >= 1, got {groups!r}")
    groups = min(groups, depth)
    return [depth * (g + 1) // groups for g in range(groups)]


class LayerStream:
    """The requests one forward pass prefills, sent layer group by layer group."""

    def __init__(self, send: Callable[..., None], layers: Mapping[str, int], depth: int,
                 groups: int, on_failed: Callable[[str, BaseException], None], *,
                 stride: int = 1) -> None:
        """`send`: `PrefillEngine.send`; `layers`: layer name -> its model layer index
        (0..depth-1); `on_failed(rid, exc)`: a request the engine refused; `stride`: entries
        of the pools' layer axis per model layer (2 where a pool keeps a layer's K and V as two
        tensors of one field, vLLM's `group_pools` with equal K and V shapes)."""
        bad = {n: i for n, i in layers.items() if not 0 <= i < depth}
        if bad:
            raise RequestError(f"layer positions {bad} are outside the pools' {depth} layers")
        self._send, self._layers, self.depth, self._stride = send, dict(layers), depth, stride
        self.ends = set(group_ends(depth, groups))
        self._on_failed = on_failed
        self._open: dict[str, list[Any]] = {}  # rid -> [indices, next layer, last]

    @property
    def requests(self) -> list[str]:
        """The requests of the pass in progress."""
        return list(self._open)

    def begin(self, rid: str, indices: Mapping[str, Any], *, last: bool = True) -> None:
        """Stream `indices` of request `rid` through this pass (its layers are computed in it)."""
        self._open[rid] = [dict(indices), 0, last]

    def layer_done(self, layer_name: str, ready: Any = None) -> None:
        """Layer `layer_name` of the pass is written: send the group it closes, if it closes one."""
        pos = self._layers.get(layer_name)
        if pos is None or pos + 1 not in self.ends or not self._open:
            return
        for rid, state in list(self._open.items()):
            if state[1] <= pos:
                self._range(rid, state, pos + 1, ready)

    def finish(self) -> list[str]:
        """The pass ended: send any layers not reported yet; the requests it streamed."""
        done = list(self._open)
        for rid, state in list(self._open.items()):
            if state[1] < self.depth:
                self._range(rid, state, self.depth, None)
        self._open.clear()
        return done

    def _range(self, rid: str, state: list, end: int, ready: Any) -> None:
        indices, lo, last = state
        try:
            k = self._stride
            self._send(rid, indices, layers=(lo * k, end * k), last=last, ready=ready)
            state[1] = end
        except PdxferError as exc:
            log.error("pdxfer: streaming layers [%d, %d) of %s failed: %s", lo, end, rid, exc)
            del self._open[rid]
            self._on_failed(rid, exc)
