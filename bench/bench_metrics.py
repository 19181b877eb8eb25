"""What the Prometheus metrics cost a save: the same saves with ``metrics_port`` set and unset, in one run.

    python bench/bench_metrics.py [--mib 64] [--saves 10] [--rounds 3] [--dir /dev/shm]

A local cluster of 2 slices x 2 hosts (real sidecar daemons), a state of --mib MiB of float32 sharded
over 8 CPU devices, new contents each save, replication on. Rounds alternate a manager without
metrics and one with them (a scraper reads /metrics every 0.5 s meanwhile, far more often than a
real 15-60 s scrape), --saves saves each, every save waited for (commit and replication). Printed:
the median of save() to commit (``total_s``) and of the time save() blocks, both ways, and their
ratios; and the cost of the metrics hooks themselves per save (timed directly, the part that does
not drown in the noise of a shared machine) as a fraction of the median save.

Times are ratios measured in one run: quote those, not absolute seconds.
"""

from __future__ import annotations

import argparse
import os
import sys

if "jax" not in sys.modules:  # 8 CPU devices; must precede the first jax import
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import socket  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from mtc.head import CheckpointManager, MTCConfig  # noqa: E402
from mtc.head import metrics  # noqa: E402
from mtc.head.reports import SaveReport  # noqa: E402
from mtc.sidecar.local_cluster import LocalCluster  # noqa: E402


def make_state(mib: float, seed: int) -> dict:
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    rows = max(8, int(mib * 2**20 / 4 / 1024) // 8 * 8)
    a = np.random.default_rng(seed).standard_normal((rows, 1024), dtype=np.float32)
    return {"w": jax.device_put(a, NamedSharding(mesh, P("data", "model"))), "step": seed}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_saves(cluster: LocalCluster, port: int, first: int, saves: int, mib: float) -> list[SaveReport]:
    cfg = MTCConfig(local_checkpoint_directory=str(cluster.root), cluster_spec=str(cluster.spec_path),
                    local_checkpoint_period=1, prefetch_on_start=False, local_max_to_keep=2, metrics_port=port)
    out = []
    with CheckpointManager(cfg) as m:
        for step in range(first, first + saves):
            state = make_state(mib, step)
            m.save(step, state)
            m.wait_until_finished()
            m.wait_for_replication()
            out.append(m.last_save_report)
    return out


def hooks_cost(n: int = 2000) -> float:
    """Seconds the metrics hooks of one save take (the tracker's ``saved``, its error counter's block,
    and a replication report), timed over ``n`` calls on the process's instruments."""
    from mtc.head.reports import ReplicationReport

    cfg = MTCConfig(local_checkpoint_directory="/tmp/unused", metrics_port=metrics.served_port() or free_port())

    class _Runner:  # the tracker reads only ``running`` from the backup runner
        running = False

    tracker = metrics.Tracker(metrics.instruments(), cfg, _Runner())
    report = SaveReport(step=0, bytes_total=1 << 26, bytes_written=1 << 26, blocked_s=0.01, phase1_s=0.1,
                        phase2_s=0.01, total_s=0.12)
    rep = ReplicationReport(step=0, moved_blobs=8, moved_bytes=1 << 24, complete=True, replicated=True, seconds=0.2)
    t0 = time.perf_counter()
    for i in range(n):
        with tracker.errors("save"):
            tracker.saved(SaveReport(**{**report.__dict__, "step": i}))
        tracker.replicated(ReplicationReport(**{**rep.__dict__, "step": i}))
    return (time.perf_counter() - t0) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=64.0)
    ap.add_argument("--saves", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    a = ap.parse_args()
    port = free_port()
    results: dict[str, list[SaveReport]] = {"off": [], "on": []}
    stop = threading.Event()
    scrapes = [0]

    def scraper() -> None:
        while not stop.wait(0.5):
            if metrics.served_port():
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics.served_port()}/metrics", timeout=10) as r:
                    r.read()
                scrapes[0] += 1

    with tempfile.TemporaryDirectory(prefix="mtc-bench-metrics-", dir=a.dir) as d:
        with LocalCluster(Path(d) / "cluster", 2, 2, devices_per_host=2) as cluster:
            run_saves(cluster, 0, 0, 2, a.mib)  # warm-up: compile, connect, first blobs
            t = threading.Thread(target=scraper, daemon=True)
            t.start()
            step = 10
            for r in range(a.rounds):
                for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                    results[mode] += run_saves(cluster, port if mode == "on" else 0, step, a.saves, a.mib)
                    step += a.saves
            stop.set()
            t.join()
    med = {k: statistics.median(x.total_s for x in v) for k, v in results.items()}
    blocked = {k: statistics.median(x.blocked_s for x in v) for k, v in results.items()}
    hook = hooks_cost()
    print(f"state {a.mib:g} MiB, 2x2 hosts, {a.rounds} rounds x {a.saves} saves each way, {scrapes[0]} scrapes")
    print(f"save() to commit, median: off {med['off'] * 1e3:.1f} ms, on {med['on'] * 1e3:.1f} ms, "
          f"ratio on/off {med['on'] / med['off']:.3f}")
    print(f"save() blocked, median:   off {blocked['off'] * 1e3:.2f} ms, on {blocked['on'] * 1e3:.2f} ms, "
          f"ratio on/off {blocked['on'] / blocked['off']:.3f}")
    print(f"metrics hooks per save: {hook * 1e6:.1f} us = {hook / med['off'] * 100:.3f} % of the median save "
          f"(goal <= 1 %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
