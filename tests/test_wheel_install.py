"""What `pip install /path/to/pdxfer` gives a user works, without `-e` and outside the checkout.

`make setup` installs editable, so the suite otherwise imports pdxfer from
the checkout and cannot notice a package the wheel leaves out (a
`pyproject.toml` that listed packages by hand once shipped a wheel without
`pdxfer.lifecycle`: every command then failed with ModuleNotFoundError).
Here the wheel is built from a copy of the source, every module of
`pdxfer/`, `layout/` and `transport/` is looked for in it under the name it
installs as, and it is installed — not editable, `--no-deps` — into a fresh
venv whose only other path is the dev venv's site-packages (torch, numpy,
msgpack, nixl: no network). From a directory outside the checkout that
install then runs `pdxfer --version`, `pdxfer layout --example` and a
request between two processes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# repository folder -> the package it installs as (what setup.py maps)
INSTALLED = {"pdxfer": "pdxfer", "layout": "pdxfer/layout", "transport": "pdxfer/transport"}
SOURCE = ["pyproject.toml", "setup.py", "README.md", "LICENSE", "NOTICE", *INSTALLED]


def _run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float = 120) -> str:
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (f"{' '.join(map(str, argv))} exited {proc.returncode}\n"
                                  f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}")
    return proc.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from a copy of the source (the checkout gets no build/ or egg-info)."""
    src = tmp_path_factory.mktemp("src")
    for name in SOURCE:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif path.exists():
            shutil.copy2(path, src / name)
    out = tmp_path_factory.mktemp("dist")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
          "-w", str(out), str(src)], env, src, timeout=180)
    (built,) = out.glob("pdxfer-*.whl")
    return built


def test_the_wheel_holds_every_module_under_its_installed_name(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = []
    for folder, package in INSTALLED.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).as_posix()
            if "__pycache__" not in rel and f"{package}/{rel}" not in names:
                missing.append(f"{folder}/{rel}" + ("" if folder == package else f" (as {package}/{rel})"))
    assert not missing, ("the wheel leaves out " + ", ".join(missing) + ": a package folder "
                         "without __init__.py, or packaging that does not find it (setup.py)")
    assert not [n for n in names if n.split("/")[0] in ("layout", "transport", "tests", "examples")]


def test_installed_wheel_runs_the_cli_and_a_two_process_transfer(wheel: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     {}, tmp_path).strip())
    # torch, numpy, msgpack, nixl from the dev venv, appended after the fresh site-packages.
    # A plain path line: the dev venv's own .pth files (its editable pdxfer finder) are not run.
    (site / "dev-venv-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    env = {"PATH": f"{env_dir / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path),
           "PYTHONNOUSERSITE": "1"}
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
          "--no-index", "-q", str(wheel)], {**env, "PATH": os.environ["PATH"]}, tmp_path)
    work = tmp_path / "elsewhere"  # not the checkout: nothing can import from the tree
    work.mkdir()
    pdxfer = str(env_dir / "bin" / "pdxfer")
    assert _run([pdxfer, "--version"], env, work).strip() == "pdxfer 0.1.0"
    entry_maps = _run([pdxfer, "layout", "--example"], env, work)
    assert "entry" in entry_maps and "Traceback" not in entry_maps
    script = work / "installed_transfer.py"
    shutil.copy2(ROOT / "tests" / "packaging" / "installed_transfer.py", script)
    out = _run([str(python), str(script)], env, work)
    assert "decode exited 0" in out and "4 entries checked" in out, out
    for line in out.splitlines():  # both processes imported the installed package
        assert f"imported pdxfer from {site}/pdxfer/__init__.py" in line, out
