"""Attention on CUDA: paged KV writes and decode as Triton kernels; prefill uses the base class's SDPA."""

from __future__ import annotations

import torch

from lm_engine.attention import triton_kernels
from lm_engine.attention.base import AttentionBackend
from lm_engine.attention.triton_kernels import triton_paged_decode, triton_write_kv


class TritonBackend(AttentionBackend):
    name = "triton"

    def write_kv(
        self, key, value, k_cache, v_cache, slot_mapping, all_written=False
    ) -> None:  # masks -1 itself
        triton_write_kv(key, value, k_cache, v_cache, slot_mapping)

    def decode(self, q, k_cache, v_cache, block_tables, context_lens, scale, max_context) -> torch.Tensor:
        return triton_paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, max_context)

    def warmup(self, k_cache, v_cache, num_heads, max_model_len) -> None:
        """Every decode variant (see ``decode_warmup_plan``) and the KV write, in the layouts a step uses."""
        _, _, kv_heads, head_dim = k_cache.shape
        sms = torch.cuda.get_device_properties(k_cache.device).multi_processor_count
        plan = triton_kernels.decode_warmup_plan(kv_heads, head_dim, max_model_len, sms)
        q = torch.zeros(1, num_heads, head_dim, dtype=k_cache.dtype, device=k_cache.device)
        triton_kernels.warmup_decode(q, k_cache, v_cache, plan)
        # As in the decoder: the key is rotated (contiguous), the value a view of the fused QKV projection.
        qkv = torch.zeros(1, num_heads + 2 * kv_heads, head_dim, dtype=k_cache.dtype, device=k_cache.device)
        key = qkv[:, num_heads : num_heads + kv_heads].contiguous()
        slots = torch.full((1,), -1, dtype=torch.long, device=k_cache.device)
        triton_write_kv(key, qkv[:, num_heads + kv_heads :], k_cache, v_cache, slots)
