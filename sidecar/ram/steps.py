"""The step catalog: phase-1 host manifests under ``pending/`` and commits under ``steps/``.

A step is committed iff ``steps/<step:012d>.json`` exists and parses as JSON whose ``"step"``
equals the number in the file name. Nothing else makes a step visible. Manifest files are
only ever replaced atomically (a new inode), never rewritten in place, so what was parsed of
a file is cached by (inode, mtime, size).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Callable, Iterable

import msgspec

from mtc.shared.errors import InsufficientSpaceError, ManifestError, StepNotFoundError
from mtc.shared.safe_files import MAX_MANIFEST_BYTES, UntrustedFileError, open_regular
from mtc.sidecar.ram.common import TMP_PREFIX, check_step, file_key, read_fd, read_file, temp_path

log = logging.getLogger(__name__)

_JSON = msgspec.json.Decoder()  # (checks a line is JSON at several times json.loads' speed)
_STEP_FILE_RE = re.compile(r"^(\d{12})\.json$")
_STEP_DIR_RE = re.compile(r"^(\d{12})$")
HOST_JSON = "host.json"

BlobsOf = Callable[[bytes], "set[str]"]
NoSpace = Callable[[str, "int | None", "int | None", OSError], InsufficientSpaceError]


def parse_step(data: bytes, step: int, where: str) -> None:
    """ManifestError unless ``data`` is a JSON object whose ``"step"`` is ``step`` (a manifest in
    JSON Lines: its header; every further line must be JSON too). Digests are the readers' job."""
    data = bytes(data)
    view = memoryview(data)
    cut = data.find(b"\n")
    try:
        doc = json.loads(data[:cut] if cut >= 0 else data)
        while cut >= 0:  # each further line, as a view (a keeper's manifest is hundreds of MiB at scale)
            nxt = data.find(b"\n", cut + 1)
            _JSON.decode(view[cut + 1:nxt if nxt >= 0 else len(data)])
            cut = nxt
    except (ValueError, UnicodeDecodeError, msgspec.DecodeError) as e:
        raise ManifestError(f"{where}: the step manifest is not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("step") != step or isinstance(doc.get("step"), bool):
        got = doc.get("step") if isinstance(doc, dict) else type(doc).__name__
        raise ManifestError(f"{where}: the step manifest must be a JSON object with \"step\": {step}, "
                            f"got {got!r}")


_file_key = file_key


def _remove_pending_dir(d: str | Path) -> None:
    """Remove a pending step directory: its host manifest, then the directory (rmtree if it holds more)."""
    try:
        os.unlink(os.path.join(d, HOST_JSON))
    except FileNotFoundError:
        pass
    except OSError:
        shutil.rmtree(d, ignore_errors=True)
        return
    try:
        os.rmdir(d)
    except FileNotFoundError:
        pass
    except OSError:  # not empty (a temp file of an interrupted writer), or not a directory
        shutil.rmtree(d, ignore_errors=True)


class StepCatalog:
    """Pending and committed steps under ``root``; ``blobs_of`` reads the blob names a manifest uses."""

    def __init__(self, root: Path, *, blobs_of: BlobsOf, no_space: NoSpace):
        self.root = root
        self.pending_root = root / "pending"
        self.steps_root = root / "steps"
        # The same as strings: the per-save paths are joined as strings (no Path objects to build).
        self._pending_s = str(self.pending_root)
        self._steps_s = str(self.steps_root)
        self._blobs_of = blobs_of
        self._no_space = no_space
        self._warned: set[str] = set()
        self._step_ok: dict[str, tuple[tuple, str | None]] = {}
        self._blobs_cache: dict[str, tuple[tuple, frozenset]] = {}  # by os.fspath
        self._valid: dict[int, bytes] = {}  # step -> the last bytes of its file that passed parse_step
        self._pending: dict[int, tuple[tuple, bytes]] = {}  # step -> (file key, bytes) this process wrote

    def path(self, step: int) -> Path:
        return self.steps_root / f"{step:012d}.json"

    def pending_dir(self, step: int) -> Path:
        return self.pending_root / f"{step:012d}"

    def _step_file(self, step: int) -> str:
        return f"{self._steps_s}/{step:012d}.json"

    def _pending_dir_s(self, step: int) -> str:
        return f"{self._pending_s}/{step:012d}"

    def _atomic_write(self, final: str, data: bytes, what: str, step: int) -> os.stat_result:
        """Write ``final`` atomically; returns its stat (the cache keys of ``committed``)."""
        directory, name = os.path.split(final)
        tmp = temp_path(directory, f"{name}-")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                view, off = memoryview(data), 0
                while off < len(view):
                    off += os.write(fd, view[off:])
                st = os.fstat(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
            return st
        except BaseException as e:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise self._no_space(what, step, len(data), e) from e
            raise

    # --- pending (phase 1) ---------------------------------------------------------------

    def write_pending(self, step: int, host_manifest: bytes) -> None:
        d = self._pending_dir_s(step)
        data = bytes(host_manifest)
        self._pending.pop(step, None)
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
        st = self._atomic_write(f"{d}/{HOST_JSON}", data, "the host manifest", step)
        self._pending[step] = (_file_key(st), data)

    def read_pending(self, step: int) -> bytes | None:
        path = f"{self._pending_dir_s(check_step(step))}/{HOST_JSON}"
        try:
            mine = self._pending.get(step)
            if mine is not None and _file_key(os.stat(path)) == mine[0]:
                return mine[1]  # the version this process wrote (files are replaced, never rewritten)
            return read_file(path, MAX_MANIFEST_BYTES, "host manifest")[0]
        except (FileNotFoundError, UntrustedFileError):
            return None

    def pending_dirs(self) -> dict[int, Path]:
        out = {}
        with os.scandir(self.pending_root) as it:
            for e in it:
                m = _STEP_DIR_RE.match(e.name)
                if m and e.is_dir():
                    out[int(m.group(1))] = self.pending_root / e.name
        return out

    def pending_steps(self) -> list[int]:
        return sorted(s for s, p in self.pending_dirs().items() if (p / HOST_JSON).is_file())

    def live_pending(self, steps: list[int], dirs: dict[int, Path] | None = None) -> list[int]:
        """Pending dirs that still matter: those of uncommitted steps newer than the newest
        (``dirs``: a listing of ``pending_dirs`` made under the store's lock, else a new one)."""
        newest = steps[-1] if steps else None
        dirs = self.pending_dirs() if dirs is None else dirs
        return [p for p in dirs if newest is None or (p > newest and p not in steps)]

    def remove_stale_pending(self, live_pending: list[int], dirs: dict[int, Path] | None = None) -> None:
        """Remove the pending dirs not in ``live_pending`` (of ``dirs``, as in ``live_pending``);
        removed ones are dropped from ``dirs``."""
        dirs = self.pending_dirs() if dirs is None else dirs
        for p, d in list(dirs.items()):
            if p not in live_pending:
                self._pending.pop(p, None)
                _remove_pending_dir(d)
                del dirs[p]

    # --- committed (phase 2) -------------------------------------------------------------

    def write_commit(self, step: int, data: bytes) -> None:
        """Write ``steps/<step>.json`` atomically (``data`` already validated), then drop the
        step's pending manifest."""
        path = self._step_file(step)
        st = self._atomic_write(path, data, "the step manifest", step)
        key = _file_key(st)
        self._step_ok[os.path.basename(path)] = (key, None)  # validated: no second parse
        try:  # what it keeps alive, for the garbage collection that follows: not read back
            self._blobs_cache[path] = (key, frozenset(self._blobs_of(data)))
        except Exception:  # unreadable for the callback: garbage collection reads it and says so
            self._blobs_cache.pop(path, None)
        self._valid[step] = data
        self._pending.pop(step, None)
        _remove_pending_dir(self._pending_dir_s(step))

    def _warn_once(self, key: str, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def committed(self) -> list[int]:
        """Committed steps, ascending. Malformed files in steps/ are ignored (with a warning)."""
        out = []
        seen = {}
        for name in os.listdir(self.steps_root):
            if name.startswith(TMP_PREFIX):
                continue
            p = f"{self._steps_s}/{name}"
            m = _STEP_FILE_RE.match(name)
            if not m:
                self._warn_once(name, "ramdisk %s: ignoring %s in steps/: not a step file name", self.root, p)
                continue
            step = int(m.group(1))
            try:
                # One stat for a version already checked (files are replaced, never rewritten).
                key = _file_key(os.stat(p))
                cached = self._step_ok.get(name)
                if cached is not None and cached[0] == key:
                    error = cached[1]
                else:
                    fd = open_regular(p, "step manifest")  # not through a link, not a FIFO
                    try:
                        st = os.fstat(fd)
                        key = _file_key(st)
                        try:
                            if st.st_size > MAX_MANIFEST_BYTES:
                                raise ManifestError(f"{p} has {st.st_size} bytes, more than a step manifest may "
                                                    f"have ({MAX_MANIFEST_BYTES})")
                            parse_step(read_fd(fd, st.st_size), step, p)
                            error = None
                        except ManifestError as e:
                            error = str(e)
                    finally:
                        os.close(fd)
                seen[name] = (key, error)
            except FileNotFoundError:
                continue  # removed meanwhile
            except OSError as e:
                error = str(e)
            if error is not None:
                self._warn_once(name, "ramdisk %s: ignoring %s: %s", self.root, p, error)
                continue
            out.append(step)
        self._step_ok = seen
        if len(self._valid) > len(out):
            self._valid = {s: d for s, d in self._valid.items() if s in out}
        return sorted(out)

    def unreadable(self) -> list[int]:
        """Steps whose file is there but fails ``parse_step`` (as of the last ``committed()``): a
        committed step whose file was damaged (only a commit writes one, atomically)."""
        out = []
        for name, (_, error) in self._step_ok.items():
            m = _STEP_FILE_RE.match(name)
            if error is not None and m and (self.steps_root / name).exists():
                out.append(int(m.group(1)))
        return sorted(out)

    def read(self, step: int) -> bytes:
        step = check_step(step)
        path = self._step_file(step)
        try:
            data = read_file(path, MAX_MANIFEST_BYTES, "step manifest")[0]
            if self._valid.get(step) != data:  # the same bytes as last time need no second parse
                parse_step(data, step, path)
                self._valid[step] = data
            return data
        except (FileNotFoundError, ManifestError, UntrustedFileError):
            raise StepNotFoundError(f"step {step} is not committed in the ramdisk {self.root}; "
                                    f"committed steps: {self.committed()}") from None

    def remove(self, step: int, *, pending: bool = True) -> None:
        """Remove committed ``step`` and its pending dir (``pending=False``: the caller's listing
        under the store's lock has none)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._step_file(step))
        self._valid.pop(step, None)
        self._pending.pop(step, None)
        if pending:
            _remove_pending_dir(self._pending_dir_s(step))

    def exists(self, step: int) -> bool:
        return self.path(step).exists() or self.pending_dir(step).exists()

    # --- what the manifests keep alive ---------------------------------------------------

    def blobs_in(self, path: str | Path, key: tuple | None = None) -> set[str]:
        """The blob names the manifest file ``path`` uses (ManifestError if unreadable); ``key``:
        its ``file_key`` as the caller just found it (else one stat here)."""
        path = os.fspath(path)
        cached = self._blobs_cache.get(path)
        if cached is not None and cached[0] == (key if key is not None else _file_key(os.stat(path))):
            return set(cached[1])
        try:
            data, key = read_file(path, MAX_MANIFEST_BYTES, "step manifest")
        except UntrustedFileError as e:
            raise ManifestError(str(e)) from None
        try:
            names = frozenset(self._blobs_of(data))
        except ManifestError:
            raise
        except Exception as e:  # the callback's own parsing errors: untrusted bytes from disk
            raise ManifestError(f"{path}: cannot tell which blobs it uses ({e!r})") from None
        if len(self._blobs_cache) > 256:
            self._blobs_cache = {p: v for p, v in self._blobs_cache.items() if os.path.exists(p)}
        self._blobs_cache[path] = (key, names)
        return set(names)

    def live_blobs(self, steps: list[int], pending: Iterable[int], pinned: Iterable[str],
                   dirs: dict[int, Path] | None = None) -> set[str]:
        """Blobs used by ``steps``, the ``pending`` host manifests (of ``dirs``, a ``pending_dirs``
        listing made under the store's lock, else a new one), and ``pinned``."""
        live = set(pinned)
        for s in steps:
            # The key ``committed`` found for it; callers list the steps under the store's lock
            # first, and only this process commits (and holds that lock), so it is current.
            seen = self._step_ok.get(f"{s:012d}.json")
            live |= self.blobs_in(self._step_file(s), seen[0] if seen is not None and seen[1] is None else None)
        dirs = self.pending_dirs() if dirs is None else dirs
        for p in pending:
            try:
                live |= self.blobs_in(os.path.join(dirs[p], HOST_JSON))
            except (FileNotFoundError, KeyError):
                pass
        return live
