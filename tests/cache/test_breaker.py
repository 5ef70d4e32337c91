from __future__ import annotations

import pytest

from cache import BreakerState, CircuitBreaker


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def fail(breaker: CircuitBreaker, n: int) -> None:
    for _ in range(n):
        assert breaker.allow()
        breaker.record_failure()


def test_opens_after_threshold_consecutive_failures(clock: FakeClock) -> None:
    b = CircuitBreaker(failure_threshold=3, cooldown_s=5.0, clock=clock)
    fail(b, 2)
    assert b.allow()
    b.record_success()  # resets the run of failures
    fail(b, 2)
    assert b.state is BreakerState.CLOSED
    fail(b, 1)
    assert b.state is BreakerState.OPEN and b.opens == 1
    assert not b.allow()


def test_half_open_admits_one_trial_and_success_closes(clock: FakeClock) -> None:
    b = CircuitBreaker(failure_threshold=1, cooldown_s=5.0, clock=clock)
    fail(b, 1)
    clock.now += 4.9
    assert not b.allow()
    clock.now += 0.2
    assert b.allow()  # the trial
    assert b.state is BreakerState.HALF_OPEN
    assert not b.allow(), "only one trial call at a time"
    b.record_success()
    assert b.state is BreakerState.CLOSED
    assert all(b.allow() for _ in range(10))


def test_failed_trial_reopens_for_a_full_cooldown(clock: FakeClock) -> None:
    b = CircuitBreaker(failure_threshold=2, cooldown_s=5.0, clock=clock)
    fail(b, 2)
    clock.now += 5.0
    assert b.allow()
    b.record_failure()
    assert b.state is BreakerState.OPEN and b.opens == 2
    clock.now += 4.0
    assert not b.allow()
    clock.now += 1.0
    assert b.allow()


def test_rejecting_is_a_peek_that_starts_no_trial(clock: FakeClock) -> None:
    b = CircuitBreaker(failure_threshold=1, cooldown_s=5.0, clock=clock)
    assert not b.rejecting()
    fail(b, 1)
    assert b.rejecting()
    clock.now += 5.0
    assert not b.rejecting()
    assert b.state is BreakerState.OPEN
    assert b.allow() and b.state is BreakerState.HALF_OPEN


def test_late_success_does_not_close_an_open_breaker(clock: FakeClock) -> None:
    b = CircuitBreaker(failure_threshold=1, cooldown_s=5.0, clock=clock)
    assert b.allow()  # a slow call starts while closed ...
    fail(b, 1)  # ... another fails and opens the breaker ...
    b.record_success()  # ... then the slow one finishes
    assert b.state is BreakerState.OPEN


def test_transitions_are_reported(clock: FakeClock) -> None:
    seen: list[tuple[str, str]] = []
    b = CircuitBreaker(1, 1.0, clock=clock, on_transition=lambda old, new: seen.append((old, new)))
    fail(b, 1)
    clock.now += 1.0
    assert b.allow()
    b.record_success()
    assert seen == [("closed", "open"), ("open", "half_open"), ("half_open", "closed")]
