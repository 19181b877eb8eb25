"""The sidecar's job model (mtc.sidecar.jobs): start at once, long-poll or poll, answered once."""

from __future__ import annotations

import threading
import time

import pytest

from mtc.shared.errors import StepNotFoundError
from mtc.sidecar.jobs import Jobs

pytestmark = pytest.mark.unit


def test_a_job_is_answered_when_done_and_only_once():
    jobs, gate = Jobs("h0"), threading.Event()
    job = jobs.start(lambda x: (gate.wait(5), x * 2)[1], 21)
    assert jobs.poll(job) == {"done": False} and jobs.running() == 1
    t0 = time.monotonic()
    assert jobs.poll(job, wait_s=0.2) == {"done": False}  # waited, still running
    assert time.monotonic() - t0 >= 0.15
    threading.Timer(0.1, gate.set).start()
    t0 = time.monotonic()
    assert jobs.poll(job, wait_s=5) == {"done": True, "result": 42}  # woke when it ended, not after 5 s
    assert time.monotonic() - t0 < 2
    with pytest.raises(StepNotFoundError, match="h0: no job"):
        jobs.poll(job)


def test_a_failed_job_reports_its_error_and_an_unknown_job_is_refused():
    jobs = Jobs("h1")

    def boom():
        raise ValueError("bucket gone")

    job = jobs.start(boom)
    status = jobs.poll(job, wait_s=5)
    assert status == {"done": True, "error": "ValueError", "message": "bucket gone"}
    with pytest.raises(StepNotFoundError, match="sidecar restarted"):
        jobs.poll("0" * 32)
