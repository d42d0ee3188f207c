"""A pool over raw pointer ranges a serving engine hands us, checked against a declaration.

SGLang gives a transfer backend no tensors: its `KVArgs` carry, per buffer, a
pointer, a length in bytes and the bytes of one item (a page of one layer's
K, one Mamba slot of one state tensor, one metadata row). Building a pool on
that is where a wrong number silently becomes a wrong write, so this module
takes the declaration of what the buffers must hold (`EntryField`s: one per
tensor family, `layers` ranges each) and refuses anything that disagrees with
it before a tensor is made:

- every declared field has exactly `layers` ranges, and no range is undeclared;
- a pointer is a positive int aligned to the field's dtype, a length a
  positive whole number of entries, and an item length, where the engine
  states one, is the field's bytes per entry and layer;
- every range of every field holds the same number of entries (one pool, one
  index space);
- no two ranges overlap (a buffer listed twice would receive a request twice).

The ranges are then viewed as tensors of the declared dtype and shape (CPU
through `torch.frombuffer`, CUDA through `__cuda_array_interface__`) and
handed to `PerLayerArena`, which the planner and the handshake already know:
what `describe` says of the pool is the declaration, so two peers whose
engines laid their buffers out differently are refused by field name.

The tensors do not own the memory: the engine that handed over the pointers
keeps it alive for as long as the pool is used (SGLang's pools live as long
as its scheduler). Nothing here reads or writes the bytes.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence

import torch

from .checks import _check_names
from .errors import LayoutError
from .fields import EntryField, _require_int
from .per_layer import PerLayerArena


class _CudaRange:
    """The `__cuda_array_interface__` of one byte range, for `torch.as_tensor`."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3}


def _bytes_at(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over `nbytes` at `ptr` on `device`, owning nothing."""
    if device.type == "cpu":
        return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)
    if device.type == "cuda":
        return torch.as_tensor(_CudaRange(ptr, nbytes), device=device)
    raise LayoutError(f"cannot adopt raw ranges on device {device}; cpu and cuda are supported")


def _one_range(field: EntryField, layer: int, rng: object) -> tuple[int, int]:
    """`(ptr, nbytes)` of one range, checked against `field`, or `LayoutError`."""
    where = f"field {field.name!r} layer {layer}"
    if not isinstance(rng, Sequence) or len(rng) not in (2, 3):
        raise LayoutError(f"{where}: a range is (ptr, nbytes) or (ptr, nbytes, item_bytes), "
                          f"got {rng!r}")
    ptr = _require_int(rng[0], f"{where}: pointer", minimum=1)
    nbytes = _require_int(rng[1], f"{where}: length", minimum=1)
    item = field.per_layer_bytes
    if len(rng) == 3 and _require_int(rng[2], f"{where}: item length") != item:
        raise LayoutError(
            f"{where}: the engine says one entry is {rng[2]} B, the declaration "
            f"{list(field.shape)} {field.dtype} makes it {item} B; declare the field the "
            "engine allocated (shape and dtype of one entry of one layer)"
        )
    if ptr % field.dtype.itemsize:
        raise LayoutError(f"{where}: pointer {ptr:#x} is not aligned to {field.dtype} "
                          f"({field.dtype.itemsize} B); pass the buffer's own start")
    if nbytes % item:
        raise LayoutError(
            f"{where}: {nbytes} B is not a whole number of {item} B entries "
            f"({nbytes // item} entries + {nbytes % item} B); the declaration does not "
            "match the buffer"
        )
    return ptr, nbytes


def adopt_ranges(fields: Sequence[EntryField], ranges: Mapping[str, Sequence[Sequence[int]]],
                 *, device: str | torch.device = "cpu") -> PerLayerArena:
    """A `PerLayerArena` over raw ranges: `ranges[field]` is one range per layer of `field`.

    Each field's `shape` is one entry of one layer; its first dim is the rows
    an entry spans (the page size for token-indexed KV, 1 otherwise) and must
    be the same for every field. A range is `(ptr, nbytes)`, or
    `(ptr, nbytes, item_bytes)` to have the engine's own item length checked.
    Refusals (`LayoutError`, naming the field, layer and numbers) come before
    any tensor is made; see the module docstring for the list.
    """
    fields = list(fields)
    if not fields:
        raise LayoutError("declare at least one field for the ranges")
    _check_names(fields)
    if not isinstance(ranges, Mapping):
        raise LayoutError(f"ranges must map field name -> ranges per layer, got {type(ranges).__name__}")
    names = [f.name for f in fields]
    if set(ranges) != set(names):
        raise LayoutError(
            f"ranges name fields {sorted(map(str, ranges))} but the declaration has {names}; "
            "give one list of ranges per declared field"
        )
    rows = {f.shape[0] if f.shape else 1 for f in fields}
    if len(rows) != 1 or not all(f.shape for f in fields):
        raise LayoutError(
            f"every field's shape must start with the rows of one entry, and the same for all "
            f"fields; got {[list(f.shape) for f in fields]}"
        )
    device = torch.device(device)
    checked: dict[str, list[tuple[int, int]]] = {}
    entries: dict[str, int] = {}
    for field in fields:
        per_layer = list(ranges[field.name])
        if len(per_layer) != field.layers:
            raise LayoutError(f"field {field.name!r} declares {field.layers} layers but "
                              f"{len(per_layer)} ranges were given")
        checked[field.name] = [_one_range(field, layer, r) for layer, r in enumerate(per_layer)]
        counts = {n // field.per_layer_bytes for _, n in checked[field.name]}
        if len(counts) != 1:
            raise LayoutError(f"field {field.name!r}: its ranges hold {sorted(counts)} entries; "
                              "every layer of a pool holds the same entries")
        entries[field.name] = counts.pop()
    if len(set(entries.values())) != 1:
        raise LayoutError(f"fields hold different entry counts {entries}; one pool is one index "
                          "space (put buffers of another size in a pool of their own)")
    spans = sorted((ptr, ptr + n, f"field {name!r} layer {layer}")
                   for name, rs in checked.items() for layer, (ptr, n) in enumerate(rs))
    for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise LayoutError(f"{a} and {b} overlap ({end - start} B); each buffer is listed "
                              "once and owns its bytes")
    tensors = {
        field.name: [_bytes_at(ptr, n, device).view(field.dtype).view(-1, *field.shape[1:])
                     for ptr, n in checked[field.name]]
        for field in fields
    }
    return PerLayerArena(tensors, entry_rows=rows.pop())
