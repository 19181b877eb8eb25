"""``mtc verify --backup``: scrub the backups now (what the job's background scrub does).

The hosts (a running local cluster, or the ramdisk folders of a stopped job, as for ``mtc status``)
re-hash the blobs of the newest backups in the store, at a bandwidth cap, re-upload a bad blob from
a host whose ramdisk holds a good copy, and mark a backup they cannot repair damaged, so that restore
never chooses it. It prints, per backup, the blobs checked, the bad ones and the repaired ones.
Exit 0 when every backup checked is whole (after repairs), 1 when one is damaged, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys

from mtc.shared.config import MTCConfig
from mtc.shared.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    v = sub.add_parser(
        "verify", help="re-hash the backups' blobs in the store now; repair or mark damaged ones",
        description="Scrub the backups on demand: the hosts re-hash the blobs of the newest backups (--backups) "
                    "in the backup root, at --bytes-per-s each, repair a bad blob from a host whose ramdisk holds a "
                    "good copy, and mark a backup they cannot repair damaged (restore never chooses it; `mtc "
                    "status` says why). Exit 1 when a backup is damaged.")
    v.add_argument("--backup", action="store_true", required=True, help="verify the backup tier (required)")
    v.add_argument("--cluster-spec", help="the cluster spec of a running local cluster (MTC_CLUSTER_SPEC)")
    v.add_argument("--local-checkpoint-directory", nargs="+", metavar="DIR",
                   help="ramdisk folder(s) of a stopped job, one per host")
    v.add_argument("--base-output-directory", default="", help="the job's base_output_directory")
    v.add_argument("--run-name", default="", help="the job's run_name")
    v.add_argument("--backups", type=int, default=MTCConfig.backup_scrub_backups,
                   help=f"how many of the newest backups to check (default {MTCConfig.backup_scrub_backups})")
    v.add_argument("--name", action="append", default=[], metavar="BACKUP",
                   help="check this backup (as `mtc restore-version show` lists it) instead; may be repeated")
    v.add_argument("--bytes-per-s", type=float, default=float(MTCConfig.backup_scrub_bytes_per_s),
                   help="read bandwidth cap per host, bytes/s (default 50 MiB/s)")
    v.add_argument("--ramdisk", action="store_true",
                   help="also hash the hosts' ramdisk copies of those blobs, and remove corrupt ones")
    v.add_argument("--json", action="store_true", help="machine-readable output")
    v.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mtc.head.backup.scrub import scrub_backups
    from mtc.head.dispatch.cluster.dispatcher import ClusterDispatcher
    from mtc.head.tools.cli.common import missing_local_root
    from mtc.shared.backup_layout import parse_backup_name
    from mtc.head.tools.sources import TOOL_ERRORS, job_hosts, refused

    try:
        if bool(args.cluster_spec) == bool(args.local_checkpoint_directory):
            raise ConfigError("give the job's --cluster-spec (a running local cluster) or its "
                              "--local-checkpoint-directory (ramdisk folders of a stopped job; several allowed)")
        if not args.base_output_directory or not args.run_name:
            raise ConfigError("give the job's --base-output-directory and --run-name: the backups are under "
                              "<base_output_directory>/<run_name>/mtc")
        if args.backups < 1:
            raise ConfigError(f"--backups {args.backups}: check at least 1 backup (the newest), e.g. --backups 2")
        if not 0 < args.bytes_per_s < float("inf"):
            raise ConfigError(f"--bytes-per-s {args.bytes_per_s:.0f}: give a read bandwidth cap above 0 bytes/s "
                              "per host, e.g. --bytes-per-s 52428800 (50 MiB/s)")
        for name in args.name:  # a name that cannot be a backup's is bad input, wherever the root is
            parse_backup_name(name)
        missing = missing_local_root(MTCConfig(base_output_directory=args.base_output_directory,
                                               run_name=args.run_name).backup_root)
        if missing:  # nothing to check there, and the hosts would create it
            print(f"mtc verify: error: {missing}", file=sys.stderr)
            return 1
        with job_hosts(args.cluster_spec, args.local_checkpoint_directory) as (hosts, rows):
            config = MTCConfig(local_checkpoint_directory=str(rows[0][1] if rows else hosts.spec_path.parent),
                               cluster_spec=str(hosts.spec_path), base_output_directory=args.base_output_directory,
                               run_name=args.run_name, peer_token=hosts.token)
            dispatch = ClusterDispatcher(config, devices=hosts.devices)
            try:
                report = scrub_backups(dispatch, backups=args.backups, bytes_per_s=args.bytes_per_s,
                                       names=args.name or None, ramdisk=args.ramdisk)
            finally:
                dispatch.close()
    except TOOL_ERRORS as e:
        return refused("verify", e)
    if args.json:
        print(json.dumps({"backups": [{"name": b.name, "step": b.step, "checked": b.checked, "bad": list(b.bad),
                                       "repaired": list(b.repaired), "damaged": b.damaged,
                                       "marked_before": b.marked_before, "cleared": b.cleared}
                                      for b in report.backups],
                          "already_damaged": list(report.already_damaged), "bytes": report.bytes,
                          "ramdisk_checked": report.ramdisk_checked, "ramdisk_removed": report.ramdisk_removed,
                          "seconds": report.seconds}, indent=2))
    else:
        if not report.backups and not report.already_damaged:
            print(f"no backup to check in the backup root {config.backup_root}: the job has made none there yet, "
                  "or --base-output-directory and --run-name are not the job's")
        for b in report.backups:
            state = f"DAMAGED: {b.damaged}" if b.damaged else "ok" if not b.bad else "ok (repaired)"
            if b.cleared:
                state += ", its damaged mark removed"
            again = "marked damaged earlier, checked again: " if b.marked_before else ""
            print(f"backup {b.name} (step {b.step}): {again}{b.checked} blobs checked, {len(b.bad)} bad, "
                  f"{len(b.repaired)} repaired: {state}")
        for d in report.already_damaged:
            print(f"backup {d['name']} (step {d['step']}): marked damaged earlier, not checked: {d['why']}")
        if args.ramdisk:
            print(f"ramdisk: {report.ramdisk_checked} copies checked, corrupt ones removed: "
                  + ("; ".join(f"{h}: {', '.join(bl)}" for h, bl in sorted(report.ramdisk_removed.items())) or "none"))
        print(f"read {report.bytes} bytes in {report.seconds:.1f} s")
    return 1 if any(b.damaged for b in report.backups) else 0
