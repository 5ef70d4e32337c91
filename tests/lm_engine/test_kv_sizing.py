"""The KV pool is sized from a memory budget after a warm-up, never from a fixed guess."""

from __future__ import annotations

from lm_engine import LLM, SamplingParams
from tests.support import user


def test_pool_follows_the_memory_budget(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), kv_cache_memory=4 << 20, max_model_len=2048, max_num_seqs=256)
    runner = llm.engine.runner
    per_block = runner.kv_bytes_per_block()
    cfg = llm.engine.model_config
    assert per_block == cfg.num_hidden_layers * 2 * 16 * cfg.num_key_value_heads * cfg.head_dim * 4
    assert runner.num_blocks == (4 << 20) // per_block
    assert runner.kv_cache.numel() * 4 == runner.num_blocks * per_block
    llm.close()


def test_default_budget_measures_and_serves(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), max_model_len=1024, max_num_seqs=4)
    # Capped by what max_num_seqs × max_model_len can use; the warm-up ran the worst-case step.
    assert 0 < llm.engine.runner.num_blocks <= 4 * 64 + 1
    (out,) = llm.chat([user("hello")], SamplingParams(temperature=0, max_tokens=4))
    assert len(out.token_ids) == 4
    llm.close()


def test_a_cpu_warm_up_runs_a_scaled_down_step_and_scales_its_memory_up(tiny_ckpt, monkeypatch):
    """The worst-case step on a CPU is most of the start at real size: a step of at most 256 tokens and a
    1,024-patch image stands for it, its memory scaled up (tokens linearly, patches quadratically). Scripted
    peak-memory readings, so the arithmetic is checked, not this machine."""
    import lm_engine.model_runner as model_runner

    llm = LLM(str(tiny_ckpt), kv_cache_memory=4 << 20, max_model_len=512)
    runner = llm.engine.runner
    ran = []
    monkeypatch.setattr(runner, "_warm_vision", lambda patches: ran.append(("vision", patches)))
    monkeypatch.setattr(runner, "_warm_decoder", lambda tokens: ran.append(("decoder", tokens)))
    for readings, want in (
        ([100, 110, 110, 130], max(10 * 16, 30 * 8)),  # the decoder raised the peak: the peak above the start
        ([100, 150, 150, 150], max(50 * 16, 50 * 8)),  # it did not: the tower's peak bounds it
    ):
        seq = iter(readings)
        monkeypatch.setattr(model_runner, "peak_rss_bytes", lambda seq=seq: next(seq))
        ran.clear()
        assert runner._warmup_peak(2048, 4096) == want
        assert ran == [("vision", 1024), ("decoder", 256)]
    seq = iter([100, 100, 100, 105])
    monkeypatch.setattr(model_runner, "peak_rss_bytes", lambda: next(seq))
    ran.clear()
    assert runner._warmup_peak(100, 500) == 5  # already small: run as it is, nothing scaled
    assert ran == [("vision", 500), ("decoder", 100)]
    llm.close()


def test_modules_built_uninitialized_take_the_dtype_and_draw_nothing(monkeypatch):
    """Parameters the checkpoint overwrites are neither drawn nor made in float32 first; afterwards torch's
    own initializers and default dtype are back."""
    import torch
    from torch import nn

    from encoder.models.weights import uninitialized

    real_uniform = nn.init.kaiming_uniform_
    drawn = []
    monkeypatch.setattr(torch.Tensor, "uniform_", lambda self, *a, **k: drawn.append(self) or self)
    with uninitialized(torch.bfloat16):
        linear = nn.Linear(8, 4)
        embed = nn.Embedding(10, 4)
        freqs = torch.arange(0, 4, 2, dtype=torch.float)
    assert drawn == []
    assert linear.weight.dtype == embed.weight.dtype == torch.bfloat16 and freqs.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32 and nn.init.kaiming_uniform_ is real_uniform
    nn.Linear(8, 4)
    assert drawn  # drawn again outside
