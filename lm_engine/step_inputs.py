"""One step's inputs: the flat token batch (decodes first, then prefill chunks), its positions, KV slots and
block tables, which rows take image embeddings, and which rows' logits are sampled. Gathered on the host
and copied to the device in one transfer; built once per step and shared by every layer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from cache import EmbeddingKey
from lm_engine.attention import AttentionMetadata
from lm_engine.device import to_device
from lm_engine.scheduler import ScheduledChunk, SchedulerOutput


@dataclass(slots=True)
class StepBatch:
    """Everything one forward pass needs."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    mm_rows: torch.Tensor | None  # rows of the flat batch that take image embedding rows ...
    mm_embeds: torch.Tensor | None  # ... and those rows, in the same order
    logit_rows: torch.Tensor  # flat index of each completing chunk's last token
    completing: list[ScheduledChunk]


def build_step(
    sched: SchedulerOutput,
    embeddings: Mapping[EmbeddingKey, torch.Tensor],
    block_size: int,
    device: torch.device,
) -> StepBatch:
    """``embeddings`` holds every image a chunk covers (the scheduler admits only such sequences); a chunk
    that cuts through an image takes the rows of its part."""
    host = _HostInputs(block_size)
    for chunk in sorted(sched.chunks, key=lambda c: c.num_tokens != 1):  # decodes first
        host.add(chunk, embeddings)
    return host.ship(device)


@dataclass(slots=True)
class _HostInputs:
    block_size: int
    ids: list[int] = field(default_factory=list)
    positions: list[torch.Tensor] = field(default_factory=list)
    slots: list[torch.Tensor] = field(default_factory=list)
    decode_tables: list[list[int]] = field(default_factory=list)
    decode_lens: list[int] = field(default_factory=list)
    spans: list[tuple[int, int, int]] = field(default_factory=list)  # (start in batch, length, context)
    span_tables: list[torch.Tensor] = field(default_factory=list)
    mm_rows: list[torch.Tensor] = field(default_factory=list)
    mm_embeds: list[torch.Tensor] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)
    completing: list[ScheduledChunk] = field(default_factory=list)

    def add(self, chunk: ScheduledChunk, embeddings: Mapping[EmbeddingKey, torch.Tensor]) -> None:
        seq, n, bs = chunk.seq, chunk.num_tokens, self.block_size
        start = seq.num_computed_tokens
        end, base = start + n, len(self.ids)
        self.ids.extend(seq.token_ids[start:end])
        self.positions.append(seq.position_rows(start, end))
        table = torch.tensor(seq.block_table, dtype=torch.long)
        j = torch.arange(start, end)
        self.slots.append(table[j // bs] * bs + j % bs)
        if n == 1:
            self.decode_tables.append(seq.block_table)
            self.decode_lens.append(end)
        else:
            self.spans.append((base, n, end))
            self.span_tables.append(table)
        for img in seq.images:
            lo, hi = max(start, img.offset), min(end, img.end)
            if lo < hi:
                self.mm_rows.append(torch.arange(base + lo - start, base + hi - start))
                rows = img.rows_from - img.offset
                self.mm_embeds.append(embeddings[img.key][lo + rows : hi + rows])
        if chunk.completes:
            self.logit_rows.append(base + n - 1)
            self.completing.append(chunk)

    def ship(self, device: torch.device) -> StepBatch:
        width = max((len(t) for t in self.decode_tables), default=1)
        tables = torch.zeros(len(self.decode_tables), width, dtype=torch.long)
        for i, t in enumerate(self.decode_tables):
            tables[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        slots = torch.cat(self.slots)
        host = [
            torch.tensor(self.ids, dtype=torch.long),
            torch.cat(self.positions, dim=1),
            slots,
            tables,
            torch.tensor(self.decode_lens, dtype=torch.long),
            torch.tensor(self.logit_rows, dtype=torch.long),
            torch.cat(self.mm_rows) if self.mm_rows else torch.zeros(0, dtype=torch.long),
            *self.span_tables,
        ]
        ids, positions, slot_mapping, tables, lens, logit_rows, mm_rows, *span_tables = _ship_together(
            host, device
        )
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            num_decode_tokens=len(self.decode_tables),
            decode_block_tables=tables.to(torch.int32),
            decode_context_lens=lens.to(torch.int32),
            prefill_spans=self.spans,
            prefill_block_tables=span_tables,
            max_decode_context=max(self.decode_lens, default=0),
            all_slots_written=bool((slots >= 0).all()),  # looked at once here, not by each layer's write
        )
        mm_embeds = torch.cat(self.mm_embeds) if self.mm_embeds else None
        mm_rows = mm_rows if self.mm_rows else None
        return StepBatch(ids, positions, meta, mm_rows, mm_embeds, logit_rows, self.completing)


def _ship_together(host: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``host`` (int64 tensors) packed into one buffer, copied to ``device`` once, and returned as views of
    the copy in their own shapes. Each part starts 64-byte aligned (kernels specialise on pointer alignment)."""
    sizes = [t.numel() for t in host]
    starts, total = [], 0
    for n in sizes:
        starts.append(total)
        total += -(-n // 8) * 8
    buf = torch.zeros(total, dtype=torch.long)
    for t, start, n in zip(host, starts, sizes):
        buf[start : start + n] = t.reshape(-1)
    buf = to_device(buf, device)
    return [buf[start : start + n].view(t.shape) for t, start, n in zip(host, starts, sizes)]
