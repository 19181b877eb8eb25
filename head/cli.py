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
    size.add_argument("--json", action="store_true", help="print JSON instead of text")
    size.set_defaults(func=_cmd_size)

    demo = sub.add_parser("demo", help="run a small training job with a crash and a restore")
    demo.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    demo.add_argument("--period", type=int, default=5,
                      help="local checkpoint period in steps (default 5)")
    # None here, a fresh directory in the handler: a default computed while building the
    # parser would create a temp dir on every `mtc` invocation.
    demo.add_argument("--workdir", type=Path, default=None,
                      help="working directory (default: a fresh temporary directory)")
    demo.add_argument("--crash-at", type=int, default=17,
                      help="step at which to kill a host (default 17)")
    demo.set_defaults(func=_cmd_demo)
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
    if args.json:
        print(json.dumps(size.to_dict(), indent=2))
        return 0
    print("Ramdisk per host (MaxText multi-tier checkpointing guide):")
    for line in size.explain():
        print("  " + line)
    print(f"Ramdisk per host: {format_bytes(size.required_bytes)} "
          f"({size.required_bytes:,} bytes)")
    print(f"Kubernetes sizeLimit: {size.size_limit} (rounded up; "
          f"{size.size_limit_bytes:,} bytes)")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.workdir is None:
        args.workdir = Path(tempfile.mkdtemp(prefix="mtc-demo-"))
    # Imported on use: only this command needs the demo (and whatever it imports).
    from mtc.head import demo

    rc = demo.main(args)
    return 0 if rc is None else int(rc)


if __name__ == "__main__":
    sys.exit(main())
