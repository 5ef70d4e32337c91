"""The KV pool is sized from a memory budget after a warm-up, never from a fixed guess."""

from __future__ import annotations

import pytest

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

    from runtime.weights import uninitialized

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


# -- the budget rule and the fit check, on scripted memory figures ---------------------------------------------

GIB = 1 << 30


def test_the_budget_is_a_share_of_the_start_less_what_else_is_held():
    from lm_engine.memory import kv_budget_bytes

    assert kv_budget_bytes(20 * GIB, 8 * GIB, GIB, 0.9, GIB) == int(20 * GIB * 0.9) - 10 * GIB
    # no cap: a large machine gets a large pool
    assert kv_budget_bytes(200 * GIB, 8 * GIB, GIB, 0.9, GIB) == int(200 * GIB * 0.9) - 10 * GIB
    assert kv_budget_bytes(20 * GIB, 30 * GIB, 0, 0.9, 0) < 0  # nothing left
    assert kv_budget_bytes(20 * GIB, 8 * GIB, GIB, 0.9, GIB, fixed=3 * GIB) == 3 * GIB  # --kv-cache-memory


def test_the_reserve_counts_the_helpers_and_every_extra_tower():
    from lm_engine import memory

    base = memory.runtime_reserve_bytes(512 << 20, 0, 0, tower_bytes=GIB)
    assert base == memory.RUNTIME_RESERVE + (512 << 20)
    assert memory.runtime_reserve_bytes(512 << 20, 2, 0, GIB) == base + 2 * memory.PREPROCESS_WORKER_BYTES
    # each encoder worker loads the tower again; the engine keeps its own copy as the fallback
    assert memory.runtime_reserve_bytes(512 << 20, 0, 3, GIB) == base + 3 * (
        memory.ENCODER_WORKER_BYTES + GIB
    )


# Qwen2.5-VL-7B-Instruct's config.json: 28 layers, 4 KV heads of 128; 16.6 GB of bfloat16 safetensors.
QWEN25_7B = dict(num_hidden_layers=28, num_key_value_heads=4, head_dim=128)
QWEN25_7B_WEIGHTS = 16_580_000_000


def test_the_7b_shape_serves_on_a_24_gib_machine_with_default_flags():
    """`vlmserve serve` defaults (2 preprocess workers on 2 cores) with the memory an idle 24 GiB machine has
    available once the server's imports are in; the warm-up peak is scripted high (1.5 GiB)."""
    from types import SimpleNamespace

    from lm_engine import memory
    from lm_engine.config import EngineConfig

    config = EngineConfig(model="unused")
    available, peak = 22 * GIB, 3 * GIB // 2
    per_token = memory.kv_bytes_per_token(SimpleNamespace(**QWEN25_7B), 2)
    max_model_len = 8192  # the engine's default cap
    min_kv = ((max_model_len + 15) // 16 + 1) * 16 * per_token
    reserve = memory.runtime_reserve_bytes(config.embedding_cache_bytes, 2, 0, tower_bytes=1_340_000_000)
    memory.check_fit(
        available=available,
        weight_bytes=QWEN25_7B_WEIGHTS,
        reserve=reserve,
        kv_bytes_per_token=per_token,
        max_model_len=max_model_len,
        min_kv_bytes=min_kv,
        utilization=config.memory_utilization,
    )
    budget = memory.kv_budget_bytes(available, QWEN25_7B_WEIGHTS, peak, config.memory_utilization, reserve)
    assert budget >= 4 * min_kv  # several full-length sequences, not a bare minimum
    # and everything together stays under the machine's memory, with the share's headroom left
    assert QWEN25_7B_WEIGHTS + peak + reserve + budget <= 0.9 * available + 1


def fit(available, weights=10 * GIB, **kw):
    from lm_engine.memory import check_fit

    args = dict(
        available=available,
        weight_bytes=weights,
        reserve=GIB,
        kv_bytes_per_token=1 << 20,
        max_model_len=4096,
        min_kv_bytes=4097 << 20,
        utilization=0.9,
    )
    check_fit(**{**args, **kw})


def test_a_checkpoint_that_cannot_fit_gets_one_line_saying_what_to_change():
    from lm_engine.memory import NotEnoughMemory

    fit(20 * GIB)  # 10 + 4 + 1 GiB within 18 GiB
    with pytest.raises(NotEnoughMemory) as err:
        fit(16 * GIB)  # 14.4 GiB allowed: the sequence must shrink, or the share grow
    message = str(err.value)
    assert "\n" not in message
    assert "15.0 GiB needed" in message and "14.4 GiB allowed" in message and "16.0 GiB available" in message
    assert "lower --max-model-len to 3481 or less" in message  # 3.4 GiB of room at 1 MiB a token
    assert "raise --memory-utilization to 0.94" in message
    assert "give --kv-cache-memory of at most 5.0 GiB" in message
    with pytest.raises(
        NotEnoughMemory, match="the weights and the runtime alone take more than is available"
    ):
        fit(10 * GIB)


def test_a_fixed_pool_too_large_for_the_machine_is_refused():
    from lm_engine.memory import NotEnoughMemory

    fit(20 * GIB, fixed_kv=9 * GIB)  # utilization does not apply to a given size (as in vLLM)
    with pytest.raises(NotEnoughMemory) as err:
        fit(20 * GIB, fixed_kv=12 * GIB)
    assert "23.0 GiB needed" in str(err.value) and "20.0 GiB available" in str(err.value)
    assert "lower --kv-cache-memory to 9.0 GiB or less" in str(err.value)
    with pytest.raises(NotEnoughMemory, match="--num-kv-blocks"):
        fit(20 * GIB, fixed_kv=12 * GIB, fixed_flag="--num-kv-blocks")


def test_sizes_read_as_flags_give_them():
    from runtime.memory import parse_bytes

    assert (
        parse_bytes("4GiB") == 4 << 30
        and parse_bytes("512 MiB") == 512 << 20
        and parse_bytes("1.5GiB") == 3 << 29
    )
    assert parse_bytes("4G") == parse_bytes("4GB") == 4_000_000_000 and parse_bytes("1234") == 1234
    for bad in ("lots", "-1GiB", "GiB"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_weight_bytes_come_from_the_headers(tiny_ckpt):
    """Every tensor counted once, at the compute dtype's width, the tower's apart; against the tensors themselves."""
    from lm_engine.memory import WeightBytes, checkpoint_weight_bytes
    from runtime.weights import iter_checkpoint_tensors

    tensors = dict(iter_checkpoint_tensors(tiny_ckpt))
    numel = sum(t.numel() for t in tensors.values())
    tower = sum(t.numel() for name, t in tensors.items() if name.startswith("visual."))
    assert 0 < tower < numel
    assert checkpoint_weight_bytes(tiny_ckpt, 4) == WeightBytes(numel * 4, tower * 4)
    assert checkpoint_weight_bytes(tiny_ckpt, 2) == WeightBytes(numel * 2, tower * 2)


# -- the engine ------------------------------------------------------------------------------------------------


def test_the_engine_sizes_the_pool_from_the_memory_at_its_start(tiny_ckpt, monkeypatch):
    """MemAvailable is read once, before loading; weights (from the headers), the scripted warm-up peak and the
    reserve come out of its share."""
    import lm_engine.engine as engine_mod
    import lm_engine.model_runner as model_runner
    from lm_engine.memory import checkpoint_weight_bytes, runtime_reserve_bytes

    reads = []
    monkeypatch.setattr(engine_mod, "available_memory_bytes", lambda: reads.append(1) or 4 * GIB)
    monkeypatch.setattr(model_runner, "available_memory_bytes", lambda: pytest.fail("read after loading"))
    monkeypatch.setattr(model_runner.ModelRunner, "_warmup_peak", lambda self, tokens, patches: 100 << 20)
    llm = LLM(str(tiny_ckpt), dtype="float32", max_model_len=512, max_num_seqs=100_000)
    weights = checkpoint_weight_bytes(tiny_ckpt, 4).total
    reserve = runtime_reserve_bytes(512 << 20, 0, 0, 0)
    budget = int(4 * GIB * 0.9) - weights - (100 << 20) - reserve
    runner = llm.engine.runner
    assert reads == [1]
    assert runner.num_blocks == budget // runner.kv_bytes_per_block()
    assert llm.engine.kv_cache_bytes == runner.num_blocks * runner.kv_bytes_per_block()
    llm.close()


# the tiny preset's keys and values per token in float32: 2 layers × (K, V) × 2 KV heads × 16 × 4 bytes
LLM_KV_PER_TOKEN = 2 * 2 * 2 * 16 * 4


def test_the_engine_refuses_before_reading_any_weight(tiny_ckpt, monkeypatch):
    import lm_engine.engine as engine_mod
    from lm_engine.memory import NotEnoughMemory, checkpoint_weight_bytes, runtime_reserve_bytes

    # room for half of one 4,096-token sequence's KV once the weights and the reserve are in
    held = checkpoint_weight_bytes(tiny_ckpt, 4).total + runtime_reserve_bytes(512 << 20, 0, 0, 0)
    half = 4097 * LLM_KV_PER_TOKEN // 2
    monkeypatch.setattr(engine_mod, "available_memory_bytes", lambda: int((held + half) / 0.9))
    monkeypatch.setattr(engine_mod, "ModelRunner", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(NotEnoughMemory, match=r"lower --max-model-len to (20[0-9][0-9]) or less"):
        LLM(str(tiny_ckpt), dtype="float32", max_model_len=4096)
    with pytest.raises(NotEnoughMemory, match="lower --kv-cache-memory"):
        LLM(str(tiny_ckpt), kv_cache_memory=1 << 30)


def test_serve_exits_with_one_line_when_the_model_cannot_fit(tiny_ckpt, capsys):
    from api.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", str(tiny_ckpt), "--kv-cache-memory", "64TiB", "--preprocess-workers", "0"])
    message = str(exit_.value.code)
    assert message.startswith("vlmserve serve: not enough memory: ") and "\n" not in message
    assert "lower --kv-cache-memory to" in message and "available" in message
