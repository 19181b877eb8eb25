"""A child process that dies with its parent (Linux ``PR_SET_PDEATHSIG``).

Used by the sidecar daemons a local cluster or a tool starts, and by the training processes and the
standby of the head's supervisor: a ``kill -9`` of the parent (a pod lost) takes its children with it,
and none lives on holding ports, ramdisk files or a device.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, what: str = "this process") -> None:
    """SIGKILL this process when ``parent_pid`` (its parent) dies; exit at once if it already has."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        log.warning("PR_SET_PDEATHSIG is not available here; %s will outlive its parent", what)
        return
    if prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d)", ctypes.get_errno())
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)
