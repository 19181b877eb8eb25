"""Checkpoints in and out of mtc, with the real MaxText: unmodified MaxText reads what ``mtc export``
writes, and a run on MaxText's standard checkpoints moves onto mtc without losing its progress.

Synthetic data here (every batch is the same), so a run that starts from a checkpoint through
``load_full_state_path`` (which restarts the data, as MaxText documents) must log exactly the
metrics of an uninterrupted run, and a ``load_parameters_path`` run's first loss and gradient
norm must equal the uninterrupted run's at the step after the checkpoint (same parameters, same
batch). The real-data case (the data iterator's position through ``iter``) is in
``test_exact_resume.py``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from test_maxtext_e2e import _env, _finish, _kill_after_commit, _restored, base_yml  # noqa: F401

pytestmark = [pytest.mark.maxtext, pytest.mark.integration]

STEPS = 10
FIRST = 6  # the exporting run trains steps 0..5; its last step, 5, is exported
METRICS = ("learning/loss", "learning/raw_grad_norm", "learning/param_norm", "learning/current_learning_rate")


def flags(base_yml: str, run: Path, *, steps: int = STEPS, mtc: bool = True) -> list[str]:
    out = [
        base_yml, "run_name=r", f"base_output_directory={run / 'out'}", "model_name=default",
        "base_emb_dim=64", "base_num_decoder_layers=2", "base_mlp_dim=128", "base_num_query_heads=2",
        "base_num_kv_heads=2", "head_dim=32", "vocab_size=256", "max_target_length=32", "per_device_batch_size=1",
        f"steps={steps}", f"learning_rate_schedule_steps={STEPS}", "dataset_type=synthetic", "hardware=cpu",
        f"metrics_file={run / 'metrics.txt'}", "skip_jax_distributed_system=True", "enable_checkpointing=True",
    ]
    if mtc:
        out += ["enable_multi_tier_checkpointing=True", f"local_checkpoint_directory={run / 'ramdisk'}",
                "local_checkpoint_period=2", "multi_tier_checkpointing_backup_interval_steps=4"]
    else:
        out += ["checkpoint_period=1000"]
    return out


def maxtext(py: str, args: list[str], log: Path, *, launcher: bool, **env: str) -> subprocess.Popen:
    module = "mtc.head.maxtext" if launcher else "maxtext.trainers.pre_train.train"
    log.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([py, "-m", module, *args], env=dict(_env(1), **env), stdout=log.open("ab"),
                            stderr=subprocess.STDOUT)


def metrics(run: Path) -> dict[int, dict]:
    out = {}
    for line in (run / "metrics.txt").read_text().splitlines():
        d = json.loads(line)
        out[int(d["step"])] = {k: d[k] for k in METRICS}
    return out


@pytest.fixture(scope="module")
def reference(maxtext_python, base_yml, tmp_path_factory):
    """Unmodified MaxText, uninterrupted, no checkpoints: step -> metrics."""
    run = tmp_path_factory.mktemp("ref")
    args = [a for a in flags(base_yml, run, mtc=False) if a != "enable_checkpointing=True"]
    _finish(maxtext(maxtext_python, args + ["enable_checkpointing=False"], run / "log.txt", launcher=False),
            run / "log.txt")
    got = metrics(run)
    assert sorted(got) == list(range(STEPS))
    return got


def test_unmodified_maxtext_continues_from_mtc_export(ramdisk, maxtext_python, base_yml, reference, tmp_path):
    run = ramdisk / "run"
    run.mkdir()
    export_dir = tmp_path / "exported"
    _finish(maxtext(maxtext_python, flags(base_yml, run, steps=FIRST), run / "log.txt", launcher=True,
                    MTC_EXPORT_ON_FINISH=str(export_dir)), run / "log.txt")
    log = (run / "log.txt").read_text()
    assert f"exported step {FIRST - 1} as a standard checkpoint" in log, log[-3000:]
    items = export_dir / str(FIRST - 1) / "items"

    # The CLI, from the stopped run's ramdisk: another step, read back and compared bit for bit.
    cli = Path(maxtext_python).parent / "mtc"
    r = subprocess.run([str(cli), "export", "--to", str(tmp_path / "cli"), "--step", "4", "--verify",
                        "--local-checkpoint-directory", str(run / "ramdisk")],
                       env=_env(1), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "verified bit for bit" in r.stdout and f"load_full_state_path={tmp_path / 'cli' / '4' / 'items'}" in r.stdout
    assert (tmp_path / "cli" / "4" / "items").is_dir()
    again = subprocess.run([str(cli), "export", "--to", str(tmp_path / "cli"), "--step", "4",
                            "--local-checkpoint-directory", str(run / "ramdisk")],
                           env=_env(1), capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "already exists" in again.stderr and "Traceback" not in again.stderr

    # Unmodified MaxText, no mtc flags: the full state, then the parameters alone.
    full = tmp_path / "full"
    _finish(maxtext(maxtext_python, flags(base_yml, full, mtc=False) + [f"load_full_state_path={items}"],
                    full / "log.txt", launcher=False), full / "log.txt")
    got = metrics(full)
    assert sorted(got) == list(range(FIRST, STEPS)), "the run did not continue at the step after the export"
    for step in got:
        assert got[step] == reference[step], f"step {step}: {got[step]} != {reference[step]}"
    params = tmp_path / "params"
    args = [a for a in flags(base_yml, params, steps=1, mtc=False) if a != "enable_checkpointing=True"]
    _finish(maxtext(maxtext_python, args + ["enable_checkpointing=False", f"load_parameters_path={items}"],
                    params / "log.txt", launcher=False), params / "log.txt")
    first = metrics(params)[0]
    for name in ("learning/loss", "learning/raw_grad_norm"):  # the same parameters on the same batch
        assert first[name] == reference[FIRST][name], (name, first, reference[FIRST])


def test_standard_checkpoint_run_moves_onto_mtc_and_resumes_from_mtc(ramdisk, maxtext_python, base_yml, reference,
                                                                     tmp_path):
    std = tmp_path / "std"
    _finish(maxtext(maxtext_python, flags(base_yml, std, steps=4, mtc=False), std / "log.txt", launcher=False),
            std / "log.txt")
    items = std / "out" / "r" / "checkpoints" / "3" / "items"
    assert items.is_dir(), sorted(p.name for p in (std / "out" / "r" / "checkpoints").iterdir())
    run = ramdisk / "run"
    run.mkdir()
    args = flags(base_yml, run) + [f"load_full_state_path={items}"]
    logs = [run / "log1.txt", run / "log2.txt"]
    _kill_after_commit(maxtext(maxtext_python, args, logs[0], launcher=True), run, 6, logs[0])
    first = logs[0].read_text()
    assert "started from load_full_state_path" in first, first[-3000:]
    _finish(maxtext(maxtext_python, args, logs[1], launcher=True), logs[1])
    second = logs[1].read_text()
    assert "restored step 6" in _restored(second), "the same command did not resume from mtc's newer step"
    assert "started from load_full_state_path" not in second
    got = metrics(run)
    assert sorted(got) == list(range(4, STEPS))
    for step in got:
        assert got[step] == reference[step], f"step {step}: {got[step]} != {reference[step]}"
