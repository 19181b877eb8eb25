"""What TLS in transit costs: peer fetch and cluster restore throughput, clear text against mutual TLS.

    python bench/bench_tls.py [--gib 0.5] [--repeats 5] [--dir /dev/shm]

Both in one process, the two modes interleaved round by round (a shared machine's load hits
both alike), each on its own local cluster of real daemons; the TLS one uses a folder
``mtc tls generate`` wrote (EC P-256, TLS 1.3: AES-GCM or ChaCha20 as OpenSSL negotiates).

Part 1, peer fetch: 1 slice x 2 hosts; one host holds --gib GiB of blobs, the other pulls them
all through the production path (the head's ``peer_pull`` -> the receiving daemon's
``PeerClient`` objects -> the holder's ``PeerServer``), hashed on arrival.
Part 2, cluster restore: 1 slice x 4 hosts x 2 devices; a --gib GiB state saved once, restored
to the head (its 8 CPU devices) from the hosts' ramdisks over the control connections; the
last restore of each mode is compared bit for bit with what was saved.
Medians, GB/s (10^9 bytes per second), and the TLS/clear ratio.
"""

from __future__ import annotations

import argparse
import os
import sys

if "jax" not in sys.modules:  # 8 CPU devices; must precede the first jax import
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import contextlib  # noqa: E402
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
from mtc.head.tools.cli.tls import generate  # noqa: E402
from mtc.sidecar.local_cluster import LocalCluster  # noqa: E402

MODES = ("clear", "tls")


def _state(devs: list, gib: float, seed: int) -> dict:
    """Four float32 arrays of --gib GiB in all, sharded over ``devs``; random bytes (no dedupe)."""
    mesh = Mesh(np.array(devs), ("d",))
    per = int(gib * (1 << 30)) // 4 // 4
    per -= per % (len(devs) * 4096)
    rng = np.random.default_rng(seed)
    return {f"a{i}": jax.device_put(rng.integers(0, 1 << 31, per, dtype=np.int32).view(np.float32),
                                    NamedSharding(mesh, P("d"))) for i in range(4)}


def _config(root: Path, cluster: LocalCluster, tls_dir: str | None, **kw) -> MTCConfig:
    return MTCConfig(local_checkpoint_directory=str(root), cluster_spec=str(cluster.spec_path),
                     local_checkpoint_period=1, tls_dir=tls_dir or "", prefetch_on_start=False, **kw)


def peer_fetch(parent: Path, tls_dir: str, gib: float, repeats: int) -> dict:
    state = _state(jax.devices()[:4], gib, 1)  # the first host's devices: it holds every blob
    nbytes = sum(x.nbytes for x in state.values())
    out: dict = {"nbytes": nbytes, **{m: [] for m in MODES}}
    with contextlib.ExitStack() as stack:
        runs = {}
        for mode in MODES:
            root = parent / f"fetch-{mode}"
            cluster = stack.enter_context(LocalCluster(root, 1, 2, devices_per_host=4,
                                                       tls_dir=tls_dir if mode == "tls" else None))
            m = stack.enter_context(CheckpointManager(_config(root, cluster, tls_dir if mode == "tls" else None,
                                                              replication_factor=1)))
            m.save(1, state)
            m.wait_until_finished()
            sizes = m._dispatch.manifest(1).blob_sizes()
            holder, receiver = cluster.hosts
            m._dispatch.peer_inventories()  # connect the peer lanes: learn every peer address
            runs[mode] = (cluster, m, receiver, sizes, [(b, n, [holder]) for b, n in sorted(sizes.items())])
        for r in range(repeats + 1):  # the first round warms up and is not counted
            for mode in MODES:
                cluster, m, receiver, sizes, rows = runs[mode]
                for p in (cluster.store_root(receiver) / "blobs").iterdir():
                    if p.name in sizes:
                        p.unlink()
                t0 = time.perf_counter()
                got = m._dispatch.peer_pull(1, {receiver: rows})[receiver]
                dt = time.perf_counter() - t0
                if got.error or got.failed or got.pulled_bytes != nbytes:
                    raise SystemExit(f"{mode}: peer fetch failed: {got}")
                if r:
                    out[mode].append(dt)
    return out


def cluster_restore(parent: Path, tls_dir: str, gib: float, repeats: int) -> dict:
    devs = jax.devices()[:8]
    state = _state(devs, gib, 2)
    nbytes = sum(x.nbytes for x in state.values())
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()}
    out: dict = {"nbytes": nbytes, **{m: [] for m in MODES}}
    with contextlib.ExitStack() as stack:
        managers = {}
        for mode in MODES:
            root = parent / f"restore-{mode}"
            cluster = stack.enter_context(LocalCluster(root, 1, 4, devices_per_host=2,
                                                       tls_dir=tls_dir if mode == "tls" else None))
            m = stack.enter_context(CheckpointManager(_config(root, cluster, tls_dir if mode == "tls" else None,
                                                              local_max_to_keep=1, replication_factor=1)))
            m.save(1, state)
            m.wait_until_finished()
            managers[mode] = m
        for r in range(repeats + 1):
            for mode in MODES:
                t0 = time.perf_counter()
                got = jax.block_until_ready(managers[mode].restore(1, target=target))
                dt = time.perf_counter() - t0
                if r == repeats:
                    for k in state:
                        if np.asarray(state[k]).tobytes() != np.asarray(got[k]).tobytes():
                            raise SystemExit(f"{mode}: restored {k} differs from what was saved")
                del got
                if r:
                    out[mode].append(dt)
    return out


def _report(title: str, res: dict) -> None:
    rates = {m: res["nbytes"] / statistics.median(res[m]) / 1e9 for m in MODES}
    print(f"{title} ({res['nbytes'] / 2**30:.2f} GiB, median of {len(res['clear'])}):")
    for m in MODES:
        runs = ", ".join(f"{res['nbytes'] / t / 1e9:.2f}" for t in res[m])
        print(f"  {m:5s} {rates[m]:6.2f} GB/s   (runs: {runs})")
    print(f"  TLS / clear: {rates['tls'] / rates['clear']:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=0.5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    p.add_argument("--parts", default="fetch,restore", help="which parts to run (comma-separated: fetch, restore)")
    a = p.parse_args()
    parent = Path(tempfile.mkdtemp(prefix="mtc-bench-tls-", dir=a.dir))
    try:
        generate(parent / "tls")
        tls_dir = str(parent / "tls")
        print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
        parts = set(a.parts.split(","))
        if "fetch" in parts:
            _report("peer fetch, 1 holder -> 1 receiver", peer_fetch(parent, tls_dir, a.gib, a.repeats))
        if "restore" in parts:
            _report("cluster restore, 4 hosts -> head", cluster_restore(parent, tls_dir, a.gib, a.repeats))
    finally:
        shutil.rmtree(parent, ignore_errors=True)


if __name__ == "__main__":
    main()
