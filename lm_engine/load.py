"""Load control: the visual budget controller fed before and after every engine step.

Before a step it reads the queued prefill work, KV use and recent TTFT, moves the visual budget level and
sets the scheduler's prefill cap (the per-token latency target at the measured prefill rate); after it, it
measures the prefill the step did and publishes the admission state the next requests are judged by.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from types import MappingProxyType

from lm_engine.admission import Admission, AdmissionState, queue_ahead_reason
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
        self.visual_budget = VisualBudgetController(
            ladder=ladder,
            ttft_slo_s=config.ttft_slo_ms / 1000,
            dwell_s=config.budget_dwell_s,
            enabled=config.visual_budget == "adaptive",
            fixed_level=config.visual_level,
            shed=config.slo_admission,
            clock=clock,
        )
        self.ttft_window = TTFTWindow(window_s=5 * config.budget_dwell_s, clock=clock)
        self.prefill_rate = PrefillRate(horizon_s=5 * config.budget_dwell_s)
        self._queued_before = 0
        self._started = 0.0

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
        """Feed the controller and publish the admission state; returns the queued prefill tokens."""
        vb = self.visual_budget
        by_client = self.queued_by_client() if vb.sheds else None  # one pass over the queue either way
        queued = sum(by_client.values()) if by_client is not None else self.queued_prefill_tokens()
        vb.update(
            BudgetSignals(
                queued_tokens=queued,
                token_budget=self.config.max_num_batched_tokens,
                kv_usage=self.block_manager.usage(),
                recent_ttft_s=self.ttft_window.percentile(0.9),
                prefill_tokens_per_s=self.prefill_rate.tokens_per_s,
                busy=busy,
            )
        )
        wait = vb.expected_wait_s
        reason = queue_ahead_reason(wait, vb.ttft_slo_s) if vb.saturated else None
        state = AdmissionState(vb.saturated, self._retry_after(queued), reason, wait)
        if by_client is not None:  # what the API side decides on until the next step (AdmissionState's notes)
            state = dataclasses.replace(
                state,
                queued_by_client=MappingProxyType(by_client),
                prefill_tokens_per_s=self.prefill_rate.tokens_per_s,
                admit_within_s=vb.shed_low * vb.ttft_slo_s,
                ttft_slo_s=vb.ttft_slo_s,
                # NOTE: with the adaptive budget the queue is the ladder's signal too. Counting a request's own
                # prefill there refused more, the shorter queue hid the load, and the ladder stepped back up
                # mid-burst: 74 and 77 of 96 requests within the SLOs against 85 and 83 without
                # (benchmarks/visual_budget.py, 2 s SLO, 2026-12-05). With a fixed budget only admission reads it.
                own_from_s=None if vb.enabled else vb.queue_share * vb.ttft_slo_s,
            )
        self.admission.state = state
        return queued

    def _prefill_cap(self) -> int | None:
        """Prefill tokens that fit the per-token target beside decodes, at the measured prefill rate.

        The rate is measured on such capped steps too, so the cap settles where a step's fixed cost plus its
        prefill fills the target (at least one block, so prefill always moves)."""
        slo, rate = self.config.tpot_slo_ms, self.prefill_rate.tokens_per_s
        if slo is None or rate is None:
            return None
        return max(self.config.block_size, int(rate * slo / 1000 * 0.8))

    def _retry_after(self, queued_tokens: int) -> float:
        """Whole seconds until what is queued now has been prefilled, at the measured throughput."""
        rate = self.prefill_rate.tokens_per_s
        if rate is None:  # nothing measured yet: a rough 50 ms per full step
            wait = queued_tokens / max(1, self.config.max_num_batched_tokens) * 0.05
        else:
            wait = queued_tokens / rate
        return float(max(1, min(60, math.ceil(wait))))

    def level_of(self, max_pixels: int | None) -> int:
        """The ladder level an image planned with ``max_pixels`` got (0: full resolution)."""
        ladder = self.visual_budget.ladder
        return ladder.index(max_pixels) if max_pixels in ladder else 0
