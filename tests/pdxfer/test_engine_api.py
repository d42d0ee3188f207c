"""The public surface: what `pdxfer` exports, the config and result types, the wire messages."""

from __future__ import annotations

import dataclasses
import socket
import struct
import threading

import numpy as np
import pytest
from pdxfer.transport.errors import ProtocolError, TransferTimeout
from pdxfer.transport.wire import LENGTH
from pdxfer_testkit import BACKENDS, build_pools, config

import pdxfer
from pdxfer import (
    ConfigError,
    DecodeEngine,
    EngineConfig,
    KVPoll,
    PdxferError,
    PrefillEngine,
    RequestStats,
)
from pdxfer.protocol import (
    CONTROL,
    Expect,
    Landed,
    Ping,
    decode_notify,
    encode_notify,
    landed_payload,
    pack_indices,
    unpack_indices,
)
from pdxfer.session import parse_address


def test_public_api_is_pinned() -> None:
    assert pdxfer.__all__ == [
        "BoundsError", "CapabilityError", "ClosedError", "ConfigError", "DecodeEngine", "EngineConfig",
        "HeteroTPDecode", "HeteroTPPrefill", "KVPoll",
        "LayoutError", "LayoutMismatchError", "PdxferError", "PeerLostError", "PrefillEngine",
        "ProtocolError", "RegistrationError", "RequestError", "RequestFailed", "RequestOutcome",
        "RequestStats", "ResizeBlockedError", "ResizeReport", "TransferTimeout", "TransportError",
        "UnknownRequestError",
        "group_address", "sub_request_id",
    ]
    for name in pdxfer.__all__:
        assert getattr(pdxfer, name) is not None
    shared = ("poll", "wait", "failure_reason", "failure_cause", "outcome", "abort", "stats",
              "release", "resize", "close", "trace")
    for method in ("send", *shared):
        assert callable(getattr(PrefillEngine, method))
    for method in ("expect", *shared):
        assert callable(getattr(DecodeEngine, method))
    assert isinstance(PrefillEngine.metrics, property)  # the engine's own registry (#32)


def test_every_exported_error_derives_from_the_one_root() -> None:
    errors = [getattr(pdxfer, n) for n in pdxfer.__all__ if n.endswith("Error") or n in (
        "RequestFailed", "TransferTimeout")]
    assert len(errors) == 16
    for cls in errors:
        assert issubclass(cls, PdxferError), cls
    assert issubclass(pdxfer.UnknownRequestError, pdxfer.RequestError)
    # The layout family keeps ValueError (as the entry-arena design does), and so do bounds and config refusals.
    for cls in (pdxfer.LayoutError, pdxfer.BoundsError, ConfigError):
        assert issubclass(cls, ValueError)


def test_kvpoll_keeps_sglang_numbering() -> None:
    assert [(p.name, int(p)) for p in KVPoll] == [
        ("Failed", 0), ("Bootstrapping", 1), ("WaitingForInput", 2), ("Transferring", 3), ("Success", 4),
        ("Quarantined", 5)]  # ours (#11), after SGLang's values
    assert KVPoll.Success.finished and KVPoll.Failed.finished and not KVPoll.Transferring.finished
    assert not KVPoll.Quarantined.finished


def test_config_is_frozen_and_validated() -> None:
    cfg = EngineConfig(transport="tcp", host="127.0.0.1", port=0, timeout=10.0, transport_options={"streams": 2})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.timeout = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.transport_options["streams"] = 4  # type: ignore[index]
    assert hash(cfg) == hash(EngineConfig(transport="tcp", transport_options={"streams": 2}))
    assert cfg.heartbeat == 2.5 and cfg.grace == 1.0
    with pytest.raises(ConfigError, match="timeout must be a finite, positive number"):
        EngineConfig(timeout=0)
    with pytest.raises(ConfigError, match="transport must be a backend name"):
        EngineConfig(transport="")
    with pytest.raises(ConfigError, match="port must be an int 0..65535"):
        EngineConfig(port=70000)
    stats = RequestStats(1, 2, 3, 0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.nbytes = 0  # type: ignore[misc]


def test_fast_notify_payload_matches_the_wire_protocol_byte_for_byte() -> None:
    msg = Landed("req-é", 2**40, 3, 1, 2, True, 123456789, 17)
    payload = landed_payload(*(getattr(msg, f.name) for f in dataclasses.fields(msg)))
    assert payload == encode_notify(msg)
    assert decode_notify(payload) == msg
    with pytest.raises(ProtocolError, match="expected 'landed'"):
        decode_notify(CONTROL.pack(Ping())[LENGTH.size:])


def test_control_messages_decode_strictly() -> None:
    frame = CONTROL.pack(Expect("r", 1, {"kv": pack_indices(np.array([3, 1, 2]))}))
    msg = CONTROL.unpack(frame[LENGTH.size:])
    assert unpack_indices(msg.indices["kv"], "kv").tolist() == [3, 1, 2]
    with pytest.raises(ProtocolError, match="multiple of 8"):
        unpack_indices(b"1234567", "kv")
    with pytest.raises(ProtocolError, match="indices must be int64 bytes"):
        unpack_indices([1, 2], "kv")


def test_bootstrap_addresses() -> None:
    assert parse_address("10.0.0.1:5000") == ("10.0.0.1", 5000)
    assert parse_address("[::1]:7") == ("::1", 7)
    for bad in ("host", "host:0", "host:x", ":80", 5, "host:²", "host:١٢"):  # non-ASCII digits too
        with pytest.raises(pdxfer.RequestError, match="host:port"):
            parse_address(bad)


def test_wait_times_out_while_running(pair) -> None:
    prefill, decode, _, _ = pair
    decode.expect("w", prefill.bootstrap_address, {"kv": [1]})
    with pytest.raises(TransferTimeout, match="still .* after 0.05 s"):
        decode.wait("w", 0.05)
    assert decode.poll("w") in (KVPoll.Bootstrapping, KVPoll.WaitingForInput)
    assert decode.failure_reason("w") is None


def test_garbage_on_the_bootstrap_port_is_refused_and_serving_continues(pair) -> None:
    prefill, decode, _, _ = pair
    host, port = parse_address(prefill.bootstrap_address)
    with socket.create_connection((host, port), timeout=5) as junk:
        junk.sendall(struct.pack("!I", 0xFFFFFFF0) + b"x" * 16)
        junk.settimeout(5)
        reply = b""
        while chunk := junk.recv(4096):  # the prefill explains and hangs up
            reply += chunk
        assert b"exceeds" in reply
    decode.expect("ok", prefill.bootstrap_address, {"kv": [1]})
    prefill.send("ok", {"kv": [2]})
    assert decode.wait("ok", 10) is KVPoll.Success


@pytest.mark.parametrize("pre,dec", [(a, b) for a in BACKENDS for b in BACKENDS if a != b])
def test_different_transports_are_refused_in_the_handshake(pre, dec) -> None:
    with PrefillEngine(build_pools(16, 4), config(pre)) as prefill, \
            DecodeEngine(build_pools(16, 4), config(dec)) as decode:
        decode.expect("t", prefill.bootstrap_address, {"kv": [1]})
        with pytest.raises(pdxfer.RequestFailed, match=f"decode uses transport '{dec}', this prefill '{pre}'"):
            decode.wait("t", 10)


@pytest.mark.parametrize("field", ["timeout", "heartbeat_interval", "abort_grace"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, True, 10**400])
def test_config_refuses_durations_that_disable_timeouts(field: str, value: float) -> None:
    # NaN compares false with everything: a NaN timeout never fires. inf waits forever.
    with pytest.raises(ConfigError, match=f"{field} must be a finite, positive number"):
        EngineConfig(**{field: value})


def test_config_refuses_bools_where_ints_are_due() -> None:
    with pytest.raises(ConfigError, match=r"port must be an int 0..65535, got True"):
        EngineConfig(port=True)


def test_config_refuses_unknown_and_ignored_transport_options() -> None:
    with pytest.raises(ConfigError, match=r"unknown transport_options key 'stream' for transport "
                                          r"'tcp'; valid: .*connect_timeout.*streams"):
        EngineConfig(transport="tcp", transport_options={"stream": 2})
    with pytest.raises(ConfigError, match=r"transport 'loopback' ignores the option 'connect_timeout'"):
        EngineConfig(transport="loopback", transport_options={"connect_timeout": 2.0})
    with pytest.raises(ConfigError, match=r"unknown transport_options key 'streams' for transport 'loopback'"):
        EngineConfig(transport="loopback", transport_options={"streams": 2})
    with pytest.raises(ConfigError, match=r"duplicates EngineConfig.host"):
        EngineConfig(transport="tcp", transport_options={"host": "::1"})
    assert EngineConfig(transport="tcp", transport_options={"streams": 2, "port": 0})
    assert EngineConfig(transport="loopback", transport_options={"copy_threads": 2})


def test_send_refuses_readiness_for_host_pools_before_anything_happens(pair) -> None:
    # `ready` hands a CUDA producer's event over (transport.streams); with host
    # pools it is a caller's mistake, refused before the request exists.
    prefill, decode, _, _ = pair
    with pytest.raises(pdxfer.CapabilityError, match="applies to CUDA memory only"):
        prefill.send("r", {"kv": [2]}, ready=object())
    with pytest.raises(pdxfer.UnknownRequestError):
        prefill.poll("r")  # the refused send left nothing behind
    decode.expect("r", prefill.bootstrap_address, {"kv": [1]})
    prefill.send("r", {"kv": [2]}, ready=None)
    assert decode.wait("r", 10) is KVPoll.Success


def test_readiness_is_captured_at_send_and_reaches_every_write(monkeypatch) -> None:
    # A chunk sent before the decode expects it is posted later, on the progress
    # thread, whose current stream is not the caller's: the event must be the
    # one captured inside send(), on the caller's thread.
    from pdxfer.transport.loopback import LoopbackLink

    from pdxfer.pools import PoolSet

    captured, written = [], []

    def readiness(self, ready):
        captured.append(threading.current_thread())
        return {r: ("event", ready) for r in self.regions}

    write = LoopbackLink.write

    def recording(self, local, remote, segments, notify=None, *, ready=None):
        if len(segments):  # the handshake's empty warm-up writes move no pool bytes
            written.append(ready)
        return write(self, local, remote, segments, notify)

    monkeypatch.setattr(PoolSet, "readiness", readiness)
    monkeypatch.setattr(LoopbackLink, "write", recording)
    with PrefillEngine(build_pools(16, 4), config("loopback")) as prefill, \
            DecodeEngine(build_pools(16, 4), config("loopback")) as decode:
        prefill.send("q", {"kv": [2, 3], "state": [1]}, ready="R")  # queued: decode not there yet
        decode.expect("q", prefill.bootstrap_address, {"kv": [5, 6], "state": [2]})
        assert decode.wait("q", 10) is KVPoll.Success
    assert captured == [threading.main_thread()]
    assert written and all(r == ("event", "R") for r in written)


def test_a_refused_send_leaves_no_record(pair) -> None:
    """#25 item 5: refused means nothing happened — no record polling Bootstrapping, then Failed."""
    prefill, decode, src, _ = pair
    n = src["kv"].entries
    with pytest.raises(pdxfer.LayoutError, match=f"pool 'kv' source index {n} at position 1"):
        prefill.send("r", {"kv": [1, n]})
    with pytest.raises(pdxfer.UnknownRequestError):
        prefill.poll("r")
    decode.expect("r", prefill.bootstrap_address, {"kv": [1, 2]})
    prefill.send("r", {"kv": [3, 4]})
    assert decode.wait("r", 10) is KVPoll.Success
    assert prefill.wait("r", 10) is KVPoll.Success
