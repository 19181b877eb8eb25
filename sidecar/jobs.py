"""Long sidecar operations as jobs: one model for both transports.

Uploads, downloads and peer pulls can take minutes. Neither transport holds a call open that
long: the call that starts one answers at once with a job id, and the head asks ``job`` until
it is done. The daemon's ``job`` waits up to ``wait_s`` for the end (a long poll, so the head
learns of it at once); the colocated transport polls with ``wait_s=0`` (on a CPU backend
colocated calls of one kind are serialised, so a waiting call would hold the others up).
A job's result, or its error, is handed out once. A sidecar that restarts forgets its jobs:
the head is then told there is no such job.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any, Callable

from mtc.shared.errors import StepNotFoundError
from mtc.shared.requests import MAX_WAIT_S

# Finished jobs that nobody asked about (their head died) are forgotten after this long.
_FORGET_AFTER_S = 3600.0


class Jobs:
    def __init__(self, host_id: str):
        self.host_id = host_id
        self._lock = threading.Lock()
        self._jobs: dict[str, tuple[threading.Event, dict]] = {}
        self._finished: dict[str, float] = {}  # job id -> when it finished

    def start(self, fn: Callable[..., Any], *args: Any) -> str:
        """Run ``fn(*args)`` on a thread of this sidecar; returns the job id to ask ``poll`` with."""
        job_id = uuid.uuid4().hex
        done = threading.Event()
        with self._lock:
            self._forget_old()
            self._jobs[job_id] = (done, {"done": False})

        def run() -> None:
            try:
                out = {"done": True, "result": fn(*args)}
            except Exception as e:  # reported to the head by `poll`
                out = {"done": True, "error": type(e).__name__, "message": str(e)}
            with self._lock:
                self._jobs[job_id] = (done, out)
                self._finished[job_id] = time.monotonic()
            done.set()

        threading.Thread(target=run, name=f"mtc-job-{job_id[:8]}", daemon=True).start()
        return job_id

    def poll(self, job_id: str, wait_s: float = 0.0) -> dict:
        """{"done": False} while running (after waiting up to ``wait_s``); then the result
        ({"done": True, "result"}) or the error ({"done": True, "error", "message"}), once."""
        with self._lock:
            entry = self._jobs.get(job_id)
        if entry is None:
            raise StepNotFoundError(f"host {self.host_id}: no job {job_id} (the sidecar restarted, or it "
                                    "was answered already)")
        done, _ = entry
        if wait_s > 0:
            done.wait(min(float(wait_s), MAX_WAIT_S))
        with self._lock:
            entry = self._jobs.get(job_id)
            if entry is None:
                raise StepNotFoundError(f"host {self.host_id}: no job {job_id} (answered already)")
            status = entry[1]
            if status["done"]:
                del self._jobs[job_id]
                self._finished.pop(job_id, None)
            return status

    def running(self) -> int:
        with self._lock:
            return sum(1 for _, st in self._jobs.values() if not st["done"])

    def _forget_old(self) -> None:
        now = time.monotonic()
        for job_id, t in list(self._finished.items()):
            if now - t > _FORGET_AFTER_S:
                del self._finished[job_id]
                self._jobs.pop(job_id, None)
