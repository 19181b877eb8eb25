"""The backup tier's layout in object storage: a contract between the sidecars that write
backups and the head (and ``mtc restore-version``) that read them.

Under the backup root ``<base_output_directory>/<run_name>/mtc/``::

    blobs/<hash>                      content-addressed blobs, shared by every backup
    backups/<UTC time>-step-<step>.json   one backup: its step manifest, written last, create-only
    backups/<name>.seal, <name>.parts     its seal (the job key's word) and part index, written before it
    restore.version                   optional: the name of the one backup restore must use
    finalizing/<gen>.<name>.<host>.*  a finalize in progress (sidecar/backup/fence.py); none when idle
    damaged/<name>.json               a backup the scrub found bad and could not repair: never restored

Backups are ordered by step, newest first, and only among backups of one step by the time in
their names: the time is for people, and a host whose clock ran ahead (or behind) changes no
retention and no choice (``names_from_listing``).
"""

from __future__ import annotations

import re
import time

from mtc.shared.errors import ConfigError

BLOBS = "blobs/"
BACKUPS = "backups/"
FINALIZING = "finalizing/"
DAMAGED = "damaged/"
RESTORE_VERSION = "restore.version"
_NAME_RE = re.compile(r"(\d{8}T\d{6}Z)-step-(\d{12})")


def backup_name(step: int, when: float | None = None) -> str:
    """The readable name of a backup of ``step`` taken at ``when`` (UTC)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if when is None else when))
    return f"{stamp}-step-{step:012d}"


def is_backup_name(name: str) -> bool:
    return isinstance(name, str) and _NAME_RE.fullmatch(name) is not None


def parse_backup_name(name: str) -> int:
    """The step of a backup name; a clear error for anything that is not one."""
    m = _NAME_RE.fullmatch(name.strip()) if isinstance(name, str) else None
    if m is None:
        raise ConfigError(
            f"{name!r} is not a backup name: expected <UTC time>-step-<12 digits>, e.g. "
            f"{backup_name(120, 0)}; list the backups with `mtc restore-version show`")
    return int(m.group(2))


def manifest_object(name: str) -> str:
    parse_backup_name(name)
    return f"{BACKUPS}{name}.json"


def parts_object(name: str) -> str:
    """The part index of backup ``name`` (``mtc.shared.backup_index``)."""
    parse_backup_name(name)
    return f"{BACKUPS}{name}.parts"


def damaged_object(name: str) -> str:
    parse_backup_name(name)
    return f"{DAMAGED}{name}.json"


def blob_object(blob: str) -> str:
    return f"{BLOBS}{blob}"


def order_key(name: str) -> tuple[int, str]:
    """How backups are ordered: by step, then by the time in the name (same step only)."""
    m = _NAME_RE.fullmatch(name)
    return int(m.group(2)), m.group(1)


def names_from_listing(objects: list[str]) -> list[str]:
    """Backup names from a listing of ``backups/``, newest step first (see ``order_key``)."""
    out = []
    for obj in objects:
        base = obj[len(BACKUPS):] if obj.startswith(BACKUPS) else obj
        if base.endswith(".json") and is_backup_name(base[:-5]):
            out.append(base[:-5])
    return sorted(out, key=order_key, reverse=True)
