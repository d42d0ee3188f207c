"""`pdxfer doctor --etcd`: a live etcd answers with its version; an absent one fails by address, in time."""

from __future__ import annotations

import socket
import time

from pdxfer import doctor


def test_a_running_etcd_answers(etcd_url: str) -> None:
    finding = doctor.etcd(etcd_url, timeout=5.0)
    assert finding.ok is True, finding.detail
    assert finding.detail.startswith("etcd 3.")


def test_an_absent_etcd_fails_naming_the_address_within_the_timeout() -> None:
    with socket.socket() as s:  # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        start = time.monotonic()
        finding = doctor.etcd(f"http://127.0.0.1:{port}", timeout=1.0)
    assert finding.ok is False
    assert f"127.0.0.1:{port}" in finding.detail and finding.fix
    assert time.monotonic() - start < 10  # refused at once; the bound only catches a hang
