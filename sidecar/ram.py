"""The RAM tier: one host's content-addressed blob store and committed steps on its ramdisk.

Layout under ``root`` (= ``<local_checkpoint_directory>/mtc``)::

    blobs/<32-hex>                committed blobs: raw bytes, named by their xxh3-128
    blobs/.tmp-<random>           blob writes in progress (never look like committed data)
    pending/<step:012d>/host.json phase-1 host manifest (keeps its blobs alive until commit)
    steps/<step:012d>.json        the commit: the step manifest, written last, atomically

A step is committed iff ``steps/<step>.json`` exists and parses as JSON whose ``"step"``
equals the number in the file name. Nothing else makes a step visible.

Concurrency: blob writes (``write_blob``, ``finalize_temp_blob``, ``put_blob_file``) may run
from several threads at once. Metadata operations (``commit``, ``prune``, ``gc``,
``check_space``, ``write_pending``, ``delete_step``, ``wipe``) are serialised by one lock.
Garbage collection spares blobs referenced by a kept step, by a pending host manifest, or
pinned with :meth:`RamStore.pin`; a caller that writes blobs while another thread may commit
(and so collect) pins the names first, until its host manifest is written. One process owns
a root at a time (opening a store removes leftover temp files).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import mmap
import os
import re
import secrets
import shutil
import threading
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from mtc.shared.errors import CorruptBlobError, InsufficientSpaceError, ManifestError, StepNotFoundError
from mtc.shared.hashing import HEX_LEN, blob_name, check_blob_name, is_blob_name, new_hasher

log = logging.getLogger(__name__)

__all__ = ["RamStore", "collect_blob_names", "format_bytes"]

TMP_PREFIX = ".tmp-"
# Large enough that syscall overhead vanishes; small enough that hashing a chunk right after
# reading it finds it still in cache.
_WRITE_CHUNK = 64 << 20
_READ_CHUNK = 4 << 20
_STEP_FILE_RE = re.compile(r"^(\d{12})\.json$")
_STEP_DIR_RE = re.compile(r"^(\d{12})$")
_MAX_STEP = 10**12 - 1
_HOST_JSON = "host.json"

BlobsOf = Callable[[bytes], "set[str]"]


def format_bytes(n: int) -> str:
    """``n`` bytes in binary units with two decimals, e.g. ``"1.20 GiB"``."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    value = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def collect_blob_names(json_bytes: bytes) -> set[str]:
    """Blob names in a manifest: every string under any key named ``"blob"``, at any depth.

    The default ``blobs_of`` of :class:`RamStore`; the format module provides the real one.
    Raises :class:`ManifestError` when the bytes are not JSON or a ``"blob"`` value is not a
    well-formed blob name (manifests on disk are untrusted).
    """
    try:
        doc = json.loads(json_bytes)
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"manifest is not valid JSON ({e}); cannot tell which blobs it uses") from None
    names: set[str] = set()

    def strings(v) -> Iterator[str]:
        if isinstance(v, str):
            yield v
        elif isinstance(v, list):
            for x in v:
                yield from strings(x)
        elif isinstance(v, dict):
            for x in v.values():
                yield from strings(x)

    def walk(v) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                if k == "blob":
                    for s in strings(x):
                        if not _valid_name(s):
                            raise ManifestError(f"manifest names blob {s!r}, which is not a blob name "
                                                f"({HEX_LEN} lowercase hex digits)")
                        names.add(s)
                else:
                    walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    walk(doc)
    return names


def _valid_name(name) -> bool:
    # The length check also refuses "<32 hex>\n", which a `$`-anchored regex lets through.
    return is_blob_name(name) and len(name) == HEX_LEN


def _check_name(name) -> str:
    if not _valid_name(name):
        check_blob_name(name)  # raises ValueError with the standard message
        raise ValueError(f"invalid blob name {name!r}: expected {HEX_LEN} lowercase hex digits")
    return name


def _check_step(step) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 0 <= step <= _MAX_STEP:
        raise ValueError(f"invalid step {step!r}: expected an integer in [0, {_MAX_STEP}]")
    return int(step)


def _byte_view(data) -> memoryview:
    """A flat, read-only-or-writable unsigned-byte view of ``data`` without copying."""
    if isinstance(data, np.ndarray):
        if data.dtype.hasobject:
            raise TypeError(f"cannot store an array of dtype {data.dtype}: it holds Python objects, not bytes")
        if not data.flags.c_contiguous:
            raise ValueError("array is not C-contiguous; pass np.ascontiguousarray(a) (blobs are raw C-order bytes)")
        # Viewing as uint8 first also covers dtypes the buffer protocol cannot describe (bfloat16).
        return memoryview(data.reshape(-1).view(np.uint8))
    mv = memoryview(data)
    if not mv.c_contiguous:
        raise ValueError("buffer is not C-contiguous (blobs are raw C-order bytes)")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def _hash_fd(fd: int, size: int) -> str:
    if size == 0:
        return blob_name(b"")
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
        return blob_name(m)


class RamStore:
    """One host's blob store and committed steps under ``root`` (see the module docstring).

    ``max_to_keep`` is the number of committed steps kept (``local_max_to_keep``).
    ``blobs_of`` extracts the blob names from a step manifest or a host manifest.
    """

    def __init__(self, root: str | os.PathLike, *, max_to_keep: int = 2,
                 blobs_of: BlobsOf = collect_blob_names):
        if isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1:
            raise ValueError(f"max_to_keep (local_max_to_keep) must be an integer >= 1, got {max_to_keep!r}")
        self.root = Path(root)
        self.max_to_keep = max_to_keep
        self._blobs_of = blobs_of
        self._blobs = self.root / "blobs"
        self._pending = self.root / "pending"
        self._steps = self.root / "steps"
        self._lock = threading.RLock()
        self._pins: Counter[str] = Counter()
        self._warned: set[str] = set()
        self._make_dirs()
        self._remove_leftovers()

    # --- layout ------------------------------------------------------------------------

    def _make_dirs(self) -> None:
        for d in (self._blobs, self._pending, self._steps):
            d.mkdir(parents=True, exist_ok=True)

    def _remove_leftovers(self) -> None:
        # A writer killed mid-way leaves temp files; they were never visible, so they go.
        dirs = [self._blobs, self._steps] + [p for p in self._pending.iterdir() if p.is_dir()]
        removed = 0
        for d in dirs:
            for p in d.iterdir():
                if p.name.startswith(TMP_PREFIX):
                    with contextlib.suppress(FileNotFoundError):
                        p.unlink()
                    removed += 1
        if removed:
            log.info("ramdisk %s: removed %d leftover temp files from an interrupted writer", self.root, removed)

    def _step_path(self, step: int) -> Path:
        return self._steps / f"{step:012d}.json"

    def _pending_dir(self, step: int) -> Path:
        return self._pending / f"{step:012d}"

    def _temp_name(self, directory: Path, tag: str = "") -> Path:
        return directory / f"{TMP_PREFIX}{tag}{secrets.token_hex(8)}"

    def _free_bytes(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def _no_space(self, what: str, step: int | None, needed: int | None, err: OSError) -> InsufficientSpaceError:
        free = self._free_bytes()
        need = f"{format_bytes(needed)} ({needed} bytes)" if needed is not None else "more space"
        step_s = f"step {step}" if step is not None else "a step"
        return InsufficientSpaceError(
            f"ramdisk {self.root} is full while writing {what} of {step_s}: needed {need}, "
            f"{format_bytes(free)} ({free} bytes) free ({err.strerror}); the partial file was removed. "
            f"Make the ramdisk larger: see `mtc size --params ... --hosts ...`, or lower local_max_to_keep")

    # --- blobs -------------------------------------------------------------------------

    def blob_path(self, name: str) -> Path:
        """The file of blob ``name``; the name is validated first (ValueError if malformed)."""
        return self._blobs / _check_name(name)

    def has_blob(self, name: str) -> bool:
        """True when blob ``name`` is committed in this store (ValueError for a malformed name)."""
        return self.blob_path(name).is_file()

    def blob_size(self, name: str) -> int:
        """Size in bytes of blob ``name``; FileNotFoundError when absent."""
        path = self.blob_path(name)
        try:
            return path.stat().st_size
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, f"blob {name} is not in the ramdisk", str(path)) from None

    def list_blobs(self) -> set[str]:
        """Names of all committed blobs (temp files excluded)."""
        return {p.name for p in self._blobs.iterdir() if _valid_name(p.name)}

    def missing_bytes(self, blobs: dict[str, int]) -> int:
        """Bytes of ``blobs`` ({name: nbytes}) not already present: what a step would add.

        Each size is rounded up to the filesystem block (a tmpfs page), as it is allocated.
        """
        block = os.statvfs(self.root).f_frsize or 1
        return sum(-(-int(n) // block) * block for name, n in blobs.items() if not self.has_blob(name))

    @contextlib.contextmanager
    def pin(self, names: Iterable[str]) -> Iterator[None]:
        """Keep ``names`` out of garbage collection while the context is open.

        For blobs written before anything references them (between ``write_blob`` and
        ``write_pending``, or received from a peer): pin first, then write.
        """
        names = [_check_name(n) for n in names]
        with self._lock:
            self._pins.update(names)
        try:
            yield
        finally:
            with self._lock:
                self._pins.subtract(names)
                self._pins += Counter()  # drop zero counts

    def _publish(self, tmp: Path, final: Path) -> bool:
        """Move a finished temp file to its final name; False if the blob already existed.

        A hard link cannot overwrite, so among racing writers of one blob exactly one wins
        and the committed file is never replaced under a reader.
        """
        try:
            os.link(tmp, final)
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            if final.exists():
                return False
            os.replace(tmp, final)  # filesystem without hard links: same bytes, so replacing is harmless
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return True

    def write_blob(self, data, *, name: str | None = None) -> tuple[str, bool]:
        """Store ``data`` (bytes-like or C-contiguous ndarray: its raw bytes) as a blob.

        ``name`` is trusted as the precomputed hash when given. Returns (name, written);
        written is False when the blob was already present (nothing is written then).
        Raises InsufficientSpaceError (temp file removed) when the ramdisk fills up.
        """
        mv = _byte_view(data)
        name = blob_name(mv) if name is None else _check_name(name)
        final = self._blobs / name
        if final.exists():
            return name, False
        tmp = self._temp_name(self._blobs)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            try:
                off, n = 0, mv.nbytes
                while off < n:
                    off += os.write(fd, mv[off:off + _WRITE_CHUNK])
            finally:
                os.close(fd)
        except BaseException as e:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise self._no_space(f"blob {name}", None, mv.nbytes, e) from e
            raise
        return name, self._publish(tmp, final)

    def read_blob_into(self, name: str, out) -> None:
        """Read blob ``name`` into ``out`` (writable buffer or ndarray of exactly its size).

        Raises CorruptBlobError when the blob is missing, has another size, or its bytes do
        not hash to its name; ``out`` holds garbage then.
        """
        path = self.blob_path(name)
        mv = _byte_view(out)
        if mv.readonly:
            raise TypeError(f"read_blob_into needs a writable buffer for blob {name}")
        try:
            f = open(path, "rb", buffering=0)
        except FileNotFoundError:
            raise CorruptBlobError(f"blob {name} is missing from the ramdisk ({path})") from None
        hasher = new_hasher()
        with f:
            size = os.fstat(f.fileno()).st_size
            if size != mv.nbytes:
                raise CorruptBlobError(f"blob {name} at {path} has {size} bytes, but the reader expects "
                                       f"{mv.nbytes}: wrong size, not using it")
            off = 0
            while off < size:
                got = f.readinto(mv[off:off + _READ_CHUNK])
                if not got:
                    raise CorruptBlobError(f"blob {name} at {path} ended after {off} of {size} bytes "
                                           "(truncated while reading)")
                hasher.update(mv[off:off + got])
                off += got
        actual = hasher.hexdigest()
        if actual != name:
            raise CorruptBlobError(f"blob {name} at {path} is corrupt: its bytes hash to {actual}")

    def read_blob(self, name: str) -> bytes:
        """The verified bytes of blob ``name`` (CorruptBlobError if missing or corrupt)."""
        try:
            size = self.blob_size(name)
        except FileNotFoundError:
            raise CorruptBlobError(f"blob {name} is missing from the ramdisk ({self.blob_path(name)})") from None
        buf = bytearray(size)
        self.read_blob_into(name, buf)
        return bytes(buf)

    def verify_blob(self, name: str) -> bool:
        """True when blob ``name`` is present and its bytes hash to its name."""
        path = self.blob_path(name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            return _hash_fd(fd, os.fstat(fd).st_size) == name
        finally:
            os.close(fd)

    def open_temp_blob(self) -> tuple[int, Path]:
        """A new temp file in ``blobs/`` for receiving a blob: (fd open for writing, path).

        Write the bytes, close the fd, then call :meth:`finalize_temp_blob` (or
        :meth:`discard_temp_blob` on failure).
        """
        tmp = self._temp_name(self._blobs)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        return fd, tmp

    def _check_temp(self, temp_path) -> Path:
        tmp = Path(temp_path)
        if tmp.parent != self._blobs or not tmp.name.startswith(TMP_PREFIX):
            raise ValueError(f"{tmp} is not a temp blob of the ramdisk {self.root} (use open_temp_blob)")
        return tmp

    def discard_temp_blob(self, temp_path) -> None:
        """Remove a temp file from :meth:`open_temp_blob` (a failed transfer)."""
        with contextlib.suppress(FileNotFoundError):
            self._check_temp(temp_path).unlink()

    def finalize_temp_blob(self, temp_path, name: str, verify: bool = True) -> bool:
        """Commit a received temp file as blob ``name``; returns whether it was added.

        With ``verify`` (the default) the bytes are hashed first; a mismatch removes the
        temp file and raises CorruptBlobError. False when the blob was already present.
        """
        tmp = self._check_temp(temp_path)
        try:
            _check_name(name)
            if verify:
                fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    actual = _hash_fd(fd, os.fstat(fd).st_size)
                finally:
                    os.close(fd)
                if actual != name:
                    raise CorruptBlobError(f"received copy of blob {name} is corrupt: it hashes to {actual}; "
                                           f"discarded {tmp}")
        except BaseException:
            self.discard_temp_blob(tmp)
            raise
        return self._publish(tmp, self._blobs / name)

    def put_blob_file(self, name: str, src_path: str | os.PathLike) -> bool:
        """Copy the file ``src_path`` in as blob ``name``, verified; returns whether it was added."""
        _check_name(name)
        if self.has_blob(name):
            return False
        fd, tmp = self.open_temp_blob()
        os.close(fd)
        try:
            shutil.copyfile(src_path, tmp)  # sendfile on Linux: no copy through Python
        except BaseException as e:
            self.discard_temp_blob(tmp)
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise self._no_space(f"blob {name}", None, os.stat(src_path).st_size, e) from e
            raise
        return self.finalize_temp_blob(tmp, name, verify=True)

    # --- space -------------------------------------------------------------------------

    def check_space(self, needed_bytes: int, *, step: int) -> None:
        """Make sure ``needed_bytes`` fit before any byte of ``step`` is written.

        If they do not fit, frees what policy allows (the oldest committed steps beyond
        ``max_to_keep - 1``, which the commit would remove anyway, then their blobs), but
        only when that is enough; otherwise nothing is deleted and InsufficientSpaceError
        says what is needed, what is free and how to fix it. The newest step is never removed.
        """
        needed = int(needed_bytes)
        if needed < 0:
            raise ValueError(f"needed_bytes must be >= 0, got {needed_bytes!r}")
        step = _check_step(step)
        with self._lock:
            free = self._free_bytes()
            if needed <= free:
                return
            steps = self.committed_steps()
            keep = max(1, self.max_to_keep - 1)
            drop = steps[:-keep] if len(steps) > keep else []
            kept = steps[len(drop):]
            live_pending = self._live_pending(kept)
            try:
                live = self._live_blobs(kept, live_pending)
            except ManifestError as e:
                log.error("ramdisk %s: cannot free space safely: %s", self.root, e)
                live = None
            reclaim = 0
            if live is not None:
                for name in self.list_blobs() - live:
                    with contextlib.suppress(FileNotFoundError):
                        reclaim += (self._blobs / name).stat().st_blocks * 512
            if free + reclaim < needed:
                raise self._space_error(step, needed, free, reclaim)
            for s in drop:
                log.info("ramdisk %s: removing step %d early to make room for step %d "
                         "(local_max_to_keep=%d)", self.root, s, step, self.max_to_keep)
                self._remove_step(s)
            self._remove_stale_pending(live_pending)
            self._gc_locked(frozenset())
            free = self._free_bytes()
            if needed > free:
                raise self._space_error(step, needed, free, 0)

    def _space_error(self, step: int, needed: int, free: int, reclaim: int) -> InsufficientSpaceError:
        return InsufficientSpaceError(
            f"step {step} does not fit in the ramdisk {self.root}: it needs {format_bytes(needed)} "
            f"({needed} bytes), {format_bytes(free)} ({free} bytes) are free, and removing the old steps "
            f"that local_max_to_keep={self.max_to_keep} allows would free only {format_bytes(reclaim)} more. "
            f"Nothing of step {step} was written. Make the ramdisk larger: see "
            f"`mtc size --params ... --hosts ...`, or lower local_max_to_keep")

    # --- pending (phase 1) ---------------------------------------------------------------

    def _atomic_write(self, final: Path, data: bytes, what: str, step: int) -> None:
        tmp = self._temp_name(final.parent, f"{final.name}-")
        try:
            with open(tmp, "xb") as f:
                f.write(memoryview(data))
            os.replace(tmp, final)
        except BaseException as e:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise self._no_space(what, step, len(data), e) from e
            raise

    def write_pending(self, step: int, host_manifest: bytes) -> None:
        """Write (atomically, replacing) the phase-1 host manifest of ``step``."""
        step = _check_step(step)
        with self._lock:
            d = self._pending_dir(step)
            d.mkdir(exist_ok=True)
            self._atomic_write(d / _HOST_JSON, bytes(host_manifest), "the host manifest", step)

    def read_pending(self, step: int) -> bytes | None:
        """The phase-1 host manifest of ``step``, or None if there is none."""
        try:
            return (self._pending_dir(_check_step(step)) / _HOST_JSON).read_bytes()
        except FileNotFoundError:
            return None

    def _pending_dirs(self) -> dict[int, Path]:
        out = {}
        for p in self._pending.iterdir():
            m = _STEP_DIR_RE.match(p.name)
            if m and p.is_dir():
                out[int(m.group(1))] = p
        return out

    def pending_steps(self) -> list[int]:
        """Steps with a phase-1 host manifest, ascending."""
        return sorted(s for s, p in self._pending_dirs().items() if (p / _HOST_JSON).is_file())

    # --- commit (phase 2) and steps ------------------------------------------------------

    def commit(self, step: int, step_manifest: bytes) -> None:
        """Make ``step`` visible: write steps/<step>.json atomically, last; then prune.

        The manifest must be JSON whose "step" equals ``step`` (ManifestError otherwise).
        """
        step = _check_step(step)
        data = bytes(step_manifest)
        self._parse_step(data, step, f"commit of step {step}")
        with self._lock:
            self._atomic_write(self._step_path(step), data, "the step manifest", step)
            log.info("ramdisk %s: committed step %d", self.root, step)
            d = self._pending_dir(step)
            if d.exists():
                shutil.rmtree(d, ignore_errors=True)
            self.prune()

    @staticmethod
    def _parse_step(data: bytes, step: int, where: str) -> None:
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise ManifestError(f"{where}: the step manifest is not valid JSON ({e})") from None
        if not isinstance(doc, dict) or doc.get("step") != step or isinstance(doc.get("step"), bool):
            got = doc.get("step") if isinstance(doc, dict) else type(doc).__name__
            raise ManifestError(f"{where}: the step manifest must be a JSON object with \"step\": {step}, "
                                f"got {got!r}")

    def _warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def committed_steps(self) -> list[int]:
        """Committed steps, ascending. Malformed files in steps/ are ignored (with a warning)."""
        out = []
        for p in self._steps.iterdir():
            if p.name.startswith(TMP_PREFIX):
                continue
            m = _STEP_FILE_RE.match(p.name)
            if not m:
                self._warn_once(p.name, "ramdisk %s: ignoring %s in steps/: not a step file name", self.root, p)
                continue
            step = int(m.group(1))
            try:
                self._parse_step(p.read_bytes(), step, str(p))
            except FileNotFoundError:
                continue  # removed meanwhile
            except (ManifestError, OSError) as e:
                self._warn_once(p.name, "ramdisk %s: ignoring %s: %s", self.root, p, e)
                continue
            out.append(step)
        return sorted(out)

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def read_step(self, step: int) -> bytes:
        """The step manifest of committed ``step`` (StepNotFoundError if not committed)."""
        step = _check_step(step)
        path = self._step_path(step)
        try:
            data = path.read_bytes()
            self._parse_step(data, step, str(path))
            return data
        except (FileNotFoundError, ManifestError):
            raise StepNotFoundError(f"step {step} is not committed in the ramdisk {self.root}; "
                                    f"committed steps: {self.committed_steps()}") from None

    def _remove_step(self, step: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._step_path(step).unlink()
        d = self._pending_dir(step)
        if d.exists():
            shutil.rmtree(d, ignore_errors=True)

    def delete_step(self, step: int) -> bool:
        """Remove committed ``step`` and its pending manifest, then collect garbage.

        Returns True when there was something to remove.
        """
        step = _check_step(step)
        with self._lock:
            existed = self._step_path(step).exists() or self._pending_dir(step).exists()
            self._remove_step(step)
            self._gc_locked(frozenset())
            return existed

    def _live_pending(self, steps: list[int]) -> list[int]:
        """Pending dirs that still matter: those of uncommitted steps newer than the newest."""
        newest = steps[-1] if steps else None
        return [p for p in self._pending_dirs() if newest is None or (p > newest and p not in steps)]

    def prune(self) -> None:
        """Keep the newest ``max_to_keep`` steps, drop stale pending manifests, then gc()."""
        with self._lock:
            steps = self.committed_steps()
            drop = steps[:-self.max_to_keep] if len(steps) > self.max_to_keep else []
            for s in drop:
                log.info("ramdisk %s: removing step %d (local_max_to_keep=%d)", self.root, s, self.max_to_keep)
                self._remove_step(s)
            self._remove_stale_pending(self._live_pending(steps[len(drop):]))
            self._gc_locked(frozenset())

    def _remove_stale_pending(self, live_pending: list[int]) -> None:
        for p, d in self._pending_dirs().items():
            if p not in live_pending:
                shutil.rmtree(d, ignore_errors=True)

    def _blobs_in(self, path: Path) -> set[str]:
        data = path.read_bytes()
        try:
            return set(self._blobs_of(data))
        except ManifestError:
            raise
        except Exception as e:  # the callback's own parsing errors: untrusted bytes from disk
            raise ManifestError(f"{path}: cannot tell which blobs it uses ({e!r})") from None

    def _live_blobs(self, steps: list[int], pending: Iterable[int]) -> set[str]:
        live = set(self._pins)
        for s in steps:
            live |= self._blobs_in(self._step_path(s))
        dirs = self._pending_dirs()
        for p in pending:
            try:
                live |= self._blobs_in(dirs[p] / _HOST_JSON)
            except (FileNotFoundError, KeyError):
                pass
        return live

    def gc(self, extra_live: Iterable[str] = frozenset()) -> int:
        """Delete blobs that no committed step, pending manifest, pin or ``extra_live`` uses.

        Returns the number of bytes freed. If a manifest cannot be parsed, nothing is deleted
        (an error is logged): deleting blindly could destroy a good step.
        """
        with self._lock:
            return self._gc_locked(frozenset(extra_live))

    def _gc_locked(self, extra_live: frozenset) -> int:
        steps = self.committed_steps()
        try:
            live = self._live_blobs(steps, sorted(self._pending_dirs()))
        except ManifestError as e:
            log.error("ramdisk %s: garbage collection skipped, a manifest is unreadable: %s", self.root, e)
            return 0
        live |= extra_live
        freed = count = 0
        for name in self.list_blobs() - live:
            path = self._blobs / name
            try:
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                continue
            freed += size
            count += 1
        if count:
            log.info("ramdisk %s: garbage collection removed %d blobs, %s", self.root, count, format_bytes(freed))
        return freed

    def wipe(self) -> None:
        """Remove everything under root (a replaced node), leaving an empty store."""
        with self._lock:
            for p in self.root.iterdir():
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
            self._make_dirs()

    def usage(self) -> dict:
        """Bytes and counts: blob_bytes, blob_count, free_bytes, total_bytes, committed/pending steps."""
        blob_bytes = count = 0
        for name in self.list_blobs():
            with contextlib.suppress(FileNotFoundError):
                blob_bytes += (self._blobs / name).stat().st_size
                count += 1
        st = os.statvfs(self.root)
        return {
            "blob_bytes": blob_bytes,
            "blob_count": count,
            "free_bytes": st.f_bavail * st.f_frsize,
            "total_bytes": st.f_blocks * st.f_frsize,
            "committed_steps": self.committed_steps(),
            "pending_steps": self.pending_steps(),
        }
