"""A small etcd v3 client on etcd's JSON gateway, standard library only.

etcd serves its v3 gRPC API as JSON over HTTP at `<client URL>/v3/...` (the
grpc-gateway; `/v3/` since etcd 3.4 and the only prefix from 3.5, per etcd's
dev-guide "api_grpc_gateway"): keys and values are base64 in JSON, int64s are
JSON strings, proto3 defaults (0, false, "") are left out of answers. This
module speaks exactly the calls a directory needs — range (paged, one
snapshot revision), put, delete, a create-if-absent / compare-and-swap txn,
lease grant / keep-alive / revoke, compaction, and a watch stream — each
checked against a real etcd 3.5 in `tests/directory`. docs/directory.md
records why this and not a PyPI client (etcd3 does not import with current
protobuf, python-etcd speaks only the v2 API, etcd3gw's watch hangs when etcd
dies, aetcd brings grpcio and an asyncio loop into processes that fork).

Every call is bounded by `timeout`. Several endpoints (the members of one
cluster) are tried in turn when one cannot be reached; a call that reached a
server and failed there is not retried here — the directory's loops decide.
Errors are `DirectoryUnavailable`, with the endpoint and etcd's own message.

A watch is one long HTTP response of newline-separated JSON objects. It is
read on its own connection, in blocking reads without a timeout (an idle
watch is silent for as long as nothing changes); `WatchStream.close()` from
another thread shuts the socket to end a read, and TCP keep-alive on that
socket turns a silently vanished server into an error within
`keepalive_idle + 3` seconds.
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import threading
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import DirectoryError, DirectoryUnavailable

# Largest watch message or answer we read: a page of records or one batch of
# events. Past it the stream is refused (the directory re-lists) instead of buffered.
MAX_MESSAGE = 16 << 20
_PAGE = 1000  # keys per range page
_STALE = (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected)


class AnswerTooLarge(DirectoryUnavailable):
    """An answer over `MAX_MESSAGE` bytes (a range page of huge values): ask for less."""


def _b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def prefix_end(prefix: str) -> bytes:
    """The range_end covering every key that starts with `prefix` (its last byte plus one)."""
    raw = prefix.encode().rstrip(b"\xff")
    return raw[:-1] + bytes([raw[-1] + 1]) if raw else b"\0"


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int


@dataclass(frozen=True)
class Header:
    """The part of an answer's header that says which store answered, and how far it is."""

    revision: int
    cluster_id: str


def _header(answer: dict) -> Header:
    h = answer.get("header", {})
    return Header(int(h.get("revision", 0)), str(h.get("cluster_id", "")))


def _key(raw: bytes) -> str:
    # Keys are bytes to etcd; anyone may write one that is not UTF-8. Decoded with
    # surrogateescape it still reads (and fails every name check) and encodes back exactly.
    return raw.decode("utf-8", "surrogateescape")


def key_bytes(key: str) -> bytes:
    """A key as etcd stores it (the inverse of how keys are read: surrogateescape)."""
    return key.encode("utf-8", "surrogateescape")


def _kv(d: dict) -> KeyValue:
    return KeyValue(_key(_unb64(d["key"])), _unb64(d.get("value", "")),
                    int(d.get("mod_revision", 0)), int(d.get("create_revision", 0)),
                    int(d.get("lease", 0)))


def parse_endpoints(endpoints: str | Sequence[str]) -> list[tuple[str, int]]:
    """`"http://h:p,http://h2:p"` (or a list; `h:p` alone means http) as (host, port) pairs."""
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    out = []
    for item in items:
        text = item.strip()
        url = urllib.parse.urlsplit(text if "://" in text else f"http://{text}")
        if url.scheme != "http" or not url.hostname or url.path not in ("", "/"):
            raise DirectoryError(f"etcd endpoint must be http://host:port (TLS and auth are not "
                                 f"supported; put etcd on a private network), got {item!r}")
        try:
            port = url.port or 2379
        except ValueError as exc:
            raise DirectoryError(f"etcd endpoint {item!r}: {exc}") from exc
        out.append((url.hostname, port))
    if not out:
        raise DirectoryError("no etcd endpoint given")
    return out


class EtcdClient:
    """Unary calls over one keep-alive connection per calling thread; watches on their own."""

    def __init__(self, endpoints: str | Sequence[str], timeout: float = 5.0) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self.timeout = timeout
        self._local = threading.local()
        self._current = 0  # index of the endpoint that answered last
        self._conns: set[http.client.HTTPConnection] = set()
        self._lock = threading.Lock()
        self._closed = False

    # -- transport ------------------------------------------------------------------------
    def _endpoint(self, i: int) -> tuple[str, int]:
        return self.endpoints[(self._current + i) % len(self.endpoints)]

    def call(self, path: str, body: dict) -> dict:
        """POST `body` to `/v3/<path>` and return the answer; `DirectoryUnavailable` if none."""
        if self._closed:
            raise DirectoryError("etcd client is closed")
        payload = json.dumps(body).encode()
        errors = []
        for i in range(len(self.endpoints)):
            host, port = self._endpoint(i)
            for fresh in (False, True):
                conn, reused = self._conn(host, port)
                try:
                    conn.request("POST", f"/v3/{path}", payload, {"Content-Type": "application/json"})
                    resp = conn.getresponse()
                    data = resp.read(MAX_MESSAGE + 1)
                except (OSError, http.client.HTTPException) as exc:
                    self._drop(conn)
                    # A kept-alive connection the server closed (idle, or a restart) fails
                    # its next request before the server read it: once more, on a new one.
                    if reused and not fresh and isinstance(exc, _STALE):
                        continue
                    errors.append(f"{host}:{port}: {exc or type(exc).__name__}")
                    if isinstance(exc, ConnectionRefusedError):
                        break  # never sent: the next member may answer
                    raise DirectoryUnavailable(f"etcd {path} failed: {'; '.join(errors)}") from exc
                self._current = (self._current + i) % len(self.endpoints)
                if len(data) > MAX_MESSAGE:
                    self._drop(conn)  # the rest of the answer is still unread on it
                return self._answer(host, port, path, resp.status, data)
        raise DirectoryUnavailable(f"etcd {path} failed: {'; '.join(errors)}")

    @staticmethod
    def _answer(host: str, port: int, path: str, status: int, data: bytes) -> dict:
        if len(data) > MAX_MESSAGE:
            raise AnswerTooLarge(f"etcd {host}:{port} {path}: answer over {MAX_MESSAGE} B")
        try:
            answer = json.loads(data) if data else {}
        except ValueError as exc:
            raise DirectoryUnavailable(f"etcd {host}:{port} {path}: not JSON ({exc}): "
                                       f"{data[:200]!r}") from exc
        if status != 200 or not isinstance(answer, dict) or "error" in answer:
            message = answer.get("message") or answer.get("error") if isinstance(answer, dict) else data
            raise DirectoryUnavailable(f"etcd {host}:{port} {path} answered {status}: {message}")
        return answer

    def _conn(self, host: str, port: int) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection to (host, port), and whether it was used before."""
        conns = self._local.__dict__.setdefault("conns", {})
        conn = conns.get((host, port))
        if conn is not None:
            return conn, True
        conn = http.client.HTTPConnection(host, port, timeout=self.timeout)
        conns[(host, port)] = conn
        with self._lock:
            self._conns.add(conn)
        return conn, False

    def _drop(self, conn: http.client.HTTPConnection) -> None:
        conn.close()
        conns = self._local.__dict__.get("conns", {})
        for key, c in list(conns.items()):
            if c is conn:
                del conns[key]
        with self._lock:
            self._conns.discard(conn)

    def close(self) -> None:
        """Close every connection (watches close themselves); idempotent."""
        self._closed = True
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            conn.close()

    # -- kv ---------------------------------------------------------------------------------
    def range(self, prefix: str) -> tuple[int, list[KeyValue]]:
        """Every key under `prefix`, as one snapshot: (revision, key-values), paged.

        A page over `MAX_MESSAGE` (someone stored huge values) is asked for
        again with half the keys, one that timed out with an eighth, down to
        one: a single etcd value is at most its request limit (1.5 MiB by
        default), so a listing completes and the directory refuses those
        values one by one.
        """
        end = _b64(prefix_end(prefix))
        body: dict[str, Any] = {"key": _b64(prefix), "range_end": end, "limit": _PAGE}
        out: list[KeyValue] = []
        revision = 0
        while True:
            try:
                answer = self.call("kv/range", body)
            except DirectoryUnavailable as exc:
                # too large, or too slow to produce (etcd serializing a page of huge values):
                # ask for half as many keys; one key's answer always fits
                slow = isinstance(exc.__cause__, TimeoutError)
                if body["limit"] == 1 or not (isinstance(exc, AnswerTooLarge) or slow):
                    raise
                body = {**body, "limit": max(1, body["limit"] // (8 if slow else 2))}
                continue
            revision = revision or int(answer["header"]["revision"])
            kvs = [_kv(d) for d in answer.get("kvs", [])]
            out += kvs
            if not answer.get("more") or not kvs:
                return revision, out
            # next page: after the last key, at the first page's revision (one snapshot)
            body = {"key": _b64(key_bytes(kvs[-1].key) + b"\0"), "range_end": end,
                    "limit": body["limit"],
                    "revision": revision}

    def get(self, key: str) -> KeyValue | None:
        kvs = self.call("kv/range", {"key": _b64(key)}).get("kvs", [])
        return _kv(kvs[0]) if kvs else None

    def probe(self, key: str) -> tuple[Header, KeyValue | None]:
        """A linearizable read of one key: which store answered, its revision, and the key.

        Linearizable (etcd's default): a member cut off from its quorum does
        not answer, so an answer means the cluster is there and current.
        """
        answer = self.call("kv/range", {"key": _b64(key)})
        kvs = answer.get("kvs", [])
        return _header(answer), (_kv(kvs[0]) if kvs else None)

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """Write `key`; the revision it got."""
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return int(self.call("kv/put", body)["header"]["revision"])

    def delete(self, key: str) -> int:
        """Delete `key`; how many keys went (0 or 1)."""
        return int(self.call("kv/deleterange", {"key": _b64(key)}).get("deleted", 0))

    def put_if(self, key: str, value: bytes, lease: int = 0, *, mod_revision: int = 0) -> bool:
        """Put only if `key`'s mod_revision is still `mod_revision` (0: only if absent)."""
        put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            put["lease"] = str(lease)
        compare = {"key": _b64(key), "result": "EQUAL", "target": "MOD",
                   "mod_revision": str(mod_revision)}
        return bool(self.call("kv/txn", {"compare": [compare],
                                         "success": [{"request_put": put}]}).get("succeeded"))

    def delete_if_lease(self, key: str, lease: int) -> bool:
        """Delete `key` only while it is still on `lease` (never a successor's record)."""
        compare = {"key": _b64(key), "result": "EQUAL", "target": "LEASE", "lease": str(lease)}
        return bool(self.call("kv/txn", {"compare": [compare], "success": [
            {"request_delete_range": {"key": _b64(key)}}]}).get("succeeded"))

    def compact(self, revision: int) -> None:
        """Compact history up to `revision` (operators' tool; tests use it to force a re-list)."""
        self.call("kv/compaction", {"revision": str(revision), "physical": True})

    # -- leases ------------------------------------------------------------------------------
    def grant(self, ttl: int) -> tuple[int, int]:
        """A new lease: (id, the TTL etcd granted, which may be longer than asked)."""
        answer = self.call("lease/grant", {"TTL": str(ttl)})
        return int(answer["ID"]), int(answer.get("TTL", ttl))

    def keepalive(self, lease: int) -> int:
        """Refresh `lease`; the TTL it has again, 0 if it had already expired."""
        answer = self.call("lease/keepalive", {"ID": str(lease)})
        return int(answer.get("result", answer).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        """End `lease` now: every key on it is deleted (peers see it at once)."""
        self.call("lease/revoke", {"ID": str(lease)})

    # -- watch -------------------------------------------------------------------------------
    def watch(self, prefix: str, start_revision: int, keepalive_idle: float = 5.0) -> WatchStream:
        """Events under `prefix` from `start_revision` on (a stream of `WatchResponse` dicts)."""
        body = {"create_request": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                   "start_revision": str(start_revision)}}
        errors = []
        for i in range(len(self.endpoints)):
            host, port = self._endpoint(i)
            try:
                return WatchStream(host, port, body, self.timeout, keepalive_idle)
            except (OSError, http.client.HTTPException, DirectoryUnavailable) as exc:
                errors.append(f"{host}:{port}: {exc}")
        raise DirectoryUnavailable(f"etcd watch failed: {'; '.join(errors)}")


def event_key(event: dict) -> str:
    return _key(_unb64(event["kv"]["key"]))


def message_header(message: dict) -> Header:
    """The header of a watch message (revision, cluster id)."""
    return _header(message)


def event_value(event: dict) -> bytes:
    return _unb64(event["kv"].get("value", ""))


class WatchStream:
    """One open watch: iterate for its responses; `close()` ends it from any thread."""

    def __init__(self, host: str, port: int, body: dict, timeout: float, keepalive_idle: float) -> None:
        self.where = f"{host}:{port}"
        self._conn = http.client.HTTPConnection(host, port, timeout=timeout)
        self._closed = False
        self._reading = False
        try:
            self._conn.request("POST", "/v3/watch", json.dumps(body).encode(),
                               {"Content-Type": "application/json"})
            self._resp = self._conn.getresponse()
            if self._resp.status != 200:
                raise DirectoryUnavailable(f"etcd {self.where} watch answered {self._resp.status}: "
                                           f"{self._resp.read(4096)!r}")
            sock = self._conn.sock
            assert sock is not None
            sock.settimeout(None)  # an idle watch is silent: keep-alive, not a timeout, finds a dead peer
            _keepalive(sock, keepalive_idle)
        except BaseException:
            self._conn.close()
            raise

    def __iter__(self) -> Iterator[dict]:
        """Each `result` object; ends (StopIteration) when the server or `close()` ends the stream."""
        self._reading = True
        try:
            yield from self._messages()
        finally:
            self._reading = False
            self._conn.close()  # here, on the reading thread: http.client is not thread-safe

    def _messages(self) -> Iterator[dict]:
        while not self._closed:
            try:
                line = self._resp.readline(MAX_MESSAGE + 1)
            except Exception as exc:  # noqa: BLE001 — any read error ends the stream; which, we say
                if self._closed:
                    return
                raise DirectoryUnavailable(f"etcd {self.where} watch stream broke: "
                                           f"{exc!r}") from exc
            if not line:
                return
            if len(line) > MAX_MESSAGE:
                raise AnswerTooLarge(f"etcd {self.where}: watch message over {MAX_MESSAGE} B")
            if not line.strip():
                continue
            try:
                message = json.loads(line)
            except ValueError as exc:
                raise DirectoryUnavailable(f"etcd {self.where}: watch message is not JSON: "
                                           f"{line[:200]!r}") from exc
            if "error" in message:
                err = message["error"]
                raise DirectoryUnavailable(f"etcd {self.where} watch error: "
                                           f"{err.get('message', err) if isinstance(err, dict) else err}")
            yield message.get("result", {})

    def close(self) -> None:
        """End the stream; a blocked read returns at once. Idempotent, any thread."""
        if self._closed:
            return
        self._closed = True
        sock = self._conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the reader, which closes the connection
            except OSError:
                pass
        if not self._reading:
            self._conn.close()


def _keepalive(sock: socket.socket, idle: float) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", max(1, int(idle))), ("TCP_KEEPINTVL", 1),
                        ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):  # Linux names; elsewhere the system's defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
