"""``mtc export`` against Orbax's own save of the same state from memory, and the physical limit.

    python bench/bench_export.py [--gib 1.0] [--max-memory-mib 256] [--dir /dev/shm]

One run. A state of --gib GiB (8 float32 arrays over 8 CPU devices, random) is saved to an mtc
ramdisk. Then, each in a fresh process (so that its peak RSS is its own):
- export: a new head opens the ramdisk and exports the step (``CheckpointManager.export``,
  at most --max-memory-mib of the state in memory at once), with and without ``verify``;
- orbax: the same state built in memory, then ``ocp.save_checkpointables(..., {"items": state})``,
  what MaxText's standard checkpointing does;
- raw: the same bytes written with ``write()`` into fresh files (the physical limit of writing).
Every output lands in --dir. Printed: seconds, GB/s, peak RSS and peak RSS above the process's
baseline (after imports and, for Orbax, after the state exists), and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, os, resource, sys, time
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

def rss_mib():  # current RSS
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

def peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

def make_state(gib):
    mesh = Mesh(np.array(jax.devices()).reshape(8), ("d",))
    n = int(gib * 2**30 / 4 / 8)
    rows = n // 1024
    rng = np.random.default_rng(0)
    return {f"w{i}": jax.device_put(rng.standard_normal((rows, 1024), dtype=np.float32), NamedSharding(mesh, P("d")))
            for i in range(8)}

mode, ramdisk, out, gib, max_mib = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5])
from mtc.head import CheckpointManager, MTCConfig
cfg = MTCConfig(local_checkpoint_directory=ramdisk, local_checkpoint_period=1)
res = {}
if mode == "save":
    with CheckpointManager(cfg) as m:
        m.save(1, make_state(gib)); m.wait_until_finished()
elif mode in ("export", "export-verify"):
    m = CheckpointManager(cfg)
    m.all_steps()
    base = rss_mib()
    t0 = time.perf_counter()
    rep = m.export(out, 1, max_bytes=max_mib << 20, verify=mode == "export-verify")
    res = {"seconds": time.perf_counter() - t0, "base_mib": base, "groups": rep.groups,
           "largest_group_mib": rep.largest_group_bytes / 2**20}
    m.close()
elif mode == "orbax":
    from orbax.checkpoint import v1 as ocp
    state = make_state(gib)
    jax.block_until_ready(state)
    base = rss_mib()
    t0 = time.perf_counter()
    ocp.save_checkpointables(out, {"items": state})
    res = {"seconds": time.perf_counter() - t0, "base_mib": base}
elif mode == "raw":
    state = {k: np.asarray(v) for k, v in make_state(gib).items()}
    base = rss_mib()
    os.makedirs(out)
    t0 = time.perf_counter()
    for k, a in state.items():
        with open(os.path.join(out, k), "wb") as f:
            f.write(memoryview(a).cast("B"))
    res = {"seconds": time.perf_counter() - t0, "base_mib": base}
res["peak_mib"] = peak_mib()
print("RESULT " + json.dumps(res))
"""


def child(mode: str, ramdisk: Path, out: Path, gib: float, max_mib: int) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, mode, str(ramdisk), str(out), str(gib), str(max_mib)],
                       capture_output=True, text=True, timeout=1800)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        raise SystemExit(f"{mode} failed ({r.returncode}):\n{r.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--max-memory-mib", type=int, default=256)
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mtc-bench-export-", dir=args.dir))
    try:
        ramdisk = work / "ramdisk"
        child("save", ramdisk, work / "unused", args.gib, args.max_memory_mib)
        rows = {}
        for mode in ("raw", "orbax", "export", "export-verify"):
            rows[mode] = child(mode, ramdisk, work / mode, args.gib, args.max_memory_mib)
        nbytes = args.gib * 2**30
        print(f"state {args.gib:g} GiB (8 x float32 arrays over 8 CPU devices), outputs in {args.dir or 'the temp dir'}; "
              f"export holds at most {args.max_memory_mib} MiB at once (max_bytes)")
        print(f"{'':14} {'seconds':>8} {'GB/s':>6} {'peak RSS MiB':>13} {'above base':>11}  note")
        for mode, r in rows.items():
            note = (f"{r['groups']} groups, largest {r['largest_group_mib']:.0f} MiB" if "groups" in r else
                    {"raw": "write() of the same bytes into fresh files", "orbax": "ocp.save_checkpointables from memory"}[mode])
            print(f"{mode:14} {r['seconds']:8.2f} {nbytes / r['seconds'] / 1e9:6.2f} {r['peak_mib']:13.0f} "
                  f"{r['peak_mib'] - r['base_mib']:11.0f}  {note}")
        e, o, w = rows["export"], rows["orbax"], rows["raw"]
        print(f"export / orbax save: time {e['seconds'] / o['seconds']:.2f}x, peak RSS {e['peak_mib'] / o['peak_mib']:.2f}x "
              f"(above base {(e['peak_mib'] - e['base_mib']) / max(1.0, o['peak_mib'] - o['base_mib']):.2f}x)")
        print(f"export / raw write: time {e['seconds'] / w['seconds']:.2f}x; orbax / raw write: "
              f"{o['seconds'] / w['seconds']:.2f}x")
        print(f"peak RSS of the export: {e['peak_mib']:.0f} MiB for a {nbytes / 2**20:.0f} MiB state "
              f"({e['peak_mib'] / (nbytes / 2**20):.2f}x the state; Orbax's save needs the state in memory: "
              f"{o['peak_mib'] / (nbytes / 2**20):.2f}x)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
