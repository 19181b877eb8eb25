"""The head's layout (docs/architecture.md, "Where the code is"): no import cycle among the
``mtc.head`` modules, modules named by their role, not by their folder, and every package of the
head installed (listed in pyproject.toml).

Read from the source with ``ast``, nothing imported. An import inside a function counts: deferring
an import hides a cycle from Python, not from the design. Imports under ``if TYPE_CHECKING:`` do
not count: they never run. Importing a module runs its packages' ``__init__`` first; that is not
counted as an edge either (``mtc.head``'s ``__init__`` imports the public names from the modules
below it).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

HEAD = Path(__file__).resolve().parents[2] / "head"
PACKAGE = "mtc.head"


def head_modules(head: Path = HEAD) -> dict[str, Path]:
    """Dotted name -> file, for every module under ``head`` (a package by its ``__init__.py``)."""
    out = {}
    for path in sorted(head.rglob("*.py")):
        parts = list(path.relative_to(head).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([PACKAGE, *parts])] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The ``mtc.head`` modules that module ``name`` (file ``path``) imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
            continue
        base = node.module or ""
        if node.level:  # relative: from the module's package, up level - 1
            anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            base = f"{anchor}.{base}" if base else anchor
        for a in node.names:
            if f"{base}.{a.name}" in modules:  # a submodule: from mtc.head.backup import plan
                out.add(f"{base}.{a.name}")
            elif base in modules:  # a name defined in the module
                out.add(base)
    out.discard(name)
    return out


def import_graph(head: Path = HEAD) -> dict[str, set[str]]:
    modules = head_modules(head)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (``[a, b, ..., a]``), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path, todo = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while todo:
            nxt = next(todo[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                todo.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                todo.append(iter(sorted(graph[nxt])))
    return None


def prefixed_names(head: Path = HEAD) -> list[str]:
    """Modules and folders under ``head`` named with the name of a folder they are in
    (``backup/backup_plan.py``, ``dispatch/cluster/cluster.py``): the folder already says it."""
    bad = []
    for path in sorted(head.rglob("*")):
        if path.name.startswith((".", "__")) or not (path.is_dir() or path.suffix == ".py"):
            continue
        rel = path.relative_to(head)
        stem = path.stem if path.is_file() else path.name
        folders = (head.name, *rel.parts[:-1])
        if any(stem == f or stem.startswith(f + "_") for f in folders):
            bad.append(str(rel))
    return bad


def test_graph_sees_the_head():
    graph = import_graph()
    assert "mtc.head.manager" in graph and "mtc.head.dispatch.interface" in graph["mtc.head.manager"]


def test_no_import_cycle_among_head_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle among mtc.head modules: " + " -> ".join(cycle or [])


def test_no_module_named_by_its_folder():
    bad = prefixed_names()
    assert not bad, f"named with the name of their folder (drop the prefix, the folder says it): {bad}"


def test_every_head_package_is_installed():
    import tomllib

    listed = set(tomllib.loads((HEAD.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {name for name, path in head_modules().items() if path.name == "__init__.py"}
    assert packages <= listed, f"pyproject.toml's [tool.setuptools] packages lacks {sorted(packages - listed)}"
    folders = {p.parent for p in HEAD.rglob("*.py")} - {p.parent for p in HEAD.rglob("__init__.py")}
    assert not folders, f"folders of modules without an __init__.py (not installed): {sorted(map(str, folders))}"
