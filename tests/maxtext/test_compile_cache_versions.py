"""A compilation cache written by another jax/jaxlib is never used: the same program, compiled by
this project's environment and by MaxText's (another jax), finds no entry of the other's, and
computes the same result; each finds its own."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integration"))
from test_compile_cache import EXPECTED, run  # noqa: E402

pytestmark = [pytest.mark.maxtext, pytest.mark.integration]


def _jax(python: str) -> str:
    return subprocess.run([python, "-c", "import jax, jaxlib; print(jax.__version__, jaxlib.__version__)"],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_an_entry_of_another_jax_version_is_never_used(maxtext_python, ramdisk, tmp_path):
    if _jax(maxtext_python) == _jax(sys.executable):
        pytest.skip("both environments have the same jax: no other version to try")
    backup = tmp_path / "bucket"
    ours = run(ramdisk / "c", backup)
    assert ours["uploaded"] >= 1, ours
    shutil.rmtree(ramdisk / "c")
    theirs = run(ramdisk / "c", backup, python=maxtext_python)  # the same path, the same program
    assert theirs["filled"] >= 1 and theirs["hits"] == 0 and theirs["misses"] >= 1, theirs
    assert theirs["out"] == EXPECTED["double"]
    shutil.rmtree(ramdisk / "c")
    again = run(ramdisk / "c", backup, python=maxtext_python)  # now the backup holds both versions' entries
    assert again["hits"] >= 1 and again["misses"] == 0, again
    shutil.rmtree(ramdisk / "c")
    back = run(ramdisk / "c", backup)
    assert back["hits"] >= 1 and back["misses"] == 0 and back["out"] == EXPECTED["double"], back
