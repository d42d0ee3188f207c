"""The PD engine's `close()` runs every step even if one raised, and a second close finishes (#29 item 4).

Before, a step that raised (here: stopping the progress thread) skipped the
transport's close, and a second `close()` returned at once with the
transport's links open and its regions registered.
"""

from __future__ import annotations

import pytest
from pdxfer.transport import CloseError
from pdxfer_testkit import build_pools, config

from pdxfer import DecodeEngine, PrefillEngine


class Once:
    """Raise `RuntimeError` on the first call, then do what the wrapped call did."""

    def __init__(self, fn) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("injected failure")
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize("kind", [PrefillEngine, DecodeEngine])
def test_a_raising_close_step_skips_nothing_and_a_second_close_finishes(kind) -> None:
    engine = kind(build_pools(16, 4), config("tcp"))
    engine._progress.stop = Once(engine._progress.stop)
    with pytest.raises(CloseError, match=r"(prefill|decode) engine .*: 1 step\(s\) failed \(stop "
                                         r"the progress thread: RuntimeError: injected failure\)"):
        engine.close()
    assert engine._transport.closed  # the steps after the failed one ran
    engine.close()  # retries the failed step, and only it
    assert engine._progress.stop.calls == 2
    engine.close()
    assert engine._progress.stop.calls == 2
