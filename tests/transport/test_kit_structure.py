"""The package's shape, checked from the source: no import circles, no reaching into another's `_private`.

Issue #19: a backend is the small part that differs on the kit; a helper
module gets a narrow interface object, never its engine, so nothing imports
back to the engine and nothing calls another object's private methods.
Issue #29 holds the PD engine to the same rules: the same counts run over
all of pdxfer/ (its drivers, lifecycle, directory, integrations, benches)
as over transport/ alone. Counted by `ast` over every module of the tree
(module-level and function-level imports alike, `TYPE_CHECKING` ones
included):

* an import circle: a strongly connected set of more than one module (the
  package root re-exporting its children excepted, as
  /work/shared/tools/import_cycles.py does);
* private access: `x._name` where `x` is anything but `self`/`cls` (another
  object's, or another module's, private attribute), and `from m import _name`
  for a module of ours (a library's private module is its business: NIXL keeps
  its exception classes in `nixl_cu12._bindings`, which nixl/agent.py imports).
  `super()._name` is the object's own. A third-party object's private
  attribute an integration cannot avoid is listed in `FOREIGN` with why —
  named here, never skipped silently.

Run as a script to print every finding: `python tests/transport/test_kit_structure.py`.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PDXFER = Path(__file__).resolve().parents[2] / "pdxfer"
# tree -> (its directory, its package name)
TREES = {"transport": (PDXFER / "transport", "pdxfer.transport"), "pdxfer": (PDXFER, "pdxfer")}
# `file: expression` -> why: private attributes of other projects' objects that an
# integration has to touch (none of ours may be listed here).
FOREIGN = {
    "pdxfer/integrations/vllm.py: request._all_token_ids":
        "vLLM's Request keeps its token list only there (all_token_ids is a read-only view); "
        "the Mamba prefill backoff trims the prompt's tail in both lists",
}


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _targets(mod: str, is_pkg: bool, node: ast.AST, mods: dict[str, Path], package: str) -> set[str]:
    names: list[str] = []
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = mod.split(".") if mod else []
            if not is_pkg:
                base = base[:-1]
            if node.level > 1:
                base = base[: len(base) - (node.level - 1)]
            target = ".".join([*base, *([node.module] if node.module else [])])
        elif node.module and (node.module == package or node.module.startswith(package + ".")):
            target = node.module[len(package):].lstrip(".")
        else:
            return set()
        names = [target] + [f"{target}.{a.name}".strip(".") for a in node.names]
    elif isinstance(node, ast.Import):
        names = [a.name[len(package):].lstrip(".") for a in node.names
                 if a.name == package or a.name.startswith(package + ".")]
    return {n for n in names if n in mods and n != mod}


def import_circles(tree: str = "transport") -> list[list[str]]:
    """Every strongly connected set of more than one module in `tree` (a key of `TREES`)."""
    root, package = TREES[tree]
    mods = _modules(root)
    graph = {}
    for mod, path in mods.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            deps |= _targets(mod, path.name == "__init__.py", node, mods, package)
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


def _own(owner: ast.AST) -> bool:
    """`self`, `cls` or `super()`: the object's own attribute."""
    if isinstance(owner, ast.Name):
        return owner.id in ("self", "cls")
    return (isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name)
            and owner.func.id == "super")


def private_access(tree: str = "transport") -> list[str]:
    """`file:line: expression` for every reach into another object's or module's `_private` name."""
    root = TREES[tree][0]
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                if _own(node.value) or f"{rel}: {ast.unparse(node)}" in FOREIGN:
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


def test_no_import_circles_in_pdxfer() -> None:
    assert import_circles("pdxfer") == []


def test_no_module_of_pdxfer_reaches_into_another_ones_private_names() -> None:
    assert private_access("pdxfer") == []


def test_every_foreign_exception_is_still_needed() -> None:
    """An entry of `FOREIGN` whose access is gone is dropped, not left to excuse a later one."""
    for key in FOREIGN:
        rel, expr = key.split(": ", 1)
        assert expr in (PDXFER.parent / rel).read_text(), f"FOREIGN lists {key!r}, no longer there"


if __name__ == "__main__":
    bad = 0
    for tree in TREES:
        circles, private = import_circles(tree), private_access(tree)
        for c in circles:
            print(f"{tree}: circle:", " -> ".join(c))
        for p in private:
            print(f"{tree}: private:", p)
        print(f"{tree}: import circles: {len(circles)}; cross-module _private access: {len(private)}")
        bad += len(circles) + len(private)
    sys.exit(1 if bad else 0)
