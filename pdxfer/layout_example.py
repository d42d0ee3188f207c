"""`pdxfer layout --example`: the entry maps of an example hybrid model, printed.

A reader deciding whether entry-major arenas pay off wants to see, for one
concrete model, where every field sits in an entry, what a checkpoint image
carries, and how many segments one request costs entry-major versus
layer-major. This module builds that model's pools and asks `layout` — it
computes nothing itself, so what it prints is what the transport would do.

The pools live on the `meta` device: the arithmetic is the real one, and
printing a map of gigabytes allocates nothing.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import numpy as np
import torch

from pdxfer.layout import (
    EntryField,
    EntryMajorArena,
    LayerMajorArena,
    PageMajorMambaArena,
    PageMajorMHAArena,
    describe,
    fingerprint,
    plan_segments,
)

from .cliargs import bounded_int

_META = torch.device("meta")

# The example model: 4 full-attention layers with paged MHA KV, 12 GDN layers
# with a conv + temporal recurrent state, 4 layers with DeepSeek-V4-style
# compressor state.
ATTN_LAYERS, KV_HEADS, HEAD_DIM, PAGE_SIZE, PAGES = 4, 8, 128, 16, 1024
GDN_LAYERS, CONV_DIM, CONV_KERNEL, GDN_HEADS, GDN_K, GDN_V = 12, 2048, 4, 16, 128, 128
CMP_LAYERS, STATE_SLOTS = 4, 64


def kv_fields() -> list[EntryField]:
    """Paged MHA KV: one entry is one page of `PAGE_SIZE` tokens."""
    shape = (PAGE_SIZE, KV_HEADS, HEAD_DIM)
    return [
        EntryField("k", ATTN_LAYERS, shape, torch.bfloat16),
        EntryField("v", ATTN_LAYERS, shape, torch.bfloat16),
    ]


def gdn_fields() -> list[EntryField]:
    """GDN recurrent state: one entry is one request's slot."""
    return [
        EntryField("conv", GDN_LAYERS, (CONV_DIM, CONV_KERNEL - 1), torch.bfloat16),
        EntryField("temporal", GDN_LAYERS, (GDN_HEADS, GDN_K, GDN_V), torch.float32),
    ]


def compressor_fields() -> list[EntryField]:
    """DeepSeek-V4-style compressor `kv_state`/`score_state` pairs, three flavors.

    Scores start at -inf so an unwritten ring position loses the softmax. One
    field is left out of checkpoints (its resumer rewrites every row it reads),
    so the map shows a checkpoint image split around it.
    """
    fields = []
    for flavor, ring, width in (("csa", 8, 512), ("hca", 128, 512), ("idx", 8, 128)):
        fields.append(
            EntryField(
                f"{flavor}_kv_state", CMP_LAYERS, (ring, width), torch.float32,
                in_checkpoint=flavor != "hca",
            )
        )
        fields.append(
            EntryField(
                f"{flavor}_score_state", CMP_LAYERS, (ring, width), torch.float32,
                fill=float("-inf"),
            )
        )
    return fields


def _entry_map(name: str, arena: EntryMajorArena, note: str) -> list[str]:
    desc = describe(arena)
    lines = [
        f"pool {name} ({desc['kind']}; {note})",
        f"  entries {arena.entries}, entry_bytes {arena.entry_bytes}, "
        f"slot_stride {arena.slot_stride}, fingerprint {fingerprint(desc)[:16]}",
        f"  {'field':<18}{'layers':>7}  {'shape':<16}{'dtype':<16}{'fill':>6}{'align':>7}"
        f"{'ckpt':>6}{'offset':>10}{'bytes':>10}",
    ]
    for field in arena.fields:
        lines.append(
            f"  {field.name:<18}{field.layers:>7}  {str(field.shape):<16}{str(field.dtype):<16}"
            f"{field.fill:>6}{field.align:>7}{'yes' if field.in_checkpoint else 'no':>6}"
            f"{arena.field_offset(field.name):>10}{field.bytes_per_entry:>10}"
        )
    lines.append(f"  checkpoint ranges (offset, bytes): {arena.checkpoint_ranges}")
    return lines


def _segments(arena, src: np.ndarray, dst: np.ndarray, **kw) -> int:
    return sum(t.shape[0] for t in plan_segments(arena, src, dst, **kw))


def _request_line(
    label: str, entry: EntryMajorArena, layer: LayerMajorArena, src: Sequence[int],
    dst: Sequence[int],
) -> str:
    s, d = np.asarray(src), np.asarray(dst)
    return (
        f"  request {label} {list(src)} -> {list(dst)}: entry-major "
        f"{_segments(entry, s, d)} segment(s) "
        f"({_segments(entry, s, d, checkpoint=True)} as a checkpoint image), "
        f"layer-major {_segments(layer, s, d)}"
    )


def build_report(pages: Sequence[int], slot: int) -> str:
    """The whole printout for a request holding `pages` and state slot `slot`."""
    dst_pages = list(range(len(pages)))
    out = [
        f"example hybrid model: {ATTN_LAYERS} attention layers (paged MHA KV, page_size "
        f"{PAGE_SIZE}), {GDN_LAYERS} GDN layers (conv + temporal state), {CMP_LAYERS} "
        "compressor layers (DeepSeek-V4-style kv_state/score_state pairs)",
        f"one request: KV pages {list(pages)} and state slot {slot}, shipped to pages "
        f"{dst_pages} and slot 0 on the decode side",
        "",
    ]
    pools = (
        ("kv", kv_fields(), PAGES, "one entry = one page", pages, dst_pages),
        ("gdn_state", gdn_fields(), STATE_SLOTS, "one entry = one request slot", [slot], [0]),
        ("compressor_state", compressor_fields(), STATE_SLOTS, "one entry = one request slot",
         [slot], [0]),
    )
    for name, fields, entries, note, src, dst in pools:
        entry = EntryMajorArena(fields, entries, _META)
        layer = LayerMajorArena(fields, entries, _META)
        out += _entry_map(name, entry, note)
        out.append(_request_line("entries", entry, layer, src, dst))
        out.append("")

    mha = PageMajorMHAArena(
        ATTN_LAYERS, KV_HEADS, HEAD_DIM, HEAD_DIM, torch.bfloat16, PAGE_SIZE, PAGES, _META
    )
    s, d = np.asarray(pages), np.asarray(dst_pages)
    out.append(
        f"pool kv as SGLang page-major (page_major_mha): page bytes {mha.entry_bytes}, "
        f"{len(mha.fields)} fields (k/v per layer), request pages {list(pages)}: "
        f"{_segments(mha, s, d)} segment(s)"
    )
    mamba = PageMajorMambaArena(
        GDN_LAYERS, [(CONV_DIM, CONV_KERNEL - 1)], torch.bfloat16,
        (GDN_HEADS, GDN_K, GDN_V), torch.float32, STATE_SLOTS, _META,
    )
    out.append(
        f"pool gdn_state as SGLang page-major (page_major_mamba): slot bytes "
        f"{mamba.entry_bytes}, request slot {slot}: "
        f"{_segments(mamba, np.asarray([slot]), np.asarray([0]))} segment(s)"
    )
    return "\n".join(out)


def _indices(text: str) -> list[int]:
    try:
        pages = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    bad = [p for p in pages if not 0 <= p < PAGES]
    if bad or not pages or len(set(pages)) != len(pages):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give 1..{PAGES} distinct pages, each 0..{PAGES - 1}"
            + (f" ({bad[0]} is not)" if bad else "")
        )
    return pages


def main(argv: list[str] | None = None) -> int:
    """`pdxfer layout --example [--pages 3,4,9] [--slot 5]`."""
    parser = argparse.ArgumentParser(
        prog="pdxfer layout", description="print the entry maps of an example hybrid model"
    )
    parser.add_argument("--example", action="store_true", help="print the example model's pools")
    parser.add_argument(
        "--pages", type=_indices, default=[3, 4, 5, 9],
        help=f"KV pages one request holds, each 0..{PAGES - 1} (comma-separated; default 3,4,5,9)",
    )
    parser.add_argument("--slot", type=bounded_int(0, STATE_SLOTS - 1), default=5,
                        help=f"the request's state slot, 0..{STATE_SLOTS - 1}")
    args = parser.parse_args(argv)
    if not args.example:
        # The only report there is today; saying so beats printing a bare usage.
        parser.error("nothing to print: pass --example to print the example model's pools "
                     "(the only layout report so far)")
    print(build_report(args.pages, args.slot))
    return 0
