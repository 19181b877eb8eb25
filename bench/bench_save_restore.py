"""Save/restore benchmark: mtc against the physical limits and Orbax, in one run.

    python bench/bench_save_restore.py [--gib 1.0] [--repeats 3] [--dir /dev/shm]

State: 8 float32 arrays of random data totalling --gib GiB, each sharded by rows over 8 CPU
devices (NamedSharding). Everything is written to a fresh subdirectory of --dir (a tmpfs,
/dev/shm by default) that is removed at the end. Every timed save goes to a new step with
changed contents (the state is XORed with a new per-repeat constant: every word changes and
the entropy stays that of the random data), so content-addressed dedupe cannot skip writing;
a save of unchanged state is measured separately.

Measured, interleaved per repeat so that a noisy machine hits every contender alike, and
reported as medians of --repeats:
- raw write: the staged shard bytes written with os.write into fresh files in the same tmpfs,
  one file per shard (1 thread, and one thread per core): the physical limit for a save;
- raw read: those files read with readinto into preallocated buffers: the limit for restore;
- memcpy: one np.copyto of every shard into preallocated host buffers: the limit for the part
  of save that blocks the caller;
- mtc: save() (blocked), save() + wait_until_finished() (total), restore() into a target of
  ShapeDtypeStructs with the saved shardings (block_until_ready included), checked bit for bit;
  in steady state: after the first save and the local_max_to_keep saves that grow the ramdisk
  (reported on their own), so that each timed save rewrites a pruned step's files as in training;
- Orbax StandardCheckpointer (default: zarr3 + zstd) and PyTreeCheckpointer with
  use_compression=False, fresh directory per repeat, restored into the same abstract target;
- peak resident memory during each mtc save above the resident memory just before it
  (VmHWM reset through /proc/self/clear_refs; a 2 ms sampler thread where that is refused).

Times are ratios measured in one run: quote those, not absolute seconds (FACTS.md).
"""

from __future__ import annotations

import argparse
import os
import sys

if "jax" not in sys.modules:  # 8 CPU devices; must precede the first jax import
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import contextlib
import gc
import logging
import platform
import shutil
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata

import numpy as np

N_ARRAYS = 8
KEEP = 2  # local_max_to_keep of the mtc runs
N_DEVICES = 8
COLS = 1024
GB = 1e9
GiB = 1 << 30

# Targets (issue 2, "Benchmark").
T_SAVE_VS_RAW = 1.25
T_RESTORE_VS_RAW = 1.25
T_VS_ORBAX_DEFAULT = 0.5
T_VS_ORBAX_RAW = 0.8
T_BLOCKED_OVER_MEMCPY_MS = 20.0
T_PEAK_RSS = 1.10
T_PEAK_RSS_STEADY = 0.10


# --- small helpers ---------------------------------------------------------------------------


def _proc_status(field: str) -> int:
    """A kB field of /proc/self/status, in bytes."""
    with open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(field.encode() + b":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def rss() -> int:
    return _proc_status("VmRSS")


class PeakRSS:
    """Peak resident memory inside a `with` block, above the resident memory at its start.

    Uses the kernel's high-water mark (VmHWM, reset by writing 5 to /proc/self/clear_refs):
    exact and free. Where the reset is refused, a thread samples VmRSS every 2 ms.
    """

    def __init__(self, trim: bool = True):
        self.trim = trim
        self.base = self.peak = 0
        self._mode = "hwm"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "PeakRSS":
        _settle()
        if self.trim:
            _malloc_trim()  # freed heap memory handed back, so reusing it shows as an increase
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._mode = "hwm"
        except OSError:
            self._mode = "sampler"
        self.base = rss()
        self.peak = self.base
        if self._mode == "sampler":
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        fd = os.open("/proc/self/statm", os.O_RDONLY)
        page = os.sysconf("SC_PAGE_SIZE")
        try:
            while not self._stop.wait(0.002):
                self.peak = max(self.peak, int(os.pread(fd, 128, 0).split()[1]) * page)
        finally:
            os.close(fd)

    def __exit__(self, *exc) -> None:
        if self._mode == "hwm":
            self.peak = max(self.peak, _proc_status("VmHWM"))
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, rss())

    @property
    def increase(self) -> int:
        return self.peak - self.base


def _settle() -> None:
    """Before every timed operation: collect garbage, so no contender pays for another's."""
    gc.collect()


def _malloc_trim() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def version_of(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def mem_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def mem_available() -> int:
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def fs_type(path: str) -> str:
    best, kind = "", "?"
    real = os.path.realpath(path)
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mnt = parts[1]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, parts[2]
    return kind


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


# --- raw I/O (the physical limits) ---------------------------------------------------------------


def _write_file(path: str, buf: np.ndarray) -> None:
    mv = memoryview(buf.reshape(-1).view(np.uint8))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        off, n = 0, mv.nbytes
        while off < n:
            off += os.write(fd, mv[off:off + (64 << 20)])
    finally:
        os.close(fd)


def _read_file(path: str, buf: np.ndarray, hash_it: bool = False) -> None:
    mv = memoryview(buf.reshape(-1).view(np.uint8))
    hasher = None
    if hash_it:
        import xxhash
        hasher = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        off, n = 0, mv.nbytes
        while off < n:
            got = f.readinto(mv[off:off + (4 << 20)])
            if not got:
                raise RuntimeError(f"{path}: short read at {off} of {n}")
            if hasher is not None:
                hasher.update(mv[off:off + got])
            off += got
    if hasher is not None:
        hasher.hexdigest()


def raw_write(dirpath: str, bufs: list[np.ndarray], threads: int, hash_it: bool = False) -> float:
    os.makedirs(dirpath)
    paths = [os.path.join(dirpath, f"shard{i:04d}") for i in range(len(bufs))]

    def one(i: int) -> None:
        if hash_it:
            import xxhash
            xxhash.xxh3_128_hexdigest(memoryview(bufs[i].reshape(-1).view(np.uint8)))
        _write_file(paths[i], bufs[i])

    t0 = time.perf_counter()
    if threads <= 1:
        for i in range(len(bufs)):
            one(i)
    else:
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(one, range(len(bufs))))
    return time.perf_counter() - t0


def raw_read_fresh(dirpath: str, like: list[np.ndarray], threads: int) -> float:
    """Read the files into newly allocated buffers: what a restore that allocates its result
    pays (first-touch page faults on top of the read). The buffers are allocated in the
    calling thread (glibc gives worker threads their own arenas, which changes the result)."""
    t0 = time.perf_counter()
    bufs = [np.empty_like(b) for b in like]
    paths = [os.path.join(dirpath, f"shard{i:04d}") for i in range(len(like))]
    if threads <= 1:
        for p, b in zip(paths, bufs):
            _read_file(p, b)
    else:
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(lambda pb: _read_file(pb[0], pb[1]), zip(paths, bufs)))
    dt = time.perf_counter() - t0
    del bufs
    return dt


def raw_read(dirpath: str, bufs: list[np.ndarray], threads: int, hash_it: bool = False) -> float:
    paths = [os.path.join(dirpath, f"shard{i:04d}") for i in range(len(bufs))]
    t0 = time.perf_counter()
    if threads <= 1:
        for p, b in zip(paths, bufs):
            _read_file(p, b, hash_it)
    else:
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(lambda pb: _read_file(pb[0], pb[1], hash_it), zip(paths, bufs)))
    return time.perf_counter() - t0


# --- the benchmark ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1.0)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats; medians are reported (default 3)")
    ap.add_argument("--dir", default="/dev/shm",
                    help="tmpfs directory; a fresh subdirectory is used and removed (default /dev/shm)")
    ap.add_argument("--no-orbax", action="store_true", help="skip the Orbax baselines")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory (debugging)")
    ap.add_argument("--force", action="store_true", help="run even when available memory looks too small")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.gib <= 0:
        ap.error("--repeats must be >= 1 and --gib > 0")

    logging.basicConfig(level=logging.WARNING)
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from mtc.head import CheckpointManager, MTCConfig

    devices = jax.devices()
    if len(devices) < N_DEVICES:
        print(f"need {N_DEVICES} devices, jax has {len(devices)} ({devices[0].platform}); "
              f"set XLA_FLAGS=--xla_force_host_platform_device_count={N_DEVICES} before jax is imported",
              file=sys.stderr)
        return 2
    devices = devices[:N_DEVICES]
    mesh = Mesh(np.array(devices), ("d",))
    sharding = NamedSharding(mesh, P("d", None))

    # Shapes: 8 arrays of (rows, 1024) float32, rows a multiple of 8 (one row block per device).
    per_array = args.gib * GiB / 4 / N_ARRAYS
    rows = max(N_DEVICES, int(round(per_array / COLS / N_DEVICES)) * N_DEVICES)
    shape = (rows, COLS)
    state_bytes = N_ARRAYS * rows * COLS * 4

    parent = args.dir
    if not os.path.isdir(parent):
        print(f"--dir {parent} is not a directory", file=sys.stderr)
        return 2
    # mtc keeps up to local_max_to_keep + 1 steps during a save; plus raw files and one Orbax copy.
    need = int(state_bytes * 5.5) + (64 << 20)
    if free_bytes(parent) < need:
        print(f"{parent} has {free_bytes(parent) / GiB:.2f} GiB free; the benchmark needs about "
              f"{need / GiB:.2f} GiB: pass --dir on a larger tmpfs or a smaller --gib", file=sys.stderr)
        return 2
    # Process memory (measured: up to ~8x state: libraries, state, staging, host buffers, one
    # restore or Orbax copy, heap kept by malloc) plus up to ~4x state in tmpfs, both in RAM.
    need_mem = int(state_bytes * 12) + (1 << 30)
    avail = mem_available()
    if avail and avail < need_mem and not args.force:
        print(f"only {avail / GiB:.1f} GiB of memory available; a {state_bytes / GiB:.2f} GiB run needs about "
              f"{need_mem / GiB:.1f} GiB (process + tmpfs): wait for other jobs, pass a smaller --gib, or "
              "--force", file=sys.stderr)
        return 2

    scratch = tempfile.mkdtemp(prefix="mtc-bench-", dir=parent)
    try:
        return _run(args, jax, jnp, sharding, shape, state_bytes, scratch, CheckpointManager, MTCConfig)
    finally:
        if args.keep:
            print(f"kept {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


def _run(args, jax, jnp, sharding, shape, state_bytes, scratch, CheckpointManager, MTCConfig) -> int:
    t_start = time.perf_counter()
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    fs = fs_type(scratch)

    # --- machine facts ------------------------------------------------------------------------
    print("# mtc save/restore benchmark")
    print()
    print(f"- machine: {ncpu} cores usable ({os.cpu_count()} online), {cpu_model()}, "
          f"{mem_total() / GiB:.1f} GiB memory, Linux {platform.release()}")
    print(f"- python {platform.python_version()}, jax {version_of('jax')}, jaxlib {version_of('jaxlib')}, "
          f"numpy {np.__version__}, orbax-checkpoint {version_of('orbax-checkpoint')}, "
          f"tensorstore {version_of('tensorstore')}, mtc {version_of('mtc')}")
    print(f"- devices: {len(jax.devices())} x {jax.devices()[0].platform}; state: {N_ARRAYS} x float32 "
          f"{shape} random, sharded by rows over {N_DEVICES} devices = {state_bytes / GiB:.3f} GiB "
          f"({state_bytes} bytes), {N_ARRAYS * N_DEVICES} shards of {state_bytes // (N_ARRAYS * N_DEVICES)} bytes")
    print(f"- directory: {scratch} ({fs}), repeats: {args.repeats} (medians), "
          f"each save a new step with new contents")
    if fs != "tmpfs":
        print(f"- warning: {scratch} is on {fs}, not tmpfs: the numbers are not the RAM-tier numbers")
    sys.stdout.flush()

    # --- state ----------------------------------------------------------------------------------
    rng = np.random.default_rng(20260101)
    state = {}
    for i in range(N_ARRAYS):
        host = rng.random(shape, dtype=np.float32)
        state[f"layer_{i}"] = jax.device_put(host, sharding)
        del host
    jax.block_until_ready(state)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)

    def _xor(tree, c):
        def one(x):
            bits = jax.lax.bitcast_convert_type(x, jnp.uint32) ^ c
            return jax.lax.bitcast_convert_type(bits, jnp.float32)
        return jax.tree.map(one, tree)

    xor = jax.jit(_xor, donate_argnums=0)
    cur = [0]  # the constant the state is currently XORed with (0: the original random data)

    def new_contents(k: int):
        """State becomes original ^ C_k: new contents, same entropy, donated in place."""
        nonlocal state
        ck = (k * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF
        with _quiet_donation():
            state = xor(state, np.uint32(cur[0] ^ ck))
        cur[0] = ck
        jax.block_until_ready(state)

    shards = [s for k in sorted(state) for s in state[k].addressable_shards]

    # --- physical limits: preallocated host buffers ---------------------------------------------
    # One set of host buffers: memcpy target, raw-write source, raw-read target. Each repeat
    # copies into them first (then saves with mtc) and does the raw I/O later, so they sit idle
    # between repeats as mtc's staging buffers sit idle between saves (on a VM, writing into
    # pages left alone for seconds costs more than into pages just used).
    host_bufs = [np.empty(s.data.shape, np.float32) for s in shards]

    def memcpy() -> float:
        srcs = [np.asarray(s.data) for s in shards]
        t0 = time.perf_counter()
        for dst, src in zip(host_bufs, srcs):
            np.copyto(dst, src)
        return time.perf_counter() - t0

    memcpy()  # touch the buffers once: first-touch page faults are not the copy
    shards_now = lambda: [s for k in sorted(state) for s in state[k].addressable_shards]  # noqa: E731

    R: dict[str, list[float]] = {k: [] for k in (
        "raw_w1", "raw_wn", "raw_r1", "raw_rn", "raw_rf1", "raw_rfn", "raw_w_hash", "raw_r_hash", "memcpy",
        "mtc_blocked", "mtc_total", "mtc_restore", "mtc_stage", "mtc_phase1", "mtc_phase2",
        "mtc_load", "mtc_rss", "mtc_restore_rss",
        "std_save", "std_blocked", "std_restore", "raw_save", "raw_restore",
        "std_save_rss", "std_restore_rss", "unc_save_rss", "unc_restore_rss")}
    notes: list[str] = []

    mtc_dir = os.path.join(scratch, "mtc-local")
    mgr = CheckpointManager(MTCConfig(local_checkpoint_directory=mtc_dir, local_checkpoint_period=1,
                                      local_max_to_keep=KEEP))

    def mtc_save(step: int) -> tuple[float, float, PeakRSS, object]:
        with PeakRSS() as peak:
            t0 = time.perf_counter()
            mgr.save(step, state, force=True)
            t1 = time.perf_counter()
            mgr.wait_until_finished()
            t2 = time.perf_counter()
        return t1 - t0, t2 - t0, peak, mgr.last_save_report

    def mtc_restore(step: int):
        # No malloc_trim here: it would make every restore fault in fresh pages, which on a VM
        # costs more than the read (see "raw read into fresh buffers").
        with PeakRSS(trim=False) as peak:
            t0 = time.perf_counter()
            out = mgr.restore(step, target=abstract)
            jax.block_until_ready(out)
            dt = time.perf_counter() - t0
        return dt, out, peak

    def check_equal(restored, what: str) -> bool:
        ok = True
        for k in sorted(state):
            a = np.asarray(state[k]).view(np.uint8)
            b = np.asarray(restored[k]).view(np.uint8)
            if a.shape != b.shape or not np.array_equal(a, b):
                print(f"{what}: array {k} differs from the saved state", file=sys.stderr)
                ok = False
            r = restored[k]
            if getattr(r, "sharding", None) is not None and not r.sharding.is_equivalent_to(
                    state[k].sharding, len(shape)):
                print(f"{what}: array {k} came back with sharding {r.sharding}, saved {state[k].sharding}",
                      file=sys.stderr)
                ok = False
        return ok

    # --- warm-up: first mtc save (cold staging buffers), restore ------------------------------
    step = 0
    new_contents(1)
    cold_blocked, cold_total, cold_peak, cold_rep = mtc_save(step)
    dt, out, _ = mtc_restore(step)
    cold_restore = dt
    ok_cold = check_equal(out, "mtc restore (first)")
    del out
    gc.collect()

    # --- priming: until a step is pruned, the ramdisk grows ---------------------------------------
    # The next KEEP saves write every blob into newly allocated tmpfs pages; from then on each
    # save rewrites the files of the step its commit pruned (the free pool), as a training run
    # does for all but its first KEEP + 1 saves. The timed repeats measure that steady state;
    # these saves are reported on their own.
    prime_total = []
    for _ in range(KEEP):
        step += 1
        new_contents(step + 1)
        prime_total.append(mtc_save(step)[1])

    # --- Orbax setup and warm-up ----------------------------------------------------------------
    ocp = None
    if not args.no_orbax:
        import absl.logging

        absl.logging.set_verbosity(absl.logging.ERROR)
        import orbax.checkpoint as ocp

        logging.getLogger("orbax").setLevel(logging.ERROR)
        std = ocp.StandardCheckpointer()
        unc = ocp.PyTreeCheckpointer(use_compression=False)
        unc_restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)

        def orbax_std(path: str) -> tuple[float, float, float, object]:
            with PeakRSS(trim=False) as pk:
                t0 = time.perf_counter()
                std.save(path, state)
                t1 = time.perf_counter()
                std.wait_until_finished()
                t2 = time.perf_counter()
            R["std_save_rss"].append(pk.increase / state_bytes)
            with PeakRSS(trim=False) as pk:
                t2b = time.perf_counter()
                out = std.restore(path, abstract)
                jax.block_until_ready(out)
                t3 = time.perf_counter()
            R["std_restore_rss"].append(pk.increase / state_bytes)
            return t2 - t0, t1 - t0, t3 - t2b, out

        def orbax_unc(path: str) -> tuple[float, float, object]:
            with PeakRSS(trim=False) as pk:
                t0 = time.perf_counter()
                unc.save(path, args=ocp.args.PyTreeSave(state))
                t1 = time.perf_counter()
            R["unc_save_rss"].append(pk.increase / state_bytes)
            with PeakRSS(trim=False) as pk:
                t1b = time.perf_counter()
                out = unc.restore(path, args=ocp.args.PyTreeRestore(item=abstract, restore_args=unc_restore_args))
                jax.block_until_ready(out)
                t2 = time.perf_counter()
            R["unc_restore_rss"].append(pk.increase / state_bytes)
            return t1 - t0, t2 - t1b, out

        # Warm-up (imports, tracing, thread pools), checked bit for bit once.
        p = os.path.join(scratch, "orbax-std-warm")
        *_, out = orbax_std(p)
        ok_std = check_equal(out, "orbax default restore")
        del out
        shutil.rmtree(p)
        p = os.path.join(scratch, "orbax-unc-warm")
        *_, out = orbax_unc(p)
        ok_unc = check_equal(out, "orbax uncompressed restore")
        del out
        shutil.rmtree(p)
        gc.collect()
        if not (ok_std and ok_unc):
            notes.append("an Orbax restore differed from the saved state")

    # --- timed repeats (interleaved) ---------------------------------------------------------------
    ok_timed = True
    last_written = []
    for r in range(args.repeats):
        step += 1
        new_contents(step + 1)
        shards = shards_now()

        # memcpy (the limit for the blocking part), right before the mtc save it is compared with,
        # into buffers idle since the previous repeat's raw I/O, as the staging buffers are idle
        # since the previous save (a copy into just-used buffers is faster on this VM)
        _settle()
        R["memcpy"].append(memcpy())

        # mtc
        blocked, total, peak, rep = mtc_save(step)
        R["mtc_blocked"].append(blocked)
        R["mtc_total"].append(total)
        R["mtc_rss"].append(peak.increase / state_bytes)
        R["mtc_stage"].append(rep.stage_s)
        R["mtc_phase1"].append(rep.phase1_s)
        R["mtc_phase2"].append(rep.phase2_s)
        last_written.append(rep.bytes_written)
        dt, out, rpeak = mtc_restore(step)
        R["mtc_restore"].append(dt)
        R["mtc_restore_rss"].append(rpeak.increase / state_bytes)
        R["mtc_load"].append(mgr.last_restore_report.load_s)
        if r == args.repeats - 1:
            ok_timed = check_equal(out, "mtc restore (timed)")
        del out
        gc.collect()

        # raw write / read, 1 thread and one per core, fresh files each time
        for tag, threads in (("1", 1), ("n", ncpu)):
            d = os.path.join(scratch, f"raw-{r}-{tag}")
            _settle()
            R[f"raw_w{tag}"].append(raw_write(d, host_bufs, threads))
            _settle()
            R[f"raw_r{tag}"].append(raw_read(d, host_bufs, threads))
            _settle()
            R[f"raw_rf{tag}"].append(raw_read_fresh(d, host_bufs, threads))
            shutil.rmtree(d)
        d = os.path.join(scratch, f"raw-{r}-h")
        _settle()
        R["raw_w_hash"].append(raw_write(d, host_bufs, ncpu, hash_it=True))
        _settle()
        R["raw_r_hash"].append(raw_read(d, host_bufs, ncpu, hash_it=True))
        shutil.rmtree(d)

        # Orbax, fresh directories
        if ocp is not None:
            p = os.path.join(scratch, f"orbax-std-{r}")
            save_s, blocked_s, restore_s, out = orbax_std(p)
            del out
            R["std_save"].append(save_s)
            R["std_blocked"].append(blocked_s)
            R["std_restore"].append(restore_s)
            shutil.rmtree(p)
            p = os.path.join(scratch, f"orbax-unc-{r}")
            save_s, restore_s, out = orbax_unc(p)
            del out
            R["raw_save"].append(save_s)
            R["raw_restore"].append(restore_s)
            shutil.rmtree(p)
            gc.collect()
        print(f"  repeat {r + 1}/{args.repeats} done ({time.perf_counter() - t_start:.1f} s)", flush=True)

    # --- dedupe: the same contents again, to a new step -------------------------------------------
    step += 1
    dd_blocked, dd_total, _, dd_rep = mtc_save(step)
    mgr.close()
    if ocp is not None:
        std.close()
        unc.close()

    bitok = ok_cold and ok_timed
    # --- report -----------------------------------------------------------------------------------
    m = {k: med(v) for k, v in R.items()}
    raw_w = min(m["raw_w1"], m["raw_wn"])
    raw_r = min(m["raw_r1"], m["raw_rn"])

    def row(name, xs, nbytes=state_bytes, note=""):
        if not xs:
            return
        s = med(xs)
        spread = f"{min(xs):.3f}-{max(xs):.3f}" if len(xs) > 1 else ""
        print(f"| {name} | {s:.3f} | {nbytes / s / GB:.2f} | {spread} | {note} |")

    print()
    print(f"## Measurements ({state_bytes / GiB:.3f} GiB, median of {args.repeats})")
    print()
    print("| what | seconds | GB/s | min-max | note |")
    print("|---|---|---|---|---|")
    row("memcpy (np.copyto into preallocated buffers, right before each save)", R["memcpy"])
    row("raw write, 1 thread (os.write, fresh files)", R["raw_w1"], note="limit" if raw_w == m["raw_w1"] else "")
    row(f"raw write, {ncpu} threads", R["raw_wn"], note="limit" if raw_w == m["raw_wn"] else "")
    row(f"raw write + xxh3_128, {ncpu} threads", R["raw_w_hash"], note="info")
    row("raw read, 1 thread (readinto preallocated)", R["raw_r1"], note="limit" if raw_r == m["raw_r1"] else "")
    row(f"raw read, {ncpu} threads", R["raw_rn"], note="limit" if raw_r == m["raw_rn"] else "")
    row(f"raw read + xxh3_128, {ncpu} threads", R["raw_r_hash"], note="info")
    row("raw read into fresh buffers (np.empty, allocated in the caller), 1 thread", R["raw_rf1"], note="info")
    row(f"raw read into fresh buffers, {ncpu} threads", R["raw_rfn"], note="info")
    row("mtc save blocked (save() returns)", R["mtc_blocked"])
    row("mtc save total (save + wait_until_finished)", R["mtc_total"])
    row("  of which stage (report.stage_s)", R["mtc_stage"])
    row("  of which phase 1 (report.phase1_s)", R["mtc_phase1"])
    row("  of which phase 2 (report.phase2_s)", R["mtc_phase2"])
    row("mtc restore (restore + block_until_ready)", R["mtc_restore"])
    row("  of which load (report.load_s)", R["mtc_load"])
    row("mtc first save, blocked (cold staging buffers)", [cold_blocked])
    row("mtc first save, total", [cold_total])
    row("mtc first restore", [cold_restore])
    row(f"mtc saves 2-{KEEP + 1}, total (the ramdisk grows: fresh tmpfs pages, no free pool yet)", prime_total,
        note="info")
    row(f"mtc save of unchanged state (dedupe: {dd_rep.bytes_written} bytes written)", [dd_total],
        note=f"blocked {dd_blocked * 1e3:.1f} ms")
    if ocp is not None:
        row("orbax StandardCheckpointer default, save + wait", R["std_save"])
        row("orbax StandardCheckpointer default, save() blocked", R["std_blocked"], note="info")
        row("orbax StandardCheckpointer default, restore", R["std_restore"])
        row("orbax PyTreeCheckpointer(use_compression=False), save", R["raw_save"])
        row("orbax PyTreeCheckpointer(use_compression=False), restore", R["raw_restore"])
    print()
    print(f"- mtc bytes written per timed save: {sorted(set(last_written))} (state {state_bytes})")
    print(f"- peak RSS increase / state, first save (staging allocated): {cold_peak.increase / state_bytes:.3f} "
          f"({cold_peak.increase / 2**20:.1f} MiB over {cold_peak.base / 2**20:.1f} MiB)")
    if ocp is not None:
        print("- Orbax peak RSS increase / state (max over all runs, warm-up included): "
              f"default save {max(R['std_save_rss']):.2f}, restore {max(R['std_restore_rss']):.2f}; "
              f"uncompressed save {max(R['unc_save_rss']):.2f}, restore {max(R['unc_restore_rss']):.2f}")

    # --- ratios with targets ---------------------------------------------------------------------
    checks: list[tuple[str, str, str, bool | None]] = []

    def ratio(name, num, den, target):
        v = num / den
        checks.append((name, f"{v:.2f}x", f"<= {target:.2f}x", v <= target))

    ratio("mtc save total / raw write", m["mtc_total"], raw_w, T_SAVE_VS_RAW)
    ratio("mtc restore / raw read", m["mtc_restore"], raw_r, T_RESTORE_VS_RAW)
    if ocp is not None:
        ratio("mtc save / orbax default save", m["mtc_total"], m["std_save"], T_VS_ORBAX_DEFAULT)
        ratio("mtc save / orbax uncompressed save", m["mtc_total"], m["raw_save"], T_VS_ORBAX_RAW)
        ratio("mtc restore / orbax default restore", m["mtc_restore"], m["std_restore"], T_VS_ORBAX_DEFAULT)
        ratio("mtc restore / orbax uncompressed restore", m["mtc_restore"], m["raw_restore"], T_VS_ORBAX_RAW)
    over = (m["mtc_blocked"] - m["memcpy"]) * 1e3
    checks.append(("mtc save blocked - memcpy",
                   f"{over:+.1f} ms ({m['mtc_blocked'] / m['memcpy']:.2f}x)",
                   f"<= +{T_BLOCKED_OVER_MEMCPY_MS:.0f} ms", over <= T_BLOCKED_OVER_MEMCPY_MS))
    cold = cold_peak.increase / state_bytes
    checks.append(("peak RSS increase / state, first save", f"{cold:.3f}", f"<= {T_PEAK_RSS:.2f}",
                   cold <= T_PEAK_RSS))
    steady = max(R["mtc_rss"])
    checks.append(("peak RSS increase / state, later saves (max)", f"{steady:.3f}",
                   f"<= {T_PEAK_RSS_STEADY:.2f}", steady <= T_PEAK_RSS_STEADY))
    rr = max(R["mtc_restore_rss"])
    checks.append(("peak RSS increase / state, restore (max; the result itself is 1.0)", f"{rr:.3f}",
                   f"(info) <= {T_PEAK_RSS:.2f}", None if rr <= T_PEAK_RSS else False))
    checks.append(("dedupe: bytes written for unchanged state", f"{dd_rep.bytes_written}", "0",
                   dd_rep.bytes_written == 0))

    print()
    print("## Ratios and targets")
    print()
    print("| check | measured | target | result |")
    print("|---|---|---|---|")
    for name, val, tgt, ok in checks:
        print(f"| {name} | {val} | {tgt} | {'info' if ok is None else 'PASS' if ok else 'MISS'} |")
    print()
    print(f"- raw limits used: write {raw_w:.3f} s ({state_bytes / raw_w / GB:.2f} GB/s, best of 1 and {ncpu} "
          f"threads), read {raw_r:.3f} s ({state_bytes / raw_r / GB:.2f} GB/s)")
    for n in notes:
        print(f"- note: {n}")
    print(f"- bit for bit: {'ok' if bitok else 'FAILED'} (mtc restores compared with the saved state as uint8)")
    print(f"- wall time {time.perf_counter() - t_start:.1f} s")
    sys.stdout.flush()
    if not bitok:
        return 1
    if args.strict and not all(ok for *_, ok in checks if ok is not None):
        return 1
    return 0


@contextlib.contextmanager
def _quiet_donation():
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*donated.*")
        yield


if __name__ == "__main__":
    sys.exit(main())
