"""Cluster mode: the head's cost per save against the number of hosts, and 1 GiB over sockets.

    python bench/bench_cluster.py [--hosts 1,4,16,64] [--saves 20] [--gib 1.0] [--repeats 3] [--dir /dev/shm]

Part 1, fan-out. For each host count N, N sidecar daemons on this machine (1 slice), the
head's 64 CPU devices split evenly over them, and a tiny state (64 shards of 1 KiB, one per
device). Measured: daemon start-up and resident memory; the median head cost of one save (save() + waiting for
phase 1 and phase 2 on every host: dispatch and round trips); the same per host; its growth
against N; the CPU time the head and the daemons spend per save; and one control round trip to
every host, one host after another (serial) and at once. Saves and pings are timed both ways
in turn: from one thread with a selector (``HostLanes.call_each``, what the head does) and with
a pool thread per host for every request (``thread_per_host`` here; the head does that only for
requests that carry more than a MiB to a host). Growth below N and parallel below serial say
that the fan-out is parallel. Then a restarted head restores the last step, --saves times each:
onto the sharding that saved it (each host loads its own part) and onto the devices reversed
(each host reads other writers' parts, pulled whole the first time); wall and head CPU per
restore, and the shard rows the head parsed (none: both are planned from the manifest's header).

Part 2, bytes. --gib GiB of random float32 (8 arrays sharded over 8 devices), saved through 4
daemons in cluster mode and through one in-process host in colocated mode (a CheckpointManager
without cluster_spec), interleaved, --repeats times, with new contents each save. Their ratio
is what the local sockets cost; a raw loopback socket copy of the same bytes, measured after
each repeat, is the physical limit for that part. Each restore is timed once replication of the
save is done (it would otherwise share the cores with it); saved shards are streamed from maps of
their files and hashed by the head as they arrive.

Times are ratios measured in one run: quote those, not absolute seconds (a shared VM's speed varies).
"""

from __future__ import annotations

import argparse
import dataclasses
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
from mtc.head.dispatch.cluster.dispatcher import ClusterDispatcher  # noqa: E402
from mtc.head.dispatch.cluster.lanes import HostLanes, lane_of  # noqa: E402
from mtc.head.dispatch.colocated import ColocatedDispatcher  # noqa: E402
from mtc.sidecar.local_cluster import LocalCluster  # noqa: E402

NDEV = 64


def thread_per_host(lanes: HostLanes):
    """``lanes.call_each`` with a pool thread per host for every request (the head's ``call_each``
    does that only for requests over its inline limit): the other way a fan-out can go, timed
    beside the head's own."""
    def call_each(op, hosts=None, args=None, payloads=None, *, lane=None):
        hosts = lanes.hosts if hosts is None else list(hosts)
        args_of = args if callable(args) else (lambda h, a=args or {}: a)
        lane = lane or lane_of(op)
        return lanes.fan_out(lambda h: lanes.call(h, op, args_of(h), payloads(h) if payloads else (), lane=lane),
                             hosts, lane=lane)
    return call_each


def tiny_state(step: int) -> dict:
    devs = jax.devices()[:NDEV]
    x = np.full((NDEV, 256), step, np.float32)  # 64 shards of 1 KiB, new contents every step
    return {"x": jax.device_put(x, NamedSharding(Mesh(np.array(devs), ("d",)), P("d"))), "step": step}


def _cpu(procs: list) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def fan_out(parent: Path, hosts: list[int], saves: int) -> list[dict]:
    """Per host count: saves and pings, each timed both ways in turn (the one-thread selector
    fan-out, ``inline``, and a thread per host, as before it), with the head's and the daemons'
    CPU time per save."""
    rows = []
    me = psutil.Process()
    for n in hosts:
        if NDEV % n:
            raise SystemExit(f"--hosts: {n} does not divide the head's {NDEV} devices")
        root = parent / f"fanout-{n}"
        t0 = time.perf_counter()
        with LocalCluster(root, 1, n, devices_per_host=NDEV // n) as cluster:
            startup = time.perf_counter() - t0
            daemons = [psutil.Process(pid) for pid in cluster.pids().values()]
            rss = statistics.median(p.memory_info().rss for p in daemons)
            cfg = MTCConfig(local_checkpoint_directory=str(root), cluster_spec=str(cluster.spec_path),
                            local_checkpoint_period=1)
            disp = ClusterDispatcher(cfg, jax.devices()[:NDEV])
            r: dict = {"n": n, "startup": startup, "rss": rss}
            with CheckpointManager(cfg, dispatcher=disp) as m:
                for step in range(3):  # warm: connections, version check, jit of nothing
                    m.save(step, tiny_state(step))
                    m.wait_until_finished()
                step = 3
                ways = {"inline": HostLanes.call_each.__get__(disp.lanes), "threads": thread_per_host(disp.lanes)}
                for _ in range(saves):
                    for mode in ways:
                        disp.lanes.call_each = ways[mode]
                        state = tiny_state(step)
                        # Timed alone: the background replication of the previous save would share the cores
                        # (64 daemons on this machine's few; on a cluster each host has its own).
                        m.wait_for_replication()
                        c_head, c_daemons = me.cpu_times(), _cpu(daemons)
                        t = time.perf_counter()
                        m.save(step, state)
                        m.wait_until_finished()
                        r.setdefault(mode + "_save", []).append(time.perf_counter() - t)
                        c1 = me.cpu_times()
                        r.setdefault(mode + "_head_cpu", []).append(c1.user + c1.system - c_head.user - c_head.system)
                        r.setdefault(mode + "_daemon_cpu", []).append(_cpu(daemons) - c_daemons)
                        r.setdefault(mode + "_p1", []).append(m.last_save_report.phase1_s)
                        r.setdefault(mode + "_p2", []).append(m.last_save_report.phase2_s)
                        step += 1
                for _ in range(saves):
                    for mode in ways:
                        disp.lanes.call_each = ways[mode]
                        t = time.perf_counter()
                        _, failures = disp.lanes.call_each("ping")
                        r.setdefault(mode + "_ping", []).append(time.perf_counter() - t)
                        if failures:
                            raise SystemExit(f"ping failed: {failures}")
                    t = time.perf_counter()
                    for h in disp.hosts():
                        disp.lanes.call(h, "ping")
                    r.setdefault("serial_ping", []).append(time.perf_counter() - t)
                del disp.lanes.call_each  # the head's own again
                m.wait_for_replication()
                last = step - 1
            r.update(restores(cfg, last, saves))
        shutil.rmtree(root, ignore_errors=True)
        # CPU times tick in 10 ms: their mean; the times' median.
        rows.append({k: (statistics.fmean(v) if k.endswith("_cpu") else statistics.median(v)) if isinstance(v, list)
                     else v for k, v in r.items()})
    return rows


def restores(cfg: MTCConfig, step: int, repeats: int) -> dict:
    """A restarted head's restore of ``step``: onto the sharding that saved it (each host loads its own
    part) and onto the devices reversed (each host pulls the parts it reads from their writers, once:
    later restores find them held), planned from the manifest's header. Wall and head CPU per restore,
    and the shard rows the head parsed (none, on either path)."""
    from mtc.shared import format as fmt

    parsed = [0]
    real = fmt.PartColumns.from_json.__func__

    def counting(cls, data, **kw):
        part = real(cls, data, **kw)
        parsed[0] += len(part)
        return part

    fmt.PartColumns.from_json = classmethod(counting)
    me = psutil.Process()
    devs = jax.devices()[:NDEV]
    same = {"x": jax.ShapeDtypeStruct((NDEV, 256), np.float32, sharding=NamedSharding(Mesh(np.array(devs), ("d",)),
                                                                                         P("d"))), "step": 0}
    other = {"x": jax.ShapeDtypeStruct((NDEV, 256), np.float32,
                                       sharding=NamedSharding(Mesh(np.array(devs[::-1]), ("d",)), P("d"))), "step": 0}
    out: dict = {}
    try:
        with CheckpointManager(dataclasses.replace(cfg, prefetch_on_start=False),
                               dispatcher=ClusterDispatcher(cfg, devs)) as m:
            for name, target in (("same", same), ("other", other)):
                for _ in range(repeats):
                    c0, t = me.cpu_times(), time.perf_counter()
                    got = m.restore(step, target=target)
                    out.setdefault(f"restore_{name}", []).append(time.perf_counter() - t)
                    c1 = me.cpu_times()
                    out.setdefault(f"restore_{name}_cpu", []).append(c1.user + c1.system - c0.user - c0.system)
                    if not (np.asarray(got["x"]) == step).all():
                        raise SystemExit(f"restore of step {step} ({name}) is not what was saved")
    finally:
        fmt.PartColumns.from_json = classmethod(real)
    out["restore_rows"] = parsed[0]
    return out


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


def raw_loopback(data: np.ndarray, sink: np.ndarray | None = None) -> float:
    """Seconds to move ``data`` over a loopback TCP socket (sendall of 4 MiB views, recv_into a
    fresh buffer, as a restore must: its buffers become the restored arrays; or into ``sink``,
    a buffer touched before: the socket alone)."""
    nbytes = data.nbytes
    sink = np.empty_like(data) if sink is None else sink
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
           "cluster_restore": [], "colo_restore": [], "loopback": [],
           "loopback_touched": []}
    raw = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    croot, lroot = parent / "bytes-cluster", parent / "bytes-colocated"
    with LocalCluster(croot, 1, 4, devices_per_host=2) as cluster:
        # One step kept: this part holds the state several times over already (the shared machine's memory).
        ccfg = MTCConfig(local_checkpoint_directory=str(croot), cluster_spec=str(cluster.spec_path),
                         local_checkpoint_period=1, local_max_to_keep=1)
        lcfg = MTCConfig(local_checkpoint_directory=str(lroot), local_checkpoint_period=1, local_max_to_keep=1)
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
                    # The restore is timed alone: not against the background replication of this save.
                    m.wait_for_replication()
                    for suffix in ("_restore",):
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
                            res[name + suffix].append(restore)
                    if step:
                        res[name].append(total)
                        res[name + "_blocked"].append(blocked)
                if step:  # the physical limit, measured between the restores
                    sink = np.empty_like(raw)  # fresh: its pages are first touched by the copy
                    res["loopback"].append(raw_loopback(raw, sink))
                    res["loopback_touched"].append(raw_loopback(raw, sink))  # the same buffer again
                    del sink
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
    p.add_argument("--parts", default="fanout,bytes", help="which parts to run (comma-separated: fanout, bytes)")
    a = p.parse_args()
    parts = set(a.parts.split(","))
    if not parts or parts - {"fanout", "bytes"}:
        raise SystemExit(f"--parts: {a.parts!r}: name fanout, bytes or both (comma-separated)")
    if len(jax.devices()) < NDEV:
        raise SystemExit(f"needs {NDEV} CPU devices: run with XLA_FLAGS=--xla_force_host_platform_device_count={NDEV}")
    parent = Path(tempfile.mkdtemp(prefix="mtc-bench-cluster-", dir=a.dir))
    try:
        if "fanout" in parts:
            print_fan_out(fan_out(parent, [int(x) for x in a.hosts.split(",")], a.saves), a.saves)
        if "bytes" in parts:
            print_bytes(bytes_compare(parent, a.gib, a.repeats), a.repeats)
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def print_fan_out(rows: list[dict], saves: int) -> None:
    base = rows[0]
    print(f"\n## Head cost per save, tiny state ({NDEV} shards of 1 KiB), median of {saves} saves each way, "
          "interleaved\n")
    print("inline: every request sent from one thread, replies read as they come (a selector); threads: one "
          "pool thread per host (before). CPU: milliseconds of CPU per save, the head's process and all "
          "daemons together.\n")
    print("| hosts | daemon start-up (per host) | daemon RSS | save, inline | save, threads | threads / inline "
          "| per host, inline | phase 1 / phase 2, inline | head CPU inline / threads | daemons' CPU |"
          f" growth vs {base['n']} host(s) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['n']} | {r['startup'] / r['n'] * 1e3:.0f} ms | {r['rss'] / 2**20:.0f} MiB | "
              f"{r['inline_save'] * 1e3:.1f} ms | {r['threads_save'] * 1e3:.1f} ms | "
              f"{r['threads_save'] / r['inline_save']:.2f}x | {r['inline_save'] / r['n'] * 1e3:.2f} ms | "
              f"{r['inline_p1'] * 1e3:.1f} / {r['inline_p2'] * 1e3:.1f} ms | "
              f"{r['inline_head_cpu'] * 1e3:.1f} / {r['threads_head_cpu'] * 1e3:.1f} ms | "
              f"{r['inline_daemon_cpu'] * 1e3:.1f} ms | {r['inline_save'] / base['inline_save']:.2f}x |")
    print("\n| hosts | ping all: serial | threads | inline | serial / threads | serial / inline "
          "| per host: serial | threads | inline |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        n = r["n"]
        print(f"| {n} | {r['serial_ping'] * 1e3:.2f} ms | {r['threads_ping'] * 1e3:.2f} ms | "
              f"{r['inline_ping'] * 1e3:.2f} ms | {r['serial_ping'] / r['threads_ping']:.2f}x | "
              f"{r['serial_ping'] / r['inline_ping']:.2f}x | {r['serial_ping'] / n * 1e3:.3f} ms | "
              f"{r['threads_ping'] / n * 1e3:.3f} ms | {r['inline_ping'] / n * 1e3:.3f} ms |")
    print(f"\n| hosts | restore, same sharding | its head CPU | restore, devices reversed | its head CPU "
          f"| shard rows the head parsed | growth vs {base['n']} host(s), same / reversed |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['n']} | {r['restore_same'] * 1e3:.1f} ms | {r['restore_same_cpu'] * 1e3:.1f} ms | "
              f"{r['restore_other'] * 1e3:.1f} ms | {r['restore_other_cpu'] * 1e3:.1f} ms | {r['restore_rows']} | "
              f"{r['restore_same'] / base['restore_same']:.2f}x / {r['restore_other'] / base['restore_other']:.2f}x |")
    top = rows[-1]
    print(f"\nTarget: head time per save at 64 daemons <= 40 ms; at {top['n']}: {top['inline_save'] * 1e3:.1f} ms "
          f"({'holds' if top['n'] == 64 and top['inline_save'] <= 0.040 else 'missed or not measured at 64'}).")


def print_bytes(b: dict, repeats: int) -> None:
    gb = b["nbytes"] / 1e9
    med = {k: statistics.median(v) for k, v in b.items() if isinstance(v, list)}
    print(f"\n## {b['nbytes'] / (1 << 30):.2f} GiB: 4 daemons (cluster) vs 1 in-process host (colocated), "
          f"median of {repeats}\n")
    print("| what | seconds | GB/s |")
    print("|---|---:|---:|")
    for label, key in (("cluster save total", "cluster"), ("colocated save total", "colo"),
                       ("cluster save blocked", "cluster_blocked"), ("colocated save blocked", "colo_blocked"),
                       ("cluster restore (streamed, hashed by the head)", "cluster_restore"),
                       ("colocated restore", "colo_restore"),
                       ("raw loopback TCP copy of the same bytes, into a fresh buffer", "loopback"),
                       ("raw loopback TCP copy, into a buffer touched before (the socket alone)",
                        "loopback_touched")):
        print(f"| {label} | {med[key]:.3f} | {gb / med[key]:.2f} |")
    print("\n| ratio | value | target |")
    print("|---|---:|---:|")
    print(f"| cluster restore / raw loopback copy | {med['cluster_restore'] / med['loopback']:.2f} | <= 1.3 |")
    print(f"| cluster restore / raw loopback copy into a touched buffer | "
          f"{med['cluster_restore'] / med['loopback_touched']:.2f} | |")
    print(f"| cluster save total / colocated save total | {med['cluster'] / med['colo']:.2f} | |")
    print(f"| (cluster - colocated save) / raw loopback copy | {(med['cluster'] - med['colo']) / med['loopback']:.2f} | |")
    print(f"| cluster restore / colocated restore | {med['cluster_restore'] / med['colo_restore']:.2f} | |")
    spread = {k: (min(v) / med[k], max(v) / med[k]) for k, v in b.items() if isinstance(v, list) and v}
    print("\nSpread (min / median, max / median): " + ", ".join(
        f"{k} {lo:.2f}-{hi:.2f}" for k, (lo, hi) in spread.items()))


if __name__ == "__main__":
    main()
