"""What one entry of a cache holds, and the one walk that places its bytes.

An entry is one unit of an index space: a block of paged KV, or one request's
recurrent state. It holds several tensor families (k and v and their scales;
a GDN conv and temporal state; DeepSeek-V4's compressor `kv_state` /
`score_state` pairs), each declared as an `EntryField` whose `shape` is what
ONE (layer, entry) pair of it holds.

This module owns the byte arithmetic over such a declaration and nothing
else. There is exactly one align-place-advance walk, `field_extents`; the
entry's size (`entry_bytes_for`), an arena's field offsets and a checkpoint
image's ranges (`checkpoint_ranges_for`) are three answers to that walk, so
they cannot drift apart. The page-major envelope SGLang builds is the same
walk with no inter-field padding (`base_align=1`), which is why the walk takes
that knob instead of there being a second walk for it.

Also here, because `_ALIGN` is: `plan_regions` / `carve`, which place several
regions in one allocation on the boundaries their field views retype from,
and `field_view`, the one place a field's strided tensor is cut out of a byte
buffer (every arena kind differs only in the three byte strides it passes).

Every refusal is a `LayoutError` (a `ValueError`) naming the numbers and the
fix, raised before any byte is touched.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import groupby

import torch

from .errors import LayoutError

# Field offsets inside an entry, and an entry's size, are rounded up to this.
# 256 B is the CUDA caching allocator's granularity and a multiple of every
# element size in play, so a field pointer is safe for the widest vector load
# and byte offsets convert to element offsets by exact division.
_ALIGN = 256


def _align_up(n: int, to: int = _ALIGN) -> int:
    return -(-n // to) * to


def _require_int(value: object, what: str, *, minimum: int = 0) -> int:
    """`value` as a Python int (numpy integers welcome), or `LayoutError`."""
    # bool is an int subclass; a flag passed where a count belongs is a bug.
    try:
        number = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        number = None
    if number is None or number < minimum:
        raise LayoutError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return number


def plan_regions(
    sizes: Sequence[int], aligns: Sequence[int] | None = None
) -> tuple[list[int], int]:
    """Byte offsets for regions packed back to back in one allocation.

    Returns `(offsets, total)`, both `_ALIGN`-aligned, so with the default
    alignment `plan_regions(a)` followed by `plan_regions(b)` shifted by `a`'s
    total lays out exactly as `plan_regions(a + b)`: plan groups separately and
    concatenate. An empty list plans to `([], 0)`.

    `aligns` (one per region, 0 meaning `_ALIGN`) lets a region whose fields
    need a stricter boundary start on it; `carve_layer_major` passes each
    group's strictest field alignment. The concatenation property then holds
    only when every shift is a multiple of the later regions' alignments, so
    plan such a list in one call.
    """
    if aligns is not None and len(aligns) != len(sizes):
        raise LayoutError(f"plan_regions got {len(sizes)} sizes but {len(aligns)} alignments")
    offsets: list[int] = []
    offset = 0
    for i, nbytes in enumerate(sizes):
        nbytes = _require_int(nbytes, f"region {i} size")
        align = _ALIGN
        if aligns is not None:
            align = max(_ALIGN, _require_int(aligns[i], f"region {i} alignment"))
            if align % _ALIGN:
                raise LayoutError(f"region {i} alignment {align} must be a multiple of {_ALIGN}")
        offset = _align_up(offset, align)
        offsets.append(offset)
        offset += nbytes
    return offsets, _align_up(offset)


def carve(
    buf: torch.Tensor | None, sizes: Sequence[int], aligns: Sequence[int] | None = None
) -> list[torch.Tensor | None]:
    """`buf` cut into one region per size, placed by `plan_regions`.

    The one place a region's start is decided, so every consumer of a shared
    allocation places its regions the same way and none is told offsets.
    `None` in, `None`s out: a pool that owns its memory carves nothing.
    """
    offsets, total = plan_regions(sizes, aligns)
    if buf is None:
        return [None] * len(sizes)
    if buf.dtype is not torch.uint8 or buf.dim() != 1:
        raise LayoutError(
            f"carve needs a 1-D uint8 buffer, got shape {list(buf.shape)} {buf.dtype}; "
            "pass buf.view(-1).view(torch.uint8)"
        )
    # Slicing past the end truncates rather than raising, so a short buffer
    # would come back as a short last region and surface far from its cause.
    if buf.numel() < total:
        raise LayoutError(
            f"a buffer of {buf.numel()} B cannot hold {len(sizes)} regions needing "
            f"{total} B; allocate at least {total} B (plan_regions gives the total)"
        )
    return [buf[start : start + size] for start, size in zip(offsets, sizes, strict=True)]


@dataclass(frozen=True)
class EntryField:
    """One tensor family inside an entry.

    `shape` is what ONE (layer, entry) pair holds: the trailing shape a backend
    passes today, without the leading layer and slot dims.
    """

    name: str
    layers: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    # Initial value. Score states start at -inf so an unwritten ring position
    # loses the softmax; kv states start at zero.
    fill: float = 0.0
    # Byte alignment of the field's offset inside an entry, over and above
    # `_ALIGN`: a field also read as rows of a retyped plane needs its offset
    # on one of those wider rows, or the kernel's row index is off by a
    # fraction of a row and nothing about the view says so.
    align: int = 0
    # Whether a checkpoint image holds this field. All-or-nothing on purpose:
    # a ring carried in *some* rows depends on the checkpoint's phase, which
    # this module is not given and must not guess.
    in_checkpoint: bool = True
    # Which dim of `shape` tensor parallelism splits (the KV-head axis), or
    # None for a field every rank holds whole (MLA's latent KV, recurrent
    # state replicated across ranks). Only `ShardMajorArena` reads it; the
    # other arenas lay the field out unsplit whatever it says.
    tp_axis: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise LayoutError(f"a field name must be a non-empty string, got {self.name!r}")
        _require_int(self.layers, f"{self.name}: layers")
        try:
            shape = tuple(self.shape)
        except TypeError:
            raise LayoutError(
                f"{self.name}: shape must be a sequence of ints, got {self.shape!r}"
            ) from None
        for dim in shape:
            _require_int(dim, f"{self.name}: every shape dim")
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))
        if not isinstance(self.dtype, torch.dtype):
            raise LayoutError(f"{self.name}: dtype must be a torch.dtype, got {self.dtype!r}")
        try:
            fill = float(self.fill)
        except (TypeError, ValueError):
            raise LayoutError(f"{self.name}: fill must be a number, got {self.fill!r}") from None
        if not math.isfinite(fill) and not self.dtype.is_floating_point:
            raise LayoutError(
                f"{self.name}: fill {fill} is not representable in {self.dtype}; "
                "use a floating dtype or a finite fill"
            )
        object.__setattr__(self, "fill", fill)
        _require_int(self.align, f"{self.name}: align")
        if self.align % _ALIGN:
            raise LayoutError(
                f"{self.name}: alignment {self.align} must be a multiple of "
                f"{_ALIGN}, which every field already has"
            )
        if not isinstance(self.in_checkpoint, bool):
            raise LayoutError(
                f"{self.name}: in_checkpoint must be a bool, got {self.in_checkpoint!r}"
            )
        if self.tp_axis is not None:
            axis = _require_int(self.tp_axis, f"{self.name}: tp_axis")
            if axis >= len(shape) or not shape[axis]:
                raise LayoutError(
                    f"{self.name}: tp_axis {axis} names no non-empty dim of shape "
                    f"{list(shape)}; pass the index of the KV-head dim, or None for a "
                    "field every rank holds whole"
                )

    @property
    def per_layer_numel(self) -> int:
        return math.prod(self.shape)

    @property
    def per_layer_bytes(self) -> int:
        """Bytes of one (layer, entry) pair: the unit a layer-major view strides by."""
        return self.per_layer_numel * self.dtype.itemsize

    @property
    def bytes_per_entry(self) -> int:
        """Bytes this field occupies in one entry, across all its layers."""
        return self.layers * self.per_layer_bytes


def field_extents(
    fields: Sequence[EntryField], *, base_align: int = _ALIGN
) -> Iterator[tuple[EntryField, int, int]]:
    """Each field with the `[start, end)` bytes it occupies in an entry.

    The one place the align-place-advance walk is written. `base_align` is the
    boundary every field starts on: `_ALIGN` for our arenas, 1 for SGLang's
    packed page-major envelope (whose views then refuse a field that does not
    start on its own itemsize, as SGLang's asserts do).
    """
    offset = 0
    for field in fields:
        offset = _align_up(offset, max(base_align, field.align))
        yield field, offset, offset + field.bytes_per_entry
        offset += field.bytes_per_entry


def strictest_align(fields: Sequence[EntryField], *, base_align: int = _ALIGN) -> int:
    """The boundary an entry's start (and so its size and stride) must keep.

    Every entry repeats the first one's field offsets, so the strictest field
    alignment has to survive the stride and the buffer's own start as well.
    """
    return max([base_align] + [f.align for f in fields])


def entry_bytes_for(fields: Sequence[EntryField], *, base_align: int = _ALIGN) -> int:
    """Bytes one entry costs, including inter-field alignment.

    Rounded up to the strictest field alignment, not just `_ALIGN`: an entry
    is also the stride of an arena that owns its buffer, and a stride that is
    not a multiple of a field's `align` puts every entry past the first off
    that field's boundary. A free function because sizing runs before any
    allocation exists, and the budget and the allocation must be one
    expression.
    """
    end = 0
    for _, _, field_end in field_extents(fields, base_align=base_align):
        end = field_end
    return _align_up(end, strictest_align(fields, base_align=base_align))


def checkpoint_ranges_for(
    fields: Sequence[EntryField], *, base_align: int = _ALIGN
) -> list[tuple[int, int]]:
    """`(offset, num_bytes)` of an entry a checkpoint image holds.

    Consecutive carried fields merge into one range, padding included
    (splitting to shave padding costs more descriptors than it saves), so the
    all-carried case is one range. A left-out field breaks the run: merging
    across it would put it back in the image. Zero-byte runs are dropped,
    since a zero-length range is not one.
    """
    ranges: list[tuple[int, int]] = []
    extents = field_extents(fields, base_align=base_align)
    for carried, run in groupby(extents, lambda e: e[0].in_checkpoint):
        if not carried:
            continue
        run = list(run)
        start = run[0][1]
        nbytes = run[-1][2] - start
        if nbytes:
            ranges.append((start, nbytes))
    return ranges


def field_view(
    buf: torch.Tensor,
    field: EntryField,
    entries: int,
    *,
    offset: int,
    layer_stride: int,
    entry_stride: int,
) -> torch.Tensor:
    """`[layers, entries, *shape]` view of `field` inside the uint8 `buf`.

    `offset`, `layer_stride` and `entry_stride` are in bytes from the start of
    `buf`; an entry-major arena strides entries by its slot and layers by one
    layer's block, a layer-major one the other way round. Every byte quantity
    must divide by the itemsize, which is checked here so a misfit is a
    `LayoutError` naming the number rather than torch's view error or, worse,
    a silently truncated element offset.

    `as_strided`'s storage offset is ABSOLUTE, so the typed view's own offset
    is added: a buffer carved from a larger one (or SGLang's `raw` at a
    non-zero storage offset) is then addressed from its own start, never from
    the front of the host allocation.
    """
    itemsize = field.dtype.itemsize
    for what, value in (
        ("entry stride", entry_stride),
        ("offset", offset),
        ("layer stride", layer_stride),
        ("buffer storage offset", buf.storage_offset()),
        ("buffer size", buf.numel()),
    ):
        if value % itemsize:
            raise LayoutError(
                f"field {field.name!r} ({field.dtype}, {itemsize} B elements): {what} "
                f"{value} B is not a multiple of {itemsize}; size and place buffers and "
                "fields in whole elements"
            )
    if entries and field.layers and field.per_layer_numel:
        end = (
            offset
            + (field.layers - 1) * layer_stride
            + (entries - 1) * entry_stride
            + field.per_layer_bytes
        )
        if end > buf.numel():
            raise LayoutError(
                f"field {field.name!r} would reach byte {end} of a {buf.numel()} B buffer; "
                f"the buffer must hold at least {end} B"
            )
    typed = buf.view(field.dtype)
    inner: tuple[int, ...] = ()
    acc = 1
    for dim in reversed(field.shape):
        inner = (acc,) + inner
        acc *= dim
    return typed.as_strided(
        (field.layers, entries) + field.shape,
        (layer_stride // itemsize, entry_stride // itemsize) + inner,
        typed.storage_offset() + offset // itemsize,
    )


def check_buffer(buf: torch.Tensor, want: int, align: int) -> None:
    """Refuse a caller's buffer an arena cannot address `want` bytes of."""
    if not isinstance(buf, torch.Tensor):
        raise LayoutError(f"buf must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype is not torch.uint8 or buf.dim() != 1 or buf.numel() < want:
        raise LayoutError(
            f"buf must be a 1-D uint8 tensor of at least {want} B, got shape "
            f"{list(buf.shape)} {buf.dtype}"
        )
    if not buf.is_contiguous():
        raise LayoutError("buf must be contiguous; pass a contiguous slice of the allocation")
    if buf.storage_offset() % align:
        raise LayoutError(
            f"buf must start on a {align} B boundary, got storage offset "
            f"{buf.storage_offset()}: field views retype the buffer, which needs the "
            "offset to divide every itemsize and field alignment (carve it with `carve`)"
        )
