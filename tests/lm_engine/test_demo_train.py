"""train-demo's training machinery: the tower it trains computes transformers' Qwen2-VL tower, outputs and
gradients, in the shapes it runs them in (a linear patch embedding, images attending in padded groups); the
decoder's pointer targets point at the digits in reading order and at the shapes' centres (against the task
set's own geometry: the digits' and shapes' centres PIL drew them at)."""

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


def _pointer_rows(batch, row):
    p = batch["pointer"]
    mine = p["seq"] == row
    by_query: dict[int, list[tuple[int, float]]] = {}
    for q, k, w in zip(p["query"][mine].tolist(), p["key"][mine].tolist(), p["weight"][mine].tolist()):
        by_query.setdefault(q, []).append((k, w))
    return by_query


def test_number_pointer_reads_the_digits_left_to_right(encoder):
    image_pad, start = encoder.ids["<|image_pad|>"], encoder.ids["<|vision_start|>"]
    checked = 0
    for i in range(40):
        ex = tasks.sample(47, i, "number")
        if len(ex.qa["number"]) < 2:
            continue
        batch = make_batch(encoder, [ex], [encoder.pre.max_pixels], task_filter="number")
        _, gh, gw = batch["grid_thw"][0].tolist()
        cols = gw // 2
        ids, labels = batch["input_ids"][0], batch["labels"][0]
        queries = _pointer_rows(batch, 0)
        answer_positions = torch.nonzero(labels != -100).flatten().tolist()
        # one query per digit and one for the end of the answer, the positions that predict them
        assert sorted(queries) == answer_positions
        first = int(torch.nonzero(ids == image_pad)[0])
        centres = []
        for k, q in enumerate(sorted(queries)):
            targets = queries[q]
            assert sum(w for _, w in targets) == pytest.approx(1.0, abs=1e-5)
            if k == len(ex.qa["number"]):
                assert [int(ids[key]) for key, _ in targets] == [start]  # the end: the sink
                continue
            assert encoder.tok.id_to_token(int(labels[q])) == ex.qa["number"][k]
            assert all(int(ids[key]) == image_pad for key, _ in targets)
            column = sum(((key - first) % cols + 0.5) * w for key, w in targets)
            centres.append(column)
            # the task set's own centre of that digit, on the token grid
            drawn = ex.objects[k][0] / ex.size[0] * cols
            assert abs(column - drawn) <= 1.0, (ex.qa, k, column, drawn)
        assert centres == sorted(centres) or len(set(round(c) for c in centres)) == 1
        checked += 1
    assert checked >= 20


def test_count_pointer_points_at_each_centre_and_the_sink(encoder):
    start = encoder.ids["<|vision_start|>"]
    for i in range(12):
        ex = tasks.sample(53, i, "many" if i % 3 else "single")
        batch = make_batch(encoder, [ex], [encoder.pre.max_pixels], task_filter="count")
        _, gh, gw = batch["grid_thw"][0].tolist()
        rows, cols = gh // 2, gw // 2
        ids = batch["input_ids"][0]
        queries = _pointer_rows(batch, 0)
        assert len(queries) == 1  # the count's digit; nothing for the end
        (targets,) = queries.values()
        n = int(ex.qa["count"])
        weights = dict(targets)
        sink = int(torch.nonzero(ids == start)[0])
        assert weights.pop(sink) == pytest.approx(1 / (n + 1))
        first = sink + 1
        expected: dict[int, float] = {}
        for x, y, _ in ex.objects:
            row, col = min(rows - 1, int(y / ex.size[1] * rows)), min(cols - 1, int(x / ex.size[0] * cols))
            cell = row * cols + col
            expected[first + cell] = expected.get(first + cell, 0.0) + 1 / (n + 1)
        assert weights == pytest.approx(expected)


def test_pointer_loss_is_the_cross_entropy_of_the_pointer_head():
    seqs, length = 2, 6
    attn = torch.full((seqs, 4, length, length), 1.0 / length)
    targets = [[(3, 1, 0.25), (3, 2, 0.75)], [(4, 0, 1.0)]]
    pointer = demo_train.stack_pointers(targets)
    layers = tuple(attn.clone() for _ in range(4))
    uniform = demo_train.pointer_loss(layers, pointer)
    assert uniform.item() == pytest.approx(-torch.log(torch.tensor(1.0 / length + 1e-6)).item(), rel=1e-5)
    exact = [a.clone() for a in layers]
    head = exact[demo_train.POINTER_LAYER][:, demo_train.POINTER_HEAD]
    head[0, 3] = torch.tensor([0, 0.25, 0.75, 0, 0, 0])
    head[1, 4] = torch.tensor([1.0, 0, 0, 0, 0, 0])
    best = demo_train.pointer_loss(tuple(exact), pointer).item()
    entropy = -(0.25 * torch.log(torch.tensor(0.25)) + 0.75 * torch.log(torch.tensor(0.75))).item() / 2
    assert best == pytest.approx(entropy, abs=1e-4)
    assert best < uniform.item()
