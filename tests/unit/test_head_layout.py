"""The head's layout (docs/architecture.md, "Where the code is"): no import cycle among the
``mtc.head`` modules, no import up the head's floors (``FLOORS``), modules named by their role, not
by their folder, and every package of the head installed (listed in pyproject.toml).

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


# The head's floors, lowest first: a module imports modules of its own floor or below. A module's
# floor is that of the longest prefix that names it.
FLOORS = [
    ("ground: values every floor shares", (
        "mtc.head.commit", "mtc.head.tree", "mtc.head.reports", "mtc.head.elastic", "mtc.head.preemption",
        "mtc.head.lease", "mtc.head.items", "mtc.head.twin_check", "mtc.head.supervisor")),
    ("dispatch: how the head reaches the sidecars", ("mtc.head.dispatch",)),
    ("plans: the save's values and the tiers' plans", (
        "mtc.head.save", "mtc.head.restore.plan", "mtc.head.replication.plan", "mtc.head.backup.plan",
        "mtc.head.backup.listing")),
    ("tiers: replication, backup, restore", ("mtc.head.replication", "mtc.head.backup", "mtc.head.restore")),
    ("the manager", ("mtc.head.manager", "mtc.head.metrics")),
    ("adapters: Orbax's surface, MaxText's launcher", ("mtc.head.orbax", "mtc.head.maxtext")),
    ("tools", ("mtc.head.tools",)),
]
# The one import up: ``CheckpointManager.export`` offers the export to a standard Orbax checkpoint (a lazy
# import inside the method; the adapter itself reads the job through the manager).
UP_ALLOWED = {("mtc.head.manager", "mtc.head.orbax.export")}


def floor_of(module: str) -> int | None:
    best = None
    for i, (_, prefixes) in enumerate(FLOORS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    return None if best is None else best[0]


def imports_up(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for m, deps in sorted(graph.items()):
        if m == PACKAGE:  # the public API's __init__ imports from every floor
            continue
        fm = floor_of(m)
        if fm is None:
            out.append(f"{m}: on no floor (add it to FLOORS)")
            continue
        for d in sorted(deps - {PACKAGE}):
            fd = floor_of(d)
            if (fd is None or fd > fm) and (m, d) not in UP_ALLOWED:
                out.append(f"{m} ({FLOORS[fm][0]}) -> {d} ({FLOORS[fd][0] if fd is not None else 'no floor'})")
    return out


def test_no_import_runs_up_the_heads_floors():
    bad = imports_up(import_graph())
    assert not bad, "imports up the head's floors:\n" + "\n".join(bad)


def test_the_floor_check_sees_an_import_up(tmp_path):
    (tmp_path / "dispatch").mkdir()
    (tmp_path / "restore").mkdir()
    for d in (tmp_path, tmp_path / "dispatch", tmp_path / "restore"):
        (d / "__init__.py").write_text("")
    (tmp_path / "restore" / "plan.py").write_text("X = 1\n")
    (tmp_path / "dispatch" / "reads.py").write_text("def f():\n    from mtc.head.restore.plan import X\n")
    assert imports_up(import_graph(tmp_path)) == [
        "mtc.head.dispatch.reads (dispatch: how the head reaches the sidecars) -> mtc.head.restore.plan "
        "(plans: the save's values and the tiers' plans)"]


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
