"""Suite-wide fixtures: one launcher run shared by every test that asks for the same options.

A launcher (`python -m examples.launch_*`: each has `parse_args(argv)`) starts
worker processes, each importing torch: one run costs 10-20 s on two cores. A
documented command (tests/test_docs.py) and an example test
(tests/examples/) often ask for the same run, and two documented lines may
spell the same options differently (`--requests 4` and `--prefill 2 --decode
2 --requests 4` with 2 the default). `launcher_run` runs each distinct set of
options once per session and hands every asker the same completed process:
each test still asserts what it asserts, on the very output of the command it
names. Runs are keyed by the launcher's own parse of the arguments
(`parse_args(argv)`), so "the same run" means what the program sees, not the
spelling; arguments it refuses are keyed as written (and run, so the test sees
the refusal).

Under pytest-xdist (`make test`: `-n 3`) the askers of one run may sit on
different workers: the result is kept as a file in the directory the workers'
temporary directories share, written under a file lock, so the first asker
runs the command and the others wait for it and read it. (xdist's own
`xdist_group` cannot be used: with pytest 9.2 its `--dist loadgroup` renames
no test and groups nothing.)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import io
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _options(module: str, args: Sequence[str]) -> tuple:
    """What the launcher makes of `args`: its parsed options, or the words when it refuses."""
    parse = importlib.import_module(module).parse_args
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            parsed = vars(parse(list(args)))
    except SystemExit:  # a refusal (or --help): the words themselves are the key
        return ("argv", *args)
    return ("options", *sorted((k, repr(v)) for k, v in parsed.items()))


@pytest.fixture(scope="session")
def launcher_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., subprocess.CompletedProcess]:
    """`launcher_run(module, args)`: `python -m module *args` run once per distinct options.

    Runs from the checkout with this venv first on PATH and no PYTHONPATH, the
    environment a reader following the docs has (tests/test_docs.py's `_in_bash`).
    """
    base = tmp_path_factory.getbasetemp()
    # xdist gives each worker basetemp/popen-gwN of one directory per run: that parent is
    # this run's alone (a later or concurrent session numbers its own).
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    where = shared / "launcher-runs"
    where.mkdir(exist_ok=True)

    def run(module: str, args: Sequence[str], timeout: float = 200.0) -> subprocess.CompletedProcess:
        key = repr((module, _options(module, args)))
        result = where / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"
        with open(result.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not result.exists():
                env = dict(os.environ, PATH=f"{Path(sys.prefix) / 'bin'}:{os.environ.get('PATH', '')}")
                env.pop("PYTHONPATH", None)
                proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                                      capture_output=True, text=True, timeout=timeout)
                result.write_text(json.dumps([key, proc.returncode, proc.stdout, proc.stderr]))
        got, code, out, err = json.loads(result.read_text())
        assert got == key, (got, key)
        return subprocess.CompletedProcess([sys.executable, "-m", module, *args], code, out, err)

    return run


# -- the suite's order: slowest files first ------------------------------------------------
#
# `make test` runs three xdist workers with `--dist worksteal`: each worker starts on a third of
# the collection and an idle one takes tests from the end of another's queue. The wall time
# is then set by what is left running at the end, so the files that take longest run first
# and the end of every queue is made of short tests. A file's weight is its measured time
# (setup + call + teardown of all its tests, seconds) from tests/durations.json; files stay
# whole and in their own order (their module-scoped fixtures are set up once per worker), and
# a file the table does not know yet weighs the median. Refresh the table after adding slow
# tests: `.venv/bin/python -m pytest -q -n 3 --dist worksteal --store-durations`.

DURATIONS = Path(__file__).with_name("durations.json")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--store-durations", action="store_true",
                     help="write each test file's measured time to tests/durations.json "
                          "(the order `make test` runs the files in: slowest first)")


def _weights() -> dict[str, float]:
    try:
        return json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    weights = _weights()
    if not weights:
        return
    known = sorted(weights.values())
    median = known[len(known) // 2]
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        first_seen.setdefault(_file_of(item.nodeid), i)
    # the same order on every worker (xdist requires identical collections): a pure
    # function of the table and the collection
    items.sort(key=lambda item: (-weights.get(_file_of(item.nodeid), median),
                                 first_seen[_file_of(item.nodeid)]))


_measured: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # Under xdist this runs in the controller for every worker's reports too.
    path = _file_of(report.nodeid)
    _measured[path] = _measured.get(path, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if not config.getoption("store_durations") or hasattr(config, "workerinput"):
        return
    table = _weights()
    table.update({path: round(seconds, 2) for path, seconds in _measured.items()})
    DURATIONS.write_text(json.dumps(dict(sorted(table.items())), indent=1) + "\n")
