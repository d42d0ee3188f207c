"""Request traces and Prometheus metrics from the engines (pdxfer/observe.py, #32).

Traces run over every backend (the `pair` fixture): a chunked request's
timeline on both sides is complete (one `posted` per transfer, one `landed`
per transfer, the same (chunk, part)s) and in order. Metrics are read from
the engine's own registry with prometheus_client's exposition parser.
"""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
from pdxfer.transport.errors import ClosedError, ProtocolError
from pdxfer_testkit import BIG_KV_FIELDS, build_pools, config, poll_or_none, until

from pdxfer import (
    ConfigError,
    DecodeEngine,
    KVPoll,
    PrefillEngine,
    RequestFailed,
    TransferTimeout,
    UnknownRequestError,
    observe,
)
from pdxfer.errors import LayoutMismatchError, PeerLostError, RequestError

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

WAIT = 30.0


def _samples(engine) -> dict[tuple, float]:
    """Every sample of the engine's registry: (name, sorted labels) -> value."""
    text = prometheus_client.generate_latest(engine.metrics).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _value(engine, name: str, **labels) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(v for (n, ls), v in _samples(engine).items()
               if n == name and all(dict(ls).get(k) == w for k, w in labels.items()))


def _parts(trace, event: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in re.search(r"chunk=(\d+) part=(\d+)/", e.detail).groups())
            for e in trace if e.event == event]


def test_a_chunked_request_has_a_complete_ordered_timeline_on_both_sides(pair) -> None:
    prefill, decode, _, _ = pair
    decode.expect("t1", prefill.bootstrap_address, {"kv": [5, 9, 10, 11], "state": [3]})
    until(lambda: poll_or_none(prefill, "t1") is not None, "the prefill saw the Expect")
    prefill.send("t1", {"kv": [1, 2]}, last=False)
    prefill.send("t1", {"kv": [7, 8], "state": [4]})
    assert decode.wait("t1", WAIT) is KVPoll.Success
    assert prefill.wait("t1", WAIT) is KVPoll.Success

    p, d = prefill.trace("t1"), decode.trace("t1")
    for trace in (p, d):
        times = [e.t for e in trace]
        assert times == sorted(times) and times[0] >= 0
    # prefill: the decode's Expect, each send, a posted write per transfer, Done, Success
    pev = [e.event for e in p]
    assert pev[0] == "expect" and pev[-2:] == ["received", "success"] and p[-2].detail == "done"
    assert pev.count("send") == 2 and pev.index("send") < pev.index("posted")
    posted = _parts(p, "posted")
    assert len(posted) == prefill.stats("t1").transfers
    assert [c for c, _ in posted] == sorted(c for c, _ in posted) and {c for c, _ in posted} == {0, 1}
    states = [e.detail for e in p if e.event == "state"]
    assert states == ["WaitingForInput", "Transferring"]
    # decode: expect(), the Expect sent, a notify landed per transfer, Success, Done sent
    dev = [e.event for e in d]
    assert dev[:2] == ["expect", "sent"] and d[1].detail == "expect"
    assert dev[-2:] == ["success", "sent"] and d[-1].detail == "done"
    assert sorted(_parts(d, "landed")) == sorted(posted)
    assert len(_parts(d, "landed")) == decode.stats("t1").transfers
    assert max(i for i, e in enumerate(d) if e.event == "landed") < dev.index("success")
    # a released request's trace stays readable (the ring of finished ones)
    decode.release("t1")
    assert decode.trace("t1") == d


def test_an_aborted_request_traces_the_abort_and_its_answer(pair) -> None:
    prefill, decode, _, _ = pair
    decode.expect("a1", prefill.bootstrap_address, {"kv": [1], "state": [1]})
    until(lambda: poll_or_none(prefill, "a1") is not None, "the prefill saw the Expect")
    decode.abort("a1", "test gave up")
    with pytest.raises(RequestFailed, match="aborted by decode: test gave up"):
        decode.wait("a1", WAIT)
    events = [(e.event, e.detail) for e in decode.trace("a1")]
    assert events.index(("sent", "abort")) < events.index(("received", "abort_ack"))
    assert events[-1] == ("failed", "aborted by decode: test gave up")
    until(lambda: prefill.poll("a1") is KVPoll.Failed, "the prefill failed it too")
    pev = [(e.event, e.detail) for e in prefill.trace("a1")]
    assert pev[0][0] == "expect" and ("received", "abort") in pev and pev[-2][0] == "failed"
    assert pev[-1] == ("sent", "abort_ack")


def test_traces_are_bounded_and_logged_at_debug(caplog) -> None:
    cfg = config("loopback", traces=2)
    with PrefillEngine(build_pools(64, 8, seed=1), cfg) as prefill, \
            DecodeEngine(build_pools(64, 8), cfg) as decode:
        caplog.set_level(logging.DEBUG, logger="pdxfer.trace")
        for i in range(3):
            decode.expect(f"b{i}", prefill.bootstrap_address, {"kv": [i], "state": [i]})
            prefill.send(f"b{i}", {"kv": [i], "state": [i]})
            assert decode.wait(f"b{i}", WAIT) is KVPoll.Success
            decode.release(f"b{i}")
        assert decode.trace("b2")[-1].event == "sent"
        with pytest.raises(UnknownRequestError, match=r"older than the last 2 finished"):
            decode.trace("b0")  # pushed out of the ring of 2
        lines = [r for r in caplog.records if r.name == "pdxfer.trace"
                 and getattr(r, "pdxfer_trace", {}).get("request") == "b2"]
        assert [r.pdxfer_trace["event"] for r in lines if r.pdxfer_trace["role"] == "decode"][-2:] \
            == ["success", "sent"]
        assert "event=landed" in lines[2].getMessage() or any(
            "event=landed" in r.getMessage() for r in lines)
    with DecodeEngine(build_pools(8, 2), config("loopback", traces=0)) as off:
        off.expect("x", "127.0.0.1:1", {"kv": [0], "state": [0]})
        with pytest.raises(UnknownRequestError, match="no trace"):
            off.trace("x")


def test_a_request_of_many_chunks_keeps_a_bounded_trace_with_its_end() -> None:
    cfg = config("loopback")
    n = observe.EVENTS_PER_REQUEST + 10
    with PrefillEngine(build_pools(n + 8, 8, seed=1), cfg) as prefill, \
            DecodeEngine(build_pools(n + 8, 8), cfg) as decode:
        decode.expect("long", prefill.bootstrap_address, {"kv": list(range(n)), "state": [0]})
        for i in range(n - 1):
            prefill.send("long", {"kv": [i]}, last=False)
        prefill.send("long", {"kv": [n - 1], "state": [0]})
        assert decode.wait("long", WAIT) is KVPoll.Success
        trace = decode.trace("long")
        assert len(trace) == observe.EVENTS_PER_REQUEST + 2
        assert [e.event for e in trace].count("truncated") == 1
        assert trace[-1].event == "success" and trace[0].event == "expect"


def test_counts_outcomes_and_reasons_in_each_engines_own_registry() -> None:
    cfg = config("loopback", metrics=True)
    with PrefillEngine(build_pools(64, 8, seed=1), cfg) as prefill, \
            DecodeEngine(build_pools(64, 8), cfg) as decode, \
            DecodeEngine(build_pools(64, 8), cfg) as other:
        for i in range(3):
            decode.expect(f"m{i}", prefill.bootstrap_address, {"kv": [i, i + 8], "state": [i]})
            prefill.send(f"m{i}", {"kv": [i, i + 1], "state": [i]})
            assert decode.wait(f"m{i}", WAIT) is KVPoll.Success
            assert prefill.wait(f"m{i}", WAIT) is KVPoll.Success
        decode.expect("gone", prefill.bootstrap_address, {"kv": [20], "state": [5]})
        until(lambda: poll_or_none(prefill, "gone") is not None, "the prefill saw the Expect")
        decode.abort("gone", "test")
        with pytest.raises(RequestFailed):
            decode.wait("gone", WAIT)
        until(lambda: prefill.poll("gone") is KVPoll.Failed, "the prefill failed it")
        for engine, role in ((prefill, "prefill"), (decode, "decode")):
            assert _value(engine, "pdxfer_requests_total", outcome="success", role=role,
                          backend="loopback") == 3
            assert _value(engine, "pdxfer_requests_total", outcome="failed") == 1
            assert _value(engine, "pdxfer_request_failures_total", reason="aborted_decode",
                          phase="WaitingForInput") == 1
            assert _value(engine, "pdxfer_requests_started_total") == 4
            assert _value(engine, "pdxfer_request_seconds_count") == 4
            assert _value(engine, "pdxfer_bytes_total") == sum(
                engine.stats(f"m{i}").nbytes for i in range(3))
            assert _value(engine, "pdxfer_links_total", event="opened") == 1
            assert _value(engine, "pdxfer_links_up") == 1
            assert _value(engine, "pdxfer_registered_bytes") > 0
            assert _value(engine, "pdxfer_requests_in_flight") == 0
        assert _value(prefill, "pdxfer_request_wire_seconds_count") == 3
        assert _value(prefill, "pdxfer_request_wire_seconds_sum") > 0
        assert _value(decode, "pdxfer_links_total", event="dialed") == 1
        # the third engine, in the same process, counted nothing of theirs
        assert _value(other, "pdxfer_requests_started_total") == 0
        assert other.metrics is not decode.metrics


def test_a_timeout_counts_by_phase_and_in_flight_shows_the_state() -> None:
    cfg = config("loopback", metrics=True, request_timeout=0.5)
    with PrefillEngine(build_pools(64, 8, seed=1), cfg) as prefill, \
            DecodeEngine(build_pools(64, 8), cfg) as decode:
        decode.expect("late", prefill.bootstrap_address, {"kv": [1], "state": [1]})
        until(lambda: decode.poll("late") is KVPoll.WaitingForInput, "the Expect went out")
        assert _value(decode, "pdxfer_requests_in_flight", state="WaitingForInput") == 1
        with pytest.raises(RequestFailed, match="timed out") as info:
            decode.wait("late", WAIT)  # the prefill never sends: the decode's wait runs out
        assert isinstance(info.value.__cause__, TransferTimeout)
        assert _value(decode, "pdxfer_request_failures_total", reason="timeout",
                      phase="WaitingForInput") == 1
        until(lambda: prefill.poll("late") is KVPoll.Failed, "the prefill heard the abort")
        assert _value(prefill, "pdxfer_request_failures_total", reason="aborted_decode") == 1


@pytest.mark.parametrize(("role", "reason", "error", "kind"), [
    ("decode", "x", TransferTimeout("t"), "timeout"),
    ("decode", "layout mismatch, refused", LayoutMismatchError("m"), "layout_refused"),
    ("prefill", "decode lost", PeerLostError("p"), "peer_lost"),
    ("decode", "closed", ClosedError("c"), "closed"),
    ("decode", "bad notify", ProtocolError("b"), "protocol"),
    ("prefill", "aborted by prefill: caller", None, "aborted_prefill"),
    ("prefill", "request 'r' timed out: ...", None, "aborted_decode"),  # the decode's word
    ("decode", "prefill has no pool(s) ['x']", RequestError("r"), "aborted_prefill"),
    ("decode", "aborted by decode: caller", None, "aborted_decode"),
    ("decode", "weird", ValueError("v"), "other"),
])
def test_failure_kind_names_the_cause_from_a_fixed_set(role, reason, error, kind) -> None:
    assert observe.failure_kind(role, reason, error) == kind
    assert kind in observe.REASONS


def test_metrics_config_is_checked_and_off_means_no_registry(monkeypatch) -> None:
    with pytest.raises(ConfigError, match=r"EngineConfig.metrics must be True, False or None"):
        config("loopback", metrics="yes")
    with pytest.raises(ConfigError, match=r"EngineConfig.traces must be an int"):
        config("loopback", traces=-1)
    with DecodeEngine(build_pools(8, 2), config("loopback", metrics=False)) as off:
        assert off.metrics is None
    monkeypatch.setattr(observe, "metrics_available", lambda: False)
    with pytest.raises(ConfigError, match=r"pip install 'pdxfer\[metrics\]'"):
        DecodeEngine(build_pools(8, 2), config("loopback", metrics=True))
    with DecodeEngine(build_pools(8, 2), config("loopback")) as auto:  # None: off without it
        assert auto.metrics is None


def test_serve_metrics_merges_two_engines_on_one_page() -> None:
    import urllib.request

    cfg = config("loopback", metrics=True)
    with PrefillEngine(build_pools(16, 4, seed=1), cfg) as prefill, \
            DecodeEngine(build_pools(16, 4), cfg) as decode:
        decode.expect("s", prefill.bootstrap_address, {"kv": [1], "state": [1]})
        prefill.send("s", {"kv": [2], "state": [2]})
        assert decode.wait("s", WAIT) is KVPoll.Success
        server, port = observe.serve_metrics([prefill.metrics, decode.metrics], 0)
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=WAIT).read()
        finally:
            server.shutdown()
        fams = {f.name: f for f in text_string_to_metric_families(text.decode())}
        roles = {s.labels["role"] for s in fams["pdxfer_requests"].samples}
        assert roles == {"prefill", "decode"}
        assert text.decode().count("# TYPE pdxfer_requests_total counter") <= 1
    with pytest.raises(ConfigError, match="metrics=False"):
        observe.serve_metrics(None, 0)


def test_quarantine_is_counted_with_how_long_it_lasted(monkeypatch) -> None:
    """A no-fence decode: an abort unanswered within the grace quarantines the request."""
    cfg = config("loopback", metrics=True, request_timeout=5.0)
    prefill = PrefillEngine(build_pools(16, 4, seed=1), cfg)
    decode = DecodeEngine(build_pools(16, 4), config("loopback", metrics=True,
                                                     transport_options={"fence": False}))
    try:
        decode.expect("q", prefill.bootstrap_address, {"kv": [1], "state": [1]})
        until(lambda: poll_or_none(prefill, "q") is not None, "the prefill saw the Expect")
        monkeypatch.setattr(prefill, "_on_message", lambda link, msg: None)  # deaf to the Abort
        decode.abort("q", "test")
        until(lambda: decode.poll("q") is KVPoll.Quarantined, "quarantined")
        assert _value(decode, "pdxfer_requests_quarantined_total") == 1
        assert _value(decode, "pdxfer_requests_in_flight", state="Quarantined") == 1
        assert any(e.event == "quarantined" for e in decode.trace("q"))
    finally:
        decode.close()  # closing fails what is still quarantined: its stay ends there
        prefill.close()
    assert _value(decode, "pdxfer_quarantine_seconds_count") == 1
    assert np.isfinite(_value(decode, "pdxfer_quarantine_seconds_sum"))


def test_a_layout_mismatch_counts_as_refused_on_both_sides() -> None:
    cfg = config("loopback", metrics=True)
    with PrefillEngine(build_pools(16, 4, seed=1, kv_fields=BIG_KV_FIELDS), cfg) as prefill, \
            DecodeEngine(build_pools(16, 4), cfg) as decode:
        decode.expect("lm", prefill.bootstrap_address, {"kv": [1], "state": [1]})
        with pytest.raises(RequestFailed, match="layout mismatch"):
            decode.wait("lm", WAIT)
        assert _value(decode, "pdxfer_request_failures_total", reason="layout_refused",
                      phase="Bootstrapping") == 1
        assert _value(decode, "pdxfer_links_total", event="refused", kind="layout") == 1
        until(lambda: _value(prefill, "pdxfer_links_total", event="refused", kind="layout") == 1,
              "the prefill counted its refusal")
        assert decode.trace("lm")[-1].event == "failed"


def test_finished_requests_become_opentelemetry_spans_once_enabled() -> None:
    sdk = pytest.importorskip("opentelemetry.sdk.trace")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))  # exports synchronously
    cfg = config("loopback")
    with PrefillEngine(build_pools(16, 4, seed=1), cfg) as prefill, \
            DecodeEngine(build_pools(16, 4), cfg) as decode:
        decode.expect("before", prefill.bootstrap_address, {"kv": [1], "state": [1]})
        prefill.send("before", {"kv": [2], "state": [2]})
        assert decode.wait("before", WAIT) is KVPoll.Success
        # The prefill finishes "before" only when the decode's Done reaches it, which under
        # load can come after spans are on (a third span): wait for both sides' end first.
        assert prefill.wait("before", WAIT) is KVPoll.Success
        observe.enable_spans(provider)
        try:
            decode.expect("o1", prefill.bootstrap_address, {"kv": [3], "state": [0]})
            prefill.send("o1", {"kv": [4], "state": [0]})
            assert decode.wait("o1", WAIT) is KVPoll.Success
            until(lambda: len(exporter.get_finished_spans()) == 2, "both sides' spans")
        finally:
            observe.disable_spans()
        spans = {s.name: s for s in exporter.get_finished_spans()}
        assert set(spans) == {"pdxfer.prefill.request", "pdxfer.decode.request"}  # not "before"
        span = spans["pdxfer.decode.request"]
        assert span.attributes["pdxfer.request_id"] == "o1"
        assert span.attributes["pdxfer.outcome"] == "success"
        assert span.attributes["pdxfer.bytes"] == decode.stats("o1").nbytes
        names = [e.name for e in span.events]
        assert names == [e.event for e in decode.trace("o1")][:len(names)]
        assert "landed" in names and "success" in names
        stamps = [e.timestamp for e in span.events]
        assert stamps == sorted(stamps) and span.start_time <= stamps[0] <= span.end_time
