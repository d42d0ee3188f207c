"""One prepared GPU check: `make gpu-check` (or `python -m examples.gpu_check --out DIR`).

Why it exists: GPU machines are lent rarely and briefly, so everything a GPU
must confirm is prepared here, runs in one go (a few minutes on one GPU with
no NIC) and leaves its figures behind as `gpu_check.json` + `gpu_check.md`
in `--out`, plus the UCX logs that say which transport carried NIXL's
bytes. Sections (each runs even if an earlier one failed; failures are
recorded, never hidden):

- attributes: the device, and the driver attributes the verbs/GPUDirect path
  needs (dma-buf, GPUDirect RDMA support, write ordering, flush options);
- copies: device-to-device baselines for the 64 x 4 MiB, 4096 x 64 KiB and
  65,536 x 4 KiB tables — one contiguous copy of the same bytes, the batched
  gather (`transport.device_copy`) and the one-copy-per-row loop it replaces;
- loopback, tcp: CUDA → CUDA round trips through each backend (tcp bounces
  through pinned host memory), bytes checked, GB/s;
- ucx: CUDA → CUDA round trips through `ucx-all` (UCXX over UCX's full
  list: cuda_copy / cuda_ipc), bytes checked, GB/s;
- nixl: VRAM → VRAM between two processes (`nixl-all`: UCX's full list),
  GB/s and the ratio to the device copy (goal: >= 0.8x on the 4 MiB rows),
  with the transports UCX reported (`UCX_PROTO_INFO`);
- verbs (only where an RDMA port is ACTIVE; skipped with the reason
  elsewhere): GPU → GPU writes through dma-buf MRs, GB/s and the ratio to
  the device copy, the port and GID the engine chose, the NIC each GPU's
  memory gets, and what one `cuFlushGPUDirectRDMAWrites` costs;
- engine: a PD request through Prefill/DecodeEngine over CUDA pools;
- demo: `examples.launch_pd --device cuda`, its own identical-output check.

`--device cpu` runs the very same code on host memory (the test suite does,
with `--quick`, so the script cannot rot between GPU loans). Without CUDA and
without `--device cpu` it refuses with a clear message (exit 2).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pdxfer.transport.device_copy import copy_rows

from pdxfer import transport

from . import gpu_check_parts as parts

TABLES = [("64 x 4 MiB", 64, 4 << 20), ("4096 x 64 KiB", 4096, 64 << 10), ("65536 x 4 KiB", 65536, 4 << 10)]
# --quick divides row sizes by this (row counts stay: the launch count is the point).
QUICK_SHRINK = 64
SECTIONS = ("attributes", "copies", "loopback", "tcp", "ucx", "nixl", "verbs", "engine", "demo")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path, help="directory for gpu_check.json/.md and UCX logs")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cuda (the check) or cpu (the same code on host memory, for the test suite)")
    p.add_argument("--quick", action="store_true", help=f"rows {QUICK_SHRINK}x smaller, 1 timed rep")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per figure (median)")
    args = p.parse_args(argv)
    args.only = [s for s in args.only.split(",") if s]
    unknown = sorted(set(args.only) - set(SECTIONS))
    if unknown:
        p.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    if args.quick:
        args.reps = 1
    return args


def tables(quick: bool) -> list[tuple[str, int, int]]:
    """The issue's three tables (rows shrunk under --quick, row counts kept)."""
    return [(name, rows, n // QUICK_SHRINK if quick else n) for name, rows, n in TABLES]


def scattered(rows: int, n: int, seed: int) -> np.ndarray:
    """`rows` rows of `n` bytes, sources and destinations shuffled over a 2x larger region."""
    rng = np.random.default_rng(seed)
    slots = 2 * rows
    src = rng.permutation(slots)[:rows] * n
    dst = rng.permutation(slots)[:rows] * n
    return np.stack([src, dst, np.full(rows, n)], 1).astype(np.int64)


def timed(fn: Callable[[], None], device: torch.device, reps: int) -> float:
    """Median seconds of `fn` over `reps` runs (after one warm-up), waiting on this stream only."""
    fn()
    parts.wait_stream(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        parts.wait_stream(device)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def section_copies(args: argparse.Namespace, device: torch.device, res: dict) -> dict:
    """Device copy baselines per table: contiguous copy, batched gather, per-row loop."""
    out = {}
    for name, rows, n in tables(args.quick):
        table = scattered(rows, n, 1)
        size = 2 * rows * n
        src = torch.randint(0, 256, (size,), dtype=torch.uint8, device=device)
        dst = torch.zeros(size, dtype=torch.uint8, device=device)
        nbytes = rows * n
        memcpy = timed(lambda: dst[:nbytes].copy_(src[:nbytes]), device, args.reps)  # noqa: B023
        batched = timed(lambda: copy_rows(src, dst, table), device, args.reps)  # noqa: B023

        def per_row() -> None:
            for s, d, k in table.tolist():  # noqa: B023 - the loop the batched copy replaces
                dst[d:d + k].copy_(src[s:s + k], non_blocking=True)  # noqa: B023

        loop = timed(per_row, device, 1)
        dst.zero_()
        copy_rows(src, dst, table)
        out[name] = {
            "bytes": nbytes, "memcpy_gbs": nbytes / memcpy / 1e9, "batched_gbs": nbytes / batched / 1e9,
            "per_row_gbs": nbytes / loop / 1e9, "batched_vs_memcpy": memcpy / batched,
            "exact": parts.rows_equal(src, dst, table),
        }
    return out


def section_backend(backend: str, args: argparse.Namespace, device: torch.device, res: dict) -> dict:
    """CUDA (or, under --device cpu, host) round trips through one backend, bytes checked."""
    opts: dict[str, Any] = {"streams": 2} if backend == "tcp" else {}
    if backend == "tcp" and device.type == "cpu":
        opts["force_bounce"] = True  # the host run takes the bounce path a GPU takes
    out = {}
    with transport.create(backend, **opts) as tx, transport.create(backend, **opts) as rx:
        conn = None
        for name, rows, n in tables(args.quick):
            table = scattered(rows, n, 2)
            src = torch.randint(0, 256, (2 * rows * n,), dtype=torch.uint8, device=device)
            dst = torch.zeros(2 * rows * n, dtype=torch.uint8, device=device)
            s, d = tx.register(src), rx.register(dst)
            conn = conn or tx.connect(rx.address())
            secs = timed(lambda: conn.write(s, d.descriptor(), table).wait(120),  # noqa: B023
                         torch.device("cpu"), args.reps)
            out[name] = {"gbs": rows * n / secs / 1e9, "exact": parts.rows_equal(src, dst, table)}
            tx.deregister(s)
            rx.deregister(d)
    return out


def section_nixl(args: argparse.Namespace, device: torch.device, res: dict) -> dict:
    """VRAM → VRAM (host → host under --device cpu) between two processes over nixl-all."""
    if "nixl-all" not in transport.variants():
        return {"skipped": "nixl-cu12 is not installed"}
    out = parts.nixl_between_processes(args.out, device.type, args.quick, args.reps)
    copies = res.get("copies", {})
    for name, fig in out.get("tables", {}).items():
        base = copies.get(name, {}).get("memcpy_gbs")
        if base:
            fig["vs_device_copy"] = fig["gbs"] / base
    return out


def section_verbs(args: argparse.Namespace, device: torch.device, res: dict) -> dict:
    """verbs on this host's RDMA port: facts, then round trips per table (skipped without a port)."""
    from pdxfer.transport.verbs.nics import probe

    reason = probe()
    if reason is not None:
        return {"skipped": reason}
    out: dict[str, Any] = parts.verbs_facts(device, args.reps)
    out["tables"] = section_backend("verbs", args, device, res)
    for name, fig in out["tables"].items():
        base = res.get("copies", {}).get(name, {}).get("memcpy_gbs")
        if base:
            fig["vs_device_copy"] = fig["gbs"] / base
    return out


def section_demo(args: argparse.Namespace, device: torch.device, res: dict) -> dict:
    """The PD example on this device: exit 0 means every output matched its reference."""
    cmd = [sys.executable, "-m", "examples.launch_pd", "--device", device.type, "--transport", "tcp",
           "--requests", "2" if args.quick else "8", "--prompt-len", "16" if args.quick else "48",
           "--gen-len", "2" if args.quick else "8"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    return {"command": " ".join(cmd[1:]), "exit": done.returncode, "identical": done.returncode == 0,
            "tail": (done.stdout + done.stderr).strip().splitlines()[-6:]}


def main(argv: list[str] | None = None) -> int:
    """Run the chosen sections, write JSON + markdown to --out; 0 if every section ran clean."""
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here (torch.cuda.is_available() is False, torch "
              f"{torch.__version__}); run it on a GPU machine, or pass --device cpu to run the "
              "same code on host memory", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                           "device": args.device, "quick": args.quick, "torch": torch.__version__}
    runners = {
        "attributes": lambda: parts.attributes(device),
        "copies": lambda: section_copies(args, device, res),
        "loopback": lambda: section_backend("loopback", args, device, res),
        "tcp": lambda: section_backend("tcp", args, device, res),
        "ucx": lambda: (section_backend("ucx-all", args, device, res) if "ucx-all" in
                        transport.variants() else {"skipped": "ucxx-cu12 is not installed"}),
        "nixl": lambda: section_nixl(args, device, res),
        "verbs": lambda: section_verbs(args, device, res),
        "engine": lambda: parts.engine_round_trips(device),
        "demo": lambda: section_demo(args, device, res),
    }
    ok = True
    for name in SECTIONS:
        if name not in args.only:
            continue
        t0 = time.monotonic()
        print(f"gpu-check: {name} ...", flush=True)
        try:
            res[name] = runners[name]()
        except Exception as exc:  # recorded and reported: one broken section must not hide the rest
            res[name] = {"error": f"{type(exc).__name__}: {exc}"}
            ok = False
        res[name]["seconds"] = round(time.monotonic() - t0, 2)
        ok = ok and parts.section_ok(res[name])
    (args.out / "gpu_check.json").write_text(json.dumps(res, indent=2, default=str))
    (args.out / "gpu_check.md").write_text(parts.markdown(res))
    print(parts.markdown(res))
    print(f"gpu-check: results in {args.out}/gpu_check.json and .md", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
