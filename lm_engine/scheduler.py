"""Continuous batching: each step fills a token budget with decodes first, then prefill chunks."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from lm_engine.block_manager import BlockManager
from lm_engine.sequence import Sequence, SequenceStatus
from lm_engine.step_budget import ClientUsage, StepBudget


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
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.bm = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.usage = ClientUsage()
        self.waiting: deque[Sequence] = deque()  # arrival order; WAITING_FOR_IMAGES ones are skipped
        self.running: list[Sequence] = []  # admission order: the last is preempted first
        self.num_preemptions = 0
        # Prefill tokens a step may carry beside decodes (None: the whole budget); the engine's load control
        # sets it from the per-token latency target and the measured prefill rate.
        self.prefill_cap: int | None = None
        self._in_flight: set[bytes] = set()  # hashes of the full blocks running requests are computing

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.usage.step()
        budget = StepBudget(self.max_num_batched_tokens, self.prefill_cap, self.bm.block_size)
        # Decodes first, one token each, so running requests keep streaming under prefill pressure.
        for seq in [s for s in self.running if s.num_uncomputed == 1]:
            if budget.tokens <= 0:
                break
            if seq.status is SequenceStatus.RUNNING and self._grow(seq, 1, out):  # not preempted meanwhile
                budget.tokens -= 1
        if out.preempted:
            return out  # memory is short: admit nothing new this step
        # Then prefill chunks, running prompts before new admissions, the least-served client first, each
        # client within its fair share of what the decodes left.
        candidates = self._prefill_candidates()
        budget.plan_prefill(candidates, with_decodes=bool(out.chunks))
        for seq in candidates:
            n = budget.grant(seq.client_key, seq.num_uncomputed)
            if n <= 0 or seq in out.preempted:
                continue
            if seq.status is SequenceStatus.WAITING and not self._admit(seq):
                break  # no room: later arrivals would not fit either
            n = min(n, seq.num_uncomputed)  # the prefix cache may have served part of it
            if seq.status is SequenceStatus.RUNNING and self._grow(seq, n, out):
                budget.spend(seq.client_key, n)
        for chunk in out.chunks:
            self.usage.record(chunk.seq.client_key, chunk.num_tokens)
        return out

    def _prefill_candidates(self) -> list[Sequence]:
        """Running prompts, then the waiting sequences that may be admitted (ready, not waiting for a prefix
        another request is computing, within max_num_seqs)."""
        running = [s for s in self.running if s.num_uncomputed > 1 and s.status is SequenceStatus.RUNNING]
        self._in_flight = self.bm.blocks_in_flight(self.running)
        room = self.max_num_seqs - len(self.running)
        waiting = [
            s for s in self.waiting if s.status is SequenceStatus.WAITING and not self._prefix_in_flight(s)
        ]
        return sorted(running, key=self._served) + sorted(waiting[: max(0, room)], key=self._served)

    def _prefix_in_flight(self, seq: Sequence, hits: list[int] | None = None) -> bool:
        """Whether the next block past ``seq``'s cached prefix is being computed by a running request now."""
        if not self._in_flight:
            return False
        hits = self.bm.lookup(seq) if hits is None else hits
        return self.bm.next_block_hash(seq, len(hits)) in self._in_flight

    def _served(self, seq: Sequence) -> float:
        return self.usage.of(seq.client_key)

    def _admit(self, seq: Sequence) -> bool:
        """Give a waiting sequence its blocks (prefix hits first); False if the pool has no room for it.

        Two reasons leave it waiting (True: neither is a reason to stop admitting others):
        - the next block past its cached prefix is being computed right now by a running request (the same
          page asked about twice at once): it takes that block from the cache once committed, instead of
          computing it a second time;
        - NOTE: its images were made ready for the prefix the cache held then; if an admission earlier in
          this step evicted part of it, the images past what is left are not encoded: it goes back to
          waiting for them."""
        hits = self.bm.lookup(seq)
        if self._prefix_in_flight(seq, hits):  # a candidate before it in this step computes it
            return True
        if len(hits) * self.bm.block_size < seq.images_ready_after:
            seq.status = SequenceStatus.WAITING_FOR_IMAGES
            return True
        if not self.bm.can_allocate(seq, hits, keep_watermark=bool(self.running)):
            return False
        self.waiting.remove(seq)
        self.bm.allocate(seq, hits)
        self._in_flight |= self.bm.blocks_in_flight([seq])
        if not seq.first_admitted:
            seq.num_cached_tokens = seq.num_computed_tokens
            seq.first_admitted = True
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return True

    def _grow(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Schedule ``n`` tokens of a running sequence, preempting later arrivals if blocks run out."""
        end = seq.num_computed_tokens + n
        copies = self.bm.ensure_slots(seq, end)
        while copies is None:
            victim = self._pick_victim(exclude={c.seq.seq_id for c in out.chunks})
            if victim is None or victim is seq:
                self._preempt(seq, out)
                return False
            self._preempt(victim, out)
            copies = self.bm.ensure_slots(seq, end)
        out.block_copies.extend(copies)
        out.chunks.append(ScheduledChunk(seq, n))
        return True

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
