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
