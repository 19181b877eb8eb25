"""``mtc size``: the ramdisk size per host, and with ``--ramdisk DIR`` whether DIR fits and is fast."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from mtc.shared.errors import ConfigError
from mtc.shared.sizing import format_bytes, ramdisk_size


def cmd_size(args: argparse.Namespace) -> int:
    try:
        size = ramdisk_size(args.params, args.hosts, buffer=args.buffer,
                            bytes_per_param=args.bytes_per_param, steps_kept=args.steps_kept,
                            peer_copies=args.peer_copies)
    except ConfigError as e:
        print(f"mtc size: error: {e}", file=sys.stderr)
        return 2
    check = _check_ramdisk(args.ramdisk, size.required_bytes) if args.ramdisk is not None else None
    if check is not None and "error" in check:
        print(f"mtc size: error: {check['error']}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**size.to_dict(), **({"ramdisk": check} if check else {})}, indent=2))
        return 1 if check and not check["fits"] else 0
    print("Ramdisk per host (MaxText multi-tier checkpointing guide):")
    for line in size.explain():
        print("  " + line)
    print(f"Ramdisk per host: {format_bytes(size.required_bytes)} "
          f"({size.required_bytes:,} bytes)")
    print(f"Kubernetes sizeLimit: {size.size_limit} (rounded up; "
          f"{size.size_limit_bytes:,} bytes)")
    if check is None:
        return 0
    print(f"Ramdisk {check['path']}: {check['fstype'] or 'unknown filesystem'} at {check['mountpoint'] or '?'}"
          f"{', huge=' + check['huge'] if check['huge'] else ''}, {format_bytes(check['total_bytes'])} in all, "
          f"{format_bytes(check['free_bytes'])} free")
    if check["advice"]:
        print(f"  advice: {check['advice']}")
    if not check["fits"]:
        print(f"mtc size: {check['path']} is too small: {format_bytes(size.required_bytes)} needed per host, "
              f"the filesystem holds {format_bytes(check['total_bytes'])}; raise the tmpfs size= "
              f"(Kubernetes: the emptyDir sizeLimit and the pod's memory limit)", file=sys.stderr)
        return 1
    print("  fits")
    return 0


def _check_ramdisk(path: Path, required: int) -> dict:
    """The mount, room and advice for ramdisk directory ``path`` (``{"error"}`` if unreadable)."""
    from mtc.shared import ramdisk

    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent  # a directory mtc would create: measure the filesystem it would be on
    if path.exists() and not path.is_dir():
        return {"error": f"--ramdisk {path} is not a directory"}
    if probe != path:
        m = ramdisk.describe(probe)
        if not (m and m.fstype == "tmpfs"):  # created on a disk, not in a ramdisk: almost surely a typo
            return {"error": f"--ramdisk {path} does not exist, and would be created on {probe} "
                             f"({m.fstype if m else 'unknown filesystem'}), which is not a ramdisk; mount the "
                             "ramdisk (e.g. mount -t tmpfs -o size=64g,huge=within_size tmpfs DIR) and pass its path"}
    try:
        st = os.statvfs(probe)
    except OSError as e:
        return {"error": f"cannot read the filesystem of {path}: {e}"}
    m = ramdisk.describe(path)
    total = st.f_blocks * st.f_frsize
    return {"path": str(path), "mountpoint": m.mountpoint if m else "", "fstype": m.fstype if m else "",
            "huge": m.huge if m else "", "total_bytes": total, "free_bytes": st.f_bavail * st.f_frsize,
            "fits": total >= required, "advice": ramdisk.advice(path)}
