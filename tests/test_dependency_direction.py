"""Dependencies point one way: layout <- transport <- pdxfer <- examples.

Checked from the source text (imports parsed by `ast`), so a stray import is
caught even when it sits in a branch no other test executes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> the project packages it may import. `transport` may import only
# the error root from `layout`: it knows byte ranges, never fields.
ALLOWED = {
    "layout": {"layout"},
    "transport": {"transport", "layout.errors"},
    "pdxfer": {"pdxfer", "transport", "layout"},
}
PROJECT = {"layout", "transport", "pdxfer", "examples"}


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module)
    return out


def _allowed(name: str, allowed: set[str]) -> bool:
    return any(name == a or name.startswith(a + ".") for a in allowed)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_downstream(package: str) -> None:
    files = sorted((ROOT / package).glob("*.py"))
    assert files, f"no modules found under {package}/"
    bad = [
        f"{f.name} imports {name}"
        for f in files
        for name in _imports(f)
        if name.split(".")[0] in PROJECT and not _allowed(name, ALLOWED[package])
    ]
    assert not bad, f"{package} breaks the dependency direction: {bad}"


def test_checker_flags_a_wrong_way_import(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("import pdxfer.engine\nfrom transport.tcp import TcpEngine\n")
    names = _imports(probe)
    assert names == ["pdxfer.engine", "transport.tcp"]
    assert not _allowed("pdxfer.engine", ALLOWED["layout"])
    assert _allowed("layout.errors", ALLOWED["transport"])
    assert not _allowed("layout.fields", ALLOWED["transport"])
