"""kill -9 of a process writing to the RAM tier: reopening finds only whole, committed steps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from mtc.shared.errors import StepNotFoundError
from mtc.shared.hashing import blob_name
from mtc.sidecar.ram import RamStore

BLOB = 1 << 20
BLOBS_PER_STEP = 3

# Blob 0 is the same in every step (deduplicated); the others are new each step.
DRIVER = textwrap.dedent(f"""
    import json, os, sys
    import numpy as np
    from mtc.sidecar.faults import crash_point
    from mtc.sidecar.ram import RamStore

    def data(step, i):
        seed = 0 if i == 0 else step * 100 + i
        return np.random.default_rng(seed).integers(0, 256, {BLOB}, dtype=np.uint8)

    root, last = sys.argv[1], int(sys.argv[2])
    store = RamStore(root, max_to_keep=2)
    for step in range(1, last + 1):
        crash_point("before_blobs")
        names = []
        for i in range({BLOBS_PER_STEP}):
            if i:
                # Another I/O thread would be half-way through the next blob right now.
                fd, tmp = store.blobs.open_temp()
                os.write(fd, data(step, i)[: {BLOB} // 2].tobytes())
                crash_point("between_blobs")
                os.close(fd)
                store.blobs.discard_temp(tmp)
            names.append(store.blobs.write(data(step, i))[0])
        m = json.dumps({{"step": step, "shards": [{{"blob": n, "i": i}} for i, n in enumerate(names)]}}).encode()
        store.write_pending(step, m)
        crash_point("before_commit")
        store.commit(step, m)
        crash_point("after_commit")
        print("committed", step, flush=True)
""")


def expected(step: int, i: int) -> bytes:
    seed = 0 if i == 0 else step * 100 + i
    return np.random.default_rng(seed).integers(0, 256, BLOB, dtype=np.uint8).tobytes()


def temps(root: Path) -> list[Path]:
    return [p for p in root.rglob(".tmp-*")]


def check_reopened(root: Path, committed: list[int], killed: int | None) -> RamStore:
    store = RamStore(root, max_to_keep=2)
    assert temps(root) == []
    assert store.catalog.committed() == committed
    if killed is not None:
        with pytest.raises(StepNotFoundError, match=f"step {killed} "):
            store.catalog.read(killed)
    for s in committed:
        shards = json.loads(store.catalog.read(s))["shards"]
        assert len(shards) == BLOBS_PER_STEP
        for sh in shards:
            buf = np.empty(BLOB, np.uint8)
            store.blobs.read_into(sh["blob"], buf)
            assert buf.tobytes() == expected(s, sh["i"])
    return store


def run_driver(tmp_path: Path, root: Path, crash_at: str, last: int) -> subprocess.CompletedProcess:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = dict(os.environ, MTC_CRASH_AT=crash_at)
    return subprocess.run([sys.executable, str(script), str(root), str(last)], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.chaos
@pytest.mark.parametrize("crash_at, committed, torn_temp, new_blobs", [
    ("before_blobs@2", [1], False, 0),
    ("between_blobs@3", [1], True, 0),   # step 2: shared blob deduplicated, second half-written
    ("between_blobs@4", [1], True, 1),   # step 2: second blob written, third half-written
    ("before_commit@2", [1], False, 2),  # step 2: everything but the commit
    ("after_commit@2", [1, 2], False, 2),
])
def test_kill_at_a_crash_point(tmp_path, crash_at, committed, torn_temp, new_blobs):
    root = tmp_path / "mtc"
    r = run_driver(tmp_path, root, crash_at, last=3)
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr)
    assert r.stdout == "committed 1\n"  # every crash point fires in step 2, before its report
    assert bool(temps(root)) == torn_temp  # the crash left what a real one would
    on_disk = {p.name for p in (root / "blobs").iterdir()}
    assert sum(blob_name(expected(2, i)) in on_disk for i in range(1, BLOBS_PER_STEP)) == new_blobs
    killed = None if committed == [1, 2] else 2
    store = check_reopened(root, committed, killed)

    # Carrying on after the crash: the next commit collects the killed step's leftovers.
    names = [store.blobs.write(expected(3, i))[0] for i in range(BLOBS_PER_STEP)]
    store.commit(3, json.dumps({"step": 3, "shards": [{"blob": n, "i": i} for i, n in enumerate(names)]}).encode())
    kept = store.catalog.committed()
    assert kept == [committed[-1], 3]
    live = {blob_name(expected(s, i)) for s in kept for i in range(BLOBS_PER_STEP)}
    assert store.blobs.names() == live
    assert store.catalog.pending_steps() == []
    check_reopened(root, kept, None)


@pytest.mark.chaos
@pytest.mark.parametrize("kill_after", [1, 2, 4])
def test_kill_at_an_arbitrary_moment(tmp_path, kill_after):
    root = tmp_path / "mtc"
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = {k: v for k, v in os.environ.items() if k != "MTC_CRASH_AT"}
    proc = subprocess.Popen([sys.executable, str(script), str(root), "1000"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for want in range(1, kill_after + 1):
            line = proc.stdout.readline()
            assert line == f"committed {want}\n", (line, proc.stderr.read() if not line else "")
        # The driver is somewhere in step kill_after + 1 (or just done with it): kill it there.
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    store = RamStore(root, max_to_keep=2)
    steps = store.catalog.committed()
    # The kill lands wherever the driver is (a later step may have committed meanwhile): what is
    # visible must be the newest max_to_keep steps, whole.
    newest = steps[-1] if steps else None
    assert newest is not None and newest >= kill_after
    assert steps == list(range(max(1, newest - 1), newest + 1))
    check_reopened(root, steps, newest + 1)
