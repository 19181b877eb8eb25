"""``mtc demo``: train a small model, crash it (kill -9), restore, finish, and compare.

Three fresh processes, on 8 CPU devices and the embedded defaults (a local ramdisk folder):
1. the reference: train all steps without interruption;
2. the victim: train with checkpoints every ``--period`` steps, killed with SIGKILL after
   step ``--crash-at``;
3. the recovery: a new process restores the latest checkpoint and finishes the run.
The final parameters of (3) must equal those of (1) bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

_XLA = "--xla_force_host_platform_device_count=8"


def _worker_env() -> dict:
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        env["XLA_FLAGS"] = (flags + " " + _XLA).strip()
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _train(workdir: Path, steps: int, period: int, crash_at: int | None, checkpoint: bool) -> None:
    """The training job (runs in its own process)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from mtc.head import CheckpointManager, MTCConfig

    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    w_sh = NamedSharding(mesh, P(None, "model"))

    def init():
        k1, k2 = jax.random.split(jax.random.PRNGKey(0))
        params = {"w1": jax.random.normal(k1, (16, 64)) * 0.3, "b1": jnp.zeros(64),
                  "w2": jax.random.normal(k2, (64, 1)) * 0.3}
        shard = {"w1": w_sh, "b1": NamedSharding(mesh, P("model")), "w2": NamedSharding(mesh, P("model"))}
        params = {k: jax.device_put(v, shard[k]) for k, v in params.items()}
        momentum = jax.tree.map(jnp.zeros_like, params)
        return {"params": params, "momentum": momentum, "step": 0}

    def batch(step):
        k = jax.random.PRNGKey(1000 + step)
        x = jax.random.normal(k, (32, 16))
        y = jnp.sin(x.sum(axis=1, keepdims=True))
        return jax.device_put(x, NamedSharding(mesh, P("data"))), jax.device_put(y, NamedSharding(mesh, P("data")))

    def loss_fn(params, x, y):
        h = jnp.tanh(x @ params["w1"] + params["b1"])
        return jnp.mean((h @ params["w2"] - y) ** 2)

    @jax.jit
    def train_step(params, momentum, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        momentum = jax.tree.map(lambda m, g: 0.9 * m + g, momentum, grads)
        params = jax.tree.map(lambda p, m: p - 0.05 * m, params, momentum)
        return params, momentum, loss

    state = init()
    mgr = None
    if checkpoint:
        cfg = MTCConfig(enable_multi_tier_checkpointing=True, local_checkpoint_directory=str(workdir / "ramdisk"),
                        local_checkpoint_period=period)
        mgr = CheckpointManager(cfg)
        latest = mgr.latest_step()
        if latest is not None:
            print(f"  committed steps on the ramdisk: {mgr.all_steps()} (a step still being written "
                  "when the job died is not visible)", flush=True)
            abstract = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array)
                else x, state)
            state = mgr.restore(latest, target=abstract)
            r = mgr.last_restore_report
            print(f"  restored step {latest} ({sum(r.bytes_by_tier.values())} bytes from "
                  f"{', '.join(r.bytes_by_tier)}) in {r.total_s * 1000:.1f} ms", flush=True)
    params, momentum = state["params"], state["momentum"]
    for step in range(state["step"] + 1, steps + 1):
        x, y = batch(step)
        params, momentum, loss = train_step(params, momentum, x, y)
        t0 = time.perf_counter()
        if mgr is not None and mgr.save(step, {"params": params, "momentum": momentum, "step": step}):
            print(f"  step {step:3d}  loss {float(loss):.5f}  checkpoint started; training waited "
                  f"{(time.perf_counter() - t0) * 1000:.1f} ms", flush=True)
        if crash_at is not None and step == crash_at:
            print(f"  step {step:3d}  *** kill -9 ***", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    if mgr is not None:
        mgr.close()
    flat = {k: np.asarray(v) for k, v in params.items()}
    np.savez(workdir / "final.npz", **flat)
    print(f"  finished {steps} steps, loss {float(loss):.5f}", flush=True)


def _run(workdir: Path, args: argparse.Namespace, *extra: str) -> int:
    cmd = [sys.executable, "-m", "mtc.head.demo", "train", "--workdir", str(workdir), "--steps", str(args.steps),
           "--period", str(args.period), *extra]
    return subprocess.run(cmd, env=_worker_env()).returncode


def main(args: argparse.Namespace) -> int:
    """Run the demo; returns 0 when the recovered run equals the reference bit for bit."""
    import numpy as np

    work = Path(args.workdir)
    if args.crash_at < 1 or args.crash_at >= args.steps:
        print(f"mtc demo: --crash-at must be between 1 and --steps - 1 ({args.steps - 1})", file=sys.stderr)
        return 2
    if args.period < 1 or args.period > args.crash_at:
        print("mtc demo: --period must be >= 1 and <= --crash-at, or there is nothing to restore", file=sys.stderr)
        return 2
    ref, run = work / "reference", work / "job"
    for d in (ref, run):
        d.mkdir(parents=True, exist_ok=True)
    print(f"mtc demo in {work}: {args.steps} steps, a checkpoint every {args.period} steps, "
          f"ramdisk {run / 'ramdisk'}")
    print("1) reference run, no interruption")
    if _run(ref, args, "--no-checkpoint") != 0:
        return 1
    print(f"2) training job with checkpoints, killed after step {args.crash_at}")
    rc = _run(run, args, "--crash-at", str(args.crash_at))
    if rc != -signal.SIGKILL:
        print(f"mtc demo: the job should have been killed, exit status {rc}", file=sys.stderr)
        return 1
    print("3) a fresh process restores the latest checkpoint and finishes")
    if _run(run, args) != 0:
        return 1
    a, b = np.load(ref / "final.npz"), np.load(run / "final.npz")
    same = sorted(a.files) == sorted(b.files) and all(
        a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes() for k in a.files)
    result = {"bitwise_equal": same, "arrays": len(a.files), "workdir": str(work)}
    print(json.dumps(result))
    print("final parameters equal the uninterrupted run bit for bit" if same
          else "MISMATCH: the recovered run differs from the reference")
    return 0 if same else 1


def _train_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mtc.head.demo train")
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--period", type=int, required=True)
    p.add_argument("--crash-at", type=int, default=None)
    p.add_argument("--no-checkpoint", action="store_true")
    a = p.parse_args(argv)
    _train(a.workdir, a.steps, a.period, a.crash_at, not a.no_checkpoint)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "train":
        sys.exit(_train_main(sys.argv[2:]))
    print("usage: mtc demo [--steps N --period N --crash-at N --workdir DIR]", file=sys.stderr)
    sys.exit(2)
