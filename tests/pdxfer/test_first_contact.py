"""First contact between a prefill and a decode: what each side hears when it goes wrong (#18, #20).

- A layout mismatch fails the request on BOTH sides at once, with one named
  reason: the refused decode tells the prefill which of its requests the
  refusal dooms (an `Abort` on the refused link), so the prefill's sender
  does not wait out `request_timeout` with "no decode expected it".
- A decode started before its prefill keeps dialling, with backoff, for
  `connect_timeout`; a prefill it never reached is "not reached", never
  "lost".
- A failure of any kind in the prefill's data-connection worker fails that
  connect cleanly, and the next request opens it again.
- The bootstrap host name is resolved off the progress thread, bounded by
  `connect_timeout`, its address family taken from `getaddrinfo`.

Timeouts are long where today's defect would hide behind them, and the
waits that must end early are short: a pass never waits one out.
"""

from __future__ import annotations

import logging
import socket
import threading

import pytest
import torch
from pdxfer_testkit import KV_FIELDS, build_pools, config, until

from pdxfer import DecodeEngine, KVPoll, LayoutMismatchError, PrefillEngine, RequestFailed, layout

# Long enough that a request which only a timer would end is plainly still running.
SLOW = {"timeout": 30.0, "request_timeout": 60.0}
QUICK = 8.0  # what a wait that must end promptly gets
# The decode's k is twice as wide: one field attribute apart from the prefill's pools.
WIDER_K = [layout.EntryField("k", 2, (2, 32), torch.float16), *KV_FIELDS[1:]]


def _free_port(family: int = socket.AF_INET, host: str = "127.0.0.1") -> int:
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def test_a_layout_mismatch_fails_the_prefills_requests_with_the_same_reason(backend, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="pdxfer")
    with PrefillEngine(build_pools(16, 4), config(backend, **SLOW)) as prefill, \
            DecodeEngine(build_pools(16, 4, kv_fields=WIDER_K), config(backend, **SLOW)) as decode:
        prefill.send("early", {"kv": [1]})  # the sender first, the usual order
        decode.expect("early", prefill.bootstrap_address, {"kv": [0]})
        with pytest.raises(RequestFailed, match=r"pool 'kv': field 'k' differs in shape") as d:
            decode.wait("early", QUICK)
        assert isinstance(d.value.__cause__, LayoutMismatchError)
        with pytest.raises(RequestFailed) as p:
            prefill.wait("early", QUICK)
        assert p.value.reason == d.value.reason
        # The decode first: the prefill remembers why, and its late send fails at once.
        decode.expect("late", prefill.bootstrap_address, {"kv": [0]})
        with pytest.raises(RequestFailed):
            decode.wait("late", QUICK)
        until(lambda: prefill.try_poll("late") is KVPoll.Failed, "the prefill heard of 'late'", QUICK)
        prefill.send("late", {"kv": [1]})
        with pytest.raises(RequestFailed, match=r"pool 'kv': field 'k' differs in shape"):
            prefill.wait("late", QUICK)
    logged = [r.getMessage() for r in caplog.records]
    assert any("prefill: refused" in m and "field 'k' differs in shape" in m for m in logged), logged


def test_a_decode_started_before_its_prefill_reaches_it_within_connect_timeout(backend, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="pdxfer")
    port = _free_port()
    with DecodeEngine(build_pools(16, 4), config(backend, **SLOW, connect_timeout=20.0)) as decode:
        decode.expect("r", f"127.0.0.1:{port}", {"kv": [1]})
        until(lambda: any("not reachable yet" in r.getMessage() for r in caplog.records),
              "a refused first dial, retried", QUICK)
        assert decode.poll("r") is KVPoll.Bootstrapping
        with PrefillEngine(build_pools(16, 4), config(backend, **SLOW, port=port)) as prefill:
            prefill.send("r", {"kv": [2]})
            assert decode.wait("r", QUICK * 2) is KVPoll.Success


def test_a_prefill_never_reached_is_not_called_lost(backend) -> None:
    port = _free_port()
    with DecodeEngine(build_pools(16, 4), config(backend, **SLOW, connect_timeout=0.3)) as decode:
        decode.expect("r", f"127.0.0.1:{port}", {"kv": [1]})
        with pytest.raises(RequestFailed, match=(
                rf"prefill at 127.0.0.1:{port} not reached \(no handshake\): cannot connect to "
                rf"prefill at 127.0.0.1:{port}: ECONNREFUSED; \d+ attempts? within connect_timeout "
                r"0.3 s")) as info:
            decode.wait("r", QUICK)
        assert "lost" not in info.value.reason


def test_a_prefill_reached_then_lost_is_not_redialled(backend) -> None:
    """A refused dial where a prefill was welcomed before means it is gone: fail at once."""
    with DecodeEngine(build_pools(16, 4), config(backend, **SLOW)) as decode:
        with PrefillEngine(build_pools(16, 4), config(backend, **SLOW)) as prefill:
            addr = prefill.bootstrap_address
            decode.expect("a", addr, {"kv": [1]})
            prefill.send("a", {"kv": [2]})
            assert decode.wait("a", QUICK) is KVPoll.Success
        until(lambda: addr not in decode._sessions, "the decode saw the prefill go", QUICK)
        decode.expect("b", addr, {"kv": [1]})  # its connect_timeout is 30 s: only no redial ends it
        with pytest.raises(RequestFailed, match=(
                rf"prefill at {addr} not reached \(no handshake\): cannot connect .*; 1 attempt "
                r"not redialled: the prefill there was reached before, then lost")):
            decode.wait("b", QUICK)


def test_an_exception_in_the_connect_worker_fails_that_connect_and_the_next_request_reopens(
        backend, monkeypatch) -> None:
    """#20: a non-transport failure (a pinned allocation) in the worker, at Hello and later."""
    with PrefillEngine(build_pools(16, 4), config(backend, **SLOW)) as prefill, \
            DecodeEngine(build_pools(16, 4), config(backend, **SLOW)) as decode:
        real, failures = prefill._transport.connect, []

        def connect(address):
            if failures:
                raise failures.pop()
            return real(address)

        monkeypatch.setattr(prefill._transport, "connect", connect)
        failures.append(RuntimeError("cudaHostAlloc: out of pinned memory"))
        prefill.send("a", {"kv": [1]})
        decode.expect("a", prefill.bootstrap_address, {"kv": [0]})
        with pytest.raises(RequestFailed, match="out of pinned memory"):
            decode.wait("a", QUICK)
        with pytest.raises(RequestFailed, match="out of pinned memory"):
            prefill.wait("a", QUICK)
        decode.expect("b", prefill.bootstrap_address, {"kv": [0]})
        prefill.send("b", {"kv": [1]})
        assert decode.wait("b", QUICK) is KVPoll.Success
        # Once welcomed: the data connection dies, and its reopening fails the same way.
        failures.append(MemoryError("pinned bounce buffer"))
        next(iter(prefill._sessions.values())).conn.close()
        decode.expect("c", prefill.bootstrap_address, {"kv": [2]})
        prefill.send("c", {"kv": [3]})
        with pytest.raises(RequestFailed, match="pinned bounce buffer"):
            prefill.wait("c", QUICK)
        decode.expect("d", prefill.bootstrap_address, {"kv": [4]})
        prefill.send("d", {"kv": [5]})
        assert decode.wait("d", QUICK) is KVPoll.Success


class _Resolver:
    """`socket.getaddrinfo` with test names: one that answers IPv6 only, one that hangs.

    Today's dial resolved inside `connect_ex` itself, so that is where a hanging
    name hangs too: the simulation blocks wherever the name is looked up.
    """

    def __init__(self, monkeypatch, v6_port: int) -> None:
        self.release = threading.Event()
        self.asked = threading.Event()
        real_gai, real_connect_ex = socket.getaddrinfo, socket.socket.connect_ex

        def getaddrinfo(host, port, *args, **kwargs):
            if kwargs.get("flags", 0) & socket.AI_NUMERICHOST:  # no lookup: never slow
                return real_gai(host, port, *args, **kwargs)
            if host == "v6only.test":
                return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", v6_port, 0, 0))]
            if host == "slow.test":
                self.asked.set()
                self.release.wait(30)
                raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
            return real_gai(host, port, *args, **kwargs)

        def connect_ex(sock, address):
            if isinstance(address, tuple) and address[0] in ("v6only.test", "slow.test"):
                getaddrinfo(address[0], address[1])  # what the C resolver would do, as slowly
                return real_connect_ex(sock, ("192.0.2.1", 9))  # an answer today's guess cannot use
            return real_connect_ex(sock, address)

        monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
        monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)


# The resolution and the dial are the engine's control path, the same whatever the backend.
def test_a_host_name_that_resolves_to_ipv6_only_is_dialled_over_ipv6(monkeypatch) -> None:
    with PrefillEngine(build_pools(16, 4), config("tcp", host="::1")) as prefill:
        port = int(prefill.bootstrap_address.rpartition(":")[2])
        _Resolver(monkeypatch, port)
        with DecodeEngine(build_pools(16, 4), config("tcp")) as decode:
            decode.expect("r", f"v6only.test:{port}", {"kv": [1]})
            prefill.send("r", {"kv": [2]})
            assert decode.wait("r", QUICK) is KVPoll.Success


def test_a_slow_name_lookup_does_not_stop_the_progress_thread(monkeypatch) -> None:
    resolver = _Resolver(monkeypatch, 0)
    try:
        with PrefillEngine(build_pools(16, 4), config("tcp")) as prefill, \
                DecodeEngine(build_pools(16, 4), config("tcp", connect_timeout=1.0,
                                                        request_timeout=30.0)) as decode:
            decode.expect("slow", "slow.test:4000", {"kv": [1]})
            assert resolver.asked.wait(QUICK)
            # The lookup hangs; requests to a prefill already known keep moving meanwhile.
            decode.expect("b", prefill.bootstrap_address, {"kv": [2]})
            prefill.send("b", {"kv": [3]})
            assert decode.wait("b", QUICK) is KVPoll.Success
            assert decode.poll("slow") is KVPoll.Bootstrapping or decode.poll("slow") is KVPoll.Failed
            with pytest.raises(RequestFailed, match=(
                    r"prefill at slow.test:4000 not reached \(no handshake\): no answer resolving "
                    r"'slow.test'; \d+ attempts? within connect_timeout 1.0 s")):
                decode.wait("slow", QUICK)
            resolver.release.set()  # the late answer is dropped; close() joins its thread at once
    finally:
        resolver.release.set()
