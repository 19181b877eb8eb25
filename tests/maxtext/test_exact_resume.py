"""A resume is exact on real data: MaxText with Grain over a parquet file the test writes.

Every batch of the data set is different (distinct rows, tokenized by MaxText's bundled
sentencepiece tokenizer), so a data iterator that started over after a restore would change
every later loss. The runs are ``python -m mtc.head.maxtext`` in the MaxText environment
(``env.py``): a reference run; a run killed with SIGKILL after a commit and restarted; every
ramdisk wiped and restarted (the backup); a SIGTERM in the middle of a run; a restart over other
data files (refused); the same restart with ``MTC_DATA_RESTART=1`` (the data starts over: the
losses differ, which is what every resume did before the iterator was part of a step).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from test_maxtext_e2e import _backups, _env, _finish, _kill_after_commit, _restored, _step_file, final_state
from test_maxtext_e2e import metrics as logged_metrics

pytestmark = [pytest.mark.maxtext, pytest.mark.integration]

STEPS = 14
PERIOD = 2
BACKUP_STEPS = 4
METRICS = ("learning/loss", "learning/grad_norm", "learning/param_norm")
ROWS = 3000

MAKE_DATA = """
import random, sys
import pyarrow as pa, pyarrow.parquet as pq
random.seed(int(sys.argv[2]))
words = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon "
         "phi chi psi omega river stone cloud green quick brown fox jumps over lazy dog").split()
rows = [" ".join(random.choice(words) for _ in range(random.randint(10, 40))) + f" row {i}" for i in range(int(sys.argv[3]))]
pq.write_table(pa.table({"text": rows}), sys.argv[1])
"""


@pytest.fixture(scope="module")
def maxtext_dir(maxtext_python):
    out = subprocess.run([maxtext_python, "-c", "import maxtext, os; print(os.path.dirname(maxtext.__file__))"],
                         capture_output=True, text=True, check=True).stdout.strip()
    return Path(out)


@pytest.fixture(scope="module")
def data(maxtext_python, tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    train, other = d / "data-train-00000.parquet", d / "other-train-00000.parquet"
    for path, seed in ((train, 0), (other, 1)):
        subprocess.run([maxtext_python, "-c", MAKE_DATA, str(path), str(seed), str(ROWS)], check=True)
    return train, other


def grain_flags(maxtext_dir: Path, run: Path, files: Path, *, steps: int = STEPS, period: int = PERIOD,
                pathways: bool = False) -> list[str]:
    flags = [
        str(maxtext_dir / "configs" / "base.yml"), "run_name=r", f"base_output_directory={run / 'out'}",
        "model_name=default", "base_emb_dim=32", "base_num_decoder_layers=2", "base_mlp_dim=64",
        "base_num_query_heads=2", "base_num_kv_heads=2", "head_dim=16", "max_target_length=32",
        "per_device_batch_size=1", f"steps={steps}", f"learning_rate_schedule_steps={steps}",
        "dataset_type=grain", "grain_file_type=parquet", f"grain_train_files={files}", "grain_worker_count=0",
        f"tokenizer_path={maxtext_dir / 'assets' / 'tokenizers' / 'tokenizer.default'}",
        "tokenizer_type=sentencepiece", "eval_interval=-1", "hardware=cpu",
        "enable_checkpointing=True", "enable_multi_tier_checkpointing=True",
        f"local_checkpoint_directory={run / 'ramdisk'}", f"local_checkpoint_period={period}",
        f"multi_tier_checkpointing_backup_interval_steps={max(BACKUP_STEPS, 2 * period)}",
        f"metrics_file={run / 'metrics.txt'}",
        "skip_jax_distributed_system=True",
    ]
    if pathways:
        flags += ["enable_single_controller=True", "colocated_python_checkpointing=True"]
    return flags


def launch(py: str, flags: list[str], devices: int, log: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen([py, "-m", "mtc.head.maxtext", *flags], env=dict(_env(devices), **env),
                            stdout=log.open("ab"), stderr=subprocess.STDOUT)


def metrics(run: Path) -> dict[int, dict]:
    return logged_metrics(run, METRICS)


@pytest.fixture(scope="module")
def reference(maxtext_python, maxtext_dir, data, tmp_path_factory):
    """step -> metrics of an uninterrupted run, per device count, and its run folder."""
    runs = {}

    def get(devices: int, pathways: bool = False):
        if (devices, pathways) not in runs:
            ref = tmp_path_factory.mktemp(f"ref{devices}")
            _finish(launch(maxtext_python, grain_flags(maxtext_dir, ref, data[0], pathways=pathways), devices,
                           ref / "log.txt"), ref / "log.txt")
            got = metrics(ref)
            assert sorted(got) == list(range(STEPS))
            losses = [m["learning/loss"] for m in got.values()]
            assert len(set(losses)) == len(losses), "the data set repeats batches: it cannot show a restarted iterator"
            runs[(devices, pathways)] = (got, ref)
        return runs[(devices, pathways)]

    return get


@pytest.mark.parametrize("devices,pathways", [(1, False), (4, True)], ids=["1dev", "4dev-pathways-flags"])
def test_kill_restart_and_backup_restore_resume_the_data_exactly(ramdisk, maxtext_python, maxtext_dir, data,
                                                                 reference, devices, pathways):
    ref_metrics, ref = reference(devices, pathways)
    run = ramdisk / "run"
    run.mkdir()
    flags = grain_flags(maxtext_dir, run, data[0], pathways=pathways)
    logs = [run / f"log{i}.txt" for i in (1, 2, 3)]
    _kill_after_commit(launch(maxtext_python, flags, devices, logs[0]), run, 3 * PERIOD, logs[0])
    _kill_after_commit(launch(maxtext_python, flags, devices, logs[1]), run, 5 * PERIOD, logs[1])
    assert _backups(run), "no backup was made"
    shutil.rmtree(run / "ramdisk")  # every ramdisk: the restart restores the backup
    _finish(launch(maxtext_python, flags, devices, logs[2]), logs[2])
    second, third = logs[1].read_text(), logs[2].read_text()
    assert "ram " in _restored(second) and "data position restored" in second, second[-3000:]
    assert "backup 2" in _restored(third) and "ram 0 bytes" in _restored(third), _restored(third)
    assert "data position restored" in third
    got = metrics(run)
    assert set(got) == set(range(STEPS))
    for step in range(STEPS):
        assert got[step] == ref_metrics[step], f"step {step}: {got[step]} != reference {ref_metrics[step]}"
    assert final_state(run, STEPS - 1) == final_state(ref, STEPS - 1)


def test_sigterm_saves_the_step_reached_and_the_same_command_resumes_after_it(ramdisk, maxtext_python, maxtext_dir,
                                                                             data, reference):
    ref_metrics, ref = reference(1)
    run = ramdisk / "run"
    run.mkdir()
    period = 5  # the step reached is seldom a periodic one
    flags = grain_flags(maxtext_dir, run, data[0], period=period)
    logs = [run / "log1.txt", run / "log2.txt"]
    proc = launch(maxtext_python, flags, 1, logs[0], MTC_PREEMPTION_GRACE_S="60")
    deadline = time.monotonic() + 600
    while not _step_file(run, period).exists() or not (run / "metrics.txt").exists():
        assert proc.poll() is None and time.monotonic() < deadline, logs[0].read_text()[-3000:]
        time.sleep(0.05)
    logged = max(metrics(run))  # the steps the run had finished by the notice
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    assert proc.wait(timeout=120) == 0, logs[0].read_text()[-3000:]
    assert time.monotonic() - t0 < 60, "the run did not exit within its preemption budget"
    text = logs[0].read_text()
    line = next(x for x in text.splitlines() if "mtc: preemption: step" in x)
    saved = int(line.split("mtc: preemption: step ")[1].split()[0])
    assert "committed" in line and "not committed" not in line, line
    assert saved > logged and saved < STEPS - 1 and _step_file(run, saved).exists(), (saved, logged, line)

    _finish(launch(maxtext_python, flags, 1, logs[1]), logs[1])
    second = logs[1].read_text()
    assert f"restoring from this run's directory step {saved}" in second, second[-3000:]
    got = metrics(run)
    # MaxText logs a step's metrics when the next one ends: the step a SIGTERM stopped it at has
    # none (its own preemption path is the same); every other step is there once, as in the reference.
    assert set(got) == set(range(STEPS)) - {saved}
    for step in got:
        assert got[step] == ref_metrics[step], f"step {step}: {got[step]} != reference {ref_metrics[step]}"
    assert final_state(run, STEPS - 1) == final_state(ref, STEPS - 1)


def test_another_file_list_is_refused_and_a_restart_on_purpose_starts_the_data_over(ramdisk, maxtext_python,
                                                                                   maxtext_dir, data, reference):
    ref_metrics, _ = reference(1)
    run = ramdisk / "run"
    run.mkdir()
    log = run / "log.txt"
    _kill_after_commit(launch(maxtext_python, grain_flags(maxtext_dir, run, data[0]), 1, log), run, 2 * PERIOD, log)
    other = subprocess.run([maxtext_python, "-m", "mtc.head.maxtext", *grain_flags(maxtext_dir, run, data[1])],
                           env=_env(1), capture_output=True, text=True, timeout=600)
    assert other.returncode == 2, other.stderr[-3000:]
    message = other.stderr
    assert "data-train-00000.parquet" in message and "other-train-00000.parquet" in message, message[-3000:]
    assert "Traceback" not in message.split("mtc: step")[-1], message[-3000:]
    # On purpose: the state is restored, the data starts over, so the resumed losses differ from
    # the reference (what a resume did before the data position was part of a step).
    _finish(launch(maxtext_python, grain_flags(maxtext_dir, run, data[0]), 1, log, MTC_DATA_RESTART="1"), log)
    assert "MTC_DATA_RESTART is set" in log.read_text()
    got = metrics(run)
    resumed = [s for s in range(2 * PERIOD + 1, STEPS)]
    assert all(got[s]["learning/loss"] != ref_metrics[s]["learning/loss"] for s in resumed[:3])


def test_export_at_finish_is_a_checkpoint_unmodified_maxtext_resumes_with_its_data_position(
        ramdisk, maxtext_python, maxtext_dir, data, reference):
    """MTC_EXPORT_ON_FINISH=1 writes the last step into MaxText's own checkpoint_dir (items + iter):
    MaxText without mtc, the same run name, resumes from it, data position included."""
    ref_metrics, _ = reference(1)
    run = ramdisk / "run"
    run.mkdir()
    first = 8
    flags = [f"steps={first}" if f.startswith("steps=") else f for f in grain_flags(maxtext_dir, run, data[0])]
    log = run / "log1.txt"
    _finish(launch(maxtext_python, flags, 1, log, MTC_EXPORT_ON_FINISH="1"), log)
    step_dir = run / "out" / "r" / "checkpoints" / str(first - 1)
    assert {p.name for p in step_dir.iterdir()} >= {"_CHECKPOINT_METADATA", "items", "iter"}, log.read_text()[-3000:]
    assert [p.name for p in (step_dir / "iter").iterdir()] == ["process_0-of-1.json"]
    plain = [f for f in grain_flags(maxtext_dir, run, data[0])
             if not f.startswith(("enable_multi_tier_checkpointing", "local_checkpoint", "multi_tier_"))]
    log2 = run / "log2.txt"
    proc = subprocess.Popen([maxtext_python, "-m", "maxtext.trainers.pre_train.train", *plain, "checkpoint_period=1000"],
                            env=_env(1), stdout=log2.open("ab"), stderr=subprocess.STDOUT)
    _finish(proc, log2)
    assert f"restoring from this run's directory step {first - 1}" in log2.read_text(), log2.read_text()[-3000:]
    got = metrics(run)
    for step in range(first, STEPS):
        assert got[step] == ref_metrics[step], f"step {step}: {got[step]} != reference {ref_metrics[step]}"
