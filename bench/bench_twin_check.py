"""The twin check's cost per save: check on against check off, in one run.

    python bench/bench_twin_check.py [--slices 2] [--hosts 4] [--arrays 400] [--saves 7] [--gib 0.5] [--repeats 5]

Part 1, across hosts (the production case: each host writes and names its own copy). Real sidecar
daemons, --slices x --hosts of them, 2 devices each; a state of --arrays small float32 arrays
sharded over the devices of a slice and replicated across slices (every box has a twin on every
other slice), plus numpy leaves (a copy on every host). Saves alternate between
``twin_check=off`` and ``twin_check=warn``, --saves each, with new contents each save; medians of
the save's total time. Then the check itself on the hosts' real answers to phase 1 of the last
save (parse every host's part, group the names by box, compare), timed alone: it reads no bytes,
so its cost grows with shards, not with the state's size.

Part 2, the hash pass (``twin_check_hash``: the replicas no host writes, hashed while ``save``
blocks). --gib GiB of float32 with two replicas of every box (mesh 2 x 4, rows split 4 ways), so
one pass hashes --gib GiB. Saved in colocated mode in this process, alternating hash off and on,
--repeats each: medians of the time ``save`` blocked. Also ``hash_replicas`` alone (GiB/s).

Times are ratios measured in one run: quote those, not absolute seconds (a shared VM's speed varies).
"""

from __future__ import annotations

import argparse
import os
import sys

if "jax" not in sys.modules:  # enough CPU devices for the cluster; must precede the first jax import
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=16").strip()

import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from mtc.head import CheckpointManager, MTCConfig  # noqa: E402
from mtc.head.dispatch.cluster.dispatcher import ClusterDispatcher  # noqa: E402
from mtc.head.save import flatten  # noqa: E402
from mtc.head.twin_check import compare, hash_replicas  # noqa: E402
from mtc.sidecar.local_cluster import LocalCluster  # noqa: E402

GIB = 1 << 30


class _Recording(ClusterDispatcher):
    """The stock dispatcher; keeps the last phase 1 answers so the check can be timed alone on them."""

    last = None

    def write(self, step, staged):
        self.last = super().write(step, staged)
        return self.last


def _cluster_state(seed: int, mesh: Mesh, arrays: int) -> dict:
    rng = np.random.default_rng(seed)
    model = mesh.shape["model"]
    sharding = NamedSharding(mesh, P(None, "model"))  # split within a slice, replicated across slices
    out = {f"layer{i:04d}": jax.device_put(rng.standard_normal((64, 16 * model), np.float32), sharding)
           for i in range(arrays)}
    out["host"] = {"rng": rng.integers(0, 2**62, size=(4,)), "lr": np.float32(seed)}
    return out


def part1(root: Path, slices: int, hosts: int, arrays: int, saves: int) -> None:
    ndev = slices * hosts * 2
    devices = jax.devices()[:ndev]
    mesh = Mesh(np.array(devices).reshape(slices, hosts * 2), ("data", "model"))
    with LocalCluster(root / "cluster", slices, hosts, devices_per_host=2) as cluster:
        cfg = MTCConfig(local_checkpoint_directory=str(cluster.root), cluster_spec=str(cluster.spec_path),
                        local_checkpoint_period=1, prefetch_on_start=False, local_max_to_keep=2,
                        replication_factor=1)
        dispatch = _Recording(cfg, devices)
        times: dict[str, list[float]] = {"off": [], "warn": []}
        with CheckpointManager(cfg, dispatcher=dispatch) as m:
            step = 0
            for i in range(2 * saves + 2):
                mode = ("off", "warn")[i % 2]
                m._config = cfg.replace(twin_check=mode)  # the same manager and hosts, the check switched
                state = _cluster_state(i, mesh, arrays)
                step += 1
                m.save(step, state)
                m.wait_until_finished()
                report = m.last_save_report
                if not report.committed:
                    raise SystemExit(f"step {step}: the twin check tripped on equal replicas: {report.twin_mismatches}")
                if i >= 2:  # the first two warm up
                    times[mode].append(report.total_s)
            leaves, _ = flatten(state)
            parts = dispatch.last.parts
            shards = sum(json.loads(p)["rows"] for _, p in parts)
            t = []
            for _ in range(20):
                t0 = time.perf_counter()
                found = compare(leaves, parts, {}, dispatch.host_of_device)
                t.append(time.perf_counter() - t0)
            assert found == []
    off, on = statistics.median(times["off"]), statistics.median(times["warn"])
    check = statistics.median(t)
    print(f"part 1, across hosts: {slices} slices x {hosts} hosts, {arrays} arrays + 2 numpy leaves, "
          f"{len(parts)} parts, ~{shards} shard rows")
    print(f"  save total, median of {saves}: twin_check=off {off * 1e3:.1f} ms, warn {on * 1e3:.1f} ms "
          f"(on/off {on / off:.3f})")
    print(f"  the check alone on the last save's real parts: {check * 1e3:.2f} ms per save "
          f"({check / off * 100:.1f} % of a save; {check / max(shards, 1) * 1e6:.2f} us per shard row)")


def part2(root: Path, gib: float, repeats: int) -> None:
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    sharding = NamedSharding(mesh, P("model"))  # 4 boxes, each on 2 devices: one copy written, one not
    rows = max(4, int(gib * GIB) // (4 * 4096) // 4 * 4)
    base = np.random.default_rng(0).standard_normal((rows, 4096), np.float32)
    nbytes = base.nbytes
    blocked: dict[bool, list[float]] = {False: [], True: []}
    hashed_s = []
    with CheckpointManager(local_checkpoint_directory=str(root / "ramdisk"), local_checkpoint_period=1,
                           prefetch_on_start=False, local_max_to_keep=2) as m:
        cfg = m.config
        for i in range(2 * repeats + 2):
            on = bool(i % 2)
            m._config = cfg.replace(twin_check_hash=on)
            state = {"w": jax.device_put(base + np.float32(i), sharding)}
            jax.block_until_ready(state)
            m.save(i, state)
            m.wait_until_finished()
            if not m.last_save_report.committed:
                raise SystemExit(f"step {i}: the hash pass tripped on identical replicas")
            if i >= 2:
                blocked[on].append(m.last_save_report.blocked_s)
            if on:
                leaves, _ = flatten(state)
                t0 = time.perf_counter()
                hash_replicas(leaves)
                hashed_s.append(time.perf_counter() - t0)
    off, on = statistics.median(blocked[False]), statistics.median(blocked[True])
    rate = nbytes / GIB / statistics.median(hashed_s)
    print(f"part 2, hash pass (colocated, one host): {nbytes / GIB:.2f} GiB of replicas not written")
    print(f"  save() blocked, median of {repeats}: hash off {off * 1e3:.1f} ms, on {on * 1e3:.1f} ms "
          f"(+{(on - off) * 1e3:.1f} ms, x{on / off:.2f})")
    print(f"  hash_replicas alone: {rate:.1f} GiB/s, {1e3 / rate:.0f} ms per GiB of replicas")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slices", type=int, default=2)
    ap.add_argument("--hosts", type=int, default=4, help="hosts per slice (2 devices each)")
    ap.add_argument("--arrays", type=int, default=400)
    ap.add_argument("--saves", type=int, default=7, help="timed saves per mode (part 1)")
    ap.add_argument("--gib", type=float, default=0.5, help="GiB of replicas hashed (part 2)")
    ap.add_argument("--repeats", type=int, default=5, help="timed saves per mode (part 2)")
    ap.add_argument("--dir", default="/dev/shm")
    args = ap.parse_args(argv)
    if args.slices * args.hosts * 2 > len(jax.devices()):
        raise SystemExit(f"--slices x --hosts x 2 devices must be at most {len(jax.devices())} (XLA_FLAGS)")
    root = Path(tempfile.mkdtemp(prefix="mtc-bench-twin-", dir=args.dir))
    try:
        part1(root, args.slices, args.hosts, args.arrays, args.saves)
        part2(root, args.gib, args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
