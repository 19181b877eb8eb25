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

The Grain row (``--grain``, on by default) measures what a data iterator's position costs a save:
the iterator MaxText builds for ``grain_file_type=parquet`` (Grain's ParquetIterDataset over a
parquet file this benchmark writes, interleaved, window-shuffled, batched), its state's bytes in
the step, and the time a save blocks training with and without it, on the same arrays (the tiny
model's train state), through the same ``OrbaxCompatibleManager`` the launcher uses.

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


GRAIN_SCRIPT = r"""
import json, os, random, statistics, sys, time
import numpy as np, jax, grain
import pyarrow as pa, pyarrow.parquet as pq
import orbax.checkpoint as ocp
from mtc.head import MTCConfig, OrbaxCompatibleManager, IteratorSave
from mtc.head.items import save_tree

work, saves = sys.argv[1], int(sys.argv[2])
random.seed(0)
files = []
for i in range(2):
    f = os.path.join(work, f"data-train-{i:05d}.parquet")
    pq.write_table(pa.table({"text": [" ".join(str(random.random()) for _ in range(30)) for _ in range(5000)]}), f)
    files.append(f)
ds = grain.MapDataset.source(files).map(grain.experimental.ParquetIterDataset)
ds = grain.experimental.InterleaveIterDataset(ds, cycle_length=2)
ds = grain.experimental.WindowShuffleIterDataset(ds, window_size=128, seed=0)
it = iter(ds.map(lambda r: len(r["text"])).batch(8))
for _ in range(50):
    next(it)
rng = np.random.default_rng(0)
state = {f"w{i}": jax.device_put(rng.standard_normal((64, 1024), dtype=np.float32)) for i in range(6)}
nbytes = sum(x.nbytes for x in state.values())
t = time.perf_counter(); tree = save_tree("iterator", IteratorSave(it, pipeline={"files": files}))
take_ms = 1e3 * (time.perf_counter() - t)
iter_bytes = sum(a.nbytes for a in tree.values())
out = {}
for mode in ("state", "state+iter"):
    m = OrbaxCompatibleManager(MTCConfig(local_checkpoint_directory=os.path.join(work, mode), local_checkpoint_period=1,
                                         local_max_to_keep=2))
    blocked = []
    for step in range(saves):
        next(it)
        items = {"state": ocp.args.PyTreeSave(item=state)}
        if mode != "state":
            items["iter"] = IteratorSave(it, pipeline={"files": files})
        m.save(step, args=ocp.args.Composite(**items))
        m.wait_until_finished()
        blocked.append(m.mtc_manager.last_save_report.blocked_s)
    m.close()
    out[mode] = statistics.median(blocked[2:])
print(json.dumps({"iter_bytes": iter_bytes, "take_ms": take_ms, "state_bytes": nbytes, **out}))
"""


def grain_row(py: str, work: Path, saves: int = 20) -> None:
    d = work / "grain"
    d.mkdir()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    r = subprocess.run([py, "-c", GRAIN_SCRIPT, str(d), str(saves)], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"grain row failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    g = json.loads(r.stdout.strip().splitlines()[-1])
    a, b = g["state"], g["state+iter"]
    print(f"\nGrain iterator in the step (parquet pipeline as MaxText builds it; {g['state_bytes'] / 2**20:.1f} MiB of "
          f"arrays; median of {saves - 2} saves)")
    print(f"{'iter bytes':>10} {'get_state ms':>13} {'blocked s':>10} {'+iter s':>9} {'+ms/save':>9} {'ratio':>6}")
    print(f"{g['iter_bytes']:10d} {g['take_ms']:13.3f} {a:10.4f} {b:9.4f} {1e3 * (b - a):9.2f} {b / a:6.2f}",
          flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--models", default="tiny,larger")
    ap.add_argument("--no-grain", dest="grain", action="store_false", help="skip the Grain iterator row")
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
        if a.grain:
            grain_row(py, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
