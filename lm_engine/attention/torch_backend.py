"""Attention in plain torch: the CPU path and the reference the Triton kernels are tested against."""

from __future__ import annotations

import torch

from lm_engine.attention.base import AttentionBackend


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` ([T, KVH, D]) into the paged caches at ``slot_mapping`` (-1 = skip)."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context: int = 0,
) -> torch.Tensor:
    """One query per sequence ([S, H, D]) against its paged context; returns [S, H, D]."""
    block_size = k_cache.shape[1]
    if max_context <= 0:
        max_context = int(context_lens.max())
    n_blocks = (max_context + block_size - 1) // block_size
    tables = block_tables[:, :n_blocks].long()
    # Gathers only the blocks the longest sequence needs: [S, L, KVH, D]
    keys = k_cache[tables].flatten(1, 2)
    values = v_cache[tables].flatten(1, 2)
    length = keys.shape[1]
    mask = torch.arange(length, device=q.device).unsqueeze(0) < context_lens.unsqueeze(1).to(q.device)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2),  # [S, H, 1, D]
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2)


class TorchBackend(AttentionBackend):
    name = "torch"

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        write_kv(key, value, k_cache, v_cache, slot_mapping)

    def decode(self, q, k_cache, v_cache, block_tables, context_lens, scale, max_context) -> torch.Tensor:
        return paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, max_context)
