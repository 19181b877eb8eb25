"""retry_call on a fake clock: backoff with full jitter, the deadline, and its restart on
progress. Plain functions stand in for the network; nothing of ours is mocked."""

from __future__ import annotations

import random

import pytest

from mtc.shared.objstore.retry import Backoff, retry_call, retry_if

pytestmark = pytest.mark.unit


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


class Flaky(Exception):
    pass


class Broken(Exception):
    pass


def failing(times: int, exc: type[Exception] = Flaky, result: str = "ok"):
    """A function that raises `exc` on its first `times` calls, then returns `result`."""
    calls = []

    def fn() -> str:
        calls.append(1)
        if len(calls) <= times:
            raise exc(f"failure {len(calls)}")
        return result

    fn.calls = calls
    return fn


transient = retry_if(lambda e: isinstance(e, Flaky))


def run(fn, clock: FakeClock, **kw):
    kw.setdefault("policy", transient)
    kw.setdefault("deadline", 60.0)
    return retry_call(fn, sleep=clock.sleep, clock=clock.clock, rng=random.Random(7), **kw)


def test_returns_after_transient_failures():
    clock = FakeClock()
    fn = failing(3)
    assert run(fn, clock) == "ok"
    assert len(fn.calls) == 4 and len(clock.sleeps) == 3


def test_fatal_error_is_raised_at_once():
    clock = FakeClock()
    fn = failing(1, exc=Broken)
    with pytest.raises(Broken, match="failure 1"):
        run(fn, clock)
    assert len(fn.calls) == 1 and clock.sleeps == []


def test_waits_are_full_jitter_under_a_growing_cap():
    backoff = Backoff(initial=0.5, maximum=4.0, multiplier=2.0)
    assert [backoff.cap(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    waits_by_try: dict[int, list[float]] = {}
    for seed in range(200):
        clock = FakeClock()
        retry_call(failing(6), policy=transient, deadline=1e9, backoff=backoff, sleep=clock.sleep,
                   clock=clock.clock, rng=random.Random(seed))
        for n, w in enumerate(clock.sleeps, start=1):
            assert 0 <= w <= backoff.cap(n)
            waits_by_try.setdefault(n, []).append(w)
    # Full jitter: waits spread over [0, cap], they are not the cap itself.
    for n, waits in waits_by_try.items():
        assert min(waits) < 0.2 * backoff.cap(n) and max(waits) > 0.8 * backoff.cap(n)


def test_deadline_bounds_the_retries():
    clock = FakeClock()
    fn = failing(10**9)
    with pytest.raises(Flaky):
        run(fn, clock, deadline=5.0, backoff=Backoff(initial=0.1, maximum=1.0))
    # Never waits past the deadline; the last try happens at it.
    assert sum(clock.sleeps) == pytest.approx(5.0)
    assert clock.now == pytest.approx(105.0)
    assert len(fn.calls) == len(clock.sleeps) + 1 > 5


def test_zero_deadline_means_one_try():
    clock = FakeClock()
    fn = failing(1)
    with pytest.raises(Flaky):
        run(fn, clock, deadline=0.0)
    assert len(fn.calls) == 1 and clock.sleeps == []


def test_deadline_restarts_on_progress():
    """An upload that moves a chunk between failures is never cut off; once it stalls it
    gets one more full deadline, counted from its last progress."""
    clock = FakeClock()
    moved = [0]
    calls = [0]
    backoff = Backoff(initial=1.0, maximum=2.0)

    def upload() -> str:
        calls[0] += 1
        if calls[0] <= 20:
            moved[0] += 1  # a chunk got through before this try failed
            raise Flaky("connection reset after a chunk")
        raise Flaky("stalled")

    with pytest.raises(Flaky, match="stalled"):
        run(upload, clock, deadline=5.0, backoff=backoff, progress=lambda: moved[0])
    elapsed = clock.now - 100.0
    waits_while_moving = sum(clock.sleeps[:19])  # the 20th failure still moved: restart there
    assert elapsed > 5.0  # longer than one deadline in total...
    # ...and the stall got exactly one deadline after the last progress.
    assert elapsed - waits_while_moving == pytest.approx(5.0)

    # Without progress the same failures stop at the deadline.
    clock2 = FakeClock()
    with pytest.raises(Flaky):
        run(failing(10**9), clock2, deadline=5.0, backoff=backoff)
    assert clock2.now - 100.0 == pytest.approx(5.0)


def test_progress_resets_the_backoff():
    clock = FakeClock()
    moved = [0]
    backoff = Backoff(initial=1.0, maximum=64.0)
    policy_attempts = []

    def policy(attempt: int, exc: Exception) -> bool:
        policy_attempts.append(attempt)
        return True

    def fn() -> str:
        if len(policy_attempts) == 3:
            moved[0] += 1
        if len(policy_attempts) < 6:
            raise Flaky("x")
        return "done"

    assert run(fn, clock, policy=policy, deadline=1e6, backoff=backoff, progress=lambda: moved[0]) == "done"
    assert policy_attempts == [1, 2, 3, 1, 2, 3]


def test_retry_if_max_attempts():
    clock = FakeClock()
    fn = failing(10)
    with pytest.raises(Flaky, match="failure 3"):
        run(fn, clock, policy=retry_if(lambda e: True, max_attempts=3))
    assert len(fn.calls) == 3


def test_bad_arguments():
    with pytest.raises(ValueError):
        Backoff(initial=0)
    with pytest.raises(ValueError):
        Backoff(initial=2.0, maximum=1.0)
    with pytest.raises(ValueError):
        retry_call(lambda: None, policy=transient, deadline=-1)
