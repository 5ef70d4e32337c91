"""Qwen2.5-VL end to end: a generated checkpoint served by our engine (our tower, our decoder) gives
transformers' greedy tokens, and a broken video part gets a 400 for both families (tests/api/test_video.py and
tests/lm_engine/test_video_equivalence.py serve good ones)."""

from __future__ import annotations

import base64
import json

import pytest
import torch
from fastapi.testclient import TestClient

from api.config import ServerArgs
from api.server import create_app
from lm_engine import LLM, SamplingParams
from lm_engine.config import EngineConfig
from tests.support import image_part, make_image, user

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def ckpt25(tiny25_ckpt):
    return tiny25_ckpt


@pytest.fixture(scope="module")
def oracle25(hf_oracle25):
    return hf_oracle25


def conversations() -> list[list[dict]]:
    """Grids (in patches) 14×22 and 34×46: not multiples of the 8-patch window; two images in one request."""
    return [
        user("Hi there, who are you?"),
        user(image_part(make_image(300, 200, 3)), "Describe the picture."),
        user(
            image_part(make_image(100, 150, 7)), image_part(make_image(640, 480, 5, "JPEG")), "Compare them."
        ),
        user("Look: ", image_part(make_image(448, 336, 9)), " and say what you see."),
    ]


def test_config_is_qwen2_5_vl(ckpt25):
    cfg = json.loads((ckpt25 / "config.json").read_text())
    assert cfg["model_type"] == "qwen2_5_vl" and cfg["vision_config"]["fullatt_block_indexes"] == [1]


@pytest.mark.parametrize("chunk", [2048, 48], ids=["whole", "chunked-through-images"])
def test_greedy_equals_transformers(ckpt25, oracle25, chunk):
    convs = conversations()
    with LLM(str(ckpt25), max_num_batched_tokens=chunk, num_kv_blocks=256) as llm:
        outs = llm.chat(convs, GREEDY)
    for conv, out in zip(convs, outs):
        assert out.prompt_token_ids == oracle25.inputs(conv)["input_ids"][0].tolist()
        assert out.token_ids == oracle25.generate(conv, MAX_NEW)
    # Not degenerate: the continuation depends on the image.
    assert len({tuple(o.token_ids) for o in outs}) == len(outs)


def test_tower_is_ours_and_matches_transformers_on_the_checkpoint(ckpt25, oracle25):
    from encoder.models import Qwen25VisionTower, build_vision_tower

    config = json.loads((ckpt25 / "config.json").read_text())
    ours = build_vision_tower(config, ckpt25)
    assert isinstance(ours, Qwen25VisionTower)
    gen = torch.Generator().manual_seed(0)
    grid = torch.tensor([[1, 14, 22], [1, 6, 10]])
    pixels = torch.randn(14 * 22 + 60, 3 * 2 * 14 * 14, generator=gen)
    with torch.no_grad():
        want = oracle25.model.model.visual(pixels, grid_thw=grid).pooler_output
    torch.testing.assert_close(ours(pixels, grid), want, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_a_broken_video_part_is_a_400(family, tiny_ckpt, ckpt25):
    ckpt = tiny_ckpt if family == "qwen2_vl" else ckpt25
    args = ServerArgs(engine=EngineConfig(model=str(ckpt), num_kv_blocks=64))
    url = "data:video/mp4;base64," + base64.b64encode(b"\x00\x00\x00\x18ftypmp42").decode()
    bodies = [
        [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "What happens?"}],
        [{"type": "video", "video": url}, {"type": "text", "text": "What happens?"}],
    ]
    with TestClient(create_app(args), raise_server_exceptions=False) as client:
        for content in bodies:
            body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
            resp = client.post("/v1/chat/completions", json=body)
            assert resp.status_code == 400, resp.text
            err = resp.json()["error"]
            assert "video" in err["message"] and err["type"] == "invalid_request_error"
        ok = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert client.post("/v1/chat/completions", json=ok).status_code == 200


def test_make_model_cli_family(tmp_path, ckpt25):
    from api.cli import main

    assert (
        main(["make-model", "--family", "qwen2_5_vl", "--preset", "tiny", "--out", str(tmp_path / "m")]) == 0
    )
    for name in ("config.json", "model.safetensors", "preprocessor_config.json", "tokenizer.json"):
        assert (tmp_path / "m" / name).read_bytes() == (ckpt25 / name).read_bytes(), name
    assert main(["make-model", "--preset", "tiny", "--out", str(tmp_path / "d")]) == 0  # the default family
    assert json.loads((tmp_path / "d" / "config.json").read_text())["model_type"] == "qwen2_vl"
