"""The tiers' layout (docs/architecture.md, "Where the code is"): what each folder of ``sidecar/``
and ``shared/`` may import, read from the source with ``ast`` (an import inside a function counts)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

# folder -> the mtc packages its modules may import (besides their own folder)
ALLOWED = {
    "sidecar/ram": ("mtc.shared",),
    "sidecar/peer": ("mtc.shared", "mtc.sidecar.ram", "mtc.sidecar.tcpserver"),
    "sidecar/backup": ("mtc.shared", "mtc.sidecar.ram", "mtc.sidecar.fencing", "mtc.sidecar.faults"),
    "shared": (),
}


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in out if m.startswith("mtc.")}


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_each_folder_imports_only_what_its_role_allows(folder):
    own = "mtc." + folder.replace("/", ".")
    bad = {}
    for path in sorted((REPO / folder).rglob("*.py")):
        wrong = sorted(m for m in _imports(path)
                       if not _within(m, own) and not any(_within(m, a) for a in ALLOWED[folder]))
        if wrong:
            bad[str(path.relative_to(REPO))] = wrong
    assert not bad, f"imports outside what {folder}/ may import: {bad}"


TRANSPORTS = ("sidecar/colocated.py", "sidecar/daemon.py")
TIERS = ("mtc.sidecar.ram", "mtc.sidecar.peer", "mtc.sidecar.backup")


@pytest.mark.parametrize("module", TRANSPORTS)
def test_the_transports_import_no_tier(module):
    """A transport only decodes a request, calls the service and encodes its answer: what it needs of a
    tier the service (or its store) gives it, and what both sides share is in ``mtc.shared``."""
    wrong = sorted(m for m in _imports(REPO / module) if any(_within(m, t) for t in TIERS))
    assert not wrong, f"{module} imports the tiers' modules {wrong}; reach them through the service"


def test_the_check_can_fail(tmp_path):
    """A module of the RAM tier importing the head is caught."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from mtc.head.manager import CheckpointManager\n")
    assert _imports(f) == {"mtc.head.manager", "mtc.head.manager.CheckpointManager"}
    assert not any(_within(m, "mtc.shared") for m in _imports(f))
