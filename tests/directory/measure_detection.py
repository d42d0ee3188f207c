"""How long a follower takes to notice a frozen etcd and an etcd rebuilt from nothing (docs/reliability.md, #35).

Run: `.venv/bin/python tests/directory/measure_detection.py [runs]`. Each run
starts its own throwaway etcd (`EtcdServer`), so it needs the binary the test
suite uses. Printed per TTL: seconds from SIGSTOP to `health().degraded` and
from SIGCONT to connected again; seconds from the fresh etcd being healthy to a
new registration visible and a record only the old store had gone, with the
fresh store behind the view's revision and already past it ("overtaken").
"""

from __future__ import annotations

import shutil
import signal
import sys
import time
import uuid
from pathlib import Path

from pdxfer.directory import EtcdDirectory, PeerRecord, Slot
from pdxfer.directory.etcd_client import EtcdClient
from pdxfer.directory.etcd_server import EtcdServer, find_etcd

WAIT = 30.0


def _rec(slot: Slot, engine: str) -> PeerRecord:
    return PeerRecord(slot, "127.0.0.1:1000", engine, "tcp")


def _follower(url: str, cluster: str, ttl: int) -> EtcdDirectory:
    view = EtcdDirectory(url, cluster=cluster, ttl=ttl, follow=[("m", "prefill")])
    assert view.wait_connected(WAIT), view.health()
    return view


def frozen(ttl: int) -> tuple[float, float, float]:
    with EtcdServer(find_etcd()) as srv:
        view = _follower(srv.url, f"m{uuid.uuid4().hex[:6]}", ttl)
        try:
            srv.kill(signal.SIGSTOP)
            t = time.monotonic()
            assert view.wait_for(lambda: view.health().degraded, WAIT)
            took = time.monotonic() - t
            srv.kill(signal.SIGCONT)
            t = time.monotonic()
            assert view.wait_connected(WAIT)
            return took, time.monotonic() - t, view.probe + view._client.timeout
        finally:
            srv.kill(signal.SIGCONT)
            view.close()


def rebuilt(ttl: int, overtake: bool) -> tuple[float, float]:
    with EtcdServer(find_etcd()) as srv:
        cluster = f"m{uuid.uuid4().hex[:6]}"
        old, view = EtcdDirectory(srv.url, cluster=cluster, ttl=ttl), _follower(srv.url, cluster, ttl)
        a, b = Slot("m", "prefill", "a"), Slot("m", "prefill", "b")
        old.register(a, _rec(a, "e1"))
        assert view.wait_for(lambda: view.resolve(a) is not None, WAIT)
        old.close(revoke=False)  # its process went down with the old store
        srv.kill()
        shutil.rmtree(Path(srv.data_dir) / "data")
        srv.start()
        t = time.monotonic()
        client = EtcdClient(srv.url)
        new = EtcdDirectory(srv.url, cluster=cluster, ttl=ttl)
        try:
            if overtake:
                for n in range(view.health().revision + 5):
                    client.put(f"/elsewhere/{n}", b"y")
            new.register(b, _rec(b, "e2"))
            assert view.wait_for(lambda: view.resolve(b) is not None and view.resolve(a) is None,
                                 WAIT)
            return time.monotonic() - t, view.probe + view._client.timeout
        finally:
            view.close()
            new.close()
            client.close()


def main() -> int:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    for ttl in (3, 10):
        for _ in range(runs):
            took, back, bound = frozen(ttl)
            print(f"frozen    ttl={ttl:2}: degraded {took:.2f} s after SIGSTOP (bound {bound:.2f} s), "
                  f"connected {back:.2f} s after SIGCONT", flush=True)
        for overtake in (False, True):
            for _ in range(runs):
                took, bound = rebuilt(ttl, overtake)
                print(f"rebuilt   ttl={ttl:2} {'overtaken' if overtake else 'behind   '}: seen "
                      f"{took:.2f} s after the fresh etcd was healthy (bound {bound:.2f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
