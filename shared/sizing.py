"""Ramdisk size per host, by the MaxText guide's rule of thumb (README, "The ramdisk").

A full checkpoint (weights and optimizer state) is about ``parameters x 12`` bytes; each
host of a slice holds ``1 / hosts`` of it; the ramdisk holds two steps (the one being
written and the last committed one); and a 10-15 % buffer goes on top. For 70e9 parameters
on 32 hosts with a 15 % buffer: 840 GB, 26.25 GB, 52.5 GB, 60.375 GB per host.

The arithmetic is exact (fractions), so that the result can be rounded *up* safely for a
Kubernetes ``sizeLimit`` and quoted in "ramdisk full" errors.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any

from mtc.shared.errors import ConfigError

GB = 10**9  # the guide's unit (decimal)
GIB = 2**30  # Kubernetes quantities are written in binary units ("Gi")
MIB = 2**20


@dataclass(frozen=True)
class RamdiskSize:
    """The inputs and each step of the ramdisk sizing, in bytes.

    ``checkpoint_bytes`` = params x bytes_per_param; ``shard_bytes`` = checkpoint / hosts
    (one step on one host); ``kept_bytes`` = shard x steps_kept; ``required_bytes`` =
    kept x (1 + buffer), rounded up to a whole byte.
    """

    params: float
    hosts: int
    buffer: float
    bytes_per_param: float
    steps_kept: int
    checkpoint_bytes: float
    shard_bytes: float
    kept_bytes: float
    required_bytes: int
    peer_copies: int = 0

    @property
    def size_limit_bytes(self) -> int:
        """``required_bytes`` rounded up to whole GiB (whole MiB below 1 GiB)."""
        unit = GIB if self.required_bytes >= GIB else MIB
        return -(-self.required_bytes // unit) * unit

    @property
    def size_limit(self) -> str:
        """A Kubernetes quantity for ``emptyDir.sizeLimit``, rounded up, e.g. ``"57Gi"``."""
        if self.size_limit_bytes >= GIB:
            return f"{self.size_limit_bytes // GIB}Gi"
        return f"{self.size_limit_bytes // MIB}Mi"

    def explain(self) -> list[str]:
        """The calculation, one line per step, for people (CLI output, error messages)."""
        hosts = f"{self.hosts} host" + ("s" if self.hosts != 1 else "")
        ckpt, shard = format_bytes(self.checkpoint_bytes), format_bytes(self.shard_bytes)
        kept, required = format_bytes(self.kept_bytes), format_bytes(self.required_bytes)
        rows = [
            ("checkpoint",
             f"{_count(self.params)} params x {self.bytes_per_param:g} bytes = {ckpt}"),
            ("per-host shard", f"{ckpt} / {hosts} = {shard}"),
            (f"x {self.steps_kept} steps kept", f"{shard} x {self.steps_kept} = {kept}") if not self.peer_copies else
            (f"x {self.steps_kept} steps x (1 + {self.peer_copies} peer cop{'y' if self.peer_copies == 1 else 'ies'})",
             f"{shard} x {self.steps_kept} x {1 + self.peer_copies} = {kept}"),
            (f"+ {self.buffer * 100:g}% buffer",
             f"{kept} x {1 + self.buffer:g} = {required} ({self.required_bytes:,} bytes)"),
        ]
        width = max(len(label) for label, _ in rows)
        return [f"{label.ljust(width)}  {text}" for label, text in rows]

    def to_dict(self) -> dict[str, Any]:
        """The fields plus ``size_limit`` and ``size_limit_bytes`` (JSON-ready)."""
        d = asdict(self)
        d["size_limit"] = self.size_limit
        d["size_limit_bytes"] = self.size_limit_bytes
        return d


def ramdisk_size(params: float, hosts: int, buffer: float = 0.15, bytes_per_param: float = 12,
                 steps_kept: int = 2, peer_copies: int = 0) -> RamdiskSize:
    """Ramdisk needed on each host for a model of ``params`` parameters over ``hosts`` hosts.

    ``peer_copies``: copies of other hosts' shards each host keeps for the peer tier, beyond
    the guide's rule: 0 when the slices are data-parallel twins (the twins are the copies),
    ``replication_factor - 1`` when the job has one slice.

    Raises ConfigError (a ValueError) when params <= 0, hosts < 1, buffer is outside 0..1,
    bytes_per_param <= 0, steps_kept < 1 or peer_copies < 0.
    """
    p = _positive("params", params)
    bpp = _positive("bytes_per_param", bytes_per_param)
    if not _whole(hosts) or hosts < 1:
        raise ConfigError(f"hosts={hosts!r} must be a whole number >= 1 (hosts in the slice)")
    if not _whole(steps_kept) or steps_kept < 1:
        raise ConfigError(f"steps_kept={steps_kept!r} must be a whole number >= 1")
    if not _whole(peer_copies) or peer_copies < 0:
        raise ConfigError(f"peer_copies={peer_copies!r} must be a whole number >= 0 (replication_factor - 1 "
                          "with one slice, 0 with data-parallel slices)")
    b = _exact("buffer", buffer)
    if not 0 <= b <= 1:
        raise ConfigError(f"buffer={buffer!r} must be between 0 and 1 (e.g. 0.15 for 15%)")

    checkpoint = p * bpp
    shard = checkpoint / int(hosts)
    kept = shard * int(steps_kept) * (1 + int(peer_copies))
    required = math.ceil(kept * (1 + b))
    return RamdiskSize(
        params=float(params), hosts=int(hosts), buffer=float(buffer),
        bytes_per_param=float(bytes_per_param), steps_kept=int(steps_kept),
        checkpoint_bytes=float(checkpoint), shard_bytes=float(shard), kept_bytes=float(kept),
        required_bytes=required, peer_copies=int(peer_copies))


def format_bytes(n: float) -> str:
    """Decimal units like the guide (1 GB = 10^9 bytes), at most two decimals: ``"26.25 GB"``."""
    for unit, name in ((10**15, "PB"), (10**12, "TB"), (GB, "GB"), (10**6, "MB"), (10**3, "kB")):
        if n >= unit:
            return f"{_trim(n / unit)} {name}"
    return f"{_trim(n)} B"


def _trim(x: float) -> str:
    text = f"{x:.2f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _count(x: float) -> str:
    return f"{int(x):,}" if float(x).is_integer() else f"{x:,}"


def _whole(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _exact(name: str, x: Any) -> Fraction:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise ConfigError(f"{name}={x!r} must be a number")
    if isinstance(x, numbers.Integral):
        return Fraction(int(x))
    if not math.isfinite(float(x)):
        raise ConfigError(f"{name}={x!r} must be a finite number")
    # repr gives the shortest decimal that round-trips, so 0.15 means 15/100, not the
    # binary float just below it (which would round 60,375,000,000 bytes the wrong way).
    return Fraction(repr(float(x)))


def _positive(name: str, x: Any) -> Fraction:
    value = _exact(name, x)
    if value <= 0:
        raise ConfigError(f"{name}={x!r} must be > 0")
    return value
