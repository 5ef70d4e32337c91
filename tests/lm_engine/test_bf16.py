"""bfloat16 numerics match transformers' own bfloat16 (forced dtype, so these run on any CPU)."""

from __future__ import annotations

import random

import pytest
import torch

from lm_engine import LLM, SamplingParams
from tests.support import user

WORDS = "lighthouse keeper sea storm night ship harbor wave light rock the a and of to".split()


def long_prompts() -> list[list[dict]]:
    """Six text prompts of 1,500 to 3,200 tokens: where a rounded rotary frequency is off by radians."""
    rng = random.Random(0)
    return [user(" ".join(rng.choice(WORDS) for _ in range(n))) for n in (720, 860, 1000, 1150, 1300, 1450)]


@pytest.fixture(scope="module")
def bf16_engine(tiny_ckpt):
    llm = LLM(
        str(tiny_ckpt),
        dtype="bfloat16",
        max_model_len=4096,
        max_num_batched_tokens=1024,  # prompts longer than this are prefilled in chunks from the paged cache
        enable_prefix_caching=False,
    )
    yield llm
    llm.close()


def test_rotary_frequencies_stay_float32(bf16_engine):
    runner = bf16_engine.engine.runner
    assert {p.dtype for p in runner.model.parameters()} == {torch.bfloat16}
    freqs = {name: buf.dtype for name, buf in runner.model.named_buffers() if "inv_freq" in name}
    assert freqs and set(freqs.values()) == {torch.float32}, freqs
    # The vision tower (bf16 weights) builds its rotary tables in float32 at every pass, from the positions:
    # there is no frequency buffer a module cast could round.
    assert {p.dtype for p in runner.vision.parameters()} == {torch.bfloat16}
    batch = runner.vision.metadata([(1, 40, 60)], torch.device("cpu"))
    assert batch.cos.dtype == batch.sin.dtype == torch.float32
    assert float(batch.cos.min()) < 0.99  # positions up to 59 really turned the tables


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_first_token_agrees_with_transformers_bf16_on_long_prompts(bf16_engine, hf_oracle, tiny_ckpt):
    """At least as close to transformers bf16 as transformers bf16 is to its own float32 (the noise floor),
    in first greedy tokens and in the logits themselves."""
    from transformers import AutoModelForImageTextToText

    convs = long_prompts()
    ids = [hf_oracle.inputs(c)["input_ids"] for c in convs]
    assert min(i.shape[1] for i in ids) >= 1500
    hf_bf16 = AutoModelForImageTextToText.from_pretrained(str(tiny_ckpt), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref = [hf_bf16(input_ids=i).logits[0, -1].float() for i in ids]
        floor = [hf_oracle.model(input_ids=i).logits[0, -1].float() for i in ids]

    model = bf16_engine.engine.runner.model
    seen: list[torch.Tensor] = []
    compute_logits = model.compute_logits

    def spy(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(compute_logits(hidden))
        return seen[-1]

    model.compute_logits = spy
    try:
        outs = bf16_engine.chat(convs, SamplingParams(temperature=0, max_tokens=1))
        ours_batched = [o.token_ids[0] for o in outs]
        seen.clear()
        for conv in convs:  # one at a time, for each prompt's own logits
            bf16_engine.chat([conv], SamplingParams(temperature=0, max_tokens=1))
    finally:
        del model.compute_logits
    ours = [s[0] for s in seen]
    top = [int(r.argmax()) for r in ref]
    agree = sum(a == b for a, b in zip(ours_batched, top))
    floor_agree = sum(int(f.argmax()) == b for f, b in zip(floor, top))
    err = sum(_relative(o, r) for o, r in zip(ours, ref)) / len(ref)
    floor_err = sum(_relative(r, f) for r, f in zip(ref, floor)) / len(ref)
    print(f"first tokens: ours/hf-bf16 {agree}/{len(ref)}, hf-bf16/hf-fp32 {floor_agree}/{len(ref)}")
    print(f"logits relative error: ours/hf-bf16 {err:.4f}, hf-bf16/hf-fp32 {floor_err:.4f}")
    assert [int(o.argmax()) for o in ours] == ours_batched  # batched and alone agree
    assert agree >= floor_agree
    assert err <= floor_err


def test_prefill_runs_the_causal_kernel_where_it_applies(bf16_engine, monkeypatch):
    """The first-token test above checks the numbers; this checks which code made them: where the vision
    attention library has bf16 dot products, every prefill chunk (whole prompts and chunks after a cached
    prefix) goes through its causal kernel, elsewhere through torch's attention."""
    from lm_engine.attention import torch_backend
    from runtime import cpu_kernel

    backend = bf16_engine.engine.runner.backend
    calls: list[tuple[int, int]] = []
    real = cpu_kernel.causal_attention

    def spy(lib, q, k, v, scale, num_threads=None, amx=False):
        calls.append((q.shape[0], k.shape[0]))
        return real(lib, q, k, v, scale, num_threads, amx)

    monkeypatch.setattr(torch_backend.cpu_kernel, "causal_attention", spy)
    bf16_engine.chat(long_prompts()[-1:], SamplingParams(temperature=0, max_tokens=2))
    probe = torch.empty(1, 1, 16, dtype=torch.bfloat16)
    cfg = bf16_engine.engine.runner.cfg
    shape = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    if backend.name == "cpu" and cpu_kernel.causal_supported(backend.prefill_lib, probe):
        assert shape in backend.causal_choice  # timed at start-up, before any request
    if backend.name == "cpu" and backend.causal_choice.get(shape, "sdpa") != "sdpa":
        assert len(calls) >= 2 and any(lk > lq for lq, lk in calls), calls  # chunked: a cached prefix too
    else:
        assert calls == []


def test_prefill_kernel_choice_follows_the_timing(monkeypatch):
    """The causal kernel is kept only where it timed faster than SDPA: fake clocks make either side slower.
    (No library: no AMX variant to time.)"""
    from lm_engine.attention import torch_backend
    from runtime import cpu_kernel

    monkeypatch.setattr(cpu_kernel, "causal_attention", lambda lib, q, k, v, scale, amx=False: None)

    def clock(slow: str):
        """Called twice a run (start, end); runs alternate kernel, sdpa; the slow side's runs take 10 s."""
        order, ticks = iter(["kernel", "sdpa"] * 3), []

        def timer() -> float:
            ticks.append(0.0 if len(ticks) % 2 == 0 else 10.0 if next(order) == slow else 1.0)
            return ticks[-1]

        return timer

    for slow, want in (("kernel", "sdpa"), ("sdpa", "kernel")):
        timer = clock(slow)
        assert torch_backend.fastest_prefill(None, 4, 2, 16, tokens=32, timer=timer) == want
