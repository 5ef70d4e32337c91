"""The published-shape presets (`make-model --preset qwen2-vl-2b` ... `qwen3-vl-8b`): their config.json says what
the released checkpoints' config.json says, the tensors their writer stores are exactly the ones transformers
loads, and a scaled-down copy (same depth, fewer heads) stays finite and prompt-dependent in bf16. No test
writes a multi-GB file: the real-size writers run with the tensor drawing replaced by a recorder."""

from __future__ import annotations

import dataclasses
import io
import json
import math
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, rename_source_key

from api import cli
from lm_engine import LLM, SamplingParams
from tests.support import HFOracle, image_part, make_image, user
from tools import qwen2_vl_make, qwen3_vl_make

# The released checkpoints' values, written here independently of the presets (sources: the comments at each
# preset). Keys are transformers' attribute names on the parsed config; "vision.*" is vision_config.
# fmt: off
QWEN2_TEXT = dict(rope_theta=1000000.0, mrope_section=[16, 24, 24], rms_norm_eps=1e-6, head_dim=128)
QWEN2_PIXELS = dict(min_pixels=3136, max_pixels=12845056, patch=14)
QWEN25_TOWER = {"vision.depth": 32, "vision.hidden_size": 1280, "vision.intermediate_size": 3420,
                "vision.num_heads": 16, "vision.patch_size": 14, "vision.temporal_patch_size": 2,
                "vision.spatial_merge_size": 2, "vision.window_size": 112,
                "vision.fullatt_block_indexes": [7, 15, 23, 31], "vision.hidden_act": "silu"}
QWEN3_TEXT = dict(rope_theta=5000000.0, mrope_section=[24, 20, 20], mrope_interleaved=True, rms_norm_eps=1e-6,
                  head_dim=128, max_position_embeddings=262144, vocab_size=151936)
QWEN3_PIXELS = dict(min_pixels=65536, max_pixels=16777216, patch=16)
QWEN3_TOWER = {"vision.patch_size": 16, "vision.temporal_patch_size": 2, "vision.spatial_merge_size": 2,
               "vision.num_position_embeddings": 2304, "vision.hidden_act": "gelu_pytorch_tanh"}
PUBLISHED = {
    "qwen2-vl-2b": dict(
        family="qwen2_vl", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=32768,
        **QWEN2_TEXT, **QWEN2_PIXELS,
        **{"vision.depth": 32, "vision.embed_dim": 1280, "vision.hidden_size": 1536, "vision.mlp_ratio": 4,
           "vision.num_heads": 16, "vision.patch_size": 14, "vision.temporal_patch_size": 2,
           "vision.spatial_merge_size": 2, "vision.hidden_act": "quick_gelu"},
    ),
    "qwen2.5-vl-3b": dict(
        family="qwen2_5_vl", vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
        num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=128000,
        **QWEN2_TEXT, **QWEN2_PIXELS, **QWEN25_TOWER, **{"vision.out_hidden_size": 2048},
    ),
    "qwen2.5-vl-7b": dict(
        family="qwen2_5_vl", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False, max_position_embeddings=128000,
        **QWEN2_TEXT, **QWEN2_PIXELS, **QWEN25_TOWER, **{"vision.out_hidden_size": 3584},
    ),
    "qwen3-vl-2b": dict(
        family="qwen3_vl", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, tie_word_embeddings=True, **QWEN3_TEXT, **QWEN3_PIXELS, **QWEN3_TOWER,
        **{"vision.depth": 24, "vision.hidden_size": 1024, "vision.intermediate_size": 4096, "vision.num_heads": 16,
           "vision.out_hidden_size": 2048, "vision.deepstack_visual_indexes": [5, 11, 17]},
    ),
    "qwen3-vl-4b": dict(
        family="qwen3_vl", hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, tie_word_embeddings=True, **QWEN3_TEXT, **QWEN3_PIXELS, **QWEN3_TOWER,
        **{"vision.depth": 24, "vision.hidden_size": 1024, "vision.intermediate_size": 4096, "vision.num_heads": 16,
           "vision.out_hidden_size": 2560, "vision.deepstack_visual_indexes": [5, 11, 17]},
    ),
    "qwen3-vl-8b": dict(
        family="qwen3_vl", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, tie_word_embeddings=False, **QWEN3_TEXT, **QWEN3_PIXELS, **QWEN3_TOWER,
        **{"vision.depth": 27, "vision.hidden_size": 1152, "vision.intermediate_size": 4304, "vision.num_heads": 16,
           "vision.out_hidden_size": 4096, "vision.deepstack_visual_indexes": [8, 16, 24]},
    ),
}
# Parameter counts read for two released checkpoints: Qwen2-VL-2B-Instruct "2.21" (B, its hub listing);
# Qwen2.5-VL-7B-Instruct 8.292B, 676.6M of them the tower, "calculated from the tensors stored in the upstream
# checkpoint" (huggingface.co/OpenExplorer/Qwen2.5-VL-7B-Instruct).
PARAMS_BILLIONS = {"qwen2-vl-2b": (2.21, None), "qwen2.5-vl-7b": (8.292, 0.6766)}
# fmt: on


def _maker(preset: str):
    return qwen3_vl_make if preset.startswith("qwen3") else qwen2_vl_make


class WeightsRecorder:
    """Stands in for the writer's tensor drawing: keeps what would be written, writes nothing."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, out, specs, make, dtype, shard_size_bytes) -> None:
        shards = qwen2_vl_make.plan_shards(specs, dtype, shard_size_bytes)
        self.calls.append(dict(out=Path(out), specs=specs, dtype=dtype, shards=shards, size=shard_size_bytes))


@pytest.fixture
def recorder(monkeypatch) -> WeightsRecorder:
    rec = WeightsRecorder()
    monkeypatch.setattr(qwen2_vl_make, "write_weights", rec)
    return rec


def _make_model(tmp_path: Path, preset: str, *extra: str) -> Path:
    out = tmp_path / preset
    assert cli.main(["make-model", "--preset", preset, "--out", str(out), *extra]) == 0
    return out


def test_cli_lists_every_preset() -> None:
    assert set(cli.MAKE_MODEL_PRESETS) | set(cli.PUBLISHED_PRESETS) == set(qwen2_vl_make.PRESETS) | set(
        qwen3_vl_make.PRESETS
    )
    assert set(cli.PUBLISHED_PRESETS) == set(PUBLISHED)


@pytest.mark.parametrize("preset", PUBLISHED)
def test_config_has_the_published_values(preset: str, recorder, tmp_path) -> None:
    """config.json, as transformers parses it, and the preprocessor's bounds equal the table above."""
    want = PUBLISHED[preset]
    out = _make_model(tmp_path, preset)
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.model_type == want["family"]
    text, vision = cfg.text_config, cfg.vision_config
    rope = text.rope_parameters
    got = {
        "family": cfg.model_type,
        "vocab_size": text.vocab_size,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "rope_theta": rope["rope_theta"],
        "mrope_section": list(rope["mrope_section"]),
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
    }
    if "mrope_interleaved" in want:
        got["mrope_interleaved"] = rope.get("mrope_interleaved")
    for key in want:
        if key.startswith("vision."):
            value = getattr(vision, key.removeprefix("vision."))
            got[key] = list(value) if isinstance(value, (list, tuple)) else value
        elif key not in got and hasattr(text, key):
            got[key] = getattr(text, key)
    pre = json.loads((out / "preprocessor_config.json").read_text())
    got |= {"min_pixels": pre["size"]["shortest_edge"], "max_pixels": pre["size"]["longest_edge"]}
    got["patch"] = pre["patch_size"]
    assert (pre["min_pixels"], pre["max_pixels"]) == (got["min_pixels"], got["max_pixels"])
    assert {k: got.get(k) for k in want} == want
    assert cfg.dtype == torch.bfloat16 or str(cfg.dtype).endswith("bfloat16")


def _transformers_keys(model) -> dict[str, tuple[int, ...]]:
    """What transformers fills from a checkpoint: its state dict, less a tied head (it is the embedding)."""
    tied = (
        set(getattr(model, "all_tied_weights_keys", None) or {})
        if model.config.tie_word_embeddings
        else set()
    )
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in tied}


def _renamed(model, names: list[str]) -> list[str]:
    """Checkpoint names as transformers' own loading renames them (v5: ``model.`` -> ``model.language_model.``)."""
    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if not isinstance(c, WeightConverter)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    meta = model.state_dict()
    return [rename_source_key(n, renamings, converters, model.base_model_prefix, meta)[0] for n in names]


@pytest.mark.parametrize("preset", PUBLISHED)
def test_written_tensors_are_what_transformers_loads(preset: str, recorder, tmp_path) -> None:
    """The checkpoint `make-model --preset <shape>` writes loads in transformers: every tensor the writer stores
    (the list the writer itself draws from) is, after transformers' key conversion, a parameter of the model
    transformers builds from the written config.json, with its shape, and none is missing. Built on the meta
    device, so no weight is materialised; the written files are bf16, HF-like shards."""
    out = _make_model(tmp_path, preset)
    (call,) = recorder.calls
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(out))
    names = [n for n, _ in call["specs"]]
    written = dict(zip(_renamed(model, names), (shape for _, shape in call["specs"]), strict=True))
    assert len(written) == len(names)
    assert written == _transformers_keys(model)
    assert ("lm_head.weight" in names) is not PUBLISHED[preset]["tie_word_embeddings"]
    # The original layout for Qwen2-VL / Qwen2.5-VL (as released), transformers' own for Qwen3-VL.
    assert any(n.startswith("model.language_model.") for n in names) is preset.startswith("qwen3")
    if preset in PARAMS_BILLIONS:
        total, tower = PARAMS_BILLIONS[preset]
        assert sum(math.prod(s) for _, s in call["specs"]) / 1e9 == pytest.approx(total, abs=0.0051)
        if tower is not None:
            got = sum(math.prod(s) for n, s in call["specs"] if n.startswith("visual.")) / 1e9
            assert got == pytest.approx(tower, abs=0.00051)
    assert call["dtype"] == torch.bfloat16 and call["size"] == qwen2_vl_make.REAL_SHARD_BYTES
    sizes = [sum(math.prod(dict(call["specs"])[n]) * 2 for n in shard) for shard in call["shards"]]
    assert len(sizes) >= 2 and max(sizes) <= qwen2_vl_make.REAL_SHARD_BYTES
    assert [n for shard in call["shards"] for n in shard] == names


@pytest.mark.parametrize("preset", ["qwen2-vl-2b", "qwen3-vl-8b"])
def test_tokenizer_is_small_but_its_ids_are_the_configs(preset: str, recorder, tmp_path) -> None:
    """The tokenizer is the small preset's 8,192-token BPE; the embedding keeps the published rows (padding rows
    past the tokenizer, as 151,936 > 151,665 in the released ones); the config's special ids are the tokenizer's."""
    out = _make_model(tmp_path, preset)
    cfg = json.loads((out / "config.json").read_text())
    vocab = cfg.get("text_config", cfg)["vocab_size"]
    processor = AutoProcessor.from_pretrained(out)
    tok = processor.tokenizer
    assert len(tok) == 8192 < vocab == PUBLISHED[preset]["vocab_size"] == 151936
    for key, token in [
        ("image_token_id", "<|image_pad|>"),
        ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"),
    ]:
        assert cfg[key] == tok.convert_tokens_to_ids(token), key
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    inputs = processor(
        text=["<|vision_start|><|image_pad|><|vision_end|>"], images=[_image(256, 192)], return_tensors="pt"
    )
    assert (
        int((inputs["input_ids"] == cfg["image_token_id"]).sum()) == int(inputs["image_grid_thw"].prod()) // 4
    )


def _image(width: int, height: int) -> Image.Image:
    return Image.open(io.BytesIO(make_image(width, height, 3)))


def test_a_published_preset_implies_its_family(recorder, tmp_path) -> None:
    out = _make_model(tmp_path, "qwen2.5-vl-7b")
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2_5_vl"
    _make_model(tmp_path, "qwen2.5-vl-7b", "--family", "qwen2_5_vl")  # the same family, said twice: fine
    for preset, family in [
        ("qwen2.5-vl-7b", "qwen2_vl"),
        ("qwen2-vl-2b", "qwen3_vl"),
        ("qwen3-vl-4b", "qwen2_vl"),
    ]:
        with pytest.raises(SystemExit, match=f"exists for --family {PUBLISHED[preset]['family']} only"):
            _make_model(tmp_path, preset, "--family", family)
    with pytest.raises(ValueError, match="qwen2_5_vl only"):
        qwen2_vl_make.make_checkpoint(tmp_path / "x", "qwen2.5-vl-3b", family="qwen2_vl")
    assert len(recorder.calls) == 2  # nothing written for the refused ones


# -- the writer: shard by shard, deterministic, and what it writes loads ---------------------------------------


def test_writer_draws_one_shard_at_a_time(tmp_path, monkeypatch) -> None:
    """No tensor of a shard is drawn before the previous shard is saved (memory holds one shard), and the index
    maps every tensor to the file that holds it."""
    events: list[tuple[str, object]] = []
    real_save, real_init = qwen2_vl_make._save, qwen2_vl_make.init_tensor
    monkeypatch.setattr(
        qwen2_vl_make, "_save", lambda t, p: (events.append(("save", set(t))), real_save(t, p))
    )
    monkeypatch.setattr(
        qwen2_vl_make,
        "init_tensor",
        lambda c, s, n, sh: (events.append(("draw", n)), real_init(c, s, n, sh))[1],
    )
    out = qwen2_vl_make.make_checkpoint(tmp_path, "tiny", seed=0, shard_size_bytes=300_000)
    saves = [names for kind, names in events if kind == "save"]
    assert len(saves) > 2
    drawn: set[str] = set()
    for kind, what in events:
        if kind == "draw":
            drawn.add(what)
        else:
            assert drawn == what, "a shard's tensors are exactly those drawn since the previous save"
            drawn = set()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert {n for names in saves for n in names} == set(index["weight_map"])


def test_large_tensors_are_drawn_in_blocks_deterministically(monkeypatch) -> None:
    """Above DRAW_BLOCK values a tensor is drawn block by block into its dtype (no float32 copy of all of it):
    the same (seed, name) gives the same values, the row scale applies per row, the spread is the asked one."""
    monkeypatch.setattr(qwen2_vl_make, "DRAW_BLOCK", 10_000)
    rows = torch.ones(3000)
    rows[2000:] = 0.1
    args = (0, "lm_head.weight", (3000, 64), 0.0, 0.5, torch.bfloat16, rows)
    a, b = qwen2_vl_make.draw_tensor(*args), qwen2_vl_make.draw_tensor(*args)
    assert a.dtype == torch.bfloat16 and a.is_contiguous() and torch.equal(a, b)
    assert a[:2000].float().std().item() == pytest.approx(0.5, rel=0.02)
    assert a[2000:].float().std().item() == pytest.approx(0.05, rel=0.02)
    other = qwen2_vl_make.draw_tensor(1, *args[1:])
    assert not torch.equal(a, other)


@pytest.fixture
def scaled(monkeypatch):
    """Registers a published shape with fewer heads, narrower MLPs and towers under ``name + "/scaled"``; the
    vocabulary rows, head dims, M-RoPE sections, tying and (unless given) depths stay the published ones."""

    def make(preset: str, dtype: str, **depths) -> str:
        key = f"{preset}/scaled"
        if preset.startswith("qwen3"):
            p = qwen3_vl_make.PRESETS[preset]
            text = dataclasses.replace(
                p.text,
                hidden_size=128,
                num_heads=1,
                num_kv_heads=1,
                intermediate_size=384,
                dtype=dtype,
                num_layers=depths.get("num_layers", p.text.num_layers),
            )
            vision_depth = depths.get("vision_depth", p.vision_depth)
            deepstack = (
                p.deepstack_visual_indexes if vision_depth == p.vision_depth else tuple(range(vision_depth))
            )
            new = dataclasses.replace(
                p,
                text=text,
                vision_hidden=64,
                vision_heads=1,
                vision_intermediate=256,
                vision_depth=vision_depth,
                deepstack_visual_indexes=deepstack,
            )
            monkeypatch.setitem(qwen3_vl_make.PRESETS, key, new)
        else:
            p = qwen2_vl_make.PRESETS[preset]
            vision_depth = depths.get("vision_depth", p.vision_depth)
            new = dataclasses.replace(
                p,
                hidden_size=128,
                num_heads=1,
                num_kv_heads=1,
                intermediate_size=384,
                vision_embed_dim=80,
                vision_heads=1,
                vision_intermediate_size=p.vision_intermediate_size and 216,
                fullatt_block_indexes=p.fullatt_block_indexes if vision_depth == p.vision_depth else None,
                dtype=dtype,
                num_layers=depths.get("num_layers", p.num_layers),
                vision_depth=vision_depth,
                shard_size_bytes=30_000_000,
            )
            monkeypatch.setitem(qwen2_vl_make.PRESETS, key, new)
        return key

    return make


def _write(key: str, out: Path) -> Path:
    if key.startswith("qwen3"):
        return qwen3_vl_make.make_checkpoint(out, key, seed=0, shard_size_bytes=30_000_000)
    return qwen2_vl_make.make_checkpoint(out, key, seed=0)


@pytest.mark.parametrize("preset", ["qwen2-vl-2b", "qwen2.5-vl-7b", "qwen3-vl-2b"])
def test_scaled_down_published_depth_is_finite_and_varied_in_bf16(
    preset, scaled, tmp_path, monkeypatch
) -> None:
    """The init rule at the published depths (28 layers and a 32-block tower; 28 + 24 for Qwen3-VL), with the
    published vocabulary rows and tying, in bf16, drawn in blocks as the real-size writer draws: the logits stay
    finite, the last hidden state far inside bf16's range, greedy answers differ per prompt and per image and do
    not repeat one token, and no answer token is a padding row the tokenizer cannot decode."""
    monkeypatch.setattr(qwen2_vl_make, "DRAW_BLOCK", 1 << 20)  # the embedding takes the block-wise path
    ckpt = _write(scaled(preset, "bfloat16"), tmp_path / "ckpt")
    oracle = HFOracle(ckpt, dtype=torch.bfloat16)
    assert oracle.model.dtype == torch.bfloat16
    convs = [
        user("Hello, how are you?"),
        user("What is the capital of France?"),
        user(image_part(make_image(224, 224, 1)), "Describe the picture."),
        user(image_part(make_image(224, 224, 2)), "Describe the picture."),
    ]
    answers = []
    for conv in convs:
        inputs = oracle.inputs(conv)
        with torch.no_grad():
            out = oracle.model(**inputs, output_hidden_states=True)
        assert torch.isfinite(out.logits).all()
        assert max(h.float().abs().max().item() for h in out.hidden_states) < 1e4
        answers.append(oracle.generate(conv, 12))
    assert len({tuple(a) for a in answers}) == len(answers)
    assert all(len(set(a)) >= 4 for a in answers), answers
    assert all(t < 8192 for a in answers for t in a)


@pytest.mark.parametrize("preset", ["qwen2-vl-2b", "qwen3-vl-2b"])
def test_engine_serves_a_tied_padded_vocabulary_shape(preset, scaled, tmp_path) -> None:
    """Greedy ids of our engine equal transformers' generate() (float32) on a written, sharded checkpoint of a
    published shape with few layers: a tied head not stored in the files, 151,936 embedding rows for an
    8,192-token tokenizer, the published tower configuration."""
    ckpt = _write(scaled(preset, "float32", num_layers=2, vision_depth=3), tmp_path / "ckpt")
    assert len(list(ckpt.glob("model-*-of-*.safetensors"))) > 1
    model, info = AutoModelForImageTextToText.from_pretrained(ckpt, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert model.lm_head.weight.shape[0] == 151936
    convs = [user("Hi"), user(image_part(make_image(280, 224, 5)), "What is in this picture?")]
    oracle = HFOracle(ckpt)
    refs = [oracle.generate(c, 16) for c in convs]
    with LLM(str(ckpt), max_num_batched_tokens=256, num_kv_blocks=64, enable_prefix_caching=False) as llm:
        outs = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=16))
    assert [o.token_ids for o in outs] == refs
    assert all(o.text for o in outs)
