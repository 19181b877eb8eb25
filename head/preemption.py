"""A preemption notice (SIGTERM, then the grace period) as time to save the step the job is at.

Kubernetes stops a pod by sending SIGTERM and, after ``terminationGracePeriodSeconds``, SIGKILL
(GKE's spot and maintenance events do the same). ``PreemptionNotice`` turns the first SIGTERM
into a flag the training loop reads at its next step boundary (``reached_preemption``) and a
budget, ``MTC_PREEMPTION_GRACE_S`` (default 25 s, inside Kubernetes' default 30 s): the loop
saves the step it reached, ``CheckpointManager.finish_preemption`` waits for its commit and,
when the job has more than one failure domain, its copies, and the process exits 0. A second
SIGTERM, or the budget running out, exits at once (status 143) with what is committed: a step is
committed or absent, never half there.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 25.0
EXIT_INTERRUPTED = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM


def grace_from_env(environ=None) -> float:
    """``MTC_PREEMPTION_GRACE_S`` (seconds, > 0), or the default; a bad value names the variable."""
    from mtc.shared.config import env_number

    return env_number("MTC_PREEMPTION_GRACE_S", os.environ if environ is None else environ, default=DEFAULT_GRACE_S,
                      why="seconds; set it below the pod's terminationGracePeriodSeconds (mtc manifests render "
                          "sets both)")


def _say(message: str) -> None:
    # From a signal handler or a timer: the logging module's locks may be held by the interrupted
    # code, so write the line directly.
    sys.stderr.write(f"mtc: {message}\n")
    sys.stderr.flush()


class PreemptionNotice:
    """The first SIGTERM as a notice with a budget; the second (or the budget's end) exits now."""

    def __init__(self, grace_s: float | None = None):
        self.grace_s = float(grace_s) if grace_s is not None else grace_from_env()
        self._received_at: float | None = None
        self._timer: threading.Timer | None = None
        self._installed = False

    def install(self) -> "PreemptionNotice":
        """Take SIGTERM (from the main thread: Python delivers signals there)."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("watch for preemption from the main thread (Python runs signal handlers there)")
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self._installed = True
        return self

    @property
    def received(self) -> bool:
        return self._received_at is not None

    def remaining(self) -> float:
        """Seconds of the budget left (the whole budget before a notice)."""
        if self._received_at is None:
            return self.grace_s
        return max(0.0, self._received_at + self.grace_s - time.monotonic())

    def elapsed(self) -> float:
        return 0.0 if self._received_at is None else time.monotonic() - self._received_at

    def notify(self) -> None:
        """What SIGTERM does (callable directly, e.g. from another notice source)."""
        if self._received_at is not None:
            _say("second SIGTERM: exiting now with what is committed")
            os._exit(EXIT_INTERRUPTED)
        self._received_at = time.monotonic()
        _say(f"SIGTERM: saving the step the job is at, at the next step boundary (budget {self.grace_s:g} s; "
             "a second SIGTERM exits at once)")
        self._timer = threading.Timer(self.grace_s, self._out_of_time)
        self._timer.daemon = True
        self._timer.start()

    def _on_sigterm(self, signum, frame) -> None:
        self.notify()

    def _out_of_time(self) -> None:
        _say(f"the preemption budget of {self.grace_s:g} s ran out: exiting now with what is committed")
        os._exit(EXIT_INTERRUPTED)

    def done(self) -> None:
        """The preemption save finished in time: the budget's timer stops."""
        if self._timer is not None:
            self._timer.cancel()
