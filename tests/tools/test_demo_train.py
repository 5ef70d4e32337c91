"""train-demo's training machinery: the tower it trains computes transformers' Qwen2-VL tower, outputs and
gradients, in the shapes it runs them in (a linear patch embedding, images attending in padded groups)."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from tools import demo_tasks as tasks
from tools import demo_train
from tools.demo_train import AttentionLayout, Encoder, make_batch
from tools.qwen2_vl_make import make_checkpoint, original_name


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("demo"), preset=demo_train.PRESET, seed=0)


@pytest.fixture(scope="module")
def encoder(checkpoint) -> Encoder:
    return Encoder(checkpoint)


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
    # NOTE: atol 5e-5, not 1e-5: the per-patch states are summed in another order (padded groups against one
    # image at a time); one element of 312,320 near zero differed by 1.4e-5 (a misplaced token differs by ~1)
    torch.testing.assert_close(f_patch, p_patch, rtol=1e-4, atol=5e-5)
    for f, p in zip(f_grads, p_grads):
        torch.testing.assert_close(f, p, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("sequences", [False, True])
def test_training_batches_from_pictures_equal_batches_from_files(encoder, checkpoint, sequences, monkeypatch):
    """Training draws its PNG examples as pictures (no encode, no decode): every tensor of a batch, tower
    phase's and whole model's, equals the one made from the examples' files, PNG and JPEG alike."""
    kinds = ("single", "many", "number", "numbers") if not sequences else tasks.KINDS
    files = [tasks.sample(11, i, kinds[i % len(kinds)]) for i in range(12)]
    drawn = [tasks.sample(11, i, kinds[i % len(kinds)], picture=True) for i in range(12)]
    pngs = [ex.fmt == "PNG" for ex in files]
    assert any(pngs) and not all(pngs)
    assert [ex.picture is not None for ex in drawn] == pngs
    assert all(ex.data for ex, png in zip(drawn, pngs) if not png) and not any(ex.picture for ex in files)
    for budget in (encoder.pre.max_pixels, encoder.pre.min_pixels):
        a = make_batch(encoder, files, [budget] * 12, sequences=sequences)
        b = make_batch(encoder, drawn, [budget] * 12, sequences=sequences)
        flat_a, flat_b = _tensors(a), _tensors(b)
        assert flat_a.keys() == flat_b.keys()
        for key, tensor in flat_a.items():
            assert torch.equal(tensor, flat_b[key]), key
    # and training asks for pictures, in both phases
    asked = []
    sample = tasks.sample
    monkeypatch.setattr(tasks, "sample", lambda *a, **kw: asked.append(kw.get("picture")) or sample(*a, **kw))
    cfg = demo_train.TrainConfig(steps=1, batch_images=4, tower_steps=1, tower_batch_images=4)
    assert next(iter(demo_train.TrainBatches(checkpoint, cfg, tower=not sequences)))["grid_thw"].shape[0] == 4
    assert asked == [True] * 4


def _tensors(batch: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in batch.items():
        if isinstance(value, dict):
            out |= _tensors(value, f"{prefix}{key}.")
        else:
            out[prefix + key] = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    return out


def test_a_kept_tower_phase_gives_the_whole_runs_weights(tmp_path, monkeypatch):
    """A run that keeps its tower phase, and one that starts phase 2 from what was kept (another phase 2
    length), write to the byte the weights of runs without a snapshot; other phase-1 settings are not served
    from it."""
    from safetensors.torch import load_file

    cfg = demo_train.TrainConfig(
        tower_steps=2, tower_batch_images=2, steps=2, batch_images=2, eval_every=0, eval_per_task=1
    )
    other_phase2 = dataclasses.replace(cfg, steps=3, count_weight=2.0)
    kept, lines = tmp_path / "tower", []

    def weights(name: str, config=cfg, **kw) -> dict[str, torch.Tensor]:
        return load_file(
            demo_train.train(tmp_path / name, config, log=lines.append, **kw) / "model.safetensors"
        )

    plain, plain_other = weights("plain"), weights("plain-other", other_phase2)
    keeping = weights("keeping", tower_snapshot=kept)
    assert (kept / demo_train.SNAPSHOT_FILE).is_file()

    def no_tower_phase(*args, **kwargs):
        raise AssertionError("the tower phase ran again")

    monkeypatch.setattr(demo_train, "train_tower", no_tower_phase)
    lines.clear()
    resumed = weights("resumed", other_phase2, tower_snapshot=kept)
    assert any("the tower phase from" in line for line in lines), lines
    meta = json.loads((tmp_path / "resumed" / "demo_training.json").read_text())
    assert meta["tower_phase_from"]["snapshot"] == str(kept)
    for got, want in ((keeping, plain), (resumed, plain_other)):
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
    assert not all(torch.equal(plain[k], plain_other[k]) for k in plain)  # phase 2's length mattered

    # another phase-1 setting: the kept phase is not used (the tower phase would run again)
    for changed in (
        dataclasses.replace(cfg, tower_count_weight=1.0),
        dataclasses.replace(cfg, tower_steps=3),
    ):
        assert demo_train.tower_phase_key(changed) != demo_train.tower_phase_key(cfg)
        with pytest.raises(AssertionError, match="ran again"):
            weights("changed", changed, tower_snapshot=kept)
    assert demo_train.tower_phase_key(other_phase2) == demo_train.tower_phase_key(cfg)


def test_frozen_tower_blocks_keep_phase_ones_weights(tmp_path):
    """``frozen_tower_blocks``: phase 2 leaves the patch embedding and the lowest blocks at the weights the
    tower phase gave them (weight decay included) and trains the blocks above; the setting is phase 2's alone
    (a kept tower phase serves it)."""
    from safetensors.torch import load_file

    cfg = demo_train.TrainConfig(
        tower_steps=2,
        tower_batch_images=2,
        steps=2,
        batch_images=2,
        eval_every=0,
        eval_per_task=1,
        frozen_tower_blocks=3,
        decoder_attention="math",
    )
    kept = tmp_path / "tower"
    out = demo_train.train(tmp_path / "run", cfg, log=lambda line: None, tower_snapshot=kept)
    after = load_file(out / "model.safetensors")
    phase1 = torch.load(kept / demo_train.SNAPSHOT_FILE, weights_only=True)["model"]
    plain = dataclasses.replace(cfg, frozen_tower_blocks=0, decoder_attention="sdpa")
    assert demo_train.tower_phase_key(cfg) == demo_train.tower_phase_key(plain)
    frozen = ("model.visual.patch_embed.", *(f"model.visual.blocks.{i}." for i in range(3)))
    checked = {"frozen": 0, "trained": 0}
    for name, start in phase1.items():
        saved = after[original_name(name)]
        if name.startswith(frozen):
            assert torch.equal(saved, start.to(saved.dtype)), name
            checked["frozen"] += 1
        # block 3's matrices must move; its norms' ones move less than bf16's step in two small steps
        elif name.startswith("model.visual.blocks.3.") and start.ndim == 2:
            assert not torch.equal(saved, start.to(saved.dtype)), name
            checked["trained"] += 1
    assert checked["frozen"] >= 3 * 8 and checked["trained"] >= 4, checked
    with pytest.raises(ValueError, match="has 8 blocks"):
        demo_train.freeze_lower_tower(demo_train.build_model(seed=0), 9)


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


def test_token_slots_name_each_digit_by_its_place_in_its_number():
    """Numbers placed by hand on a 4 x 6 grid of merged tokens over a 120 x 80 image (20 px a token)."""
    N = demo_train.NO_DIGIT
    five_two_nine = [(21.0, 10.0, "5"), (31.0, 10.0, "2"), (38.0, 10.0, "9")]  # one token, places 0-2
    seven = [(45.0, 12.0, "7")]  # a number of its own (another line): place 0, the next token
    forty = [(109.0, 79.0, "4"), (119.0, 79.0, "0")]  # the last token
    shape = (70.0, 50.0, "circle red")  # shapes name no digit
    objects = (*five_two_nine, shape, *seven, *forty)
    ex = tasks.Example(kind="numbers", data=b"", fmt="PNG", size=(120, 80), qa={}, objects=objects)
    slots = demo_train.token_slots(ex, rows=4, cols=6)
    want = torch.full((24, demo_train.SLOTS), N)
    want[1] = torch.tensor([5, 2, 9, N])
    want[2] = torch.tensor([7, N, N, N])
    want[23] = torch.tensor([4, 0, N, N])
    assert torch.equal(slots, want)
    # a number spread over tokens: each digit in the token under its centre, at its own place
    wide = dataclasses.replace(ex, objects=((10.0, 30.0, "8"), (30.0, 30.0, "1"), (50.0, 30.0, "6")))
    got = demo_train.token_slots(wide, rows=4, cols=6)
    assert (
        got[6].tolist() == [8, N, N, N]
        and got[7].tolist() == [N, 1, N, N]
        and got[8].tolist() == [N, N, 6, N]
    )
    assert (got[[i for i in range(24) if i not in (6, 7, 8)]] == N).all()


def test_tower_batches_carry_token_slots_for_every_merged_token(encoder):
    """The slots line up with the tower's merged tokens: one row per token of every image, digits only where
    a number is drawn (on the several-number images of the tower's phase, several numbers' digits)."""
    examples = [tasks.sample(3, i, kind) for i, kind in enumerate(("numbers", "number", "many", "numbers"))]
    batch = make_batch(encoder, examples, [encoder.pre.max_pixels] * 4, sequences=False)
    slots = batch["aux"]["token_slots"]
    tokens = batch["grid_thw"].prod(-1) // 4
    assert slots.shape == (int(tokens.sum()), demo_train.SLOTS)
    per_image = slots.split(tokens.tolist())
    for ex, s in zip(examples, per_image):
        named = sorted(d for d in s.flatten().tolist() if d != demo_train.NO_DIGIT)
        drawn = sorted(int(label) for _, _, label in ex.objects if label.isdigit())
        assert named == drawn, ex.kind  # each digit in exactly one token, at one place
    assert (per_image[2] == demo_train.NO_DIGIT).all()
    assert batch["aux"]["digits"][0].tolist() == [-100] * demo_train.AUX_DIGITS  # no single answer


def test_count_weight_scales_the_count_heads_loss_alone(encoder):
    """TrainConfig's count weights reach AuxHeads.loss, which multiplies the per-image count head's cross
    entropy (recomputed here with torch's) and no other term: the other heads' gradients do not move."""
    model = demo_train.build_model(seed=0)
    aux = demo_train.AuxHeads(model.config.text_config.hidden_size, model.config.vision_config.embed_dim)
    examples = [tasks.sample(5, i, kind) for i, kind in enumerate(("many", "single", "many", "number"))]
    batch = make_batch(encoder, examples, [encoder.pre.max_pixels // 4] * 4, sequences=False)
    with torch.no_grad():
        _, pooled, dense = demo_train.encode_images(model, batch)
    target = batch["aux"]["count"]
    assert (target[[0, 2]] != -100).all() and (target[3] == -100)  # the shape images carry a count
    count_ce = torch.nn.functional.cross_entropy(aux.count(pooled), target, ignore_index=-100)

    def loss_and_grads(weight: float) -> tuple[float, dict[str, torch.Tensor]]:
        aux.zero_grad()
        loss = aux.loss(pooled, dense, batch["aux"], count_weight=weight)
        loss.backward()
        return loss.item(), {name: p.grad.clone() for name, p in aux.named_parameters() if p.grad is not None}

    one, grads_one = loss_and_grads(1.0)
    three, grads_three = loss_and_grads(3.0)
    assert three - one == pytest.approx(2 * count_ce.item(), rel=1e-4)
    for name, grad in grads_one.items():
        if name.startswith("count."):
            assert not torch.allclose(grads_three[name], grad)
            torch.testing.assert_close(grads_three[name], 3 * grad)
        else:
            torch.testing.assert_close(grads_three[name], grad)
    # the defaults are the shipped checkpoint's recipe, as its demo_training.json records it: phases 1 and 2 as
    # the run the tool phase started from records them, the tool phase's knobs as the tool phase does
    from tools import demo

    meta = json.loads((demo.SHIPPED / "demo_training.json").read_text())
    assert meta["phase"] == "tools"
    defaults = json.loads(json.dumps(dataclasses.asdict(demo_train.TrainConfig())))
    tool = {k: defaults.pop(k) for k in list(defaults) if k.startswith("tool_")}
    assert tool == {k: v for k, v in meta["train_config"].items() if k.startswith("tool_")}
    base = meta["from"]["training"]["train_config"]
    assert defaults == base


@pytest.mark.parametrize("decoder_attention", ["sdpa", "math"])
def test_shared_prefix_rows_compute_each_question_alone(encoder, decoder_attention):
    """A row holding an image's prefix once and each question's block after it gives every answer token the
    logits transformers' own forward gives that question as a sequence of its own (its 2-D padding mask and
    the M-RoPE positions it computes itself, through torch's SDPA), and the loss's gradient reaches the tower
    the same way; with the decoder's attention as ``math_attention`` too."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    model = demo_train.build_model(seed=0, decoder_attention=decoder_attention)
    # colour, shape and description; count and description; a number; sizes between budgets
    examples = [tasks.sample(9, i, kind) for i, kind in enumerate(("single", "many", "number", "single"))]
    budgets = [encoder.pre.max_pixels, encoder.pre.max_pixels // 4, encoder.pre.max_pixels // 2, 20_000]
    batch = make_batch(encoder, examples, budgets)
    assert batch["sequences"] == sum(len(ex.qa) for ex in examples) and (batch["block"] > 1).any()

    feats, _, _ = demo_train.encode_images(model, batch)
    ours, where = demo_train.answer_logits(model, batch, feats)
    ours_loss = torch.nn.functional.cross_entropy(ours, batch["labels"][where])
    qkv = model.model.visual.blocks[0].attn.qkv.weight
    grad_ours = torch.autograd.grad(ours_loss, qkv, retain_graph=True)[0]  # the tower graph serves both

    # the reference: one sequence per (image, question), as train-demo built them before sharing the prefix
    seqs = []
    for i, ex in enumerate(examples):
        n_tok = int(batch["grid_thw"][i].prod()) // 4
        for task, answer in ex.qa.items():
            text = (
                f"<|im_start|>system\n{demo_train.SYSTEM}<|im_end|>\n<|im_start|>user\n<|vision_start|>"
                + "<|image_pad|>" * n_tok
                + f"<|vision_end|>{tasks.QUESTIONS[task]}<|im_end|>\n<|im_start|>assistant\n"
            )
            prompt = encoder.tok.encode(text, add_special_tokens=False).ids
            assert prompt == encoder.prefix(n_tok) + encoder.question(tasks.QUESTIONS[task])
            seqs.append((i, prompt, encoder.answer(answer)))
    length = max(len(p) + len(a) for _, p, a in seqs)
    ids = torch.full((len(seqs), length), encoder.ids["<|endoftext|>"])
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for row, (_, prompt, answer) in enumerate(seqs):
        ids[row, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        mask[row, : len(prompt) + len(answer)] = 1
        labels[row, len(prompt) - 1 : len(prompt) + len(answer) - 1] = torch.tensor(answer)
    image_of_seq = torch.tensor([i for i, *_ in seqs])
    demo_train.use_decoder_attention(model, "sdpa")
    out = model.model(
        input_ids=ids,
        attention_mask=mask,
        image_grid_thw=batch["grid_thw"][image_of_seq],
        mm_token_type_ids=(ids == model.config.image_token_id).int(),
        mm_encoder_outputs={
            "image": BaseModelOutputWithPooling(pooler_output=tuple(feats[i] for i in image_of_seq.tolist()))
        },
        use_cache=False,
    )
    theirs = model.lm_head(out.last_hidden_state[labels != -100]).float()
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    theirs_loss = torch.nn.functional.cross_entropy(theirs, labels[labels != -100])
    grad_theirs = torch.autograd.grad(theirs_loss, qkv, retain_graph=True)[0]
    torch.testing.assert_close(grad_ours, grad_theirs, rtol=1e-3, atol=1e-6)

    # and forward's per-question exact match follows the labels of each question
    loss, exact = demo_train.forward(model, batch)
    assert exact.shape == (len(seqs),) and loss.item() == pytest.approx(ours_loss.item(), rel=1e-5)


def _pointers(batch: dict) -> list[tuple[int, int, int, int, float]]:
    p = batch["pointer"]
    return list(zip(*(p[k].tolist() for k in ("row", "query", "key", "head", "weight"))))


@pytest.mark.parametrize("sink_mass", [1.0, 4.0])
def test_pointer_targets_follow_the_digits_left_to_right_and_the_shapes(encoder, monkeypatch, sink_mass):
    """Checked against the task set's own geometry (each object's centre in the original image, mapped to the
    merged grid the preprocessing produced) and the batch's own labels and ids: on the digit head, the query
    predicting the k-th digit looks at the token under the k-th digit from the left, the one predicting the
    end of the turn at <|vision_start|>; on the count head, the count's query puts m/(m+n) on the sink and
    1/(m+n) on each shape's centre token (m: COUNT_SINK_MASS). Both questions of an image carry them: "4071" and "the number 4071",
    "3" and "3 shapes"."""
    pool = (tasks.sample(5, i, "number") for i in range(40))
    numbers = [ex for ex in pool if len(ex.qa["number"]) >= 3][:2]
    examples = numbers + [tasks.sample(5, i, "many") for i in range(2)]
    monkeypatch.setattr(demo_train, "COUNT_SINK_MASS", sink_mass)
    batch = make_batch(encoder, examples, [encoder.pre.max_pixels] * len(examples))
    ids, labels = batch["input_ids"], batch["labels"]
    digit_of = {encoder.tok.token_to_id(d): d for d in "0123456789"}
    by_query: dict[tuple[int, int, int], list[tuple[int, float]]] = {}
    for row, query, key, head, weight in _pointers(batch):
        by_query.setdefault((row, query, head), []).append((key, weight))
    checked = {"digit": 0, "end": 0, "count": 0}
    for (row, query, head), looks in by_query.items():
        ex = examples[row]
        _, gh, gw = batch["grid_thw"][row].tolist()
        rows, cols = gh // 2, gw // 2
        sink = ids[row].tolist().index(encoder.ids["<|vision_start|>"])
        label = int(labels[row, query])

        def cell(x: float, y: float, ex=ex, rows=rows, cols=cols) -> int:
            return min(rows - 1, int(y * rows / ex.size[1])) * cols + min(
                cols - 1, int(x * cols / ex.size[0])
            )

        assert sum(w for _, w in looks) == pytest.approx(1.0)
        if head == demo_train.DIGIT_HEAD:
            assert ex.kind == "number"
            if label == encoder.end:
                assert looks == [(sink, 1.0)]
                checked["end"] += 1
                continue
            first = query  # this answer's first label
            while labels[row, first - 1] != -100:
                first -= 1
            place = sum(t in digit_of for t in labels[row, first:query].tolist())
            x, y, d = sorted(ex.objects)[place]  # the digits of one line, left to right
            assert digit_of[label] == d
            assert looks == [(sink + 1 + cell(x, y), 1.0)]
            checked["digit"] += 1
        else:
            assert head == demo_train.COUNT_HEAD and ex.kind == "many"
            n = len(ex.objects)
            assert digit_of[label] == str(n)
            want: dict[int, float] = {sink: sink_mass / (sink_mass + n)}
            for x, y, _ in ex.objects:
                want[sink + 1 + cell(x, y)] = want.get(sink + 1 + cell(x, y), 0.0) + 1 / (sink_mass + n)
            assert dict(looks) == pytest.approx(want)
            assert all(int(ids[row, k]) == encoder.image_pad for k in want if k != sink)
            checked["count"] += 1
    assert checked == {
        "digit": 2 * sum(len(ex.qa["number"]) for ex in numbers),
        "end": 2 * len(numbers),
        "count": 2 * 2,
    }


def test_pointer_loss_reads_the_layers_own_attention(encoder, monkeypatch):
    """The pointer's attention, recomputed from the layer's inputs, against the attention weights transformers'
    eager attention returns for the same layer and heads (float32, random weights). Eager attention adds its
    mask, so the oracle's run gets the block mask as 0 / -inf."""
    model = demo_train.build_model(seed=0).eval()
    examples = [tasks.sample(6, i, kind) for i, kind in enumerate(("number", "many", "number"))]
    batch = make_batch(encoder, examples, [encoder.pre.max_pixels // 2] * 3)
    with torch.no_grad():
        feats, _, _ = demo_train.encode_images(model, batch)
        seen: dict = {}
        demo_train.answer_logits(model, batch, feats, seen)
        got = demo_train.pointer_loss(model, seen, batch["pointer"])

        weights = {}
        layer = model.model.language_model.layers[demo_train.POINTER_LAYER].self_attn
        handle = layer.register_forward_hook(lambda m, args, out: weights.update(w=out[1]))
        model.model.language_model.config._attn_implementation = "eager"
        allowed = demo_train.block_mask
        monkeypatch.setattr(
            demo_train,
            "block_mask",
            lambda block: torch.zeros(()).masked_fill(~allowed(block), float("-inf")),
        )
        demo_train.answer_logits(model, batch, feats)
        handle.remove()
    p = batch["pointer"]
    picked = weights["w"][p["row"], p["head"], p["query"], p["key"]]
    queries = len({(r, q, h) for r, q, _, h, _ in _pointers(batch)})
    want = -(p["weight"] * torch.log(picked)).sum() / queries
    assert queries >= 3 and torch.isfinite(want)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_tool_merge_interpolates_from_the_weights_the_checkpoint_stores():
    """``tool_merge``: alpha 0 gives the base back, 1 the trained weights as the checkpoint stores them (bf16,
    to float32 rounding), and between them the straight line from the one to the other."""
    base = {"w": torch.randn(64, 32), "b": torch.randn(32)}
    trained = {k: v + 0.1 * torch.randn_like(v) for k, v in base.items()}
    stored = {k: v.to(torch.bfloat16).float() for k, v in trained.items()}
    for name in base:
        assert torch.equal(demo_train.interpolate(base, trained, 0.0)[name], base[name])
        torch.testing.assert_close(demo_train.interpolate(base, trained, 1.0)[name], stored[name])
        merged = demo_train.interpolate(base, trained, 0.7)[name]
        torch.testing.assert_close(merged, base[name] + 0.7 * (stored[name] - base[name]))
        assert not torch.allclose(merged, base[name]) and not torch.allclose(merged, stored[name])
