"""The head pod's supervisor: it restarts a failed training process in place, from a warm standby.

Most of what a training job loses to a failure of its training process is not the restore: it is
the pod's restart delay and a new interpreter importing Python, JAX and MaxText. The supervisor is a
small parent process (it imports no JAX) that runs the training process as a child and keeps one
**standby** child beside it: a process that has already imported what the training process imports
(``warm``: JAX, MaxText, mtc) but has not initialised a backend or touched a device, and waits on its
stdin. When the training process dies (a signal, a crash, a non-zero exit other than bad input), the
supervisor promotes the standby at once (one line on its stdin: ``go`` and the restart's record),
and starts a new standby behind it. The promoted process runs the training program as a new process
would (a new head generation fences the dead one's late operations on the hosts, and it restores from
the tiers); only the imports were done before.

Every child is started the same way, as a standby (``mtc.head.supervisor.standby``): the first one is
told to go at once. Children die with the supervisor (``PR_SET_PDEATHSIG``): a ``kill -9`` of the pod
takes them all, and Kubernetes restarts the pod cold, as before.

- SIGUSR1 to the supervisor (a backup asked for by an operator) goes to the training process where it
  catches it (``CheckpointManager.watch_backup_requests``; the MaxText launcher does), else it is
  logged and dropped: SIGUSR1's default action would end the process.
- SIGTERM (or SIGINT, SIGHUP) to the supervisor goes to the training process as SIGTERM (a preemption:
  it saves the step it reached and exits 0, as without the supervisor); the standby is stopped; the
  supervisor exits with the training process's status and restarts nothing.
- A training process that exits 0 (finished, or preempted) ends the supervisor with 0; one that exits
  ``EXIT_BAD_INPUT`` (2: bad flags or input, named) ends it with 2: a restart would fail the same way.
- A crash loop is bounded: more than ``MTC_RESTARTS`` restarts (default 8) within
  ``MTC_RESTART_WINDOW_S`` (default 3600) ends the supervisor with the child's status (non-zero), and
  Kubernetes takes over as without it.
- ``MTC_STANDBY=0``: no standby; a failed training process is restarted in place, cold.

What the promoted process knows of it (``promotion()``): how many restarts the supervisor made, and
why, exported by the head's metrics (``mtc_supervisor_restarts_total{cause}``), and which modules
were imported before it was told to go.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from typing import Mapping, Sequence

from mtc.shared.config import env_flag, env_number
from mtc.shared.errors import ConfigError

log = logging.getLogger(__name__)

ENV_SUPERVISOR = "MTC_SUPERVISOR"  # "0": python -m mtc.head.maxtext runs without a supervisor
ENV_STANDBY = "MTC_STANDBY"  # "0": no standby (restarts are cold, in place)
ENV_RESTARTS = "MTC_RESTARTS"  # the most restarts within ENV_WINDOW
ENV_WINDOW = "MTC_RESTART_WINDOW_S"
ENV_PROMOTION = "MTC_SUPERVISOR_PROMOTION"  # in a promoted child: the restart's record (JSON)
DEFAULT_RESTARTS = 8
DEFAULT_WINDOW_S = 3600.0
EXIT_BAD_INPUT = 2
POLL_S = 0.02  # how often the supervisor looks at its training process (a death is seen within it)
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (its ``SigCgt`` mask in /proc)."""
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return False

# In a child: what it was told when it was promoted (see promotion()).
_promotion: dict = {}


class SupervisorConfigError(ValueError):
    """A supervisor setting (``MTC_RESTARTS``, ``MTC_RESTART_WINDOW_S``) that does not parse, named."""


def _on(env: Mapping[str, str], name: str) -> bool:
    try:
        return env_flag(name, env, default=True)
    except ConfigError as e:
        raise SupervisorConfigError(str(e)) from None


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the MaxText launcher runs under a supervisor (``MTC_SUPERVISOR``, default on)."""
    return _on(os.environ if environ is None else environ, ENV_SUPERVISOR)


def promotion() -> dict:
    """In a training process the supervisor started: {"restarts": {cause: n}, "restart": n (0: the first
    start), "warm": [modules imported before the go], "died_at": wall time of the death it replaces or
    None}; {} in a process no supervisor started."""
    return dict(_promotion)


def set_promotion(record: dict) -> None:
    _promotion.clear()
    _promotion.update(record)


def _positive(env: Mapping[str, str], name: str, default: float, kind=float) -> float:
    try:
        return env_number(name, env, default=default, integer=kind is int, inclusive=True,
                          why=f"unset it for the default ({default})")
    except ConfigError as e:
        raise SupervisorConfigError(str(e)) from None


def describe_status(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited {code}"


def cause_of(code: int) -> str:
    """The metrics label of a death: the signal's name, or ``exit``."""
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal{-code}"
    return "exit"


class Supervisor:
    """Runs ``target`` (``["-m", module, *args]`` or ``[script, *args]``) as a training process with a
    warm standby; ``warm``: the modules a standby imports while it waits. ``run()`` returns the exit
    status for the pod."""

    def __init__(self, target: Sequence[str], warm: Sequence[str] = (), *, environ: Mapping[str, str] | None = None):
        env = dict(os.environ if environ is None else environ)
        self.target = list(target)
        self.warm = [m for m in warm if m]
        self.standby_on = _on(env, ENV_STANDBY)
        self.max_restarts = int(_positive(env, ENV_RESTARTS, DEFAULT_RESTARTS, int))
        self.window_s = _positive(env, ENV_WINDOW, DEFAULT_WINDOW_S)
        self.env = env
        self.restarts: list[float] = []  # when each restart was made (the window's)
        self.causes: dict[str, int] = {}
        self._stopping: int | None = None  # the signal that asked the supervisor to stop
        self._stop_seen = False
        self._wake_r, self._wake_w = os.pipe()
        self._training: subprocess.Popen | None = None
        self._standby: subprocess.Popen | None = None

    # --- children --------------------------------------------------------------------------

    def _spawn(self) -> subprocess.Popen:
        """A child that imports ``warm`` and waits for its go (its stdout and stderr are the pod's)."""
        argv = [sys.executable, "-m", "mtc.head.supervisor.standby", "--parent-pid", str(os.getpid()),
                "--warm", ",".join(self.warm), "--", *self.target]
        return subprocess.Popen(argv, stdin=subprocess.PIPE, env=self.env)

    def _go(self, child: subprocess.Popen, died_at: float | None, standby: bool = False) -> None:
        record = {"restart": len(self.restarts), "restarts": dict(self.causes), "died_at": died_at,
                  "standby": standby}
        assert child.stdin is not None
        try:
            child.stdin.write(f"go {json.dumps(record)}\n".encode())
            child.stdin.flush()
        except BrokenPipeError:  # it died meanwhile: the loop sees its exit
            pass

    def _stop_standby(self) -> None:
        s, self._standby = self._standby, None
        if s is None:
            return
        try:
            s.stdin.close()  # EOF: a waiting standby exits 0
        except OSError:
            pass
        try:
            s.wait(timeout=5)
        except subprocess.TimeoutExpired:  # still importing
            s.kill()
            s.wait()

    # --- signals ---------------------------------------------------------------------------

    def _on_signal(self, signum: int, _frame) -> None:
        self._stopping = signum
        os.write(self._wake_w, b"s")

    def _on_backup_request(self, signum: int, _frame) -> None:
        """SIGUSR1 (a backup asked for: ``CheckpointManager.watch_backup_requests``) goes to the training
        process, only where it catches it: SIGUSR1's default action would end it."""
        training = self._training
        if training is None or training.poll() is not None:
            return
        if catches(training.pid, signum):
            os.kill(training.pid, signum)
        else:
            os.write(self._wake_w, b"u")  # said by the loop (no logging in a signal handler)

    # --- the loop --------------------------------------------------------------------------

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in _STOP_SIGNALS}
        previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._on_backup_request)
        try:
            return self._run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._stop_standby()
            if self._training is not None and self._training.poll() is None:
                self._training.kill()
                self._training.wait()

    def _run(self) -> int:
        self._training = self._spawn()
        self._go(self._training, None)
        log.info("mtc: supervisor (pid %d): training process pid %d started%s", os.getpid(),
                 self._training.pid, "; a standby follows" if self.standby_on else " (no standby: MTC_STANDBY=0)")
        if self.standby_on:
            self._standby = self._spawn()
        forwarded = False
        while True:
            code = self._wait_training()
            if code is None:  # a stop signal
                if not forwarded and self._training.poll() is None:
                    log.info("mtc: supervisor: %s: passed to the training process (pid %d) as SIGTERM",
                             signal.Signals(self._stopping).name, self._training.pid)
                    self._training.send_signal(signal.SIGTERM)
                    forwarded = True
                    self._stop_standby()
                continue
            died_at = time.time()
            if self._stopping is not None or code == 0:
                log.info("mtc: supervisor: the training process %s; done", describe_status(code))
                return code if code >= 0 else 128 - code
            if code == EXIT_BAD_INPUT:
                log.error("mtc: supervisor: the training process exited %d (bad input: a restart would fail the "
                          "same way); not restarting", code)
                return code
            now = time.monotonic()
            self.restarts = [t for t in self.restarts if now - t < self.window_s]
            if len(self.restarts) >= self.max_restarts:
                log.error("mtc: supervisor: the training process %s, after %d restarts within %.0f s (%s); giving up: "
                          "the pod ends and Kubernetes restarts it", describe_status(code), len(self.restarts),
                          self.window_s, ENV_RESTARTS)
                return code if code > 0 else 128 - code
            self.restarts.append(now)
            cause = cause_of(code)
            self.causes[cause] = self.causes.get(cause, 0) + 1
            standby = self._standby
            self._standby = None
            warm = standby is not None and standby.poll() is None
            self._training = standby if warm else self._spawn()
            self._go(self._training, died_at, standby=warm)
            log.warning("mtc: supervisor: the training process %s; restart %d (of at most %d in %.0f s): %s pid %d "
                        "takes over", describe_status(code), len(self.restarts), self.max_restarts, self.window_s,
                        "standby" if warm else "a new process", self._training.pid)
            if self.standby_on:
                self._standby = self._spawn()

    def _wait_training(self) -> int | None:
        """The training process's exit status, or None when a stop signal came first."""
        proc = self._training
        while True:
            if self._stopping is not None and not self._stop_seen:
                self._stop_seen = True
                return None
            code = proc.poll()
            if code is not None:
                return code
            ready, _, _ = select.select([self._wake_r], [], [], POLL_S)
            if ready and b"u" in os.read(self._wake_r, 64):
                log.warning("mtc: supervisor: SIGUSR1 (a backup asked for) not passed on: the training process (pid "
                            "%d) does not catch it (CheckpointManager.watch_backup_requests), and it would end it",
                            proc.pid)
