"""transport/'s shape, checked from the source: no import circles, no reaching into another's `_private`.

Issue #19: a backend is the small part that differs on the kit; a helper
module gets a narrow interface object, never its engine, so nothing imports
back to the engine and nothing calls another object's private methods.
Counted by `ast` over every module of transport/ (module-level and
function-level imports alike, `TYPE_CHECKING` ones included):

* an import circle: a strongly connected set of more than one module (the
  package root re-exporting its children excepted, as
  /work/shared/tools/import_cycles.py does);
* private access: `x._name` where `x` is anything but `self`/`cls` (another
  object's, or another module's, private attribute), and `from m import _name`
  for a module of ours (a library's private module is its business: NIXL keeps
  its exception classes in `nixl_cu12._bindings`, which nixl/agent.py imports).

Run as a script to print every finding: `python tests/transport/test_kit_structure.py`.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "transport"
PACKAGE = "pdxfer.transport"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _targets(mod: str, is_pkg: bool, node: ast.AST, mods: dict[str, Path]) -> set[str]:
    names: list[str] = []
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = mod.split(".") if mod else []
            if not is_pkg:
                base = base[:-1]
            if node.level > 1:
                base = base[: len(base) - (node.level - 1)]
            target = ".".join([*base, *([node.module] if node.module else [])])
        elif node.module and (node.module == PACKAGE or node.module.startswith(PACKAGE + ".")):
            target = node.module[len(PACKAGE):].lstrip(".")
        else:
            return set()
        names = [target] + [f"{target}.{a.name}".strip(".") for a in node.names]
    elif isinstance(node, ast.Import):
        names = [a.name[len(PACKAGE):].lstrip(".") for a in node.names
                 if a.name == PACKAGE or a.name.startswith(PACKAGE + ".")]
    return {n for n in names if n in mods and n != mod}


def import_circles() -> list[list[str]]:
    """Every strongly connected set of more than one module in transport/."""
    mods = _modules()
    graph = {}
    for mod, path in mods.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            deps |= _targets(mod, path.name == "__init__.py", node, mods)
        graph[mod] = {d for d in deps if mod and d}  # the root re-exporting its children: not a circle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_access() -> list[str]:
    """`file:line: expression` for every reach into another object's or module's `_private` name."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    continue
                out.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.ImportFrom) and (
                    node.level or (node.module or "").startswith("pdxfer")):  # ours, not a library's
                for alias in node.names:
                    if _private(alias.name):
                        out.append(f"{rel}:{node.lineno}: from {node.module} import {alias.name}")
    return out


def test_no_import_circles_in_transport() -> None:
    assert import_circles() == []


def test_no_module_reaches_into_another_ones_private_names() -> None:
    assert private_access() == []


if __name__ == "__main__":
    circles, private = import_circles(), private_access()
    for c in circles:
        print("circle:", " -> ".join(c))
    for p in private:
        print("private:", p)
    print(f"import circles: {len(circles)}; cross-module _private access: {len(private)}")
    sys.exit(1 if circles or private else 0)
