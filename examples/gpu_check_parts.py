"""The GPU check's pieces that are not timing loops: attributes, checks, processes, the report.

Apart from `gpu_check.py` to keep each file to one job: this one reads the
driver, checks bytes, runs the two NIXL processes (and is their entry point:
`python -m examples.gpu_check_parts nixl-rx|nixl-tx`), drives the engine,
asks the verbs backend which NIC each GPU gets and what a GPUDirect flush
costs, and renders the markdown table.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import re
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdxfer import DecodeEngine, EngineConfig, KVPoll, PrefillEngine, layout, transport

# cuDeviceGetAttribute numbers (CUDA driver API, cuda.h CUdevice_attribute).
CU_ATTRIBUTES = {
    "gpu_direct_rdma_supported": 116,
    "gpu_direct_rdma_flush_writes_options": 117,
    "gpu_direct_rdma_writes_ordering": 118,
    "dma_buf_supported": 124,
}
# UCX transport names looked for in the NIXL processes' UCX log lines.
UCX_TLS = ("cuda_ipc", "cuda_copy", "gdr_copy", "cma", "knem", "posix", "sysv", "xpmem",
           "rc_mlx5", "dc_mlx5", "rc_verbs", "ud_mlx5", "tcp", "self")
ROOT = Path(__file__).resolve().parents[1]
WAIT = 120.0


def wait_stream(device: torch.device) -> None:
    """Wait for the current stream of `device` (never the whole device); nothing on cpu."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def rows_equal(src: torch.Tensor, dst: torch.Tensor, table: np.ndarray) -> bool:
    """Whether every row of an equal-row, row-aligned `table` landed (checked with plain indexing).

    Deliberately not through `device_copy`: the check must not share the code it checks.
    """
    n = int(table[0, 2])
    s = torch.from_numpy(table[:, 0] // n).to(src.device)
    d = torch.from_numpy(table[:, 1] // n).to(dst.device)
    return bool(torch.equal(src.view(-1, n)[s], dst.view(-1, n)[d]))


def attributes(device: torch.device) -> dict[str, Any]:
    """The device and the GPUDirect / dma-buf attributes the driver reports."""
    if device.type != "cuda":
        return {"name": "cpu", "note": "host run: no driver attributes"}
    props = torch.cuda.get_device_properties(device)
    out: dict[str, Any] = {"name": props.name, "capability": f"{props.major}.{props.minor}",
                           "memory_gib": round(props.total_memory / 2**30, 1),
                           "cuda": torch.version.cuda}
    try:
        cu = ctypes.CDLL("libcuda.so.1")
        cu.cuInit(0)
        dev = ctypes.c_int()
        cu.cuDeviceGet(ctypes.byref(dev), device.index or 0)
        for name, number in CU_ATTRIBUTES.items():
            value = ctypes.c_int(-1)
            rc = cu.cuDeviceGetAttribute(ctypes.byref(value), number, dev)
            out[name] = value.value if rc == 0 else f"error {rc}"
    except OSError as exc:
        out["driver"] = f"libcuda.so.1 not loadable: {exc}"
    with transport.create("nixl") as tcp_only:  # tls=tcp must refuse VRAM cleanly
        try:
            tcp_only.register(torch.zeros(4096, dtype=torch.uint8, device=device))
            out["nixl_tcp_refuses_vram"] = False
        except transport.CapabilityError:
            out["nixl_tcp_refuses_vram"] = True
    return out


# -- NIXL between two processes --------------------------------------------------


def _tables(quick: bool) -> list[tuple[str, np.ndarray]]:
    from .gpu_check import scattered, tables

    return [(name, scattered(rows, n, 3)) for name, rows, n in tables(quick)]


def _source(table: np.ndarray, device: str, seed: int) -> torch.Tensor:
    # The same bytes in both processes: drawn on the CPU from one seed, then moved.
    size = int(2 * table.shape[0] * table[0, 2])
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen).to(device)


def _line(stream: Any, deadline: float) -> dict:
    while True:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([stream], [], [], max(0.0, left))
        if not ready:
            raise TimeoutError("a NIXL check process said nothing in time")
        line = stream.readline()
        if not line:
            raise RuntimeError("a NIXL check process exited early (see its log in --out)")
        if line.startswith("{"):
            return json.loads(line)


def nixl_between_processes(out_dir: Path, device: str, quick: bool, reps: int) -> dict[str, Any]:
    """Receiver and sender as two processes over nixl-all; GB/s, exactness, UCX's transports."""
    env = dict(os.environ, UCX_PROTO_INFO="y", UCX_LOG_LEVEL="info", UCX_LOG_FILE="stderr")
    base = [sys.executable, "-m", "examples.gpu_check_parts"]
    flags = [device, "1" if quick else "0", str(reps)]
    logs = {side: open(out_dir / f"nixl_{side}.log", "w") for side in ("rx", "tx")}  # noqa: SIM115
    rx = subprocess.Popen([*base, "nixl-rx", *flags], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=logs["rx"], text=True, cwd=ROOT, env=env)
    tx = None
    try:
        deadline = time.monotonic() + WAIT
        hello = _line(rx.stdout, deadline)
        tx = subprocess.Popen([*base, "nixl-tx", *flags], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=logs["tx"], text=True, cwd=ROOT, env=env)
        tx.stdin.write(json.dumps(hello) + "\n")
        tx.stdin.flush()
        figures = {}
        for name, _ in _tables(quick):
            fig = _line(tx.stdout, deadline + WAIT)
            check = _line(rx.stdout, deadline + WAIT)
            figures[name] = {"gbs": fig["gbs"], "exact": check["exact"]}
    finally:
        for proc in (tx, rx):
            if proc is not None:
                proc.stdin.close()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        for f in logs.values():
            f.close()
    puts = _put_protocols(out_dir / "nixl_tx.log")
    return {"tables": figures, "ucx_write_transports": sorted({t for p in puts for t in p["transports"]}),
            "ucx_write_protocols": puts, "logs": ["nixl_rx.log", "nixl_tx.log"]}


def _put_protocols(path: Path) -> list[dict]:
    """What carried the writes: the sender's UCX_PROTO_INFO tables for `ucp_put*`.

    Each table is headed "remote memory write by ucp_put* from <mem> memory to
    <mem>" and lists `| range | description | config |` rows; the config
    names the transport ("cma/memory", "cuda_ipc/cuda", "rc_mlx5/mlx5_0:1").
    """
    names = re.compile(r"\b(" + "|".join(UCX_TLS) + r")/")
    out: list[dict] = []
    what = None
    for line in path.read_text(errors="replace").splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 1 and "remote memory write by ucp_put" in cells[0]:
            what = cells[0].replace("remote memory write by ", "")
        elif what and len(cells) == 3 and cells[0] != "Range":
            row = {"what": what, "range": cells[0], "protocol": cells[1], "config": cells[2],
                   "transports": sorted(set(names.findall(cells[2])))}
            if row not in out:
                out.append(row)
        elif len(cells) == 1:
            what = None  # another table begins
    return out


def _child(role: str, device: str, quick: bool, reps: int) -> int:
    eng = transport.create("nixl-all")
    tabs = _tables(quick)
    try:
        if role == "nixl-rx":
            dst = {name: torch.zeros(2 * int(t.shape[0] * t[0, 2]), dtype=torch.uint8, device=device)
                   for name, t in tabs}
            descs = {name: eng.register(buf).descriptor() for name, buf in dst.items()}
            notes: queue.Queue[bytes] = queue.Queue()
            eng.set_notify_handler(lambda _sender, payload: notes.put(payload))
            print(json.dumps({"address": eng.address(), "descs": descs}), flush=True)
            for i, (name, table) in enumerate(tabs):
                assert notes.get(timeout=WAIT) == name.encode()
                exact = rows_equal(_source(table, device, i), dst[name], table)
                print(json.dumps({"table": name, "exact": exact}), flush=True)
            sys.stdin.read()  # until the parent is done with us
            return 0
        hello = json.loads(sys.stdin.readline())
        conn = eng.connect(hello["address"])
        for i, (name, table) in enumerate(tabs):
            src = eng.register(_source(table, device, i))
            desc = hello["descs"][name]
            conn.write(src, desc, table).wait(WAIT)  # warm-up: connection, rkeys, IPC handles
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                conn.write(src, desc, table).wait(WAIT)
                times.append(time.perf_counter() - t0)
            conn.write(src, desc, table, notify=name.encode()).wait(WAIT)
            nbytes = int(table[:, 2].sum())
            print(json.dumps({"table": name, "gbs": nbytes / float(np.median(times)) / 1e9}), flush=True)
        sys.stdin.read()
        return 0
    finally:
        eng.close()


# -- the engine over device pools -------------------------------------------------


def engine_round_trips(device: torch.device) -> dict[str, Any]:
    """One request through Prefill/DecodeEngine over pools on `device`, per backend, bytes checked."""
    fields = [layout.EntryField("k", 4, (16, 64), torch.float16),
              layout.EntryField("v", 4, (16, 64), torch.float16)]
    out = {}
    for backend in [b for b in ("loopback", "tcp", "nixl-all", "verbs")
                    if b in transport.available() + transport.variants()]:
        src = layout.EntryMajorArena(fields, 64, device)
        dst = layout.EntryMajorArena(fields, 64, device)
        src.buf.copy_(torch.randint(0, 256, src.buf.shape, dtype=torch.uint8, device=device))
        cfg = EngineConfig(transport=backend, timeout=20.0)
        src_idx, dst_idx = np.arange(0, 48, 3), np.arange(10, 26)
        t0 = time.perf_counter()
        with PrefillEngine({"kv": src}, cfg) as prefill, DecodeEngine({"kv": dst}, cfg) as decode:
            decode.expect("r", prefill.bootstrap_address, {"kv": dst_idx})
            prefill.send("r", {"kv": src_idx})
            state = decode.wait("r", 60)
        rows = src.buf.view(64, -1)
        exact = bool(torch.equal(rows[torch.from_numpy(src_idx).to(device)],
                                 dst.buf.view(64, -1)[torch.from_numpy(dst_idx).to(device)]))
        out[backend] = {"state": str(state), "exact": exact and state is KVPoll.Success,
                        "seconds": round(time.perf_counter() - t0, 3)}
    return out


# -- verbs ---------------------------------------------------------------------------------


def verbs_facts(device: torch.device, reps: int) -> dict[str, Any]:
    """What only an RDMA host can say: the port and GID chosen, the NIC per GPU, a flush's cost."""
    from pdxfer.transport.verbs.cuda import CudaDriver

    out: dict[str, Any] = {}
    with transport.create("verbs") as engine:
        engine.register(torch.zeros(4096, dtype=torch.uint8, device=device))
        out["engine"] = engine.describe()
    if device.type != "cuda":
        return out
    nic = {}
    for gpu in range(torch.cuda.device_count()):  # the 8-GPU/8-NIC question: one NIC each?
        with transport.create("verbs") as engine:
            engine.register(torch.zeros(4096, dtype=torch.uint8, device=f"cuda:{gpu}"))
            nic[f"cuda:{gpu}"] = f"{engine.nic.device}/{engine.nic.port_num} ({engine.nic.why})"
    out["nic_per_gpu"] = nic
    driver, gpu = CudaDriver(), device.index or 0
    try:
        if driver.flush_needed(gpu):
            driver.flush(gpu)
            n = 100 * reps
            t0 = time.perf_counter()
            for _ in range(n):
                driver.flush(gpu)
            out["flush_us"] = round((time.perf_counter() - t0) / n * 1e6, 2)
        else:
            out["flush_us"] = "not needed: GPU_DIRECT_RDMA_WRITES_ORDERING >= OWNER"
    finally:
        driver.close()
    return out


# -- the report -----------------------------------------------------------------------


def section_ok(result: dict) -> bool:
    """False when a section failed: an error, a byte mismatch, or a demo that did not match."""
    if "error" in result or result.get("identical") is False:
        return False
    return all(v.get("exact", True) is not False and section_ok(v)
               for v in result.values() if isinstance(v, dict))


def markdown(res: dict) -> str:
    """The results as markdown: a header, one table of figures, then anything else per section."""
    lines = [f"# pdxfer gpu-check — {res['date']}, device {res['device']}"
             + (" (quick)" if res.get("quick") else ""), ""]
    attrs = res.get("attributes", {})
    if attrs:
        lines += ["## device", "", *[f"- {k}: {v}" for k, v in attrs.items()], ""]
    from .gpu_check import TABLES

    names = [name for name, _, _ in TABLES]
    cols = [("copies", "memcpy_gbs", "device copy"), ("copies", "batched_gbs", "batched gather"),
            ("copies", "per_row_gbs", "per-row copy_"), ("loopback", "gbs", "loopback"),
            ("tcp", "gbs", "tcp (bounce)"), ("nixl", "gbs", "nixl-all 2 procs"),
            ("nixl", "vs_device_copy", "nixl / device copy"), ("verbs", "gbs", "verbs"),
            ("verbs", "vs_device_copy", "verbs / device copy")]
    lines += ["## GB/s (ratios as x)", "", "| table | " + " | ".join(c[2] for c in cols) + " |",
              "| --- |" + " --- |" * len(cols)]
    for name in names:
        cells = []
        for sec, key, _ in cols:
            table = res.get(sec, {}).get("tables", res.get(sec, {}))
            v = table.get(name, {}).get(key) if isinstance(table, dict) else None
            ok = table.get(name, {}).get("exact", True) if isinstance(table, dict) else True
            cells.append("-" if v is None else f"{v:.2f}" + ("" if ok else " WRONG BYTES"))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for sec in ("nixl", "verbs", "engine", "demo"):
        if sec in res:
            extra = {k: v for k, v in res[sec].items() if k != "tables"}
            lines += ["", f"## {sec}", "", "```", json.dumps(extra, indent=1, default=str), "```"]
    errors = [f"- {k}: {v['error']}" for k, v in res.items() if isinstance(v, dict) and "error" in v]
    if errors:
        lines += ["", "## errors", "", *errors]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    role, dev, quick_flag, reps_arg = sys.argv[1:5]
    raise SystemExit(_child(role, dev, quick_flag == "1", int(reps_arg)))
