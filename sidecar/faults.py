"""Deterministic crash points for chaos tests.

The sidecar calls :func:`crash_point` at named places. When the environment variable
``MTC_CRASH_AT`` (read at each call) names that point, the process kills itself with SIGKILL:
a real ``kill -9``, no cleanup, no ``finally`` blocks, no flushed buffers.

``MTC_CRASH_AT`` is a comma-separated list of entries ``name`` (crash whenever the point is
reached) or ``name@N`` (crash the N-th time it is reached in this process, 1-based).

Points (placed in the sidecar service):

- ``before_blobs``: space checked, no blob of the step written yet.
- ``between_blobs``: some blobs of the step written, others not.
- ``before_commit``: every blob and the host manifest written; the step manifest not yet.
- ``after_commit``: the step manifest written (the step is committed).
- ``between_uploads``: a backup upload of one blob is about to start (backup tier); ``@N``
  picks the N-th upload, so earlier ones are in the bucket and later ones are not.
"""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter

from mtc.shared.errors import InjectedFaultError

__all__ = ["CRASH_POINTS", "ENV_VAR", "FAIL_ENV_VAR", "crash_point"]

ENV_VAR = "MTC_CRASH_AT"
# The same points and syntax, but the point raises InjectedFaultError instead of killing the
# process: a failure the sidecar reports (needed where the sidecar shares the head's process).
FAIL_ENV_VAR = "MTC_FAIL_AT"
CRASH_POINTS = frozenset({"before_blobs", "between_blobs", "before_commit", "after_commit", "between_uploads"})

_counts: Counter[str] = Counter()
_lock = threading.Lock()


def _parse(spec: str) -> dict[str, set[int | None]]:
    """{point: {N, ...}} from MTC_CRASH_AT; None stands for "every time"."""
    out: dict[str, set[int | None]] = {}
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        name, at, nth = item.partition("@")
        if name not in CRASH_POINTS:
            raise ValueError(f"{ENV_VAR}={spec!r}: unknown crash point {name!r}; known points: "
                             f"{', '.join(sorted(CRASH_POINTS))}")
        n: int | None = None
        if at:
            if not nth.isdigit() or int(nth) < 1:
                raise ValueError(f"{ENV_VAR}={spec!r}: in {item!r}, the part after '@' must be a count >= 1")
            n = int(nth)
        out.setdefault(name, set()).add(n)
    return out


def crash_point(name: str) -> None:
    """Kill this process with SIGKILL if ``MTC_CRASH_AT`` selects this visit of point ``name``.

    Every call counts a visit (even with the variable unset), so ``name@N`` means the N-th
    visit since the process started. Raises ValueError for a malformed ``MTC_CRASH_AT`` or
    an unknown point name.
    """
    if name not in CRASH_POINTS:
        raise ValueError(f"unknown crash point {name!r}; known points: {', '.join(sorted(CRASH_POINTS))}")
    with _lock:
        _counts[name] += 1
        visit = _counts[name]
    for var in (ENV_VAR, FAIL_ENV_VAR):
        spec = os.environ.get(var, "")
        if not spec:
            continue
        wanted = _parse(spec).get(name)
        if wanted is not None and (None in wanted or visit in wanted):
            if var == FAIL_ENV_VAR:
                raise InjectedFaultError(f"injected failure at {name} (visit {visit}; {FAIL_ENV_VAR}={spec})")
            os.kill(os.getpid(), signal.SIGKILL)
