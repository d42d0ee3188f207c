"""SGLang's page-major envelope, byte for byte, as entry-major arenas over a packed walk.

SGLang keeps all layers of a pool in one uint8 buffer cut into pages; inside a
page each layer's K block (`page_size` rows) is followed by its V block:

    page = [L0_K × ps | L0_V × ps | L1_K × ps | L1_V × ps | ...]

and a Mamba slot is `[conv[0] × layers][conv[1] × layers]...[temporal ×
layers]`. Both are exactly an entry-major arena (entry = page, or slot) whose
fields are placed by `field_extents` with no inter-field padding
(`base_align=1`): MHA as one field per (layer, K|V) with `layers=1` and shape
`(page_size, heads, dim)`, Mamba as one field per state tensor with
`layers=layer_num`. So the views, the segment planning, `describe` and the
checks are the ones every other arena gets, not a second walk.

The builders keep SGLang's names and keyword arguments so a worker can swap
them in, with two deliberate differences:
- `anchor_bytes` counts from the start of `raw`. SGLang passes it straight to
  `as_strided`, whose storage offset is absolute, so a `raw` that is itself a
  slice at a non-zero storage offset lands its views at the wrong bytes.
- validation raises `LayoutError` (a `ValueError`) with the numbers and the
  fix instead of `assert`, which `python -O` strips; a `raw` too small for
  the pool is refused too, where SGLang's views would read past it.

The pools (`PageMajorMHAArena`, `PageMajorMambaArena`) own or wrap the buffer;
their `buf` is the pool's own region `raw[anchor : anchor + total]`, so
segment offsets count from the pool, and two pools carved at different
anchors describe (and fingerprint) the same.

Deletion condition: the builders go once the serving engine allocates its
pools as `EntryMajorArena`s itself; the pools stay while kernels read
SGLang's page-major views.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .arenas import EntryMajorArena
from .errors import LayoutError
from .fields import EntryField, _require_int, entry_bytes_for

# Packed: SGLang puts every field right after the previous one. A field that
# then does not start on its own itemsize is refused by `field_view`, as
# SGLang's asserts refuse it.
_PACKED = 1

_DTYPE_OF_ITEMSIZE = {1: torch.uint8, 2: torch.float16, 4: torch.float32, 8: torch.float64}


def mha_page_fields(
    *,
    layer_num: int,
    head_num: int,
    head_dim: int,
    v_head_dim: int,
    store_dtype: torch.dtype,
    page_size: int,
) -> list[EntryField]:
    """The MHA page as fields `k0, v0, k1, v1, ...`, one per layer and side."""
    layer_num = _require_int(layer_num, "layer_num")
    page_size = _require_int(page_size, "page_size", minimum=1)
    fields = []
    for layer in range(layer_num):
        fields.append(EntryField(f"k{layer}", 1, (page_size, head_num, head_dim), store_dtype))
        fields.append(EntryField(f"v{layer}", 1, (page_size, head_num, v_head_dim), store_dtype))
    return fields


def mamba_slot_fields(
    *,
    layer_num: int,
    conv_state_shapes: Sequence[Sequence[int]],
    conv_dtype: torch.dtype,
    temporal_state_shape: Sequence[int],
    temporal_dtype: torch.dtype,
) -> list[EntryField]:
    """The Mamba slot as fields `conv0, conv1, ..., temporal`, each over all layers."""
    layer_num = _require_int(layer_num, "layer_num")
    fields = [
        EntryField(f"conv{i}", layer_num, tuple(shape), conv_dtype)
        for i, shape in enumerate(conv_state_shapes)
    ]
    fields.append(EntryField("temporal", layer_num, tuple(temporal_state_shape), temporal_dtype))
    return fields


def mha_entry_bytes(
    *, layer_num: int, head_num: int, head_dim: int, v_head_dim: int, itemsize: int
) -> int:
    """Bytes one slot occupies across all layers (K and V), as SGLang counts them."""
    if itemsize not in _DTYPE_OF_ITEMSIZE:
        raise LayoutError(f"itemsize {itemsize!r} must be one of {sorted(_DTYPE_OF_ITEMSIZE)}")
    fields = mha_page_fields(
        layer_num=layer_num,
        head_num=head_num,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        store_dtype=_DTYPE_OF_ITEMSIZE[itemsize],
        page_size=1,
    )
    return entry_bytes_for(fields, base_align=_PACKED)


def mamba_entry_bytes(
    *,
    layer_num: int,
    conv_state_shapes: Sequence[Sequence[int]],
    conv_dtype: torch.dtype,
    temporal_state_shape: Sequence[int],
    temporal_dtype: torch.dtype,
) -> int:
    """Bytes one Mamba slot occupies across all layers (conv + temporal)."""
    fields = mamba_slot_fields(
        layer_num=layer_num,
        conv_state_shapes=conv_state_shapes,
        conv_dtype=conv_dtype,
        temporal_state_shape=temporal_state_shape,
        temporal_dtype=temporal_dtype,
    )
    return entry_bytes_for(fields, base_align=_PACKED)


def _pool_region(
    raw: torch.Tensor | None, anchor_bytes: int, want: int, device: torch.device | str | None
) -> torch.Tensor:
    """The pool's own bytes: a fresh zeroed buffer, or `raw[anchor : anchor + want]`."""
    anchor_bytes = _require_int(anchor_bytes, "anchor_bytes")
    if raw is None:
        if anchor_bytes:
            raise LayoutError(
                f"anchor_bytes {anchor_bytes} places a pool inside a caller's buffer; "
                "pass buf=raw, or anchor_bytes=0 for a pool that owns its memory"
            )
        return torch.zeros(want, dtype=torch.uint8, device=device)
    if not isinstance(raw, torch.Tensor) or raw.dtype is not torch.uint8 or raw.dim() != 1:
        raise LayoutError(
            "raw must be a 1-D uint8 tensor, got "
            f"{list(raw.shape) if isinstance(raw, torch.Tensor) else type(raw).__name__} "
            f"{getattr(raw, 'dtype', '')}".rstrip()
        )
    if not raw.is_contiguous():
        raise LayoutError("raw must be contiguous; pass the pool's allocation or a slice of it")
    if raw.numel() < anchor_bytes + want:
        raise LayoutError(
            f"raw of {raw.numel()} B cannot hold a {want} B pool at anchor_bytes "
            f"{anchor_bytes}; it needs at least {anchor_bytes + want} B"
        )
    return raw[anchor_bytes : anchor_bytes + want]


def _check_anchor(raw: torch.Tensor | None, anchor_bytes: int, dtypes: Sequence[torch.dtype]) -> None:
    """Name `anchor_bytes` when it is what puts a view off its itemsize."""
    if raw is None:
        return
    start = raw.storage_offset() + anchor_bytes
    for dtype in dtypes:
        if start % dtype.itemsize:
            raise LayoutError(
                f"anchor_bytes {anchor_bytes} (raw at storage offset {raw.storage_offset()}) "
                f"puts the pool at byte {start}, not a multiple of the {dtype.itemsize} B "
                f"itemsize of {dtype}; anchor the pool on a whole element"
            )


class _SGLangEnvelope(EntryMajorArena):
    """What both page-major kinds share: the page geometry in the description, and no layer ranges."""

    geometry: dict[str, Any]

    def description(self) -> dict[str, Any]:
        """The entry-major keys, plus the page geometry SGLang's pool was built from."""
        desc = super().description()
        desc["page"] = dict(self.geometry)
        return desc

    def _spans(self, checkpoint: bool, layers: tuple[int, int] | None) -> list[tuple[int, int]]:
        """No `layers` here: each layer is a field of its own (`k0`, `conv0`, ...), so a
        layer range by field layer index would mean every field's only layer."""
        if layers is not None:
            raise LayoutError(
                f"{type(self).__name__} declares each layer as a field of its own, so it cannot "
                f"ship a layer range {layers!r}; ship whole pages (layers=None)"
            )
        return super()._spans(checkpoint, None)


class PageMajorMHAArena(_SGLangEnvelope):
    """A paged MHA KV pool in SGLang's page-major layout; one entry is one page.

    `k_buffer[l]` / `v_buffer[l]` are `(num_pages, page_size, head_num,
    head_dim)` views, exactly SGLang's. A page is contiguous, so a request's
    pages ship as one segment per run of pages.
    """

    kind = "page_major_mha"

    def __init__(
        self,
        layer_num: int,
        head_num: int,
        head_dim: int,
        v_head_dim: int,
        store_dtype: torch.dtype,
        page_size: int,
        num_pages: int,
        device: torch.device | str | None,
        buf: torch.Tensor | None = None,
        anchor_bytes: int = 0,
    ) -> None:
        fields = mha_page_fields(
            layer_num=layer_num,
            head_num=head_num,
            head_dim=head_dim,
            v_head_dim=v_head_dim,
            store_dtype=store_dtype,
            page_size=page_size,
        )
        num_pages = _require_int(num_pages, "num_pages")
        want = num_pages * entry_bytes_for(fields, base_align=_PACKED)
        region = _pool_region(buf, anchor_bytes, want, device)
        _check_anchor(buf, anchor_bytes, [store_dtype])
        # Never filled: every fill is 0, an owned buffer is zeroed, and a
        # caller's raw may already hold KV.
        self._setup(fields, num_pages, device, region, None, None, base_align=_PACKED, fill=False)
        self.raw = region if buf is None else buf
        self.anchor_bytes = anchor_bytes
        self.geometry = {
            "layer_num": layer_num,
            "head_num": head_num,
            "head_dim": head_dim,
            "v_head_dim": v_head_dim,
            "store_dtype": str(store_dtype),
            "page_size": page_size,
        }
        self.page_size = page_size
        self.num_pages = num_pages
        self.k_buffer = [self.view(f"k{layer}")[0] for layer in range(layer_num)]
        self.v_buffer = [self.view(f"v{layer}")[0] for layer in range(layer_num)]



class PageMajorMambaArena(_SGLangEnvelope):
    """A Mamba/GDN state pool in SGLang's per-slot envelope; one entry is one slot.

    `conv[i]` and `temporal` are `(layer_num, max_slots, *shape)` views, as
    `MambaPool.State` holds them. Mamba state is token-granular (page = slot).
    """

    kind = "page_major_mamba"

    def __init__(
        self,
        layer_num: int,
        conv_state_shapes: Sequence[Sequence[int]],
        conv_dtype: torch.dtype,
        temporal_state_shape: Sequence[int],
        temporal_dtype: torch.dtype,
        max_slots: int,
        device: torch.device | str | None,
        buf: torch.Tensor | None = None,
        anchor_bytes: int = 0,
    ) -> None:
        fields = mamba_slot_fields(
            layer_num=layer_num,
            conv_state_shapes=conv_state_shapes,
            conv_dtype=conv_dtype,
            temporal_state_shape=temporal_state_shape,
            temporal_dtype=temporal_dtype,
        )
        max_slots = _require_int(max_slots, "max_slots")
        want = max_slots * entry_bytes_for(fields, base_align=_PACKED)
        region = _pool_region(buf, anchor_bytes, want, device)
        _check_anchor(buf, anchor_bytes, [conv_dtype, temporal_dtype])
        self._setup(fields, max_slots, device, region, None, None, base_align=_PACKED, fill=False)
        self.raw = region if buf is None else buf
        self.anchor_bytes = anchor_bytes
        self.geometry = {
            "layer_num": layer_num,
            "conv_state_shapes": [list(f.shape) for f in fields[:-1]],
            "conv_dtype": str(conv_dtype),
            "temporal_state_shape": list(fields[-1].shape),
            "temporal_dtype": str(temporal_dtype),
            "page_size": 1,
        }
        self.page_size = 1
        self.max_slots = max_slots
        self.conv = [self.view(f"conv{i}") for i in range(len(fields) - 1)]
        self.temporal = self.view("temporal")



def build_page_major_mha_views(
    raw: torch.Tensor,
    *,
    layer_num: int,
    head_num: int,
    head_dim: int,
    v_head_dim: int,
    store_dtype: torch.dtype,
    page_size: int,
    num_pages: int,
    anchor_bytes: int = 0,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer K/V views over `raw`, SGLang's builder with `anchor_bytes` from `raw`'s start.

    Each view is `(num_pages, page_size, head_num, head_dim)`; token `t` reads
    page `t // page_size`, slot `t % page_size`.
    """
    if not isinstance(raw, torch.Tensor):
        raise LayoutError(f"raw must be a torch.Tensor, got {type(raw).__name__}")
    pool = PageMajorMHAArena(
        layer_num, head_num, head_dim, v_head_dim, store_dtype, page_size, num_pages,
        raw.device, buf=raw, anchor_bytes=anchor_bytes,
    )
    return pool.k_buffer, pool.v_buffer


def build_page_major_mamba_views(
    raw: torch.Tensor,
    *,
    layer_num: int,
    conv_state_shapes: Sequence[Sequence[int]],
    conv_dtype: torch.dtype,
    temporal_state_shape: Sequence[int],
    temporal_dtype: torch.dtype,
    max_slots: int,
    anchor_bytes: int = 0,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per-slot Mamba conv/temporal views over `raw`, SGLang's builder with our anchor."""
    if not isinstance(raw, torch.Tensor):
        raise LayoutError(f"raw must be a torch.Tensor, got {type(raw).__name__}")
    pool = PageMajorMambaArena(
        layer_num, conv_state_shapes, conv_dtype, temporal_state_shape, temporal_dtype,
        max_slots, raw.device, buf=raw, anchor_bytes=anchor_bytes,
    )
    return pool.conv, pool.temporal
