"""``mtc restore-version show|set|clear``: list the backups, and pin restore to one (the
``restore.version`` file in the backup root) or unpin it."""

from __future__ import annotations

import argparse
import sys

from mtc.shared.errors import ConfigError

from mtc.head.tools.cli.common import last_line


def cmd_restore_version(args: argparse.Namespace) -> int:
    from mtc.shared import backup_layout as layout
    from mtc.shared.backup_seals import Seals, read_restore_version
    from mtc.shared.job_key import JobKey
    from mtc.shared.config import MTCConfig
    from mtc.shared.objstore import StoreError, open_store

    try:
        root = args.backup_root or MTCConfig(base_output_directory=args.base_output_directory,
                                             run_name=args.run_name).backup_root
        store = open_store(root, create=False)  # read-only until a pin is written: a wrong root is not created
    except ConfigError as e:
        print(f"mtc restore-version: error: {e} (or pass --backup-root)", file=sys.stderr)
        return 2
    except Exception as e:  # a client library's error (credentials, a missing package): its message, no traceback
        print(f"mtc restore-version: error: cannot open {root}: {type(e).__name__}: {last_line(e)}"
              + (_GCS_HINT if str(root).startswith("gs://") else ""), file=sys.stderr)
        return 1
    try:
        objects = store.list(layout.BACKUPS)
        # Only the backups this job sealed (its key from MTC_JOB_KEY or MTC_PEER_TOKEN, as the sidecars'),
        # as restore sees them; without a key, all of them, unchecked.
        seals = Seals(store, JobKey.from_secret(), root)
        names = seals.verify(layout.names_from_listing(objects), objects)
        held = [] if names else store.list("")
        if not names and not held:
            print(f"mtc restore-version: error: the backup root {root} does not exist or is empty: nothing was "
                  "backed up there; check --base-output-directory and --run-name (backups go to "
                  "<base_output_directory>/<run_name>/mtc)", file=sys.stderr)
            return 1
        if not names and args.action != "clear":
            tops = sorted({str(k).split("/")[0] for k in held})
            inner = sorted({str(k).split("/")[0] for k in held if f"/{layout.BACKUPS}" in f"/{k}"})
            hint = (f"; the backups are one level down: --backup-root {str(root).rstrip('/')}/{inner[0]}"
                    if len(inner) == 1 and inner[0] != layout.BACKUPS else "")
            print(f"mtc restore-version: error: {root} holds no backups (no {layout.BACKUPS} in it); it holds "
                  f"{', '.join(tops[:8])}{' ...' if len(tops) > 8 else ''}{hint}", file=sys.stderr)
            return 1
        try:
            current = read_restore_version(store)
        except ConfigError as e:
            if args.action != "clear":
                print(f"mtc restore-version: error: {e}", file=sys.stderr)
                return 1
            current = "(unreadable)"
        damaged = {o[len(layout.DAMAGED):].removesuffix(".json") for o in store.list(layout.DAMAGED)}
        if args.action == "show":
            print(f"backups in {root} (newest first):")
            for n in names:
                print(f"  {n}  step {layout.parse_backup_name(n)}" + ("  damaged (restore never takes it)"
                                                                      if n in damaged else "")
                      + ("  <- restore.version" if n == current else ""))
            for n, why in seals.refused.items():
                print(f"  {n}  refused: {why}")
            if not names:
                print("  (none)")
            print(f"restore.version: {current if current else 'not set (restore takes the newest step)'}")
            if current and (current not in names or current in damaged):
                what = "is damaged" if current in names else "does not exist"
                print(f"warning: restore.version names a backup that {what}; restore will fail until it is fixed "
                      "or cleared", file=sys.stderr)
            return 0
        if args.action == "clear":
            if current is None:
                print(f"restore.version is not set in {root}; nothing to remove (restore takes the newest step)")
                return 0
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
        if args.name in damaged:
            print(f"mtc restore-version: error: backup {args.name} is marked damaged "
                  f"({layout.damaged_object(args.name)} in {root}): a backup scrub could not repair it, restore never "
                  "takes it, and a pin to it would fail every restore; pin another (mtc restore-version show), or "
                  f"check it again with mtc verify --backup --name {args.name}", file=sys.stderr)
            return 2
        store.put_bytes(layout.RESTORE_VERSION, (args.name + "\n").encode())
        print(f"restore.version in {root} now pins {args.name} (step {layout.parse_backup_name(args.name)})")
        return 0
    except StoreError as e:
        print(f"mtc restore-version: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # e.g. google.auth errors while listing a gs:// root
        print(f"mtc restore-version: error: {root}: {type(e).__name__}: {last_line(e)}"
              + (_GCS_HINT if str(root).startswith("gs://") else ""), file=sys.stderr)
        return 1
    finally:
        store.close()


_GCS_HINT = ("; for gs:// the google-cloud-storage client needs credentials (gcloud auth application-default "
             "login, or GOOGLE_APPLICATION_CREDENTIALS) and pip install 'mtc[gcs]'; STORAGE_EMULATOR_HOST points it "
             "at an emulator")
