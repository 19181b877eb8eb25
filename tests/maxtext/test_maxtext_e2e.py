"""MaxText, from PyPI, trains on mtc unchanged: kill -9, restart, bit-identical metrics and state.

Each run is ``python -m mtc.head.maxtext <MaxText's train arguments>`` in the MaxText
environment (``env.py``: Python >= 3.12, built once and reused). A reference run trains N
steps; a second run is killed with SIGKILL once mtc has committed a step, restarted with the
same command (it resumes through MaxText's own restore path), killed again, every ramdisk is
wiped, and restarted once more (it restores from the backup). Every metric of every step a
resumed run logs (loss, grad norm, param norm, learning rate) and every byte of the final
state equal the reference run's.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest


pytestmark = [pytest.mark.maxtext, pytest.mark.integration]

STEPS = 15
PERIOD = 3
BACKUP_STEPS = 6
METRICS = ("learning/loss", "learning/grad_norm", "learning/param_norm", "learning/current_learning_rate")


@pytest.fixture(scope="session")
def base_yml(maxtext_python):
    out = subprocess.run([maxtext_python, "-c", "import maxtext, os; print(os.path.dirname(maxtext.__file__))"],
                         capture_output=True, text=True, check=True).stdout.strip()
    return str(Path(out) / "configs" / "base.yml")


def tiny_flags(base_yml: str, run: Path, *, pathways: bool) -> list[str]:
    flags = [
        base_yml, "run_name=r", f"base_output_directory={run / 'out'}", "model_name=default",
        "base_emb_dim=64", "base_num_decoder_layers=2", "base_mlp_dim=128", "base_num_query_heads=2",
        "base_num_kv_heads=2", "head_dim=32", "vocab_size=256", "max_target_length=32", "per_device_batch_size=1",
        f"steps={STEPS}", f"learning_rate_schedule_steps={STEPS}", "dataset_type=synthetic", "hardware=cpu",
        "enable_checkpointing=True", "enable_multi_tier_checkpointing=True",
        f"local_checkpoint_directory={run / 'ramdisk'}", f"local_checkpoint_period={PERIOD}",
        f"multi_tier_checkpointing_backup_interval_steps={BACKUP_STEPS}", f"metrics_file={run / 'metrics.txt'}",
        "skip_jax_distributed_system=True",
    ]
    if pathways:
        flags += ["enable_single_controller=True", "colocated_python_checkpointing=True"]
    return flags


def _env(devices: int) -> dict:
    e = dict(os.environ)
    e["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    e["JAX_PLATFORMS"] = "cpu"
    e.pop("MTC_CLUSTER_SPEC", None)
    return e


# The job's token, as a pod gets it from the job's Secret: its key seals the backups and signs the
# compilation cache's entries, the same for every run of the job.
JOB_TOKEN = "maxtext-e2e-job-token-0123456789abcdef"


def _launch(py: str, flags: list[str], devices: int, log: Path, pod: Path | None = None) -> subprocess.Popen:
    """MaxText on mtc; ``pod``: the folder of this pod's own temporary files (JAX's private compilation
    cache): a run in the same pod as an earlier one finds its programs there, one in a new pod does not."""
    env = dict(_env(devices), MTC_PEER_TOKEN=JOB_TOKEN)
    if pod is not None:
        env["MTC_COMPILE_CACHE_DIR"] = str(pod / "jax-cache")
    return subprocess.Popen([py, "-m", "mtc.head.maxtext", *flags], env=env,
                            stdout=log.open("ab"), stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen, log: Path, timeout: float = 600) -> None:
    rc = proc.wait(timeout=timeout)
    assert rc == 0, f"MaxText exited {rc}:\n{log.read_text()[-4000:]}"


def _step_file(run: Path, step: int) -> Path:
    return run / "ramdisk" / "mtc" / "steps" / f"{step:012d}.json"


def _kill_after_commit(proc: subprocess.Popen, run: Path, step: int, log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not _step_file(run, step).exists():
        assert proc.poll() is None, f"MaxText ended before step {step} was committed:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"step {step} was not committed in {timeout} s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def metrics(run: Path, names: tuple[str, ...] = METRICS) -> dict[int, dict]:
    """step -> the metrics ``names``, from every line any run wrote (later runs overwrite earlier ones)."""
    out: dict[int, dict] = {}
    for line in (run / "metrics.txt").read_text().splitlines():
        d = json.loads(line)
        out[int(d["step"])] = {k: d[k] for k in names}
    return out


def final_state(run: Path, step: int) -> dict:
    """(array key, box) -> the raw bytes of that shard, read from the blob files of ``step``."""
    from mtc.shared import format as fmt

    m = fmt.StepManifest.from_json(_step_file(run, step).read_bytes())
    blobs = run / "ramdisk" / "mtc" / "blobs"
    out = {}
    for a in m.arrays:
        if a.kind == "scalar":
            out[(a.key, "value")] = json.dumps(a.value).encode()
            continue
        for sh in a.shards:
            out[(a.key, json.dumps(sh.box))] = (blobs / sh.blob).read_bytes()
        out[(a.key, "meta")] = json.dumps([a.dtype, list(a.shape), a.prng_impl]).encode()
    return out


def _restored(log_text: str) -> str:
    """mtc's line about the restore of a run: which step, from where, bytes by tier."""
    lines = [line for line in log_text.splitlines() if "mtc: restored step" in line]
    assert len(lines) == 1, lines
    return lines[0]


def _cache_report(log_text: str) -> dict:
    """The launcher's first line about the compilation cache: JAX's hits and misses, entries filled."""
    import re

    m = re.search(r"mtc: compilation cache: (\d+) program\(s\) loaded from the cache, (\d+) compiled; \d+ entries "
                  r"filled \(\d+ from the ramdisk, (\d+) from the backup\)", log_text)
    assert m, "no compilation cache report in the log"
    return {"hits": int(m.group(1)), "compiled": int(m.group(2)), "from_backup": int(m.group(3))}


def _backups(run: Path) -> list[str]:
    d = run / "out" / "r" / "mtc" / "backups"
    return sorted(p.name for p in d.glob("*.json")) if d.is_dir() else []


@pytest.mark.parametrize("devices,pathways", [(1, False), (4, True)], ids=["1dev", "4dev-pathways-flags"])
def test_kill_restart_and_backup_restore_match_the_reference(tmp_path, ramdisk, maxtext_python, base_yml,
                                                             devices, pathways):
    ref, run = tmp_path / "ref", ramdisk / "run"
    for d in (ref, run):
        d.mkdir(parents=True)
    ref_log = ref / "log.txt"
    logs = [run / f"log{i}.txt" for i in (1, 2, 3)]

    _finish(_launch(maxtext_python, tiny_flags(base_yml, ref, pathways=pathways), devices, ref_log, tmp_path / "pod0"),
            ref_log)
    reference = metrics(ref)
    assert sorted(reference) == list(range(STEPS))
    last = STEPS - 1
    assert _step_file(ref, last).exists(), "the forced final save of the last step did not commit"

    flags = tiny_flags(base_yml, run, pathways=pathways)
    # 1. Killed with SIGKILL once step 6 is committed; restarted: resumes from the ramdisk.
    pod = tmp_path / "pod1"  # the restart after the kill runs in the same pod
    _kill_after_commit(_launch(maxtext_python, flags, devices, logs[0], pod), run, 2 * PERIOD, logs[0])
    seen_first = metrics(run)
    _kill_after_commit(_launch(maxtext_python, flags, devices, logs[1], pod), run, 3 * PERIOD, logs[1])
    after_restart = metrics(run)
    # 2. Every ramdisk wiped (the ramdisk root and everything in it): the restart restores the backup.
    assert _backups(run), "no backup was made"
    shutil.rmtree(run / "ramdisk")
    _finish(_launch(maxtext_python, flags, devices, logs[2], tmp_path / "pod2"), logs[2])  # a new pod
    final = metrics(run)
    first, second, third = (p.read_text() for p in logs)
    assert "No existing checkpoints found" in first
    assert "restoring from this run's directory step" in second and "ram " in _restored(second), second[-3000:]
    restored_backup = _restored(third)
    assert "backup 2" in restored_backup and "ram 0 bytes" in restored_backup, restored_backup

    for step, m in final.items():
        assert m == reference[step], f"step {step}: {m} != reference {reference[step]}"
    assert set(final) == set(range(STEPS))
    assert set(after_restart) - set(seen_first), "the first restart trained no step"
    # The restarts loaded their programs from the compilation cache instead of compiling them: from
    # the ramdisk after the kill, from the backup after every ramdisk was lost (JAX's hit events).
    hits = [_cache_report(text) for text in (first, second, third)]
    assert hits[0]["hits"] == 0 and hits[0]["compiled"] >= 1, hits
    # (the first restore's own programs are new: the first run restored nothing)
    assert hits[1]["hits"] >= 1 and hits[1]["compiled"] < hits[0]["compiled"] // 2, hits
    assert hits[2]["hits"] >= 1 and hits[2]["compiled"] == 0 and hits[2]["from_backup"] >= 1, hits
    assert final_state(run, last) == final_state(ref, last), "final state differs from the reference"


def test_bad_flag_combination_fails_before_training(maxtext_python, base_yml, tmp_path):
    flags = tiny_flags(base_yml, tmp_path, pathways=False)
    no_dir = [f for f in flags if not f.startswith("local_checkpoint_directory=")]
    r = subprocess.run([maxtext_python, "-m", "mtc.head.maxtext", *no_dir], env=_env(1), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and "local_checkpoint_directory" in r.stderr and "Traceback" not in r.stderr, r.stderr
    both = flags + ["multi_tier_checkpointing_backup_interval_minutes=5"]
    r = subprocess.run([maxtext_python, "-m", "mtc.head.maxtext", *both], env=_env(1), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and "exclusive" in r.stderr and "Traceback" not in r.stderr, r.stderr


CLUSTER_SCRIPT = """
import sys
from mtc.sidecar.local_cluster import LocalCluster
with LocalCluster(sys.argv[1], 1, 2, devices_per_host=2) as c:
    print(c.spec_path, flush=True)
    sys.stdin.read()  # until the test closes it
"""


def test_cluster_mode_head_killed_and_restarted(tmp_path, ramdisk, maxtext_python, base_yml):
    """MTC_CLUSTER_SPEC: the head (MaxText) is killed -9, its sidecar daemons live on; the restart resumes."""
    ref, run = tmp_path / "ref", ramdisk / "run"
    for d in (ref, run):
        d.mkdir(parents=True)
    _finish(_launch(maxtext_python, tiny_flags(base_yml, ref, pathways=False), 4, ref / "log.txt"), ref / "log.txt")
    reference = metrics(ref)
    # The daemons run in the MaxText environment too: head and sidecars must have one fingerprint.
    # The job token, given to the daemons and the head alike (not left to whatever an earlier test
    # of this process put in its environment).
    token = secrets.token_hex(16)
    cluster = subprocess.Popen([maxtext_python, "-c", CLUSTER_SCRIPT, str(run / "ramdisk")], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env=dict(_env(1), MTC_PEER_TOKEN=token))
    try:
        spec = cluster.stdout.readline().strip()
        assert spec, "the local cluster did not start"
        flags = tiny_flags(base_yml, run, pathways=False)
        env = dict(_env(4), MTC_CLUSTER_SPEC=spec, MTC_PEER_TOKEN=token)
        logs = [run / "log1.txt", run / "log2.txt"]
        proc = subprocess.Popen([maxtext_python, "-m", "mtc.head.maxtext", *flags], env=env,
                                stdout=logs[0].open("ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        hosts_dir = run / "ramdisk"
        while not list(hosts_dir.glob(f"*/mtc/steps/{2 * PERIOD:012d}.json")):
            assert proc.poll() is None, logs[0].read_text()[-4000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc = subprocess.Popen([maxtext_python, "-m", "mtc.head.maxtext", *flags], env=env,
                                stdout=logs[1].open("ab"), stderr=subprocess.STDOUT)
        _finish(proc, logs[1])
    finally:
        cluster.stdin.close()
        cluster.wait(timeout=60)
    assert "cluster mode" in logs[0].read_text()
    restored = _restored(logs[1].read_text())
    assert "from the hosts" in restored and "ram 0 bytes" not in restored, restored
    got = metrics(run)
    assert set(got) == set(range(STEPS))
    for step, m in got.items():
        assert m == reference[step], f"step {step}: {m} != reference {reference[step]}"


def _children(pid: int) -> list[int]:
    """The children of ``pid``, oldest first (by their start time)."""
    kids = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return sorted(kids, key=lambda k: int(Path(f"/proc/{k}/stat").read_text().rsplit(")", 1)[1].split()[19]))


def test_a_killed_training_process_is_replaced_in_the_pod_by_the_warm_standby(tmp_path, ramdisk, maxtext_python,
                                                                                base_yml):
    """``python3 -m mtc.head.maxtext`` supervises: the training process killed with SIGKILL after a commit
    is replaced by the standby (MaxText already imported), which restores from the ramdisk and trains
    to the end, in the same log and the same pod; the losses equal an uninterrupted run's."""
    ref, run = tmp_path / "ref", ramdisk / "run"
    for d in (ref, run):
        d.mkdir(parents=True)
    env = dict(MTC_SUPERVISOR="0")  # the reference runs as a plain program
    _finish(subprocess.Popen([maxtext_python, "-m", "mtc.head.maxtext", *tiny_flags(base_yml, ref, pathways=False)],
                             env=dict(_env(1), MTC_PEER_TOKEN=JOB_TOKEN, **env), stdout=(ref / "log.txt").open("ab"),
                             stderr=subprocess.STDOUT), ref / "log.txt")
    reference = metrics(ref)
    log = run / "log.txt"
    proc = _launch(maxtext_python, tiny_flags(base_yml, run, pathways=False), 1, log, tmp_path / "pod")
    deadline = time.monotonic() + 600
    while not _step_file(run, 2 * PERIOD).exists():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.05)
    training, standby = _children(proc.pid)  # started first, then the standby behind it
    os.kill(training, signal.SIGKILL)
    _finish(proc, log)
    text = log.read_text()
    assert "killed by SIGKILL; restart 1" in text and f"standby pid {standby} takes over" in text, text[-4000:]
    assert "promoted standby" in text and "modules imported before it was told to go" in text
    restored = [line for line in text.splitlines() if "mtc: restored step" in line]
    assert len(restored) == 1 and "ram " in restored[0], restored
    final = metrics(run)
    assert set(final) == set(range(STEPS))
    for step, m in final.items():
        assert m == reference[step], f"step {step}: {m} != reference {reference[step]}"
