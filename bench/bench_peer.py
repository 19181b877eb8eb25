"""The peer tier: fetch throughput between two sidecar daemons, and bytes moved by replication.

    python bench/bench_peer.py [--gib 1.0] [--repeats 3] [--state-mib 64] [--steps 3] [--dir /dev/shm]
                               [--huge-pages auto|no]

Part 1, fetch. One daemon holds --gib GiB of blobs (16 shards of one host's devices); the other
pulls all of them through the production path (the head's ``peer_pull`` -> the receiving
daemon's ``PeerClient``s, two connections -> the holder's ``PeerServer``: ``sendall`` from a map
of its ramdisk file; received into a temp blob (straight into a map of it on a huge-page
ramdisk), hashed as it arrives, published once it verifies).
Interleaved in the same run, --repeats times, the same bytes over raw loopback TCP sockets,
each the best of one and two streams (mtc uses two connections per holder, so the raw copy
gets them too): ``sendall`` of 4 MiB views into a preallocated buffer (the socket's physical
limit); the same from the ramdisk files with ``sendfile`` (what sending from this
ramdisk costs); and from ramdisk files into new ramdisk files (what any copy between two
ramdisks must also do: the receiver allocates fresh tmpfs pages). Medians; the ratios are
what to quote.
With ``--huge-pages auto`` (the default) and root, part 1 runs again on a private tmpfs mounted
``huge=within_size``, the ramdisk mtc recommends (``mtc.shared.ramdisk``): a tmpfs with 4 KiB
pages pays per-page kernel work on both ends that the memory-to-memory baseline does not.

Part 2, replication. Bytes that replication moves per saved step (replication_factor=2), for
(a) 2 slices x 2 hosts, data-parallel across slices: the twins are the copies, nothing moves;
(b) 1 slice x 4 hosts, the state sharded over all of them: every blob is copied once.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

if "jax" not in sys.modules:  # 8 CPU devices; must precede the first jax import
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import shutil  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from mtc.head import CheckpointManager, MTCConfig  # noqa: E402
from mtc.shared.hashing import blob_name  # noqa: E402
from mtc.sidecar.local_cluster import LocalCluster  # noqa: E402

NDEV = 8
_CHUNK = 4 << 20


def _random(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1 << 32, size=nbytes // 4, dtype=np.uint32).view(np.float32)


# --- raw baselines ---------------------------------------------------------------------------------

# The sender of a raw copy runs in its own process, like the holder's daemon: two threads of one
# Python process would take turns on its interpreter lock and understate the raw rate.
_SENDER = r"""
import os, socket, sys
import numpy as np
mode, port, files = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
if mode == "mem":  # the bytes in memory first, touched, as a training process would have them
    data = np.concatenate([np.fromfile(f, np.uint8) for f in files])
with socket.create_connection(("127.0.0.1", port)) as s:
    if mode == "mem":
        mv = memoryview(data)
        for off in range(0, len(data), 4 << 20):
            s.sendall(mv[off:off + (4 << 20)])
    else:
        for f in files:
            with open(f, "rb") as fh:
                s.sendfile(fh, 0, os.fstat(fh.fileno()).st_size)
"""


def raw_copy(files: list[Path], send: str, recv: str, streams: int = 1, sink: np.ndarray | None = None,
             out_dir: Path | None = None) -> float:
    """Seconds to move ``files``' bytes over loopback TCP, on ``streams`` connections at once.

    Each stream has its own sender process (a share of the files) and its own receiving thread.
    ``send="mem"``: the senders ``sendall`` from their memory (4 MiB views, loaded before the
    clock starts); ``send="file"``: they ``sendfile`` the ramdisk files, like a peer server.
    ``recv="mem"``: the receivers ``recv_into`` their part of ``sink``, a preallocated, touched
    buffer; ``recv="file"``: they write new files in ``out_dir`` (``recv_into`` 4 MiB + ``write``).
    mem -> mem is the socket's physical limit; file -> file is a plain copy between
    two ramdisks.
    """
    shares = [files[k::streams] for k in range(streams)]
    srv = socket.create_server(("127.0.0.1", 0))
    port = str(srv.getsockname()[1])
    senders = []
    conns: list[socket.socket] = []
    try:
        for share in shares:  # accepted in order: connection k carries share k
            senders.append(subprocess.Popen([sys.executable, "-c", _SENDER, send, port, *map(str, share)]))
            conns.append(srv.accept()[0])
        views, off = [], 0
        if recv == "mem":
            whole = memoryview(sink.view(np.uint8))
            for share in shares:
                n = sum(f.stat().st_size for f in share)
                views.append(whole[off:off + n])
                off += n

        def receive(k: int) -> None:
            conn = conns[k]
            if recv == "mem":
                view, got = views[k], 0
                while got < len(view):
                    got += conn.recv_into(view[got:], len(view) - got)
                return
            buf = memoryview(bytearray(_CHUNK))
            for i, f in enumerate(shares[k]):
                n, got = f.stat().st_size, 0
                fd = os.open(out_dir / f"copy-{k}-{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                while got < n:
                    m = conn.recv_into(buf, min(_CHUNK, n - got))
                    w = 0
                    while w < m:
                        w += os.write(fd, buf[w:m])
                    got += m
                os.close(fd)

        threads = [threading.Thread(target=receive, args=(k,)) for k in range(streams)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        dt = time.perf_counter() - t0
    finally:
        for c in conns:
            c.close()
        srv.close()
        for p in senders:
            p.wait(timeout=60)
    if out_dir is not None:
        for p in out_dir.glob("copy-*"):
            p.unlink()
    return dt


def best_raw(files: list[Path], send: str, recv: str, **kw) -> float:
    """The faster of one and two streams: the raw copy gets the connections mtc uses (two per holder)."""
    return min(raw_copy(files, send, recv, streams=k, **kw) for k in (1, 2))


# --- part 1: fetch between two daemons --------------------------------------------------------------


def fetch(parent: Path, gib: float, repeats: int) -> dict:
    devs = jax.devices()[:NDEV]
    holder_devs = devs[:4]  # the first host's devices: it holds every blob
    mesh = Mesh(np.array(holder_devs), ("d",))
    per_array = int(gib * (1 << 30)) // 4
    per_array -= per_array % (4 * 4 * 4096)
    state = {f"a{i}": jax.device_put(_random(per_array, i), NamedSharding(mesh, P("d"))) for i in range(4)}
    nbytes = sum(x.nbytes for x in state.values())
    root = parent / "fetch"
    res: dict = {"nbytes": nbytes, "peer": [], "peer_steady": [], "raw": [], "raw1": [], "raw_send": [], "raw_file": [],
                 "blobs": 0}
    with LocalCluster(root, 1, 2, devices_per_host=4) as cluster:
        cfg = MTCConfig(local_checkpoint_directory=str(root), cluster_spec=str(cluster.spec_path),
                        local_checkpoint_period=1, replication_factor=1)
        with CheckpointManager(cfg) as m:
            m.save(1, state)
            m.wait_until_finished()
            manifest = m._dispatch.manifest(1)
            holder, receiver = cluster.hosts
            sizes = manifest.blob_sizes()
            rows = [(b, n, [holder]) for b, n in sorted(sizes.items())]
            res["blobs"] = len(rows)
            files = [cluster.store_root(holder) / "blobs" / b for b in sorted(sizes)]
            scratch = parent / "raw"
            scratch.mkdir()
            sink = np.zeros(nbytes, np.uint8)  # preallocated and touched: the socket's limit, not page faults
            m._dispatch.peer_inventories()  # connect the peer lanes: learn every peer address
            for r in range(repeats + 1):  # the first round warms up and is not counted
                for p in (cluster.store_root(receiver) / "blobs").iterdir():
                    if p.name in sizes:
                        p.unlink()
                t0 = time.perf_counter()
                out = m._dispatch.peer_pull(1, {receiver: rows})[receiver]
                dt = time.perf_counter() - t0
                if out.error or out.failed or out.pulled_bytes != nbytes:
                    raise SystemExit(f"peer fetch failed: {out}")
                raw1 = raw_copy(files, "mem", "mem", streams=1, sink=sink)
                raw = min(raw1, raw_copy(files, "mem", "mem", streams=2, sink=sink))
                raw_send = best_raw(files, "file", "mem", sink=sink)
                raw_file = best_raw(files, "file", "file", out_dir=scratch)
                if r:
                    res["peer"].append(dt)
                    res["raw"].append(raw)
                    res["raw1"].append(raw1)
                    res["raw_send"].append(raw_send)
                    res["raw_file"].append(raw_file)
            # Verified on arrival; check once more from the outside that the bytes are the holder's.
            for b in sorted(sizes)[:2]:
                if blob_name((cluster.store_root(receiver) / "blobs" / b).read_bytes()) != b:
                    raise SystemExit(f"fetched blob {b} does not verify")
            # Steady state of replication: every round saves a new step; committing it prunes the
            # oldest kept one on both hosts (local_max_to_keep=2, the default), whose files go to
            # the free pools, and the receiver's pull then overwrites recycled pages instead of
            # allocating new ones.
            m2_cfg = cfg.replace(local_max_to_keep=2)
            with CheckpointManager(m2_cfg) as m2:
                m2._dispatch.peer_inventories()
                for r in range(repeats + 3):  # three rounds to fill the receiver's pool
                    step = 100 + r
                    m2.save(step, {k: v + 1.0 + r for k, v in state.items()})
                    m2.wait_until_finished()
                    sizes2 = m2._dispatch.manifest(step).blob_sizes()
                    rows2 = [(b, n, [holder]) for b, n in sorted(sizes2.items())]
                    t0 = time.perf_counter()
                    out = m2._dispatch.peer_pull(step, {receiver: rows2})[receiver]
                    dt = time.perf_counter() - t0
                    if out.error or out.failed:
                        raise SystemExit(f"peer fetch failed: {out}")
                    if r >= 3:
                        res["peer_steady"].append(dt * nbytes / max(1, out.pulled_bytes))
    shutil.rmtree(root, ignore_errors=True)
    return res


# --- part 2: bytes moved by replication ---------------------------------------------------------------


def replication(parent: Path, state_mib: int, steps: int) -> list[dict]:
    devs = jax.devices()[:NDEV]
    n = state_mib * (1 << 20) // 4
    n -= n % (NDEV * 1024)
    rows = []
    layouts = (
        ("2 slices x 2 hosts, data-parallel across slices", 2, 2, Mesh(np.array(devs).reshape(2, 4), ("data", "model")),
         P(None, "model")),
        ("1 slice x 4 hosts, sharded over all", 1, 4, Mesh(np.array(devs), ("model",)), P("model")),
    )
    for label, slices, hosts, mesh, spec in layouts:
        root = parent / f"repl-{slices}x{hosts}"
        with LocalCluster(root, slices, hosts, devices_per_host=NDEV // (slices * hosts)) as cluster:
            cfg = MTCConfig(local_checkpoint_directory=str(root), cluster_spec=str(cluster.spec_path),
                            local_checkpoint_period=1, replication_factor=2)
            moved, seconds, state_bytes = [], [], 0
            with CheckpointManager(cfg) as m:
                for step in range(steps):
                    x = _random(n * 4, 100 + step).reshape(-1, 1024)
                    state = {"x": jax.device_put(x, NamedSharding(mesh, spec)), "step": step}
                    state_bytes = x.nbytes
                    m.save(step, state)
                    m.wait_until_finished()
                    rep = m.wait_for_replication()
                    if not (rep.complete and rep.replicated):
                        raise SystemExit(f"{label}: replication of step {step} incomplete: {rep}")
                    moved.append(rep.moved_bytes)
                    seconds.append(rep.seconds)
        shutil.rmtree(root, ignore_errors=True)
        rows.append({"label": label, "state": state_bytes, "moved": moved, "seconds": statistics.median(seconds)})
    return rows


@contextlib.contextmanager
def huge_page_tmpfs(gib: float):
    """A private tmpfs mounted with ``huge=within_size`` (2 MiB pages), or None and why not."""
    mnt = Path(tempfile.mkdtemp(prefix="mtc-bench-huge-"))
    size_mib = int((6 * gib + 1) * 1024)  # a limit, not a reservation: holder + receiver + scratch + pools
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,huge=within_size,mode=0700", "tmpfs",
                        str(mnt)], capture_output=True, text=True)
    if r.returncode:
        mnt.rmdir()
        yield None, (r.stderr.strip() or f"mount exited {r.returncode}")
        return
    try:
        yield mnt, ""
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        mnt.rmdir()


def print_fetch(label: str, f: dict, repeats: int) -> None:
    gb = f["nbytes"] / 1e9
    med = {k: statistics.median(f[k]) for k in ("peer", "peer_steady", "raw", "raw1", "raw_send", "raw_file")}
    print(f"\n## Fetch of {f['nbytes'] / (1 << 30):.2f} GiB ({f['blobs']} blobs) between two daemons, {label}, "
          f"median of {repeats} (os.cpu_count()={os.cpu_count()})\n")
    print("| what | seconds | GB/s |")
    print("|---|---:|---:|")
    print(f"| mtc peer fetch: mapped send -> recv into a map (huge pages) or recv + write, hashed, verified "
          f"(2 streams) | {med['peer']:.3f} | "
          f"{gb / med['peer']:.2f} |")
    print(f"| mtc peer fetch, steady state (receiver overwrites recycled ramdisk pages) | "
          f"{med['peer_steady']:.3f} | {gb / med['peer_steady']:.2f} |")
    print(f"| raw loopback TCP copy, memory -> preallocated memory, one stream (the physical limit) | "
          f"{med['raw1']:.3f} | {gb / med['raw1']:.2f} |")
    print(f"| raw loopback TCP copy, memory -> preallocated memory (best of 1 and 2 streams) | {med['raw']:.3f} | "
          f"{gb / med['raw']:.2f} |")
    print(f"| raw loopback TCP copy, ramdisk file (sendfile) -> preallocated memory (best of 1, 2) | "
          f"{med['raw_send']:.3f} | {gb / med['raw_send']:.2f} |")
    print(f"| raw loopback TCP copy, ramdisk file -> new ramdisk file (best of 1, 2) | {med['raw_file']:.3f} | "
          f"{gb / med['raw_file']:.2f} |")
    print("\n| check | measured | target | result |")
    print("|---|---:|---:|---|")
    for what, key, base in (("peer fetch rate / raw loopback copy rate (memory -> memory, one stream)", "peer", "raw1"),
                            ("peer fetch rate / raw loopback copy rate (memory -> memory, best of 1 and 2 streams)",
                             "peer", "raw"),
                            ("steady-state peer fetch rate / raw loopback copy rate (memory -> memory)",
                             "peer_steady", "raw"),
                            ("peer fetch rate / raw loopback copy rate (ramdisk file -> new ramdisk file)",
                             "peer", "raw_file")):
        ratio = med[base] / med[key]
        print(f"| {what} | {ratio:.2f}x | >= 0.8x | {'ok' if ratio >= 0.8 else 'below'} |")
    print(f"| (info) ramdisk sendfile -> memory / memory -> memory: what sending from this ramdisk costs | "
          f"{med['raw'] / med['raw_send']:.2f}x | | |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--state-mib", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    p.add_argument("--huge-pages", choices=("auto", "no"), default="auto",
                   help="also run the fetch on a private tmpfs mounted huge=within_size (needs root)")
    a = p.parse_args()
    if len(jax.devices()) < NDEV:
        raise SystemExit(f"needs {NDEV} CPU devices: run with XLA_FLAGS=--xla_force_host_platform_device_count={NDEV}")
    parent = Path(tempfile.mkdtemp(prefix="mtc-bench-peer-", dir=a.dir))
    try:
        print_fetch(f"ramdisk {a.dir or tempfile.gettempdir()}", fetch(parent, a.gib, a.repeats), a.repeats)
        if a.huge_pages == "auto":
            with huge_page_tmpfs(a.gib) as (mnt, why):
                if mnt is None:
                    print(f"\n(no huge-page tmpfs run: {why})")
                else:
                    print_fetch("ramdisk = tmpfs mounted huge=within_size", fetch(mnt, a.gib, a.repeats), a.repeats)
        rows = replication(parent, a.state_mib, a.steps)
        print(f"\n## Bytes moved by replication (replication_factor=2), {a.steps} saved steps each\n")
        print("| layout | state per step | moved per step (each step) | moved / state | replication time (median) |")
        print("|---|---:|---:|---:|---:|")
        for r in rows:
            per = ", ".join(f"{x / 2**20:.1f} MiB" for x in r["moved"])
            print(f"| {r['label']} | {r['state'] / 2**20:.1f} MiB | {per} | "
                  f"{statistics.median(r['moved']) / r['state']:.2f} | {r['seconds'] * 1e3:.0f} ms |")
    finally:
        shutil.rmtree(parent, ignore_errors=True)


if __name__ == "__main__":
    main()
