"""Link the pinned distributions this interpreter's environment already holds into an engine's venv.

`tests/engines/run.sh` builds each engine's venv with `pip install --no-deps -r PINS`. Where
the checkout's own `.venv` (`make setup`'s, which CI builds for `make test` first) already
holds a pinned distribution at exactly the pinned version (torch, numpy, sympy, pytest...),
unpacking and byte-compiling its wheel again is build time spent on nothing new: torch alone
is 0.7 GB and 2,300 modules. This hard-links that distribution's files, as its RECORD lists
them (the byte-compiled ones included), into the engine's venv; pip then finds the pin
satisfied and installs the rest from the index as before. The files are the bytes a wheel
install writes, except the shebang of console scripts, rewritten to the engine venv's Python.

A distribution is left to pip when its version differs from the pin, it is an editable install
(its files point into a source tree), its RECORD is missing or lists a file that is gone, or
the two interpreters differ (byte code and extension modules are
per Python build). Its `.dist-info` is linked last: a run cut short leaves no metadata claiming
a half-linked distribution, and pip installs it over. Files are copied where a hard link is
refused (another file system). Run under the source environment's Python:

    .venv/bin/python tests/engines/reuse_installed.py PINS TARGET_PYTHON

Prints one line per linked distribution.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(path: str) -> dict[str, str]:
    pins = {}
    for line in open(path, encoding="utf-8"):
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[_norm(name)] = version.strip()
    return pins


def _target(python: str) -> dict:
    probe = ("import json, sys, sysconfig; print(json.dumps({'version': sys.version, "
             "'purelib': sysconfig.get_paths()['purelib'], 'scripts': sysconfig.get_paths()['scripts']}))")
    return json.loads(subprocess.run([python, "-c", probe], check=True, capture_output=True,
                                     text=True).stdout)


def _place(src: str, dst: str, scripts: str, python: str) -> None:
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    if os.path.dirname(dst) == scripts:
        with open(src, "rb") as f:
            data = f.read()
        if data.startswith(b"#!") and b"python" in data.split(b"\n", 1)[0]:
            # a console script: its shebang names the interpreter it was installed for
            with open(dst, "wb") as f:
                f.write(b"#!" + python.encode() + b"\n" + data.split(b"\n", 1)[1])
            shutil.copymode(src, dst)
            return
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def main(pins_path: str, python: str) -> None:
    """Link every pinned distribution found here at its pinned version into `python`'s venv."""
    target = _target(python)
    if target["version"] != sys.version:
        print(f"nothing reused: this is Python {sys.version.split()[0]}, the venv's "
              f"{target['version'].split()[0]}")
        return
    pins = _pins(pins_path)
    purelib, scripts = target["purelib"], os.path.normpath(target["scripts"])
    python = os.path.join(scripts, "python")
    done: set[str] = set()
    for dist in importlib.metadata.distributions():
        name = _norm(dist.metadata["Name"] or "")
        if name in done or pins.get(name) != dist.version or dist.files is None:
            continue
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
        if direct.get("dir_info", {}).get("editable"):
            continue
        files = [(str(f), str(dist.locate_file(f))) for f in dist.files]
        if not all(os.path.isfile(src) for _, src in files):
            continue
        meta = [(rel, src) for rel, src in files if ".dist-info" in rel]
        for rel, src in [f for f in files if f not in meta] + meta:
            dst = os.path.normpath(os.path.join(purelib, rel))
            if not os.path.exists(dst):
                _place(src, dst, scripts, python)
        done.add(name)
        print(f"reused {dist.metadata['Name']}=={dist.version} ({len(files)} files)")


if __name__ == "__main__":
    main(*sys.argv[1:])
