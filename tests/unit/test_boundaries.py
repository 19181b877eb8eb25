"""The house rule: mtc.head and mtc.sidecar never import each other (docs/architecture.md, "Processes")."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _imports(folder: str) -> list[tuple[str, str]]:
    out = []
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out += [(str(path.relative_to(ROOT)), a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                out.append((str(path.relative_to(ROOT)), node.module))
    return out


@pytest.mark.parametrize("folder, forbidden", [("head", ("mtc.sidecar",)), ("sidecar", ("mtc.head",)),
                                               ("shared", ("mtc.head", "mtc.sidecar"))])
def test_no_static_imports_across_the_seam(folder, forbidden):
    bad = [(f, m) for f, m in _imports(folder) if m.startswith(forbidden)]
    assert not bad, f"{folder}/ imports across the head/sidecar boundary: {bad}"


def test_importing_every_head_module_loads_no_sidecar_code():
    modules = sorted(".".join(p.relative_to(ROOT / "head").with_suffix("").parts)
                     for p in (ROOT / "head").rglob("*.py") if p.stem not in ("__init__", "__main__"))
    code = ("import sys\n" + "".join(f"import mtc.head.{m}\n" for m in modules) +
            "bad = [m for m in sys.modules if m.startswith('mtc.sidecar')]\n"
            "assert not bad, bad\nprint('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_no_generic_top_level_module_installed():
    import mtc.head
    import mtc.shared
    import mtc.sidecar

    for name in ("head", "shared", "sidecar"):
        r = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True, cwd="/")
        assert r.returncode != 0, f"a top-level module {name!r} is importable"
    assert Path(mtc.head.__file__).parent.name == "head"
