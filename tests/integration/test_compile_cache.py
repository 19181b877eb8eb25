"""The compilation cache a restarted process finds: on the ramdisk, or filled from the backup.

Each run is a new process (as a restarted pod is) that compiles one program with JAX's
persistent cache in ``mtc.head.maxtext.compile_cache.CompileCache`` and reports JAX's own cache-hit and
miss events, not a timing. The programs' results are checked too: a cached program computes
what a compiled one does.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

RUN = """
import json, sys
from mtc.head.maxtext.compile_cache import CompileCache
local, backup, program = sys.argv[1], sys.argv[2] or None, sys.argv[3]
cache = CompileCache(local, backup)
cache.start_fill()
cache.enable()
cache.wait_filled()
import jax, numpy as np
fn = {"double": lambda x: x * 2.0 + 1.0, "square": lambda x: x * x - 3.0}[program]
out = jax.jit(fn)(np.arange(16, dtype=np.float32))  # one program: the input is not computed by jax
cache.sync()
cache.close()
print(json.dumps({"hits": cache.hits, "misses": cache.misses, "filled": cache.filled, "uploaded": cache.uploaded,
                  "out": [float(v) for v in out], "entries": cache.entries()}))
"""


def run(local: Path, backup: Path | None, program: str = "double", python: str = sys.executable) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    r = subprocess.run([python, "-c", RUN, str(local), str(backup) if backup else "", program], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


EXPECTED = {"double": [i * 2.0 + 1.0 for i in range(16)], "square": [i * i - 3.0 for i in range(16)]}


def test_a_restarted_process_loads_its_program_from_the_ramdisk(ramdisk):
    local = ramdisk / "mtc-compile-cache"
    first = run(local, None)
    assert first["misses"] >= 1 and first["hits"] == 0 and first["entries"] >= 1, first
    second = run(local, None)
    assert second["hits"] >= 1 and second["misses"] == 0, second
    assert first["out"] == second["out"] == EXPECTED["double"]


def test_a_host_that_comes_back_empty_fills_its_cache_from_the_backup(ramdisk, tmp_path):
    backup = tmp_path / "bucket" / "r" / "mtc"
    first = run(ramdisk / "a", backup)
    assert first["uploaded"] >= 1 and first["misses"] >= 1, first
    objects = sorted((backup / "compile-cache").iterdir())
    assert objects, "nothing was uploaded"
    for obj in objects:  # named by JAX's key and the sha256 of the bytes
        entry, _, digest = obj.name.rpartition(".")
        assert entry.endswith("-cache") and hashlib.sha256(obj.read_bytes()).hexdigest() == digest
    shutil.rmtree(ramdisk / "a")  # the host comes back with an empty ramdisk: only the bucket survived
    wiped = run(ramdisk / "a", backup)
    assert wiped["filled"] >= 1 and wiped["hits"] >= 1 and wiped["misses"] == 0, wiped
    assert wiped["uploaded"] == 0, "an entry the backup holds was uploaded again"
    assert wiped["out"] == EXPECTED["double"]


def test_another_program_finds_no_entry_and_a_damaged_one_is_never_used(ramdisk, tmp_path):
    backup = tmp_path / "bucket"
    run(ramdisk / "a", backup, "double")
    shutil.rmtree(ramdisk / "a")
    other = run(ramdisk / "a", backup, "square")  # the double's entries are copied, never looked up for square
    assert other["filled"] >= 1 and other["hits"] == 0 and other["misses"] >= 1, other
    assert other["out"] == EXPECTED["square"]
    # An entry whose bytes do not match its name's hash (bit rot, a planted file) is not copied.
    for obj in (backup / "compile-cache").iterdir():
        data = bytearray(obj.read_bytes())
        data[len(data) // 2] ^= 0xFF
        obj.write_bytes(bytes(data))
    shutil.rmtree(ramdisk / "a")
    damaged = run(ramdisk / "a", backup, "double")
    assert damaged["filled"] == 0 and damaged["hits"] == 0 and damaged["misses"] >= 1, damaged
    assert damaged["out"] == EXPECTED["double"]
    # A local entry cut short (JAX cannot load it): compiled again, never a wrong program.
    for entry in (ramdisk / "a").glob("*-cache"):
        entry.write_bytes(entry.read_bytes()[:100])
    cut = run(ramdisk / "a", None, "double")
    assert cut["hits"] == 0 and cut["out"] == EXPECTED["double"], cut
