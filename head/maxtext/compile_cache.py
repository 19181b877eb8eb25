"""The XLA compilation cache, kept where a restarted training process finds it, and trusted only when
this job signed it.

A training process that restarts after a failure compiles its programs again: on the MaxText
runs this project measures, compilation is the largest stage of a recovery after the imports.
JAX's persistent compilation cache turns that into a file read, but MaxText keeps it under
``~/jax_cache`` by default, which a new pod does not have. An entry of that cache is an XLA
executable: native code, run in the training process, which holds the job's token and keys. JAX's
documentation says the cache directory must be trusted; the places where a restart finds it (the
ramdisk volume, the bucket) may be writable by others. So ``CompileCache`` keeps three places:

- JAX's folder (``local``): private to this user, created with mode 0700 and checked for its owner
  and mode whenever it is used (a folder someone else made, or one others can write, is refused and
  the cache is off). Only JAX and this class write there. It has one path on every pod
  (``<temp dir>/mtc-compile-cache-<uid>``: JAX's key holds the folder's path), so a process that
  restarts in the same pod finds its entries there at once;
- the ramdisk's shelf (``<local_checkpoint_directory>/mtc-compile-cache/``), which survives the loss
  of the pod as the steps do, and the backup root (``<backup_root>/compile-cache/``), which survives
  the loss of the ramdisk. Both hold entries as ``<JAX's key>-cache.<tag>``: the tag is a MAC under the
  job key (``mtc.shared.job_key``) over the kind, JAX's key and the bytes. An entry enters JAX's
  folder from them only when its tag checks: a planted one, one renamed to another program's key, or
  one of another job is never loaded (one warning, a count in ``rejected``). With no job key (no
  token), nothing is shared: JAX's folder alone.

Every read opens a regular file or object of at most ``MAX_ENTRY_BYTES``, never through a link; the
fill copies at most ``FILL_MAX_ENTRIES`` entries and ``FILL_MAX_BYTES`` (the programs a run compiles,
a few per run), removes its temporaries, and the shelf takes at most ``SHELF_SHARE`` of the ramdisk
(it never takes room a save needs: what does not fit stays in the backup).

An entry this job signed can still fail when it runs (a program that raises, or crashes the process,
on this machine): then every restart would load it again. So the entries a start copied in are on
probation (``.mtc-probation.json`` in JAX's folder) until that start's second train step (or its first
save); a start that finds the list of an earlier one, which never got that far, drops those entries (from JAX's folder, the
shelf and the backup), copies none of them in again, and lets JAX compile them. A crash before the
second step for any other reason costs one compilation of what the cache had; never a restart loop.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import threading
from pathlib import Path

from mtc.shared import job_key
from mtc.shared.config import env_flag
from mtc.shared.safe_files import GiB, MiB, UntrustedFileError, read_regular

log = logging.getLogger(__name__)

PREFIX = "compile-cache/"
SUFFIX = "-cache"  # JAX's name for an entry's file: <key>-cache (its -atime files are not copied)
ENV = "MTC_COMPILE_CACHE"  # "0": leave JAX's cache as MaxText sets it
ENV_DIR = "MTC_COMPILE_CACHE_DIR"  # JAX's folder, instead of <temp dir>/mtc-compile-cache-<uid>
LOCAL_NAME = "mtc-compile-cache"  # the shelf's folder on the ramdisk
KIND = "compilation cache entry"

MAX_ENTRY_BYTES = 512 * MiB
FILL_MAX_ENTRIES = 64
FILL_MAX_BYTES = 2 * GiB
SHELF_SHARE = 0.05  # of the ramdisk's size, for the shelf's entries together
_TEMP = ".fill-"
# In JAX's folder: the entries this start copied in, until its second step or first save (``CompileCache.passed``).
PROBATION = ".mtc-probation.json"
MAX_PROBATION_BYTES = 1 * MiB

_EVENTS = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "misses"}


class PrivateFolderError(UntrustedFileError):
    """JAX's cache folder is not this user's alone (owner, mode, a link): the cache is not used."""


def private_folder(path: str | os.PathLike) -> Path:
    """``path``, created with mode 0700 if missing; a PrivateFolderError when it is a link, not a
    folder, not this user's, or writable (or readable) by others."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    fix = f"remove it, or set {ENV_DIR} to a folder of this user's with mode 0700"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise PrivateFolderError(f"the compilation cache folder {path} is {'a link' if stat.S_ISLNK(st.st_mode) else 'not a folder'}; {fix}")
    if st.st_uid != os.getuid():
        raise PrivateFolderError(f"the compilation cache folder {path} belongs to user {st.st_uid}, not to this "
                                 f"process's ({os.getuid()}): its entries would run as this job's code; {fix}")
    if st.st_mode & 0o077:
        raise PrivateFolderError(f"the compilation cache folder {path} has mode {stat.S_IMODE(st.st_mode):o}: others "
                                 f"can reach it, and its entries run as this job's code; {fix} (chmod 700 it)")
    return path


def default_folder() -> Path:
    return Path(tempfile.gettempdir()) / f"{LOCAL_NAME}-{os.getuid()}"


class CompileCache:
    """JAX's compilation cache in the private folder ``local``, shared through the ramdisk's ``shelf``
    and the backup at ``backup_url`` (either None: not used) as entries signed with ``key``.

    Use: ``start_fill()`` and ``enable()`` as early as possible (the fill runs in the background,
    beside the imports), ``wait_filled()`` before the programs that matter compile,
    ``sync_in_background()`` after a save (shelves and uploads what was compiled since), ``close()``.

    Attributes:
        local: the folder JAX reads and writes (private).
        shelf: the ramdisk's folder of signed entries, or None.
        hits, misses: JAX's persistent-cache lookups in this process, by outcome.
        filled: entries copied into ``local`` by this process (``from_shelf`` of them from the ramdisk's
            shelf, ``from_backup`` from the backup).
        uploaded: entries this process copied to the backup.
        rejected: entries that failed the job key's check (never loaded).
    """

    def __init__(self, local: str | os.PathLike, backup_url: str | None = None, *, shelf: str | os.PathLike | None = None,
                 key: job_key.JobKey | None = None):
        self.local = Path(local)
        self.key = key if key is not None else job_key.JobKey.from_secret()
        shared = self.key.enabled
        if not shared and (backup_url or shelf):
            log.warning("mtc: compilation cache: no job key (set %s or %s), so entries are neither read from nor "
                        "written to the ramdisk or the backup: a restarted pod compiles again", job_key.ENV_TOKEN,
                        job_key.ENV_KEY)
        self.backup_url = backup_url if shared else None
        self.shelf = Path(shelf) if shelf is not None and shared else None
        self.hits = self.misses = self.filled = self.uploaded = self.rejected = 0
        self.from_shelf = self.from_backup = 0
        self.dropped = 0  # entries of an earlier start that never reached its second step (probation)
        self._steps = 0  # train steps that asked to be saved (step_seen)
        self._in_backup: set[str] = set()  # entries known to be in the backup
        self._on_shelf: set[str] = set()  # entries known to be on the shelf
        self._lock = threading.Lock()
        self._fill: threading.Thread | None = None
        self._sync: threading.Thread | None = None
        self._store = None
        self._enabled = False
        self._reported = False

    # --- signed entries ------------------------------------------------------------------

    def _signed_name(self, entry: str, data: bytes) -> str:
        return f"{entry}.{self.key.sign(KIND, entry, data)}"

    @staticmethod
    def _parse(name: str) -> tuple[str, str] | None:
        entry, _, tag = name.rpartition(".")
        if not entry.endswith(SUFFIX) or "/" in entry or entry.startswith("."):
            return None
        return entry, tag

    def _accept(self, entry: str, tag: str, data: bytes, where: str) -> bool:
        verdict = self.key.check(KIND, entry, data, tag if job_key.is_tag(tag) else None)
        if verdict == job_key.OK:
            return True
        self.rejected += 1
        job_key.refuse(KIND, f"{entry}.{tag}", verdict, where, "not loaded; the program is compiled instead")
        return False

    def _open(self):
        if self._store is None and self.backup_url:
            from mtc.shared.objstore import open_store

            self._store = open_store(self.backup_url)
        return self._store

    def _clean_temps(self, folder: Path) -> None:
        for p in folder.glob(f"{_TEMP}*"):
            try:
                p.unlink()
            except OSError:
                pass

    def _place(self, folder: Path, name: str, data: bytes) -> None:
        """``data`` as ``folder/name``, whole or not at all (a temporary, renamed; removed on failure)."""
        fd, tmp = tempfile.mkstemp(prefix=_TEMP, dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, folder / name)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    # --- the fill ------------------------------------------------------------------------

    def fill(self) -> int:
        """Copy into ``local`` the signed entries the shelf and the backup have and ``local`` lacks,
        within the fill's budget; entries that fail the check are skipped (and counted)."""
        private_folder(self.local)
        self._clean_temps(self.local)
        suspects = self._take_probation()
        if suspects:
            self._drop(suspects)
        have = {p.name for p in self.local.iterdir()} | suspects  # the suspects: not copied in again
        placed: list[str] = []
        budget = [FILL_MAX_ENTRIES, FILL_MAX_BYTES]
        n = 0
        if self.shelf is not None and self.shelf.is_dir():
            self._clean_temps(self.shelf)
            for p in sorted(self.shelf.iterdir()):
                parsed = self._parse(p.name)
                if parsed is None:
                    continue
                entry, tag = parsed
                self._on_shelf.add(entry)
                if entry in have or not self._within(budget, p.lstat().st_size, p):
                    continue
                try:
                    data = read_regular(p, MAX_ENTRY_BYTES, KIND)
                except (UntrustedFileError, OSError) as e:
                    log.warning("mtc: compilation cache: %s not used (%s)", p, e)
                    continue
                if self._accept(entry, tag, data, str(self.shelf)):
                    self._place(self.local, entry, data)
                    have.add(entry)
                    self.from_shelf += 1
                    placed.append(entry)
                    n += 1
        store = self._open()
        if store is not None:
            from mtc.shared.objstore.store import StoreError

            for name in sorted(store.list(PREFIX)):
                parsed = self._parse(name[len(PREFIX):])
                if parsed is None:
                    continue
                entry, tag = parsed
                if entry in have:
                    self._in_backup.add(entry)
                    continue
                if not job_key.is_tag(tag):  # an unsigned (or older mtc's) entry: never read
                    self._accept(entry, tag, b"", self.backup_url)
                    continue
                size = store.size(name)
                if size is None or not self._within(budget, size, name):
                    continue
                try:
                    data = store.get_bytes(name, max_bytes=MAX_ENTRY_BYTES)
                except StoreError as e:
                    log.warning("mtc: compilation cache: %s in the backup not used (%s)", name, e)
                    continue
                if self._accept(entry, tag, data, self.backup_url):
                    self._place(self.local, entry, data)
                    have.add(entry)
                    self._in_backup.add(entry)
                    self.from_backup += 1
                    placed.append(entry)
                    n += 1
        self.filled += n
        if placed:
            self._place(self.local, PROBATION, json.dumps(sorted(placed)).encode())
        return n

    # --- probation -----------------------------------------------------------------------

    def _take_probation(self) -> set[str]:
        """The entries an earlier start copied in and never saw its second step or first save with (the list removed)."""
        path = self.local / PROBATION
        try:
            names = json.loads(read_regular(path, MAX_PROBATION_BYTES, "compilation cache probation list"))
        except FileNotFoundError:
            return set()
        except (UntrustedFileError, OSError, ValueError) as e:
            names = []
            log.warning("mtc: compilation cache: %s not read (%s); removed", path, e)
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        if not isinstance(names, list):
            return set()
        return {n for n in names if isinstance(n, str) and n.endswith(SUFFIX) and "/" not in n and not n.startswith(".")}

    def _drop(self, entries: set[str]) -> None:
        """Remove ``entries`` from JAX's folder, the shelf and the backup."""
        log.warning("mtc: compilation cache: the last start in this pod copied %d program(s) in from the ramdisk or "
                    "the backup and ended before its second step; they are dropped (here, on the ramdisk and in the "
                    "backup) and compiled again, so that a program that fails when it runs cannot make a restart "
                    "loop", len(entries))
        for entry in entries:
            try:
                (self.local / entry).unlink()
            except FileNotFoundError:
                pass
        if self.shelf is not None and self.shelf.is_dir():
            for p in self.shelf.iterdir():
                parsed = self._parse(p.name)
                if parsed is not None and parsed[0] in entries:
                    p.unlink(missing_ok=True)
        store = self._open()
        if store is not None:
            for name in store.list(PREFIX):
                parsed = self._parse(name[len(PREFIX):])
                if parsed is not None and parsed[0] in entries:
                    store.delete(name)
        self.dropped += len(entries)

    def step_seen(self) -> bool:
        """One more train step asked to be saved; True from the second on (the first step's results were
        read by then: the programs ran)."""
        self._steps += 1
        return self._steps >= 2

    def passed(self) -> None:
        """The programs this start copied in ran (two steps, or a save): off probation."""
        try:
            (self.local / PROBATION).unlink()
        except FileNotFoundError:
            pass

    @staticmethod
    def _within(budget: list[int], size: int, what) -> bool:
        if size > MAX_ENTRY_BYTES or budget[0] < 1 or budget[1] < size:
            log.info("mtc: compilation cache: %s (%d bytes) not copied: over the fill's budget (%d entries, %d "
                     "bytes of at most %d bytes each)", what, size, FILL_MAX_ENTRIES, FILL_MAX_BYTES, MAX_ENTRY_BYTES)
            return False
        budget[0] -= 1
        budget[1] -= size
        return True

    # --- the sync ------------------------------------------------------------------------

    def sync(self) -> int:
        """Sign every entry of ``local`` that the shelf or the backup lacks and copy it there; return
        how many were uploaded to the backup."""
        if (self.shelf is None and self.backup_url is None) or not self.local.is_dir():
            return 0
        private_folder(self.local)
        store = self._open()
        n = 0
        for path in sorted(self.local.iterdir()):
            entry = path.name
            if not entry.endswith(SUFFIX) or entry.startswith("."):
                continue
            shelve = self.shelf is not None and entry not in self._on_shelf
            upload = store is not None and entry not in self._in_backup
            if not (shelve or upload):
                continue
            try:
                data = read_regular(path, MAX_ENTRY_BYTES, KIND)
            except (UntrustedFileError, OSError) as e:  # JAX writes regular files: this one it did not
                log.warning("mtc: compilation cache: %s not copied (%s)", path, e)
                continue
            name = self._signed_name(entry, data)
            if shelve:
                self._shelve(name, data)
                self._on_shelf.add(entry)
            if upload:
                store.put_bytes(f"{PREFIX}{name}", data, if_absent=True)
                self._in_backup.add(entry)
                n += 1
        with self._lock:
            self.uploaded += n
        return n

    def _shelve(self, name: str, data: bytes) -> None:
        """Put a signed entry on the ramdisk's shelf when it fits the shelf's share of the ramdisk."""
        self.shelf.mkdir(parents=True, exist_ok=True)
        usage = shutil.disk_usage(self.shelf)
        held = sum(p.lstat().st_size for p in self.shelf.iterdir())
        room = min(SHELF_SHARE * usage.total - held, usage.free - SHELF_SHARE * usage.total)
        if len(data) > room:
            log.info("mtc: compilation cache: %s (%d bytes) not put on the ramdisk: the shelf may take %.0f%% of it "
                     "and has %d bytes; the backup holds it", name, len(data), SHELF_SHARE * 100, max(0, int(room)))
            return
        self._place(self.shelf, name, data)

    def _guarded(self, what: str, fn) -> None:
        try:
            fn()
        except Exception as e:  # the cache saves time; it never stops training
            log.warning("mtc: compilation cache: %s failed (%s: %s); programs are compiled as without it", what,
                        type(e).__name__, e)

    def start_fill(self) -> None:
        self._fill = threading.Thread(target=self._guarded, args=("filling from the ramdisk and the backup", self.fill),
                                      name="mtc-compile-cache-fill", daemon=True)
        self._fill.start()

    def sync_in_background(self) -> None:
        """Shelve and upload new entries in a thread, unless a sync is still running."""
        if (self.backup_url is None and self.shelf is None) or (self._sync is not None and self._sync.is_alive()):
            return
        self._sync = threading.Thread(target=self._guarded, args=("copying to the ramdisk and the backup", self.sync),
                                      name="mtc-compile-cache-sync", daemon=True)
        self._sync.start()

    # --- JAX's side ------------------------------------------------------------------------

    def wait_filled(self, timeout: float = 60.0) -> None:
        """Wait (up to ``timeout`` s) for the fill, so that the next compilation finds its entry."""
        if self._fill is not None:
            self._fill.join(timeout)

    def enable(self) -> None:
        """Point JAX at ``local`` (every program cached, however fast it compiled) and count its lookups;
        a PrivateFolderError (nothing enabled) when ``local`` is not this user's alone."""
        private_folder(self.local)
        if self._enabled:
            return
        import jax

        jax.config.update("jax_compilation_cache_dir", str(self.local))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

        def on_event(event: str, **_: object) -> None:
            field = _EVENTS.get(event)
            if field:
                with self._lock:
                    setattr(self, field, getattr(self, field) + 1)

        jax.monitoring.register_event_listener(on_event)
        self._enabled = True

    def entries(self) -> int:
        return sum(1 for p in self.local.glob(f"*{SUFFIX}")) if self.local.is_dir() else 0

    def summary(self) -> str:
        refused = f", {self.rejected} refused (not signed by this job)" if self.rejected else ""
        refused += f", {self.dropped} dropped (on probation from a start that ended before its second step)" if self.dropped else ""
        return (f"{self.hits} program(s) loaded from the cache, {self.misses} compiled; {self.filled} entries "
                f"filled ({self.from_shelf} from the ramdisk, {self.from_backup} from the backup), {self.uploaded} "
                f"uploaded{refused}; {self.entries()} in {self.local}")

    def first_report(self) -> str | None:
        """``summary()`` the first time it is asked for, then None (for one log line a run)."""
        if self._reported:
            return None
        self._reported = True
        return self.summary()

    def close(self, timeout: float = 30.0) -> None:
        if self._sync is not None:
            self._sync.join(timeout)
        if self._store is not None:
            self._store.close()
            self._store = None


def for_launcher(argv: list[str], cfg, environ=None) -> CompileCache | None:
    """The cache the MaxText launcher keeps for this run, or None: ``MTC_COMPILE_CACHE=0``, a
    ``jax_cache_dir=`` on the command line (the user's own), multi-tier checkpointing off, Pathways
    (``JAX_PLATFORMS`` names its ``proxy`` backend: Pathways caches its own compilations, and
    ``pathwaysutils.initialize()`` turns JAX's persistent cache off), or a JAX folder that is not
    private (said in a warning)."""
    env = os.environ if environ is None else environ
    if not env_flag(ENV, env, default=True):
        return None
    if any(a.startswith("jax_cache_dir=") for a in argv[1:]) or not cfg.enable_multi_tier_checkpointing:
        return None
    platforms = env.get("JAX_PLATFORMS", "")
    if "proxy" in platforms:  # as pathwaysutils.is_pathways_backend_used() tells, before JAX starts
        log.info("mtc: compilation cache: not used on Pathways (JAX_PLATFORMS=%s): Pathways keeps its own compilation "
                 "cache, and pathwaysutils turns JAX's persistent cache off; mtc leaves it alone", platforms)
        return None
    local = Path(env[ENV_DIR]) if env.get(ENV_DIR) else default_folder()
    try:
        private_folder(local)
    except (PrivateFolderError, OSError) as e:
        log.warning("mtc: compilation cache off: %s", e)
        return None
    ramdisk = Path(cfg.local_checkpoint_directory)
    if cfg.mode == "colocated":
        ramdisk.mkdir(parents=True, exist_ok=True)  # the ramdisk mount: the manager fills it anyway
    # In cluster mode the ramdisk is the workers'; the head uses one only where it is mounted.
    shelf = ramdisk / LOCAL_NAME if ramdisk.is_dir() else None
    key = job_key.JobKey.from_secret(cfg.peer_token, env)
    return CompileCache(local, cfg.backup_root if cfg.backup_enabled else None, shelf=shelf, key=key)
