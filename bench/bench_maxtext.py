"""MaxText step time with mtc saving every step, vs no checkpointing, vs Orbax every step.

    python bench/bench_maxtext.py [--steps 12] [--devices 1] [--models tiny,larger]

Each configuration is one real MaxText 0.2.5 run (the MaxText test environment,
tests/maxtext/env.py, built once and reused) on the same model, in one invocation:

- ``none``: ``enable_checkpointing=False``;
- ``orbax``: MaxText's plain Orbax checkpointing (async, OCDBT/zarr3) every step, to a local
  directory on /dev/shm;
- ``mtc``: ``python3 -m mtc.head.maxtext`` with multi-tier checkpointing every step
  (``local_checkpoint_period=1``) on a /dev/shm ramdisk, backups every 60 minutes (so one,
  of the first step).

The step time is MaxText's own ``perf/step_time_seconds`` (metrics_file), median over the
steps after the first two (compilation). Overhead per step is the difference to ``none``; the
ratios are measured in the same run, so the machine's noise largely cancels.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "maxtext"))
import env as mx_env  # noqa: E402

MODELS = {
    # ~0.1 M parameters (1.4 MB of train state)
    "tiny": ["base_emb_dim=64", "base_num_decoder_layers=2", "base_mlp_dim=128", "base_num_query_heads=2",
             "base_num_kv_heads=2", "head_dim=32", "vocab_size=256"],
    # ~25 M parameters (~300 MB of train state: params and two Adam moments in float32)
    "larger": ["base_emb_dim=512", "base_num_decoder_layers=2", "base_mlp_dim=2048", "base_num_query_heads=8",
               "base_num_kv_heads=8", "head_dim=64", "vocab_size=16384"],
}


def run(py: str, base_yml: str, model: str, mode: str, steps: int, devices: int, work: Path) -> dict:
    d = work / f"{model}-{mode}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    flags = [base_yml, "run_name=b", f"base_output_directory={d / 'out'}", "model_name=default", *MODELS[model],
             "max_target_length=32", "per_device_batch_size=1", f"steps={steps}", "dataset_type=synthetic",
             "hardware=cpu", "skip_jax_distributed_system=True", f"metrics_file={d / 'metrics.txt'}"]
    module = "maxtext.trainers.pre_train.train"
    if mode == "none":
        flags.append("enable_checkpointing=False")
    elif mode == "orbax":
        flags += ["enable_checkpointing=True", "async_checkpointing=True", "checkpoint_period=1"]
    else:
        module = "mtc.head.maxtext"
        flags += ["enable_checkpointing=True", "enable_multi_tier_checkpointing=True",
                  f"local_checkpoint_directory={d / 'ramdisk'}", "local_checkpoint_period=1",
                  "multi_tier_checkpointing_backup_interval_minutes=60", "checkpoint_period=100000"]
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    t0 = time.perf_counter()
    r = subprocess.run([py, "-m", module, *flags], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{model}/{mode} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    rows = [json.loads(line) for line in (d / "metrics.txt").read_text().splitlines()]
    times = [row["perf/step_time_seconds"] for row in rows if row["step"] >= 2]
    saved = sorted(p.name for p in (d / "ramdisk" / "mtc" / "steps").glob("*.json")) if mode == "mtc" else []
    shutil.rmtree(d, ignore_errors=True)
    return {"median": statistics.median(times), "wall": wall, "steps": len(times), "kept": len(saved)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--models", default="tiny,larger")
    a = ap.parse_args()
    py = str(mx_env.ensure())
    pkg = subprocess.run([py, "-c", "import maxtext, os; print(os.path.dirname(maxtext.__file__))"],
                         capture_output=True, text=True, check=True).stdout.strip()
    base_yml = str(Path(pkg) / "configs" / "base.yml")
    work = Path(tempfile.mkdtemp(prefix="mtc-bench-maxtext-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        print(f"MaxText step time, {a.devices} CPU device(s), {a.steps} steps, median of steps 2..{a.steps - 1}")
        print(f"{'model':8} {'none s':>9} {'orbax s':>9} {'mtc s':>9} {'orbax/none':>11} {'mtc/none':>9} "
              f"{'orbax +ms':>10} {'mtc +ms':>9} {'mtc/orbax':>10}")
        for model in a.models.split(","):
            res = {m: run(py, base_yml, model, m, a.steps, a.devices, work) for m in ("none", "orbax", "mtc")}
            n, o, m = (res[k]["median"] for k in ("none", "orbax", "mtc"))
            print(f"{model:8} {n:9.4f} {o:9.4f} {m:9.4f} {o / n:11.2f} {m / n:9.2f} {1e3 * (o - n):10.1f} "
                  f"{1e3 * (m - n):9.1f} {m / o:10.2f}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
