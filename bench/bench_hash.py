"""Why blob names are xxh3-128: hash throughput against writing the same bytes to tmpfs, and what a
keyed cryptographic blob name would cost instead.

    python bench/bench_hash.py [--mib 64,1024] [--repeats 3]

For each buffer size (random bytes), prints:

1. GB/s of each candidate and its cost as a fraction of a tmpfs write of the same bytes.
2. The keyed cryptographic candidates (keyed BLAKE3 on one thread and on all cores, HMAC-SHA256,
   plain SHA-256, keyed BLAKE2b) against xxh3-128 and against a plain memory copy of the same
   bytes (numpy copy into a buffer already faulted in: the memory-bandwidth limit a hash runs
   against), each hashed in one call and in the 8 MiB updates a save hashes in while it writes
   (FILL_CHUNK, sidecar/ram/mapped.py), and the seconds each adds to a save of 1 GiB per host
   over xxh3-128.

All on one core except the row marked "all cores", all measured in this run.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import tempfile
import time
import zlib

import numpy as np
import xxhash

from mtc.shared.hashing import blob_name
from mtc.sidecar.ram.mapped import FILL_CHUNK

try:
    import blake3
except ImportError:  # optional: the bench extra installs it
    blake3 = None

GIB = 1 << 30
NAME_BYTES = 16  # blob names stay 32 hex digits, whichever hash makes them


def best(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def chunks(mv: memoryview, size: int = FILL_CHUNK):
    for off in range(0, mv.nbytes, size):
        yield mv[off:off + size]


def streamed(new):
    """A function hashing ``mv`` in FILL_CHUNK updates with the hasher ``new()`` returns."""
    def run(mv):
        h = new()
        for c in chunks(mv):
            h.update(c)
        return h.digest()
    return run


def keyed_candidates(key: bytes):
    """(name, one-shot fn(mv), streamed fn(mv)) of each candidate; xxh3-128 first (the baseline)."""
    rows = [("xxh3_128 (today)", blob_name, streamed(xxhash.xxh3_128))]
    if blake3 is not None:
        rows += [
            ("blake3 keyed, 1 thread",
             lambda mv: blake3.blake3(mv, key=key).digest(NAME_BYTES),
             streamed(lambda: blake3.blake3(key=key))),
            ("blake3 keyed, all cores",
             lambda mv: blake3.blake3(mv, key=key, max_threads=blake3.blake3.AUTO).digest(NAME_BYTES),
             streamed(lambda: blake3.blake3(key=key, max_threads=blake3.blake3.AUTO))),
        ]
    rows += [
        ("hmac-sha256",
         lambda mv: hmac.new(key, mv, hashlib.sha256).digest()[:NAME_BYTES],
         streamed(lambda: hmac.new(key, digestmod=hashlib.sha256))),
        ("sha256 (unkeyed)",
         lambda mv: hashlib.sha256(mv).digest()[:NAME_BYTES],
         streamed(hashlib.sha256)),
        ("blake2b keyed",
         lambda mv: hashlib.blake2b(mv, key=key, digest_size=NAME_BYTES).digest(),
         streamed(lambda: hashlib.blake2b(key=key, digest_size=NAME_BYTES))),
    ]
    return rows


def tmpfs_table(mv: memoryview, n: int, mib: int, directory: str | None, repeats: int) -> None:
    def write():
        with tempfile.NamedTemporaryFile(dir=directory) as f:
            f.write(mv)

    t_write = best(write, repeats)
    rows = [
        ("xxh3_128 (chosen)", lambda: xxhash.xxh3_128_hexdigest(mv)),
        ("xxh3_64", lambda: xxhash.xxh3_64_hexdigest(mv)),
        ("crc32 (zlib)", lambda: zlib.crc32(mv)),
        ("blake2b", lambda: hashlib.blake2b(mv).hexdigest()),
        ("sha256", lambda: hashlib.sha256(mv).hexdigest()),
    ]
    print(f"{mib} MiB random bytes; tmpfs write {n / t_write / 1e9:.2f} GB/s")
    print(f"{'hash':20s} {'GB/s':>8s} {'cost vs tmpfs write':>20s}")
    for name, fn in rows:
        t = best(fn, repeats)
        print(f"{name:20s} {n / t / 1e9:8.2f} {t / t_write:19.1%}")


def keyed_table(data: np.ndarray, mv: memoryview, n: int, mib: int, repeats: int) -> None:
    dst = np.ones_like(data)  # faulted in: the copy measures memory bandwidth, not page faults
    t_copy = best(lambda: np.copyto(dst, data), repeats)
    del dst
    key = os.urandom(32)
    scale = GIB / n  # seconds for this buffer -> seconds for 1 GiB
    print()
    print(f"{mib} MiB random bytes, keyed candidates; memory copy (numpy) {n / t_copy / 1e9:.2f} GB/s; "
          f"{FILL_CHUNK >> 20} MiB updates = as a save hashes while it writes")
    head = (f"| {'hash':24s} | {'GB/s':>6s} | {'time / xxh3':>11s} | {'time / memcpy':>13s} | "
            f"{'+s per 1 GiB save':>17s} | {'GB/s, updates':>13s} | {'+s per 1 GiB, updates':>21s} |")
    print(head)
    print("|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|")
    base = base_s = None
    for name, one, upd in keyed_candidates(key):
        t = best(lambda: one(mv), repeats)
        ts = best(lambda: upd(mv), repeats)
        if base is None:
            base, base_s = t, ts
        print(f"| {name:24s} | {n / t / 1e9:6.2f} | {t / base:10.1f}x | {t / t_copy:12.1f}x | "
              f"{(t - base) * scale:17.3f} | {n / ts / 1e9:13.2f} | {(ts - base_s) * scale:21.3f} |")
    if blake3 is None:
        print("blake3 rows skipped: pip install blake3 (or the bench extra: pip install -e '.[bench]')")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", default="64,1024", help="buffer sizes in MiB, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="best of this many runs per row")
    p.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    a = p.parse_args()
    sizes = [int(s) for s in str(a.mib).split(",") if s.strip()]
    if blake3 is None:
        print("blake3 is not installed: pip install blake3 (its rows are skipped)")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"{cpus} CPUs; blake3 {getattr(blake3, '__version__', 'absent')}; xxhash {xxhash.VERSION}")
    for i, mib in enumerate(sizes):
        data = np.random.default_rng(i).integers(0, 256, mib << 20, dtype=np.uint8)
        mv = memoryview(data)
        n = data.nbytes
        if i:
            print()
        tmpfs_table(mv, n, mib, a.dir, a.repeats)
        keyed_table(data, mv, n, mib, a.repeats)
        del mv, data


if __name__ == "__main__":
    main()
