"""Backup tier end to end vs the raw GCS client, in one run, against fake-gcs-server.

    python bench/bench_backup.py [--gib 1.0] [--threads 4]

1. mtc: save a --gib state (8 CPU devices, colocated mode) with a backup due; time the
   backup (uploads from the ramdisk + the create-only manifest), then wipe the ramdisk and
   time restore() from the backup (downloads, verified, then the usual restore).
2. raw: the google-cloud-storage client uploading the same blob files with --threads threads
   (the tier uses 4 per host), and downloading them again into files on the same tmpfs.
Prints GB/s and the mtc / raw ratios (target >= 0.8x of the raw rate).
"""

from __future__ import annotations

import argparse
import os
import sys

if "jax" not in sys.modules:
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from bench_backup_store import start_fake_gcs  # noqa: E402

from mtc.head import CheckpointManager, MTCConfig  # noqa: E402
from mtc.shared.objstore.gcs import make_client  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=4)
    a = p.parse_args()
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    work = Path(tempfile.mkdtemp(prefix="mtc-bench-backup-", dir=shm))
    proc, url = start_fake_gcs()
    os.environ["STORAGE_EMULATOR_HOST"] = url
    try:
        client = make_client(url)
        bucket_name = f"bench-{uuid.uuid4().hex[:8]}"
        bucket = client.create_bucket(bucket_name)
        n = int(a.gib * (1 << 30)) // 4 // 8 // 8 * 8
        sh = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
        rng = np.random.default_rng(0)
        state = {f"w{i}": jax.device_put(rng.standard_normal(n, dtype=np.float32), sh) for i in range(8)}
        nbytes = sum(x.nbytes for x in state.values())
        cfg = MTCConfig(local_checkpoint_directory=str(work / "ramdisk"), enable_multi_tier_checkpointing=True,
                        local_checkpoint_period=1, base_output_directory=f"gs://{bucket_name}", run_name="run",
                        multi_tier_checkpointing_backup_interval_steps=1)
        with CheckpointManager(cfg) as m:
            m.save(1, state)
            m.wait_until_finished()
            rep = m.wait_for_backup()
        if rep.error:
            raise SystemExit(f"backup failed: {rep.error}")
        blob_files = sorted((work / "ramdisk" / "mtc" / "blobs").glob("[0-9a-f]*"))
        raw_files = work / "raw"
        raw_files.mkdir()
        for f in blob_files:  # the raw client uploads the very same files, from the same tmpfs
            shutil.copyfile(f, raw_files / f.name)
        shutil.rmtree(work / "ramdisk")

        t0 = time.perf_counter()
        with CheckpointManager(cfg) as m:
            out = m.restore()
            jax.block_until_ready(out)
            rrep = m.last_restore_report
        t_restore = time.perf_counter() - t0
        ok = all(np.array_equal(np.asarray(out[k]).view(np.uint8), np.asarray(v).view(np.uint8))
                 for k, v in state.items())

        def up(f: Path) -> None:
            bucket.blob(f"raw/{f.name}").upload_from_filename(str(f))

        def down(f: Path) -> None:
            bucket.blob(f"raw/{f.name}").download_to_filename(str(raw_files / (f.name + ".down")))

        files = sorted(raw_files.iterdir())
        with ThreadPoolExecutor(a.threads) as pool:
            t0 = time.perf_counter()
            list(pool.map(up, files))
            t_up = time.perf_counter() - t0
            t0 = time.perf_counter()
            list(pool.map(down, files))
            t_down = time.perf_counter() - t0

        gb = nbytes / 1e9
        print(f"state {nbytes / (1 << 30):.2f} GiB, {len(blob_files)} blobs; fake-gcs-server (memory); "
              f"{os.cpu_count()} cores; restore bit for bit: {'ok' if ok else 'MISMATCH'}")
        print(f"{'what':44s} {'seconds':>8s} {'GB/s':>7s}")
        rows = [("mtc backup (uploads + manifest)", rep.seconds), (f"raw client upload, {a.threads} threads", t_up),
                ("mtc restore from backup (fetch + restore)", t_restore),
                (f"raw client download, {a.threads} threads", t_down)]
        for name, t in rows:
            print(f"{name:44s} {t:8.2f} {gb / t:7.3f}")
        print(f"backup rate / raw upload rate:   {t_up / rep.seconds:.2f}x (target >= 0.8x)")
        print(f"restore rate / raw download rate: {t_down / t_restore:.2f}x (target >= 0.8x)")
        print(f"uploaded bytes {rep.uploaded_bytes}; restore bytes by tier {rrep.bytes_by_tier}")
        if not ok:
            sys.exit(1)
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
