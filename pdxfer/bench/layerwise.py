"""`pdxfer bench layerwise`: how much of the transfer streamed layer groups hide behind the forward pass.

A prefill computes its layers in order. Sending whole entries waits for the
last layer, so the whole transfer sits between the forward pass and the
decode's first token; streaming (`PrefillEngine.send(layers=(a, b))`, #33)
ships each group of layers as soon as it is computed, and only the last
group's transfer is left exposed. Over a `LayerInterleavedArena` (each
entry `[layer 0: K V][layer 1: K V]...`) a group is ONE byte range per page,
so a request costs entries x groups descriptors, never entries x layers x
fields.

Per backend and prompt size (512..16k tokens, 16-token pages of
`--layers` layers of K and V, 2 heads x 64 dims fp16: 512 B per token and
layer), one request per mode:

- `whole`: compute every layer, then one `send` of every page;
- `G groups` (2, 4, 8, and one per layer): compute a group's layers, send
  that layer range of every page (`ready` is the group's end), repeat;
- `transfer only`: no compute; send and wait: the transfer time itself.

Compute is emulated at a stated cost, `--us-per-token-layer` microseconds
per token per layer (default 4.0: 4k tokens through 32 layers in 0.5 s, a
large model's prefill on one GPU; what matters is the ratio to the transfer,
which `transfer only` shows beside it: on this toy's 512 B per token and
layer it is the ratio an RDMA deployment of a real model sees), as a sleep: the
prefill's host thread is idle while a GPU computes, which is when a
streamed send runs. The GPU's timeline is its own: group g is computed at
start + g's layers x cost, however late the host woke or long it spent in
`send` (the host enqueues; it does not wait for the device). `total ms` is from the prefill's first layer to the
decode holding every byte (`wait` returned Success), `exposed ms` from the
end of the last layer to then; `added ms` = total - compute, what the
transfer added to the forward pass (it counts a send that blocks the host,
as loopback's inline copy does, which `exposed` would not), and `hidden` =
1 - added / added(whole): the share of the whole-entry transfer's cost the
stream took off the time to first token. `descriptors` are the
request's segment-table rows (`RequestStats.segments`), beside entries x
groups. Every request's pages are compared byte for byte with the source.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

from .. import layout
from ..cliargs import bounded_float, bounded_int
from ..config import EngineConfig
from ..decode import DecodeEngine
from ..integrations.layer_stream import group_ends
from ..prefill import PrefillEngine
from . import report as br

PAGE = 16  # tokens per page
SIZES = (512, 1024, 2048, 4096, 8192, 16384)
TINY_SIZES = (512, 2048)


def fields(layers: int) -> list[layout.EntryField]:
    """A page: `layers` layers of K and V, 16 tokens x 2 heads x 64 dims fp16 each."""
    shape = (PAGE, 2, 64)
    return [layout.EntryField("k", layers, shape, torch.float16),
            layout.EntryField("v", layers, shape, torch.float16)]


def modes(layers: int, tiny: bool) -> list[tuple[str, int]]:
    """`(name, groups)`; 0 groups: transfer only, 1: whole entries."""
    groups = [g for g in (2, 4, 8) if g < layers] + [layers]
    if tiny:
        groups = [4]
    return [("transfer only", 0), ("whole", 1)] + [
        (f"{g} groups" if g < layers else f"per layer ({g})", g) for g in groups]


def bounds(layers: int, groups: int) -> list[tuple[int, int]]:
    """`groups` contiguous layer ranges covering `[0, layers)`, as even as integers allow."""
    ends = group_ends(layers, groups)
    return list(zip([0, *ends[:-1]], ends, strict=True))


def _one(prefill: PrefillEngine, decode: DecodeEngine, rid: str, src: np.ndarray, dst: np.ndarray,
         layers: int, groups: int, layer_s: float) -> tuple[float, float, int]:
    """One request; `(total s, exposed s, descriptors)`."""
    decode.expect(rid, prefill.bootstrap_address, {"kv": dst})
    t0 = time.monotonic()
    if groups == 0:
        t_last = t0
        prefill.send(rid, {"kv": src})
    elif groups == 1:
        _until(t0 + layer_s * layers)
        t_last = time.monotonic()
        prefill.send(rid, {"kv": src})
    else:
        for a, b in bounds(layers, groups):
            _until(t0 + layer_s * b)  # the GPU has computed layers a..b-1 by then
            t_last = time.monotonic()
            prefill.send(rid, {"kv": src}, layers=(a, b))
    decode.wait(rid, 120.0)
    t_done = time.monotonic()
    prefill.wait(rid, 60.0)
    segments = prefill.stats(rid).segments
    prefill.release(rid)
    decode.release(rid)
    return t_done - t0, t_done - t_last, segments


def _until(deadline: float) -> None:
    """Sleep until `deadline` on the monotonic clock: the emulated GPU computes on a timeline of
    its own, which neither a late wake-up nor the time a send takes on the host shifts."""
    left = deadline - time.monotonic()
    if left > 0:
        time.sleep(left)


def _check(src_pool, dst_pool, src: np.ndarray, dst: np.ndarray, what: str) -> None:
    s, d = torch.as_tensor(src), torch.as_tensor(dst)
    for name in ("k", "v"):
        got = dst_pool.view(name)[:, d].contiguous().view(torch.int16)
        want = src_pool.view(name)[:, s].contiguous().view(torch.int16)
        if not torch.equal(got, want):
            raise SystemExit(f"{what}: the decode's pages differ from the prefill's")


def run(backends: list[str], sizes: tuple[int, ...], layers: int, us: float, reps: int, tiny: bool,
        out, report: br.Report, width: int = 0) -> list[dict]:
    """Every backend x size x mode; print one table and its legend; return its rows."""
    pages_max = max(sizes) // PAGE
    n = 2 * pages_max
    rng = np.random.default_rng(0)
    columns = ["backend", "tokens", "mode", "compute ms", "total ms", "exposed ms", "added ms", "hidden",
               "descriptors", "entries x groups"]
    emit = br.markdown(columns, out, width, keys=3)
    all_modes = modes(layers, tiny)
    progress = br.Progress(len(backends) * len(sizes) * (reps + 1), "rounds")
    rows = []
    for backend in backends:
        src_pool = layout.LayerInterleavedArena(fields(layers), n, "cpu")
        dst_pool = layout.LayerInterleavedArena(fields(layers), n, "cpu")
        raw = layout.arena_buffers(src_pool)[0]
        raw.copy_(torch.from_numpy(rng.integers(0, 256, raw.numel(), dtype=np.uint8)))
        cfg = EngineConfig(transport=backend, timeout=60.0)
        prefill = PrefillEngine({"kv": src_pool}, cfg)
        decode = DecodeEngine({"kv": dst_pool}, cfg)
        try:
            for tokens in sizes:
                pages = tokens // PAGE
                layer_s = us * 1e-6 * tokens
                got: dict[str, list[tuple[float, float, int]]] = {m: [] for m, _ in all_modes}
                for i in range(reps + 1):
                    src, dst = rng.permutation(n)[:pages], rng.permutation(n)[:pages]
                    for name, groups in all_modes:
                        rid = f"{backend}-{tokens}-{name}-{i}"
                        r = _one(prefill, decode, rid, src, dst, layers, groups, layer_s)
                        _check(src_pool, dst_pool, src, dst, rid)
                        if i:  # round 0 warms the connection and the allocator
                            got[name].append(r)
                    progress.step(f"{backend} {tokens} tokens round {i}")
                med = {m: (statistics.median(t for t, _, _ in v), statistics.median(e for _, e, _ in v),
                           v[0][2]) for m, v in got.items()}
                for name, groups in all_modes:
                    total, exposed, segs = med[name]
                    compute = 0.0 if groups == 0 else layer_s * layers * 1e3
                    whole_added = med["whole"][0] - layer_s * layers
                    added = total - compute / 1e3
                    hidden = None if groups < 2 else 1 - added / whole_added
                    row = {"backend": backend, "tokens": tokens, "mode": name, "groups": groups,
                           "compute_ms": compute, "total_ms": total * 1e3,
                           "exposed_ms": exposed * 1e3, "added_ms": added * 1e3, "hidden": hidden,
                           "descriptors": segs,
                           "entries_x_groups": pages * max(groups, 1)}
                    rows.append(row)
                    report.sample(backend=backend, tokens=tokens, mode=name,
                                  seconds=[list(r) for r in got[name]])
                    emit({"backend": backend, "tokens": str(tokens), "mode": name,
                          "compute ms": f"{compute:.1f}", "total ms": f"{total * 1e3:.1f}",
                          "exposed ms": f"{exposed * 1e3:.2f}", "added ms": f"{added * 1e3:.2f}",
                          "hidden": "" if hidden is None else f"{hidden:.0%}",
                          "descriptors": str(segs), "entries x groups": str(row["entries_x_groups"])})
        finally:
            decode.close()
            prefill.close()
    emit.close()
    meanings = {
        "backend": "transport of both engines (one process)",
        "tokens": f"prompt tokens: {PAGE}-token pages of {layers} layers x (K, V), 512 B per token "
                  "and layer, scattered on both sides",
        "mode": "whole: compute every layer, then one send; G groups: compute a group, send that "
                "layer range of every page; transfer only: no compute",
        "compute ms": f"emulated forward pass: {us} us per token per layer, slept (a GPU computing)",
        "total ms": "median ms from the prefill's first layer to the decode holding every byte",
        "exposed ms": "median ms from the end of the last layer to the decode holding every byte",
        "added ms": "total ms - compute ms: what the transfer added to the forward pass",
        "hidden": "share of the whole-entry transfer's added time the stream hid: "
                  "1 - added / added(whole)",
        "descriptors": "segment-table rows the request posted (RequestStats.segments)",
        "entries x groups": "pages x send() calls: the bound streamed descriptors stay within",
    }
    report.finish(meanings, columns, rows, out)
    return rows


def plot(rows: list[dict], path, note: str) -> None:
    """Total ms (left) and exposed ms (right) against prompt tokens, one series per backend x mode."""

    def draw(plt) -> None:
        _, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharex=True)
        series = sorted({(r["backend"], r["groups"], r["mode"]) for r in rows})
        for backend, _, mode in series:
            mine = sorted((r for r in rows if r["backend"] == backend and r["mode"] == mode),
                          key=lambda r: r["tokens"])
            xs = [r["tokens"] for r in mine]
            axes[0].plot(xs, [r["total_ms"] for r in mine], label=f"{backend} {mode}")
            axes[1].plot(xs, [max(r["exposed_ms"], 1e-3) for r in mine], label=f"{backend} {mode}")
        axes[0].set_title("prefill start to the decode holding every byte", fontsize=9)
        axes[1].set_title("exposed: end of the last layer to the decode holding every byte", fontsize=9)
        axes[0].set_ylabel("ms (log)")
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("prompt tokens")
            ax.set_xticks(sorted({r["tokens"] for r in rows}))
            ax.set_xticklabels([str(t) for t in sorted({r["tokens"] for r in rows})])

    br.figure(path, draw, "pdxfer bench layerwise: whole entries vs streamed layer groups", note)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `pdxfer bench layerwise`."""
    parser = argparse.ArgumentParser(prog="pdxfer bench layerwise", description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=bounded_int(2, 256), default=32, help="model layers (2..256)")
    parser.add_argument("--us-per-token-layer", type=bounded_float(0.0, 1000.0), default=4.0,
                        help="emulated compute: microseconds per token per layer (0..1000)")
    parser.add_argument("--tokens", default=",".join(map(str, SIZES)),
                        help="comma-separated prompt sizes in tokens (multiples of 16, 16..65536)")
    parser.add_argument("--reps", type=bounded_int(1, 1000), default=3, help="timed requests per point (median)")
    parser.add_argument("--backends", default=None, help="comma-separated backends (default: every installed)")
    parser.add_argument("--tiny", action="store_true",
                        help="512 and 2048 tokens, 8 layers, whole vs 4 groups, one timed request: a smoke run")
    br.add_output_args(parser)
    args = parser.parse_args(argv)
    try:
        sizes = tuple(int(t) for t in args.tokens.split(","))
    except ValueError:
        parser.error(f"--tokens: {args.tokens!r} is not a comma-separated list of ints")
    if any(t < PAGE or t % PAGE or t > 65536 for t in sizes):
        parser.error(f"--tokens: every size must be a multiple of {PAGE} in {PAGE}..65536, got {args.tokens}")
    if args.tiny:
        sizes, args.layers, args.reps = TINY_SIZES, 8, 1
    backends = br.backends_arg(parser, args.backends, tiny=args.tiny)
    br.check_outputs(parser, args)
    report = br.Report("layerwise", backends, {"layers": args.layers, "tokens": list(sizes),
                                               "us_per_token_layer": args.us_per_token_layer,
                                               "reps": args.reps})
    print(f"# pdxfer bench layerwise: {args.layers} layers, {args.us_per_token_layer} us per token "
          f"per layer, median of {args.reps}")
    print(br.machine_line())
    rows = run(backends, sizes, args.layers, args.us_per_token_layer, args.reps, args.tiny,
               lambda line: print(line, flush=True), report, br.terminal_width(args.width))
    report.write(args.json, report.data["columns"])
    if args.plot is not None:
        plot(rows, args.plot, report.note(f"{args.layers} layers, {args.us_per_token_layer} us per "
                                          f"token-layer, median of {args.reps}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
