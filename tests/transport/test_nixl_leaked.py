"""A NIXL request whose release keeps failing is kept and released at teardown, never forgotten (#29 item 6).

The polling loop gave up after `RELEASE_TRIES` failed releases and dropped
the request: the last reference to a request NIXL still held went, and the
teardown never tried again. NIXL's own python API keeps such handles
(`_leaked_xfer_handles`); so do we, in `Requests.leaked`, and `release_all`
tries each once more. Driven with a fake agent: no NIXL needed.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

nixl_requests = pytest.importorskip("pdxfer.transport.nixl.requests")


class StuckRequest:
    """A finished request whose release fails until `unstick()`."""

    def __init__(self) -> None:
        self.stuck, self.released, self.attempts = True, False, 0

    def release(self) -> None:
        self.attempts += 1
        if self.stuck:
            raise RuntimeError("NIXL_ERR_BACKEND: request still active")
        self.released = True


class Agent:
    def get_new_notifs(self) -> dict:
        return {}

    def check_xfer_state(self, xfer: StuckRequest) -> str:
        return "DONE"


def test_an_unreleasable_request_is_kept_and_released_at_teardown() -> None:
    initiator = SimpleNamespace(lock=threading.RLock(), agent=Agent())
    requests = nixl_requests.Requests(initiator)
    link = SimpleNamespace(peer="decode-1", dead=False, ctx=SimpleNamespace(drains=False))
    xfer = StuckRequest()
    requests._sends.append(nixl_requests._Send(link, xfer, None, (1, 7)))  # as post() files it
    for _ in range(nixl_requests.RELEASE_TRIES):
        requests.poll()
    assert xfer.attempts == nixl_requests.RELEASE_TRIES
    # polling stopped retrying it ...
    requests.poll()
    assert xfer.attempts == nixl_requests.RELEASE_TRIES  # ... each round
    assert [send.xfer for send in requests.leaked] == [xfer]  # ... but kept it
    xfer.stuck = False
    with initiator.lock:
        requests.release_all()  # teardown tries once more
    assert xfer.released and not requests.leaked


def test_a_request_that_refuses_at_teardown_too_stays_referenced() -> None:
    initiator = SimpleNamespace(lock=threading.RLock(), agent=Agent())
    requests = nixl_requests.Requests(initiator)
    link = SimpleNamespace(peer="decode-1", dead=False, ctx=SimpleNamespace(drains=False))
    xfer = StuckRequest()
    requests._sends.append(nixl_requests._Send(link, xfer, None, (1, 7)))
    for _ in range(nixl_requests.RELEASE_TRIES):
        requests.poll()
    with initiator.lock:
        requests.release_all()
    assert not xfer.released and [send.xfer for send in requests.leaked] == [xfer]
