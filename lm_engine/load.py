"""Load control: measures the load before and after every engine step and publishes it.

Before a step it reads the queued prefill work, KV use and recent TTFT, hands them to the visual budget
controller (which picks the level) and to the admission policy (which owns every refusal rule), and sets the
scheduler's prefill cap (the per-token latency target at the measured prefill rate); after it, it measures
the prefill the step did and publishes the admission state the next requests are judged by.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from lm_engine.admission import Admission, AdmissionPolicy
from lm_engine.block_manager import BlockManager
from lm_engine.config import EngineConfig
from lm_engine.scheduler import Scheduler
from lm_engine.sequence import Sequence
from lm_engine.visual_budget import BudgetSignals, PrefillRate, TTFTWindow, VisualBudgetController


class LoadControl:
    def __init__(
        self,
        config: EngineConfig,
        ladder: list[int],
        scheduler: Scheduler,
        block_manager: BlockManager,
        admission: Admission,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.clock = clock
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.admission = admission
        adaptive = config.visual_budget == "adaptive"
        slo = config.ttft_slo_ms / 1000
        self.visual_budget = VisualBudgetController(
            ladder=ladder,
            ttft_slo_s=slo,
            dwell_s=config.budget_dwell_s,
            enabled=adaptive,
            fixed_level=config.visual_level,
            clock=clock,
        )
        # admission by the SLO: as asked, else while the budget adapts
        sheds = adaptive if config.slo_admission is None else config.slo_admission
        self.policy = AdmissionPolicy(slo, sheds=sheds, adaptive=adaptive)
        self.ttft_window = TTFTWindow(window_s=5 * config.budget_dwell_s, clock=clock)
        self.prefill_rate = PrefillRate(horizon_s=5 * config.budget_dwell_s)
        self._queued_before = 0
        self._started = 0.0

    @property
    def ttft_slo_s(self) -> float:
        return self.policy.ttft_slo_s

    @ttft_slo_s.setter
    def ttft_slo_s(self, seconds: float) -> None:
        """One target for both readers of it (tests and benchmarks move it on a running engine)."""
        self.policy.ttft_slo_s = self.visual_budget.ttft_slo_s = seconds

    def before_step(self, busy: bool) -> None:
        self._queued_before, self._started = self.update(busy), self.clock()
        self.scheduler.prefill_cap = self._prefill_cap()

    def after_step(self, busy: bool) -> None:
        """``busy``: work is left; an idle engine is not updated again, so the controller must know now."""
        if self._queued_before >= self.config.max_num_batched_tokens:  # a step that could fill its budget
            # NOTE: no request is added during a step, so the queue's shrinkage is the prefill it did (prefix
            # cache hits included); a step that only waited for the encoder counts with 0 tokens.
            done = self._queued_before - self.queued_prefill_tokens()
            self.prefill_rate.observe(done, self.clock() - self._started)
        self.update(busy)

    def first_token(self, seconds: float) -> None:
        self.ttft_window.add(seconds)

    def _prefilling(self) -> Iterator[Sequence]:
        """The sequences with prompt tokens still to prefill: every waiting one, and the running ones not yet
        decoding (one token left is a decode)."""
        yield from self.scheduler.waiting
        yield from (s for s in self.scheduler.running if s.num_uncomputed > 1)

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens (visual included) still to prefill: the work ahead of a new request."""
        return sum(s.num_uncomputed for s in self._prefilling())

    def queued_by_client(self) -> dict[str, int]:
        """``queued_prefill_tokens`` per client (the scheduler's fairness key)."""
        out: dict[str, int] = {}
        for s in self._prefilling():
            if s.num_uncomputed:
                out[s.client_key] = out.get(s.client_key, 0) + s.num_uncomputed
        return out

    def update(self, busy: bool) -> int:
        """Measure, feed the controller and the admission policy, publish the admission state; returns the
        queued prefill tokens."""
        policy = self.policy
        by_client = self.queued_by_client() if policy.sheds else None  # one pass over the queue either way
        queued = sum(by_client.values()) if by_client is not None else self.queued_prefill_tokens()
        signals = BudgetSignals(
            queued_tokens=queued,
            token_budget=self.config.max_num_batched_tokens,
            kv_usage=self.block_manager.usage(),
            recent_ttft_s=self.ttft_window.percentile(0.9),
            prefill_tokens_per_s=self.prefill_rate.tokens_per_s,
            busy=busy,
        )
        self.visual_budget.update(signals, saturated=policy.observe(signals))
        # what the API side decides on until the next step (AdmissionState's notes)
        self.admission.state = policy.publish(signals, by_client)
        return queued

    def _prefill_cap(self) -> int | None:
        """Prefill tokens that fit the per-token target beside decodes, at the measured prefill rate.

        The rate is measured on such capped steps too, so the cap settles where a step's fixed cost plus its
        prefill fills the target (at least one block, so prefill always moves)."""
        slo, rate = self.config.tpot_slo_ms, self.prefill_rate.tokens_per_s
        if slo is None or rate is None:
            return None
        return max(self.config.block_size, int(rate * slo / 1000 * 0.8))

    def level_of(self, max_pixels: int | None) -> int:
        """The ladder level an image planned with ``max_pixels`` got (0: full resolution)."""
        ladder = self.visual_budget.ladder
        return ladder.index(max_pixels) if max_pixels in ladder else 0
