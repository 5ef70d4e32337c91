"""The visual budget controller: under load, new images get fewer visual tokens instead of waiting.

Each engine step feeds it three pressures, each normalised so 1.0 means "at the limit":
queued prefill work (tokens, visual included) against what ``drain_steps`` steps can process, KV-cache
utilisation against ``kv_high``, and recent time-to-first-token against the SLO. Their maximum steps
the level down a ladder of ``max_pixels`` values when it stays above ``high`` for ``dwell_s``, and back
up when it stays below ``low`` for ``dwell_s`` (hysteresis + dwell, so it does not oscillate).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class BudgetSignals:
    queued_tokens: int  # uncomputed prompt tokens of waiting + prefilling requests
    token_budget: int  # max_num_batched_tokens
    kv_usage: float  # 0..1
    recent_ttft_s: (
        float | None
    )  # a high percentile of recent TTFTs, None when none yet (counts only with a queue)


@dataclass(slots=True)
class VisualBudgetController:
    ladder: list[int]  # max_pixels per level, level 0 = full resolution
    ttft_slo_s: float = 2.0
    high: float = 1.0
    low: float = 0.5
    dwell_s: float = 1.0
    drain_steps: int = 8
    kv_high: float = 0.9
    enabled: bool = True
    clock: Callable[[], float] = time.monotonic
    level: int = 0
    pressure: float = 0.0
    _above_since: float | None = None
    _below_since: float | None = None
    _changed_at: float = field(default=float("-inf"))
    _last_update: float | None = None  # the last update(); a long gap means the engine sat idle
    history: deque = field(default_factory=lambda: deque(maxlen=512))  # (time, level) on each change

    def __post_init__(self) -> None:
        if (
            not self.ladder
            or any(b <= 0 for b in self.ladder)
            or sorted(self.ladder, reverse=True) != self.ladder
        ):
            raise ValueError(f"the max_pixels ladder must be positive and descending, got {self.ladder}")
        if not 0 <= self.low < self.high:
            raise ValueError("need 0 <= low < high")

    @property
    def lowest(self) -> int:
        return len(self.ladder) - 1

    def max_pixels(self, detail: str | None = "auto") -> int:
        """The budget a new image gets: ``low`` always the lowest level, ``high`` always the maximum."""
        return self.ladder[self.level_for(detail)]

    def level_for(self, detail: str | None = "auto") -> int:
        if detail == "low":
            return self.lowest
        if detail == "high" or not self.enabled:
            return 0
        return self._effective_level()

    def _idle_for(self) -> float:
        return 0.0 if self._last_update is None else self.clock() - self._last_update

    def _effective_level(self) -> int:
        """The level, read without an update: an engine idle for whole dwells has had no pressure."""
        idle = self._idle_for()
        return max(0, self.level - int(idle / self.dwell_s)) if idle >= self.dwell_s else self.level

    def compute_pressure(self, s: BudgetSignals) -> float:
        queue = s.queued_tokens / max(1, s.token_budget * self.drain_steps)
        kv = s.kv_usage / self.kv_high
        # NOTE: TTFT lags; once nothing is queued, a slow burst that just ended is no reason to stay low.
        ttft = s.recent_ttft_s / self.ttft_slo_s if s.recent_ttft_s is not None and s.queued_tokens else 0.0
        return max(queue, kv, ttft)

    def update(self, signals: BudgetSignals) -> int:
        """Feed one step's signals; returns the (possibly new) level."""
        now = self.clock()
        if self.enabled and self._idle_for() >= self.dwell_s:
            # NOTE: an idle engine is not updated; a whole quiet spell counts as time without pressure.
            self._above_since = self._below_since = None
            if (level := self._effective_level()) != self.level:
                self._set(level, now)
        self._last_update = now
        p = self.pressure = self.compute_pressure(signals)
        if not self.enabled:
            return self.level
        if p > self.high:
            self._above_since = self._above_since or now
            self._below_since = None
        elif p < self.low:
            self._below_since = self._below_since or now
            self._above_since = None
        else:
            self._above_since = self._below_since = None
        settled = now - self._changed_at >= self.dwell_s
        if settled and self._above_since is not None and now - self._above_since >= self.dwell_s:
            if self.level < self.lowest:
                self._set(self.level + 1, now)
        elif (
            settled
            and self.level > 0
            and self._below_since is not None
            and now - self._below_since >= self.dwell_s
        ):
            self._set(self.level - 1, now)
        return self.level

    @property
    def saturated(self) -> bool:
        """At the lowest level and still over pressure for a whole dwell: shedding is the only tool left."""
        return (
            self.enabled
            and self._idle_for() < self.dwell_s
            and self.level == self.lowest
            and self._above_since is not None
            and self.clock() - max(self._above_since, self._changed_at) >= self.dwell_s
        )

    def _set(self, level: int, now: float) -> None:
        self.level = level
        self._changed_at = now
        self._above_since = self._below_since = None
        self.history.append((now, level))


def default_ladder(max_pixels: int, min_pixels: int) -> list[int]:
    """100 % / 50 % / 25 % / the model's minimum (deduplicated, descending)."""
    levels = [max_pixels, max_pixels // 2, max_pixels // 4, min_pixels]
    out: list[int] = []
    for v in levels:
        v = max(v, min_pixels)
        if not out or v < out[-1]:
            out.append(v)
    return out


class TTFTWindow:
    """Recent time-to-first-token samples; ``percentile`` over the last ``window_s`` seconds."""

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, ttft_s: float) -> None:
        self._samples.append((self.clock(), ttft_s))

    def percentile(self, q: float = 0.9) -> float | None:
        cutoff = self.clock() - self.window_s
        while self._samples and self._samples[0][0] < cutoff:
            self._samples.popleft()
        if not self._samples:
            return None
        values = sorted(v for _, v in self._samples)
        return values[min(len(values) - 1, int(q * len(values)))]
