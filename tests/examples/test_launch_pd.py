"""The PD example end to end: real worker processes, real ports, checked output.

Two launcher runs as subprocesses (each starts two worker processes, so these
are the slow tests of this directory, ~10 s each on two cores): the normal
run must print its figures and "outputs identical"; a run whose prefill
worker is SIGKILLed mid-demo must report the failed requests, exit non-zero
within a bounded time, and leave no worker behind.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _launch(*args: str, timeout: float = 100.0) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "examples.launch_pd", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )
    return proc, time.monotonic() - started


def _worker_pids(stdout: str) -> list[int]:
    return [int(p) for p in re.findall(r"worker pid (\d+)", stdout)]


def _assert_gone(pids: list[int]) -> None:
    assert len(pids) == 2
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"worker {pid} outlived the launcher")


def test_demo_over_tcp_matches_the_single_process_run() -> None:
    proc, _ = _launch("--transport", "tcp", "--requests", "3", "--prompt-len", "16",
                      "--gen-len", "4")
    out = proc.stdout + "\n--- stderr ---\n" + proc.stderr
    assert proc.returncode == 0, out
    rows = re.findall(r"^(req-\d+)\s+([\d,]+)\s+(\d+)\s+(\d+)\s+([\d.]+) ms\s+identical", out, re.M)
    assert [r[0] for r in rows] == ["req-0", "req-1", "req-2"], out
    for _, nbytes, segments, layer_major, _ms in rows:
        assert int(nbytes.replace(",", "")) > 0
        assert 0 < int(segments) < int(layer_major)
    assert "outputs identical: all 3 requests match" in out
    _assert_gone(_worker_pids(out))


def test_killed_prefill_worker_fails_requests_instead_of_hanging() -> None:
    proc, elapsed = _launch("--transport", "tcp", "--requests", "4", "--prompt-len", "8",
                            "--gen-len", "2", "--timeout", "3", "--kill-prefill-after", "1")
    out = proc.stdout + "\n--- stderr ---\n" + proc.stderr
    assert proc.returncode == 1, out
    assert re.search(r"^req-0 .* identical", out, re.M), out
    # req-1 may have finished before the kill landed; the ones after cannot have.
    for rid in ("req-2", "req-3"):
        assert re.search(rf"^{rid} .*FAILED: .*prefill worker", out, re.M), out
    assert re.search(r"^FAILED: [234] of 4 requests failed", out, re.M), out
    assert "outputs identical" not in out
    assert "prefill worker killed by SIGKILL" in out
    assert elapsed < 60, f"took {elapsed:.0f} s"
    _assert_gone(_worker_pids(out))


def test_demo_moving_the_pool_boundary_on_both_workers_keeps_outputs_identical(launcher_run) -> None:
    # Every request moves both workers' boundaries (the state pool grows, then shrinks
    # back) while that request's entries hold live data; the outputs must not change.
    # The run docs/elastic-pools.md shows: made once for both (tests/conftest.py).
    proc = launcher_run("examples.launch_pd", ["--transport", "tcp", "--requests", "4",
                        "--prompt-len", "16", "--gen-len", "4", "--resize-every", "1",
                        "--resize-step", "5"], timeout=100)
    out = proc.stdout + "\n--- stderr ---\n" + proc.stderr
    assert proc.returncode == 0, out
    rows = re.findall(r"^(req-\d+)\s.*identical", out, re.M)
    assert rows == ["req-0", "req-1", "req-2", "req-3"], out
    moves = re.findall(r"^  resize on (prefill|decode)\s+during (req-\d): state pool (grows|shrinks) "
                       r"(\d+) -> (\d+) entries \(boundary (\d+) -> (\d+)\): moved (\d+) entr(?:y|ies), "
                       r"([\d,]+) B in [\d.]+ ms$", out, re.M)
    assert [(w, r, v) for w, r, v, *_ in moves] == [
        (w, f"req-{i}", "grows" if i % 2 == 0 else "shrinks")
        for i in range(4) for w in ("prefill", "decode")], out
    for _w, _r, _v, before, after, old, new, entries, nbytes in moves:
        assert abs(int(before) - int(after)) == 5 == abs(int(old) - int(new))
        assert int(entries) > 0 and int(nbytes.replace(",", "")) > 0  # live entries moved
    assert "outputs identical: all 4 requests match" in out
    assert re.search(r"^resizes: 8 boundary moves \(4 on prefill, 4 on decode\)", out, re.M), out
    _assert_gone(_worker_pids(out))


def test_demo_streaming_kv_by_layer_groups_keeps_outputs_identical(launcher_run) -> None:
    # The prefill sends each attention layer's kv pages as soon as the model computed it
    # (PrefillEngine.send(layers=)), the state and first token after the last layer; the
    # run README.md shows (made once for both, tests/conftest.py).
    proc = launcher_run("examples.launch_pd", ["--layer-groups", "4", "--requests", "3",
                        "--prompt-len", "16", "--gen-len", "4"])
    out = proc.stdout + "\n--- stderr ---\n" + proc.stderr
    assert proc.returncode == 0, out
    assert "kv streamed in 2 layer group(s) while the prefill computes (the model has 2" in out
    rows = re.findall(r"^(req-\d+)\s+([\d,]+)\s+(\d+)\s+(\d+)\s+([\d.]+) ms\s+identical", out, re.M)
    assert [r[0] for r in rows] == ["req-0", "req-1", "req-2"], out
    for _, _, segments, _, _ in rows:  # 4 pages x 2 groups + the state and first-token entries
        assert int(segments) == 4 * 2 + 2, out
    assert "outputs identical: all 3 requests match" in out
