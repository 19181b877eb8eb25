"""Retry with exponential backoff and full jitter under a deadline that restarts on progress.

A policy is a small callable, as in pathways-utils: `policy(attempt, exc) -> bool` says
whether to try again after the `attempt`-th consecutive failure (1-based) raised `exc`.
Time is injected (`clock`, `sleep`) so that tests run on a fake clock.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
RetryPolicy = Callable[[int, Exception], bool]


def retry_if(predicate: Callable[[Exception], bool], *, max_attempts: int | None = None) -> RetryPolicy:
    """A policy that retries while `predicate(exc)` holds, at most `max_attempts` tries
    in a row (None: only the deadline limits them)."""

    def policy(attempt: int, exc: Exception) -> bool:
        if max_attempts is not None and attempt >= max_attempts:
            return False
        return predicate(exc)

    return policy


@dataclasses.dataclass(frozen=True)
class Backoff:
    """Exponential backoff with full jitter: the n-th wait is uniform in
    [0, min(maximum, initial * multiplier**(n-1))] (AWS "full jitter": spreads retries of
    many hosts hitting one bucket)."""

    initial: float = 0.1
    maximum: float = 10.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if not (self.initial > 0 and self.maximum >= self.initial and self.multiplier >= 1):
            raise ValueError(f"invalid backoff {self}: need 0 < initial <= maximum and multiplier >= 1")

    def cap(self, attempt: int) -> float:
        """The upper bound of the wait after the `attempt`-th failure (1-based)."""
        return min(self.maximum, self.initial * self.multiplier ** min(attempt - 1, 64))


def retry_call(
    fn: Callable[[], T],
    *,
    policy: RetryPolicy,
    deadline: float,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    backoff: Backoff = Backoff(),
    progress: Callable[[], object] | None = None,
    rng: random.Random | None = None,
    what: str = "call",
) -> T:
    """Call `fn` until it returns, retrying the failures `policy` accepts.

    The deadline is `deadline` seconds from the start, or from the last failure at which
    `progress()` (e.g. bytes confirmed so far) had changed: a long upload that keeps moving
    is never cut off, one that stalls is. Waits never run past the deadline; the last try
    happens at it at the latest. When the policy refuses, or the deadline has passed, the
    last exception is raised unchanged (the caller classifies it).
    """
    if deadline < 0:
        raise ValueError(f"deadline must be >= 0 seconds, got {deadline}")
    rng = rng or random.Random()
    start = clock()
    mark = progress() if progress is not None else None
    attempt = 0
    while True:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - the policy decides
            now = clock()
            if progress is not None:
                current = progress()
                if current != mark:
                    mark, start, attempt = current, now, 0
            attempt += 1
            if not policy(attempt, exc):
                raise
            remaining = start + deadline - now
            if remaining <= 0:
                logger.warning("%s: giving up after %d tries in %.1f s: %s", what, attempt, now - start, exc)
                raise
            delay = min(rng.uniform(0, backoff.cap(attempt)), remaining)
            logger.info("%s: try %d failed (%s); retrying in %.2f s", what, attempt, exc, delay)
            sleep(delay)
