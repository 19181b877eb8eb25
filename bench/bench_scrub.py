"""The backup scrub's read rate against its bandwidth cap, on fake-gcs-server (in memory, localhost), one run.

    python bench/bench_scrub.py [--blobs 32] [--mib 8] [--caps 32,128]

Uploads the blobs, then has one host's scrubber (``mtc.sidecar.backup.scrub.Scrubber``, downloading
into a ramdisk temp file on tmpfs and hashing, as the sidecar does) check them all at each cap, and
once with no cap (what the store and the hashing allow). Prints the measured bytes/s against the cap.
The cap holds on average over a scrub: it pauses between blobs, so a blob itself comes at full speed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import uuid
from pathlib import Path

from bench_backup_store import start_fake_gcs
from mtc.shared import backup_layout as layout
from mtc.shared.hashing import blob_name
from mtc.shared.objstore.gcs import make_client
from mtc.shared.objstore import open_store
from mtc.sidecar.backup.scrub import Scrubber
from mtc.sidecar.ram import RamStore

MIB = 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blobs", type=int, default=32)
    ap.add_argument("--mib", type=int, default=8, help="MiB per blob")
    ap.add_argument("--caps", default="32,128", help="caps to measure, MiB/s, comma-separated")
    a = ap.parse_args()
    proc, url = start_fake_gcs()
    os.environ["STORAGE_EMULATOR_HOST"] = url
    base = Path(tempfile.mkdtemp(prefix="mtc-bench-scrub-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        make_client().create_bucket(bucket)
        store = open_store(f"gs://{bucket}/run/mtc")
        blobs = []
        for i in range(a.blobs):
            data = os.urandom(a.mib * MIB)
            name = blob_name(data)
            store.put_bytes(layout.blob_object(name), data)
            blobs.append(name)
        ram = RamStore(base / "ram")
        scrubber = Scrubber(store, ram, "bench")
        total = a.blobs * a.mib * MIB
        print(f"{a.blobs} blobs x {a.mib} MiB = {total / MIB:.0f} MiB on fake-gcs-server ({url})")
        for cap in [float(c) * MIB for c in a.caps.split(",")] + [float("inf")]:
            out = scrubber.check(blobs, cap if cap != float("inf") else 1e15)
            assert out["bytes"] == total and not out["bad"] and not out["missing"], out
            rate = out["bytes"] / out["seconds"]
            what = "no cap" if cap == float("inf") else f"cap {cap / MIB:7.1f} MiB/s"
            ratio = "" if cap == float("inf") else f"  ({rate / cap:.3f} of the cap)"
            print(f"{what}: measured {rate / MIB:7.1f} MiB/s over {out['seconds']:.2f} s{ratio}")
        store.close()
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
