"""The XLA compilation cache, kept where a restarted training process finds it.

A training process that restarts after a failure compiles its programs again: on the MaxText
runs this project measures, compilation is the largest stage of a recovery after the imports.
JAX's persistent compilation cache turns that into a file read, but MaxText keeps it under
``~/jax_cache`` by default, which a new pod does not have. ``CompileCache`` keeps it where a
restart finds it:

- a folder on the ramdisk (``<local_checkpoint_directory>/mtc-compile-cache``), which survives a
  process restart, as the steps do;
- the backup root (``<backup_root>/compile-cache/``), which survives the loss of the ramdisk: a
  replaced host fills its folder from there while the process imports.

Objects in the backup are named ``compile-cache/<JAX's key>-cache.<sha256 of the bytes>`` and
checked against that hash before they are used; a local entry is written under a temporary name
and renamed, so a kill -9 never leaves half an entry. JAX's key covers the program, the
compile options, the backend, and the jax and jaxlib versions: an entry another program or
another version wrote is never looked up (it only takes room). A bad entry JAX cannot load
is compiled again (JAX warns); it is never a wrong program. JAX's key also holds the cache
folder's path (it points XLA's own caches into it), so the folder has one path on every pod: the
ramdisk's, or, where the head has no ramdisk mounted, ``<temp dir>/mtc-compile-cache``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "compile-cache/"
SUFFIX = "-cache"  # JAX's name for an entry's file: <key>-cache (its -atime files are not copied)
ENV = "MTC_COMPILE_CACHE"  # "0": leave JAX's cache as MaxText sets it
ENV_DIR = "MTC_COMPILE_CACHE_DIR"  # the local folder, instead of the ramdisk's
LOCAL_NAME = "mtc-compile-cache"

_EVENTS = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "misses"}


class CompileCache:
    """JAX's compilation cache in ``local``, copied to and from ``backup_url`` (None: local only).

    Use: ``start_fill()`` and ``enable()`` as early as possible (the fill runs in the background,
    beside the imports), ``wait_filled()`` before the programs that matter compile,
    ``sync_in_background()`` after a save (uploads what was compiled since), ``close()`` at the end.

    Attributes:
        local: the folder JAX reads and writes.
        hits, misses: JAX's persistent-cache lookups in this process, by outcome.
        filled: entries copied from the backup into ``local`` by this process.
        uploaded: entries this process copied to the backup.
    """

    def __init__(self, local: str | os.PathLike, backup_url: str | None = None):
        self.local = Path(local)
        self.backup_url = backup_url
        self.hits = self.misses = self.filled = self.uploaded = 0
        self._in_backup: set[str] = set()  # local file names known to be in the backup
        self._lock = threading.Lock()
        self._fill: threading.Thread | None = None
        self._sync: threading.Thread | None = None
        self._store = None
        self._enabled = False
        self._reported = False

    # --- the backup side -------------------------------------------------------------------

    def _open(self):
        if self._store is None and self.backup_url:
            from mtc.shared.objstore import open_store

            self._store = open_store(self.backup_url)
        return self._store

    def fill(self) -> int:
        """Copy every entry the backup has and ``local`` lacks (checked against its hash)."""
        self.local.mkdir(parents=True, exist_ok=True)
        store = self._open()
        if store is None:
            return 0
        have = {p.name for p in self.local.iterdir()}
        n = 0
        for name in sorted(store.list(PREFIX)):
            entry, _, digest = name[len(PREFIX):].rpartition(".")
            if not entry.endswith(SUFFIX) or len(digest) != 64:
                continue
            if entry in have:
                self._in_backup.add(entry)
                continue
            data = store.get_bytes(name)
            if hashlib.sha256(data).hexdigest() != digest:
                log.warning("mtc: compilation cache: %s in the backup does not match its hash; not used", name)
                continue
            fd, tmp = tempfile.mkstemp(prefix=".fill-", dir=self.local)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.local / entry)
            have.add(entry)
            self._in_backup.add(entry)
            n += 1
        self.filled += n
        return n

    def sync(self) -> int:
        """Copy to the backup every local entry it does not hold yet."""
        store = self._open()
        if store is None or not self.local.is_dir():
            return 0
        n = 0
        for path in sorted(self.local.iterdir()):
            if not path.name.endswith(SUFFIX) or path.name in self._in_backup:
                continue
            data = path.read_bytes()
            store.put_bytes(f"{PREFIX}{path.name}.{hashlib.sha256(data).hexdigest()}", data, if_absent=True)
            self._in_backup.add(path.name)
            n += 1
        with self._lock:
            self.uploaded += n
        return n

    def _guarded(self, what: str, fn) -> None:
        try:
            fn()
        except Exception as e:  # the cache saves time; it never stops training
            log.warning("mtc: compilation cache: %s failed (%s: %s); programs are compiled as without it", what,
                        type(e).__name__, e)

    def start_fill(self) -> None:
        self._fill = threading.Thread(target=self._guarded, args=("filling from the backup", self.fill),
                                      name="mtc-compile-cache-fill", daemon=True)
        self._fill.start()

    def sync_in_background(self) -> None:
        """Upload new entries in a thread, unless an upload is still running."""
        if not self.backup_url or (self._sync is not None and self._sync.is_alive()):
            return
        self._sync = threading.Thread(target=self._guarded, args=("uploading to the backup", self.sync),
                                      name="mtc-compile-cache-sync", daemon=True)
        self._sync.start()

    # --- JAX's side ------------------------------------------------------------------------

    def wait_filled(self, timeout: float = 60.0) -> None:
        """Wait (up to ``timeout`` s) for the fill, so that the next compilation finds its entry."""
        if self._fill is not None:
            self._fill.join(timeout)

    def enable(self) -> None:
        """Point JAX at ``local`` (every program cached, however fast it compiled) and count its lookups."""
        self.local.mkdir(parents=True, exist_ok=True)
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
        return (f"{self.hits} program(s) loaded from the cache, {self.misses} compiled; {self.filled} entries "
                f"from the backup, {self.uploaded} uploaded; {self.entries()} in {self.local}")

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
    ``jax_cache_dir=`` on the command line (the user's own), or multi-tier checkpointing off."""
    env = os.environ if environ is None else environ
    if env.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    if any(a.startswith("jax_cache_dir=") for a in argv[1:]) or not cfg.enable_multi_tier_checkpointing:
        return None
    if env.get(ENV_DIR):
        local = Path(env[ENV_DIR])
    else:
        ramdisk = Path(cfg.local_checkpoint_directory)
        if cfg.mode == "colocated":
            ramdisk.mkdir(parents=True, exist_ok=True)  # the ramdisk mount: the manager fills it anyway
        # In cluster mode the ramdisk is the workers'; the head uses one only where it is mounted.
        local = ramdisk / LOCAL_NAME if ramdisk.is_dir() else Path(tempfile.gettempdir()) / LOCAL_NAME
    return CompileCache(local, cfg.backup_root if cfg.backup_enabled else None)
