"""Attention in plain torch (the reference every kernel is tested against) and the CPU backend, whose
decode runs the compiled kernel of ``runtime.paged_decode`` and whose bfloat16 prefill runs the vision attention
library's causal kernel, where they apply."""

from __future__ import annotations

import logging
import time

import torch

from lm_engine.attention.base import AttentionBackend, context_kv
from runtime import cpu_kernel
from runtime import paged_decode as decode_kernel
from runtime.native import best_times
from runtime.timing_cache import cached_probe, library_tag

log = logging.getLogger("vlmserve.engine")


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    all_written: bool = False,
) -> None:
    """Scatter ``key``/``value`` ([T, KVH, D]) into the paged caches at ``slot_mapping`` (-1 = skip; with
    ``all_written`` the caller knows there is none, and the per-layer look is skipped)."""
    if not all_written:
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def gather_blocks(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """``cache[tables]`` ([*tables.shape, block_size, KVH, D]) as one ``index_select`` over whole blocks.

    NOTE: advanced indexing runs a generic per-element kernel on the CPU; for one sequence's 113 blocks
    it measured 6.2 ms against 0.12 ms for ``index_select`` (benchmarks/README.md, decode step)."""
    return cache.index_select(0, tables.reshape(-1)).view(*tables.shape, *cache.shape[1:])


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
    keys = gather_blocks(k_cache, tables).flatten(1, 2)
    values = gather_blocks(v_cache, tables).flatten(1, 2)
    length = keys.shape[1]
    mask = torch.arange(length, device=q.device).unsqueeze(0) < context_lens.unsqueeze(1).to(q.device)
    s, h, d = q.shape
    kvh = keys.shape[2]
    # NOTE: the query heads that share a KV head go in as that head's query rows ([S, KVH, H/KVH, D]),
    # not as one query per head with enable_gqa: the same result, 2× faster on the CPU (bigger tiles).
    out = torch.nn.functional.scaled_dot_product_attention(
        q.view(s, kvh, h // kvh, d),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask[:, None, None, :],
        scale=scale,
    )
    return out.reshape(s, h, d)


class TorchBackend(AttentionBackend):
    name = "torch"

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping, all_written=False) -> None:
        write_kv(key, value, k_cache, v_cache, slot_mapping, all_written)

    def decode(self, q, k_cache, v_cache, block_tables, context_lens, scale, max_context) -> torch.Tensor:
        return paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, max_context)


class CpuBackend(TorchBackend):
    """The torch backend with decode in the compiled CPU kernel (float32 and bfloat16, computed in float32),
    which reads each sequence's blocks in place: no gather, no padding to the longest context. Other dtypes
    and shapes outside the kernel's limits fall back to :func:`paged_decode`.

    NOTE: 50 sequences with 100–1400-token contexts (the small preset's shapes, 2 AVX2 cores): 60.8 ms per
    layer for gather + SDPA, 8.5 ms for the kernel (``benchmarks/attention_kernels.py --cpu``).

    Prefill chunks in bfloat16 run the vision attention library's causal kernel where it was built with
    AVX512-BF16 dot products (``runtime.cpu_kernel.causal_attention``): torch's CPU flash attention
    does not use them; where the CPU has AMX (and so does oneDNN's SDPA), the kernel's tile variant (timed
    against SDPA once per shape: see :func:`fastest_prefill`). NOTE: 12 heads over 2 kv heads × 64, 2 threads,
    AVX512-BF16 EPYC: SDPA took a 1,024-token chunk in 31.6 ms against the kernel's 10.1, 2,048: 105 against 38,
    512 after 1,024 cached: 36.5 against 12.1; Xeon with AMX, 2,048 tokens: SDPA 11.8 ms, the kernel's
    vdpbf16ps products 31.8, its AMX variant 7.1.
    """

    name = "cpu"

    def __init__(self, lib) -> None:
        self.lib = lib
        self.prefill_lib = cpu_kernel.load()
        # (heads, kv heads, head dim) → "sdpa", "kernel" or "kernel-amx" (its products on AMX tiles)
        self.causal_choice: dict[tuple[int, int, int], str] = {}
        self._lens: torch.Tensor | None = None  # the last step's context lengths, and their max
        self._lens_max = 0

    def decode(self, q, k_cache, v_cache, block_tables, context_lens, scale, max_context) -> torch.Tensor:
        if not decode_kernel.supports(q, k_cache):
            return paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, max_context)
        if context_lens is not self._lens:  # a new step's lengths (its layers share one tensor): read once
            self._lens, self._lens_max = context_lens, int(context_lens.max()) if context_lens.numel() else 0
        if max_context <= 0:
            max_context = self._lens_max
        return decode_kernel.paged_decode(
            self.lib,
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            scale,
            max_context,
            longest=self._lens_max,
        )

    def prefill(self, q, k, v, k_cache, v_cache, block_table, context_len, scale) -> torch.Tensor:
        choice = self.prefill_choice(q, k)
        if choice == "sdpa":
            return super().prefill(q, k, v, k_cache, v_cache, block_table, context_len, scale)
        keys, values = context_kv(k, v, k_cache, v_cache, block_table, context_len)
        return cpu_kernel.causal_attention(
            self.prefill_lib, q, keys, values, scale, amx=choice == "kernel-amx"
        )

    def warmup(self, k_cache, v_cache, num_heads, max_model_len) -> None:
        """Settle the prefill kernel choice for the model's shape now, not on the first request."""
        _, _, kv_heads, head_dim = k_cache.shape
        self.prefill_choice(
            torch.empty(1, num_heads, head_dim, dtype=k_cache.dtype), k_cache.new_empty(1, kv_heads, head_dim)
        )

    def prefill_choice(self, q: torch.Tensor, k: torch.Tensor) -> str:
        """What runs this prefill: ``sdpa`` where the causal kernel does not apply, else the fastest of SDPA, the
        kernel and its AMX variant, timed once per shape, CPU and torch version (at start-up: see :meth:`warmup`;
        kept in runtime/timing_cache.py; where AMX runs torch's attention, the vdpbf16ps kernel may not beat
        it)."""
        if not cpu_kernel.causal_supported(self.prefill_lib, q):
            return "sdpa"
        shape = (q.shape[1], k.shape[1], q.shape[2])
        if shape not in self.causal_choice:
            lib = self.prefill_lib
            args = {"heads": shape[0], "kv_heads": shape[1], "head_dim": shape[2], "lib": library_tag(lib)}
            self.causal_choice[shape] = cached_probe(
                "causal_prefill", args, lambda: fastest_prefill(lib, *shape)
            )
        return self.causal_choice[shape]


def fastest_prefill(
    lib, heads: int, kv_heads: int, head_dim: int, tokens: int = 512, rounds: int = 3, timer=time.perf_counter
) -> str:
    """``sdpa``, ``kernel`` or ``kernel-amx``: the causal kernel (and, where the CPU has AMX, its tile variant)
    against the torch backend's SDPA prefill on one ``tokens``-token bf16 chunk of this shape, each run once
    untimed, then ``rounds`` times alternating, best runs compared (a few ms here)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(tokens, kv_heads, head_dim, generator=gen).to(torch.bfloat16) for _ in range(2))
    scale = head_dim**-0.5
    calls = {
        "kernel": lambda: cpu_kernel.causal_attention(lib, q, k, v, scale),
        "sdpa": lambda: TorchBackend().prefill(q, k, v, k, v, None, tokens, scale),
    }
    if lib is not None and cpu_kernel.amx_ready(lib):
        calls["kernel-amx"] = lambda: cpu_kernel.causal_attention(lib, q, k, v, scale, amx=True)
    best = best_times(calls, rounds, timer)
    pick = min(best, key=best.get)
    log.info(
        "bf16 prefill attention (%d heads over %d × %d, %d tokens): %s: %s",
        heads,
        kv_heads,
        head_dim,
        tokens,
        ", ".join(f"{name} {t * 1e3:.1f} ms" for name, t in best.items()),
        pick,
    )
    return pick
