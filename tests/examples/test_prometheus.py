"""A real Prometheus server scrapes a prefill and a decode worker while requests flow (#32).

Debian's `prometheus` binary, its own config and data directory in tmp, on
127.0.0.1 at a free port, stopped at the end; the two example workers run
as processes with `--metrics-port 0`. The test sends requests through the
decode worker's RPC — some that succeed, one the prefill worker refuses (its
kv pool is too small for the prompt, so the decode worker aborts the
transfer) — and reads back through Prometheus's HTTP API: the counts it
sent, the failure by the reason it caused, wire-time histograms with
samples. Every read polls the API until the scrape shows the value, within
a bound; nothing sleeps for a fixed time.

Skipped without the `prometheus` binary or prometheus_client, except under
CI=true, where `.ci/run` installs them and their absence is a failure.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from examples.launching import spawn_worker
from examples.rpc import Failed, Generate, GenerateDone, RpcClient
from pdxfer import observe

CI = os.environ.get("CI") == "true"
PROMETHEUS = shutil.which("prometheus")
STARTUP_S = 120.0  # a worker imports torch and builds its model: generous under load
BOUND_S = 60.0  # any value the scrape must show, within this (scrapes run every 0.25 s)
SUCCESSES = 3


def _need(ok: bool, why: str) -> None:
    if ok:
        return
    if CI:
        pytest.fail(f"{why}; .ci/run installs it (apt-get install prometheus; pip install -e '.[test]')")
    pytest.skip(why)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """A Prometheus server of our own, scraping `targets` every 250 ms."""

    def __init__(self, tmp: Path, targets: list[str]) -> None:
        config = tmp / "prometheus.yml"
        config.write_text(json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": "250ms", "scrape_timeout": "200ms"},
            "scrape_configs": [{"job_name": "pdxfer", "static_configs": [{"targets": targets}]}],
        }))
        self.port = _free_port()
        self.log = open(tmp / "prometheus.log", "w")  # noqa: SIM115 — closed in stop()
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        self._until(lambda: self._get("/-/ready", raw=True), "Prometheus ready")

    def _get(self, path: str, raw: bool = False):
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as resp:
                body = resp.read()
        except OSError:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited ({self.proc.returncode}); see "
                                     f"{self.log.name}") from None
            return None
        return body if raw else json.loads(body)

    def _until(self, probe, what: str):
        deadline = time.monotonic() + BOUND_S
        while True:
            got = probe()
            if got is not None and got is not False:
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"never happened within {BOUND_S} s: {what}")
            time.sleep(0.05)  # polling the API, not waiting for time to pass

    def value(self, query: str) -> float | None:
        """The instant value of `query` now, or None while it has no sample."""
        got = self._get("/api/v1/query?" + urllib.parse.urlencode({"query": query}))
        if not got or got.get("status") != "success" or not got["data"]["result"]:
            return None
        return float(got["data"]["result"][0]["value"][1])

    def wait_for(self, query: str, want) -> float:
        """Poll until `want(value)` holds for `query`'s value; that value."""
        seen: list = []

        def probe():
            v = self.value(query)
            seen.append(v)
            return v if v is not None and want(v) else None
        try:
            return self._until(probe, f"{query} as wanted")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last value {seen[-1] if seen else None}") from None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def test_prometheus_scrapes_counts_reasons_and_wire_time_from_both_workers(tmp_path) -> None:
    _need(PROMETHEUS is not None, "the prometheus server binary is not installed")
    _need(observe.metrics_available(), "prometheus_client is not installed")
    common = ["--transport", "tcp", "--timeout", "10", "--metrics-port", "0", "--device", "cpu"]
    # Both start at once (each imports torch): the decode retries the prefill's RPC port.
    # 4 pages: a 20-token prompt (5 pages of 4) is refused by the prefill, not the decode.
    rpc = f"127.0.0.1:{_free_port()}"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        starts = [pool.submit(spawn_worker, "prefill", [*common, "--kv-pages", "4", "--port",
                                                         rpc.rsplit(":", 1)[1]], STARTUP_S),
                  pool.submit(spawn_worker, "decode", [*common, "--prefill", rpc], STARTUP_S)]
        concurrent.futures.wait(starts)
    prefill, decode = (f.result() if f.exception() is None else None for f in starts)
    prom = client = None
    try:
        for f in starts:
            if f.exception() is not None:
                raise f.exception()
        prom = Prometheus(tmp_path, [prefill.info["metrics"], decode.info["metrics"]])
        prom.wait_for('count(up{job="pdxfer"} == 1)', lambda v: v == 2)
        client = RpcClient(decode.info["rpc"], STARTUP_S)
        for i in range(SUCCESSES):
            reply = client.call(Generate(request_id=f"ok{i}", prompt=[1, 2, 3], gen_len=2))
            assert isinstance(reply, GenerateDone), reply
        refused = client.call(Generate(request_id="big", prompt=list(range(20)), gen_len=2))
        assert isinstance(refused, Failed) and "kv" in refused.reason, refused
        # one more success: everything of the refused request reached the prefill before it
        reply = client.call(Generate(request_id=f"ok{SUCCESSES}", prompt=[4, 5], gen_len=2))
        assert isinstance(reply, GenerateDone), reply
        ok = SUCCESSES + 1

        for role in ("prefill", "decode"):
            q = f'pdxfer_requests_total{{role="{role}",outcome="success"}}'
            assert prom.wait_for(q, lambda v: v >= ok) == ok
            wire = f'pdxfer_request_wire_seconds_count{{role="{role}"}}'
            assert prom.wait_for(wire, lambda v: v >= ok) == ok
        assert prom.wait_for('pdxfer_request_wire_seconds_sum{role="prefill"}', lambda v: v > 0)
        assert prom.wait_for('pdxfer_bytes_total{role="prefill"}', lambda v: v > 0) == \
            prom.wait_for('pdxfer_bytes_total{role="decode"}', lambda v: v > 0)
        # the failure the test caused: the decode worker aborted the refused request
        decode_failed = ('pdxfer_request_failures_total{role="decode",reason="aborted_decode"}')
        assert prom.wait_for(decode_failed, lambda v: v >= 1) == 1
        assert prom.wait_for('sum(pdxfer_requests_total{role="decode",outcome="failed"})',
                             lambda v: v >= 1) == 1
        # the prefill fails it by the same reason if the Expect reached it before the abort
        # (a decode aborting while still dialing tells it nothing to fail): then and only then
        started = prom.wait_for('pdxfer_requests_started_total{role="prefill"}',
                                lambda v: v >= ok)
        prefill_failed = prom.wait_for(
            'sum(pdxfer_request_failures_total{role="prefill"}) or vector(0)',
            lambda v: v == started - ok)
        if prefill_failed:
            assert prom.wait_for('pdxfer_request_failures_total{role="prefill",'
                                 'reason="aborted_decode"}', lambda v: v >= 1) == 1
        assert prom.wait_for('sum(pdxfer_links_up)', lambda v: v >= 2) == 2
    finally:
        if client is not None:
            client.close()
        if prom is not None:
            prom.stop()
        for worker in (decode, prefill):
            if worker is not None:
                worker.stop()
