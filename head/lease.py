"""This head's claim on the hosts (docs/architecture.md, "One head at a time").

A starting head takes every host with a generation newer than any lease they hold; a head that
drove them before (alive, or killed -9) is fenced off, its next change refused with FencedError
naming this one. A head that closes marks its lease closed, so the next head follows it rather
than taking over.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from typing import Any

log = logging.getLogger(__name__)


def claim(dispatch: Any, started: float) -> dict:
    """Take every host behind ``dispatch`` for a new head (started at ``started``); who it is.

    Hosts that cannot be asked now take the generation with this head's first request that
    reaches them.
    """
    head = {"host": socket.gethostname(), "pid": os.getpid(), "id": uuid.uuid4().hex[:12],
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))}
    newest = max((lease["generation"] for lease in dispatch.leases().values() if lease), default=0)
    generation = max(time.time_ns() // 1000, newest + 1)
    dispatch.claim(generation, head)
    dispatch.generation = generation
    log.info("head %s (pid %d) drives %d hosts as generation %d", head["host"], head["pid"],
             len(dispatch.hosts()), generation)
    return head


def release(dispatch: Any, head: dict) -> None:
    """Mark the lease closed, so that the next head follows this one instead of taking over."""
    try:
        dispatch.claim(dispatch.generation, {**head, "closed": True})
    except Exception as e:  # best effort: a host that is gone keeps the open lease (the next head takes over)
        log.debug("releasing the hosts: %s: %s", type(e).__name__, e)
