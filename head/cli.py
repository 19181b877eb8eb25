"""The ``mtc`` command line.

Subcommands:

- ``mtc size --params 70e9 --hosts 32``: ramdisk size per host, with the steps of the
  calculation and a Kubernetes ``sizeLimit``.
- ``mtc demo``: a small training run with a crash and a restore (``mtc.head.demo``).

``python -m mtc.head.cli ...`` works the same as ``mtc ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from mtc.shared.errors import ConfigError
from mtc.shared.sizing import format_bytes, ramdisk_size

_SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default: ``sys.argv[1:]``); returns the exit code.

    Usage errors (bad options or values) return 2 rather than raising SystemExit, so the
    function can be called in-process.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits on --help (0) and on usage errors (2)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if not hasattr(args, "func"):
        parser.print_help(sys.stderr)
        return 2
    return args.func(args)


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of `mtc` (subcommands size and demo)."""
    parser = argparse.ArgumentParser(prog="mtc", description="Multi-tier checkpointing tools.")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")

    size = sub.add_parser(
        "size", help="ramdisk size per host",
        description="Ramdisk size per host: params x bytes-per-param / hosts x steps kept "
                    "x (1 + buffer), as in the MaxText multi-tier checkpointing guide.")
    size.add_argument("--params", type=_count, required=True,
                      help="model parameters, e.g. 70e9 or 70B (suffixes K, M, B, T)")
    size.add_argument("--hosts", type=int, required=True, help="hosts in the slice")
    size.add_argument("--buffer", type=float, default=0.15,
                      help="safety buffer as a fraction, 0..1 (default 0.15)")
    size.add_argument("--bytes-per-param", type=float, default=12,
                      help="checkpoint bytes per parameter, weights and optimizer state "
                           "(default 12)")
    size.add_argument("--steps-kept", type=int, default=2,
                      help="steps the ramdisk holds at once (default 2: one committed, "
                           "one being written)")
    size.add_argument("--ramdisk", type=Path, metavar="DIR",
                      help="also check this ramdisk directory: its filesystem, page size and room "
                           "(exit status 1 when it is too small)")
    size.add_argument("--json", action="store_true", help="print JSON instead of text")
    size.set_defaults(func=_cmd_size)

    demo = sub.add_parser("demo", help="run a small training job with a crash and a restore")
    demo.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    demo.add_argument("--period", type=int, default=5,
                      help="local checkpoint period in steps (default 5)")
    # None here, a fresh directory in the handler: a default computed while building the
    # parser would create a temp dir on every `mtc` invocation.
    demo.add_argument("--workdir", type=Path, default=None,
                      help="working directory (default: a fresh directory in /dev/shm, else in the temp directory)")
    demo.add_argument("--crash-at", type=int, default=17,
                      help="step at which to kill a host (default 17)")
    demo.set_defaults(func=_cmd_demo)

    rv = sub.add_parser(
        "restore-version", help="pin restore to one backup (restore.version)",
        description="Show the backups and the restore.version file, pin restore to one backup "
                    "(set NAME), or unpin it (clear). The backup root is "
                    "<base_output_directory>/<run_name>/mtc, or --backup-root.")
    rv.add_argument("action", choices=["show", "set", "clear"])
    rv.add_argument("name", nargs="?", help="backup name, as `show` lists it (for set)")
    rv.add_argument("--backup-root", help="backup root URL or path (gs://bucket/run/mtc or a directory)")
    rv.add_argument("--base-output-directory", default="", help="MaxText base_output_directory")
    rv.add_argument("--run-name", default="", help="MaxText run_name")
    rv.set_defaults(func=_cmd_restore_version)
    return parser


def _count(text: str) -> float:
    """A number, with an optional K/M/B/T suffix: ``70e9``, ``70B``, ``1.5T``."""
    t = text.strip().lower()
    scale = 1
    if t and t[-1] in _SUFFIXES:
        t, scale = t[:-1], _SUFFIXES[t[-1]]
    try:
        return float(t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number (e.g. 70e9 or 70B)") from None


def _cmd_size(args: argparse.Namespace) -> int:
    try:
        size = ramdisk_size(args.params, args.hosts, buffer=args.buffer,
                            bytes_per_param=args.bytes_per_param, steps_kept=args.steps_kept)
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
    try:
        st = os.statvfs(probe)
    except OSError as e:
        return {"error": f"cannot read the filesystem of {path}: {e}"}
    m = ramdisk.describe(path)
    total = st.f_blocks * st.f_frsize
    return {"path": str(path), "mountpoint": m.mountpoint if m else "", "fstype": m.fstype if m else "",
            "huge": m.huge if m else "", "total_bytes": total, "free_bytes": st.f_bavail * st.f_frsize,
            "fits": total >= required, "advice": ramdisk.advice(path)}


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.workdir is None:  # on the machine's ramdisk when it has one, as a real job would be
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        args.workdir = Path(tempfile.mkdtemp(prefix="mtc-demo-", dir=shm))
    # Imported on use: only this command needs the demo (and whatever it imports).
    from mtc.head import demo

    rc = demo.main(args)
    return 0 if rc is None else int(rc)


def _cmd_restore_version(args: argparse.Namespace) -> int:
    from mtc.shared import backup_layout as layout
    from mtc.shared.config import MTCConfig
    from mtc.shared.objstore import ObjectNotFoundError, StoreError, open_store

    try:
        root = args.backup_root or MTCConfig(base_output_directory=args.base_output_directory,
                                             run_name=args.run_name).backup_root
        store = open_store(root)
    except ConfigError as e:
        print(f"mtc restore-version: error: {e} (or pass --backup-root)", file=sys.stderr)
        return 2
    try:
        names = layout.names_from_listing(store.list(layout.BACKUPS))
        try:
            current = store.get_bytes(layout.RESTORE_VERSION).decode().strip()
        except ObjectNotFoundError:
            current = None
        if args.action == "show":
            print(f"backups in {root} (newest first):")
            for n in names:
                print(f"  {n}  step {layout.parse_backup_name(n)}" + ("  <- restore.version" if n == current else ""))
            if not names:
                print("  (none)")
            print(f"restore.version: {current if current else 'not set (restore takes the newest step)'}")
            if current and current not in names:
                print("warning: restore.version names a backup that does not exist; restore will fail "
                      "until it is fixed or cleared", file=sys.stderr)
            return 0
        if args.action == "clear":
            store.delete(layout.RESTORE_VERSION)
            print(f"restore.version removed from {root}: restore takes the newest step")
            return 0
        if not args.name:
            print("mtc restore-version set: give the backup NAME (see `mtc restore-version show`)", file=sys.stderr)
            return 2
        try:
            layout.parse_backup_name(args.name)
        except ConfigError as e:
            print(f"mtc restore-version: error: {e}", file=sys.stderr)
            return 2
        if args.name not in names:
            print(f"mtc restore-version: error: no backup {args.name!r} in {root}; "
                  f"backups: {', '.join(names[:5]) or 'none'}", file=sys.stderr)
            return 2
        store.put_bytes(layout.RESTORE_VERSION, (args.name + "\n").encode())
        print(f"restore.version in {root} now pins {args.name} (step {layout.parse_backup_name(args.name)})")
        return 0
    except StoreError as e:
        print(f"mtc restore-version: error: {e}", file=sys.stderr)
        return 1
    finally:
        store.close()


if __name__ == "__main__":
    sys.exit(main())
