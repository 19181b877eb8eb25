"""The lock's resolution is reproducible from one command: `python images/build.py lock --check`
resolves again (uv, from PyPI) with the requirements and the exclude-newer date in the lock's
header, and must give the same file, byte for byte."""

from __future__ import annotations

import subprocess
import sys

import pytest

import oci

pytestmark = pytest.mark.images


def test_lock_check_reproduces_the_lock():
    out = subprocess.run([sys.executable, str(oci.IMAGES / "build.py"), "lock", "--check"], capture_output=True,
                         text=True, cwd=oci.REPO, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("ok: ") and "is reproduced exactly" in out.stdout


def test_lock_check_fails_on_a_lock_that_differs(tmp_path):
    lines = (oci.IMAGES / "requirements.lock").read_text().splitlines()
    dropped = lines[-1].strip()  # the last file hash of the last pin
    assert dropped.startswith("--hash=sha256:") and lines[-2].endswith(" \\")
    changed = tmp_path / "requirements.lock"
    changed.write_text("\n".join(lines[:-2] + [lines[-2][:-2]]) + "\n")
    out = subprocess.run([sys.executable, str(oci.IMAGES / "build.py"), "lock", "--check", "--lock", str(changed)],
                         capture_output=True, text=True, cwd=oci.REPO, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"+    {dropped}" in out.stdout and "differs from what uv resolves today" in out.stderr
