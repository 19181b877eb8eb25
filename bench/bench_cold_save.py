"""Cold saves after the process freed memory: each save's blocked time against a raw writer, one run.

    python bench/bench_cold_save.py [--gib 1] [--saves 6] [--pause 5] [--no-preamble]

Two parts, each in this process after the same preamble and on a fresh ramdisk (a private tmpfs
when run as root, else a new folder under --dir):

- the preamble: write and free memory as a training process may before its first checkpoint:
  --files files of 1 GiB on a tmpfs, written and removed, then --copies numpy copies of 1 GiB,
  made and dropped (``malloc_trim``: their pages go back to the kernel), then --pause seconds;
- mtc: --saves saves of the state (8 float32 arrays of --gib/8 GiB, each sharded by rows over 8
  CPU devices) in colocated mode, ``local_max_to_keep=2``, each save waited for before the next
  (``--back-to-back``: not waited for), every one with new contents; per save: the time ``save()`` blocked, the CPU seconds of this
  process meanwhile (every thread: below the blocked time x threads, the rest was waiting), the
  blocked part split (``reserve``: the landings made or taken from the pool and mapped; ``copy``:
  the copies into warm maps and the cold fills, each fill's seconds), this process's minor page
  faults, the machine's newly allocated pages (``/proc/vmstat`` pgalloc_*), the free memory the
  guest reported to its host meanwhile (where the kernel counts it) and any slow path the kernel
  took (direct reclaim, compaction, huge page faults, major faults: printed under the table);
- raw: --saves writes of the same bytes (one file per shard, on as many threads as the save's
  staging uses): the first three into new files, kept, as the ramdisk keeps its first steps (two
  kept, one written); each later one over the files of the oldest, as a save lands in the pool;
  with --raw-timeline at the mtc part's pace.

Saves 1-3 land every shard in new files (cold fills: ``pwrite``, the kernel allocates the pages);
from save 4 on, in the files of the pruned step (warm maps: one memcpy; a file whose map the
background warmer has not filled in yet is filled cold). ``--marks`` prints each save's blocked span
in CLOCK_MONOTONIC seconds, to cut a ``perf record -k CLOCK_MONOTONIC -e sched:sched_switch -g``
of the run by (on- and off-CPU time per thread and kernel stack).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import time

if "jax" not in sys.modules:  # 8 CPU devices; must precede the first jax import
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np

GiB = 1 << 30
N_DEVICES = 8
N_ARRAYS = 8
KEEP = 2


def vmstat() -> dict[str, int]:
    out = {}
    with open("/proc/vmstat") as f:
        for line in f:
            k, v = line.split()
            out[k] = int(v)
    return out


def minflt() -> int:
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


REPORTED = "/sys/module/page_reporting/parameters/reported_kib"  # where the kernel counts it


def reported_kib() -> int:
    """KiB of free memory the guest has reported to its host so far (0 where not counted)."""
    try:
        with open(REPORTED) as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


class Cost:
    """What a timed block cost: seconds, CPU seconds of this process (every thread), its minor
    faults, pages the machine allocated, KiB the guest reported free to its host meanwhile."""

    def __enter__(self) -> "Cost":
        self.v0, self.f0, self.r0 = vmstat(), minflt(), reported_kib()
        self.c0, self.t0 = _cpu(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.s = time.perf_counter() - self.t0
        self.cpu = _cpu() - self.c0
        self.faults = minflt() - self.f0
        v1 = vmstat()
        self.alloc = sum(v1[k] - self.v0.get(k, 0) for k in v1 if k.startswith("pgalloc_"))
        self.reported = reported_kib() - self.r0
        # the kernel's slow paths an allocation may take: direct reclaim, compaction, huge pages
        self.slow = {k: v1[k] - self.v0.get(k, 0) for k in v1
                     if k.startswith(("allocstall", "pgscan_direct", "compact_stall", "thp_fault_", "pgmajfault"))
                     and v1[k] != self.v0.get(k, 0)}


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


class Phases:
    """The blocked part of a colocated save, split: ``reserve`` (the landings: files taken or made,
    mapped) and ``copy`` (the copies and cold fills), each fill's seconds; timed by wrapping the
    two calls (nothing else changes)."""

    def __init__(self):
        from mtc.head.dispatch import colocated, staging

        self.rows: list[dict] = []
        self.now: dict = {}
        hb, ca = colocated.ColocatedDispatcher._host_buffers, staging.HostStaging.copy_all
        me = self

        def host_buffers(self_, wants):
            t0 = time.perf_counter()
            try:
                return hb(self_, wants)
            finally:
                me.now["reserve"] = me.now.get("reserve", 0.0) + time.perf_counter() - t0

        def copy_all(self_, copies, fills=None):
            timed = None
            if fills is not None:
                def wrap(f):
                    if f is None:
                        return None

                    def g(src):
                        t0 = time.perf_counter()
                        try:
                            return f(src)
                        finally:
                            me.now.setdefault("fills", []).append(time.perf_counter() - t0)
                    return g
                timed = [wrap(f) for f in fills]
            t0 = time.perf_counter()
            try:
                return ca(self_, copies, timed)
            finally:
                me.now["copy"] = me.now.get("copy", 0.0) + time.perf_counter() - t0

        colocated.ColocatedDispatcher._host_buffers = host_buffers
        staging.HostStaging.copy_all = copy_all

    def take(self) -> dict:
        out, self.now = self.now, {}
        return out


def malloc_trim() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def preamble(tmp_root: str, files: int, copies: int, pause: float, like: np.ndarray) -> None:
    d = tempfile.mkdtemp(prefix="preamble-", dir=tmp_root)
    chunk = np.random.default_rng(7).integers(0, 256, 64 << 20, dtype=np.uint8)
    try:
        for i in range(files):
            fd = os.open(os.path.join(d, f"f{i}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                for _ in range(GiB // chunk.nbytes):
                    os.write(fd, chunk)
            finally:
                os.close(fd)
    finally:
        shutil.rmtree(d)
    for _ in range(copies):
        c = np.copy(like)
        del c
        gc.collect()
        malloc_trim()
    time.sleep(pause)


@contextlib.contextmanager
def ramdisk(parent: str, size_bytes: int):
    """A fresh ramdisk: a private tmpfs mount (root), else a new folder under ``parent``."""
    d = tempfile.mkdtemp(prefix="mtc-cold-", dir=parent)
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes >> 20}m,mode=0700", "tmpfs", d],
        capture_output=True).returncode == 0
    try:
        yield d, ("a private tmpfs" if mounted else f"a folder under {parent}")
    finally:
        if mounted and subprocess.run(["umount", d], capture_output=True).returncode:
            subprocess.run(["umount", "-l", d], check=False)
        shutil.rmtree(d, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="state size (default 1)")
    p.add_argument("--saves", type=int, default=6)
    p.add_argument("--files", type=int, default=3, help="preamble: 1 GiB tmpfs files written and removed")
    p.add_argument("--copies", type=int, default=3, help="preamble: 1 GiB numpy copies made and dropped")
    p.add_argument("--pause", type=float, default=5.0, help="preamble: seconds to wait after the frees")
    p.add_argument("--no-preamble", action="store_true", help="the control: no frees, no pause")
    p.add_argument("--dir", default="/dev/shm", help="tmpfs for the preamble's files (and the ramdisks without root)")
    p.add_argument("--parts", default="mtc,raw", help="which parts, in order (default mtc,raw)")
    p.add_argument("--marks", action="store_true",
                   help="print each save's blocked span in CLOCK_MONOTONIC seconds (to cut a perf record by)")
    p.add_argument("--back-to-back", action="store_true",
                   help="each save right after the last one returned (not waited for: it may wait in the next)")
    p.add_argument("--raw-timeline", action="store_true",
                   help="raw writes at the mtc part's pace (each starts as long after the last as the save did)")
    a = p.parse_args(argv)
    parts = a.parts.split(",")
    if set(parts) - {"mtc", "raw"} or not parts:
        p.error(f"--parts: mtc and/or raw, comma-separated (got {a.parts!r})")
    if a.gib <= 0 or a.saves < 1:
        p.error("--gib must be above 0 and --saves at least 1")

    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from mtc.head import CheckpointManager, MTCConfig
    from mtc.head.dispatch import staging

    if len(jax.devices()) < N_DEVICES:
        sys.exit(f"needs {N_DEVICES} CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    per = int(a.gib * GiB) // N_ARRAYS
    rows = per // 4 // 1024 // N_DEVICES * N_DEVICES
    shape = (rows, 1024)
    nbytes = N_ARRAYS * rows * 1024 * 4
    mesh = Mesh(np.array(jax.devices()[:N_DEVICES]), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    rng = np.random.default_rng(0)
    base = [rng.integers(0, 1 << 32, shape, dtype=np.uint32).view(np.float32) for _ in range(N_ARRAYS)]
    like = np.empty(GiB, np.uint8)  # the preamble's copies are of this (touched once, then kept)
    like.fill(1)

    def state_of(k: int) -> dict:
        """New contents per save (every word changes), as device arrays."""
        return {f"a{i}": jax.device_put((b.view(np.uint32) ^ np.uint32(k * 0x9E3779B1 & 0xFFFFFFFF)).view(np.float32),
                                        sharding) for i, b in enumerate(base)}

    pre = "none" if a.no_preamble else f"{a.files} x 1 GiB files, {a.copies} x 1 GiB copies, {a.pause:g} s"
    print(f"state: {N_ARRAYS} arrays of {per / 2**20:.0f} MiB ({nbytes / GiB:.2f} GiB) on {N_DEVICES} CPU devices; "
          f"preamble: {pre}")
    with contextlib.suppress(OSError), open("/proc/cmdline") as f:
        hint = [w for w in f.read().split() if w.startswith(("page_reporting", "init_on_"))]
        if hint:
            print(f"kernel: {' '.join(hint)}")
    room = (KEEP + 2) * nbytes + GiB
    results: dict[str, list] = {}
    starts: list[float] = []  # when each mtc save began
    for part in parts:
        gc.collect()
        malloc_trim()
        with ramdisk(a.dir, room) as (root, what):
            if not a.no_preamble:
                preamble(a.dir, a.files, a.copies, a.pause, like)
            rows_out = results[part] = []
            if part == "mtc":
                phases = Phases()
                mgr = CheckpointManager(MTCConfig(local_checkpoint_directory=root, local_checkpoint_period=1,
                                                  local_max_to_keep=KEEP))
                mgr.latest_step()  # a run starts so: the sidecar is up before the first save
                for k in range(1, a.saves + 1):
                    st = state_of(k)
                    jax.block_until_ready(st)
                    gc.collect()
                    starts.append(time.perf_counter())
                    m0 = time.monotonic()
                    with Cost() as c:
                        mgr.save(k, st, force=True)
                    if a.marks:
                        print(f"mark save {k} {m0:.6f} {time.monotonic():.6f}", flush=True)
                    c.phases = phases.take()
                    if not a.back_to_back:
                        mgr.wait_until_finished()
                    rows_out.append((c, None if a.back_to_back else mgr.last_save_report))
                    del st
                mgr.wait_until_finished()
                mgr.close()
            else:
                threads = staging._THREADS
                from concurrent.futures import ThreadPoolExecutor

                with ThreadPoolExecutor(threads) as pool:
                    t_prev = None
                    for k in range(1, a.saves + 1):
                        st = state_of(k)
                        shards = [np.asarray(s.data) for key in sorted(st) for s in st[key].addressable_shards]
                        d = os.path.join(root, f"raw-{k}")
                        if k > KEEP + 1:  # as the saves from then on: into the files of the oldest kept
                            os.rename(os.path.join(root, f"raw-{k - KEEP - 1}"), d)
                            flags = 0
                        else:
                            os.mkdir(d)
                            flags = os.O_CREAT | os.O_EXCL

                        def one(i: int) -> None:
                            mv = memoryview(shards[i].reshape(-1).view(np.uint8))
                            fd = os.open(os.path.join(d, f"s{i}"), os.O_WRONLY | flags, 0o600)
                            try:
                                off = 0
                                while off < mv.nbytes:
                                    off += os.write(fd, mv[off:off + (8 << 20)])
                            finally:
                                os.close(fd)

                        gc.collect()
                        if t_prev is not None and len(starts) >= k and a.raw_timeline:
                            # the mtc part's pace: this write starts as long after the last as the save did
                            time.sleep(max(0.0, t_prev + starts[k - 1] - starts[k - 2] - time.perf_counter()))
                        t_prev = time.perf_counter()
                        with Cost() as c:
                            list(pool.map(one, range(len(shards))))
                        rows_out.append((c, None))
                        del st, shards
        print(f"  {part}: on {what}", flush=True)

    gib = nbytes / GiB
    print()
    print("| save | mtc blocked s | cpu s | reserve s | copy s | fills s (min-max) | minor faults | pages allocated | "
          "reported MiB | total s | raw s/GiB | raw cpu s | raw pages allocated | raw reported MiB |")
    print("|" + "---|" * 14)
    for i in range(a.saves):
        m = results.get("mtc", [None] * a.saves)[i]
        r = results.get("raw", [None] * a.saves)[i]
        cells = [str(i + 1)]
        if m is not None:
            c, rep = m
            ph = c.phases
            fills = ph.get("fills", [])
            cells += [f"{c.s:.3f}", f"{c.cpu:.2f}", f"{ph.get('reserve', 0):.3f}", f"{ph.get('copy', 0):.3f}",
                      f"{len(fills)}: {min(fills):.3f}-{max(fills):.3f}" if fills else "0", str(c.faults),
                      str(c.alloc), f"{c.reported / 1024:.0f}", f"{rep.total_s:.3f}" if rep else "-"]
        else:
            cells += ["-"] * 9
        if r is not None:
            c, _ = r
            cells += [f"{c.s / gib:.3f}", f"{c.cpu:.2f}", str(c.alloc), f"{c.reported / 1024:.0f}"]
        else:
            cells += ["-"] * 4
        print("| " + " | ".join(cells) + " |")
    for part in parts:
        for i, (c, _) in enumerate(results[part]):
            if c.slow:
                print(f"{part} save {i + 1}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.slow.items())))
    print(f"\npages: {os.sysconf('SC_PAGE_SIZE')} bytes; {gib:.2f} GiB is {int(nbytes // os.sysconf('SC_PAGE_SIZE'))} "
          "pages. A save whose minor faults are near that count wrote through a map page by page.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
