"""The visual budget controller: under load, new images get fewer visual tokens instead of waiting.

Each engine step feeds it three pressures, each normalised so 1.0 means "at the limit":

- the queue: the time the queued prefill work (tokens, visual included) will take at the measured prefill
  throughput, against the share of the TTFT SLO queueing may use (``queue_share``); before any throughput
  is measured, the queued tokens against what ``drain_steps`` steps can process;
- KV-cache utilisation against ``kv_high``;
- recent time-to-first-token against the SLO (it lags: it only confirms what the queue predicted).

Their maximum steps the level down a ladder of ``max_pixels`` values when it stays above ``high`` for
``dwell_s``, and back up when it stays below ``low`` for ``dwell_s`` (hysteresis + dwell, so it does not
oscillate). Time counts as idle only while the engine reports no work queued or running: a long step under
load is not a quiet spell. The controller only picks levels: whether new work is refused is admission's
(lm_engine/admission.py). A queue whose expected wait exceeds the SLO saturates admission at any level, and
meanwhile the level keeps stepping down, so the requests after the queue cost less. Refusing keeps the queue
short, so a spell of saturation (``update``'s ``saturated``) counts as pressure above ``high`` for a dwell
after it: the queue it shortened is no sign that the load fell.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

QUEUE_SHARE = (
    0.5  # of the TTFT SLO, what queueing may take (the rest: preprocessing, a request's own prefill)
)


@dataclass(slots=True)
class BudgetSignals:
    queued_tokens: int  # uncomputed prompt tokens (visual included) of waiting + prefilling requests
    token_budget: int  # max_num_batched_tokens
    kv_usage: float  # 0..1
    # A high percentile of recent TTFTs, None when none yet (counts only with a queue).
    recent_ttft_s: float | None
    prefill_tokens_per_s: float | None = None  # measured prefill throughput, None before any was measured
    busy: bool = True  # work is queued or running; False once the engine has nothing left to do

    @property
    def expected_wait_s(self) -> float | None:
        """How long the queued prefill work takes at the measured throughput (None: not measured yet)."""
        if not self.prefill_tokens_per_s:
            return None
        return self.queued_tokens / self.prefill_tokens_per_s


@dataclass(slots=True)
class VisualBudgetController:
    ladder: list[int]  # max_pixels per level, level 0 = full resolution
    ttft_slo_s: float  # EngineConfig.ttft_slo_ms's, through LoadControl
    high: float = 1.0
    low: float = 0.5
    dwell_s: float = 1.0
    queue_share: float = QUEUE_SHARE
    drain_steps: int = 8  # the token-based queue pressure's horizon, before any throughput is measured
    kv_high: float = 0.9
    enabled: bool = True
    fixed_level: int = 0  # what detail="auto" gets while disabled (0 = full resolution)
    clock: Callable[[], float] = time.monotonic
    level: int = 0
    pressure: float = 0.0
    _above_since: float | None = None
    _below_since: float | None = None
    _changed_at: float = field(default=float("-inf"))
    _idle_since: float | None = None  # set by an update reporting no work; cleared by one reporting work
    _saturated_at: float | None = None  # the last update at which admission found the queue saturated
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
        if not 0 < self.queue_share <= 1:
            raise ValueError("need 0 < queue_share <= 1")
        if not 0 <= self.fixed_level < len(self.ladder):
            raise ValueError(
                f"fixed_level {self.fixed_level} is not a level of the ladder (0..{self.lowest})"
            )

    @property
    def lowest(self) -> int:
        return len(self.ladder) - 1

    def max_pixels(self, detail: str | None = "auto") -> int:
        """The budget a new image gets: ``low`` always the lowest level, ``high`` always the maximum, ``auto``
        the controller's level (``fixed_level`` while it is disabled)."""
        return self.ladder[self.level_for(detail)]

    def level_for(self, detail: str | None = "auto") -> int:
        if detail == "low":
            return self.lowest
        if detail == "high":
            return 0
        if not self.enabled:
            return self.fixed_level
        return self._effective_level()

    def _effective_level(self) -> int:
        """The level, read without an update: an idle engine is not updated, and each whole dwell it has
        spent with nothing queued or running counts as a dwell without pressure."""
        since = self._idle_since
        if since is None:
            return self.level
        return max(0, self.level - int((self.clock() - since) / self.dwell_s))

    def compute_pressure(self, s: BudgetSignals) -> float:
        wait = s.expected_wait_s
        if wait is not None:
            queue = wait / (self.ttft_slo_s * self.queue_share)
        else:
            queue = s.queued_tokens / max(1, s.token_budget * self.drain_steps)
        kv = s.kv_usage / self.kv_high
        # NOTE: TTFT lags; once nothing is queued, a slow burst that just ended is no reason to stay low.
        ttft = s.recent_ttft_s / self.ttft_slo_s if s.recent_ttft_s is not None and s.queued_tokens else 0.0
        return max(queue, kv, ttft)

    def update(self, signals: BudgetSignals, saturated: bool = False) -> int:
        """Feed one step's signals and whether admission found the queue saturated after it
        (:meth:`~lm_engine.admission.AdmissionPolicy.observe`); returns the (possibly new) level."""
        now = self.clock()
        if not signals.busy:
            # NOTE: the engine stops updating while idle; _effective_level counts the quiet spell from here.
            self.pressure, self._saturated_at = 0.0, None
            if self._idle_since is None:
                self._idle_since = now
                self._above_since = None
                self._below_since = self._below_since or now
            return self._effective_level()
        if self._idle_since is not None:
            if (level := self._effective_level()) != self.level:
                self._set(level, now)
            self._idle_since = None
        p = self.pressure = self.compute_pressure(signals)
        if saturated:
            self._saturated_at = now
        if not self.enabled:
            return self.level
        # NOTE: while it sheds, admission control keeps the queue short, and right after each refusal spell
        # the queue reads in the band or below it although more work is offered than the engine takes. Under
        # a burst at 2x the sustainable rate (benchmarks/quality_vs_budget.py, demo model) the pressure ran
        # as a sawtooth between ~0.3-0.9 and ~2 a few times a second, never a whole dwell above ``high``, and
        # in some runs the level never left 0 (those runs' rate of correct answers within the SLOs: that of
        # a fixed budget with admission control). Saturation within the last dwell counts as pressure.
        shed_lately = self._saturated_at is not None and now - self._saturated_at < self.dwell_s
        if p > self.high or shed_lately:
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

    def _set(self, level: int, now: float) -> None:
        # NOTE: pressure seen past the threshold that moved the level counts from the change on, so with
        # updates further apart than a dwell (long steps) the level moves once per update, not every other.
        down = level > self.level
        self._above_since, self._below_since = (now, None) if down else (None, now)
        self.level = level
        self._changed_at = now
        self.history.append((now, level))


def default_ladder(max_pixels: int, min_pixels: int, factor: int = 28) -> list[int]:
    """100 % / 50 % / 25 % / the model's minimum (deduplicated, descending); the middle levels are whole
    numbers of the model's ``factor``-px tokens (28 px for Qwen2-VL, 32 px for Qwen3-VL)."""
    token = factor * factor
    levels = [max_pixels, max_pixels // 2 // token * token, max_pixels // 4 // token * token, min_pixels]
    out: list[int] = []
    for v in levels:
        v = max(v, min_pixels)
        if not out or v < out[-1]:
            out.append(v)
    return out


# A video's own ladder: (frame-rate scale, pixel-budget scale) per level, level 0 the request's (or the server's)
# fps and max_pixels. Frames go first: neighbouring frames repeat each other more than neighbouring pixels do.
# Visual tokens per level, relative to level 0: 1, 1/2, 1/4, 1/16 (the sampler keeps at least min_frames).
DEFAULT_VIDEO_LADDER: tuple[tuple[float, float], ...] = ((1.0, 1.0), (0.5, 1.0), (0.5, 0.5), (0.25, 0.25))


@dataclass(frozen=True, slots=True)
class VideoBudget:
    """What a new video gets at one level of the video ladder."""

    level: int
    fps_scale: float
    pixels_scale: float


def video_budget(
    controller: VisualBudgetController,
    detail: str | None = "auto",
    ladder: tuple[tuple[float, float], ...] = DEFAULT_VIDEO_LADDER,
) -> VideoBudget:
    """The controller's level read on the video ladder: ``low`` its lowest rung, ``high`` its first, ``auto`` the
    image level of the moment (capped at the video ladder's lowest)."""
    level = len(ladder) - 1 if detail == "low" else min(controller.level_for(detail), len(ladder) - 1)
    return VideoBudget(level, *ladder[level])


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


class PrefillRate:
    """Measured prefill throughput in tokens/s over roughly the last ``horizon_s`` seconds of observed steps:
    decayed sums of the tokens prefilled and of the seconds taken, each step weighing by its length.

    The engine observes only steps that had at least a full token budget queued, so a short queue (which
    leaves a step's budget unused) does not pass for low throughput. A step that then waited on the
    encoder counts with 0 tokens: encoder time shows in the rate wherever it is what holds prefill back."""

    def __init__(self, horizon_s: float = 5.0) -> None:
        self.horizon_s = horizon_s
        self._tokens = 0.0
        self._seconds = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        seconds = max(0.0, seconds)
        keep = math.exp(-seconds / self.horizon_s)
        self._tokens = self._tokens * keep + max(0, tokens)
        self._seconds = self._seconds * keep + seconds

    @property
    def tokens_per_s(self) -> float | None:
        """None until a step prefilled something: no throughput known, rather than an infinite wait."""
        return self._tokens / self._seconds if self._seconds > 0 and self._tokens > 0 else None
