"""One host's side of the backup scrub: re-hash backup blobs in the store, repair, mark.

A backup is checked when it is written and when it is restored; the scrub checks it in between,
so that a blob that rotted in the bucket is found while a good copy may still exist. The head
picks the backups and gives each blob to one host (``mtc.head.backup.scrub``); a host:

- ``check``: downloads each blob it was given into a temporary file of its ramdisk and hashes it
  against its name, one blob at a time, pausing between blobs so that its reads average at most
  ``bytes_per_s`` (training shares the network); an object whose size is not the blob's (the head
  gives each blob's size, from the backups' manifests) is bad without being downloaded, so that no
  object in the store can fill the ramdisk;
- ``repair``: re-uploads the blobs it holds in its ramdisk, each hashed first, over the bad
  object (the name is the content's hash, so the good bytes belong there), then checks the object
  again;
- ``check_ramdisk`` (optional): hashes this host's ramdisk copies of the backups' blobs and removes a
  corrupt one (``RamStore.scrub_blob``: replication or a restore brings a good copy back), before
  any repair reads them;
- ``mark``: writes ``damaged/<backup>.json`` for a backup no host could repair; the listing then
  leaves it out, so restore never chooses it (``BackupTier.listing``); ``clear`` removes the mark
  of a backup the head checked again and found whole (a mark is only a claim found in the store).

What the store's marks say is text from the store: ``read_damaged`` gives it without control
characters and bounded, so that no mark can drive the terminal that prints it.
"""

from __future__ import annotations

import json
import logging
import os
import time

from mtc.shared import backup_layout as layout
from mtc.shared.hashing import new_hasher
from mtc.shared.objstore.store import ObjectNotFoundError, ObjectStore
from mtc.sidecar.ram import RamStore
from mtc.sidecar.ram.common import open_blob

log = logging.getLogger(__name__)

_CHUNK = 8 * 2**20
_MARK_BYTES = 64 * 2**10  # a damaged mark larger than this is not read (its backup still counts as marked)
_WHY_CHARS = 400


def printable(text: str, limit: int = _WHY_CHARS) -> str:
    """``text`` with every control or other non-printable character escaped (``\\x1b``), at most
    ``limit`` characters: text from the store, safe to log and print."""
    out = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"
                  for c in str(text)[: limit + 1])
    return out if len(out) <= limit else out[:limit] + "..."


def hash_file(path: str) -> str:
    """The blob name of a file's bytes, read in chunks."""
    h = new_hasher()
    with os.fdopen(open_blob(path), "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class Scrubber:
    """Checks, repairs and marks backup blobs of one backup root, from one host."""

    def __init__(self, store: ObjectStore, ram: RamStore, host_id: str):
        self._store, self._ram, self._host = store, ram, host_id

    def _object_ok(self, blob: str, size: int | None = None) -> tuple[bool, int]:
        """(whether the store's object of ``blob`` hashes to its name, its size); ObjectNotFoundError
        when it is missing. With ``size`` (the blob's), an object of another size is not downloaded."""
        if size is not None:
            n = self._store.size(layout.blob_object(blob))
            if n is None:
                raise ObjectNotFoundError(layout.blob_object(blob))
            if n != size:
                log.error("backup scrub: the object of blob %s in %s is %d bytes, the blob %d: not downloaded "
                          "(host %s)", blob, self._store.url, n, size, self._host)
                return False, 0
        fd, tmp = self._ram.blobs.open_temp()
        os.close(fd)
        try:
            n = self._store.get_to_file(layout.blob_object(blob), str(tmp))
            return hash_file(str(tmp)) == blob, n
        finally:
            self._ram.blobs.discard_temp(tmp)

    def check(self, blobs: list[str], bytes_per_s: float, sizes: dict[str, int] | None = None) -> dict:
        """Hash each of ``blobs`` as the store holds it, at most ``bytes_per_s`` on average; with
        ``sizes`` (blob -> its size), an object of another size is bad without being downloaded."""
        sizes = sizes or {}
        t0 = time.monotonic()
        done = 0
        bad: list[str] = []
        missing: list[str] = []
        for blob in sorted(set(blobs)):
            try:
                ok, n = self._object_ok(blob, sizes.get(blob))
            except ObjectNotFoundError:
                missing.append(blob)
                log.error("backup scrub: blob %s is missing from %s (host %s)", blob, self._store.url, self._host)
                continue
            done += n
            if not ok:
                bad.append(blob)
                log.error("backup scrub: blob %s in %s does not hash to its name: it is corrupt (host %s)",
                          blob, self._store.url, self._host)
            # The cap: the next download starts once the bytes so far average at most bytes_per_s.
            time.sleep(max(0.0, done / bytes_per_s - (time.monotonic() - t0)))
        seconds = time.monotonic() - t0
        log.info("- backup scrub; host=%s; %d blobs, %d bytes in %.3fs (%.1f MB/s, cap %.1f MB/s); %d bad, %d missing",
                 self._host, len(set(blobs)), done, seconds, done / max(seconds, 1e-9) / 1e6, bytes_per_s / 1e6,
                 len(bad), len(missing))
        return {"checked": len(set(blobs)), "bytes": done, "bad": bad, "missing": missing, "seconds": seconds}

    def check_ramdisk(self, blobs: list[str]) -> dict:
        """Hash the ramdisk copies of those ``blobs`` this host holds; remove the corrupt ones."""
        held = [b for b in sorted(set(blobs)) if self._ram.blobs.has(b)]
        removed = [b for b in held if self._ram.scrub_blob(b) == "removed"]
        for blob in removed:
            log.error("backup scrub: host %s's ramdisk copy of blob %s was corrupt; removed", self._host, blob)
        return {"ramdisk_checked": len(held), "ramdisk_removed": removed}

    def repair(self, blobs: list[str]) -> list[str]:
        """Overwrite the objects of those ``blobs`` this host holds a good ramdisk copy of; the ones
        repaired (the object checked again afterwards)."""
        repaired = []
        wanted = sorted(set(blobs))
        with self._ram.pins.hold(wanted):
            for blob in wanted:
                if not self._ram.blobs.has(blob):
                    continue
                if not self._ram.blobs.verify(blob):
                    log.warning("backup scrub: host %s holds blob %s, but its copy is corrupt too", self._host, blob)
                    continue
                path = self._ram.blobs.path(blob)
                self._store.put_file(layout.blob_object(blob), str(path))
                if self._object_ok(blob, path.stat().st_size)[0]:
                    repaired.append(blob)
                    log.warning("backup scrub: blob %s repaired in %s from host %s's ramdisk", blob,
                                self._store.url, self._host)
                else:
                    log.error("backup scrub: blob %s re-uploaded from host %s, but the store still returns other "
                              "bytes", blob, self._host)
        return repaired

    def mark(self, damaged: dict[str, str]) -> list[str]:
        """Mark each backup of ``damaged`` (name -> why) damaged: restore no longer chooses it."""
        for name, why in sorted(damaged.items()):
            doc = {"backup": name, "why": why, "host": self._host,
                   "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            self._store.put_bytes(layout.damaged_object(name), json.dumps(doc).encode())
            log.error("backup %s in %s marked damaged (restore will not use it): %s", name, self._store.url,
                      printable(why))
        return sorted(damaged)

    def clear(self, names: list[str]) -> list[str]:
        """Remove the damaged marks of ``names`` (backups checked again and found whole); those removed."""
        cleared = []
        for name in sorted(set(names)):
            obj = layout.damaged_object(name)
            if self._store.exists(obj):
                self._store.delete(obj)
                cleared.append(name)
                log.warning("backup %s in %s: its damaged mark was removed (checked again: every blob is whole)",
                            name, self._store.url)
        return cleared


def read_damaged(store: ObjectStore) -> dict[str, str]:
    """Backup name -> why, for every backup marked damaged under ``store`` (why: printable, bounded)."""
    out = {}
    for obj in store.list(layout.DAMAGED):
        name = obj[len(layout.DAMAGED):].removesuffix(".json")
        if not layout.is_backup_name(name):
            continue
        try:
            n = store.size(obj)
            if n is None:
                continue  # pruned meanwhile
            doc = json.loads(store.get_bytes(obj)) if n <= _MARK_BYTES else None
            why = str(doc.get("why", "")) if isinstance(doc, dict) else ""
        except ObjectNotFoundError:
            continue
        except (ValueError, RecursionError):
            why = ""
        out[name] = printable(why) or "marked damaged by a backup scrub"
    return out
