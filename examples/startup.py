"""Ctrl-C while an example program starts: one line, never an import traceback.

A terminal's Ctrl-C reaches the launcher and every worker it started at
once, and each of them spends its first seconds importing torch and probing
the transports (longer on a busy host). Python's default handler raises
`KeyboardInterrupt` wherever that import happens to be, and the user reads a
40-line traceback out of torch or ucxx. So `examples/__init__.py` calls
`quiet_start` when a `python -m examples.X` begins, before X imports
anything: from then until X installs its own handling (`handled()` in the
launchers, `serving.StopSignals` in the workers) SIGINT and SIGTERM end the
process at once with the shell's 128 + signal status and one line, or none
for a worker whose launcher speaks for it (`--die-with-parent`). Nothing
that needs closing exists yet at that point.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_program = False  # set by quiet_start: this process is `python -m examples.X`


def _stop(signum: int, _frame: Any) -> None:
    if "--die-with-parent" not in sys.argv:
        os.write(2, b"interrupted while starting\n")  # no buffered stream in a handler
    os._exit(128 + signum)


def quiet_start() -> None:
    """Until `handled()`, SIGINT and SIGTERM end the process with one line (see the module)."""
    global _program
    _program = True
    for sig in _SIGNALS:
        signal.signal(sig, _stop)


def handled() -> None:
    """The program handles Ctrl-C itself from here: SIGINT raises `KeyboardInterrupt` again.

    Only a handler `quiet_start` installed is replaced (a launcher's own SIGTERM
    handler stays); off the main thread, or when this process never called
    `quiet_start` (tests call `main()` in-process), nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, default in zip(_SIGNALS, (signal.default_int_handler, signal.SIG_DFL), strict=True):
        if signal.getsignal(sig) is _stop:
            signal.signal(sig, default)


def is_program() -> bool:
    """Whether this process is an example program (`python -m examples.X`), not a test calling
    its `main()` in-process: only a program may keep its own signal handling until it exits."""
    return _program
