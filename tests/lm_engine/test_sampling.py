"""Sampling, stops, n > 1 and incremental detokenization, checked against independent references."""

from __future__ import annotations

import random

import pytest
import torch

from lm_engine import LLM, SamplingParams
from lm_engine.detokenizer import detokenize_step, flush
from lm_engine.sampler import sample
from lm_engine.sequence import Sequence
from tests.support import image_part, make_image, user

PROMPT = user("Tell me about the old lighthouse by the sea.")


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    with LLM(str(tiny_ckpt), max_num_batched_tokens=256) as engine:
        yield engine


def greedy_text(llm, max_tokens=24):
    (out,) = llm.chat([PROMPT], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return out


def test_seed_reproducible_and_seeds_differ(llm):
    params = SamplingParams(temperature=1.5, max_tokens=20, seed=7)
    a = llm.chat([PROMPT], params)[0].token_ids
    b = llm.chat([PROMPT], params)[0].token_ids
    c = llm.chat([PROMPT], SamplingParams(temperature=1.5, max_tokens=20, seed=8))[0].token_ids
    assert a == b
    assert a != c


def test_top_k_1_and_tiny_top_p_are_greedy(llm):
    ref = greedy_text(llm, 16).token_ids
    for params in (
        SamplingParams(temperature=1.0, top_k=1, max_tokens=16, seed=3, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=16, seed=3, ignore_eos=True),
    ):
        assert llm.chat([PROMPT], params)[0].token_ids == ref


def test_sampler_distribution_matches_softmax_with_top_k_and_top_p():
    """Empirical frequencies against the analytic filtered softmax (a χ²-style bound)."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0]])
    n = 6000
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.9, max_tokens=1)
    seq = Sequence("x", [0], 1, params)
    seq.generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(6)
    for _ in range(n):
        counts[sample(logits, [seq])[0]] += 1
    probs = (logits[0] / 0.8).softmax(-1)
    probs[4:] = 0  # top_k=4
    probs /= probs.sum()
    keep = (probs.cumsum(0) - probs) < 0.9  # the smallest prefix reaching 0.9
    probs = torch.where(keep, probs, 0)
    probs /= probs.sum()
    assert counts[~keep].sum() == 0
    expected = probs * n
    for i in torch.nonzero(keep).flatten():
        assert abs(counts[i] - expected[i]) < 5 * expected[i].sqrt() + 5


def _row(temperature=1.0, top_k=0, top_p=1.0, seed=None) -> Sequence:
    seq = Sequence("x", [0], 1, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    if seed is not None:
        seq.generator = torch.Generator().manual_seed(seed)
    return seq


def test_batched_rows_each_follow_their_own_settings():
    """One batch mixing greedy, unseeded, top-k and top-p rows: each row's frequencies match its own
    filtered softmax, and greedy rows take the argmax every time."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0]]).repeat(4, 1)
    logits[1] = logits[1].flip(0)  # a different argmax per row catches rows mixed up
    rows = [_row(temperature=0.0), _row(temperature=0.7), _row(temperature=1.2, top_k=3), _row(top_p=0.6)]
    n = 3000
    counts = torch.zeros(4, 6)
    for _ in range(n):
        for i, tok in enumerate(sample(logits, rows)):
            counts[i, tok] += 1
    assert counts[0, 0] == n
    for i, (t, k, p) in enumerate([(0.7, 6, 1.0), (1.2, 3, 1.0), (1.0, 6, 0.6)], start=1):
        probs = (logits[i] / t).softmax(-1)
        order = probs.argsort(descending=True)
        probs[order[k:]] = 0
        probs /= probs.sum()
        sorted_p = probs[order]
        keep = torch.zeros(6, dtype=torch.bool)
        keep[order] = (sorted_p.cumsum(0) - sorted_p) < p
        probs = torch.where(keep, probs, 0)
        probs /= probs.sum()
        expected = probs * n
        assert counts[i][~keep].sum() == 0, f"row {i} drew a filtered token"
        for j in torch.nonzero(keep).flatten():
            assert abs(counts[i, j] - expected[j]) < 5 * expected[j].sqrt() + 5, f"row {i} token {j}"


def test_a_seeded_row_draws_the_same_alone_or_in_a_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    batch = [_row(temperature=0.9), _row(temperature=1.3, top_k=20, seed=5), _row(temperature=0.0)]
    alone = [_row(temperature=1.3, top_k=20, seed=5)]
    picks = [(sample(logits, batch)[1], sample(logits[1:2], alone)[0]) for _ in range(20)]
    assert all(a == b for a, b in picks)
    assert len({a for a, _ in picks}) > 1  # really random draws, not a greedy row


def test_sampling_stays_on_the_logits_device(monkeypatch):
    """No copy of the logits off their device, and one .tolist() (the only sync) per call."""
    calls: list[str] = []
    for name in ("tolist", "item", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def spy(self, *a, _name=name, _orig=original, **k):
            calls.append(_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    logits = torch.randn(4, 64)
    rows = [_row(temperature=0.0), _row(temperature=0.8, seed=3), _row(top_k=5), _row(top_p=0.5)]
    sample(logits, rows)
    assert calls == ["tolist"]
    calls.clear()
    sample(logits, [_row(temperature=0.0)] * 4)
    assert calls == ["tolist"]


def test_stop_string_truncates_and_is_reported(llm):
    full = greedy_text(llm, 24)
    text = full.text
    stop = next(
        text[i : i + 2] for i in range(4, len(text) - 2) if text[i : i + 2].strip() == text[i : i + 2]
    )
    (out,) = llm.chat([PROMPT], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop], ignore_eos=True))
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.text == text[: text.index(stop)]
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    (kept,) = llm.chat(
        [PROMPT],
        SamplingParams(
            temperature=0.0, max_tokens=24, stop=[stop], include_stop_str_in_output=True, ignore_eos=True
        ),
    )
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_stop_token_ids_and_max_tokens(llm):
    full = greedy_text(llm, 24).token_ids
    stop_tok = full[5]
    (out,) = llm.chat([PROMPT], SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_tok]))
    assert out.token_ids == full[: full.index(stop_tok) + 1]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop_tok
    (short,) = llm.chat([PROMPT], SamplingParams(temperature=0.0, max_tokens=3))
    assert short.token_ids == full[:3] and short.finish_reason == "length"


def test_n_choices_share_prompt_blocks_with_copy_on_write(llm):
    eng = llm.engine
    conv = user(image_part(make_image(112, 112, 5)), "Describe this picture in detail please.")
    eng.add_request(
        "fork", conv, SamplingParams(n=3, temperature=1.2, seed=11, max_tokens=12, ignore_eos=True)
    )
    forked = False
    outs = None
    copies: list[tuple[int, int]] = []
    original = eng.scheduler.schedule

    def spy():
        out = original()
        copies.extend(out.block_copies)
        return out

    eng.scheduler.schedule = spy
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs = o
        seqs = [s for s in eng.scheduler.running if s.request_id == "fork"]
        if len(seqs) == 3 and not forked:
            forked = True
            # Right after the fork all three share every prompt block.
            assert seqs[0].block_table == seqs[1].block_table == seqs[2].block_table
            assert all(eng.block_manager.allocator.ref_counts[b] == 3 for b in seqs[0].block_table)
        eng.check_integrity()
    eng.scheduler.schedule = original
    copies_seen = bool(copies)
    assert forked and copies_seen, "the shared partial block was never copied on write"
    assert len(outs.outputs) == 3 and len({tuple(c.token_ids) for c in outs.outputs}) > 1
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    # Same seed, same choices.
    (again,) = llm.chat([conv], SamplingParams(n=3, temperature=1.2, seed=11, max_tokens=12, ignore_eos=True))
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in outs.outputs]


def test_incremental_detokenization_never_breaks_utf8(llm):
    tok = llm.engine.processor.tokenizer
    decode = llm.engine.processor.decode
    rng = random.Random(0)
    texts = ["héllo wörld — 中文字符 🙂 emoji 🚀 done", "plain ascii text", "ß∂ƒ©˙∆˚¬…æ 東京 😀😃"]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids
        for trial in range(5):
            noise = [rng.randrange(0, 2000) for _ in range(rng.randint(0, 6))] if trial else []
            out_ids = ids + noise
            seq = Sequence("d", [1], 1, SamplingParams())
            pieces = []
            for t in out_ids:
                seq.token_ids.append(t)
                pieces.append(detokenize_step(seq, decode))
            pieces.append(flush(seq, decode))
            assert "".join(pieces) == seq.output_text == decode(out_ids)
            # Nothing but the very end may hold a replacement character from a split sequence.
            if not noise:
                assert "\ufffd" not in "".join(pieces)
