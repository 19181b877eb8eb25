"""kill -9 while the RAM tier holds free-pool files, or while it rewrites one.

Whatever the moment, reopening the store shows only committed steps whose blobs verify, no
temp file, and no blob with bytes other than its name says.
"""

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

from mtc.shared.hashing import blob_name
from mtc.sidecar.ram import RamStore

BLOB = 1 << 20

DRIVER = textwrap.dedent(f"""
    import json, os, signal, sys
    import numpy as np
    from mtc.sidecar.ram import blobs as ram
    from mtc.sidecar.ram import RamStore

    def data(step, i):
        return np.random.default_rng(step * 10 + i).integers(0, 256, {BLOB}, dtype=np.uint8)

    def save(store, step):
        names = [store.blobs.write(data(step, i))[0] for i in range(2)]
        m = json.dumps({{"step": step, "shards": [{{"blob": n}} for n in names]}}).encode()
        store.write_pending(step, m)
        store.commit(step, m)

    root, mode = sys.argv[1], sys.argv[2]
    store = RamStore(root, max_to_keep=1)
    for step in (1, 2, 3):
        save(store, step)
    print("pool", store.space.usage()["free_pool_count"], flush=True)
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)
    if mode == "idle":
        die()
    ram._WRITE_CHUNK = {BLOB} // 4
    if mode == "mid_rewrite":
        real_write, calls = os.write, []
        def write(fd, b):
            calls.append(1)
            if len(calls) == 3:
                die()  # half of a pool file rewritten with step 4's first blob
            return real_write(fd, b)
        ram.os.write = write
    elif mode == "after_link":
        real_link = os.link
        def link(src, dst):
            real_link(src, dst)
            die()  # published under its name, the pool name not yet removed
        ram.os.link = link
    save(store, 4)
    print("survived", flush=True)
""")


def expected(step: int, i: int) -> bytes:
    return np.random.default_rng(step * 10 + i).integers(0, 256, BLOB, dtype=np.uint8).tobytes()


@pytest.mark.chaos
@pytest.mark.parametrize("mode", ["idle", "mid_rewrite", "after_link"])
def test_kill_with_free_pool_files(tmp_path, mode):
    root = tmp_path / "mtc"
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = {k: v for k, v in os.environ.items() if k != "MTC_CRASH_AT"}
    r = subprocess.run([sys.executable, str(script), str(root), mode], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr)
    assert r.stdout == "pool 2\n"  # step 2's two files were in the pool when it died
    on_disk = list(Path(root, "blobs").iterdir())
    assert any(p.name.startswith(".tmp-free-") for p in on_disk)  # what a real crash leaves

    store = RamStore(root, max_to_keep=1)
    assert [p for p in root.rglob(".tmp-*")] == []
    assert store.catalog.committed() == [3]
    for sh in json.loads(store.catalog.read(3))["shards"]:
        assert sh["blob"] in {blob_name(expected(3, i)) for i in range(2)}
    # No visible blob has bytes other than its name says; the torn one is not visible.
    for name in store.blobs.names():
        assert store.blobs.verify(name), name
    torn = blob_name(expected(4, 0))
    assert store.blobs.has(torn) == (mode == "after_link")
    assert store.space.usage()["free_pool_count"] == 0
    # Carrying on: step 4 saves, step 3 goes, and everything left verifies.
    names = [store.blobs.write(expected(4, i))[0] for i in range(2)]
    m = json.dumps({"step": 4, "shards": [{"blob": n} for n in names]}).encode()
    store.write_pending(4, m)
    store.commit(4, m)
    assert store.catalog.committed() == [4]
    assert store.blobs.names() == set(names)
    for i, n in enumerate(names):
        assert store.read_blob(n) == expected(4, i)
