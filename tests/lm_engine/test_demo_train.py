"""train-demo's training machinery: the tower it trains computes transformers' Qwen2-VL tower, outputs and
gradients, in the shapes it runs them in (a linear patch embedding, images attending in padded groups)."""

from __future__ import annotations

import random

import pytest
import torch

from lm_engine.models import demo_tasks as tasks
from lm_engine.models import demo_train
from lm_engine.models.demo_train import AttentionLayout, Encoder, make_batch
from lm_engine.models.qwen2_vl_make import make_checkpoint


@pytest.fixture(scope="module")
def encoder(tmp_path_factory) -> Encoder:
    return Encoder(make_checkpoint(tmp_path_factory.mktemp("demo"), preset=demo_train.PRESET, seed=0))


def test_fast_tower_computes_transformers_tower(encoder):
    """Images above and below MATH_MAX patches (SDPA and matmul groups), outputs and gradients in float32
    against the same weights run through transformers' own forward methods."""
    fast = demo_train.build_model(seed=0)
    plain = demo_train.build_model(seed=0)
    vision = plain.model.visual
    for module in (vision.patch_embed, *(b.attn for b in vision.blocks)):
        del module.forward  # the class's (transformers') forward again
    assert all(torch.equal(a, b) for a, b in zip(fast.state_dict().values(), plain.state_dict().values()))
    pool = [tasks.sample(31, i) for i in range(40)]
    large = [ex for ex in pool if min(ex.size) >= 400][:2]
    small = [ex for ex in pool if max(ex.size) <= 200][:3]
    budgets = [encoder.pre.max_pixels] * 2 + [encoder.pre.max_pixels // 4] * 3
    batch = make_batch(encoder, large + small, budgets, sequences=False)
    lengths = (batch["grid_thw"][:, 1] * batch["grid_thw"][:, 2]).tolist()
    assert max(lengths) > demo_train.MATH_MAX >= min(lengths), lengths
    outs = []
    for model in (fast, plain):
        feats, pooled, dense = demo_train.encode_images(model, batch)
        (pooled.square().sum() + dense["patch"].pow(3).mean()).backward()
        grads = [
            model.model.visual.patch_embed.proj.weight.grad,
            model.model.visual.blocks[3].attn.qkv.weight.grad,
        ]
        outs.append((torch.cat(feats), dense["patch"], grads))
    (f_tok, f_patch, f_grads), (p_tok, p_patch, p_grads) = outs
    torch.testing.assert_close(f_tok, p_tok, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(f_patch, p_patch, rtol=1e-4, atol=1e-5)
    for f, p in zip(f_grads, p_grads):
        torch.testing.assert_close(f, p, rtol=1e-3, atol=1e-6)


def test_attention_layout_places_every_token_once():
    rng = random.Random(5)
    for _ in range(50):
        lengths = [rng.choice((4, 16, 36, 100, 112, 224, 256, 400, 512)) for _ in range(rng.randint(1, 40))]
        layout = AttentionLayout.of(lengths)
        src = torch.cat([g.src for g in layout.groups])
        assert torch.equal(torch.sort(src).values, torch.arange(sum(lengths)))
        assert torch.equal(src[layout.inverse], torch.arange(sum(lengths)))
        for g in layout.groups:
            assert len(set(g.rows.tolist())) == len(g.rows) == len(g.src)
            assert int(g.rows.max()) < g.b * g.length
            members = (g.bias[:, 0, 0] == 0).sum(dim=-1).tolist()  # each image's real length
            assert sum(members) == len(g.src)
            if g.b > 1:
                assert g.b * g.length**2 <= demo_train.PAD_SLACK * sum(n * n for n in members)
