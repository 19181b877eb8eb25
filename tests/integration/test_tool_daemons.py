"""The temporary sidecar daemons a tool starts on a stopped job's ramdisk folders die with it.

`mtc verify --backup`, `mtc export` and `mtc status` read a stopped job's folders through a sidecar
daemon on each, for the time of the command. Real daemons, a real folder and a real backup folder:
a SIGTERM to the tool exits it through its cleanup (no traceback, the daemons stopped), a SIGKILL
takes them too (the kernel kills a daemon whose parent dies, ``--parent-pid``), and the next run
starts alone on the folders.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mtc.head import CheckpointManager, MTCConfig

pytestmark = pytest.mark.integration


def daemons_on(folder: Path) -> list[int]:
    """The pids of the sidecar daemons serving ``folder`` (from /proc: their command lines)."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            argv = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"mtc.sidecar" in argv and str(folder).encode() in argv:
            out.append(int(p.name))
    return out


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)
    return got


@pytest.fixture
def stopped_job(ramdisk, tmp_path):
    """A job's ramdisk folder (one host, two steps, both backed up) and its backup folder, no daemon on it."""
    folder, bucket = ramdisk / "host", tmp_path / "bucket"
    sh = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
    cfg = MTCConfig(local_checkpoint_directory=str(folder), local_checkpoint_period=1,
                    base_output_directory=str(bucket), run_name="run",
                    multi_tier_checkpointing_backup_interval_steps=1)
    with CheckpointManager(cfg) as m:
        for step in (1, 2):
            m.save(step, {"w": jax.device_put(np.arange(64 * 1024, dtype=np.float32) + step, sh)})
            m.wait_until_finished()
            assert m.wait_for_backup().error is None
    yield folder, bucket
    for pid in daemons_on(folder):  # what a failing run left: this test's own daemons only
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_killed_tool_leaves_no_daemon_on_the_folders(stopped_job, sig, tmp_path):
    folder, bucket = stopped_job
    slow = [sys.executable, "-m", "mtc.head.tools.cli", "verify", "--backup", "--local-checkpoint-directory",
            str(folder), "--base-output-directory", str(bucket), "--run-name", "run", "--bytes-per-s", "4096"]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    log = tmp_path / "tool.log"  # a file, not a pipe: a daemon that outlived the tool would hold a pipe open
    with open(log, "w") as f:
        tool = subprocess.Popen(slow, env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        # The scrub of 512 KiB at 4 KiB/s takes minutes: the tool is still running when it is signalled.
        wait_for(lambda: daemons_on(folder), 60, "the tool's daemon did not start")
        time.sleep(1.0)
        assert tool.poll() is None, log.read_text()
        tool.send_signal(sig)
        tool.wait(timeout=60)
    finally:
        tool.kill()
    err = log.read_text()
    assert tool.returncode == (128 + signal.SIGTERM if sig == signal.SIGTERM else -signal.SIGKILL), err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    wait_for(lambda: not daemons_on(folder), 15, f"the tool's daemons outlived it: {daemons_on(folder)}")
    # The next run is alone on the folder, and stops its daemon when it is done.
    r = subprocess.run([sys.executable, "-m", "mtc.head.tools.cli", "status", "--local-checkpoint-directory",
                        str(folder), "--base-output-directory", str(bucket), "--run-name", "run"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "restore would choose: step 2" in r.stdout, r.stdout + r.stderr[-2000:]
    assert daemons_on(folder) == []
