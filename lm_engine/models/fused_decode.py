"""A decode step's decoder layers as one call each into the compiled library (``vlm_decode_layer``).

A bfloat16 decode step of a few rows is memory-bound: its linear layers read every weight once, at the machine's
read rate (``runtime/csrc/skinny_linear.c``). Around them, each of the decoder's layers made about 25
calls from Python (module calls, two norms, the q/k rotary, the KV write, the attention kernel, views, residual
adds), about 15 ms of a 110 ms step at the Qwen2-VL-2B shape on a 2-vCPU Zen 4 (benchmarks/README.md, "A Zen 4
EPYC at real size"). Here a layer is one call that runs the same kernels in the same order, so the step's
output is the same to the bit as the modules' (tests/lm_engine/test_fused_decode.py).

Taken for steps of decodes only (no image rows, at most :data:`~runtime.linear.SKINNY_ROWS` rows), in
bfloat16 on the CPU, where every layer's four projections run on the few-row kernel, its norms and rotary on the
compiled library, and the attention backend is the CPU one with its paged decode kernel; anything else keeps the
modules. ``VLMSERVE_FUSED_DECODE=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import logging

import torch
from torch import nn

from lm_engine.attention.base import AttentionMetadata
from runtime import cpu_kernel, paged_decode
from runtime.linear import SKINNY_ROWS, PackedLinear, skinny_library
from runtime.native import switched_off

log = logging.getLogger("vlmserve.engine")

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Layer(ctypes.Structure):  # vlm_layer_t in runtime/csrc/cpu_kernel/decode_layer.h
    _fields_ = [
        ("linear", _P),
        ("attend", _P),
        ("hidden", _I),
        ("heads", _I),
        ("kv_heads", _I),
        ("head_dim", _I),
        ("inter", _I),
        ("paths", _I * 4),
        ("w", _P * 4),
        ("bias", _P * 2),
        ("in_norm", _P),
        ("post_norm", _P),
        ("q_norm", _P),
        ("k_norm", _P),
        ("eps", _F),
        ("qk_eps", _F),
        ("scale", _F),
    ]


class _Step(ctypes.Structure):  # vlm_step_t
    _fields_ = [
        ("m", _I),
        ("block_size", _I),
        ("table_stride", _I),
        ("linear_threads", _I),
        ("attend_threads", _I),
        ("cos", _P),
        ("sin", _P),
        ("slots", _P),
        ("tables", _P),
        ("lens", _P),
        ("h", _P),
        ("qkv", _P),
        ("q", _P),
        ("attn", _P),
        ("o", _P),
        ("gu", _P),
        ("act", _P),
    ]


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedDecode:
    """The decoder's layers as :class:`_Layer` records, the step record and its scratch; see the module doc."""

    def __init__(self, lib, layers: list[_Layer], keep: list, cfg) -> None:
        self.lib = lib
        self.layers = layers
        self._keep = (
            keep  # the tensors the records point into (norm weights, biases): alive as long as this is
        )
        q, kv, inter = (
            cfg.num_attention_heads * cfg.head_dim,
            cfg.num_key_value_heads * cfg.head_dim,
            cfg.intermediate_size,
        )
        rows, bf16 = SKINNY_ROWS, torch.bfloat16
        self.scratch = {
            "h": torch.empty(rows, cfg.hidden_size, dtype=bf16),
            "qkv": torch.empty(rows, q + 2 * kv, dtype=bf16),
            "q": torch.empty(rows, q, dtype=bf16),
            "attn": torch.empty(rows, q, dtype=bf16),
            "o": torch.empty(rows, cfg.hidden_size, dtype=bf16),
            "gu": torch.empty(rows, 2 * inter, dtype=bf16),
            "act": torch.empty(rows, inter, dtype=bf16),
        }
        self.step = _Step(**{name: t.data_ptr() for name, t in self.scratch.items()})
        self.kv_heads = cfg.num_key_value_heads

    @classmethod
    def build(cls, decoder: nn.Module, backend) -> FusedDecode | None:
        """The plan for ``decoder`` (a Qwen2VLDecoder or Qwen3VLDecoder after packing and use_step_kernels), or
        ``None`` where any layer or the backend does not fit it (see the module doc)."""
        if switched_off("VLMSERVE_FUSED_DECODE"):
            return None
        lib, found = cpu_kernel.load(), skinny_library()
        attend_lib = getattr(backend, "lib", None)
        cfg = decoder.cfg
        if lib is None or found is None or attend_lib is None or not hasattr(lib, "vlm_decode_layer"):
            return None
        if (
            decoder.embed_tokens.weight.dtype != torch.bfloat16
            or decoder.embed_tokens.weight.device.type != "cpu"
        ):
            return None
        if cfg.intermediate_size % 16 or cfg.head_dim % 2 or cfg.head_dim > cpu_kernel.MAX_HEAD_DIM:
            return None  # silu · up row by row equals the modules' one call only in whole vectors
        probe_q = torch.empty(1, cfg.num_attention_heads, cfg.head_dim, dtype=torch.bfloat16)
        probe_k = torch.empty(1, 16, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.bfloat16)
        if not paged_decode.supports(probe_q, probe_k):
            return None
        linear = ctypes.cast(found[0].vlm_skinny_linear, _P).value
        attend = ctypes.cast(attend_lib.vlm_paged_decode_bf16, _P).value
        layers, keep = [], []
        for layer in decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
            if not all(isinstance(p, PackedLinear) and p.skinny for p in linears):
                return None
            norms = [layer.input_layernorm, layer.post_attention_layernorm]
            if any(n.lib is None for n in norms) or attn.lib is None or mlp.lib is None:
                return None
            q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            weights = [n.weight.detach().contiguous() for n in norms]
            qk = [n.weight.detach().contiguous() for n in (q_norm, k_norm) if n is not None]
            biases = [attn.qkv_proj.bias, attn.o_proj.bias]
            keep += weights + qk + [b for b in biases if b is not None]
            layers.append(
                _Layer(
                    linear=linear,
                    attend=attend,
                    hidden=cfg.hidden_size,
                    heads=cfg.num_attention_heads,
                    kv_heads=cfg.num_key_value_heads,
                    head_dim=cfg.head_dim,
                    inter=cfg.intermediate_size,
                    paths=(_I * 4)(*(p.skinny for p in linears)),
                    w=(_P * 4)(*(p.address for p in linears)),
                    bias=(_P * 2)(*(_address(b) for b in biases)),
                    in_norm=weights[0].data_ptr(),
                    post_norm=weights[1].data_ptr(),
                    q_norm=qk[0].data_ptr() if qk else None,
                    k_norm=qk[1].data_ptr() if qk else None,
                    eps=layer.input_layernorm.eps,
                    qk_eps=q_norm.eps if q_norm is not None else 0.0,
                    scale=attn.scale,
                )
            )
        fn = lib.vlm_decode_layer
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(_Layer), ctypes.POINTER(_Step), _P, _P, _P]
        return cls(lib, layers, keep, cfg)

    def applies(self, input_ids: torch.Tensor, meta: AttentionMetadata, mm_rows: torch.Tensor | None) -> bool:
        t = input_ids.shape[0]
        return (
            0 < t <= SKINNY_ROWS
            and meta.num_decode_tokens == t
            and (mm_rows is None or not mm_rows.numel())
            and input_ids.device.type == "cpu"
        )

    @torch.no_grad()
    def run(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``x`` (the step's embedded rows) through every layer, in place; returns it."""
        m = x.shape[0]
        x = x.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        slots = meta.slot_mapping.contiguous()
        tables = meta.decode_block_tables.to(torch.int32).contiguous()
        lens = meta.decode_context_lens.to(torch.int32).contiguous()
        k_cache = kv_caches[0][0]
        block_size = k_cache.shape[1]
        # NOTE: as the attention kernel's own wrapper checks (paged_decode.paged_decode): every length inside its
        # row of the table, read from the lengths themselves, and every cache laid out as the kernel reads it
        longest = int(lens.max())
        if longest > tables.shape[1] * block_size:
            raise ValueError(
                f"context of {longest} tokens exceeds the block table ({tables.shape[1]} blocks)"
            )
        work = longest * m * self.kv_heads  # as CpuBackend sizes the attention kernel's threads
        threads = torch.get_num_threads()
        s = self.step
        s.m, s.block_size, s.table_stride = m, block_size, tables.shape[1]
        s.linear_threads = threads
        s.attend_threads = threads if work >= paged_decode._PARALLEL_MIN_WORK else 1
        s.cos, s.sin, s.slots, s.tables, s.lens = (
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            tables.data_ptr(),
            lens.data_ptr(),
        )
        step, fn, xp = ctypes.byref(s), self.lib.vlm_decode_layer, x.data_ptr()
        for layer, (k, v) in zip(self.layers, kv_caches):
            if not (k.is_contiguous() and v.is_contiguous()):
                raise ValueError("the fused decode step needs contiguous KV caches")
            rc = fn(ctypes.byref(layer), step, xp, k.data_ptr(), v.data_ptr())
            if rc != 0:
                raise RuntimeError(f"the fused decode layer failed (code {rc})")
        return x
