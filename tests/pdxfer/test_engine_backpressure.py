"""Issue #9 item 2: a peer that never reads cannot make the engine buffer without bound.

A raw socket completes a real Hello (a decode engine's identity) and then
floods Expects the prefill must answer (unknown pool: an Abort each) while
never reading a byte. Past the link's output bound the prefill stops reading
that peer — the flood backs up into the peer's own socket — and once it has
been stuck for the liveness timeout the link is closed with the reason
logged. Another decode is served normally throughout.
"""

from __future__ import annotations

import logging
import socket

from pdxfer_testkit import build_pools, config, until

from pdxfer import DecodeEngine, KVPoll, PrefillEngine, session
from pdxfer.protocol import CONTROL, Expect, Hello, Ping

WAIT = 20.0


def test_a_peer_that_never_reads_is_paused_then_closed(backend, monkeypatch, caplog) -> None:
    bound = 64 << 10
    monkeypatch.setattr(session, "MAX_BACKLOG", bound)
    cfg = config(backend, timeout=2.0)
    src = build_pools(64, 16, seed=1)
    with (PrefillEngine(src, cfg) as prefill, DecodeEngine(build_pools(64, 16), cfg) as mute,
          DecodeEngine(build_pools(64, 16), cfg) as decode):
        # Built before connecting: packing takes long enough under load to look like silence.
        flood = memoryview(b"".join(CONTROL.pack(Expect(f"x{i}", i + 1, {"nope": b""}))
                                    for i in range(60000)))
        host, port = prefill.bootstrap_address.rsplit(":", 1)
        raw = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
        raw.connect((host.strip("[]"), int(port)))
        raw.sendall(CONTROL.pack(Hello(mute.engine_id, backend, mute._transport.address(),
                                       **mute._pools.hello_fields())))
        def welcomed() -> bool:
            raw.sendall(CONTROL.pack(Ping()))  # alive while the prefill opens its data connection
            return any(lk.owner is not None and lk.owner.welcomed for lk in list(prefill._links))

        until(welcomed, "the prefill welcomes the raw peer")
        link = next(lk for lk in list(prefill._links) if lk.owner is not None)
        link.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        raw.setblocking(False)
        sent = 0

        def push() -> bool:
            nonlocal sent
            try:
                sent += raw.send(flood[sent:sent + 65536])
            except BlockingIOError:
                pass
            except OSError:  # closed on us: the assertions below say whether for the right reason
                return True
            if link.stuck_since is not None:
                paused.append(link.backlog)
                return True
            # Not `sent == len(flood)`: the kernel's socket buffers can take the whole flood
            # before a busy prefill has read much of it; the bound is hit when it answers.
            return False

        paused: list[int] = []
        with caplog.at_level(logging.WARNING, logger="pdxfer"):
            until(push, "the prefill pauses the peer that does not read")
            assert paused, "the whole flood was answered without a pause"
            # What it holds for the peer: the bound plus at most one read budget's answers.
            assert link.backlog < bound + (4 << 20)
            # Another decode is served while this link is paused.
            decode.expect("ok", prefill.bootstrap_address, {"kv": [1]})
            prefill.send("ok", {"kv": [2]})
            assert decode.wait("ok", WAIT) is KVPoll.Success
            until(lambda: link.closed, "the stuck link is closed after the liveness timeout")
        assert "has not read our control messages" in (link.close_reason or "")
        assert any("has not read our control messages" in r.getMessage() for r in caplog.records)
        raw.close()
