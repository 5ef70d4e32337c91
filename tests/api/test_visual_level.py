"""``--visual-level K`` under ``--visual-budget fixed``: detail=auto images get ladder level K, through the real
server; the image tokens in ``usage`` equal transformers' smart_resize of Pillow's image size at that level's
max_pixels (computed here from the checkpoint's preprocessor config, not from the server's ladder)."""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

from api.cli import main
from tests.api.conftest import start_server
from tests.support import data_url, free_port, make_image

PINNED = 2  # 25 % of max_pixels
IMAGE = make_image(640, 480, 31, "JPEG")  # full budget: 391 tokens; level 2 of the tiny preset: 300


def level_max_pixels(ckpt: Path) -> list[int]:
    """The ladder as the README states it: 100 %, 50 %, 25 % of max_pixels (whole 28-px tokens), the minimum."""
    cfg = json.loads((ckpt / "preprocessor_config.json").read_text())
    hi, lo, token = cfg["max_pixels"], cfg["min_pixels"], 28 * 28
    return [hi, hi // 2 // token * token, hi // 4 // token * token, lo]


def oracle_tokens(data: bytes, max_pixels: int, min_pixels: int) -> int:
    width, height = Image.open(io.BytesIO(data)).size
    h, w = smart_resize(height, width, factor=28, min_pixels=min_pixels, max_pixels=max_pixels)
    return h * w // (28 * 28)


@pytest.fixture(scope="module")
def pinned_server(tmp_path_factory, tiny_ckpt, image_server, canary):
    s = start_server(
        tmp_path_factory.mktemp("pinned"), tiny_ckpt, image_server, canary, "--visual-level", str(PINNED)
    )
    yield s
    s.proc.terminate()
    try:
        s.proc.wait(15)
    except subprocess.TimeoutExpired:
        s.proc.kill()
    s.http.close()


def ask(server, detail: str | None):
    part = {"url": data_url(IMAGE, "image/jpeg")} | ({"detail": detail} if detail else {})
    raw = server.client().chat.completions.with_raw_response.create(
        model="tiny",
        max_tokens=2,
        temperature=0,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": part},
                    {"type": "text", "text": "What is it?"},
                ],
            }
        ],
    )
    return raw.parse().usage, raw.headers["x-visual-budget-levels"]


def test_auto_images_get_the_pinned_level(pinned_server, tiny_ckpt):
    ladder = level_max_pixels(tiny_ckpt)
    lo = ladder[-1]
    expected = {k: oracle_tokens(IMAGE, ladder[k], lo) for k in range(len(ladder))}
    # the image tells the pinned level apart from the full budget and the lowest
    assert len({expected[0], expected[PINNED], expected[len(ladder) - 1]}) == 3
    for detail in ("auto", None):  # no detail means auto
        usage, header = ask(pinned_server, detail)
        assert usage.visual_tokens == [expected[PINNED]]
        assert usage.visual_levels == [PINNED] and header == str(PINNED)
    # high and low keep their meaning: the full budget and the lowest level
    for detail, level in (("high", 0), ("low", len(ladder) - 1)):
        usage, header = ask(pinned_server, detail)
        assert usage.visual_tokens == [expected[level]]
        assert usage.visual_levels == [level] and header == str(level)
    assert pinned_server.metrics()["vlmserve_visual_budget_level"] == PINNED


def serve_fails(monkeypatch, ckpt: Path, *flags: str) -> str:
    """`vlmserve serve` with ``flags``, in this process: must exit before it loads anything (reaching the
    server fails the test); returns its message."""
    import api.server
    import runtime.memory

    monkeypatch.setattr(api.server, "run_server", lambda *a, **k: pytest.fail("the server started"))
    monkeypatch.setattr(runtime.memory, "bound_native_caches", lambda: None)  # leave this process's env
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--model", str(ckpt), "--port", str(free_port()), *flags])
    return str(exc.value.code)


def test_a_level_off_the_ladder_is_a_clear_cli_error(tiny_ckpt, monkeypatch):
    err = serve_fails(monkeypatch, tiny_ckpt, "--visual-budget", "fixed", "--visual-level", "4")
    assert "--visual-level 4 is not a level" in err and "levels 0..3" in err
    err = serve_fails(monkeypatch, tiny_ckpt, "--visual-level", "1")  # the default budget is adaptive
    assert "--visual-budget fixed" in err
