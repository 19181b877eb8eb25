"""`mtc export`, `mtc status` and `mtc verify --backup` killed at random moments on a stopped job's
folders: no host loses a step.

A stopped 2 x 2 job (real sidecars) left steps 1..5 on each host's ramdisk folder, and a backup in a
local backup folder. The tools run as real processes on those folders (each starts a sidecar daemon
per folder for its time, and `mtc export` takes the hosts to read them), and a seeded
``random.Random`` sends each a SIGTERM or a SIGKILL at a random moment: while it starts, while its
daemons run, just after an export took the hosts (while it gives the hosts that hold only a commit
record of the step the manifest of it). After every kill, and at the end, every host folder still
holds every step it held (the same step: its manifest digest), and every blob file those steps name
that it held, byte for byte; an unkilled export and an unkilled `mtc status` then still see steps
1..5 on every host.

What it guards: a host given a manifest commits it, and a commit keeps the newest local_max_to_keep
steps; an export that configured the hosts with the default (2) left the hosts that held records of
the step it read with steps 4 and 5 only, killed or not.

``MTC_TOOLS_KILL_SEED`` picks the seed (default 0), ``MTC_TOOLS_KILLS`` the number of kills (default 20).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
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
from mtc.shared import format as fmt
from mtc.sidecar.local_cluster import LocalCluster

pytestmark = pytest.mark.chaos

SEED = int(os.environ.get("MTC_TOOLS_KILL_SEED", "0"))
KILLS = int(os.environ.get("MTC_TOOLS_KILLS", "20"))
STEPS = [1, 2, 3, 4, 5]
HOSTS = ["s0-h0", "s0-h1", "s1-h0", "s1-h1"]


def state(step: int, sh) -> dict:
    rng = np.random.default_rng(step)
    return {"w": jax.device_put(rng.standard_normal((64, 64), dtype=np.float32), sh),
            "b": jax.device_put(np.arange(64 * 16, dtype=np.float32).reshape(64, 16) + step, sh)}


def holdings(folder: Path) -> dict[int, tuple[str, dict[str, str]]]:
    """step -> (its manifest's digest, {blob: sha256} of the blob files of it this folder holds), from
    the folder itself: a commit record names this host's own part, a whole manifest every blob."""
    root = folder / "mtc"
    present = set(os.listdir(root / "blobs"))
    out = {}
    for f in sorted((root / "steps").glob("*.json")):
        data = f.read_bytes()
        rec = fmt.CommitRecord.parse(data)
        if rec is not None:
            digest, names = rec.digest, rec.host_manifest().blob_names()
        else:
            m = fmt.StepManifest.from_json(data)
            digest, names = m.digest, m.blob_names()
        out[int(f.name.split(".")[0])] = (digest, {n: hashlib.sha256((root / "blobs" / n).read_bytes()).hexdigest()
                                                   for n in sorted(names & present)})
    return out


def lost(before: dict, folders: dict[str, Path]) -> list[str]:
    """What each host held before and no longer holds, as it is now."""
    out = []
    for h, folder in folders.items():
        try:
            now = holdings(folder)
        except Exception as e:  # an unreadable step file is a lost step too
            out.append(f"{h}: its folder cannot be read ({type(e).__name__}: {e})")
            continue
        for step, (digest, blobs) in before[h].items():
            if step not in now:
                out.append(f"{h}: step {step} is gone (steps now: {sorted(now)})")
                continue
            if now[step][0] != digest:
                out.append(f"{h}: step {step} is another manifest now ({now[step][0][:12]} != {digest[:12]})")
            gone = {n: sha for n, sha in blobs.items() if now[step][1].get(n) != sha}
            if gone:
                out.append(f"{h}: step {step}: {len(gone)} of its {len(blobs)} blob files here are gone or changed")
    return out


def _whole(folder: Path, step: int) -> bool:
    """Whether ``folder`` keeps the whole manifest of ``step`` (not a commit record)."""
    return fmt.CommitRecord.parse((folder / "mtc" / "steps" / f"{step:012d}.json").read_bytes()) is None


def marks(folders) -> dict[str, tuple]:
    """(inode, mtime) of each folder's lease and step files: what changes when a tool takes the hosts or
    rewrites a step file."""
    out = {}
    for f in folders:
        for p in [f / "mtc" / "head.json", *sorted((f / "mtc" / "steps").glob("*.json"))]:
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            out[str(p)] = (st.st_ino, st.st_mtime_ns)
    return out


def daemons_on(folders) -> list[int]:
    """The pids of the sidecar daemons serving any of ``folders`` (from /proc: their command lines)."""
    wanted = {str(f).encode() for f in folders}
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            argv = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"mtc.sidecar" in argv and wanted & set(argv):
            out.append(int(p.name))
    return out


@pytest.fixture
def stopped_job(ramdisk):
    """The ramdisk folders of a stopped 2 x 2 job (steps 1..5 on each, twins across the slices; local_max_to_keep
    5) and its local backup folder, with no daemon on them."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    sh = NamedSharding(mesh, P(None, "model"))  # replicated over the slices: twins
    bucket = ramdisk / "bucket"
    with LocalCluster(ramdisk / "c", 2, 2, devices_per_host=2) as cluster:
        cfg = MTCConfig(local_checkpoint_directory=str(ramdisk / "c"), cluster_spec=str(cluster.spec_path),
                        local_checkpoint_period=1, local_max_to_keep=len(STEPS), base_output_directory=str(bucket),
                        run_name="run", multi_tier_checkpointing_backup_interval_steps=len(STEPS))
        with CheckpointManager(cfg) as m:
            for step in STEPS:
                m.save(step, state(step, sh))
                m.wait_until_finished()
            assert m.wait_for_backup().error is None
            m.wait_for_replication()
            assert m.backups()
        folders = {h: cluster.ramdisk(h) for h in cluster.hosts}
    assert sorted(folders) == HOSTS
    yield folders, bucket
    for pid in daemons_on(folders.values()):  # what a failing run left: this test's own daemons only
        os.kill(pid, signal.SIGKILL)


def _tools(rng: random.Random, folders: list[str], bucket: Path, out: Path, i: int) -> list[str]:
    where = ["--local-checkpoint-directory", *folders]
    backup = ["--base-output-directory", str(bucket), "--run-name", "run"]
    kind = rng.choice(["export", "export", "status", "status-verify", "verify"])
    if kind == "export":
        step = rng.choice([None, None, *STEPS])
        return ["export", "--to", str(out / f"export-{i}"), *where, *(["--step", str(step)] if step else []),
                *(["--verify"] if rng.random() < 0.3 else [])]
    if kind == "status":
        return ["status", *where, *(backup if rng.random() < 0.5 else []), *(["--json"] if rng.random() < 0.5 else [])]
    if kind == "status-verify":
        return ["status", "--verify", *where, *backup]
    return ["verify", "--backup", *where, *backup, *(["--bytes-per-s", "65536"] if rng.random() < 0.5 else [])]


def _kill_moment(rng: random.Random, tool: str) -> tuple[str, float]:
    """(what to wait for, then how long): the start, the tool's daemons up, or a folder changed (an export's claim
    of the hosts, then the manifests it gives them: status and verify change none, and run to their end)."""
    kind = rng.choice(["start", "daemons", "daemons", *(["change", "change"] if tool == "export" else [])])
    return kind, rng.uniform(0.0, {"start": 3.0, "daemons": 1.5, "change": 0.3}[kind])


def _run(argv: list[str], env: dict, log: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    with open(log, "w") as f:
        return subprocess.run([sys.executable, "-m", "mtc.head.tools.cli", *argv], env=env, stdout=subprocess.PIPE,
                              stderr=f, text=True, timeout=timeout)


def test_killed_tools_lose_no_step(stopped_job, tmp_path):
    folders, bucket = stopped_job
    before = {h: holdings(d) for h, d in folders.items()}
    for h in HOSTS:  # what the job left: every step on every host, each with the blobs of its part
        assert sorted(before[h]) == STEPS, (h, before[h])
        assert all(blobs for _, blobs in before[h].values()), (h, before[h])
    whole_before = {h: {s: _whole(d, s) for s in STEPS} for h, d in folders.items()}
    rng = random.Random(SEED)
    # The folders in a shuffled order, under no host's name: the tools read the host ids from them.
    names = [str(folders[h]) for h in rng.sample(HOSTS, len(HOSTS))]
    scratch = tmp_path / "tmp"  # the tools' temporary folders (a SIGKILL leaves them) stay in the test's
    scratch.mkdir()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu",
               TMPDIR=str(scratch))
    t0 = time.monotonic()
    done: list[str] = []
    for i in range(KILLS):
        argv = _tools(rng, names, bucket, tmp_path, i)
        sig = rng.choice([signal.SIGTERM, signal.SIGKILL])
        log = tmp_path / f"tool-{i}.log"
        with open(log, "w") as f:
            tool = subprocess.Popen([sys.executable, "-m", "mtc.head.tools.cli", *argv], env=env,
                                    stdout=f, stderr=subprocess.STDOUT)
        try:
            when = _kill_moment(rng, argv[0])
            if when[0] == "start":  # anywhere: while Python, JAX or the tool starts
                time.sleep(when[1])
            else:
                # Once its daemons run (while it reads, scrubs, or stops them), or once a folder changed
                # (an export took the hosts; then gave a host a manifest): a moment that runs, not a guess.
                seen = marks(folders.values())
                deadline = time.monotonic() + 60
                while tool.poll() is None and time.monotonic() < deadline and not (
                        daemons_on(folders.values()) if when[0] == "daemons" else marks(folders.values()) != seen):
                    time.sleep(0.01)
                time.sleep(when[1])
            ran = tool.poll() is None
            if ran:
                tool.send_signal(sig)
            tool.wait(timeout=60)
        finally:
            tool.kill()
        shown = [a for a in argv if a not in names and not a.startswith((str(tmp_path), str(bucket)))]
        what = (f"kill {i} ({signal.Signals(sig).name} {'sent' if ran else 'too late'} at {when[0]} + {when[1]:.2f} s, "
                f"rc {tool.returncode}): mtc {' '.join(shown)}")
        done.append(what)
        deadline = time.monotonic() + 20
        while daemons_on(folders.values()):
            assert time.monotonic() < deadline, f"{what}: its daemons outlived it: {daemons_on(folders.values())}"
            time.sleep(0.05)
        gone = lost(before, folders)
        assert not gone, f"after {what}:\n" + "\n".join(gone) + "\n" + log.read_text()[-3000:]
    upgraded = sum(1 for h, d in folders.items() for s in STEPS if _whole(d, s) and not whole_before[h][s])
    print(f"\nseed {SEED}: {KILLS} tools killed in {time.monotonic() - t0:.1f} s; {upgraded} commit records "
          "became whole manifests meanwhile\n" + "\n".join(done))

    # Unkilled, a later export reads the newest step, and the hosts still hold every step.
    r = _run(["export", "--to", str(tmp_path / "final"), "--local-checkpoint-directory", *names],
             env, tmp_path / "final-export.log")
    assert r.returncode == 0 and "exported step 5" in r.stdout, r.stdout + (tmp_path / "final-export.log").read_text()[-3000:]
    gone = lost(before, folders)
    assert not gone, "after an unkilled export:\n" + "\n".join(gone)
    # ... and a later status answers, and lists steps 1..5 on every host.
    r = _run(["status", "--json", "--local-checkpoint-directory", *names, "--base-output-directory", str(bucket),
              "--run-name", "run"], env, tmp_path / "final-status.log")
    assert r.returncode == 0, r.stdout + (tmp_path / "final-status.log").read_text()[-3000:]
    st = json.loads(r.stdout)
    assert [row["step"] for row in st["steps"]] == STEPS, st
    for row in st["steps"]:
        assert row["hosts"] == HOSTS and row["restorable"], row
    assert st["choice"] == 5 and not st["unreachable"], st
    assert not lost(before, folders)
    assert daemons_on(folders.values()) == []
