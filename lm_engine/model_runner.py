"""Owns the weights and the paged KV cache; turns a scheduled step into one forward pass."""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass
from pathlib import Path

import torch

from lm_engine.attention import AttentionMetadata, get_backend
from lm_engine.device import DeviceBinding, synchronize, to_device
from lm_engine.models.qwen2_vl import Qwen2VLConfig, Qwen2VLDecoder, VisionTower
from lm_engine.scheduler import ScheduledChunk, SchedulerOutput

log = logging.getLogger("vlmserve.engine")


@dataclass(slots=True)
class StepBatch:
    """Everything one forward pass needs, built once per step."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    mm_rows: torch.Tensor | None
    mm_embeds: torch.Tensor | None
    logit_rows: torch.Tensor  # flat index of each completing chunk's last token
    completing: list[ScheduledChunk]


def _rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        cfg: Qwen2VLConfig,
        *,
        dtype: torch.dtype,
        device: str,
        block_size: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        max_num_seqs: int,
        num_kv_blocks: int | None,
        kv_cache_memory: int | None,
        memory_utilization: float,
        attention_backend: str,
        warmup_image_patches: int,
    ) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = block_size
        self.bind_thread = DeviceBinding(self.device)
        self.bind_thread()
        self._encoder_stream: torch.cuda.Stream | None = None
        with torch.device(self.device):
            self.model = Qwen2VLDecoder(cfg).to(dtype)
        self.model.load_weights(model_dir)
        self.model.eval()
        self.vision = VisionTower(cfg, dtype).to(self.device)
        self.vision.load_weights(model_dir)
        self.vision.eval()
        self.backend = get_backend(device, attention_backend)
        log.info("attention backend: %s (asked for %s)", self.backend.name, attention_backend)
        self.num_blocks = self._size_kv_pool(
            num_kv_blocks,
            kv_cache_memory,
            memory_utilization,
            max_num_batched_tokens,
            max_model_len,
            max_num_seqs,
            warmup_image_patches,
        )
        shape = (cfg.num_hidden_layers, 2, self.num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        # NOTE: zeroed, not empty: padded decode gathers read unused slots, and 0·NaN would poison them.
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(cfg.num_hidden_layers)]
        self.backend.warmup(*self.kv_caches[0], cfg.num_attention_heads, max_model_len)

    # -- sizing ------------------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        c = self.cfg
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return c.num_hidden_layers * 2 * self.block_size * c.num_key_value_heads * c.head_dim * itemsize

    @torch.no_grad()
    def _size_kv_pool(
        self,
        num_kv_blocks,
        kv_cache_memory,
        utilization,
        max_tokens,
        max_model_len,
        max_num_seqs,
        warmup_image_patches,
    ) -> int:
        per_block = self.kv_bytes_per_block()
        useful = max_num_seqs * ((max_model_len + self.block_size - 1) // self.block_size) + 1
        if num_kv_blocks is not None:
            return int(num_kv_blocks)
        peak = self._warmup_peak(max_tokens, warmup_image_patches)
        if kv_cache_memory is not None:
            budget = int(kv_cache_memory)
        elif self.device.type == "cuda":
            # NOTE: the warm-up's freed blocks sit in the caching allocator, where mem_get_info counts them used.
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * utilization) - (total - free) - peak
        else:
            # CPU: a share of what the machine has left after weights and the warm-up's peak.
            budget = min(int(_available_memory_bytes() * utilization) - peak, 4 << 30)
        blocks = min(max(budget // per_block, 0), useful)
        min_blocks = (max_model_len + self.block_size - 1) // self.block_size + 1
        if blocks < min_blocks:
            raise RuntimeError(
                f"KV cache budget {budget / 2**20:.0f} MiB holds {blocks} blocks, fewer than one "
                f"max_model_len={max_model_len} sequence needs ({min_blocks}); lower --max-model-len"
            )
        log.info(
            "KV cache: %d blocks × %d tokens (%.1f MiB), warm-up peak %.1f MiB",
            blocks,
            self.block_size,
            blocks * per_block / 2**20,
            peak / 2**20,
        )
        return int(blocks)

    def _warmup_peak(self, max_tokens: int, image_patches: int) -> int:
        """Run the worst-case step (a full token budget + the largest image) and measure its extra memory."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        else:
            base = _rss_peak_bytes()
        if image_patches:
            merge = self.cfg.spatial_merge_size
            side = max(merge, int(image_patches**0.5) // merge * merge)
            dim = (
                3
                * int(self.cfg.vision.get("temporal_patch_size", 2))
                * int(self.cfg.vision.get("patch_size", 14)) ** 2
            )
            pixels = torch.zeros(side * side, dim, device=self.device)
            self.vision(pixels, torch.tensor([[1, side, side]], device=self.device))
            del pixels
        n_blocks = (max_tokens + self.block_size - 1) // self.block_size
        c = self.cfg
        caches = [
            (
                torch.zeros(
                    n_blocks,
                    self.block_size,
                    c.num_key_value_heads,
                    c.head_dim,
                    dtype=self.dtype,
                    device=self.device,
                ),
            )
            * 2
            for _ in range(c.num_hidden_layers)
        ]
        meta = AttentionMetadata(
            slot_mapping=torch.arange(max_tokens, device=self.device),
            num_decode_tokens=0,
            decode_block_tables=torch.zeros(0, 1, dtype=torch.int32, device=self.device),
            decode_context_lens=torch.zeros(0, dtype=torch.int32, device=self.device),
            prefill_spans=[(0, max_tokens, max_tokens)],
            prefill_block_tables=[torch.arange(n_blocks, device=self.device)],
        )
        ids = torch.zeros(max_tokens, dtype=torch.long, device=self.device)
        pos = torch.arange(max_tokens, device=self.device).expand(3, -1)
        hidden = self.model(ids, pos, caches, meta, self.backend)
        self.model.compute_logits(hidden[-1:])
        del caches, hidden
        if cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - base
        return max(0, _rss_peak_bytes() - base)

    # -- vision ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """One varlen vision-tower pass over several images' patches; rows of all images, in order, on the
        engine's device (they stay there: the decoder reads them from it).

        On CUDA the pass runs on a stream of its own, so it overlaps the decode steps; the host patches are
        staged in pinned memory (the caller's array is free again once this returns) and this thread, not the
        engine's stream, waits for the result."""
        self.bind_thread()
        if self.device.type != "cuda":
            return self.vision(pixels, grid_thw)
        if self._encoder_stream is None:
            self._encoder_stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._encoder_stream):
            rows = self.vision(to_device(pixels, self.device), to_device(grid_thw, self.device))
            done = self._encoder_stream.record_event()
        done.synchronize()
        # NOTE: the rows were allocated on the encoder stream and are read on the default one from here on.
        rows.record_stream(torch.cuda.default_stream(self.device))
        return rows

    # -- one step ----------------------------------------------------------------------------------------
    def build_batch(self, sched: SchedulerOutput) -> StepBatch:
        """The step's inputs, gathered on the host and copied to the device in one transfer."""
        bs, dev = self.block_size, self.device
        chunks = sorted(sched.chunks, key=lambda c: c.num_tokens != 1)  # decodes first
        ids: list[int] = []
        pos: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        dec_tables, dec_lens = [], []
        spans, span_tables = [], []
        mm_rows, mm_embeds = [], []
        logit_rows, completing = [], []
        for chunk in chunks:
            seq, n = chunk.seq, chunk.num_tokens
            start = seq.num_computed_tokens
            end = start + n
            base = len(ids)
            ids.extend(seq.token_ids[start:end])
            pos.append(seq.position_rows(start, end))
            table = torch.tensor(seq.block_table, dtype=torch.long)
            j = torch.arange(start, end)
            slots.append(table[j // bs] * bs + j % bs)
            if n == 1:
                dec_tables.append(seq.block_table)
                dec_lens.append(end)
            else:
                spans.append((base, n, end))
                span_tables.append(table)
            for img in seq.images:
                lo, hi = max(start, img.offset), min(end, img.offset + img.length)
                if lo < hi:
                    assert img.embedding is not None, "image rows scheduled before the image was encoded"
                    if img.embedding.device != dev:  # an embedding read back from Redis: moved once
                        img.embedding = to_device(img.embedding, dev)
                    mm_rows.append(torch.arange(base + lo - start, base + hi - start))
                    mm_embeds.append(img.embedding[lo - img.offset : hi - img.offset])
            if chunk.completes:
                logit_rows.append(base + n - 1)
                completing.append(chunk)
        max_blocks = max((len(t) for t in dec_tables), default=1)
        dec_block_tables = torch.zeros(len(dec_tables), max_blocks, dtype=torch.long)
        for i, t in enumerate(dec_tables):
            dec_block_tables[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        host = [
            torch.tensor(ids, dtype=torch.long),
            torch.cat(pos, dim=1),
            torch.cat(slots),
            dec_block_tables,
            torch.tensor(dec_lens, dtype=torch.long),
            torch.tensor(logit_rows, dtype=torch.long),
            torch.cat(mm_rows) if mm_rows else torch.zeros(0, dtype=torch.long),
            *span_tables,
        ]
        input_ids, positions, slot_mapping, tables, lens, logit_index, mm_index, *prefill_tables = (
            _ship_together(host, dev)
        )
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            num_decode_tokens=len(dec_tables),
            decode_block_tables=tables.to(torch.int32),
            decode_context_lens=lens.to(torch.int32),
            prefill_spans=spans,
            prefill_block_tables=prefill_tables,
            max_decode_context=max(dec_lens, default=0),
        )
        return StepBatch(
            input_ids=input_ids,
            positions=positions,
            meta=meta,
            mm_rows=mm_index if mm_rows else None,
            mm_embeds=torch.cat(mm_embeds) if mm_embeds else None,
            logit_rows=logit_index,
            completing=completing,
        )

    @torch.no_grad()
    def execute(self, sched: SchedulerOutput) -> tuple[list[ScheduledChunk], torch.Tensor]:
        """Run the step; returns the chunks that reached their last token and their logits ([N, vocab],
        float32, on the device: the sampler reads them there)."""
        self.bind_thread()
        for src, dst in sched.block_copies:
            self.kv_cache[:, :, dst].copy_(self.kv_cache[:, :, src])
        batch = self.build_batch(sched)
        hidden = self.model(
            batch.input_ids,
            batch.positions,
            self.kv_caches,
            batch.meta,
            self.backend,
            batch.mm_rows,
            batch.mm_embeds,
        )
        if not batch.completing:
            # NOTE: nothing to sample, so no .tolist() waits for this step: wait here, or its measured time
            # (the prefill rate, Retry-After and the TPOT cap read it) would be the launch time only.
            synchronize(self.device)
            return [], hidden.new_empty(0, self.cfg.vocab_size, dtype=torch.float32)
        return batch.completing, self.model.compute_logits(hidden[batch.logit_rows])


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
