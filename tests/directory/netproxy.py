"""A loopback TCP proxy that a test can cut: a network partition between a client and etcd.

Killing etcd tests one fault; a partition tests another — etcd keeps running
and serving everyone else, while one process's streams break and its calls
are refused. `cut()` closes every relayed connection and refuses new ones
until `restore()`. Threads, bounded: each relay ends when either side closes.
"""

from __future__ import annotations

import socket
import threading


class NetProxy:
    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self._listen = socket.create_server(("127.0.0.1", 0))
        self.port = self._listen.getsockname()[1]
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._cut = False
        self._closed = False
        self._thread = threading.Thread(target=self._accept, daemon=True, name="netproxy")
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listen.accept()
            except OSError:
                return
            with self._lock:
                if self._cut or self._closed:
                    client.close()
                    continue
            try:
                upstream = socket.create_connection(self.target, timeout=2)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._socks |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._relay, args=(a, b), daemon=True).start()

    def _relay(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        """Drop every relayed connection and refuse new ones."""
        with self._lock:
            self._cut = True
            socks, self._socks = list(self._socks), set()
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def restore(self) -> None:
        with self._lock:
            self._cut = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.cut()
        try:
            self._listen.shutdown(socket.SHUT_RDWR)  # wakes accept(); close() alone does not
        except OSError:
            pass
        self._listen.close()
        self._thread.join(5)
