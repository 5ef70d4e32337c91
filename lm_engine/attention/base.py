"""The attention backend contract: paged KV writes, paged decode, and chunked prefill over a ragged batch."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step layout of the flat token batch, built once per step and shared by every layer.

    Tokens are ordered decodes first (one token each), then prefill chunks. ``slot_mapping[i]`` is the
    KV slot (``block * block_size + offset``) token ``i`` writes; -1 writes nothing.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_context_lens: torch.Tensor  # [num_decodes] int32, including the new token
    # One entry per prefill chunk: (query start in the flat batch, query length, context length incl. the chunk)
    prefill_spans: list[tuple[int, int, int]]
    prefill_block_tables: list[torch.Tensor]  # per chunk: [num_blocks] int64 covering the context
    max_decode_context: int = 0
    # Every slot_mapping entry >= 0 (known when the step was built): the layers' KV writes skip the check
    all_slots_written: bool = False


class AttentionBackend(ABC):
    """Computes causal attention for a ragged batch against a paged KV cache.

    Contract for implementations:
    - ``k_cache``/``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``.
    - ``write_kv`` stores the step's new keys/values at ``slot_mapping`` before any read, so a token
      attends to itself and to everything computed earlier for its sequence.
    - ``decode`` takes one query per sequence (``[num_seqs, num_heads, head_dim]``) and attends over
      the first ``context_lens[i]`` slots of that sequence's block table; grouped-query attention maps
      query head ``h`` to KV head ``h // (num_heads // num_kv_heads)``.
    - Results equal softmax(q·kᵀ·scale)·v within the dtype's rounding; no attention matrix over the
      whole batch is materialised.
    """

    @abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        all_written: bool = False,  # the caller knows every slot is >= 0: the write may skip looking
    ) -> None: ...

    @abstractmethod
    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        max_context: int,
    ) -> torch.Tensor: ...

    def warmup(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, max_model_len: int
    ) -> None:
        """Compile what live traffic would otherwise compile on its first steps (default: nothing to do)."""
        return None

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        context_len: int,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of a chunk of ``q_len`` queries that end the ``context_len``-token context."""
        q_len = q.shape[0]
        keys, values = context_kv(k, v, k_cache, v_cache, block_table, context_len)
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        kh = keys.transpose(0, 1).unsqueeze(0)
        vh = values.transpose(0, 1).unsqueeze(0)
        if context_len == q_len:
            out = torch.nn.functional.scaled_dot_product_attention(
                qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            offset = context_len - q_len
            rows = torch.arange(q_len, device=q.device).unsqueeze(1) + offset
            cols = torch.arange(context_len, device=q.device).unsqueeze(0)
            out = torch.nn.functional.scaled_dot_product_attention(
                qh, kh, vh, attn_mask=cols <= rows, scale=scale, enable_gqa=True
            )
        return out.squeeze(0).transpose(0, 1)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] for the flat batch. Returns [T, H, D]."""
        self.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, all_written=meta.all_slots_written)
        nd = meta.num_decode_tokens
        decoded = None
        if nd:
            tables, lens = meta.decode_block_tables, meta.decode_context_lens
            decoded = self.decode(q[:nd], k_cache, v_cache, tables, lens, scale, meta.max_decode_context)
        if nd == q.shape[0]:  # a step of decodes only: the kernel's output is the layer's, no copy
            return decoded
        out = torch.empty_like(q)
        if nd:
            out[:nd] = decoded
        for (start, q_len, context_len), table in zip(meta.prefill_spans, meta.prefill_block_tables):
            sl = slice(start, start + q_len)
            out[sl] = self.prefill(q[sl], k[sl], v[sl], k_cache, v_cache, table, context_len, scale)
        return out


def context_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values ([context_len, KVH, D]) a prefill chunk (``k``, ``v``: its own, already cached) attends
    to: the chunk's own when nothing precedes it, else the context's blocks gathered from the paged cache."""
    if context_len == k.shape[0]:
        return k, v  # nothing earlier: no gather
    block_size = k_cache.shape[1]
    n_blocks = (context_len + block_size - 1) // block_size
    blocks = block_table[:n_blocks].long()
    # NOTE: index_select, not k_cache[blocks]: advanced indexing is up to 50× slower on the CPU.
    keys = k_cache.index_select(0, blocks).flatten(0, 1)[:context_len]
    values = v_cache.index_select(0, blocks).flatten(0, 1)[:context_len]
    return keys, values
