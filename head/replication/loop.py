"""The replication loop (the peer tier, head side): after each commit, bring every blob of the
step to ``replication_factor`` copies on distinct slices, retrying while hosts are down.

The plan of each attempt is a value (``mtc.head.replication.plan.ReplicationStrategy``); this class
runs attempts in the background, with backoff, until the copies exist, a newer step is saved,
the manager closes, or its patience runs out. It never raises: training must not fail for it.
Nor does waiting for it block for long: ``wait_for`` comes back after its timeout with what the
last attempt found (the hosts short of copies and why: a full ramdisk says the room it lacks).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from mtc.head.dispatch.interface import Dispatcher
from mtc.head.dispatch.interface import PullResult
from mtc.head.replication.plan import ReplicationStrategy, covered_by_shares, plan_shares, step_views
from mtc.head.reports import ReplicationReport
from mtc.head.commit import CommittedStep
from mtc.shared import format as fmt
from mtc.shared.format import writers
from mtc.shared.config import MTCConfig
from mtc.shared.errors import StepNotFoundError
from mtc.shared.objstore.retry import Backoff

log = logging.getLogger("mtc.head.manager")  # one log for the manager's background work

# How long replication of a step keeps retrying while a host it needs is down or a pull failed.
_REPLICATION_PATIENCE_S = 1800.0
_REPLICATION_RETRY = Backoff(0.05, 2.0)  # first and longest wait between attempts (doubling)
# How long ``wait_for_replication()`` waits by default before it reports the replication as in progress:
# long enough for the copies of a healthy step, short enough that a host that cannot take its copies
# (its ramdisk full) does not hold up the caller for the half hour replication keeps trying.
REPLICATION_WAIT_S = 60.0


class Replicator:
    """Replicates committed steps in the background, one at a time, newest wins."""

    def __init__(self, dispatch: Dispatcher, config: MTCConfig, strategy: ReplicationStrategy,
                 closing: threading.Event):
        self._dispatch = dispatch
        self._config = config
        self._strategy = strategy
        self._closing = closing
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mtc-replicate")
        self._pending: Future | None = None
        self._newest: int | None = None  # the newest step given to replication
        self.last_report: ReplicationReport | None = None
        # The running replication, after each attempt: step, attempts, start, hosts short and why, stats.
        self._progress: dict | None = None
        self.listeners: list[Callable[[ReplicationReport], None]] = []  # each ended replication's report (metrics)
        self.inventory_listeners: list[Callable[[dict], None]] = []  # each inventory it took (metrics)

    @property
    def running(self) -> bool:
        pending = self._pending
        return pending is not None and not pending.done()

    def wait(self, timeout: float | None = None) -> ReplicationReport | None:
        """The report once the running replication ends; TimeoutError after ``timeout`` seconds."""
        pending = self._pending
        if pending is not None:
            pending.result(timeout=timeout)
        return self.last_report

    def wait_for(self, timeout: float | None) -> ReplicationReport | None:
        """``wait``, but when ``timeout`` runs out first: a report with ``in_progress`` for the newest
        step, whose ``error`` names the steps and hosts short of copies and why; it goes on meanwhile."""
        try:
            return self.wait(timeout)
        except TimeoutError:
            pass
        p, newest = self._progress, self._newest
        if p is None or newest is None:  # between two attempts' bookkeeping: nothing known yet
            return ReplicationReport(step=newest if newest is not None else -1, in_progress=True, error=(
                f"replication of step {newest} is not done after {timeout:g} s; it goes on in the background"))
        steps = f"step {p['step']}" + (f" (step {newest} waits behind it)" if newest != p["step"] else "")
        hosts = "; ".join(f"host {h}: {why}" for h, why in sorted(p["short"].items())) or p["error"] or "no attempt ended yet"
        error = (f"replication of {steps} is not done after {timeout:g} s (attempt {p['attempts']}): {hosts}; "
                 "it keeps trying in the background (step_status(), `mtc status`) until the copies are made, a newer "
                 f"step is saved, the manager closes or {_REPLICATION_PATIENCE_S / 60:g} min pass")
        return ReplicationReport(step=p["step"], attempts=p["attempts"], error=error, in_progress=True,
                                 short_of_copies=dict(p["short"]), seconds=time.perf_counter() - p["t0"],
                                 **p["stats"])

    def status_of(self, step: int) -> dict:
        """``StepStatus`` fields for ``step``: whether its replication runs now, and who lacks copies and why."""
        p, last = self._progress, self.last_report
        if p is not None and p["step"] == step and self.running:
            return {"replicating": True, "short_of_copies": dict(p["short"])}
        if last is not None and last.step == step and not last.replicated:
            return {"replicating": False, "short_of_copies": dict(last.short_of_copies)}
        return {"replicating": False, "short_of_copies": {}}

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def submit(self, committed: CommittedStep) -> None:
        """Start replicating a committed step in the background (its manifest is read there)."""
        try:
            if self._config.replication_factor < 2 or len(self._dispatch.hosts()) < 2:
                return  # nothing to copy, or nowhere to copy it
            if self._newest is None or committed.step > self._newest:
                self._newest = committed.step
            self._pending = self._executor.submit(self._replicate, committed)
        except Exception as e:  # the step is committed: a save never fails because of its copies
            log.error("replication of step %d could not start: %s", committed.step, e)

    def _replicate(self, committed: CommittedStep) -> ReplicationReport:
        """Bring every blob of the step to ``replication_factor`` copies; retry until done.

        Each attempt asks the inventories (who holds what now), plans the missing copies and
        has the receiving hosts pull them. It tries again, with backoff, while a pull failed or a
        host is down and copies are still short; it gives up when a newer step is saved, the
        manager closes, or after half an hour. Never raises: training must not fail for this.
        """
        step, t0 = committed.step, time.perf_counter()
        stats = {"planned_blobs": 0, "planned_bytes": 0, "moved_blobs": 0, "moved_bytes": 0, "bad_copies": 0,
                 "removed_bad_copies": 0}
        # Share by share while the hosts' shares tell (the manifest, whose reading grows with the
        # shards, is not read at all); blob by blob from the manifest otherwise.
        by_shares = bool(committed.hosts and committed.digest)
        manifest: fmt.StepManifest | None = None
        names: list[str] = []
        attempts, error = 0, None
        complete = replicated = False
        short: dict[str, str] = {}  # host -> why it lacks copies of the step, from the last attempt
        self._progress = {"step": step, "attempts": 0, "t0": t0, "short": {}, "error": None, "stats": stats}
        deadline = time.monotonic() + _REPLICATION_PATIENCE_S
        while True:
            attempts += 1
            short = {}
            try:
                outcome = None
                if by_shares:
                    outcome = self._replicate_shares(committed, stats, short, first=attempts == 1)
                    by_shares = outcome is not None
                if outcome is None:
                    if manifest is None:
                        try:
                            manifest = committed.manifest
                        except Exception as e:  # the bytes the hosts committed do not read: nothing to plan
                            log.error("replication of step %d: its manifest does not read: %s", step, e)
                            return self._finish(ReplicationReport(
                                step=step, attempts=attempts, error=f"{type(e).__name__}: {e}",
                                seconds=time.perf_counter() - t0, **stats))
                        names = manifest.sorted_blob_names()
                    outcome = self._replicate_once(manifest, names, stats, short, first=attempts == 1)
                complete, replicated = outcome
                error = None
            except StepNotFoundError as e:  # pruned or aborted meanwhile: nothing left to do
                error = str(e)
                break
            except Exception as e:  # reported, retried
                complete, error = False, f"{type(e).__name__}: {e}"
                if isinstance(e, RuntimeError) and "after shutdown" in str(e):  # the process is exiting
                    break
                log.warning("replication of step %d, attempt %d: %s", step, attempts, error)
            self._progress = {"step": step, "attempts": attempts, "t0": t0, "short": short, "error": error,
                              "stats": stats}
            if complete:
                break
            if self._newest > step or self._closing.is_set() or time.monotonic() > deadline:
                error = error or "copies still missing: " + (
                    "a newer step was saved" if self._newest > step else
                    "the manager closed" if self._closing.is_set() else "gave up retrying")
                break
            self._closing.wait(_REPLICATION_RETRY.cap(attempts))
        if short and not replicated:
            error = "; ".join(filter(None, [error, *(f"host {h}: {why}" for h, why in sorted(short.items()))]))
        return self._finish(ReplicationReport(step=step, complete=complete, replicated=replicated,
                                              attempts=attempts, error=error, seconds=time.perf_counter() - t0,
                                              short_of_copies={} if replicated else short, **stats))

    def _finish(self, report: ReplicationReport) -> ReplicationReport:
        self.last_report = report
        self._progress = None
        for listener in self.listeners:
            try:
                listener(report)
            except Exception as e:  # a listener never stops the replication loop
                log.warning("replication report listener failed: %s", e)
        log.info("- replicate step %d; duration=%.3fs; moved=%d bytes in %d blobs (%d planned); complete=%s "
                 "replicated=%s attempts=%d", report.step, report.seconds, report.moved_bytes, report.moved_blobs,
                 report.planned_blobs, report.complete, report.replicated, report.attempts)
        return report

    def topology(self) -> dict[str, int]:
        return {h: self._dispatch.slice_of(h) for h in self._dispatch.hosts()}

    def _replicate_shares(self, committed: CommittedStep, stats: dict, short: dict[str, str], *,
                          first: bool) -> tuple[bool, bool] | None:
        """One attempt by shares: (nothing left to retry, every blob has its copies), or None when
        the shares cannot tell or place the copies (then the manifest plans, blob by blob).

        O(hosts) on the head: the inventories say which hosts hold which share whole (their own,
        a twin's, or a copy they keep); each share short of copies is pulled whole by a host of a
        domain that lacks it, which lists the blobs from its own copy of the manifest. A saving host
        that is down and whose part no other host holds whole leaves its share for later: the attempt
        is retried, by shares, until it is back (no copy of that part can be made before; the rows,
        read on every attempt, would cost O(shards) each time for nothing). ``short`` gets the hosts
        that could not make their copies, and why."""
        step, digest, hosts = committed.step, committed.digest, committed.hosts
        inv = self._inventories()
        topology = self.topology()
        twins = self._twins(committed, inv)
        if covered_by_shares(inv, step, digest, hosts, self._strategy, topology, twins):
            return True, True
        down = {h for h, i in inv.items() if i.error}
        short.update({h: f"could not be asked ({inv[h].error})" for h in down})
        targets = {h for h, i in inv.items() if not i.error
                   and any(s.step == step and s.manifest == digest for s in i.steps)}
        plan = plan_shares(inv, step, digest, hosts, self._strategy, topology, targets=targets, twins=twins)
        if plan is None:
            return None
        if not plan:  # nothing to copy now: wait for the hosts that are down (their parts), else the rows decide
            return (False, False) if down else None
        if first:
            blobs = {h: s.blobs for h, i in inv.items() for s in i.steps if s.step == step}
            stats["planned_blobs"] = sum(blobs.get(owner, 0) for rows in plan.values() for owner, _ in rows)
        failed = repaired = 0
        given_up = False
        for dst, res in self._dispatch.peer_pull(step, {}, shares=plan).items():
            _note_short(short, dst, res)
            if res.error:  # e.g. it could not get the manifest from a keeper to list the share
                given_up = True
                log.warning("replication of step %d: %s could not pull its shares (%s); planning per blob",
                            step, dst, res.error)
                continue
            failed += len(res.failed)
            stats["moved_blobs"] += res.pulled
            stats["moved_bytes"] += res.pulled_bytes
            stats["bad_copies"] += len(res.bad_copies)
            stats["removed_bad_copies"] += len(res.removed_bad_copies)
            repaired += len(res.removed_bad_copies)
            if first:
                stats["planned_bytes"] += res.asked_bytes
        if given_up:
            return None
        if repaired:  # holders dropped corrupt copies: they hold less than the inventory said; look again
            return False, False
        if covered_by_shares(self._inventories(), step, digest, hosts, self._strategy, topology, twins):
            return True, True
        if failed or down:
            return False, False
        return None  # the shares' copies were made and still not enough: the per-blob plan decides

    @staticmethod
    def _twins(committed: CommittedStep, inv: dict) -> dict[str, tuple[str, ...]] | None:
        """writer -> the writers that wrote exactly its boxes, from the header (``fmt.writers.twins``), where
        a saving host did not answer for the step: its share is then told by its twins' (or by the hosts
        that keep its part), not by the manifest's rows. None while every saving host answers."""
        answered = {h for h, i in inv.items() if not i.error
                    and any(s.step == committed.step and s.manifest == committed.digest for s in i.steps)}
        if all(h in answered for h in committed.hosts):
            return None
        header = committed.header
        return writers.twins(header) if header is not None and header.digest == committed.digest else None

    def _inventories(self) -> dict:
        inv = self._dispatch.peer_inventories()
        for listener in self.inventory_listeners:
            listener(inv)
        return inv

    def _replicate_once(self, manifest: fmt.StepManifest, names: list[str], stats: dict, short: dict[str, str], *,
                        first: bool) -> tuple[bool, bool]:
        """One attempt: (nothing left to retry, every blob has its copies); ``short`` as in ``_replicate_shares``."""
        step = manifest.step
        inv = self._inventories()
        down = {h for h, i in inv.items() if i.error}
        short.update({h: f"could not be asked ({inv[h].error})" for h in down})
        view = step_views(inv, lambda s, d: manifest if (s, d) == (step, manifest.digest) else None).get(step)
        holders = view.by_name(names) if view is not None else None
        if holders is None:
            if down:
                return False, False  # the hosts that hold it may be the ones down
            raise StepNotFoundError(f"step {step} is no longer committed on any host; nothing to replicate")
        topology = self.topology()
        plan = self._strategy.plan(manifest, holders, topology, targets=set(view.hosts) - down)
        if first:
            stats["planned_blobs"], stats["planned_bytes"] = len(plan), sum(t.nbytes for t in plan)
        failed = repaired = 0
        if plan:
            pulls: dict[str, list[tuple[str, int, list[str]]]] = {}
            for t in plan:
                others = sorted(holders[t.blob] - {t.src, t.dst} - down)
                pulls.setdefault(t.dst, []).append((t.blob, t.nbytes, [t.src, *others]))
            for dst, res in self._dispatch.peer_pull(step, pulls).items():
                _note_short(short, dst, res)
                if res.error:
                    failed += len(pulls[dst])
                    continue
                bad = res.failed_blobs
                failed += len(bad)
                stats["moved_blobs"] += res.pulled
                stats["moved_bytes"] += res.pulled_bytes
                stats["bad_copies"] += len(res.bad_copies)
                repaired += len(res.removed_bad_copies)
                stats["removed_bad_copies"] += len(res.removed_bad_copies)
                for blob, _, _ in pulls[dst]:
                    if blob not in bad:
                        holders[blob].add(dst)
        short = self._strategy.shortfall(manifest, holders, topology)
        lost = [b for b in short if not holders[b]]
        if lost:
            log.error("step %d: %d blobs have no copy on any host (e.g. %s); they cannot be replicated",
                      step, len(lost), lost[0])
        elif short and not failed and not down:
            log.warning("step %d: %d blobs stay below replication_factor=%d: the topology has %d failure domains "
                        "(slices, or hosts when there is one slice)", step, len(short), self._strategy.factor,
                        self._strategy.domains(topology))
        if repaired:  # holders dropped corrupt copies: they hold less than the inventory said; look again
            return False, False
        return failed == 0 and not (short and down), not short


def _note_short(short: dict[str, str], host: str, res: PullResult) -> None:
    """Why ``host`` did not make all of its copies, if it did not (``res``: its pull's answer)."""
    if res.error:
        short[host] = res.error
    elif res.failed:
        (blob, causes), more = res.failed[0], len(res.failed) - 1
        short[host] = (f"no holder gave it blob {blob}" + (f" and {more} more" if more else "") + ": "
                       + "; ".join(f"{h}: {c}" for h, c in causes))
