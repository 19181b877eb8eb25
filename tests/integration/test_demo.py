"""The README's first command: the demo trains, is killed, restores and matches bit for bit."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_demo_recovers_bit_for_bit(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mtc.head.cli", "demo", "--steps", "12", "--period", "3",
                        "--crash-at", "8", "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert '"bitwise_equal": true' in r.stdout
    assert "kill -9" in r.stdout and "restored step" in r.stdout
    assert "final parameters equal the uninterrupted run bit for bit" in r.stdout
