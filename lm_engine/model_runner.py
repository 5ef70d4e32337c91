"""Owns the weights and the paged KV cache; turns a scheduled step into one forward pass."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import torch

from cache import EmbeddingKey
from encoder.models import build_vision_tower
from lm_engine.attention import AttentionMetadata, get_backend
from lm_engine.config import EngineConfig
from lm_engine.device import DeviceBinding, synchronize, to_device
from lm_engine.memory import MemoryPlan, NotEnoughMemory, kv_budget_bytes, kv_bytes_per_token, zeroed_pool
from lm_engine.models.fused_decode import FusedDecode
from lm_engine.models.qwen2_vl import use_step_kernels
from lm_engine.models.registry import ModelConfig, build_decoder
from lm_engine.scheduler import ScheduledChunk, SchedulerOutput
from lm_engine.startup import StartupPhases
from lm_engine.step_inputs import build_step
from runtime import cpu_kernel
from runtime.linear import pack_linears
from runtime.memory import available_memory_bytes, format_bytes, peak_rss_bytes
from runtime.weights import uninitialized

log = logging.getLogger("vlmserve.engine")


# NOTE: on a CPU the worst-case step's compute is the start-up's longest part (35 s of 45 at the 2B shape:
# 2,048 prompt tokens and a 4,096-patch image through 2.2B parameters). Its activations grow with its tokens
# and the image's patches, so a step of at most this many of each stands for it, and its memory is scaled
# up: linearly in the tokens, quadratically in the patches (an attention path may hold a patches × patches
# score matrix), erring high. It comes out of the KV pool's share of memory (memory.kv_budget_bytes).
_CPU_WARMUP_TOKENS = 256
_CPU_WARMUP_PATCHES = 1024


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        cfg: ModelConfig,
        config: EngineConfig,
        dtype: torch.dtype,
        max_model_len: int,
        memory: MemoryPlan | None = None,
        phases: StartupPhases | None = None,
    ) -> None:
        """``memory``: what a CPU's KV pool is sized from (the engine measures it before loading; without it, the
        memory available now stands for it, weights included). ``phases``: where start-up laps are recorded."""
        phases = phases or StartupPhases()
        self.memory = memory
        self.cfg = cfg
        self.device = torch.device(config.device)
        self.dtype = dtype
        self.block_size = config.block_size
        self.bind_thread = DeviceBinding(self.device)
        self.bind_thread()
        self._encoder_stream: torch.cuda.Stream | None = None
        with torch.device(self.device), uninitialized(dtype):
            self.model = build_decoder(cfg)
        self.model.to(dtype)  # NOTE: what is not a parameter keeps its own dtype (see MRotaryEmbedding)
        self.model.load_weights(model_dir)
        self.model.eval()
        self.vision = build_vision_tower(cfg.raw, model_dir, dtype=dtype, device=self.device)
        phases.lap("load")
        packed = pack_linears(self.model, pool="prefill") + pack_linears(self.vision, pool="vision")
        if packed:
            log.info("%d linear layers with weights packed (oneDNN's bfloat16 or our float32 kernel)", packed)
        steps = use_step_kernels(self.model, cpu_kernel.load()) if dtype == torch.bfloat16 else 0
        if steps:
            log.info("%d decoder norms and MLPs on the compiled kernels in decode steps", steps)
        phases.lap("pack")
        self.backend = get_backend(config.device, config.attention_backend)
        log.info("attention backend: %s (asked for %s)", self.backend.name, config.attention_backend)
        if steps:
            self.model.fused = FusedDecode.build(self.model, self.backend)
            if self.model.fused is not None:
                log.info("decode steps: each decoder layer in one call (the fused decode layer)")
        self.num_blocks = self._size_kv_pool(config, max_model_len, phases)
        shape = (
            cfg.num_hidden_layers,
            2,
            self.num_blocks,
            self.block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        # NOTE: zeroed, not empty: padded decode gathers read unused slots, and 0·NaN would poison them.
        self.kv_cache = zeroed_pool(shape, dtype, self.device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(cfg.num_hidden_layers)]
        phases.lap("kv")
        self.backend.warmup(*self.kv_caches[0], cfg.num_attention_heads, max_model_len)
        phases.lap("warm-up")

    # -- sizing ------------------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.block_size * kv_bytes_per_token(self.cfg, itemsize)

    @torch.no_grad()
    def _size_kv_pool(self, config: EngineConfig, max_model_len: int, phases: StartupPhases) -> int:
        """Blocks for the KV pool: fixed by ``num_kv_blocks``, else what its memory budget holds after the
        worst-case warm-up (never more than ``max_num_seqs`` full-length sequences need)."""
        per_block = self.kv_bytes_per_block()
        useful = config.max_num_seqs * ((max_model_len + self.block_size - 1) // self.block_size) + 1
        if config.num_kv_blocks is not None:
            return int(config.num_kv_blocks)
        peak = self._warmup_peak(config.max_num_batched_tokens, config.warmup_image_patches)
        phases.lap("warm-up")
        utilization = config.memory_utilization
        if config.kv_cache_memory is not None:
            budget = int(config.kv_cache_memory)
        elif self.device.type == "cuda":
            # NOTE: the warm-up's freed blocks sit in the caching allocator, where mem_get_info counts them used.
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * utilization) - (total - free) - peak
        else:
            # NOTE: without a plan (a runner built on its own) the memory available now stands for the start's,
            # the weights already out of it.
            plan = self.memory or MemoryPlan(available_memory_bytes() or 8 << 30, 0, 0)
            budget = kv_budget_bytes(plan.available, plan.weight_bytes, peak, utilization, plan.reserve)
        blocks = min(max(budget // per_block, 0), useful)
        min_blocks = (max_model_len + self.block_size - 1) // self.block_size + 1
        if blocks < min_blocks:
            raise NotEnoughMemory(
                f"not enough memory: the KV cache's {format_bytes(max(budget, 0))} (after a warm-up peak of "
                f"{format_bytes(peak)}) holds {blocks * self.block_size} tokens, fewer than one "
                f"{max_model_len}-token sequence needs; lower --max-model-len, or raise --memory-utilization or "
                "--kv-cache-memory"
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
        """Run the worst-case step (a full token budget + the largest image) and measure its extra memory. On a
        CPU a scaled-down step stands for it (see ``_CPU_WARMUP_TOKENS``)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            if image_patches:
                self._warm_vision(image_patches)
            self._warm_decoder(max_tokens)
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - base
        base = peak_rss_bytes()
        patches = min(image_patches, _CPU_WARMUP_PATCHES)
        vision = 0.0
        if patches:
            self._warm_vision(patches)
            vision = (peak_rss_bytes() - base) * (image_patches / patches) ** 2
        tokens = min(max_tokens, _CPU_WARMUP_TOKENS)
        before = peak_rss_bytes()
        self._warm_decoder(tokens)
        after = peak_rss_bytes()
        # NOTE: a peak the tower's pass set and the decoder's did not pass bounds the decoder's from above.
        decoder = (after - base if after > before else before - base) * (max_tokens / tokens)
        return int(max(vision, decoder))

    def _warm_vision(self, image_patches: int) -> None:
        """The vision tower on one square image of about ``image_patches`` patches."""
        merge, v = self.cfg.spatial_merge_size, self.cfg.vision
        side = max(merge, int(image_patches**0.5) // merge * merge)
        dim = 3 * int(v.get("temporal_patch_size", 2)) * int(v.get("patch_size", 14)) ** 2
        pixels = torch.zeros(side * side, dim, device=self.device)
        self.vision(pixels, torch.tensor([[1, side, side]], device=self.device))

    def _warm_decoder(self, max_tokens: int) -> None:
        """One prefill of a full token budget, into throwaway caches of its own."""
        c, dev = self.cfg, self.device
        n_blocks = (max_tokens + self.block_size - 1) // self.block_size
        shape = (n_blocks, self.block_size, c.num_key_value_heads, c.head_dim)
        caches = [(torch.zeros(shape, dtype=self.dtype, device=dev),) * 2 for _ in range(c.num_hidden_layers)]
        meta = AttentionMetadata(
            slot_mapping=torch.arange(max_tokens, device=dev),
            num_decode_tokens=0,
            decode_block_tables=torch.zeros(0, 1, dtype=torch.int32, device=dev),
            decode_context_lens=torch.zeros(0, dtype=torch.int32, device=dev),
            prefill_spans=[(0, max_tokens, max_tokens)],
            prefill_block_tables=[torch.arange(n_blocks, device=dev)],
        )
        ids = torch.zeros(max_tokens, dtype=torch.long, device=dev)
        pos = torch.arange(max_tokens, device=dev).expand(3, -1)
        hidden = self.model(ids, pos, caches, meta, self.backend)
        self.model.compute_logits(hidden[-1:])

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

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on the engine's device (from the calling thread)."""
        self.bind_thread()
        return to_device(tensor, self.device) if tensor.device.type == "cpu" else tensor.to(self.device)

    # -- one step ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def execute(
        self, sched: SchedulerOutput, embeddings: Mapping[EmbeddingKey, torch.Tensor]
    ) -> tuple[list[ScheduledChunk], torch.Tensor]:
        """Run the step; returns the chunks that reached their last token and their logits ([N, vocab],
        float32, on the device: the sampler reads them there)."""
        self.bind_thread()
        for src, dst in sched.block_copies:
            self.kv_cache[:, :, dst].copy_(self.kv_cache[:, :, src])
        batch = build_step(sched, embeddings, self.block_size, self.device)
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
