"""Continuous batching: each step fills a token budget with decodes first, then prefill chunks."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from lm_engine.block_manager import BlockManager
from lm_engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # tokens [seq.num_computed_tokens, +num_tokens) run this step

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the sequence's last token, so its logits are sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        ready: Callable[[Sequence], bool] | None = None,
    ) -> None:
        self.bm = block_manager
        self.ready = ready  # False while a waiting sequence's images are still being encoded
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last is preempted first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def waiting_tokens(self) -> int:
        return sum(s.num_uncomputed for s in self.waiting)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        # Decodes first (one token each), so running requests keep streaming under prefill pressure.
        ordered = sorted(self.running, key=lambda s: s.num_uncomputed != 1)
        for seq in ordered:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_uncomputed, budget)
            end = seq.num_computed_tokens + n
            copies = self.bm.ensure_slots(seq, end)
            while copies is None:
                victim = self._pick_victim(exclude=scheduled)
                if victim is None or victim is seq:
                    self._preempt(seq, out)
                    break
                self._preempt(victim, out)
                copies = self.bm.ensure_slots(seq, end)
            if copies is None:
                continue
            out.block_copies.extend(copies)
            out.chunks.append(ScheduledChunk(seq, n))
            scheduled.add(seq.seq_id)
            budget -= n
        if out.preempted:
            return out  # memory is short: admit nothing new this step
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if self.ready is not None and not self.ready(seq):
                continue  # its images are still on the way; later requests may go first
            if not self.bm.can_allocate(seq, keep_watermark=bool(self.running)):
                break
            self.waiting.remove(seq)
            self.bm.allocate(seq)
            if not seq.first_admitted:
                seq.num_cached_tokens = seq.num_computed_tokens
                seq.first_admitted = True
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed, budget)
            out.chunks.append(ScheduledChunk(seq, n))
            budget -= n
        return out

    def _pick_victim(self, exclude: set[int]) -> Sequence | None:
        for seq in reversed(self.running):
            if seq.seq_id not in exclude:
                return seq
        return None

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Recompute-style preemption: free the blocks now; the prefix cache usually makes re-prefill cheap."""
        self.running.remove(seq)
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self.bm.free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
