"""kill -9 of the writer at named points of a save never leaves a step visible."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import assert_trees_bitwise_equal
from mtc.head import CheckpointManager, MTCConfig

pytestmark = pytest.mark.chaos

DRIVER = Path(__file__).with_name("crash_driver.py")


@pytest.mark.parametrize("point", ["before_blobs", "between_blobs", "before_commit"])
def test_kill_during_save_keeps_previous_step(ramdisk, point):
    env = dict(os.environ)
    env.pop("MTC_CRASH_AT", None)
    r = subprocess.run([sys.executable, str(DRIVER), str(ramdisk), point], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stdout, r.stderr[-2000:])
    assert "survived" not in r.stdout
    sys.path.insert(0, str(DRIVER.parent))
    try:
        import crash_driver
    finally:
        sys.path.pop(0)
    cfg = MTCConfig(local_checkpoint_directory=str(ramdisk), enable_multi_tier_checkpointing=True,
                    local_checkpoint_period=1)
    with CheckpointManager(cfg) as m:
        assert m.all_steps() == [1]
        assert m.latest_step() == 1
        assert_trees_bitwise_equal(crash_driver.state(1), m.restore())
        # Leftovers of the killed step are garbage, never data: no temp file survives reopening,
        # and the next save of step 2 works and is complete.
        assert not list((Path(ramdisk) / "mtc" / "blobs").glob(".tmp-*"))
        m.save(2, crash_driver.state(2))
        m.wait_until_finished()
        assert m.all_steps() == [1, 2]
        assert_trees_bitwise_equal(crash_driver.state(2), m.restore(2))
