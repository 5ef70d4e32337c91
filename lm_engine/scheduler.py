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
        # Recent tokens scheduled per client (decayed each step): prefill goes to the least-served first.
        self.served: dict[str, float] = {}
        self.fairness_decay = 0.97
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last is preempted first
        self.num_preemptions = 0
        # Prefill tokens a step may carry beside decodes (None: the whole budget); the engine sets it from the
        # per-token latency target and the measured prefill rate.
        self.prefill_cap_with_decodes: int | None = None

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def waiting_tokens(self) -> int:
        return sum(s.num_uncomputed for s in self.waiting)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._decay_served()
        scheduled: set[int] = set()
        # Decodes first (one token each), so running requests keep streaming under prefill pressure.
        budget = self.max_num_batched_tokens
        for seq in [s for s in self.running if s.num_uncomputed == 1]:
            if budget <= 0:
                break
            if seq.status is SequenceStatus.RUNNING and self._grow(seq, 1, out, scheduled):
                budget -= 1
        if out.preempted:
            return out  # memory is short: admit nothing new this step
        if out.chunks and self.prefill_cap_with_decodes is not None:
            budget = min(budget, self.prefill_cap_with_decodes)  # streams wait for this step's prefill
        # Prefill: each client with prefill work gets an equal share first (least-served first) ...
        share, used = self._client_share(budget), {}
        chunk_of: dict[int, ScheduledChunk] = {}
        for seq in sorted(self._prefilling(), key=self._served_of):
            n = min(seq.num_uncomputed, budget, share - used.get(seq.client_key, 0))
            if n > 0 and self._grow(seq, n, out, scheduled):
                chunk_of[seq.seq_id] = out.chunks[-1]
                used[seq.client_key] = used.get(seq.client_key, 0) + n
                budget -= n
        for seq in sorted(self.waiting, key=self._served_of):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            n = min(seq.num_uncomputed, budget, share - used.get(seq.client_key, 0))
            if n <= 0:
                continue
            if self.ready is not None and not self.ready(seq):
                continue  # its images are still on the way; later requests may go first
            if not self.bm.can_allocate(seq, keep_watermark=bool(self.running)):
                break
            self._admit(seq)
            n = min(seq.num_uncomputed, n)  # the prefix cache may have served part of it
            out.chunks.append(ScheduledChunk(seq, n))
            chunk_of[seq.seq_id] = out.chunks[-1]
            used[seq.client_key] = used.get(seq.client_key, 0) + n
            budget -= n
        # ... then whatever budget is left goes to the prefill work that wants more (work-conserving).
        for seq in self._prefilling():
            if budget <= 0:
                break
            chunk = chunk_of.get(seq.seq_id)
            extra = min(seq.num_uncomputed - (chunk.num_tokens if chunk else 0), budget)
            if extra <= 0:
                continue
            if chunk is not None:
                chunk.num_tokens += extra
            elif not self._grow(seq, extra, out, scheduled):
                continue
            budget -= extra
        for chunk in out.chunks:
            key = chunk.seq.client_key
            self.served[key] = self.served.get(key, 0.0) + chunk.num_tokens
        return out

    def _prefilling(self) -> list[Sequence]:
        return [s for s in self.running if s.num_uncomputed > 1 and s.status is SequenceStatus.RUNNING]

    def _served_of(self, seq: Sequence) -> float:
        return self.served.get(seq.client_key, 0.0)

    def _decay_served(self) -> None:
        for client in list(self.served):
            self.served[client] *= self.fairness_decay
            if self.served[client] < 1:
                del self.served[client]

    def _client_share(self, prefill_budget: int) -> int:
        """With several clients wanting prefill, each first gets an equal share of the step's budget."""
        clients = {s.client_key for s in self._prefilling()}
        clients.update(s.client_key for s in self.waiting)
        if len(clients) <= 1:
            return self.max_num_batched_tokens
        return max(self.bm.block_size, prefill_budget // len(clients))

    def _grow(self, seq: Sequence, n: int, out: SchedulerOutput, scheduled: set[int]) -> bool:
        """Schedule ``n`` tokens of a running sequence, preempting later arrivals if blocks run out."""
        end = seq.num_computed_tokens + n
        copies = self.bm.ensure_slots(seq, end)
        while copies is None:
            victim = self._pick_victim(exclude=scheduled)
            if victim is None or victim is seq:
                self._preempt(seq, out)
                return False
            self._preempt(victim, out)
            copies = self.bm.ensure_slots(seq, end)
        out.block_copies.extend(copies)
        out.chunks.append(ScheduledChunk(seq, n))
        scheduled.add(seq.seq_id)
        return True

    def _admit(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        self.bm.allocate(seq)
        if not seq.first_admitted:
            seq.num_cached_tokens = seq.num_computed_tokens
            seq.first_admitted = True
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

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
