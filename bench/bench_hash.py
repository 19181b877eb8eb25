"""Why blob names are xxh3-128: hash throughput against writing the same bytes to tmpfs.

    python bench/bench_hash.py [--mib 512]

Prints GB/s of each candidate and its cost as a fraction of a tmpfs write of the same bytes,
all measured in this run.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
import zlib

import numpy as np
import xxhash


def best(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    a = p.parse_args()
    data = np.random.default_rng(0).integers(0, 256, a.mib << 20, dtype=np.uint8)
    mv = memoryview(data)
    n = data.nbytes

    def write():
        with tempfile.NamedTemporaryFile(dir=a.dir) as f:
            f.write(mv)

    t_write = best(write)
    rows = [
        ("xxh3_128 (chosen)", lambda: xxhash.xxh3_128_hexdigest(mv)),
        ("xxh3_64", lambda: xxhash.xxh3_64_hexdigest(mv)),
        ("crc32 (zlib)", lambda: zlib.crc32(mv)),
        ("blake2b", lambda: hashlib.blake2b(mv).hexdigest()),
        ("sha256", lambda: hashlib.sha256(mv).hexdigest()),
    ]
    print(f"{a.mib} MiB random bytes; tmpfs write {n / t_write / 1e9:.2f} GB/s")
    print(f"{'hash':20s} {'GB/s':>8s} {'cost vs tmpfs write':>20s}")
    for name, fn in rows:
        t = best(fn)
        print(f"{name:20s} {n / t / 1e9:8.2f} {t / t_write:19.1%}")


if __name__ == "__main__":
    main()
