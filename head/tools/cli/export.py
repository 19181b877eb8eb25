"""``mtc export``: a step of a job as a standard Orbax checkpoint, MaxText's layout.

    mtc export --to DIR [--step N] [--verify] (--local-checkpoint-directory DIR... | --cluster-spec FILE)
               [--base-output-directory B --run-name R]

Sources, as for ``mtc status``: the ramdisk folders of a stopped job (a sidecar daemon on each
for the time of the export), a running local cluster's spec (read-only: the running head keeps
the hosts, so only what they hold and the backups are read), or, with neither, the backup tier
alone (one daemon on a scratch folder, ``--scratch``, that the restore fills from the backup).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from mtc.shared.errors import ConfigError

# The local_max_to_keep the export configures the hosts it takes with: every step stays. A commit the
# export causes on a stopped job's folder (a host given the manifest of a step it holds only a record
# of, or a step fetched back from a backup) prunes that host to this; the job's own is not known here.
KEEP_EVERY_STEP = 2**31 - 1

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1 << 10, "m": 1e6, "mb": 1e6, "mib": 1 << 20,
          "g": 1e9, "gb": 1e9, "gib": 1 << 30, "t": 1e12, "tb": 1e12, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """``1GiB``, ``512MiB``, ``2G``, ``1e9`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size (e.g. 1GiB, 512MiB, 2G)")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"{text!r}: the size must be positive (e.g. 1GiB, 512MiB, 2G)")
    return n


def _size_arg(text: str) -> int:
    """``parse_size`` for argparse, which prints the message of an ArgumentTypeError only."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _check_target(to: Path) -> None:
    """Refuse an export directory that cannot be made, before any sidecar starts (nothing is left behind)."""
    if to.exists() and not to.is_dir():
        raise ConfigError(f"--to {to} is a file; give a folder (the export writes <folder>/<step> in it)")
    probe = to
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"--to {to} cannot be made: {probe} is not a folder; give a folder you can write")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".mtc-export-probe-", dir=probe))
    except OSError as e:
        raise ConfigError(f"--to {to} cannot be made: {probe} is not writable here ({e.strerror or e}); give a "
                          "folder you can write") from None


def add_parser(sub: Any) -> None:
    ex = sub.add_parser(
        "export", help="write a step as a standard Orbax checkpoint (MaxText's layout: <step>/items, iter)",
        description="Write a step of a job (default: the latest restorable) with orbax-checkpoint as MaxText's "
                    "standard checkpointing writes it: DIR/<step>/items (and iter, the data iterator's position), "
                    "for MaxText's load_full_state_path / load_parameters_path or any Orbax reader. Each array is "
                    "read from the fastest tier that holds it; at most --max-memory of the state is held at once.")
    ex.add_argument("--to", required=True, metavar="DIR", help="the directory of the export (DIR/<step> is written)")
    ex.add_argument("--step", type=int, default=None, help="the step (default: the latest restorable)")
    ex.add_argument("--local-checkpoint-directory", nargs="+", metavar="DIR",
                    help="ramdisk folder(s) of a stopped job, one per host (HOST_ID=DIR to name a folder's host)")
    ex.add_argument("--cluster-spec", help="the cluster spec of a running local cluster (read-only)")
    ex.add_argument("--base-output-directory", default="", help="the job's base_output_directory (backups)")
    ex.add_argument("--run-name", default="", help="the job's run_name")
    ex.add_argument("--scratch", type=Path, default=None, metavar="DIR",
                    help="with the backup tier alone: where the blobs read from it are kept during the export "
                         "(default: a temporary folder; it holds up to the whole step, on disk)")
    ex.add_argument("--max-memory", type=_size_arg, default="1GiB", metavar="SIZE",
                    help="state held in memory at once (default 1GiB; a larger single array is read whole)")
    ex.add_argument("--verify", action="store_true",
                    help="read the export back with Orbax and compare every array bit for bit with the step")
    ex.add_argument("--json", action="store_true", help="print the report as JSON")
    ex.set_defaults(func=run)


def _progress(quiet: bool) -> tuple[Any, Any]:
    """A progress callback (rich when it is installed and the output is a terminal) and its closer."""
    if quiet or not sys.stderr.isatty():
        return (lambda done, total: None), (lambda: None)
    try:
        from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn
    except ImportError:
        return (lambda done, total: print(f"  {done}/{total} bytes", file=sys.stderr)), (lambda: None)
    bar = Progress("export", BarColumn(), DownloadColumn(), TimeRemainingColumn(), transient=True)
    bar.start()
    task = bar.add_task("export", total=None)
    return (lambda done, total: bar.update(task, completed=done, total=total)), bar.stop


def run(args: Any) -> int:
    import jax

    from mtc.head.dispatch.cluster.dispatcher import ClusterDispatcher
    from mtc.head.manager import CheckpointManager
    from mtc.head.tools.cli.common import missing_local_root
    from mtc.head.tools.sources import TOOL_ERRORS, folder_hosts, open_hosts, refused
    from mtc.shared.config import MTCConfig

    hosts = scratch = manager = None
    try:
        if args.cluster_spec and args.local_checkpoint_directory:
            raise ConfigError("give --cluster-spec (a running local cluster) or --local-checkpoint-directory "
                              "(ramdisk folders of a stopped job), not both")
        if not (args.cluster_spec or args.local_checkpoint_directory or args.base_output_directory):
            raise ConfigError("say where the step is: --local-checkpoint-directory (a stopped job's ramdisk "
                              "folders), --cluster-spec (a running local cluster) or --base-output-directory "
                              "with --run-name (its backups)")
        if bool(args.base_output_directory) != bool(args.run_name):
            raise ConfigError("--base-output-directory and --run-name go together: the backups are at "
                              "<base_output_directory>/<run_name>/mtc")
        if not str(args.to).strip():
            raise ConfigError("--to is empty; give the folder of the export (the step is written in <folder>/<step>)")
        if "://" not in str(args.to):  # a gs:// destination is checked by its writer
            _check_target(Path(args.to))
        from mtc.head.orbax.export import orbax_api

        orbax_api()  # refused here, before any sidecar starts, when orbax-checkpoint is missing
        missing = missing_local_root(MTCConfig(base_output_directory=args.base_output_directory,
                                               run_name=args.run_name).backup_root) if args.run_name else None
        if missing:  # read-only: a backup root that is not there is not created (nor read as empty)
            print(f"mtc export: error: {missing}", file=sys.stderr)
            return 1
        rows: list = []
        if args.local_checkpoint_directory:
            rows = folder_hosts(args.local_checkpoint_directory)
        elif not args.cluster_spec:
            scratch = args.scratch or Path(tempfile.mkdtemp(prefix="mtc-export-"))
            (scratch / "mtc").mkdir(parents=True, exist_ok=True)
            rows = [("h0", scratch, 0)]
        hosts = open_hosts(args.cluster_spec, rows)
        config = MTCConfig(local_checkpoint_directory=str(hosts.spec_path.parent), cluster_spec=str(hosts.spec_path),
                           base_output_directory=args.base_output_directory, run_name=args.run_name,
                           peer_token=hosts.token, prefetch_on_start=False, local_max_to_keep=KEEP_EVERY_STEP)
        devices = hosts.devices  # device ids only map the hosts' shards; arrays go onto one local device
        manager = CheckpointManager(config, dispatcher=ClusterDispatcher(config, devices=devices),
                                    read_only=bool(args.cluster_spec))
        update, stop = _progress(args.json)
        try:
            report = manager.export(str(args.to), args.step, max_bytes=args.max_memory, verify=args.verify,
                                    onto=jax.sharding.SingleDeviceSharding(jax.local_devices()[0]), progress=update)
        finally:
            stop()
    except TOOL_ERRORS as e:
        return refused("export", e)
    finally:
        if manager is not None:
            manager.close()
        if hosts is not None:
            hosts.close()
        if scratch is not None and args.scratch is None:
            shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        from dataclasses import asdict

        print(json.dumps(asdict(report), indent=2))
        return 0
    tiers = ", ".join(f"{t} {n:,} B" for t, n in report.bytes_by_tier.items() if n)
    print(f"exported step {report.step} to {report.path}: {report.arrays} arrays, {report.nbytes:,} bytes "
          f"({tiers or 'nothing read'}), {report.groups} groups of at most {report.largest_group_bytes:,} bytes, "
          f"in {report.seconds:.1f} s" + (", verified bit for bit" if report.verified else ""))
    print("MaxText:  " + "\n          ".join(report.maxtext_flags()))
    print(f"Orbax:    ocp.load({report.path!r}, abstract_state, checkpointable_name='items')  "
          "# from orbax.checkpoint import v1 as ocp")
    return 0
