"""The tcp listener against hand-made frames: every bad frame gets an error frame and a close.

Raw sockets stand in for a corrupt, hostile or out-of-date peer. Each test
pins one refusal: the reply is a decodable `ErrorMessage` (or `Refused`)
naming the problem, the stream is then closed, no byte reaches registered
memory, and the engine keeps serving good peers afterwards.
"""

from __future__ import annotations

import re
import socket
import struct
import threading
import time
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest
import torch
from pdxfer.transport import PeerLostError, ProtocolError
from pdxfer.transport.tcp.wire import (
    PROTOCOL,
    VERSION,
    Hello,
    Refused,
    Segments,
    StripeEnd,
    Welcome,
)
from pdxfer.transport.testing.tables import CANARY
from pdxfer.transport.wire import LENGTH, ErrorMessage

from pdxfer import transport


@pytest.fixture
def engine() -> Iterator[transport.TransportEngine]:
    eng = transport.create("tcp", streams=1)
    yield eng
    eng.close()


def _frame(env: object) -> bytes:
    body = msgpack.packb(env, use_bin_type=True)
    return LENGTH.pack(len(body)) + body


def _env(t: str, b: dict, v: int = VERSION, p: str = "pdxfer-tcp") -> bytes:
    return _frame({"p": p, "v": v, "t": t, "b": b})


def _hello() -> bytes:
    return PROTOCOL.pack(Hello(engine="raw-peer", link="raw-link", stream=0, streams=1))


def _exchange(engine: transport.TransportEngine, data: bytes, handshake: bool = False) -> list[object]:
    """Send `data` on a fresh raw stream; every frame the engine answers, until it closes."""
    addr = engine.address()
    with socket.create_connection((addr["host"], addr["port"]), timeout=10) as sock:
        if handshake:
            sock.sendall(_hello())
            assert isinstance(PROTOCOL.recv(sock), Welcome)
        sock.sendall(data)
        replies = []
        while True:
            try:
                replies.append(PROTOCOL.recv(sock))
            except PeerLostError:  # the engine closed the stream: what we expect last
                return replies


def _assert_still_serves(engine: transport.TransportEngine) -> None:
    with transport.create("tcp", streams=1) as other:
        src = other.register(torch.arange(64, dtype=torch.uint8))
        dst = torch.zeros(64, dtype=torch.uint8)
        region = engine.register(dst)
        other.connect(engine.address()).write(
            src, region.descriptor(), np.array([[0, 0, 64]], np.int64)
        ).wait(10)
        assert torch.equal(dst, torch.arange(64, dtype=torch.uint8))
        engine.deregister(region)


BAD_FRAMES = [
    ("undecodable body", LENGTH.pack(5) + b"\xc1\xc1\xc1\xc1\xc1", "undecodable pdxfer-tcp frame"),
    ("trailing bytes after the map", LENGTH.pack(2) + b"\x80\x01", "undecodable"),
    # before the handshake the cap is wire.HANDSHAKE_MAX_FRAME, not the protocol's 1 MiB
    ("oversized length prefix", LENGTH.pack(1 << 31), r"frame length 2147483648 B exceeds the 4096 B limit"),
    ("frame over the handshake cap", LENGTH.pack(4097), r"frame length 4097 B exceeds the 4096 B limit"),
    ("not an envelope", _frame([1, 2, 3]), "is not an envelope map"),
    ("integer map keys", _frame({1: 2}), "undecodable"),
    ("unknown message type", _env("bogus", {}), "unknown pdxfer-tcp message type 'bogus'"),
    ("wrong version", _env("hello", {}, v=VERSION + 1), f"version {VERSION + 1}, we speak {VERSION}"),
    ("other protocol", _env("hello", {}, p="pd-control"), "for protocol 'pd-control'"),
    ("missing fields", _env("hello", {"engine": "x"}), r"hello message has fields \['engine'\]"),
    ("wrong field type", _env("hello", {"engine": "x", "link": "l", "stream": "0", "streams": 1}), "hello.stream is str, expected int"),
    ("bool where int is due", _env("hello", {"engine": "x", "link": "l", "stream": True, "streams": 1}), "hello.stream is bool"),
    ("data before hello", PROTOCOL.pack(StripeEnd(transfer=1, stripes=1, nbytes=0, notify=None)), "expected hello as the first frame"),
    ("too many streams", PROTOCOL.pack(Hello(engine="x", link="l", stream=0, streams=1000)), "at most 64 streams"),
]


@pytest.mark.parametrize("data,match", [c[1:] for c in BAD_FRAMES], ids=[c[0] for c in BAD_FRAMES])
def test_bad_first_frame_gets_error_frame_then_close(engine, data: bytes, match: str) -> None:
    replies = _exchange(engine, data)
    assert len(replies) == 1 and isinstance(replies[0], ErrorMessage), replies
    assert re.search(match, replies[0].reason), replies[0].reason
    _assert_still_serves(engine)


def test_post_handshake_frames_are_capped_at_the_protocol_limit(engine) -> None:
    replies = _exchange(engine, LENGTH.pack((1 << 20) + 1), handshake=True)
    assert len(replies) == 1 and isinstance(replies[0], ErrorMessage), replies
    assert "frame length 1048577 B exceeds the 1048576 B limit" in replies[0].reason


def _landing_rig(engine) -> tuple[torch.Tensor, int]:
    dst = torch.full((4096,), CANARY, dtype=torch.uint8)
    return dst, engine.register(dst).region_id


def _segments(region: int, pairs: list[tuple[int, int]], payload: int) -> bytes:
    ranges = np.array(pairs, dtype="<i8").tobytes()
    return PROTOCOL.pack(Segments(transfer=1, region=region, ranges=ranges)) + b"\x01" * payload


@pytest.mark.parametrize("pairs,match", [
    ([(4000, 200)], r"range 0 \[4000, \+200\) lies outside the 4096 B region"),
    ([(-1, 10)], "range 0 .* lies outside"),
    ([(0, 0)], "lies outside"),
    ([(0, 100), (50, 100)], r"destination rows 0 \[0, 100\) and 1 \[50, 150\) overlap"),
], ids=["past region end", "negative offset", "zero length", "overlapping ranges"])
def test_bad_segments_header_writes_no_byte_and_closes(engine, pairs, match: str) -> None:
    dst, region = _landing_rig(engine)
    replies = _exchange(engine, _segments(region, pairs, 300), handshake=True)
    assert len(replies) == 1 and isinstance(replies[0], ErrorMessage), replies
    assert re.search(match, replies[0].reason), replies[0].reason
    assert (dst == CANARY).all(), "a refused header let payload bytes land"
    _assert_still_serves(engine)


def test_unknown_region_header_is_refused_with_its_cause(engine) -> None:
    dst, region = _landing_rig(engine)
    replies = _exchange(engine, _segments(region + 99, [(0, 10)], 10), handshake=True)
    assert replies == [Refused(transfer=1, cause="region",
                               reason=f"engine {engine.engine_id} has no region {region + 99}")]
    assert (dst == CANARY).all()


def test_stripe_end_with_wrong_byte_count_is_refused(engine) -> None:
    dst, region = _landing_rig(engine)
    end = PROTOCOL.pack(StripeEnd(transfer=1, stripes=1, nbytes=11, notify=None))
    replies = _exchange(engine, _segments(region, [(0, 10)], 10) + end, handshake=True)
    assert isinstance(replies[-1], ErrorMessage)
    assert "stripe claims 11 B, 10 B arrived" in replies[-1].reason


def _fake_listener(reply: bytes) -> tuple[socket.socket, dict]:
    """A one-shot server that answers the first frame with `reply`."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            PROTOCOL.recv(conn)
            conn.sendall(reply)
            conn.recv(1)

    threading.Thread(target=serve, daemon=True).start()
    port = server.getsockname()[1]
    return server, {"backend": "tcp", "engine": "tcp-fake", "host": "127.0.0.1", "port": port}


@pytest.mark.parametrize("reply,exc,match", [
    (_env("welcome", {"engine": "tcp-fake"}, v=VERSION + 1), ProtocolError, f"version {VERSION + 1}"),
    (PROTOCOL.pack(ErrorMessage(reason="go away")), ProtocolError, "refused the handshake: go away"),
    (PROTOCOL.pack(Welcome(engine="tcp-other")), PeerLostError, "is engine tcp-other, not tcp-fake"),
], ids=["peer speaks another version", "peer refuses", "stale address"])
def test_connect_refuses_a_peer_that_answers_wrongly(engine, reply: bytes, exc: type, match: str) -> None:
    server, addr = _fake_listener(reply)
    with server, pytest.raises(exc, match=match):
        engine.connect(addr)


def test_connect_to_nobody_is_peer_lost(engine) -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    with pytest.raises(PeerLostError, match="cannot connect"):
        engine.connect({"backend": "tcp", "engine": "tcp-x", "host": "127.0.0.1", "port": port})


def test_length_prefix_is_big_endian_u32() -> None:
    frame = PROTOCOL.pack(StripeEnd(transfer=1, stripes=1, nbytes=0, notify=None))
    assert struct.unpack("!I", frame[:4])[0] == len(frame) - 4


def test_close_reaches_a_stream_still_waiting_for_its_hello() -> None:
    # a 60 s handshake timeout: an EOF within 30 s is close's doing, not the timeout's
    eng = transport.create("tcp", streams=1, connect_timeout=60.0)
    addr = eng.address()
    with socket.create_connection((addr["host"], addr["port"]), timeout=30) as sock:
        sock.sendall(LENGTH.pack(10))  # part of a hello: the stream is blocked reading the rest
        deadline = time.monotonic() + 30
        while eng.listener.pending == 0:  # accepted and counted as pending: state, not a nap
            assert time.monotonic() < deadline, "the listener never accepted the connection"
            threading.Event().wait(0.01)
        eng.close()
        assert sock.recv(1) == b""  # the engine hung up instead of waiting out the handshake
