"""The vLLM tests' fork server: one process that imports vLLM once, for every worker process.

Each engine's TP ranks run in processes of their own (`vllm_harness.Engine`). A spawned
process imports vLLM itself (10 to 15 s here, each); forked from a server that imported it
once, a worker starts in under a second and imports nothing new. The server never ran a
pdxfer engine, a torch kernel or a thread, so its children start as clean as spawned ones.

Two traps this module exists for:

- Python's fork server (3.11 to 3.13) ignores the `sys.path` it is handed (its `main` takes
  the argument and drops it), and this directory is on `sys.path` only because pytest put it
  there; the preload's `ImportError` is swallowed, and every worker would then import vLLM
  on its own while the tests still passed, each a dozen seconds slower. The server is given
  this directory on `PYTHONPATH` instead, and `vllm_harness.Engine` refuses a worker that
  had to import the harness itself (`preloaded`).
- The server's import of vLLM is the suite's longest single step, and so is the pytest
  process's own (collecting the test modules): `tests/engines/conftest.py` starts the server
  before collection, so the two imports run side by side on two cores, not one after the other.

Imports nothing of vLLM itself: conftest.py calls `context()` before anything imports it.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os

HERE = os.path.dirname(os.path.abspath(__file__))
PRELOAD = "vllm_harness"


def context():
    """The forkserver context whose server preloaded `vllm_harness` (started on first call)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([PRELOAD])
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = HERE if not old else HERE + os.pathsep + old
    try:
        multiprocessing.forkserver.ensure_running()  # no-op once it runs
    finally:  # only the server's environment carries it, not the tests' subprocesses
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    return ctx


def preloaded(module_pid: int) -> bool:
    """Whether a module that recorded `os.getpid()` at import was imported by the server.

    In a worker forked from the server, the module was imported in the server's process
    (another pid); a worker that imported it itself records its own pid.
    """
    return module_pid != os.getpid()
