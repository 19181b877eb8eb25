"""Cluster mode: the head's cost per save against the number of hosts, and 1 GiB over sockets.

    python bench/bench_cluster.py [--hosts 1,4,16,64] [--saves 20] [--gib 1.0] [--repeats 3] [--dir /dev/shm]

Part 1, fan-out. For each host count N, N sidecar daemons on this machine (1 slice), the
head's 64 CPU devices split evenly over them, and a tiny state (64 shards of 1 KiB, one per
device). Measured: daemon start-up and resident memory; the median head cost of one save (save() + waiting for
phase 1 and phase 2 on every host: dispatch and round trips); the same per host; its growth
against N; and one control round trip to every host, in parallel (the dispatcher's fan-out)
and one host after another (serial). Growth below N and parallel below serial say that the
fan-out is parallel.

Part 2, bytes. --gib GiB of random float32 (8 arrays sharded over 8 devices), saved through 4
daemons in cluster mode and through one in-process host in colocated mode (a CheckpointManager
without cluster_spec), interleaved, --repeats times, with new contents each save. Their ratio
is what the local sockets cost; a raw loopback socket copy of the same bytes, measured in this
run, is the physical limit for that part.

Times are ratios measured in one run: quote those, not absolute seconds (FACTS.md).
"""

from __future__ import annotations

import argparse
import os
import sys

if "jax" not in sys.modules:  # 64 CPU devices; must precede the first jax import
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=64").strip()

import shutil  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import psutil  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from mtc.head import CheckpointManager, MTCConfig  # noqa: E402
from mtc.head.cluster import ClusterDispatcher  # noqa: E402
from mtc.head.colocated import ColocatedDispatcher  # noqa: E402
from mtc.sidecar.local_cluster import LocalCluster  # noqa: E402

NDEV = 64


def tiny_state(step: int) -> dict:
    devs = jax.devices()[:NDEV]
    x = np.full((NDEV, 256), step, np.float32)  # 64 shards of 1 KiB, new contents every step
    return {"x": jax.device_put(x, NamedSharding(Mesh(np.array(devs), ("d",)), P("d"))), "step": step}


def fan_out(parent: Path, hosts: list[int], saves: int) -> list[dict]:
    rows = []
    for n in hosts:
        if NDEV % n:
            raise SystemExit(f"--hosts: {n} does not divide the head's {NDEV} devices")
        root = parent / f"fanout-{n}"
        t0 = time.perf_counter()
        with LocalCluster(root, 1, n, devices_per_host=NDEV // n) as cluster:
            startup = time.perf_counter() - t0
            rss = statistics.median(psutil.Process(pid).memory_info().rss for pid in cluster.pids().values())
            cfg = MTCConfig(local_checkpoint_directory=str(root), cluster_spec=str(cluster.spec_path),
                            local_checkpoint_period=1)
            disp = ClusterDispatcher(cfg, jax.devices()[:NDEV])
            with CheckpointManager(cfg, dispatcher=disp) as m:
                for step in range(3):  # warm: connections, version check, jit of nothing
                    m.save(step, tiny_state(step))
                    m.wait_until_finished()
                costs, p1, p2 = [], [], []
                for step in range(3, 3 + saves):
                    state = tiny_state(step)
                    t = time.perf_counter()
                    m.save(step, state)
                    m.wait_until_finished()
                    costs.append(time.perf_counter() - t)
                    p1.append(m.last_save_report.phase1_s)
                    p2.append(m.last_save_report.phase2_s)
                par, ser = [], []
                for _ in range(saves):
                    t = time.perf_counter()
                    _, failures = disp._fan_out(lambda h: disp._call(h, "ping"))
                    par.append(time.perf_counter() - t)
                    assert not failures, failures
                    t = time.perf_counter()
                    for h in disp.hosts():
                        disp._call(h, "ping")
                    ser.append(time.perf_counter() - t)
        shutil.rmtree(root, ignore_errors=True)
        rows.append({"n": n, "startup": startup, "rss": rss, "save": statistics.median(costs), "p1": statistics.median(p1),
                     "p2": statistics.median(p2), "par": statistics.median(par), "ser": statistics.median(ser)})
    return rows


def big_state(gib: float, devs: list) -> dict:
    mesh = Mesh(np.array(devs), ("d",))
    n = int(gib * (1 << 30)) // (8 * 4)
    n -= n % (8 * len(devs))
    rng = np.random.default_rng(0)
    out = {}
    for i in range(8):
        a = rng.integers(0, 1 << 32, size=n, dtype=np.uint32).view(np.float32)
        out[f"a{i}"] = jax.device_put(a, NamedSharding(mesh, P("d")))
    return out


def raw_loopback(nbytes: int) -> float:
    """Seconds to move ``nbytes`` over a loopback TCP socket (sendall of 4 MiB views, recv_into)."""
    data = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    sink = np.empty_like(data)
    srv = socket.create_server(("127.0.0.1", 0))

    def recv():
        c, _ = srv.accept()
        with c:
            view, got = memoryview(sink), 0
            while got < nbytes:
                got += c.recv_into(view[got:], nbytes - got)

    t = threading.Thread(target=recv)
    t.start()
    with socket.create_connection(srv.getsockname()) as s:
        t0 = time.perf_counter()
        mv = memoryview(data)
        for off in range(0, nbytes, 4 << 20):
            s.sendall(mv[off : off + (4 << 20)])
        t.join()
        dt = time.perf_counter() - t0
    srv.close()
    return dt


def bytes_compare(parent: Path, gib: float, repeats: int) -> dict:
    devs = jax.devices()[:8]
    state = big_state(gib, devs)
    nbytes = sum(x.nbytes for x in state.values())
    res = {"nbytes": nbytes, "cluster": [], "cluster_blocked": [], "colo": [], "colo_blocked": [],
           "cluster_restore": [], "colo_restore": []}
    croot, lroot = parent / "bytes-cluster", parent / "bytes-colocated"
    with LocalCluster(croot, 1, 4, devices_per_host=2) as cluster:
        ccfg = MTCConfig(local_checkpoint_directory=str(croot), cluster_spec=str(cluster.spec_path),
                         local_checkpoint_period=1)
        lcfg = MTCConfig(local_checkpoint_directory=str(lroot), local_checkpoint_period=1)
        target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()}
        with CheckpointManager(ccfg, dispatcher=ClusterDispatcher(ccfg, devs)) as cm, \
                CheckpointManager(lcfg, dispatcher=ColocatedDispatcher(lcfg, devs)) as lm:
            for step in range(repeats + 1):  # step 0 warms both up and is not counted
                state = {k: v + 1.0 for k, v in state.items()}  # new contents: no dedupe
                jax.block_until_ready(state)
                for name, m in (("cluster", cm), ("colo", lm)):
                    t = time.perf_counter()
                    m.save(step, state)
                    blocked = time.perf_counter() - t
                    m.wait_until_finished()
                    total = time.perf_counter() - t
                    t = time.perf_counter()
                    out = jax.block_until_ready(m.restore(step, target=target))
                    restore = time.perf_counter() - t
                    if step == repeats:  # check the last one bit for bit
                        for k in state:
                            a, b = np.asarray(state[k]), np.asarray(out[k])
                            if a.view(np.uint8).tobytes() != b.view(np.uint8).tobytes():
                                raise SystemExit(f"{name}: restored {k} differs from what was saved")
                    del out
                    if step:
                        res[name].append(total)
                        res[name + "_blocked"].append(blocked)
                        res[name + "_restore"].append(restore)
    res["loopback"] = raw_loopback(nbytes)
    shutil.rmtree(croot, ignore_errors=True)
    shutil.rmtree(lroot, ignore_errors=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hosts", default="1,4,16,64")
    p.add_argument("--saves", type=int, default=20)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    a = p.parse_args()
    if len(jax.devices()) < NDEV:
        raise SystemExit(f"needs {NDEV} CPU devices: run with XLA_FLAGS=--xla_force_host_platform_device_count={NDEV}")
    parent = Path(tempfile.mkdtemp(prefix="mtc-bench-cluster-", dir=a.dir))
    try:
        rows = fan_out(parent, [int(x) for x in a.hosts.split(",")], a.saves)
        base = rows[0]
        print(f"\n## Head cost per save, tiny state ({NDEV} shards of 1 KiB), median of {a.saves} saves\n")
        print("| hosts | daemon start-up (all / per host) | daemon RSS | save: dispatch + phase 1 + phase 2 | per host "
              f"| growth vs {base['n']} host(s) | hosts ratio | phase 1 | phase 2 | ping all, parallel | serial "
              "| serial / parallel |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['n']} | {r['startup']:.2f} s / {r['startup'] / r['n'] * 1e3:.0f} ms | {r['rss'] / 2**20:.0f} MiB | "
                  f"{r['save'] * 1e3:.1f} ms | {r['save'] / r['n'] * 1e3:.2f} ms | {r['save'] / base['save']:.2f}x | "
                  f"{r['n'] / base['n']:.0f}x | {r['p1'] * 1e3:.1f} ms | {r['p2'] * 1e3:.1f} ms | "
                  f"{r['par'] * 1e3:.2f} ms | {r['ser'] * 1e3:.2f} ms | {r['ser'] / r['par']:.2f}x |")
        b = bytes_compare(parent, a.gib, a.repeats)
        gb = b["nbytes"] / 1e9
        med = {k: statistics.median(v) for k, v in b.items() if isinstance(v, list)}
        print(f"\n## {b['nbytes'] / (1 << 30):.2f} GiB: 4 daemons (cluster) vs 1 in-process host (colocated), "
              f"median of {a.repeats}\n")
        print("| what | seconds | GB/s |")
        print("|---|---:|---:|")
        for label, key in (("cluster save total", "cluster"), ("colocated save total", "colo"),
                           ("cluster save blocked", "cluster_blocked"), ("colocated save blocked", "colo_blocked"),
                           ("cluster restore", "cluster_restore"), ("colocated restore", "colo_restore")):
            print(f"| {label} | {med[key]:.3f} | {gb / med[key]:.2f} |")
        print(f"| raw loopback TCP copy of the same bytes | {b['loopback']:.3f} | {gb / b['loopback']:.2f} |")
        print("\n| ratio | value |")
        print("|---|---:|")
        print(f"| cluster save total / colocated save total | {med['cluster'] / med['colo']:.2f} |")
        print(f"| (cluster - colocated save) / raw loopback copy | {(med['cluster'] - med['colo']) / b['loopback']:.2f} |")
        print(f"| cluster restore / colocated restore | {med['cluster_restore'] / med['colo_restore']:.2f} |")
    finally:
        shutil.rmtree(parent, ignore_errors=True)


if __name__ == "__main__":
    main()
