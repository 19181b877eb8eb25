"""The checkpoint manager: the Orbax-style surface the training script uses.

``save`` validates and flattens the state (``mtc.head.save``), copies it to host memory (the
only time training waits), then writes it in the background: phase 1 on every sidecar, the
step manifest built from their answers, phase 2 on every sidecar; then, still in the
background, replication to peers (``Replicator``) and, when due, a backup (``BackupRunner``).
``restore`` (``Restorer``) picks the newest step whose every blob has a copy on some host (or
in a backup), or the one asked for; hosts that lack blobs of it pull them from peers (or the
backup) first, then it comes back with the target's shardings. The manager owns the public
API, the lifecycle, the version check and the claim on the hosts (fencing).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import signal
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from mtc.head import lease, metrics
from mtc.head.backup.runner import BackupRequest, BackupRunner
from mtc.head.dispatch.factory import make_dispatcher
from mtc.head.dispatch.interface import Dispatcher
from mtc.head.elastic import as_host_lost, host_lost_as_elastic
from mtc.head.preemption import PreemptionNotice
from mtc.head.replication.plan import ReplicationStrategy, summarize
from mtc.head.replication.loop import REPLICATION_WAIT_S, Replicator
from mtc.head.reports import BackupReport, PrefetchReport, ReplicationReport, RestoreReport, SaveReport, StepStatus
from mtc.head.restore.plan import uncommit_lone
from mtc.head.restore.restorer import Restorer
from mtc.head.commit import CommittedStep, choose_keepers
from mtc.head.save import build_step, flatten
from mtc.head.twin_check import TwinMismatchError
from mtc.shared import format as fmt
from mtc.shared import version
from mtc.shared.config import MTCConfig
from mtc.shared.errors import BackupListingError, ConfigError, FencedError, MTCError, SaveError, cause_in_chain

if TYPE_CHECKING:
    from mtc.head.orbax.export import ExportReport

log = logging.getLogger(__name__)

# Managers alive in this process. At interpreter exit (a training script that never calls
# close(), as MaxText's does not), their background retries must stop, or the exit waits for
# them: Python joins executor threads before atexit handlers run, so the hook goes where
# concurrent.futures registers its own (threading._register_atexit, run before that join).
_LIVE: "weakref.WeakSet[CheckpointManager]" = weakref.WeakSet()
_exit_hook_installed = False


def _install_exit_hook(hook: Callable[[], None]) -> None:
    global _exit_hook_installed
    if _exit_hook_installed:
        return
    register = getattr(threading, "_register_atexit", None) or atexit.register
    register(hook)
    _exit_hook_installed = True


class CheckpointManager:
    """Save and restore JAX training state through mtc's sidecars.

    Usable as a context manager. ``config`` is an ``MTCConfig``; keyword arguments build one.
    """

    def __init__(self, config: MTCConfig | None = None, *, dispatcher: Dispatcher | None = None,
                 read_only: bool = False, **kwargs: Any):
        if config is None:
            config = MTCConfig(**kwargs)
        elif kwargs:
            config = config.replace(**kwargs)
        if not config.local_checkpoint_directory:
            raise ConfigError(
                "local_checkpoint_directory is empty: set it to the ramdisk path "
                "(e.g. local_checkpoint_directory=/tmp/mtc_checkpoints)")
        self._config = config
        self._dispatch = dispatcher or make_dispatcher(config)
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
        self._closing = threading.Event()
        self._preemption: PreemptionNotice | None = None
        self._preemption_answer: tuple[int, bool] | None = None  # (step, what reached_preemption said)
        self._backup_request: BackupRequest | None = None  # watch_backup_requests
        self._strategy = ReplicationStrategy(config.replication_factor)
        self._replicator = Replicator(self._dispatch, config, self._strategy, self._closing)
        self._backups = BackupRunner(self._dispatch, config)
        self._restorer = Restorer(self._dispatch, config, self._strategy, self._replicator.submit)
        self._metrics = metrics.attach(config, self._replicator, self._backups)  # Prometheus (metrics_port)
        # A reader (read_only) never takes the hosts: a running job's head keeps them; it restores
        # what the hosts hold and the backups, and cannot save.
        self._read_only = self._restorer.read_only = bool(read_only)
        _install_exit_hook(CheckpointManager._stop_background_retries)
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
                if not self._read_only:
                    self.head = lease.claim(self._dispatch, self._started)
                self._checked_versions = True

    # --- save ----------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """True when ``step`` is due under ``local_checkpoint_period``."""
        return self._config.enable_checkpointing and self._config.should_save(step)

    def save(self, step: int, state: Any, force: bool = False, backup: bool = False) -> bool:
        """Save ``state`` as ``step`` if due (or ``force``).

        Returns once the state is copied to host memory; the write continues in the
        background (see ``wait_until_finished`` and ``check_for_errors``).

        Args:
            step: a new step number (>= 0); a committed step is never written again.
            state: a pytree of ``jax.Array``s, numpy arrays and scalars (typed PRNG keys too).
            force: save although ``local_checkpoint_period`` says the step is not due.
            backup: save (as ``force``) and back the step up to the backup root once it is committed,
                whatever the backup interval says (after a backup still running): a step worth
                keeping, or one before a stop. A request by signal does the same for the next save
                (``watch_backup_requests``).

        Returns:
            Whether a save started (False: not due, or checkpointing disabled).

        Raises:
            ValueError: ``step`` is not a non-negative integer, or is committed already.
            ConfigError: the manager is ``read_only``; ``backup`` without a backup root.
            VersionMismatchError: a sidecar runs other versions (the first save or restore checks).
            FencedError: a newer head took the hosts.
            HostLostError: a host stopped answering (a ``jax.errors.JaxRuntimeError`` whose text
                starts with ``DATA_LOSS``, which elastic training retries on).
        """
        # From the first save on, the job trains: a host that does not answer is a failure the save
        # reports (elastic training retries it), and latest_step(), which MaxText asks around saves, must not
        # wait for the host as a restart does (restore_host_wait_s).
        self._restorer.waits_for_hosts = False
        asked = self._backup_request is not None and self._backup_request.pending
        if (backup or asked) and not self._config.backup_enabled and self._config.enable_checkpointing:
            if not backup:  # by signal: said once, and training goes on
                self._backup_request.pending = False
                log.error("a backup was asked for (signal), but this job has no backup root "
                          "(base_output_directory); nothing is backed up")
            else:
                raise ConfigError(f"save(step {step}, backup=True): this job has no backup root; set "
                                  "base_output_directory (and run_name) to back steps up. Nothing was saved")
        elif asked:
            backup = True
        with host_lost_as_elastic(), self._metrics.errors("save"):
            started = self._save(step, state, force or backup, backup)
        if started and asked and backup:
            self._backup_request.pending = False
            log.info("step %d: saved and backed up as asked (signal)", step)
        return started

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

    @property
    def backup_requested(self) -> bool:
        """Whether a backup was asked for by signal and the next ``save`` call will make it."""
        return self._backup_request is not None and self._backup_request.pending and self._config.backup_enabled

    def watch_backup_requests(self, signum: int = signal.SIGUSR1) -> None:
        """Opt in (call from the main thread): ``signum`` (SIGUSR1) asks for a backup, which the next
        ``save`` call makes: it saves that step (due or not) and backs it up at once, whatever the
        backup interval. An operator's way to have a step in the bucket now (before a maintenance
        stop) without changing the training script: ``kill -USR1 <pid>``; the mtc supervisor passes it
        to the training process, and the MaxText launcher opts in. Without a backup root, a request
        is logged as an error and training goes on."""
        if self._backup_request is None:
            self._backup_request = BackupRequest()
        self._backup_request.signum = signum
        self._backup_request.previous = signal.signal(signum, self._backup_request.ask)

    def _save(self, step: int, state: Any, force: bool, backup: bool = False) -> bool:
        self._check_open()
        if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        step = int(step)
        if not self._config.enable_checkpointing:
            return False
        if self._read_only:
            raise ConfigError("this CheckpointManager is read_only (it does not take the hosts): it cannot save")
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
        leaves, tree_doc = flatten(state, self._config)  # with twin_check_hash, a hash pass over unwritten replicas
        t_stage = time.perf_counter()
        staged = self._dispatch.stage(leaves)
        stage_s = time.perf_counter() - t_stage
        blocked = time.perf_counter() - t0
        self._pending_step = step
        self._pending = self._executor.submit(self._write, step, leaves, tree_doc, staged, waited,
                                              blocked, stage_s, t0, backup)
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

    def _write(self, step, leaves, tree_doc, staged, waited, blocked, stage_s, t0, backup=False) -> SaveReport:
        committed = None
        try:
            t1 = time.perf_counter()
            result = self._dispatch.write(step, staged)
            t2 = time.perf_counter()
            data, digest = build_step(step, leaves, tree_doc, result, self._dispatch, self._config.twin_check)
            d = self._dispatch
            committed = d.commit(step, data, digest, choose_keepers(d.hosts(), d.slice_of, step, d.keeper_count))
            if self._known_steps is not None:
                self._known_steps.add(step)
            t3 = time.perf_counter()
            # Replication and the backup plan from the whole manifest; it is read (its cost grows
            # with shards) by whichever of them needs it first, in the background, not here.
            done = CommittedStep(step, data, digest=digest, hosts=tuple(committed))
            self._replicator.submit(done)
            self._backups.maybe_start(done, now=backup)
            report = SaveReport.of_commit(step, leaves, committed, waited_for_previous_s=waited, blocked_s=blocked,
                                          stage_s=stage_s, phase1_s=t2 - t1, phase2_s=t3 - t2, total_s=t3 - t0)
            self.last_save_report = self._metrics.saved(report)
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
            if isinstance(e, TwinMismatchError) and e.report is not None:  # twin_check=warn: skipped, not failed
                self.last_save_report = e.report
                return e.report
            with self._lock:
                self._errors.append(self._metrics.error(e))
            log.error("save of step %d failed: %s", step, e)
            raise e

    def _abort(self, step: int) -> None:
        """A save that failed before every host committed: forget its step everywhere (best effort:
        a host that cannot be asked now drops its leftovers when a later step commits)."""
        try:
            self._dispatch.abort(step)
        except Exception as e:
            log.warning("could not abort step %d on every host: %s", step, e)

    # --- preemption ----------------------------------------------------------------------

    def watch_preemption(self, grace_s: float | None = None,
                         notice: PreemptionNotice | None = None) -> PreemptionNotice:
        """Opt in: the first SIGTERM makes ``reached_preemption`` true (call from the main thread).

        ``grace_s`` (default ``MTC_PREEMPTION_GRACE_S``, else 25 s) is the budget from the notice
        to the exit; a second SIGTERM, or the budget's end, exits at once (status 143). The loop::

            mgr.watch_preemption()
            for step in range(start, num_steps):
                state = train_step(state)
                mgr.save(step, state, force=mgr.reached_preemption(step))
                if mgr.reached_preemption(step):
                    mgr.finish_preemption()   # the commit, then the copies, within the budget
                    break
        """
        self._preemption = notice or PreemptionNotice(grace_s).install()
        return self._preemption

    def reached_preemption(self, step: int) -> bool:
        """Whether a preemption notice came (``watch_preemption``): save ``step`` and stop.

        One answer per step: the loop asks twice (for ``save``'s ``force``, then whether to stop),
        and a SIGTERM that lands between the two must not stop the job after a save that did not
        happen. A notice after the first question of a step counts from the next step on.
        """
        if self._preemption is None:
            return False
        asked = self._preemption_answer
        if asked is not None and asked[0] == step:
            return asked[1]
        answer = self._preemption.received
        self._preemption_answer = (step, answer)
        return answer

    def finish_preemption(self) -> dict:
        """After the last save: wait, within what is left of the budget, for its commit and (with
        more than one failure domain) its copies; log what is where. Returns that as a dict."""
        notice = self._preemption or PreemptionNotice()
        step = self._pending_step
        out: dict = {"step": step, "committed": False, "replicated": None}
        try:
            if self._pending is not None:
                self._pending.result(timeout=notice.remaining())
            self.check_for_errors()
            out["committed"] = step is not None
            if step is not None:
                report = self._replicator.wait(timeout=notice.remaining())
                if report is not None and report.step == step:
                    out["replicated"] = report.replicated
        except TimeoutError:
            pass
        except MTCError as e:
            out["error"] = f"{type(e).__name__}: {e}"
        out["seconds"] = notice.elapsed()
        where = ("not committed" if not out["committed"] else "committed on the hosts' ramdisks"
                 + {None: "", True: ", with its copies in another failure domain",
                    False: ", its copies not complete"}[out["replicated"]])
        log.warning("mtc: preemption: step %s %s, %.1f s after the notice (budget %g s)%s", step, where,
                    out["seconds"], notice.grace_s, f"; {out['error']}" if "error" in out else "")
        return out  # the budget's timer still runs: exit (or close, then exit) now

    # --- replication (the peer tier) ----------------------------------------------------

    @property
    def last_replication_report(self) -> ReplicationReport | None:
        return self._replicator.last_report

    def is_replicating(self) -> bool:
        """Whether the background replication of a step is running now."""
        return self._replicator.running

    def wait_for_replication(self, timeout: float | None = REPLICATION_WAIT_S) -> ReplicationReport | None:
        """Wait until the replication of the newest saved step is done, at most ``timeout`` seconds
        (default 60; None: no limit); its report (None: nothing to replicate).

        When the time runs out first (a host whose ramdisk cannot take its copies, a host down), the
        report has ``in_progress`` set, and its ``error`` and ``short_of_copies`` name the step and the
        hosts short of copies and why (a full ramdisk: the room it lacks). Replication goes on in the
        background meanwhile (``step_status()``); wait again, or look later.
        """
        return self._replicator.wait_for(timeout)

    def step_status(self) -> list[StepStatus]:
        """Every committed step, ascending: restorable? replicated? fewest copies of a blob? Is its
        replication still running (retrying), and which hosts lack copies, why?"""
        inv = self._restorer.inventory()
        topology = self._replicator.topology()
        out = []
        for step, view in sorted(inv.views.items()):
            facts = summarize(view, self._strategy, topology)
            out.append(StepStatus(step=step, restorable=facts["restorable"] and not inv.unreachable,
                                  replicated=facts["replicated"], min_copies=facts["min_copies"], hosts=view.hosts,
                                  **self._replicator.status_of(step)))
        return out

    # --- backup --------------------------------------------------------------------------

    @property
    def last_backup_report(self) -> BackupReport | None:
        return self._backups.last_report

    def is_backing_up(self) -> bool:
        """Whether a backup is running now (in the background)."""
        return self._backups.running

    def wait_for_backup(self) -> BackupReport | None:
        """Block until the running backup (if any) is done; returns its report."""
        return self._backups.wait()

    def backups(self) -> list[dict]:
        """Backups in the backup tier, newest first ({"name", "step"}); [] without one."""
        if not self._config.base_output_directory:
            return []
        return self._dispatch.backup_listing()["backups"]

    def refused_backups(self) -> list[dict]:
        """Backups in the backup tier that no restore takes, with why ({"name", "step", "why"}): marked
        damaged by a scrub, or failing their seal (written without this job's key, changed, or read
        with no key); [] without a backup tier."""
        if not self._config.base_output_directory:
            return []
        return list(self._dispatch.backup_listing().get("damaged") or [])

    def wait_until_finished(self) -> None:
        """Block until the background save is done.

        Raises:
            SaveError: the save failed (``SaveHostLostError``, a ``HostLostError`` too, when a
                host stopped answering); the step is not committed and was aborted everywhere.
        """
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

    def _cluster_steps(self) -> list[int]:
        """Steps restorable from the hosts, ascending (see ``Inventory.restorable``)."""
        return self._restorer.inventory().restorable

    def all_steps(self) -> list[int]:
        """Restorable steps, ascending: whole across the hosts (every blob has a copy on some
        host), or in a complete backup. When ``restore.version`` names a backup, only that
        backup's step.

        Raises:
            StepsUnconfirmedError: hosts that may hold a step could not be asked and the others
                confirm none (never read as "no step").
        """
        # A head that took the hosts (its first save or restore, or the start-up pull) gives a host
        # with a damaged copy of a step manifest the copy back first, as a restore does: the latest
        # step is then the one restore() would choose.
        return self._restorer.all_steps(repair=self._checked_versions)

    def latest_step(self) -> int | None:
        """The newest restorable step (see ``all_steps``), or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    # --- restore -------------------------------------------------------------------------

    def restore(self, step: int | None = None, target: Any = None, *, partial: Any = False, pull: bool = True) -> Any:
        """Restore ``step`` (default: the latest) into the structure and shardings of ``target``.

        Each blob is read from the fastest place that holds it (this host's ramdisk, a peer in
        another slice, the backup), checked against its hash.

        Args:
            step: the step to restore; None, the latest restorable one (``latest_step``).
            target: a pytree of ``jax.ShapeDtypeStruct`` (with ``sharding``) or of arrays, whose
                shardings may differ from the saved ones (an elastic resize); None, the saved
                tree with the shardings it was saved with.
            partial: True, ``target`` may hold only some of the saved leaves (the rest are not
                read); a collection of key prefixes, only the saved leaves under them must all be
                in ``target``.
            pull: True, hosts first pull the blobs they lack for their shards (from peers, else the
                backup), so that the next restore finds them local; False (a reader), each blob is
                read where it is and only blobs no host holds are fetched.

        Returns:
            The restored pytree (``target``'s structure when given).

        Raises:
            StepNotFoundError: no restorable step (or not ``step``).
            TargetMismatchError: ``target`` does not match what was saved (keys, shapes, dtypes).
            CorruptBlobError: every copy of a blob failed its hash.
            HostLostError: a host stopped answering (see ``save``).
        """
        with host_lost_as_elastic(), self._metrics.errors("restore"):
            return self._restore(step, target, partial, pull)

    def _restore(self, step: int | None, target: Any, partial: Any, pull: bool = True) -> Any:
        self._check_open()
        prefetched = self._await_prefetch()
        self._wait_previous()
        self._check_versions()
        result, self.last_restore_report = self._metrics.restored(
            *self._restorer.restore(step, target, partial, prefetched, pull))
        self._restorer.waits_for_hosts = False  # restored: as after the first save (see save)
        return uncommit_lone(target, result) if pull and target is not None else result

    def manifest(self, step: int | None = None, *, shards: bool = True) -> fmt.StepManifest:
        """What ``step`` (default: the latest) holds: every array's key, shape, dtype and sharding, and
        its shards (which boxes, in which blobs). ``shards=False``: the arrays without their shards, read
        from the manifest's header alone (a line: what a tool that wants the arrays reads at thousands of
        hosts); a step saved by a version without headers is read whole."""
        self._check_open()
        self._check_versions()
        return self._restorer.manifest_of(step, shards)

    def export(self, directory: str, step: int | None = None, **kwargs: Any) -> "ExportReport":
        """``step`` (default: the latest) as MaxText's standard Orbax checkpoint (``mtc.head.orbax.export``)."""
        from mtc.head.orbax.export import export

        return export(self, directory, step, **kwargs)

    # --- start-up pull ---------------------------------------------------------------------

    def _prefetch_latest(self) -> PrefetchReport | None:
        """The start-up pull (``Restorer.prefetch``), in the background. Never raises: whatever
        this could not do, ``restore`` does (or explains)."""
        try:
            self._check_versions()
            report = self._restorer.prefetch(self._closing.is_set)
        except Exception as e:  # nothing to restore, a resized job, a host down: restore handles it (or says why)
            (log.warning if isinstance(e, BackupListingError) else log.info)("start-up pull skipped: %s: %s",
                                                                              type(e).__name__, e)
            return None
        if report is not None:
            self.last_prefetch_report = report
            log.info("- start-up pull of step %d; duration=%.3fs; peer=%d bytes backup=%d bytes", report.step,
                     report.seconds, report.bytes_by_tier["peer"], report.bytes_by_tier["backup"])
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

    # --- lifecycle -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise MTCError("this CheckpointManager is closed; create a new one")

    @staticmethod
    def _stop_background_retries() -> None:
        """At interpreter exit: every live manager stops retrying in the background."""
        for m in list(_LIVE):
            m._closing.set()

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
            self._backups.close()
            request = self._backup_request
            if request is not None:  # the handler before watch_backup_requests, where a thread may set one
                with contextlib.suppress(ValueError, TypeError):
                    signal.signal(request.signum, request.previous if request.previous is not None else signal.SIG_DFL)
            if self.head is not None and self._fenced is None:
                lease.release(self._dispatch, self.head)
            self._dispatch.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

