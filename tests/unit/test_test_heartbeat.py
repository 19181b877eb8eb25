"""The test run names what runs in its long silent tail: a test running longer than the heartbeat is
named while it runs (a new user saw 15 minutes of dots and nothing else)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_a_long_test_is_named_while_it_runs(tmp_path):
    (tmp_path / "test_slow_one.py").write_text("import time\n\ndef test_takes_a_while():\n    time.sleep(2.5)\n")
    env = {**os.environ, "MTC_TEST_HEARTBEAT_S": "0.5", "PYTHONPATH": str(TESTS)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q", "-n", "1",
                        "-o", "addopts=", str(tmp_path / "test_slow_one.py")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "still running after" in r.stdout and "test_slow_one.py::test_takes_a_while" in r.stdout, r.stdout
