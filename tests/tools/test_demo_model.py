"""``vlmserve train-demo``: its flags reach the training config, and the checkpoint it writes (the demo
preset, bf16 under the original key names) loads in transformers and serves the same greedy tokens from
vlmserve's engine as from transformers' generate()."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from api.cli import main
from lm_engine import LLM, SamplingParams
from tests.support import HFOracle, image_part, user
from tools import demo_tasks as tasks
from tools import demo_train
from tools.demo_train import TrainConfig
from tools.qwen2_vl_make import make_checkpoint

MAX_NEW = 12


def test_train_demo_flags_map_to_the_train_config(monkeypatch, tmp_path):
    calls: list[tuple[str, TrainConfig, str | None]] = []

    def train(out, cfg, tower_snapshot=None):
        calls.append((out, cfg, tower_snapshot))
        return Path(out)

    def train_tools(out, base, cfg):
        calls.append((out, cfg, f"from {base}"))
        return Path(out)

    monkeypatch.setattr(demo_train, "train", train)
    monkeypatch.setattr(demo_train, "train_tools", train_tools)
    out, kept = str(tmp_path / "ckpt"), str(tmp_path / "tower")
    flags = ["--seed", "3", "--tower-steps", "9", "--steps", "17", "--batch-images", "5", "--eval-every", "0"]
    flags += ["--compute-dtype", "float32", "--tower-snapshot", kept]
    flags += ["--frozen-tower-blocks", "4", "--decoder-attention", "math"]
    assert main(["train-demo", "--out", out, *flags]) == 0
    assert main(["train-demo", "--out", out]) == 0
    assert main(["train-demo", "--out", out, "--from", kept, "--tool-steps", "7", "--seed", "2"]) == 0
    tool_flags = ["--tool-images", "4", "--tool-lr", "2e-4", "--tool-weight", "2", "--tool-value-weight", "6"]
    tool_flags += ["--tool-kinds", "single=0.6,number=0.4", "--tool-merge", "0.5"]
    assert main(["train-demo", "--out", out, "--from", kept, *tool_flags]) == 0
    assert calls == [
        (
            out,
            TrainConfig(
                seed=3,
                tower_steps=9,
                steps=17,
                batch_images=5,
                eval_every=0,
                compute_dtype="float32",
                frozen_tower_blocks=4,
                decoder_attention="math",
            ),
            kept,
        ),
        (out, TrainConfig(), None),
        (out, TrainConfig(seed=2, tool_steps=7), f"from {kept}"),
        (
            out,
            TrainConfig(
                tool_images=4,
                tool_lr=2e-4,
                tool_weight=2.0,
                tool_value_weight=6.0,
                tool_kinds=(("single", 0.6), ("number", 0.4)),
                tool_merge=0.5,
            ),
            f"from {kept}",
        ),
    ]
    with pytest.raises(SystemExit):
        main(["train-demo", "--out", out, "--from", kept, "--tool-kinds", "squares=1"])
    with pytest.raises(SystemExit):
        main(["train-demo"])  # --out is required


def test_compute_dtype_follows_the_probe(monkeypatch):
    """auto: bfloat16 autocast only where the start-up probe finds bfloat16 matmuls fast (emulated bfloat16 on
    an AVX2-only CPU would make the 45-minute run take hours); an explicit choice is obeyed."""
    for fast in (True, False):
        monkeypatch.setattr(demo_train, "cpu_matmul_is_fast", lambda dtype, fast=fast: fast)
        assert TrainConfig().bf16() is fast
        assert TrainConfig().autocast().fast_dtype == torch.bfloat16
        with TrainConfig().autocast():
            assert torch.is_autocast_enabled("cpu") is fast
        assert (
            TrainConfig(compute_dtype="bfloat16").bf16() and not TrainConfig(compute_dtype="float32").bf16()
        )
    with pytest.raises(ValueError, match="compute_dtype"):
        TrainConfig(compute_dtype="fp8").bf16()


@pytest.fixture(scope="module")
def demo_ckpt(tmp_path_factory) -> Path:
    """The checkpoint train() writes, minus the steps: the demo preset at transformers' own initialisation,
    saved by train()'s save_weights into a make_checkpoint directory. NOTE: two real steps of two images
    cost about 23 s of CPU (measured with train()), too much for the suite; the CLI test covers the
    path from flags to train()."""
    out = make_checkpoint(tmp_path_factory.mktemp("demo_ckpt"), preset=demo_train.PRESET, seed=0)
    demo_train.save_weights(demo_train.build_model(seed=0), out)  # with the designed patch filters
    return out


def test_checkpoint_loads_in_transformers(demo_ckpt):
    from safetensors.torch import load_file
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    AutoProcessor.from_pretrained(str(demo_ckpt))
    model, info = Qwen2VLForConditionalGeneration.from_pretrained(
        str(demo_ckpt), dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert sum(p.numel() for p in model.parameters()) <= 30_000_000  # the bound
    stored = load_file(str(demo_ckpt / "model.safetensors"))
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    # The weights transformers holds are the ones written (under its own key names).
    embed = next(t for name, t in stored.items() if name.endswith("embed_tokens.weight"))
    assert torch.equal(model.get_input_embeddings().weight, embed.float())


def test_engine_greedy_ids_equal_transformers(demo_ckpt):
    examples = [tasks.sample(123, i, kind) for i, kind in enumerate(("single", "many", "number"))]
    convs = [user(image_part(ex.data), ex.question(task)) for ex in examples for task in list(ex.qa)[:2]]
    oracle = HFOracle(demo_ckpt)
    refs = [oracle.generate(conv, MAX_NEW) for conv in convs]
    assert len({tuple(r) for r in refs}) > 1, "the answers must depend on the image or question to bite"
    llm = LLM(str(demo_ckpt), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=512)
    try:
        outs = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    finally:
        llm.close()
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out.prompt_token_ids == oracle.inputs(convs[i])["input_ids"][0].tolist()
        assert out.token_ids == ref, f"conversation {i}: engine {out.token_ids} != transformers {ref}"


def test_make_model_writes_the_demo_preset_for_qwen2_vl_only(tmp_path, capsys):
    import json

    assert main(["make-model", "--preset", "demo", "--out", str(tmp_path / "d")]) == 0
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert (config["vision_config"]["depth"], config["hidden_size"], config["num_hidden_layers"]) == (
        8,
        256,
        4,
    )
    with pytest.raises(SystemExit, match="qwen2_vl only"):
        main(["make-model", "--preset", "demo", "--family", "qwen3_vl", "--out", str(tmp_path / "q")])
