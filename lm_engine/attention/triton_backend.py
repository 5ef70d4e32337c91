"""Attention on CUDA: paged KV writes and decode as Triton kernels; prefill uses the base class's SDPA."""

from __future__ import annotations

import torch

from lm_engine.attention.base import AttentionBackend
from lm_engine.attention.triton_kernels import triton_paged_decode, triton_write_kv


class TritonBackend(AttentionBackend):
    name = "triton"

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        triton_write_kv(key, value, k_cache, v_cache, slot_mapping)

    def decode(self, q, k_cache, v_cache, block_tables, context_lens, scale, max_context) -> torch.Tensor:
        return triton_paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, max_context)
