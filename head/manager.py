"""The checkpoint manager: the Orbax-style surface the training script uses.

``save`` validates and flattens the state, copies it to host memory (the only time training
waits), then writes it in the background: phase 1 on every sidecar, the step manifest built
from their answers, phase 2 on every sidecar; then, still in the background, replication to
peers and (when due) a backup. ``restore`` picks the newest step whose every blob has a copy
on some host (or in a backup), or the one asked for; hosts that lack blobs of it pull them
from peers (or the backup) first, then it comes back with the target's shardings.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

from mtc.head import tree as tree_lib
from mtc.head.backup_plan import assign_uploads, backup_due
from mtc.head.elastic import as_host_lost, host_lost_as_elastic
from mtc.head.reports import (BackupReport, Inventory, PrefetchReport, ReplicationReport, RestoreReport,
                               SaveReport, StepStatus)
from mtc.head.replication_loop import Replicator
from mtc.head.restore_plan import is_prng_key, make_plan, plan_target, prng_key_shape
from mtc.head.dispatch import Dispatcher, Leaf, LoadRequest
from mtc.head.replication import ReplicationStrategy, step_views, summarize
from mtc.shared import format as fmt
from mtc.shared import backup_layout, shardings, version
from mtc.shared.config import MTCConfig
from mtc.shared.errors import (
    ConfigError,
    CorruptBlobError,
    FencedError,
    HostUnreachableError,
    MTCError,
    SaveError,
    StepNotFoundError,
    TargetMismatchError,
    cause_in_chain,
)
from mtc.shared.objstore.store import TransientStoreError

log = logging.getLogger(__name__)

# How long listing the backups may retry an unreachable store (latest_step, restore wait on it).
_LISTING_DEADLINE_S = 30.0

# Managers alive in this process. At interpreter exit (a training script that never calls
# close(), as MaxText's does not), their background retries must stop, or the exit waits for
# them: Python joins executor threads before atexit handlers run, so the hook goes where
# concurrent.futures registers its own (threading._register_atexit, run before that join).
_LIVE: "weakref.WeakSet[CheckpointManager]" = weakref.WeakSet()
_exit_hook_installed = False


def _stop_background_retries() -> None:
    for m in list(_LIVE):
        m._closing.set()


def _install_exit_hook() -> None:
    global _exit_hook_installed
    if _exit_hook_installed:
        return
    register = getattr(threading, "_register_atexit", None) or atexit.register
    register(_stop_background_retries)
    _exit_hook_installed = True


def _classify(key: str, leaf: Any) -> str:
    if isinstance(leaf, jax.Array):
        return "jax"
    if isinstance(leaf, (np.ndarray, np.generic)):
        return "numpy"
    if isinstance(leaf, (bool, int, float, str)):
        return "scalar"
    raise TargetMismatchError(
        f"leaf {key!r} is a {type(leaf).__name__}; mtc saves jax.Array, numpy arrays and Python "
        "scalars (bool, int, float, str): convert it or leave it out of the state")


def _scalar_doc(v: Any) -> dict:
    if isinstance(v, bool):
        return {"type": "bool", "v": v}
    if isinstance(v, int):
        return {"type": "int", "v": v}
    if isinstance(v, float):
        return {"type": "float", "v": v.hex()}
    return {"type": "str", "v": v}


class CheckpointManager:
    """Save and restore JAX training state through mtc's sidecars.

    Usable as a context manager. ``config`` is an ``MTCConfig``; keyword arguments build one.
    """

    def __init__(self, config: MTCConfig | None = None, *, dispatcher: Dispatcher | None = None,
                 **kwargs: Any):
        if config is None:
            config = MTCConfig(**kwargs)
        elif kwargs:
            config = config.replace(**kwargs)
        if not config.local_checkpoint_directory:
            raise ConfigError(
                "local_checkpoint_directory is empty: set it to the ramdisk path "
                "(e.g. local_checkpoint_directory=/tmp/mtc_checkpoints)")
        self._config = config
        self._dispatch = dispatcher or _make_dispatcher(config)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mtc-save")
        self._pending: Future | None = None
        self._pending_step: int | None = None
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._checked_versions = False
        self._ready_lock = threading.Lock()
        self._started = time.time()
        self._fenced: FencedError | None = None  # set once a newer head took the hosts
        self.head: dict | None = None  # who this head is, as the hosts' leases name it
        self._known_steps: set[int] | None = None  # committed steps, to refuse a duplicate save cheaply
        self._closed = False
        self.last_save_report: SaveReport | None = None
        self.last_restore_report: RestoreReport | None = None
        self.last_backup_report: BackupReport | None = None
        self._backup_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mtc-backup")
        self._backup_pending: Future | None = None
        self._backup_skipped = 0
        self._last_backup: tuple[int, float] | None = None  # (step, monotonic time) of the last started
        self._closing = threading.Event()
        self._strategy = ReplicationStrategy(config.replication_factor)
        self._replicator = Replicator(self._dispatch, config, self._strategy, self._closing)
        _install_exit_hook()
        _LIVE.add(self)
        self.last_prefetch_report: PrefetchReport | None = None
        self._prefetch_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mtc-prefetch")
        self._prefetch: Future | None = None
        self._prefetch_counted = False
        if config.prefetch_on_start and config.enable_checkpointing:
            self._prefetch = self._prefetch_executor.submit(self._prefetch_latest)

    @property
    def config(self) -> MTCConfig:
        return self._config

    # --- versions ------------------------------------------------------------------------

    def _check_versions(self) -> None:
        """Before the first save or restore: the sidecars' versions, then take the hosts (fencing)."""
        if self._fenced is not None:
            raise self._fenced
        with self._ready_lock:  # the start-up pull and the first save/restore may race here
            if not self._checked_versions:
                version.check_fingerprints(version.fingerprint(), self._dispatch.fingerprints())
                self._claim_hosts()
                self._checked_versions = True

    def _claim_hosts(self) -> None:
        """Take every host for this head with a generation newer than any lease they hold.

        A head that drove them before (alive, or killed -9) is fenced off: its next change
        is refused with FencedError naming this one. Hosts that cannot be asked now take the
        generation with this head's first request that reaches them.
        """
        head = {"host": socket.gethostname(), "pid": os.getpid(), "id": uuid.uuid4().hex[:12],
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self._started))}
        newest = max((lease["generation"] for lease in self._dispatch.leases().values() if lease), default=0)
        generation = max(time.time_ns() // 1000, newest + 1)
        self._dispatch.claim(generation, head)
        self._dispatch.generation = generation
        self.head = head
        log.info("head %s (pid %d) drives %d hosts as generation %d", head["host"], head["pid"],
                 len(self._dispatch.hosts()), generation)

    # --- save ----------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """True when ``step`` is due under ``local_checkpoint_period``."""
        return self._config.enable_checkpointing and self._config.should_save(step)

    def save(self, step: int, state: Any, force: bool = False) -> bool:
        """Save ``state`` as ``step`` if due (or ``force``); returns whether a save started.

        Returns once the state is copied to host memory; the write continues in the
        background (see ``wait_until_finished`` and ``check_for_errors``). A host that stops
        answering raises ``HostLostError``, a ``jax.errors.JaxRuntimeError`` that elastic
        training retries on.
        """
        with host_lost_as_elastic():
            return self._save(step, state, force)

    @property
    def in_flight_step(self) -> int | None:
        """The step whose background write is running (not committed yet), or None."""
        pending, step = self._pending, self._pending_step
        return step if pending is not None and not pending.done() else None

    def has_step(self, step: int) -> bool:
        """Whether ``step`` is committed on the hosts or being saved now (no new save of it will start)."""
        if self.in_flight_step == step:
            return True
        if self._known_steps is None:
            self._known_steps = set(self._cluster_steps())
        return step in self._known_steps

    def _save(self, step: int, state: Any, force: bool) -> bool:
        self._check_open()
        if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        step = int(step)
        if not self._config.enable_checkpointing:
            return False
        if not (force or self.should_save(step)):
            return False
        t0 = time.perf_counter()
        waited = self._wait_previous()
        self._check_versions()
        if self._known_steps is None:
            self._known_steps = set(self._cluster_steps())
        if step in self._known_steps:
            raise ValueError(f"step {step} is already committed; save a new step number "
                             "(or restore it: checkpoints are immutable)")
        leaves, tree_doc = self._flatten(state)
        t_stage = time.perf_counter()
        staged = self._dispatch.stage(leaves)
        stage_s = time.perf_counter() - t_stage
        blocked = time.perf_counter() - t0
        self._pending_step = step
        self._pending = self._executor.submit(self._write, step, leaves, tree_doc, staged, waited,
                                              blocked, stage_s, t0)
        return True

    def _wait_previous(self) -> float:
        pending = self._pending
        if pending is None:
            return 0.0
        t0 = time.perf_counter()
        try:
            pending.result(timeout=self._config.max_save_wait_s)
        except Exception:  # recorded by _write; reported by check_for_errors
            pass
        return time.perf_counter() - t0

    def _flatten(self, state: Any) -> tuple[list[Leaf], Any]:
        keys, values, _ = tree_lib.flatten(state)
        leaves = []
        for i, (key, value) in enumerate(zip(keys, values)):
            kind = _classify(key, value)
            leaf = Leaf(index=i, key=key, kind=kind, value=value)
            if kind == "jax":
                if is_prng_key(value):
                    # The format stores a key array as its key data and names the impl.
                    leaf.prng_impl = str(jax.random.key_impl(value))
                    value = leaf.value = jax.random.key_data(value)
                    leaf.prng_key_shape = prng_key_shape(leaf.prng_impl)
                leaf.dtype = fmt.dtype_name(value.dtype)
                leaf.shape = tuple(value.shape)
                leaf.sharding = value.sharding
                if not value.is_fully_addressable:
                    raise TargetMismatchError(f"leaf {key!r} is not fully addressable from this process")
                leaf.device_boxes = shardings.device_boxes(value.sharding, leaf.shape)
            elif kind == "numpy":
                value = np.asarray(value)
                leaf.value = value
                leaf.dtype = fmt.dtype_name(value.dtype)
                leaf.shape = tuple(value.shape)
            leaves.append(leaf)
        return leaves, tree_lib.encode(state)

    def _write(self, step, leaves, tree_doc, staged, waited, blocked, stage_s, t0) -> SaveReport:
        committed = None
        try:
            t1 = time.perf_counter()
            result = self._dispatch.write(step, staged)
            t2 = time.perf_counter()
            manifest = self._build_manifest(step, leaves, tree_doc, result)
            committed = self._dispatch.commit(step, manifest)
            if self._known_steps is not None:
                self._known_steps.add(step)
            self._maybe_replicate(manifest)
            self._maybe_backup(step, manifest)
            t3 = time.perf_counter()
            written = sum(h.get("written_bytes", 0) for h in committed.values())
            report = SaveReport(
                step=step, bytes_total=manifest.nbytes, bytes_written=written,
                blobs_total=len(manifest.blob_names()), hosts=len(committed),
                waited_for_previous_s=waited, blocked_s=blocked, stage_s=stage_s,
                phase1_s=t2 - t1, phase2_s=t3 - t2, total_s=t3 - t0,
            )
            self.last_save_report = report
            log.info("- save step %d; duration=%.3fs; size=%d bytes @ %.2f GB/s", step, report.total_s,
                     report.bytes_total, report.bytes_total / max(report.total_s, 1e-9) / 1e9)
            return report
        except BaseException as e:
            fenced = cause_in_chain(e, FencedError)
            if fenced is not None:  # a newer head took the hosts: that, not "save failed", is the news
                self._fenced = e = fenced
            elif not isinstance(e, SaveError):
                hosts = getattr(e, "hosts", None) or {}
                e2 = SaveError(f"save of step {step} failed: {e}", step=step, hosts=hosts)
                e2.__cause__ = e
                e = e2
            if committed is None and fenced is None:
                self._abort(step)
            with self._lock:
                self._errors.append(e)
            log.error("save of step %d failed: %s", step, e)
            raise e

    def _abort(self, step: int) -> None:
        """A save that failed before every host committed: forget its step everywhere (best effort:
        a host that cannot be asked now drops its leftovers when a later step commits)."""
        try:
            self._dispatch.abort(step)
        except Exception as e:
            log.warning("could not abort step %d on every host: %s", step, e)

    def _build_manifest(self, step, leaves: list[Leaf], tree_doc, result) -> fmt.StepManifest:
        records = []
        for leaf in leaves:
            if leaf.kind == "scalar":
                records.append(fmt.ArrayRecord(key=leaf.key, kind="scalar", value=_scalar_doc(leaf.value)))
                continue
            dt = fmt.dtype_from_name(leaf.dtype)
            if leaf.kind == "numpy":
                box = tuple((0, n) for n in leaf.shape)
                boxes = [box]
                sharding = None
            else:
                boxes = sorted(set(leaf.device_boxes.values()))
                sharding = shardings.describe(leaf.sharding)
            shards = []
            for box in boxes:
                blob = result.blobs.get((leaf.index, box))
                if blob is None:
                    raise SaveError(f"step {step}: no host wrote array {leaf.key!r} shard {fmt.box_str(box)}",
                                    step=step)
                nbytes = int(np.prod(fmt.box_shape(box), dtype=np.int64)) * dt.itemsize
                shards.append(fmt.ShardRecord(box, blob, nbytes,
                                              tuple(result.box_devices.get((leaf.index, box), ()))))
            records.append(fmt.ArrayRecord(key=leaf.key, kind=leaf.kind, dtype=leaf.dtype, shape=leaf.shape,
                                           sharding=sharding, shards=tuple(shards), prng_impl=leaf.prng_impl,
                                           prng_key_shape=leaf.prng_key_shape))
        return fmt.StepManifest(
            step=step, arrays=tuple(records), tree=tree_doc, created=time.time(),
            topology={"hosts": sorted(result.hosts)}, fingerprint=version.fingerprint(),
        )

    # --- replication (the peer tier) ----------------------------------------------------

    def _maybe_replicate(self, manifest: fmt.StepManifest) -> None:
        self._replicator.submit(manifest)

    @property
    def last_replication_report(self) -> ReplicationReport | None:
        return self._replicator.last_report

    def is_replicating(self) -> bool:
        """Whether the background replication of a step is running now."""
        return self._replicator.running

    def wait_for_replication(self) -> ReplicationReport | None:
        """Block until the replication of the newest saved step is done; returns its report."""
        return self._replicator.wait()

    def step_status(self) -> list[StepStatus]:
        """Every committed step, ascending: restorable? replicated? fewest copies of a blob?"""
        inv = self._dispatch.inventories()
        down = any(i.error for i in inv.values())
        topology = self._replicator.topology()
        out = []
        for step, view in sorted(step_views(inv).items()):
            facts = summarize(view, self._strategy, topology)
            out.append(StepStatus(step=step, restorable=facts["restorable"] and not down,
                                  replicated=facts["replicated"], min_copies=facts["min_copies"], hosts=view.hosts))
        return out

    # --- backup --------------------------------------------------------------------------

    def _maybe_backup(self, step: int, manifest: fmt.StepManifest) -> None:
        if not backup_due(self._config, step, self._last_backup, time.monotonic()):
            return
        running = self._backup_pending
        if running is not None and not running.done():
            self._backup_skipped += 1
            log.warning("backup of step %d skipped: the previous backup is still running", step)
            return
        self._last_backup = (step, time.monotonic())
        skipped, self._backup_skipped = self._backup_skipped, 0
        self._backup_pending = self._backup_executor.submit(self._backup, manifest, skipped)

    def _backup(self, manifest: fmt.StepManifest, skipped: int) -> BackupReport:
        t0 = time.perf_counter()
        step = manifest.step
        try:
            up = self._dispatch.backup_upload(assign_uploads(manifest, self._dispatch.hosts(), self._dispatch.host_of_device))
            name = backup_layout.backup_name(step)
            host = sorted(up)[0] if up else self._dispatch.hosts()[0]
            self._dispatch.backup_finalize(host, name, manifest, self._config.backup_max_to_keep)
            report = BackupReport(
                step=step, name=name,
                uploaded_bytes=sum(u.get("uploaded_bytes", 0) for u in up.values()),
                uploaded_blobs=sum(u.get("uploaded", 0) for u in up.values()),
                skipped_blobs=sum(u.get("skipped", 0) for u in up.values()),
                bytes_by_host={h: u.get("uploaded_bytes", 0) for h, u in up.items()},
                skipped_because_running=skipped, seconds=time.perf_counter() - t0)
            log.info("- backup %s; duration=%.3fs; uploaded=%d bytes", name, report.seconds, report.uploaded_bytes)
        except Exception as e:  # training must never fail because the bucket did
            report = BackupReport(step=step, skipped_because_running=skipped, error=f"{type(e).__name__}: {e}",
                                  seconds=time.perf_counter() - t0)
            log.error("backup of step %d failed (the next due backup retries): %s", step, e)
        self.last_backup_report = report
        return report

    def wait_for_backup(self) -> BackupReport | None:
        """Block until the running backup (if any) is done; returns its report."""
        pending = self._backup_pending
        if pending is not None:
            pending.result()
        return self.last_backup_report

    def backups(self) -> list[dict]:
        """Backups in the backup tier, newest first ({"name", "step"}); [] without one."""
        if not self._config.base_output_directory:
            return []
        return self._dispatch.backup_listing()["backups"]

    def wait_until_finished(self) -> None:
        """Block until the background save is done; raise its error if it failed."""
        pending = self._pending
        if pending is not None:
            try:
                pending.result()
            except BaseException:
                pass
        self.check_for_errors()

    def check_for_errors(self) -> None:
        """Raise (once) the error of a background save that failed since the last check."""
        with self._lock:
            errs, self._errors = self._errors, []
        if errs:
            if len(errs) == 1:
                raise as_host_lost(errs[0])
            e = SaveError("; ".join(str(e) for e in errs),
                          hosts={h: m for e in errs for h, m in getattr(e, "hosts", {}).items()})
            e.__cause__ = next((x for x in errs if as_host_lost(x) is not x), errs[0])
            raise as_host_lost(e)

    # --- inventory -----------------------------------------------------------------------

    def _inventory(self, listing: dict | None = None) -> Inventory:
        """Ask every host what it holds. A step is restorable while every blob has a copy on
        some host: the one that saved it, a data-parallel twin or a peer copy, so a host that
        lost its ramdisk does not make a step unrestorable."""
        inv = self._dispatch.inventories()
        return Inventory(views=step_views(inv), unreachable={h: i.error for h, i in inv.items() if i.error},
                         backup_unreachable=(listing or {}).get("unreachable"))

    def _cluster_steps(self) -> list[int]:
        """Steps restorable from the hosts, ascending (see ``Inventory.restorable``)."""
        return self._inventory().restorable

    def _backup_listing(self) -> dict:
        """The backups and ``restore.version``; empty, with a warning, while the store is unreachable.

        Asked with a short retry deadline: a job that restarts during a bucket outage must come
        back from its ramdisks and peers, not wait out (or die of) the store's upload deadline.
        A bucket that answers with a refusal (missing, no permission) is still an error.
        """
        if not self._config.base_output_directory:
            return {"backups": [], "restore_version": None}
        try:
            return self._dispatch.backup_listing(deadline_s=_LISTING_DEADLINE_S)
        except (TransientStoreError, HostUnreachableError) as e:
            log.warning("backup root %s could not be listed within %.0f s (%s); going on with the steps on the "
                        "hosts (restore.version, if any, is not read)", self._config.backup_root,
                        _LISTING_DEADLINE_S, e)
            return {"backups": [], "restore_version": None, "unreachable": str(e)}

    def all_steps(self) -> list[int]:
        """Restorable steps, ascending: whole across the hosts (see ``_cluster_steps``), or in a
        complete backup.

        When ``restore.version`` names a backup, only that backup's step.
        """
        listing = self._backup_listing()
        if listing["restore_version"]:
            return [self._pinned_backup(listing)[1]]
        return sorted(set(self._cluster_steps()) | {b["step"] for b in listing["backups"]})

    def latest_step(self) -> int | None:
        """The newest restorable step (see ``all_steps``), or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def _pinned_backup(self, listing: dict) -> tuple[str, int]:
        rv = listing["restore_version"]
        step = backup_layout.parse_backup_name(rv)
        names = [b["name"] for b in listing["backups"]]
        if rv not in names:
            raise StepNotFoundError(
                f"restore.version in {self._config.backup_root} names backup {rv!r}, which does not exist "
                f"(backups: {names[:5]}); fix it with `mtc restore-version set NAME` or remove it with "
                "`mtc restore-version clear`; nothing was restored")
        return rv, step

    # --- restore -------------------------------------------------------------------------

    def restore(self, step: int | None = None, target: Any = None, *, partial: Any = False) -> Any:
        """Restore ``step`` (default: the latest) into the structure and shardings of ``target``.

        ``target`` is a pytree of ``jax.ShapeDtypeStruct`` (with ``sharding``) or of arrays;
        without it, arrays come back with the shardings they were saved with. With
        ``partial=True``, ``target`` may hold only some of the saved leaves (the rest are not read);
        with a collection of key prefixes, only the saved leaves under them must all be in ``target``.
        A host that stops answering raises ``HostLostError`` (see ``save``).
        """
        with host_lost_as_elastic():
            return self._restore(step, target, partial)

    def _restore(self, step: int | None, target: Any, partial: Any) -> Any:
        self._check_open()
        t0 = time.perf_counter()
        prefetched = self._await_prefetch()
        self._wait_previous()
        self._check_versions()
        step, backup_name, fallback, inv = self._choose_step(step, self._backup_listing())
        t1 = time.perf_counter()
        manifest = self._dispatch.manifest(step) if backup_name is None else self._dispatch.backup_manifest(backup_name)
        requests, finish = plan_target(manifest, target, partial)
        pulled = {"peer": [0, 0], "backup": [0, 0], "skipped": []}  # tier -> [bytes, blobs]
        needed = self._fetch_lacking(step, manifest, requests, backup_name, fallback, pulled, inv)
        if needed is None:
            needed = (sum(r.record.nbytes for r in requests), len(manifest.blob_names()))
        t_pull = time.perf_counter()
        if prefetched is not None and prefetched.step == step:  # where those bytes really came from
            for tier in ("peer", "backup"):
                pulled[tier][0] += prefetched.bytes_by_tier.get(tier, 0)
                pulled[tier][1] += prefetched.blobs_by_tier.get(tier, 0)
        view = inv.views.get(step) if backup_name is None else None
        holders = view.by_name(sorted(manifest.blob_names())) if view is not None else None
        arrays = self._dispatch.load(step, requests, holders)
        t2 = time.perf_counter()
        result = finish(arrays)
        nbytes = sum(r.record.nbytes for r in requests)
        (peer_bytes, peer_blobs), (backup_bytes, backup_blobs) = pulled["peer"], pulled["backup"]
        needed_bytes, needed_blobs = needed
        by_tier = {"ram": max(0, needed_bytes - peer_bytes - backup_bytes), "peer": peer_bytes, "backup": backup_bytes}
        blobs = {"ram": max(0, needed_blobs - peer_blobs - backup_blobs), "peer": peer_blobs, "backup": backup_blobs}
        self.last_restore_report = RestoreReport(
            step=step, bytes_by_tier=by_tier, blobs_by_tier=blobs, source=backup_name or "cluster",
            skipped_copies=tuple(pulled["skipped"]), inventory_s=t1 - t0, pull_s=t_pull - t1,
            load_s=t2 - t_pull, total_s=time.perf_counter() - t0,
            prefetched=prefetched is not None and prefetched.step == step)
        log.info("- restore step %d; duration=%.3fs; size=%d bytes", step, time.perf_counter() - t0, nbytes)
        return result

    def _choose_step(self, step: int | None, listing: dict) -> tuple[int, str | None, str | None, Inventory]:
        """(step, backup to restore it from or None for the hosts, a backup of it as fallback,
        the inventory the choice was made on)."""
        if listing["restore_version"]:
            backup_name, pinned = self._pinned_backup(listing)
            if step is not None and step != pinned:
                raise StepNotFoundError(f"restore.version pins backup {backup_name} (step {pinned}); "
                                        f"step {step} was asked for; clear restore.version to restore it")
            return pinned, backup_name, None, Inventory(views={}, unreachable={})  # the hosts are not asked
        inv = self._inventory(listing)
        cluster = inv.restorable
        in_backup: dict[int, str] = {}
        for b in listing["backups"]:  # newest first: keep the newest backup of each step
            in_backup.setdefault(b["step"], b["name"])
        steps = sorted(set(cluster) | set(in_backup))
        # While a host cannot be asked, "not found" may only mean "on the host that is gone".
        lost = (HostUnreachableError("; ".join(f"{h}: {e}" for h, e in sorted(inv.unreachable.items())))
                if inv.unreachable else None)
        if step is None:
            if not steps:
                raise StepNotFoundError(
                    f"no committed step in {self._config.ramdisk_root}"
                    + (f" nor in {self._config.backup_root}" if self._config.base_output_directory else "")
                    + "; nothing to restore (save a step first, or check local_checkpoint_directory)"
                    + inv.note()) from lost
            step = steps[-1]
        elif step not in steps:
            raise StepNotFoundError(f"step {step} is not committed on every host, and not every blob of it has a "
                                    f"copy on some host or in a backup; committed steps: {steps}"
                                    + inv.note()) from lost
        return step, (None if step in cluster else in_backup[step]), in_backup.get(step), inv

    def _fetch_lacking(self, step: int, manifest: fmt.StepManifest, requests: list[LoadRequest],
                       backup_name: str | None, fallback: str | None, pulled: dict,
                       inv: Inventory) -> tuple[int, int] | None:
        """Every host pulls the blobs it lacks for its shards of ``requests``; (bytes, blobs) needed.

        A replaced node lacks its own shards; after an elastic resize any host may lack saved
        shards its target shards overlap. Planned per host, and counted per host: a blob two
        hosts need is two transfers. None when the inventories did not see the step.
        """
        view = inv.views.get(step) if backup_name is None else None
        if backup_name is None and view is None:
            return None
        holders = view.by_name(sorted(manifest.blob_names())) if view is not None else None
        plan = make_plan(step, manifest, requests, self._dispatch.hosts(), self._dispatch.host_of_device, holders)
        needed = plan.nbytes(manifest.blob_sizes())
        if backup_name is not None:
            self._count_backup(pulled, self._dispatch.backup_fetch(backup_name, plan.needs))
        else:
            self._pull_lacking(step, manifest, plan, fallback, pulled)
            if pulled["peer"][1] or pulled["backup"][1]:
                # A host was refilled: the copies it held for its peers are gone too; make them again.
                self._maybe_replicate(manifest)
        return needed

    # --- start-up pull ---------------------------------------------------------------------

    def _prefetch_latest(self) -> PrefetchReport | None:
        """Bring the newest restorable step local, in the layout it was saved with (background).

        This is the restore's first half, started when the manager is created: a replaced node
        refills from its peers, a job whose ramdisks are all gone downloads from the backup,
        while the training script builds and compiles its model. A later ``restore`` finds the
        blobs local and counts them by the tier they came from. Never raises: whatever this
        could not do, ``restore`` does (or explains).
        """
        t0 = time.perf_counter()
        try:
            self._check_versions()
            step, backup_name, fallback, inv = self._choose_step(None, self._backup_listing())
            manifest = (self._dispatch.manifest(step) if backup_name is None
                        else self._dispatch.backup_manifest(backup_name))
            requests, _ = plan_target(manifest, None)  # the saved shardings (fails after a shrink: skipped)
            if self._closing.is_set():  # closed before anything moved: a job that did not want it
                return None
            pulled = {"peer": [0, 0], "backup": [0, 0], "skipped": []}
            self._fetch_lacking(step, manifest, requests, backup_name, fallback, pulled, inv)
        except Exception as e:  # nothing to restore, a resized job, a host down: restore handles it
            log.info("start-up pull skipped: %s: %s", type(e).__name__, e)
            return None
        report = PrefetchReport(step=step, source=backup_name or "cluster",
                                bytes_by_tier={t: pulled[t][0] for t in ("peer", "backup")},
                                blobs_by_tier={t: pulled[t][1] for t in ("peer", "backup")},
                                seconds=time.perf_counter() - t0)
        self.last_prefetch_report = report
        log.info("- start-up pull of step %d; duration=%.3fs; peer=%d bytes backup=%d bytes", step, report.seconds,
                 report.bytes_by_tier["peer"], report.bytes_by_tier["backup"])
        return report

    def wait_for_prefetch(self) -> PrefetchReport | None:
        """Block until the start-up pull is done; its report (None: nothing was pulled or it was off)."""
        pending = self._prefetch
        return pending.result() if pending is not None else None

    def _await_prefetch(self) -> PrefetchReport | None:
        """The start-up pull's report, once, for the first restore (later restores count their own)."""
        report = self.wait_for_prefetch()
        if report is None or self._prefetch_counted:
            return None
        self._prefetch_counted = True
        return report

    @staticmethod
    def _count_backup(pulled: dict, fetched: dict[str, dict]) -> None:
        pulled["backup"][0] += sum(f.get("downloaded_bytes", 0) for f in fetched.values())
        pulled["backup"][1] += sum(f.get("downloaded", 0) for f in fetched.values())

    def _pull_lacking(self, step: int, manifest: fmt.StepManifest, plan: Any, fallback: str | None,
                      pulled: dict) -> None:
        """Hosts that lack blobs they need pull them from peers that hold them, verified.

        The load spreads over the holders; a bad or unreachable copy is skipped for the next
        holder. What no peer could give comes from the backup ``fallback`` (a backup of this
        step) when there is one; otherwise CorruptBlobError names the array, the shard and the
        tiers tried. A host that lacked the step altogether (a replaced node) commits it again
        once it holds its blobs.
        """
        if plan.holders is None:
            return  # the inventories did not see this step: the load reads from where it is
        holders = {b: set(h) for b, h in plan.holders.items()}
        lacking = plan.lacking
        if not lacking:
            return
        failed: dict[tuple[str, str], list[str]] = {}
        asked: dict[str, list[tuple[str, int, list[str]]]] = {}
        for h, rows in self._strategy.pulls(lacking, holders, manifest.blob_sizes()).items():
            for blob, nbytes, srcs in rows:
                if srcs:
                    asked.setdefault(h, []).append((blob, nbytes, srcs))
                else:
                    failed[(h, blob)] = ["no other host holds it"]
        if asked:
            log.info("restore of step %d: %d hosts pull %d blobs from peers", step, len(asked),
                     sum(len(r) for r in asked.values()))
            for h, res in self._dispatch.peer_pull(step, asked, manifest).items():
                if res.error:
                    for blob, _, _ in asked[h]:
                        failed[(h, blob)] = [f"{h} could not pull: {res.error}"]
                    continue
                pulled["peer"][0] += res.pulled_bytes
                pulled["peer"][1] += res.pulled
                pulled["skipped"].extend(f"{h} <- {src}: blob {blob}: {cause}" for blob, src, cause in res.bad_copies)
                for blob, causes in res.failed:
                    failed[(h, blob)] = [f"{src}: {cause}" for src, cause in causes]
        if not failed:
            return
        if fallback is None:
            raise self._no_good_copy(step, manifest, failed)
        log.warning("restore of step %d: %d blobs have no good copy on any peer; fetching them from backup %s",
                    step, len(failed), fallback)
        fetch: dict[str, list[str]] = {}
        for h, blob in failed:
            fetch.setdefault(h, []).append(blob)
        self._count_backup(pulled, self._dispatch.backup_fetch(fallback, fetch))

    def _no_good_copy(self, step: int, manifest: fmt.StepManifest,
                      failed: dict[tuple[str, str], list[str]]) -> CorruptBlobError:
        where = {sh.blob: (rec.key, sh.box) for rec in manifest.arrays for sh in rec.shards}
        (host, blob), causes = min(failed.items(), key=lambda kv: (where[kv[0][1]][0], kv[0]))
        key, box = where[blob]
        backup = ("no backup of this step" if self._config.base_output_directory
                  else "not configured (set base_output_directory)")
        more = f"; {len(failed) - 1} more (host, blob) pairs have no good copy either" if len(failed) > 1 else ""
        return CorruptBlobError(
            f"step {step}: array {key!r} shard {fmt.box_str(box)} (blob {blob}) has no good copy for host {host}; "
            f"tiers tried: ram (not on {host}), peer ({'; '.join(causes)}), backup ({backup}){more}. "
            "Restore an older step (all_steps()) or a backup")

    # --- lifecycle -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise MTCError("this CheckpointManager is closed; create a new one")

    def close(self) -> None:
        """Wait for the background save, then release the sidecars (replication retries stop)."""
        if self._closed:
            return
        try:
            self.wait_until_finished()
        finally:
            self._closed = True
            self._closing.set()
            self._executor.shutdown(wait=True)
            self._prefetch_executor.shutdown(wait=True)
            self._replicator.close()
            self._backup_executor.shutdown(wait=True)
            self._dispatch.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _make_dispatcher(config: MTCConfig) -> Dispatcher:
    if not config.cluster_spec and os.environ.get("MTC_CLUSTER_SPEC"):
        # The launcher's way to say "cluster mode" without touching the training script.
        config = config.replace(cluster_spec=os.environ["MTC_CLUSTER_SPEC"])
    if config.cluster_spec:
        from mtc.head.cluster import ClusterDispatcher

        return ClusterDispatcher(config)
    from mtc.head.colocated import ColocatedDispatcher

    return ColocatedDispatcher(config)
