"""A circuit breaker so a dead or slow Redis costs a bounded amount of request time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from enum import StrEnum


class BreakerState(StrEnum):
    CLOSED = "closed"  # calls go through; consecutive failures are counted
    OPEN = "open"  # no calls at all until the cool-down has passed
    HALF_OPEN = "half_open"  # one trial call is in flight; its outcome decides


class CircuitBreaker:
    """Opens after `failure_threshold` consecutive failures, for `cooldown_s` seconds.

    Usage: `if breaker.allow(): try call; record_success()/record_failure()`. Every allowed call
    must report exactly one outcome, or a half-open trial would block the breaker forever.
    """

    def __init__(
        self,
        failure_threshold: int = 3,
        cooldown_s: float = 5.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_transition: Callable[[BreakerState, BreakerState], None] | None = None,
    ) -> None:
        if failure_threshold < 1:
            raise ValueError("failure_threshold must be >= 1")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._on_transition = on_transition
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self.opens = 0  # times it went from closed/half-open to open

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    def rejecting(self) -> bool:
        """True while open and cooling down: a cheap peek that, unlike allow(), starts no trial."""
        with self._lock:
            return self._state is BreakerState.OPEN and self._clock() - self._opened_at < self.cooldown_s

    def allow(self) -> bool:
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self.cooldown_s:
                self._move(BreakerState.HALF_OPEN)
                return True  # this caller is the trial
            return False

    def record_success(self) -> None:
        with self._lock:
            # NOTE: a late success from a call allowed before the breaker opened says little
            # about now; only the half-open trial (or a closed breaker) acts on it.
            if self._state is not BreakerState.OPEN:
                self._failures = 0
                self._move(BreakerState.CLOSED)

    def record_failure(self) -> None:
        with self._lock:
            if self._state is BreakerState.HALF_OPEN:
                self._open()
            elif self._state is BreakerState.CLOSED:
                self._failures += 1
                if self._failures >= self.failure_threshold:
                    self._open()

    def _open(self) -> None:
        self._opened_at = self._clock()
        self._failures = 0
        self.opens += 1
        self._move(BreakerState.OPEN)

    def _move(self, new: BreakerState) -> None:
        old, self._state = self._state, new
        if old is not new and self._on_transition is not None:
            self._on_transition(old, new)
