"""Blob names: the content hash of a shard's bytes.

xxh3-128 was chosen by measurement: bench/bench_hash.py hashes the same random bytes on one core
with each candidate (xxh3-128, xxh3-64, crc32, blake2b, sha256, and, keyed, BLAKE3, BLAKE2b and
HMAC-SHA256) and compares each with a tmpfs write of those bytes. xxh3-128 runs about as fast as
the copy, so every write and every read can be hashed; keyed BLAKE3 adds ~0.09 s per GiB on one
core. It is not a cryptographic hash: it guards against corruption and serves deduplication. What
an adversary who can write the bucket could do with it, and why the names stay xxh3-128, is in
docs/architecture.md (What mtc trusts from shared storage): the manifests that name the blobs are
sealed with the job key. 128 bits make accidental collisions negligible (2^-64 at 2^32 blobs).
"""

from __future__ import annotations

import re

import xxhash

HASH_NAME = "xxh3_128"
HEX_LEN = 32
_BLOB_RE = re.compile(r"[0-9a-f]{32}")


def new_hasher() -> "xxhash.xxh3_128":
    return xxhash.xxh3_128()


def blob_name(data) -> str:
    """The blob name of a bytes-like object (hex of its xxh3-128)."""
    return xxhash.xxh3_128_hexdigest(data)


def is_blob_name(name: str) -> bool:
    """True when `name` is a well-formed blob name (and so safe as a file name)."""
    return isinstance(name, str) and bool(_BLOB_RE.fullmatch(name))


def check_blob_name(name: str) -> str:
    if not is_blob_name(name):
        raise ValueError(f"invalid blob name {name!r}: expected {HEX_LEN} lowercase hex digits")
    return name
