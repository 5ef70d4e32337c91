"""A decode step's layers in one call each (lm_engine/models/fused_decode.py): the same kernels in the same order as
the decoder's modules, so the same bits. The oracle is the modules' own path (itself held to transformers by the
equivalence suite), run on the same step's inputs and a copy of the KV pool: hidden states and written KV equal,
for single and batched decode rows, on the trained demo checkpoint (Qwen2-VL) and a Qwen3-VL checkpoint (per-head
q/k norms)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lm_engine import LLM, SamplingParams
from runtime import linear as packing
from tests.support import image_part, make_image, user
from tools import demo, qwen3_vl_make
from tools import qwen2_vl_make as base

FOUND = packing.skinny_library()
pytestmark = pytest.mark.skipif(
    FOUND is None or not packing.native_bf16(),
    reason="no few-row kernel here (no AVX512-BF16/AMX, or no compiler): the fused step never applies",
)

# Qwen3-VL with every projection a whole number of the few-row kernel's blocks (the tiny preset's 176-wide MLP
# is not): 4 heads of 32 over 2 kv heads, a 256-wide MLP.
QWEN3 = dataclasses.replace(
    qwen3_vl_make.PRESETS["tiny"],
    text=dataclasses.replace(
        base.PRESETS["tiny"], hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2
    ),
)


@pytest.fixture(scope="module")
def qwen3_ckpt(tmp_path_factory):
    return qwen3_vl_make.make_checkpoint(tmp_path_factory.mktemp("fused_q3"), preset=QWEN3, seed=1)


@pytest.fixture(autouse=True)
def kernels_taken(monkeypatch):
    """The start-up timings aside: every layer whose layout the few-row kernel reads takes it."""
    monkeypatch.setattr(packing, "packed_is_faster", lambda: True)
    monkeypatch.setattr(packing, "skinny_is_faster", lambda: True)
    if not packing.skinny_layout_block():
        pytest.skip("oneDNN packs another layout on this CPU: the few-row kernel is never taken here")


@pytest.mark.parametrize("which", ["demo", "qwen3"])
def test_fused_steps_equal_the_modules_to_the_bit(which, qwen3_ckpt):
    """Every step the fused path takes also runs through the modules first, on a copy of the KV pool, with the same
    inputs: the hidden states and the KV each writes are equal to the bit. Three requests at once (one with an
    image), then one alone: batched decode rows and lone ones."""
    ckpt = demo.SHIPPED if which == "demo" else qwen3_ckpt
    convs = [
        user("What color is the shape?", image_part(make_image(96, 96, 3))),
        user("Count to ten, slowly and in words."),
        user("Name three colours."),
    ]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (6, 12, 9)]
    compared = []
    with LLM(str(ckpt), dtype="bfloat16", num_kv_blocks=64, block_size=16, max_num_batched_tokens=256) as llm:
        model = llm.engine.runner.model
        plan = model.fused
        assert plan is not None, "the fused step should apply to this checkpoint"
        forward = model.forward

        def both(input_ids, positions, kv_caches, meta, backend, mm_rows=None, mm_embeds=None):
            if not plan.applies(input_ids, meta, mm_rows):
                return forward(input_ids, positions, kv_caches, meta, backend, mm_rows, mm_embeds)
            copies = [(k.clone(), v.clone()) for k, v in kv_caches]
            model.fused = None
            want = forward(input_ids, positions, copies, meta, backend, mm_rows, mm_embeds)
            model.fused = plan
            got = forward(input_ids, positions, kv_caches, meta, backend, mm_rows, mm_embeds)
            assert torch.equal(got, want)
            assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(kv_caches, copies))
            compared.append(input_ids.shape[0])
            return got

        model.forward = both
        outs = llm.chat(convs, params)
        outs += llm.chat(
            [user("Name three colours.")], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        )
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 12, 9, 5]
    # batched rows (the two text requests decode together whatever the image's timing), and a lone request's
    assert max(compared) >= 2 and 1 in compared


def test_fused_step_is_not_taken_where_it_does_not_apply(tiny_ckpt, monkeypatch):
    """The tiny preset's 176-wide MLP is no whole number of the kernel's blocks; float32 has no few-row kernel;
    the switch turns it off."""
    with LLM(str(tiny_ckpt), dtype="bfloat16", num_kv_blocks=64) as llm:
        assert llm.engine.runner.model.fused is None
    with LLM(str(demo.SHIPPED), dtype="float32", num_kv_blocks=64) as llm:
        assert llm.engine.runner.model.fused is None
    monkeypatch.setenv("VLMSERVE_FUSED_DECODE", "0")
    with LLM(str(demo.SHIPPED), dtype="bfloat16", num_kv_blocks=64) as llm:
        assert llm.engine.runner.model.fused is None


def test_a_context_past_its_block_table_is_refused(monkeypatch):
    """As the attention kernel's own wrapper refuses it: the kernel trusts every length to stay in its table."""
    with LLM(str(demo.SHIPPED), dtype="bfloat16", num_kv_blocks=64) as llm:
        runner = llm.engine.runner
        plan = runner.model.fused
        from lm_engine.attention.base import AttentionMetadata

        meta = AttentionMetadata(
            slot_mapping=torch.tensor([0]),
            num_decode_tokens=1,
            decode_block_tables=torch.tensor([[0]], dtype=torch.int32),
            decode_context_lens=torch.tensor([40], dtype=torch.int32),  # 40 tokens, one block of 16
            prefill_spans=[],
            prefill_block_tables=[],
            max_decode_context=40,
            all_slots_written=True,
        )
        x = torch.zeros(1, runner.cfg.hidden_size, dtype=torch.bfloat16)
        cos = torch.ones(1, runner.cfg.head_dim, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="exceeds the block table"):
            plan.run(x, cos, cos, runner.kv_caches, meta)
