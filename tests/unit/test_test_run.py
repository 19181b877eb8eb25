"""The test run itself: a test running longer than the heartbeat is named while it runs (a new user saw
15 minutes of dots and nothing else), and a test's folder is its layer marker."""

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


def test_a_test_marked_for_another_layer_than_its_folder_is_refused():
    """``-m unit`` selects exactly tests/unit: a test there marked integration (as 16 were) stops the run."""
    import uuid

    probe = TESTS / "unit" / f"test_zz_layer_probe_{uuid.uuid4().hex[:8]}.py"
    probe.write_text("import pytest\n\n\n@pytest.mark.integration\ndef test_x():\n    pass\n")
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                            "-o", "addopts=", str(probe)], cwd=TESTS.parent, capture_output=True, text=True, timeout=120)
    finally:
        probe.unlink()
    assert r.returncode != 0 and "layer marker and folder disagree" in r.stdout + r.stderr, r.stdout + r.stderr
    assert f"{probe.name}::test_x: in tests/unit, marked integration" in r.stdout + r.stderr
