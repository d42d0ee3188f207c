"""Dependencies point one way: layout <- transport <- pdxfer <- examples.

Checked from the source text (imports parsed by `ast`, relative ones resolved
against the name each folder installs as), so a stray import is caught even
when it sits in a branch no other test executes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# folder -> the package name it installs as (pyproject's package-dir mapping).
INSTALLED = {"layout": "pdxfer.layout", "transport": "pdxfer.transport", "pdxfer": "pdxfer"}

# folder -> the project modules it may import. `transport` may import only the
# error root from `layout`: it knows byte ranges, never fields.
ALLOWED = {
    "layout": {"pdxfer.layout"},
    "transport": {"pdxfer.transport", "pdxfer.layout.errors"},
    "pdxfer": {"pdxfer"},
}
# Names that were top-level packages before they moved under `pdxfer`; an
# import of one is always wrong now (it would only work from a checkout).
RETIRED = {"layout", "transport"}


def _imports(path: Path, package: str) -> list[str]:
    """Absolute module names imported by `path`, a module of `package`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base = node.module or ""
            else:
                parts = package.split(".")
                anchor = parts[: len(parts) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" for a in node.names] if not node.module else [base]
            out += names
    return out


def _allowed(name: str, allowed: set[str]) -> bool:
    return any(name == a or name.startswith(a + ".") for a in allowed)


def _project(name: str) -> bool:
    return name.split(".")[0] in {"pdxfer", "examples"} | RETIRED


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_package_imports_only_downstream(folder: str) -> None:
    files = sorted((ROOT / folder).glob("*.py"))
    assert files, f"no modules found under {folder}/"
    bad = [
        f"{f.name} imports {name}"
        for f in files
        for name in _imports(f, INSTALLED[folder])
        if _project(name) and not _allowed(name, ALLOWED[folder])
    ]
    assert not bad, f"{folder}/ breaks the dependency direction: {bad}"


@pytest.mark.parametrize("folder", ["layout", "transport", "pdxfer", "examples", "tests"])
def test_no_import_of_a_retired_top_level_name(folder: str) -> None:
    files = sorted((ROOT / folder).rglob("*.py"))
    bad = [
        f"{f.relative_to(ROOT)} imports {name}"
        for f in files
        for name in _imports(f, INSTALLED.get(folder, folder))
        if name.split(".")[0] in RETIRED
    ]
    assert not bad, f"import these as pdxfer.layout / pdxfer.transport: {bad}"


def test_checker_flags_a_wrong_way_import(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import pdxfer.engine\nfrom pdxfer.transport.tcp import TcpEngine\n"
        "from ..transport import base\nfrom .fields import EntryField\n"
    )
    names = _imports(probe, "pdxfer.layout")
    assert names == ["pdxfer.engine", "pdxfer.transport.tcp", "pdxfer.transport",
                     "pdxfer.layout.fields"]
    assert not _allowed("pdxfer.engine", ALLOWED["layout"])
    assert not _allowed("pdxfer.transport", ALLOWED["layout"])
    assert _allowed("pdxfer.layout.fields", ALLOWED["layout"])
    assert _allowed("pdxfer.layout.errors", ALLOWED["transport"])
    assert not _allowed("pdxfer.layout.fields", ALLOWED["transport"])


ENGINES = {"sglang", "vllm"}


def test_the_core_never_imports_a_serving_engine_nor_the_integrations() -> None:
    # pdxfer/integrations/ adapts pdxfer to SGLang and vLLM (guarded imports); everything else
    # in pdxfer must import without them, and without the adapters.
    core = [f for f in sorted((ROOT / "pdxfer").rglob("*.py")) if "integrations" not in f.parts]
    core += sorted((ROOT / "layout").glob("*.py")) + sorted((ROOT / "transport").glob("*.py"))
    bad = [f"{f.relative_to(ROOT)} imports {name}" for f in core
           for name in _imports(f, "pdxfer")
           if name.split(".")[0] in ENGINES or name.startswith("pdxfer.integrations")]
    assert not bad, f"the core must not depend on a serving engine: {bad}"


def test_the_integrations_import_only_pdxfer_and_their_engine() -> None:
    files = sorted((ROOT / "pdxfer" / "integrations").glob("*.py"))
    assert files, "no modules under pdxfer/integrations/"
    bad = [f"{f.name} imports {name}" for f in files
           for name in _imports(f, "pdxfer.integrations")
           if (_project(name) and not name.startswith("pdxfer"))
           or (name.split(".")[0] in ENGINES and name.split(".")[0] != f.stem)]
    assert not bad, f"pdxfer/integrations/ breaks the dependency direction: {bad}"
