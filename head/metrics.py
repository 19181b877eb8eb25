"""Prometheus metrics of the head: durations by phase, bytes by tier, and each tier's recovery point.

Off unless ``metrics_port`` (``MTC_METRICS_PORT``) is set. Then the process serves ``/metrics`` on
that port of ``metrics_address`` (``MTC_METRICS_ADDRESS``, default ``0.0.0.0``: a Prometheus scrapes the
pod's IP) (one HTTP server per process, started by the first manager that asks; a private
``CollectorRegistry``, not prometheus_client's global one; ``mtc.shared.scrape_server``'s bounded server:
8 scrapes at once, 5 s from a connection's accept to the end of its request), and every manager records
into it:

- ``mtc_save_duration_seconds{phase}``: ``blocked`` (save() kept the caller), ``write`` (phase 1),
  ``commit`` (phase 2), ``total`` (save() to commit), ``replication`` (commit to the copies made),
  ``backup`` (one backup's upload and finalize);
- ``mtc_restore_duration_seconds{phase}``: ``inventory``, ``pull``, ``load``, ``total``;
- ``mtc_restore_bytes_total{tier}``: what restores read from ``ram``, ``peer``, ``backup`` (the
  ``bytes_by_tier`` of each ``last_restore_report``, start-up pull included);
- ``mtc_recovery_point_seconds{tier}``: how old the state of the newest step that tier alone could
  restore is (``ram``: committed; ``peer``: replicated to ``replication_factor`` domains; ``backup``:
  finalized), measured from the moment save() took it; it grows between scrapes and drops when a newer
  step reaches the tier. Absent for a tier until this process saw a step reach it;
- ``mtc_replication_lag_seconds``: how long the newest committed step has waited for its copies (0 once
  replicated); ``mtc_replications_total{outcome}``, ``mtc_replication_copies_total``,
  ``mtc_replication_bytes_total``;
- ``mtc_backups_running``, ``mtc_backups_total{outcome}``, ``mtc_backups_skipped_total``,
  ``mtc_backup_uploaded_bytes_total``;
- ``mtc_backup_scrub_blobs_total{outcome}`` (``checked``, ``bad``, ``repaired``) and
  ``mtc_backup_scrub_damaged_total`` (backups the scrub marked damaged: restore skips them);
- ``mtc_saves_total``, ``mtc_save_bytes_total{kind}`` (``state``, ``written``), ``mtc_restores_total{source}``;
- ``mtc_errors_total{op, type}`` and ``mtc_fencing_events_total`` (a newer head took the hosts).

The sidecar daemons export each host's ramdisk and peer traffic (``mtc.sidecar.metrics``). Where Orbax
records a ``jax.monitoring`` event for the same thing, the save records it too, under Orbax's name, with
or without a metrics port.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from typing import Any, Iterator

import jax.monitoring

from mtc.shared.errors import ConfigError, FencedError, cause_in_chain

log = logging.getLogger(__name__)

TIERS = ("ram", "peer", "backup")
SAVE_PHASES = ("blocked", "write", "commit", "total", "replication", "backup")
RESTORE_PHASES = ("inventory", "pull", "load", "total")
# From a millisecond (a blocked save) to an hour (a slow backup).
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
           300.0, 600.0, 1800.0, 3600.0)
# Orbax's jax.monitoring names for the same durations (orbax.checkpoint's async checkpointer).
JAX_EVENTS = {
    "blocked_s": "/jax/checkpoint/write/async/blocking_duration_secs",
    "waited_for_previous_s": "/jax/checkpoint/write/wait_for_prev_duration_secs",
    "phase2_s": "/jax/checkpoint/write/async/commit_duration_sec",
    "total_s": "/jax/checkpoint/write/async/total_duration_secs",
}
_KEEP_STEPS = 64  # capture times remembered, for the replications and backups still to come

_lock = threading.Lock()
_instruments: "_Instruments | None" = None
_server: Any = None
_server_port: int | None = None


class _Instruments:
    """The process's registry and instruments (created once, on the first manager with a port)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = r = CollectorRegistry(auto_describe=True)
        self.save = Histogram("mtc_save_duration_seconds", "Save time by phase", ["phase"], registry=r, buckets=BUCKETS)
        self.restore = Histogram("mtc_restore_duration_seconds", "Restore time by phase", ["phase"], registry=r,
                                 buckets=BUCKETS)
        self.saves = Counter("mtc_saves", "Saves committed", registry=r)
        self.save_bytes = Counter("mtc_save_bytes", "Bytes saved: the state, and what the hosts wrote", ["kind"],
                                  registry=r)
        self.restores = Counter("mtc_restores", "Restores, by source (cluster or backup)", ["source"], registry=r)
        self.restore_bytes = Counter("mtc_restore_bytes", "Bytes restores read, by tier", ["tier"], registry=r)
        self.replications = Counter("mtc_replications", "Replications ended, by outcome", ["outcome"], registry=r)
        self.replication_copies = Counter("mtc_replication_copies", "Blob copies made on peers", registry=r)
        self.replication_bytes = Counter("mtc_replication_bytes", "Bytes copied to peers", registry=r)
        self.backups = Counter("mtc_backups", "Backups ended, by outcome", ["outcome"], registry=r)
        self.backups_skipped = Counter("mtc_backups_skipped", "Due backups skipped (the previous still ran)",
                                       registry=r)
        self.backup_bytes = Counter("mtc_backup_uploaded_bytes", "Bytes uploaded to the backup tier", registry=r)
        self.scrub_blobs = Counter("mtc_backup_scrub_blobs", "Backup blobs the scrub found, by outcome (bad: corrupt "
                                   "or missing in the store; repaired: of those, re-uploaded from a host)",
                                   ["outcome"], registry=r)
        self.scrub_damaged = Counter("mtc_backup_scrub_damaged", "Backups the scrub marked damaged (restore skips "
                                     "them)", registry=r)
        self.errors = Counter("mtc_errors", "Errors raised to the caller or recorded, by operation and type",
                              ["op", "type"], registry=r)
        self.fenced = Counter("mtc_fencing_events", "Times a newer head took this head's hosts", registry=r)
        for phase in SAVE_PHASES:  # every series present from the start (a rate over it is defined)
            self.save.labels(phase)
        for phase in RESTORE_PHASES:
            self.restore.labels(phase)
        for tier in TIERS:
            self.restore_bytes.labels(tier)
        for counter, values in ((self.save_bytes, ("state", "written")), (self.restores, ("cluster", "backup")),
                                (self.replications, ("replicated", "incomplete")), (self.backups, ("ok", "error")),
                                (self.scrub_blobs, ("checked", "bad", "repaired"))):
            for v in values:
                counter.labels(v)
        self.trackers: "weakref.WeakSet[Tracker]" = weakref.WeakSet()
        r.register(_Live(self))


def instruments() -> _Instruments:
    """The process's instruments (created on first use)."""
    global _instruments
    with _lock:
        if _instruments is None:
            _instruments = _Instruments()
        return _instruments


def serve(port: int, addr: str = "0.0.0.0") -> int:
    """Serve ``/metrics`` on ``addr:port`` (``metrics_address``; every interface by default), once per
    process; returns the port served. A later call with another port keeps the first server (one per
    process) and says so. The server is ``mtc.shared.scrape_server``'s: at most ``MAX_SCRAPES`` scrapes
    at once (one more is closed at once), each with ``REQUEST_DEADLINE_S`` from its accept to the end of
    its request, so idle or slow clients hold a bounded number of the training process's threads."""
    global _server, _server_port
    from mtc.shared.scrape_server import ScrapeServer

    reg = instruments().registry
    with _lock:
        if _server is None:
            try:
                _server = ScrapeServer(addr, port, reg, name="head", logger=log, thread_name="mtc-head-metrics")
            except (OSError, OverflowError) as e:
                raise ConfigError(f"cannot serve metrics on {addr}:{port}: {e}; set metrics_port "
                                  "(MTC_METRICS_PORT) to a free port, or 0 for no metrics, and metrics_address "
                                  "(MTC_METRICS_ADDRESS) to an address of this host") from e
            _server_port = _server.port
            log.info("metrics on %s:%d/metrics", addr, _server_port)
        elif port not in (0, _server_port):
            log.warning("metrics already served on port %d in this process; metrics_port=%d is not used",
                        _server_port, port)
        return _server_port


def served_port() -> int | None:
    """The port this process serves ``/metrics`` on, or None."""
    return _server_port


def attach(config: Any, replicator: Any, backups: Any) -> "Tracker | Off":
    """The hooks of one manager: a ``Tracker`` when ``config.metrics_port`` is set, else ``Off``."""
    if not config.metrics_port:
        return OFF
    serve(config.metrics_port, config.metrics_address)
    tracker = Tracker(instruments(), config, backups)
    replicator.listeners.append(tracker.replicated)
    replicator.inventory_listeners.append(tracker.inventoried)
    backups.listeners.append(tracker.backed_up)
    backups.scrub.listeners.append(tracker.scrubbed)
    return tracker


def _record_jax(report: Any) -> None:
    for field, event in JAX_EVENTS.items():
        jax.monitoring.record_event_duration_secs(event, getattr(report, field))


class Off:
    """The hooks when metrics are off: only the jax.monitoring events."""

    def saved(self, report: Any) -> Any:
        _record_jax(report)
        return report

    def restored(self, result: Any, report: Any) -> tuple[Any, Any]:
        return result, report

    def error(self, e: BaseException, op: str = "save") -> BaseException:
        return e

    @contextlib.contextmanager
    def errors(self, op: str) -> Iterator[None]:
        yield


OFF = Off()


class Tracker(Off):
    """One manager's hooks: record into the process's instruments, and when each step reached each tier."""

    def __init__(self, m: _Instruments, config: Any, backups: Any):
        self._m = m
        self._replicating = config.replication_factor >= 2
        self._backups = backups
        self._lock = threading.Lock()
        self._captured: dict[int, float] = {}  # step -> wall time save() took its state
        self._committed: dict[int, float] = {}  # step -> wall time of its commit
        self.newest: dict[str, int] = {}  # tier -> newest step it alone could restore
        self._was_fenced = False
        self.hosts: dict[str, tuple[bool, tuple[int, int] | None]] = {}  # host -> (answered, its ramdisk (free, size))
        m.trackers.add(self)

    # --- hooks the manager calls --------------------------------------------------------------

    def inventoried(self, inventories: dict) -> None:
        """What the latest inventory said of each host: its ramdisk's room, or that it did not answer."""
        with self._lock:
            self.hosts = {h: (not i.error, i.ramdisk) for h, i in inventories.items()}

    def saved(self, report: Any) -> Any:
        """A committed save: its phases, bytes, and the RAM tier's newest step."""
        _record_jax(report)
        m, now = self._m, time.time()
        m.save.labels("blocked").observe(report.blocked_s)
        m.save.labels("write").observe(report.phase1_s)
        m.save.labels("commit").observe(report.phase2_s)
        m.save.labels("total").observe(report.total_s)
        m.saves.inc()
        m.save_bytes.labels("state").inc(report.bytes_total)
        m.save_bytes.labels("written").inc(report.bytes_written)
        with self._lock:
            self._captured[report.step] = now - report.total_s
            self._committed[report.step] = now
            for d in (self._captured, self._committed):
                for old in sorted(d)[:-_KEEP_STEPS]:
                    del d[old]
            self._reached("ram", report.step)
        return report

    def restored(self, result: Any, report: Any) -> tuple[Any, Any]:
        """A restore: its phases and its bytes by tier (as ``report.bytes_by_tier`` counts them)."""
        m = self._m
        for phase in RESTORE_PHASES:
            m.restore.labels(phase).observe(getattr(report, f"{phase}_s"))
        for tier, n in report.bytes_by_tier.items():
            m.restore_bytes.labels(tier).inc(n)
        m.restores.labels("cluster" if report.source == "cluster" else "backup").inc()
        return result, report

    def error(self, e: BaseException, op: str = "save") -> BaseException:
        """Count an error (by operation and type), and a fencing once per manager."""
        self._m.errors.labels(op, type(e).__name__).inc()
        if not self._was_fenced and cause_in_chain(e, FencedError) is not None:
            self._was_fenced = True
            self._m.fenced.inc()
        return e

    @contextlib.contextmanager
    def errors(self, op: str) -> Iterator[None]:
        """Count what the block raises (``error``), and raise it on."""
        try:
            yield
        except Exception as e:
            self.error(e, op)
            raise

    # --- listeners of the replication and backup loops (their threads) ----------------------------

    def replicated(self, report: Any) -> None:
        m = self._m
        m.replications.labels("replicated" if report.replicated else "incomplete").inc()
        m.replication_copies.inc(report.moved_blobs)
        m.replication_bytes.inc(report.moved_bytes)
        if report.replicated:
            m.save.labels("replication").observe(report.seconds)
            with self._lock:
                self._reached("peer", report.step)
        elif report.error and not report.in_progress:
            m.errors.labels("replication", "ReplicationIncomplete").inc()

    def backed_up(self, report: Any) -> None:
        m = self._m
        m.backups_skipped.inc(report.skipped_because_running)
        if report.error:
            m.backups.labels("error").inc()
            m.errors.labels("backup", report.error.split(":", 1)[0]).inc()
            return
        m.backups.labels("ok").inc()
        m.save.labels("backup").observe(report.seconds)
        m.backup_bytes.inc(report.uploaded_bytes)
        with self._lock:
            self._reached("backup", report.step)

    def scrubbed(self, report: Any) -> None:
        m = self._m
        if report.error:
            m.errors.labels("backup_scrub", report.error.split(":", 1)[0]).inc()
        m.scrub_blobs.labels("checked").inc(sum(b.checked for b in report.backups))
        m.scrub_blobs.labels("bad").inc(report.bad_blobs)
        m.scrub_blobs.labels("repaired").inc(report.repaired_blobs)
        m.scrub_damaged.inc(sum(1 for b in report.backups if b.damaged))

    def _reached(self, tier: str, step: int) -> None:
        # A replication can end before its save's report is recorded: the capture time is looked up
        # at each scrape, not here.
        if step >= self.newest.get(tier, -1):
            self.newest[tier] = step

    # --- what a scrape reads --------------------------------------------------------------------

    def captured(self, tier: str) -> float | None:
        """When save() took the state of the newest step ``tier`` alone could restore (wall time)."""
        with self._lock:
            step = self.newest.get(tier)
            return None if step is None else self._captured.get(step)

    def lag(self, now: float) -> float | None:
        """How long the newest committed step has waited for its copies (0 once it has them)."""
        if not self._replicating:
            return None
        with self._lock:
            ram, peer = self.newest.get("ram"), self.newest.get("peer", -1)
            if ram is None or peer >= ram:
                return 0.0
            return now - self._committed.get(ram, now)

    @property
    def backups_running(self) -> bool:
        return self._backups.running


class _Live:
    """The gauges computed at each scrape, from the live managers' trackers."""

    def __init__(self, m: _Instruments):
        self._m = m

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        now = time.time()
        trackers = list(self._m.trackers)
        rp = GaugeMetricFamily("mtc_recovery_point_seconds", "Age of the state of the newest step each tier alone "
                               "could restore (from the moment save() took it)", labels=["tier"])
        for tier in TIERS:
            times = [t for t in (tr.captured(tier) for tr in trackers) if t is not None]
            if times:
                rp.add_metric([tier], now - max(times))
        yield rp
        lag = GaugeMetricFamily("mtc_replication_lag_seconds", "How long the newest committed step has waited "
                                "for its peer copies (0: replicated)")
        lags = [x for x in (tr.lag(now) for tr in trackers) if x is not None]
        if lags:
            lag.add_metric([], max(lags))
        yield lag
        yield GaugeMetricFamily("mtc_backups_running", "Backups running now",
                                value=sum(tr.backups_running for tr in trackers))
        hosts: dict[str, tuple[bool, tuple[int, int] | None]] = {}
        for tr in trackers:
            hosts.update(tr.hosts)
        up = GaugeMetricFamily("mtc_host_up", "Whether the host answered the head's latest inventory",
                               labels=["host"])
        free = GaugeMetricFamily("mtc_host_ramdisk_free_bytes", "Free bytes on the host's ramdisk (latest inventory)",
                                 labels=["host"])
        size = GaugeMetricFamily("mtc_host_ramdisk_size_bytes", "Size of the host's ramdisk (latest inventory)",
                                 labels=["host"])
        for h, (answered, room) in sorted(hosts.items()):
            up.add_metric([h], 1 if answered else 0)
            if answered and room is not None:
                free.add_metric([h], room[0])
                size.add_metric([h], room[1])
        yield up
        yield free
        yield size
        from mtc.shared import job_key

        untrusted = CounterMetricFamily("mtc_untrusted_objects", "Objects this process read from shared storage that "
                                        "failed the job key's check (ignored as if absent; compilation cache entries "
                                        "on the head), by kind", labels=["kind"])
        for kind, n in sorted(job_key.rejected_counts().items()):
            untrusted.add_metric([kind], n)
        yield untrusted
        from mtc.head import supervisor

        restarts = CounterMetricFamily("mtc_supervisor_restarts", "Restarts of the training process by the head pod's "
                                       "supervisor so far (this process is the last of them), by cause: the signal "
                                       "that killed the one before, or exit", labels=["cause"])
        for cause, n in sorted((supervisor.promotion().get("restarts") or {}).items()):
            restarts.add_metric([cause], n)
        yield restarts
