"""manifests/examples/ is what the renderer makes today (regenerate: python manifests/render_examples.py),
and each example is a valid JobSet."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2] / "manifests"


def _examples():
    spec = importlib.util.spec_from_file_location("render_examples", ROOT / "render_examples.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", ["pathways-gke-csi.yaml", "pathways-memory-emptydir.yaml"])
def test_examples_are_in_sync_with_the_renderer(name):
    mod = _examples()
    assert (ROOT / "examples" / name).read_text() == mod.render(name), (
        f"manifests/examples/{name} is stale: run python manifests/render_examples.py")


def test_examples_show_both_ramdisks_and_the_launcher():
    csi = list(yaml.safe_load_all((ROOT / "examples" / "pathways-gke-csi.yaml").read_text()))
    mem = list(yaml.safe_load_all((ROOT / "examples" / "pathways-memory-emptydir.yaml").read_text()))
    text_csi, text_mem = yaml.safe_dump_all(csi), yaml.safe_dump_all(mem)
    assert "multitier-checkpoint.csi.storage.gke.io" in text_csi and "medium: Memory" in text_mem
    assert "python3 -m mtc.head.maxtext" in text_csi and "kind: Secret" not in text_csi  # an existing Secret
