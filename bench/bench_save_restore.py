"""Save/restore benchmark: mtc against the physical limits, Orbax and Orbax's multi-tier manager, in one run.

    python bench/bench_save_restore.py [--gib 1.0] [--repeats 3] [--dir /dev/shm] [--huge-pages auto]

State: 8 float32 arrays of random data totalling --gib GiB, each sharded by rows over 8 CPU
devices (NamedSharding). Everything is written to a fresh subdirectory of --dir (a tmpfs,
/dev/shm by default, usually 4 KiB pages) that is removed at the end; with ``--huge-pages auto``
(the default) and root, the mtc and raw parts run again on a private tmpfs mounted
``huge=within_size`` (2 MiB pages). Every timed save goes to a new step with changed contents
(the state is XORed with a new per-repeat constant: every word changes and the entropy stays
that of the random data), so content-addressed dedupe cannot skip writing; a save of unchanged
state is measured separately.

Measured, interleaved per repeat so that a noisy machine hits every contender alike, and
reported as medians of --repeats, on each ramdisk:
- raw write: the shard bytes written with os.write, one file per shard (1 thread, and one
  thread per core), two ways: into fresh files (first-touch: the tmpfs allocates and clears
  every page) and into files of the same sizes written before (recycled: the pages exist,
  which is what a steady-state save of mtc writes into: the fair limit);
- raw read: those files read with readinto into preallocated buffers: the limit for restore;
- memcpy: one np.copyto of every shard into preallocated host buffers: the limit for the part
  of save that blocks the caller;
- mtc: save() (blocked), save() + wait_until_finished() (total), restore() into a target of
  ShapeDtypeStructs with the saved shardings (block_until_ready included), checked bit for bit;
  in steady state: after the first save and the local_max_to_keep saves that grow the ramdisk,
  so that each timed save rewrites a pruned step's files as in training;
- the cold path, on its own: those first local_max_to_keep + 1 saves on a fresh ramdisk (no
  free pool, no maps), each against a raw write of the same bytes into fresh files with one
  thread per core and a memcpy, measured right before it;
- on the --dir ramdisk only: Orbax StandardCheckpointer (default: zarr3 + zstd) and
  PyTreeCheckpointer with use_compression=False, fresh directory per repeat; and Orbax's
  multi-tier manager ``ReplicatorCheckpointManager`` (its local tier: OCDBT + zarr3 on the
  ramdisk) with its default (zstd) and with compression patched off, run in one CPU process as init_orbax_multi_tier() below sets it up
  (one process: jax.distributed initialised with 1 process, device ids mapped); each restored
  into the same abstract target;
- peak resident memory during each mtc save above the resident memory just before it
  (VmHWM reset through /proc/self/clear_refs; a 2 ms sampler thread where that is refused).
  Mapped ramdisk pages count: the first save maps the files it lands in.

Times are ratios measured in one run: quote those, not absolute seconds (a shared VM's speed varies).
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
import subprocess
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

# Targets: each ratio the run prints is checked against one of these (its row shows the target and whether it was met).
T_SAVE_VS_RAW = 1.05
T_RESTORE_VS_RAW = 0.6
T_VS_RCM_DEFAULT = 0.2
T_VS_RCM_RAW = 0.5
T_VS_ORBAX_DEFAULT = 0.5
T_VS_ORBAX_RAW = 0.8
T_BLOCKED_OVER_MEMCPY_MS = 20.0
T_PEAK_RSS = 1.10
T_PEAK_RSS_STEADY = 0.10
T_COLD_BLOCKED = 1.2  # each of the first saves on a fresh ramdisk, against a raw write into fresh files
T_COLD_TOTAL = 1.3


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


def _warmer_drain(mgr) -> bool:
    """Wait for the sidecar in this process to finish warming its maps (colocated mode on a CPU
    backend); False where it cannot be reached."""
    from mtc.shared import landing_zones

    zone = landing_zones.find(mgr.config.ramdisk_root)
    service = getattr(zone, "_service", None)  # the colocated service's zone (sidecar/colocated.py)
    if service is None:
        return False
    return service.store.landings.warmer.drain(timeout=120)  # an AttributeError if it moves: not a silent 0


def _back_memory(root: str, nbytes: int) -> float:
    """Write ``nbytes`` of files under ``root`` and remove them; seconds taken.

    On a VM the hypervisor backs guest memory on first use, which can cost several times what
    the kernel's own allocation does (here: 2-3 s per GiB of huge pages past the first GiB). The
    cold-path rows compare mtc's first saves with raw writes into fresh files, so both must get
    memory the guest already holds; which of them touched new memory first would decide it.
    """
    d = tempfile.mkdtemp(prefix="back-", dir=root)
    chunk = np.random.default_rng(1).integers(0, 256, 64 << 20, dtype=np.uint8)
    t0 = time.perf_counter()
    try:
        for i in range(-(-nbytes // chunk.nbytes)):
            _write_file(os.path.join(d, f"f{i}"), chunk)
    finally:
        shutil.rmtree(d)
    return time.perf_counter() - t0


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


def _write_file(path: str, buf: np.ndarray, flags: int = os.O_CREAT | os.O_EXCL) -> None:
    """os.write ``buf`` to ``path`` from its start (a new file by default; ``flags=0``: over an
    existing one, not truncated)."""
    mv = memoryview(buf.reshape(-1).view(np.uint8))
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | flags, 0o644)
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

    return _timed(one, len(bufs), threads)


def _timed(one, n: int, threads: int) -> float:
    """Seconds to run ``one(i)`` for i in range(n), on ``threads`` threads (1: in this one)."""
    t0 = time.perf_counter()
    if threads <= 1:
        for i in range(n):
            one(i)
    else:
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(one, range(n)))
    return time.perf_counter() - t0


def raw_write_recycled(paths: list[str], bufs: list[np.ndarray], threads: int) -> float:
    """os.write each buffer over the start of an existing file of its size (no truncation): the
    tmpfs pages exist, as in the blob files a steady-state save rewrites."""
    def one(i: int) -> None:
        _write_file(paths[i], bufs[i], flags=0)

    return _timed(one, len(bufs), threads)


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


# --- Orbax's multi-tier manager on CPU ----------------------------------------------


def init_orbax_multi_tier() -> str | None:
    """What ReplicatorCheckpointManager needs in one CPU process, done before JAX starts its
    backends: absl flags parsed, jax.distributed with one process, the device-id mapping.
    Returns None, or why the multi-tier baseline cannot run."""
    try:
        import socket

        import jax
        from absl import flags

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        jax.distributed.initialize(f"127.0.0.1:{port}", 1, 0)
        if not flags.FLAGS.is_parsed():
            flags.FLAGS([sys.argv[0]])
        from orbax.checkpoint._src.multihost import multihost

        multihost.initialize_distributed_to_device_ids()
    except Exception as e:  # a baseline that cannot run is reported, not fatal
        return f"{type(e).__name__}: {e}"
    return None


def replicator_manager(directory: str, mesh, compression: bool):
    """Orbax's ReplicatorCheckpointManager on ``directory``; without ``compression``, its local
    handler is built with use_compression=False (there is no option for it)."""
    import functools

    from etils import epath
    from orbax.checkpoint.experimental.emergency.multi_tier_checkpointing import (
        replicator_checkpoint_manager as rcm)

    original = rcm.PyTreeCheckpointHandler
    if not compression:
        rcm.PyTreeCheckpointHandler = functools.partial(original, use_compression=False)
    try:
        return rcm.ReplicatorCheckpointManager(epath.Path(directory), global_mesh=mesh)
    finally:
        rcm.PyTreeCheckpointHandler = original


@contextlib.contextmanager
def huge_page_tmpfs(size_bytes: int):
    """A private tmpfs mounted ``huge=within_size`` (2 MiB pages): (path, "") or (None, why not)."""
    mnt = tempfile.mkdtemp(prefix="mtc-bench-huge-")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes >> 20}m,huge=within_size,mode=0700",
                        "tmpfs", mnt], capture_output=True, text=True)
    if r.returncode:
        os.rmdir(mnt)
        yield None, (r.stderr.strip() or f"mount exited {r.returncode}")
        return
    try:
        yield mnt, ""
    finally:
        gc.collect()  # arrays that still map files of it
        if subprocess.run(["umount", mnt], capture_output=True).returncode:
            subprocess.run(["umount", "-l", mnt], check=False)  # detached now, freed when the last map goes
        os.rmdir(mnt)


# --- the benchmark ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1.0)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats; medians are reported (default 3)")
    ap.add_argument("--dir", default="/dev/shm",
                    help="tmpfs directory; a fresh subdirectory is used and removed (default /dev/shm)")
    ap.add_argument("--huge-pages", choices=("auto", "on", "off"), default="auto",
                    help="also run mtc and the raw limits on a private tmpfs mounted huge=within_size "
                         "(auto: when root; on: fail without it)")
    ap.add_argument("--no-orbax", action="store_true", help="skip the Orbax baselines")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory (debugging)")
    ap.add_argument("--force", action="store_true", help="run even when available memory looks too small")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.gib <= 0:
        ap.error("--repeats must be >= 1 and --gib > 0")

    logging.basicConfig(level=logging.WARNING)
    rcm_why = None if args.no_orbax else init_orbax_multi_tier()
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
    # mtc keeps up to local_max_to_keep + 1 steps during a save, plus its pool; raw fresh and
    # recycled files; one Orbax copy.
    need = int(state_bytes * 6.5) + (64 << 20)
    if free_bytes(parent) < need:
        print(f"{parent} has {free_bytes(parent) / GiB:.2f} GiB free; the benchmark needs about "
              f"{need / GiB:.2f} GiB: pass --dir on a larger tmpfs or a smaller --gib", file=sys.stderr)
        return 2
    # Process memory (measured: up to ~8x state: libraries, state, host buffers, one restore or
    # Orbax copy, heap kept by malloc) plus up to ~5x state in tmpfs, both in RAM.
    need_mem = int(state_bytes * 13) + (1 << 30)
    avail = mem_available()
    if avail and avail < need_mem and not args.force:
        print(f"only {avail / GiB:.1f} GiB of memory available; a {state_bytes / GiB:.2f} GiB run needs about "
              f"{need_mem / GiB:.1f} GiB (process + tmpfs): wait for other jobs, pass a smaller --gib, or "
              "--force", file=sys.stderr)
        return 2

    want_huge = args.huge_pages == "on" or (args.huge_pages == "auto" and os.geteuid() == 0)
    scratch = tempfile.mkdtemp(prefix="mtc-bench-", dir=parent)
    try:
        with contextlib.ExitStack() as stack:
            ramdisks = [("small", f"--dir {parent}", scratch)]
            huge_why = "--huge-pages off" if not want_huge else ""
            if want_huge:
                mnt, huge_why = stack.enter_context(huge_page_tmpfs(need))
                if mnt is None and args.huge_pages == "on":
                    print(f"cannot mount a huge-page tmpfs: {huge_why}", file=sys.stderr)
                    return 2
                if mnt is not None:
                    ramdisks.append(("huge", "tmpfs huge=within_size", mnt))
            env = dict(jax=jax, jnp=jnp, mesh=mesh, sharding=sharding, shape=shape, state_bytes=state_bytes,
                       CheckpointManager=CheckpointManager, MTCConfig=MTCConfig, rcm_why=rcm_why,
                       huge_why=huge_why)
            return _run(args, ramdisks, **env)
    finally:
        if args.keep:
            print(f"kept {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


def _run(args, ramdisks, *, jax, jnp, mesh, sharding, shape, state_bytes, CheckpointManager, MTCConfig,
         rcm_why, huge_why) -> int:
    t_start = time.perf_counter()
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()

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
    for kind, what, root in ramdisks:
        print(f"- ramdisk '{kind}': {root} ({fs_type(root)}, {what})")
        if fs_type(root) != "tmpfs":
            print(f"- warning: {root} is not a tmpfs: the numbers are not the RAM-tier numbers")
    if huge_why:
        print(f"- no huge-page run: {huge_why}")
    print(f"- repeats: {args.repeats} (medians), each save a new step with new contents")
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
    cur = [0, 0]  # the constant the state is XORed with now (0: the original data); contents made so far

    def new_contents():
        """State becomes original ^ C_k: new contents, same entropy, donated in place."""
        nonlocal state
        cur[1] += 1
        ck = (cur[1] * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF
        with _quiet_donation():
            state = xor(state, np.uint32(cur[0] ^ ck))
        cur[0] = ck
        jax.block_until_ready(state)

    shards_now = lambda: [s for k in sorted(state) for s in state[k].addressable_shards]  # noqa: E731

    # --- physical limits: preallocated host buffers ---------------------------------------------
    # One set of host buffers: memcpy target, raw-write source, raw-read target. Each repeat
    # copies into them first (then saves with mtc) and does the raw I/O later, so they sit idle
    # between repeats as mtc's landing maps sit idle between saves (on a VM, writing into
    # pages left alone for seconds costs more than into pages just used).
    host_bufs = [np.empty(s.data.shape, np.float32) for s in shards_now()]

    def memcpy() -> float:
        srcs = [np.asarray(s.data) for s in shards_now()]
        t0 = time.perf_counter()
        for dst, src in zip(host_bufs, srcs):
            np.copyto(dst, src)
        return time.perf_counter() - t0

    memcpy()  # touch the buffers once: first-touch page faults are not the copy

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

    notes: list[str] = []

    def orbax_contenders(scratch: str) -> dict:
        """name -> (run(path or step) -> (save total, save blocked, restore, restored), cleanup)."""
        import absl.logging

        absl.logging.set_verbosity(absl.logging.ERROR)
        import orbax.checkpoint as ocp

        logging.getLogger("orbax").setLevel(logging.ERROR)
        logging.getLogger("absl").setLevel(logging.ERROR)
        restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
        out = {}
        std = ocp.StandardCheckpointer()
        unc = ocp.PyTreeCheckpointer(use_compression=False)

        def run_std(r: int):
            path = os.path.join(scratch, f"orbax-std-{r}")
            _settle()
            t0 = time.perf_counter()
            std.save(path, state)
            t1 = time.perf_counter()
            std.wait_until_finished()
            t2 = time.perf_counter()
            _settle()
            t2b = time.perf_counter()
            restored = std.restore(path, abstract)
            jax.block_until_ready(restored)
            t3 = time.perf_counter()
            shutil.rmtree(path)
            return t2 - t0, t1 - t0, t3 - t2b, restored

        def run_unc(r: int):
            path = os.path.join(scratch, f"orbax-unc-{r}")
            _settle()
            t0 = time.perf_counter()
            unc.save(path, args=ocp.args.PyTreeSave(state))
            t1 = time.perf_counter()
            _settle()
            t1b = time.perf_counter()
            restored = unc.restore(path, args=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args))
            jax.block_until_ready(restored)
            t2 = time.perf_counter()
            shutil.rmtree(path)
            return t1 - t0, t1 - t0, t2 - t1b, restored

        out["std"] = (run_std, std.close)
        out["unc"] = (run_unc, unc.close)
        if rcm_why is not None:
            notes.append(f"Orbax ReplicatorCheckpointManager not run: {rcm_why}")
            return out
        for tag, compression in (("rcm", True), ("rcm_unc", False)):
            try:
                mgr = replicator_manager(os.path.join(scratch, f"orbax-{tag}"), mesh, compression)
            except Exception as e:
                notes.append(f"Orbax ReplicatorCheckpointManager ({tag}) could not be built: {type(e).__name__}: {e}")
                continue

            def run_rcm(r: int, mgr=mgr):
                step = r + 1  # its colocated path refuses step 0; keep the two paths alike
                _settle()
                t0 = time.perf_counter()
                mgr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)), force=True)
                t1 = time.perf_counter()
                mgr.wait_until_finished()
                t2 = time.perf_counter()
                _settle()
                t2b = time.perf_counter()
                restored = mgr.restore(step, args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args))).state
                jax.block_until_ready(restored)
                t3 = time.perf_counter()
                mgr.delete(step)  # it never deletes steps itself (its replicator's job)
                mgr.wait_until_finished()
                return t2 - t0, t1 - t0, t3 - t2b, restored

            out[tag] = (run_rcm, mgr.close)
        return out

    # --- one ramdisk: mtc, the raw limits (and Orbax) interleaved ----------------------------------
    def block(kind: str, root: str, with_orbax: bool) -> dict:
        R: dict[str, list[float]] = {}
        backed = _back_memory(root, (KEEP + 2) * state_bytes)
        print(f"  {kind}: {(KEEP + 2) * state_bytes / GiB:.1f} GiB of tmpfs written and freed first in "
              f"{backed:.2f} s (a VM backs the guest's memory on first use)", flush=True)

        def add(key: str, v: float) -> None:
            R.setdefault(key, []).append(v)

        mgr = CheckpointManager(MTCConfig(local_checkpoint_directory=os.path.join(root, "mtc-local"),
                                          local_checkpoint_period=1, local_max_to_keep=KEEP))

        def mtc_save(step: int, m=None):
            m = m if m is not None else mgr
            with PeakRSS() as peak:
                t0 = time.perf_counter()
                m.save(step, state, force=True)
                t1 = time.perf_counter()
                m.wait_until_finished()
                t2 = time.perf_counter()
            return t1 - t0, t2 - t0, peak, m.last_save_report

        def mtc_restore(step: int):
            # No malloc_trim here: it would make every restore fault in fresh pages, which on a VM
            # costs more than the read (see "raw read into fresh buffers").
            with PeakRSS(trim=False) as peak:
                t0 = time.perf_counter()
                out = mgr.restore(step, target=abstract)
                jax.block_until_ready(out)
                dt = time.perf_counter() - t0
            return dt, out, peak

        # The cold path: until a step is pruned, the ramdisk grows, so the first KEEP + 1 saves of a
        # run (and of a host whose ramdisk is new) write every blob into new tmpfs files; from then
        # on each save lands in the files of the step its commit pruned (the free pool), as a
        # training run does. A fresh manager on a fresh folder per repeat; each cold save is
        # measured against a raw write of the same bytes into fresh files (freed again before the
        # save) and a memcpy, right before it.
        cold_rows: list[list[dict]] = [[] for _ in range(KEEP + 1)]
        for c in range(args.repeats):
            folder = os.path.join(root, f"mtc-cold-{c}")
            cm = CheckpointManager(MTCConfig(local_checkpoint_directory=folder, local_checkpoint_period=1,
                                             local_max_to_keep=KEEP))
            cm.latest_step()  # a run starts so (resume or not): the sidecars are up before the first save
            for i in range(KEEP + 1):
                # The last save's maps are warmed in the background (what a run does between saves);
                # here it is waited for and timed apart, so that it weighs on neither contender.
                t0 = time.perf_counter()
                _warmer_drain(cm)
                if i:
                    cold_rows[i - 1][-1]["warm"] = time.perf_counter() - t0
                new_contents()
                memcpy()  # the host buffers hold this step's bytes: the raw write's source
                d = os.path.join(root, f"raw-cold-{c}-{i}")
                _settle()
                raw = raw_write(d, host_bufs, ncpu)
                shutil.rmtree(d)
                _settle()
                mc = memcpy()
                _settle()
                blocked, total, peak, _ = mtc_save(i, cm)
                cold_rows[i].append(dict(blocked=blocked, total=total, raw=raw, memcpy=mc, peak=peak))
            t0 = time.perf_counter()
            _warmer_drain(cm)
            cold_rows[KEEP][-1]["warm"] = time.perf_counter() - t0
            cm.close()
            shutil.rmtree(folder, ignore_errors=True)

        # Warm-up of the timed manager: the first save (maps made, pages allocated), restore, and
        # the KEEP saves that grow the ramdisk until a step is pruned.
        mgr.latest_step()
        step = 0
        new_contents()
        cold_blocked, cold_total, cold_peak, _ = mtc_save(step)
        cold_restore, out, _ = mtc_restore(step)
        ok = check_equal(out, f"mtc restore (first, {kind})")
        del out
        gc.collect()
        prime = []
        for _ in range(KEEP):
            step += 1
            new_contents()
            prime.append(mtc_save(step)[1])
        _warmer_drain(mgr)

        contenders = orbax_contenders(root) if with_orbax else {}
        for tag, (run, _) in contenders.items():  # warm-up (imports, tracing, thread pools), checked once
            *_, out = run(-1 - len(tag))
            if not check_equal(out, f"orbax {tag} restore"):
                notes.append(f"an Orbax restore ({tag}) differed from the saved state")
            del out
            gc.collect()

        # Files of the shard sizes, written once: the recycled raw write overwrites their pages.
        recycled_dir = os.path.join(root, "raw-recycled")
        raw_write(recycled_dir, host_bufs, 1)
        recycled = [os.path.join(recycled_dir, f"shard{i:04d}") for i in range(len(host_bufs))]

        last_written = []
        for r in range(args.repeats):
            step += 1
            new_contents()
            # memcpy (the limit for the blocking part), right before the mtc save it is compared with
            _settle()
            add("memcpy", memcpy())
            blocked, total, peak, rep = mtc_save(step)
            add("mtc_blocked", blocked)
            add("mtc_total", total)
            add("mtc_rss", peak.increase / state_bytes)
            add("mtc_stage", rep.stage_s)
            add("mtc_phase1", rep.phase1_s)
            add("mtc_phase2", rep.phase2_s)
            last_written.append(rep.bytes_written)
            dt, out, rpeak = mtc_restore(step)
            add("mtc_restore", dt)
            add("mtc_restore_rss", rpeak.increase / state_bytes)
            add("mtc_load", mgr.last_restore_report.load_s)
            if r == args.repeats - 1:
                ok = check_equal(out, f"mtc restore (timed, {kind})") and ok
            del out
            gc.collect()

            for tag, threads in (("1", 1), ("n", ncpu)):
                d = os.path.join(root, f"raw-{r}-{tag}")
                _settle()
                add(f"raw_w{tag}", raw_write(d, host_bufs, threads))
                _settle()
                add(f"raw_rec{tag}", raw_write_recycled(recycled, host_bufs, threads))
                _settle()
                add(f"raw_r{tag}", raw_read(d, host_bufs, threads))
                _settle()
                add(f"raw_rf{tag}", raw_read_fresh(d, host_bufs, threads))
                shutil.rmtree(d)
            d = os.path.join(root, f"raw-{r}-h")
            _settle()
            add("raw_w_hash", raw_write(d, host_bufs, ncpu, hash_it=True))
            shutil.rmtree(d)

            for tag, (run, _) in contenders.items():
                save_s, blocked_s, restore_s, out = run(r)
                del out
                add(f"{tag}_save", save_s)
                add(f"{tag}_blocked", blocked_s)
                add(f"{tag}_restore", restore_s)
                gc.collect()
            print(f"  {kind}: repeat {r + 1}/{args.repeats} done ({time.perf_counter() - t_start:.1f} s)", flush=True)

        # Dedupe: the same contents again, to a new step.
        step += 1
        dd_blocked, dd_total, _, dd_rep = mtc_save(step)
        mgr.close()
        for _, close in contenders.values():
            close()
        shutil.rmtree(recycled_dir)
        shutil.rmtree(os.path.join(root, "mtc-local"), ignore_errors=True)  # room for the next ramdisk's run
        return dict(R=R, ok=ok, cold=(cold_blocked, cold_total, cold_restore, cold_peak), prime=prime,
                    cold_rows=cold_rows,
                    dedupe=(dd_blocked, dd_total, dd_rep.bytes_written), written=sorted(set(last_written)),
                    orbax=bool(contenders))

    results = {}
    for i, (kind, _, root) in enumerate(ramdisks):
        results[kind] = block(kind, root, with_orbax=(i == 0 and not args.no_orbax))
    return _report(args, results, ramdisks, state_bytes, ncpu, notes, t_start)


def _report(args, results: dict, ramdisks, state_bytes: int, ncpu: int, notes: list[str], t_start: float) -> int:
    def row(name, xs, nbytes=state_bytes, note=""):
        if not xs:
            return
        s = med(xs)
        spread = f"{min(xs):.3f}-{max(xs):.3f}" if len(xs) > 1 else ""
        print(f"| {name} | {s:.3f} | {nbytes / s / GB:.2f} | {spread} | {note} |")

    checks: dict[str, dict[str, tuple[str, bool | None]]] = {}  # check -> kind -> (value, ok)
    targets: dict[str, str] = {}

    def ratio(kind, name, num, den, target, info=False):
        v = num / den
        checks.setdefault(name, {})[kind] = (f"{v:.2f}x", None if info else v <= target)
        targets[name] = f"<= {target:.2f}x" + (" (info)" if info else "")

    for kind, what, _ in ramdisks:
        res = results[kind]
        R = res["R"]
        m = {k: med(v) for k, v in R.items()}
        raw_fresh = min(m["raw_w1"], m["raw_wn"])
        raw_rec = min(m["raw_rec1"], m["raw_recn"])
        raw_r = min(m["raw_r1"], m["raw_rn"])
        cold_blocked, cold_total, cold_restore, cold_peak = res["cold"]
        dd_blocked, dd_total, dd_written = res["dedupe"]
        print()
        print(f"## Measurements, ramdisk '{kind}' ({what}; {state_bytes / GiB:.3f} GiB, median of {args.repeats})")
        print()
        print("| what | seconds | GB/s | min-max | note |")
        print("|---|---|---|---|---|")
        row("memcpy (np.copyto into preallocated buffers, right before each save)", R["memcpy"])
        row("raw write, fresh files (first-touch pages), 1 thread", R["raw_w1"])
        row(f"raw write, fresh files, {ncpu} threads", R["raw_wn"])
        row("raw write, recycled files (pages exist), 1 thread", R["raw_rec1"])
        row(f"raw write, recycled files, {ncpu} threads", R["raw_recn"])
        row(f"raw write + xxh3_128, fresh files, {ncpu} threads", R["raw_w_hash"], note="info")
        row("raw read, 1 thread (readinto preallocated)", R["raw_r1"])
        row(f"raw read, {ncpu} threads", R["raw_rn"])
        row("raw read into fresh buffers (np.empty, allocated in the caller), 1 thread", R["raw_rf1"], note="info")
        row(f"raw read into fresh buffers, {ncpu} threads", R["raw_rfn"], note="info")
        row("mtc save blocked (save() returns)", R["mtc_blocked"])
        row("mtc save total (save + wait_until_finished)", R["mtc_total"])
        row("  of which stage (report.stage_s)", R["mtc_stage"])
        row("  of which phase 1 (report.phase1_s)", R["mtc_phase1"])
        row("  of which phase 2 (report.phase2_s)", R["mtc_phase2"])
        row("mtc restore (restore + block_until_ready)", R["mtc_restore"])
        row("  of which load (report.load_s)", R["mtc_load"])
        row("mtc first restore", [cold_restore])
        row(f"mtc save of unchanged state (dedupe: {dd_written} bytes written)", [dd_total],
            note=f"blocked {dd_blocked * 1e3:.1f} ms")
        names = {"std": "Orbax StandardCheckpointer default (zstd)", "unc": "Orbax PyTreeCheckpointer(use_compression=False)",
                 "rcm": "Orbax ReplicatorCheckpointManager default (zstd)",
                 "rcm_unc": "Orbax ReplicatorCheckpointManager, compression patched off"}
        for tag, label in names.items():
            if f"{tag}_save" in R:
                row(f"{label}, save + wait", R[f"{tag}_save"])
                row(f"{label}, save() blocked", R[f"{tag}_blocked"], note="info")
                row(f"{label}, restore", R[f"{tag}_restore"])
        print()
        print(f"### The first {KEEP + 1} saves on a fresh ramdisk (no free pool, no maps: every page new; "
              f"median of {args.repeats} runs, ratios paired within each run)")
        print()
        print("| save | blocked s | total s | raw write, fresh files, "
              f"{ncpu} threads, s | memcpy s | blocked / raw | total / raw | peak RSS / state | "
              "its maps warmed in the background after it, s |")
        print("|---|---|---|---|---|---|---|---|---|")
        for i, rs in enumerate(res["cold_rows"], 1):
            mm = {k: med([r[k] for r in rs]) for k in ("blocked", "total", "raw", "memcpy", "warm")}
            print(f"| {i} | {mm['blocked']:.3f} | {mm['total']:.3f} | {mm['raw']:.3f} | {mm['memcpy']:.3f} | "
                  f"{med([r['blocked'] / r['raw'] for r in rs]):.2f}x | {med([r['total'] / r['raw'] for r in rs]):.2f}x"
                  f" | {max(r['peak'].increase for r in rs) / state_bytes:.3f} | {mm['warm']:.2f} |")
        print()
        print(f"- mtc bytes written per timed save: {res['written']} (state {state_bytes})")
        print(f"- peak RSS increase / state, first save: {cold_peak.increase / state_bytes:.3f} "
              f"({cold_peak.increase / 2**20:.1f} MiB over {cold_peak.base / 2**20:.1f} MiB; mapped ramdisk pages count)")

        crows = res["cold_rows"]
        ratio(kind, f"first {KEEP + 1} saves: blocked / raw write into fresh files (worst save, median of runs)",
              max(med([r["blocked"] / r["raw"] for r in rs]) for rs in crows), 1.0, T_COLD_BLOCKED)
        ratio(kind, f"first {KEEP + 1} saves: total / raw write into fresh files (worst save, median of runs)",
              max(med([r["total"] / r["raw"] for r in rs]) for rs in crows), 1.0, T_COLD_TOTAL)
        total = m["mtc_total"]
        ratio(kind, "mtc save total / raw write into recycled files (the fair limit)", total, raw_rec, T_SAVE_VS_RAW)
        ratio(kind, "mtc save total / raw write into fresh files (first-touch)", total, raw_fresh, T_SAVE_VS_RAW)
        ratio(kind, "mtc restore / raw read", m["mtc_restore"], raw_r, T_RESTORE_VS_RAW)
        if "rcm_save" in R:
            ratio(kind, "mtc save total / Orbax ReplicatorCheckpointManager default", total, m["rcm_save"],
                  T_VS_RCM_DEFAULT)
        if "rcm_unc_save" in R:
            ratio(kind, "mtc save total / Orbax ReplicatorCheckpointManager, compression off", total,
                  m["rcm_unc_save"], T_VS_RCM_RAW)
        if "rcm_restore" in R:
            ratio(kind, "mtc restore / Orbax ReplicatorCheckpointManager default", m["mtc_restore"], m["rcm_restore"],
                  T_VS_RCM_DEFAULT, info=True)
        if "rcm_unc_restore" in R:
            ratio(kind, "mtc restore / Orbax ReplicatorCheckpointManager, compression off", m["mtc_restore"],
                  m["rcm_unc_restore"], T_VS_RCM_RAW, info=True)
        if "std_save" in R:
            ratio(kind, "mtc save / orbax default save", total, m["std_save"], T_VS_ORBAX_DEFAULT)
            ratio(kind, "mtc save / orbax uncompressed save", total, m["unc_save"], T_VS_ORBAX_RAW)
        over = (m["mtc_blocked"] - m["memcpy"]) * 1e3
        name = "mtc save blocked - memcpy"
        checks.setdefault(name, {})[kind] = (f"{over:+.1f} ms ({m['mtc_blocked'] / m['memcpy']:.2f}x)",
                                             over <= T_BLOCKED_OVER_MEMCPY_MS)
        targets[name] = f"<= +{T_BLOCKED_OVER_MEMCPY_MS:.0f} ms"
        cold = max(r["peak"].increase for rs in res["cold_rows"] for r in rs) / state_bytes
        name = f"peak RSS increase / state, first {KEEP + 1} saves (max)"
        checks.setdefault(name, {})[kind] = (f"{cold:.3f}", cold <= T_PEAK_RSS)
        targets[name] = f"<= {T_PEAK_RSS:.2f}"
        steady = max(R["mtc_rss"])
        name = "peak RSS increase / state, later saves (max)"
        checks.setdefault(name, {})[kind] = (f"{steady:.3f}", steady <= T_PEAK_RSS_STEADY)
        targets[name] = f"<= {T_PEAK_RSS_STEADY:.2f}"
        name = "dedupe: bytes written for unchanged state"
        checks.setdefault(name, {})[kind] = (f"{dd_written}", dd_written == 0)
        targets[name] = "0"
        print(f"- raw limits: write into recycled files {raw_rec:.3f} s ({state_bytes / raw_rec / GB:.2f} GB/s), "
              f"into fresh files {raw_fresh:.3f} s ({state_bytes / raw_fresh / GB:.2f} GB/s), read {raw_r:.3f} s "
              f"({state_bytes / raw_r / GB:.2f} GB/s); each the best of 1 and {ncpu} threads")

    kinds = [k for k, _, _ in ramdisks]
    print()
    print("## Ratios and targets (each measured within one ramdisk's interleaved repeats)")
    print()
    print("| check | " + " | ".join(f"{k} pages" for k in kinds) + " | target |")
    print("|---|" + "---|" * len(kinds) + "---|")
    for name, per in checks.items():
        cells = []
        for k in kinds:
            if k not in per:
                cells.append("")
                continue
            val, ok = per[k]
            cells.append(f"{val} {'info' if ok is None else 'PASS' if ok else 'MISS'}")
        print(f"| {name} | " + " | ".join(cells) + f" | {targets[name]} |")
    print()
    bitok = all(res["ok"] for res in results.values())
    for n in notes:
        print(f"- note: {n}")
    print(f"- bit for bit: {'ok' if bitok else 'FAILED'} (mtc restores compared with the saved state as uint8)")
    print(f"- wall time {time.perf_counter() - t_start:.1f} s")
    sys.stdout.flush()
    if not bitok:
        return 1
    if args.strict and not all(ok for per in checks.values() for _, ok in per.values() if ok is not None):
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
