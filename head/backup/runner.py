"""The backup tier's scheduling on the head: one backup at a time, in the background.

``BackupRunner.maybe_start`` starts the backup of a committed step when ``backup_due`` says
so, unless the previous one still runs (then it is skipped, and counted in the next report).
A backup's uploads are assigned by ``assign_uploads`` and run by the sidecars; the manifest
goes last, through one host. A failed backup never fails training: its report carries the
error and the next due backup retries. The backup scrub (``ScrubLoop``, ``scrub``) starts with the
first committed step and stops with the runner.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from mtc.head.backup.plan import assign_uploads, backup_due
from mtc.head.backup.scrub import ScrubLoop
from mtc.head.dispatch.interface import Dispatcher
from mtc.head.reports import BackupReport
from mtc.head.commit import CommittedStep
from mtc.shared import backup_layout
from mtc.shared.config import MTCConfig
from mtc.shared.errors import MTCError, PartUnreachableError

log = logging.getLogger(__name__)


class BackupRequest:
    """A backup asked for by signal (``CheckpointManager.watch_backup_requests``): the handler only
    sets ``pending``; the next save backs its step up. The handler before it is kept (``previous``)."""

    def __init__(self) -> None:
        self.pending = False
        self.signum = 0
        self.previous: Any = None

    def ask(self, signum: int, frame: Any) -> None:
        self.pending = True  # nothing else in a signal handler: the save, in the training loop, acts on it


class BackupRunner:
    def __init__(self, dispatch: Dispatcher, config: MTCConfig):
        self._dispatch = dispatch
        self._config = config
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mtc-backup")
        self._pending: Future | None = None
        self._skipped = 0
        self._last: tuple[int, float] | None = None  # (step, monotonic time) of the last started
        self.last_report: BackupReport | None = None
        self.listeners: list[Callable[[BackupReport], None]] = []  # each backup's report, once it ended (metrics)
        self.scrub = ScrubLoop(dispatch, config)

    def maybe_start(self, committed: CommittedStep, now: bool = False) -> None:
        """Start the backup of a committed step in the background if it is due; with ``now`` (asked
        for: ``save(..., backup=True)``), whatever the interval, after a backup still running (not
        skipped). The interval counts from it, as from any backup."""
        step = committed.step
        self.scrub.start()
        if now:
            self._last = (step, time.monotonic())
            skipped, self._skipped = self._skipped, 0
            log.info("backup of step %d asked for: it starts %s", step,
                     "after the one running" if self.running else "now")
            self._pending = self._executor.submit(self._run, committed, skipped)
            return
        if not backup_due(self._config, step, self._last, time.monotonic()):
            return
        running = self._pending
        if running is not None and not running.done():
            self._skipped += 1
            log.warning("backup of step %d skipped: the previous backup is still running", step)
            return
        self._last = (step, time.monotonic())
        skipped, self._skipped = self._skipped, 0
        self._pending = self._executor.submit(self._run, committed, skipped)

    def _parts_plan(self, committed: CommittedStep) -> tuple[dict[str, list[tuple[str, str, bool]]], str] | None:
        """(the hosts that upload their parts -> the writers they stand in for, the host that finalizes) for a
        backup with no manifest read on the head, O(hosts): when every box is in a part some host holds whole
        (the inventories) and the manifest records which host held which device (its header), the hosts share
        the uploads out among themselves (each unique box by one host) and a host that keeps the manifest
        finalizes from its own copy. A writer that lost its part (gone, or its ramdisk lost) has its share
        uploaded by a host that keeps a peer copy of its part, else by a data-parallel twin that holds its own
        part whole (the same boxes), else by every host that holds a piece of its part, each the blobs it
        holds: (writer, the part whose rows say its boxes, pieces only). None when it cannot go that way (a
        writer that answered with none of them, a step of an older version); PartUnreachableError for a
        writer that is down with none of them (no plan, the rows' neither, can upload its part)."""
        from mtc.head.replication.plan import step_views
        from mtc.shared.format import writers

        step, digest = committed.step, committed.digest
        if not digest:
            return None
        header = self._dispatch.manifest_header(step, digest)
        if header.devices is None:
            return None
        inv = self._dispatch.inventories()
        held = {w for i in inv.values() if not i.error for s in i.steps if s.step == step and s.manifest == digest
                for w in (*s.parts, *(p[0] for p in s.pieces))}
        for w, _ in header.parts:  # (the rows would give a down host its own blobs to upload: no plan can)
            if (w not in inv or inv[w].error) and w not in held:
                raise PartUnreachableError(
                    f"host {w} saved part of step {step} and is down, and no other host holds its part (whole, "
                    "as a data-parallel twin's, or in pieces): the backup waits for it (the next due backup "
                    "retries)")
        view = step_views(inv, None, lambda s, d: header if d == digest else None).get(step)
        if view is None or not view.by_writers or view.manifest != digest:
            return None
        uploads: dict[str, list[tuple[str, str, bool]]] = {  # the writers that hold their own parts whole
            h: [] for h, _ in header.parts if h in view.part_holders.get(h, ())}
        twins = writers.twins(header) if view.lost else {}
        for w in view.lost:
            keeper = next((h for h in view.part_holders.get(w, ()) if h != w), None)
            twin = next((t for t in (twins or {}).get(w, ()) if t in uploads), None)
            if keeper is not None:
                uploads.setdefault(keeper, []).append((w, w, False))
            elif twin is not None:
                uploads[twin].append((w, twin, False))
            elif w in view.pieces:  # every holder of a piece gives the blobs of the share that it holds
                for h in view.pieces[w]:
                    uploads.setdefault(h, []).append((w, w, True))
            else:
                return None
        return uploads, (list(view.keepers) or sorted(uploads))[0]  # a keeper finalizes from the copy it has

    def _run(self, committed: CommittedStep, skipped: int) -> BackupReport:
        t0 = time.perf_counter()
        step = committed.step
        try:
            name = backup_layout.backup_name(step)
            up = None
            try:
                plan = self._parts_plan(committed)
                if plan is not None:
                    up = self._dispatch.backup_upload_parts(step, plan[0])
            except PartUnreachableError:
                raise
            except MTCError as e:  # the head plans them instead; what was uploaded stays (named by content)
                log.info("backup of step %d: not by the hosts' parts (%s); the head plans the uploads", step, e)
            if up is not None:
                self._dispatch.backup_finalize_step(plan[1], name, step, committed.digest)
            else:
                manifest = committed.manifest
                hosts = self._dispatch.hosts()
                up = self._dispatch.backup_upload(assign_uploads(manifest, hosts, self._dispatch.host_of_device))
                host = sorted(up)[0] if up else hosts[0]
                self._dispatch.backup_finalize(host, name, manifest)
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
        self.last_report = report
        for listener in self.listeners:
            listener(report)
        return report

    @property
    def running(self) -> bool:
        pending = self._pending
        return pending is not None and not pending.done()

    def wait(self) -> BackupReport | None:
        """Block until the running backup (if any) is done; returns its report."""
        pending = self._pending
        if pending is not None:
            pending.result()
        return self.last_report

    def close(self) -> None:
        self.scrub.close()
        self._executor.shutdown(wait=True)
