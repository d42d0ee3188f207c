"""Real pyverbs for the honesty tests: Debian's python3-pyverbs unpacked into a private prefix.

Never installed system-wide: its `ibverbs-providers` dependency makes every
process that created a NIXL agent segfault at exit. So the .debs are fetched
with `apt-get download` into the repo's ignored `.cache/pyverbs/` and
unpacked with `dpkg -x`; tests import pyverbs in a subprocess whose
`LD_LIBRARY_PATH`/`PYTHONPATH` point into the prefix (`env()`).

`ensure()` returns the prefix, or the reason it cannot exist here — the only
case in which the tests that need it skip. Run as a script (`make pyverbs`)
to fetch ahead of time.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PREFIX = ROOT / ".cache" / "pyverbs"
PACKAGES = ["python3-pyverbs", "libibverbs1", "librdmacm1", "libnl-3-200", "libnl-route-3-200"]
SITE = "usr/lib/python3/dist-packages"


def _download(where: str) -> subprocess.CompletedProcess:
    return subprocess.run(["apt-get", "download", *PACKAGES], cwd=where, capture_output=True,
                          text=True, timeout=300)


def ensure() -> Path | str:
    """The unpacked prefix (fetching it once), or why it cannot be had on this machine.

    Under a file lock: two pytest-xdist workers asking at once would both stage
    into `pyverbs.partial` and remove each other's files.
    """
    if (PREFIX / SITE / "pyverbs").is_dir():
        return PREFIX
    PREFIX.parent.mkdir(parents=True, exist_ok=True)
    with open(PREFIX.with_name("pyverbs.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return _fetch()


def _fetch() -> Path | str:
    if (PREFIX / SITE / "pyverbs").is_dir():  # the other asker fetched it meanwhile
        return PREFIX
    if sys.version_info[:2] != (3, 11):
        return f"Debian's python3-pyverbs is built for CPython 3.11; this is {sys.version.split()[0]}"
    if not (shutil.which("apt-get") and shutil.which("dpkg")):
        return "no apt-get/dpkg here to fetch Debian's python3-pyverbs"
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)  # apt's sandbox user must be able to write the .debs
        got = _download(tmp)
        if got.returncode != 0 and os.geteuid() == 0:  # a fresh container has no package lists
            subprocess.run(["apt-get", "update"], capture_output=True, timeout=300)
            got = _download(tmp)
        if got.returncode != 0:
            return f"apt-get download {' '.join(PACKAGES)} failed: {got.stderr.strip()[-300:]}"
        staging = PREFIX.with_name("pyverbs.partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for deb in sorted(Path(tmp).glob("*.deb")):
            subprocess.run(["dpkg", "-x", str(deb), str(staging)], check=True, timeout=120)
        shutil.rmtree(PREFIX, ignore_errors=True)
        staging.rename(PREFIX)  # whole or absent: a half-unpacked prefix is never seen
    return PREFIX


def env(prefix: Path) -> dict[str, str]:
    """Environment for a subprocess that imports the prefix's pyverbs."""
    libs = [prefix / "usr/lib/x86_64-linux-gnu", prefix / "lib/x86_64-linux-gnu"]
    out = dict(os.environ)
    out["LD_LIBRARY_PATH"] = os.pathsep.join([str(p) for p in libs] + [out.get("LD_LIBRARY_PATH", "")])
    out["PYTHONPATH"] = os.pathsep.join([str(prefix / SITE), out.get("PYTHONPATH", "")])
    return out


if __name__ == "__main__":
    result = ensure()
    print(result)
    sys.exit(0 if isinstance(result, Path) else 1)
