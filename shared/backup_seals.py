"""A backup's seal: the job key's word that backup ``<name>`` of this run holds this manifest.

A backup is visible when its manifest ``backups/<name>.json`` exists; its name carries its step, and
a listing orders backups by it. Anyone who can write the bucket can copy a manifest under another
name (the oldest backup as step 999: restore would choose 999 and fail) or plant one. So before its
manifest, a finalize writes ``backups/<name>.seal``: a small JSON document naming the backup, its
run and its step, the size and SHA-256 of the manifest's bytes, and a tag (``mtc.shared.job_key``)
over all of them. A listing takes a backup only when its seal checks (a name and content that
disagree, a seal of another run, one without the job's key: left out, with a warning and a count,
and listed as refused); reading the manifest checks its bytes against the seal.

A backup root written before seals existed holds manifests without one. Such a root (no backup in it
sealed) is still read, with a warning, unless ``MTC_UNSIGNED_BACKUPS=refuse``; once a root holds one
sealed backup, an unsealed manifest there is refused (it was written after the key, by someone else).
With no job key at all (no token), nothing is sealed or checked.

A seal may also name the backup's part index (``mtc.shared.backup_index``: the SHA-256 of the
manifest's header and of each host's part), by its size, its SHA-256 and a tag of its own
(``"index"``): a host that restores its own part reads the header and that part by range, each
checked against the index, instead of the whole manifest. The manifest's fields and tag are those of
a seal without an index, so a version that does not know indexes reads such a backup whole.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import PurePosixPath
from typing import Iterable, Mapping

from mtc.shared import backup_layout as layout
from mtc.shared import job_key
from mtc.shared.config import ENV_TOKEN
from mtc.shared.errors import ConfigError, ManifestError
from mtc.shared.objstore.store import ObjectNotFoundError, ObjectStore, UntrustedObjectError

log = logging.getLogger(__name__)

KIND = "backup manifest"
INDEX_KIND = "backup part index"
SUFFIX = ".seal"
FORMAT = "mtc-seal/1"
MAX_SEAL_BYTES = 16 << 10
MAX_RESTORE_VERSION_BYTES = 4 << 10
ENV_UNSIGNED = "MTC_UNSIGNED_BACKUPS"  # "refuse": a root without seals is not read either

_warned_legacy: set[str] = set()
_lock = threading.Lock()


def seal_object(name: str) -> str:
    layout.parse_backup_name(name)
    return f"{layout.BACKUPS}{name}{SUFFIX}"


def run_of(url: str) -> str:
    """The run a backup root belongs to: ``<base_output_directory>/<run_name>/mtc`` -> run_name."""
    path = PurePosixPath(str(url).rstrip("/"))
    return path.parent.name if path.name == "mtc" else path.name


def _message_name(run: str, name: str, step: int, size: int) -> str:
    return f"{run}/{name}/step={step}/size={size}"


class Seals:
    """Makes and checks the seals of the backups under ``store`` (the root of run ``run_of(url)``)."""

    def __init__(self, store: ObjectStore, key: job_key.JobKey, url: str | None = None,
                 environ: Mapping[str, str] | None = None):
        self._store = store
        self.key = key
        self.run = run_of(url or store.url)
        env = os.environ if environ is None else environ
        self.refuse_unsigned = env.get(ENV_UNSIGNED, "").strip().lower() == "refuse"
        self.refused: dict[str, str] = {}  # backup name -> why, from the last listing

    def make(self, name: str, manifest_json: bytes, index: bytes | None = None) -> bytes | None:
        """The seal of backup ``name`` holding ``manifest_json`` (and naming its part ``index``, when
        given); None with no key."""
        step, size = layout.parse_backup_name(name), len(manifest_json)
        digest = hashlib.sha256(manifest_json).digest()
        tag = self.key.sign_digest(KIND, _message_name(self.run, name, step, size), digest)
        if tag is None:
            return None
        doc = {"format": FORMAT, "backup": name, "run": self.run, "step": step, "size": size,
               "sha256": digest.hex(), "tag": tag}
        if index is not None:
            raw = hashlib.sha256(index).digest()
            doc["index"] = {"size": len(index), "sha256": raw.hex(),
                            "tag": self.key.sign_digest(INDEX_KIND, _message_name(self.run, name, step, len(index)), raw)}
        return json.dumps(doc, sort_keys=True).encode()

    def write(self, store: ObjectStore, name: str, manifest_json: bytes, index: bytes | None = None) -> None:
        """Write the seal of ``name`` (before its manifest: the manifest is what makes it visible)."""
        seal = self.make(name, manifest_json, index)
        if seal is not None:
            store.put_bytes(seal_object(name), seal)

    def _read(self, name: str) -> dict | str:
        """The seal of ``name`` as a dict when it checks, else why not (a verdict or a sentence)."""
        try:
            data = self._store.get_bytes(seal_object(name), max_bytes=MAX_SEAL_BYTES)
            doc = json.loads(data)
        except ObjectNotFoundError:
            return job_key.UNSIGNED
        except (UntrustedObjectError, ValueError, RecursionError) as e:
            return f"its seal is unreadable ({type(e).__name__}: {e})"
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            return "its seal is not a seal of this format"
        step = layout.parse_backup_name(name)
        if doc.get("backup") != name or doc.get("step") != step:
            return f"its seal is backup {doc.get('backup')!r}'s (step {doc.get('step')!r}): copied or renamed"
        if doc.get("run") != self.run:
            return f"its seal is of run {doc.get('run')!r}, not {self.run!r}: copied from another run"
        size, digest = doc.get("size"), doc.get("sha256")
        if not isinstance(size, int) or not isinstance(digest, str) or len(digest) != 64:
            return "its seal names no manifest"
        try:
            raw = bytes.fromhex(digest)
        except ValueError:
            return "its seal names no manifest"
        verdict = self.key.check_digest(KIND, _message_name(self.run, name, step, size), raw, doc.get("tag"))
        return doc if verdict == job_key.OK else verdict

    def verify(self, names: Iterable[str], objects: Iterable[str]) -> list[str]:
        """Of ``names`` (a listing's backups, in order), those whose seal checks, or which a root without
        seals may still hold; the others go to ``self.refused`` (name -> why), each warned once."""
        names = list(names)
        self.refused = {}
        if not self.key.enabled:
            return names
        sealed = {o[len(layout.BACKUPS):-len(SUFFIX)] for o in objects if o.endswith(SUFFIX)}
        good, unsigned = [], []
        for n in names:
            verdict = self._read(n) if n in sealed else job_key.UNSIGNED
            if isinstance(verdict, dict):
                good.append(n)
            elif verdict == job_key.UNSIGNED:
                unsigned.append(n)
            else:
                self._refuse(n, verdict)
        legacy = not good and not self.refuse_unsigned
        for n in unsigned:
            if legacy:
                self._legacy_warning()
            else:
                self._refuse(n, job_key.UNSIGNED)
        return [n for n in names if n in good or (legacy and n in unsigned)]

    def _refuse(self, name: str, verdict: str) -> None:
        why = {job_key.UNSIGNED: "it has no seal, and this root holds sealed backups (or MTC_UNSIGNED_BACKUPS=refuse)"
               if self.key.enabled else "it has no seal",
               job_key.BAD: "its seal's tag does not match (changed, or written without this job's key)",
               job_key.UNKNOWN_KEY: f"its seal is of another key: a tool reads it with the job's {ENV_TOKEN} (or "
               f"{job_key.ENV_KEY}) in its environment; after a key rotation, {job_key.ENV_ACCEPTED} lists the older "
               "keys", job_key.NO_KEY: f"this process has no job key (set the job's {ENV_TOKEN} or {job_key.ENV_KEY})"
               }.get(verdict, verdict)
        self.refused[name] = f"not sealed by this job: {why}"
        job_key.refuse(KIND, f"backup {name}", verdict if verdict in (job_key.UNSIGNED, job_key.BAD,
                       job_key.UNKNOWN_KEY) else job_key.BAD, self._store.url, "never chosen or restored")
        if verdict not in (job_key.UNSIGNED, job_key.BAD, job_key.UNKNOWN_KEY):
            log.warning("mtc: backup %s in %s: %s", name, self._store.url, why)

    def _legacy_warning(self) -> None:
        with _lock:
            first = self._store.url not in _warned_legacy
            _warned_legacy.add(self._store.url)
        if first:
            log.warning("mtc: the backup root %s holds no sealed backup (written before mtc sealed its backups): its "
                        "backups are read without a check until the next backup is sealed; set %s=refuse to read "
                        "none of them", self._store.url, ENV_UNSIGNED)

    def _checked_seal(self, name: str) -> dict | None:
        """The seal of ``name`` when it checks; None where nothing is checked (no key, or a root without
        seals: see ``verify``); ManifestError when it does not check."""
        if not self.key.enabled:
            return None
        seal = self._read(name)
        if seal == job_key.UNSIGNED:
            objects = self._store.list(layout.BACKUPS)
            if not any(o.endswith(SUFFIX) for o in objects) and not self.refuse_unsigned:
                self._legacy_warning()
                return None
        if not isinstance(seal, dict):
            self._refuse(name, seal)
            raise ManifestError(f"backup {name} in {self._store.url}: {self.refused[name]}; it is not restored")
        return seal

    def check_index(self, name: str, data: bytes) -> bool:
        """Whether the part index ``data`` of backup ``name`` may be read by: True when its seal names it
        (or nothing is checked: no key, a root without seals); False when the seal names no index (sealed
        by a version without them) or another one (the index was changed or damaged, not the manifest:
        a warning), so that the manifest is read whole, against its seal; ManifestError when the seal
        does not check."""
        seal = self._checked_seal(name)
        if seal is None:
            return True
        index = seal.get("index")
        if index is None:
            return False
        step = layout.parse_backup_name(name)
        size, digest = (index.get("size"), index.get("sha256")) if isinstance(index, dict) else (None, None)
        ok = isinstance(size, int) and isinstance(digest, str) and size == len(data) \
            and digest == hashlib.sha256(data).hexdigest()
        if ok:
            ok = self.key.check_digest(INDEX_KIND, _message_name(self.run, name, step, size), bytes.fromhex(digest),
                                       index.get("tag")) == job_key.OK
        if not ok:
            log.warning("mtc: backup %s in %s: its part index is not the one its seal names (changed or damaged "
                        "after it was written); reading its whole manifest instead", name, self._store.url)
        return ok

    def check_manifest(self, name: str, data: bytes) -> None:
        """ManifestError when ``data`` is not the manifest backup ``name``'s seal names (a root without
        seals: see ``verify``)."""
        seal = self._checked_seal(name)
        if seal is None:
            return
        if seal["size"] != len(data) or seal["sha256"] != hashlib.sha256(data).hexdigest():
            self._refuse(name, job_key.BAD)
            raise ManifestError(f"backup {name} in {self._store.url}: its manifest is not the one its seal names "
                                "(changed after it was written); it is not restored")


def read_restore_version(store: ObjectStore) -> str | None:
    """The backup name ``restore.version`` holds, None when there is none; a ConfigError naming the
    object and the fix when it is not a small text file."""
    where = f"{layout.RESTORE_VERSION} in {store.url}"
    fix = "fix it with `mtc restore-version set NAME` or remove it with `mtc restore-version clear`"
    try:
        data = store.get_bytes(layout.RESTORE_VERSION, max_bytes=MAX_RESTORE_VERSION_BYTES)
    except ObjectNotFoundError:
        return None
    except UntrustedObjectError as e:
        raise ConfigError(f"{where} cannot be read as a pin ({e}); {fix}") from None
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where} is not UTF-8 text (byte {e.start}); {fix}") from None
