"""The compilation cache a restarted process finds: in its private folder, on the ramdisk's shelf, or
filled from the backup; and never a program this job did not sign.

Each run is a new process (as a restarted pod is) that compiles one program with JAX's persistent
cache in ``mtc.head.maxtext.compile_cache.CompileCache`` and reports JAX's own cache-hit and miss
events, not a timing. The programs' results are checked too: a cached program computes what a
compiled one does, and a planted executable (one compiled for ``x + 100``, put under the key of the
program ``x * 2 + 1``) is never what runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mtc.head.maxtext import compile_cache as cc
from mtc.shared.job_key import JobKey

pytestmark = pytest.mark.integration

TOKEN = "a-test-job-token-0123456789abcdef"
OTHER_TOKEN = "another-job-token-0123456789abcdef"

RUN = """
import json, os, sys
from mtc.head.maxtext import compile_cache
from mtc.shared.job_key import JobKey
local, backup, shelf, program = sys.argv[1], sys.argv[2] or None, sys.argv[3] or None, sys.argv[4]
if os.environ.get("MAX_ENTRY_BYTES"):
    compile_cache.MAX_ENTRY_BYTES = int(os.environ["MAX_ENTRY_BYTES"])
cache = compile_cache.CompileCache(local, backup, shelf=shelf, key=JobKey.from_secret())
cache.start_fill()
cache.enable()
cache.wait_filled()
import jax, numpy as np
fn = {"double": lambda x: x * 2.0 + 1.0, "square": lambda x: x * x - 3.0, "plus100": lambda x: x + 100.0}[program]
out = np.asarray(jax.jit(fn)(np.arange(16, dtype=np.float32)))  # one program: in and out not computed by jax
if cache.step_seen() and not os.environ.get("ENDS_BEFORE_ITS_SECOND_STEP"):
    raise SystemExit("off probation at the first step: before any result of its programs was read")
if not os.environ.get("ENDS_BEFORE_ITS_SECOND_STEP") and cache.step_seen():
    cache.passed()  # as the launcher does at the second step (or the first save)
cache.sync()
cache.close()
print(json.dumps({"hits": cache.hits, "misses": cache.misses, "filled": cache.filled, "uploaded": cache.uploaded,
                  "rejected": cache.rejected, "dropped": cache.dropped, "out": [float(v) for v in out],
                  "entries": cache.entries()}))
"""


def run(local: Path, backup: Path | None, program: str = "double", python: str = sys.executable, *,
        shelf: Path | None = None, token: str = TOKEN, env: dict | None = None) -> dict:
    environ = dict(os.environ, JAX_PLATFORMS="cpu", MTC_PEER_TOKEN=token, **(env or {}))
    environ.pop("XLA_FLAGS", None)
    environ.pop("MTC_JOB_KEY", None)
    r = subprocess.run([python, "-c", RUN, str(local), str(backup) if backup else "", str(shelf) if shelf else "",
                        program], env=environ, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["log"] = r.stderr
    return out


EXPECTED = {"double": [i * 2.0 + 1.0 for i in range(16)], "square": [i * i - 3.0 for i in range(16)],
            "plus100": [i + 100.0 for i in range(16)]}


def _entries(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.endswith(cc.SUFFIX))


def test_a_restarted_process_loads_its_program_from_its_private_folder(tmp_path):
    local = tmp_path / "jax"
    first = run(local, None)
    assert first["misses"] >= 1 and first["hits"] == 0 and first["entries"] >= 1, first
    assert stat.S_IMODE(local.stat().st_mode) == 0o700
    second = run(local, None)
    assert second["hits"] >= 1 and second["misses"] == 0, second
    assert first["out"] == second["out"] == EXPECTED["double"]


def test_a_new_pod_fills_from_the_shelf_and_an_empty_host_from_the_backup(ramdisk, tmp_path):
    backup = tmp_path / "bucket" / "r" / "mtc"
    local, shelf = tmp_path / "jax", ramdisk / cc.LOCAL_NAME
    first = run(local, backup, shelf=shelf)
    assert first["uploaded"] >= 1 and first["misses"] >= 1, first
    key = JobKey.from_secret(TOKEN, {})
    objects = sorted((backup / "compile-cache").iterdir())
    assert objects and sorted(o.name for o in objects) == sorted(p.name for p in shelf.iterdir())
    for obj in objects:  # named by JAX's key and the job key's tag over it and the bytes
        entry, _, tag = obj.name.rpartition(".")
        assert entry.endswith("-cache") and key.check(cc.KIND, entry, obj.read_bytes(), tag) == "ok"
    shutil.rmtree(local)  # a new pod: the ramdisk (and its shelf) survived
    pod = run(local, backup, shelf=shelf)
    assert pod["filled"] >= 1 and pod["hits"] >= 1 and pod["misses"] == 0 and pod["uploaded"] == 0, pod
    shutil.rmtree(local)
    shutil.rmtree(shelf)  # the host comes back with an empty ramdisk: only the bucket survived
    wiped = run(local, backup, shelf=shelf)
    assert wiped["filled"] >= 1 and wiped["hits"] >= 1 and wiped["misses"] == 0, wiped
    assert wiped["uploaded"] == 0, "an entry the backup holds was uploaded again"
    assert wiped["out"] == EXPECTED["double"]
    assert _entries(local) and list(shelf.iterdir()), "the shelf was not filled again"


def test_another_program_finds_no_entry_and_a_damaged_one_is_never_used(tmp_path):
    backup, local = tmp_path / "bucket", tmp_path / "jax"
    run(local, backup, "double")
    shutil.rmtree(local)
    other = run(local, backup, "square")  # the double's entries are copied, never looked up for square
    assert other["filled"] >= 1 and other["hits"] == 0 and other["misses"] >= 1, other
    assert other["out"] == EXPECTED["square"]
    # An entry whose bytes do not match its tag (bit rot, a planted file) is not copied.
    for obj in (backup / "compile-cache").iterdir():
        data = bytearray(obj.read_bytes())
        data[len(data) // 2] ^= 0xFF
        obj.write_bytes(bytes(data))
    shutil.rmtree(local)
    damaged = run(local, backup, "double")
    assert damaged["filled"] == 0 and damaged["hits"] == 0 and damaged["misses"] >= 1, damaged
    assert damaged["rejected"] >= 1 and "failed the job key's check" in damaged["log"], damaged["log"][-2000:]
    assert damaged["out"] == EXPECTED["double"]
    # A local entry cut short (JAX cannot load it): compiled again, never a wrong program.
    for entry in _entries(local):
        entry.write_bytes(entry.read_bytes()[:100])
    cut = run(local, None, "double")
    assert cut["hits"] == 0 and cut["out"] == EXPECTED["double"], cut


def test_a_planted_executable_in_the_bucket_or_on_the_ramdisk_is_never_run(ramdisk, tmp_path):
    """The attack: an executable compiled for ``x + 100``, put under the key of the head's ``x * 2 + 1``
    (visible in the real entries' names), named with its own sha256 (as mtc named entries before), with
    another job's tag, or with this job's tag of another entry, in the bucket and on the ramdisk's shelf."""
    backup, local, shelf = tmp_path / "bucket", tmp_path / "jax", ramdisk / cc.LOCAL_NAME
    run(local, backup, "double", shelf=shelf)
    doubles = {p.name for p in _entries(local)}
    shutil.rmtree(local)
    run(local, None, "plus100")  # the attacker's executable, for the same input, at the same path
    pluses = {p.name for p in _entries(local)}
    (double_entry,), (plus_entry,) = doubles - pluses, pluses - doubles  # the programs (others are shared)
    evil = (local / plus_entry).read_bytes()
    # The test can show the attack: planted straight into JAX's folder (only this user can write it), it runs.
    shutil.rmtree(local)
    local.mkdir(mode=0o700)
    (local / double_entry).write_bytes(evil)
    assert run(local, None, "double")["out"] == EXPECTED["plus100"], "the planted entry did not load: no attack shown"

    key, other = JobKey.from_secret(TOKEN, {}), JobKey.from_secret(OTHER_TOKEN, {})
    for folder in (backup / "compile-cache", shelf):
        for p in folder.iterdir():
            p.unlink()
        real_tag = key.sign(cc.KIND, plus_entry, evil)  # this job's tag, but of the plus100 entry
        for name in (f"{double_entry}.{hashlib.sha256(evil).hexdigest()}",
                     f"{double_entry}.{other.sign(cc.KIND, double_entry, evil)}",
                     f"{double_entry}.{real_tag}",
                     f"{double_entry}.{'0' * 12}-{'0' * 64}"):
            (folder / name).write_bytes(evil)
    shutil.rmtree(local)
    safe = run(local, backup, "double", shelf=shelf)
    assert safe["out"] == EXPECTED["double"], "a planted executable ran"
    assert safe["filled"] == 0 and safe["hits"] == 0 and safe["rejected"] >= 8, safe
    # What it compiled itself is shared again, signed; the planted objects are left alone, never loaded.
    shutil.rmtree(local)
    again = run(local, backup, "double", shelf=shelf)
    assert again["out"] == EXPECTED["double"] and again["hits"] >= 1, again


def test_links_fifos_and_huge_objects_neither_leak_nor_block_nor_exhaust(ramdisk, tmp_path):
    backup, local, shelf = tmp_path / "bucket" / "r" / "mtc", tmp_path / "jax", ramdisk / cc.LOCAL_NAME
    secret = tmp_path / "token"
    secret.write_bytes(b"the head's secret token")
    secret.chmod(0o600)
    first = run(local, backup, shelf=shelf)
    assert first["uploaded"] == 1, first
    # In JAX's folder (were someone to get in): a link to a secret and a FIFO are not uploaded, nor wait.
    os.symlink(secret, local / "aaaa-link-cache")
    os.mkfifo(local / "bbbb-fifo-cache")
    # In the bucket and on the shelf: a link to /dev/zero, a FIFO, an entry over the size limit.
    cache = backup / "compile-cache"
    os.symlink("/dev/zero", cache / f"zero-cache.{'1' * 12}-{'1' * 64}")
    os.mkfifo(cache / f"fifo-cache.{'2' * 12}-{'2' * 64}")
    os.symlink("/dev/zero", shelf / f"zero-cache.{'1' * 12}-{'1' * 64}")
    os.mkfifo(shelf / f"fifo-cache.{'2' * 12}-{'2' * 64}")
    key = JobKey.from_secret(TOKEN, {})
    big = os.urandom(3 << 20)
    (cache / f"big-cache.{key.sign(cc.KIND, 'big-cache', big)}").write_bytes(big)
    (local / ".fill-leftover").write_bytes(b"a temporary of a killed fill")
    t0 = time.monotonic()
    second = run(local, backup, shelf=shelf, env={"MAX_ENTRY_BYTES": str(1 << 20)})
    assert time.monotonic() - t0 < 120
    assert second["out"] == EXPECTED["double"] and second["hits"] >= 1 and second["uploaded"] == 0, second
    assert not (local / "big-cache").exists(), "an entry over the size limit was copied"
    assert not (local / ".fill-leftover").exists(), "a fill's temporary stayed"
    uploaded = b"".join(p.read_bytes() for p in cache.iterdir() if p.is_file() and not p.is_symlink()
                        and stat.S_ISREG(p.lstat().st_mode))
    # (By the planted names whole: a hash in an uploaded entry's name may hold "bbbb" by chance, as it did once.)
    assert b"secret token" not in uploaded and not any("aaaa-link-cache" in p.name or "bbbb-fifo-cache" in p.name
                                                       for p in cache.iterdir())
    assert "not a regular file" in second["log"] and "symbolic link" in second["log"], second["log"][-3000:]


def test_no_job_key_shares_nothing(ramdisk, tmp_path):
    backup, local, shelf = tmp_path / "bucket", tmp_path / "jax", ramdisk / cc.LOCAL_NAME
    out = run(local, backup, shelf=shelf, token="")
    assert out["uploaded"] == 0 and not backup.exists() and not shelf.exists(), out
    assert "no job key" in out["log"] and out["out"] == EXPECTED["double"]


def test_jax_folder_must_be_this_users_alone(tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    loose.chmod(0o777)
    with pytest.raises(cc.PrivateFolderError, match="mode 777"):
        cc.private_folder(loose)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    if os.getuid() == 0:
        os.chown(theirs, 4242, 4242)
        with pytest.raises(cc.PrivateFolderError, match="belongs to user 4242"):
            cc.private_folder(theirs)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "mine")
    (tmp_path / "mine").mkdir(mode=0o700)
    with pytest.raises(cc.PrivateFolderError, match="a link"):
        cc.private_folder(link)
    assert cc.private_folder(tmp_path / "new") == tmp_path / "new"
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o700


def test_the_launcher_turns_the_cache_off_rather_than_use_a_folder_others_can_write(tmp_path, caplog):
    from mtc.shared.config import MTCConfig

    cfg = MTCConfig.from_flags(["enable_multi_tier_checkpointing=True", f"local_checkpoint_directory={tmp_path / 'rd'}",
                                "local_checkpoint_period=2", "multi_tier_checkpointing_backup_interval_steps=4",
                                f"base_output_directory={tmp_path / 'out'}", "run_name=r"], ignore_unknown=True)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    assert cc.for_launcher(["x"], cfg, {cc.ENV_DIR: str(shared), "MTC_PEER_TOKEN": TOKEN}) is None
    assert "compilation cache off" in caplog.text
    ok = cc.for_launcher(["x"], cfg, {cc.ENV_DIR: str(tmp_path / "private"), "MTC_PEER_TOKEN": TOKEN})
    assert ok is not None and ok.key.enabled and ok.backup_url == cfg.backup_root


def test_entries_a_start_copied_in_are_dropped_and_compiled_again_if_it_ended_before_its_second_step(ramdisk,
                                                                                                     tmp_path):
    """An entry this job signed that fails when it runs would fail every restart: the entries a start
    copied in stay on probation until its second train step (or first save), and the next start in the pod drops them (from
    JAX's folder, the shelf and the backup) and compiles them, once."""
    backup, shelf, local = tmp_path / "bucket", ramdisk / cc.LOCAL_NAME, tmp_path / "jax"
    first = run(local, backup, shelf=shelf)
    assert first["uploaded"] >= 1, first
    shutil.rmtree(local)  # a new pod (JAX's folder has one path on every pod), whose first start ends after one step
    doomed = run(local, backup, shelf=shelf, env={"ENDS_BEFORE_ITS_SECOND_STEP": "1"})
    assert doomed["filled"] >= 1 and doomed["hits"] >= 1, doomed
    assert (local / cc.PROBATION).is_file()
    again = run(local, backup, shelf=shelf)  # the restart in that pod
    assert again["dropped"] >= 1 and again["filled"] == 0 and again["hits"] == 0 and again["misses"] >= 1, again
    assert "ended before its second step" in again["log"], again["log"][-2000:]
    assert again["out"] == EXPECTED["double"] and not (local / cc.PROBATION).exists()
    assert again["uploaded"] >= 1  # what it compiled went back to the backup and the shelf
    assert sorted(p.name for p in shelf.iterdir()) == sorted(p.name for p in (backup / "compile-cache").iterdir())
    then = run(local, backup, shelf=shelf)  # and is used from then on
    assert then["hits"] >= 1 and then["misses"] == 0 and then["dropped"] == 0, then
    shutil.rmtree(local)
    fresh = run(local, backup, shelf=shelf)  # a start that trains leaves no probation behind
    assert fresh["filled"] >= 1 and fresh["hits"] >= 1 and not (local / cc.PROBATION).exists(), fresh


def test_on_pathways_the_launcher_leaves_the_compilation_cache_to_pathways(tmp_path, caplog):
    """pathwaysutils turns JAX's persistent cache off on Pathways (it keeps its own): mtc fills and
    uploads nothing there, and says so."""
    import logging

    from mtc.shared.config import MTCConfig

    cfg = MTCConfig.from_flags(["enable_multi_tier_checkpointing=True", f"local_checkpoint_directory={tmp_path / 'rd'}",
                                "local_checkpoint_period=2", "multi_tier_checkpointing_backup_interval_steps=4",
                                f"base_output_directory={tmp_path / 'out'}", "run_name=r"], ignore_unknown=True)
    env = {cc.ENV_DIR: str(tmp_path / "private"), "MTC_PEER_TOKEN": TOKEN}
    with caplog.at_level(logging.INFO, logger=cc.log.name):
        assert cc.for_launcher(["x"], cfg, {**env, "JAX_PLATFORMS": "proxy"}) is None
    assert "not used on Pathways" in caplog.text
    assert cc.for_launcher(["x"], cfg, {**env, "JAX_PLATFORMS": "cpu"}) is not None
