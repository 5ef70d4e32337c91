"""From raw bytes to tokens: formats, EXIF, the embedding cache (memory and Redis) against transformers."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest
from PIL import Image

from lm_engine import LLM, SamplingParams
from tests.support import image_part, make_image, user

MAX_NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def picture(w: int, h: int, seed: int) -> Image.Image:
    return Image.open(io.BytesIO(make_image(w, h, seed)))


def format_cases() -> dict[str, bytes]:
    rgba = picture(200, 150, 1).convert("RGBA")
    alpha = np.zeros((150, 200), np.uint8)
    alpha[:, 100:] = 255  # left half fully transparent: composited over white
    rgba.putalpha(Image.fromarray(alpha))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise on display
    exif3 = Image.Exif()
    exif3[0x0112] = 3
    return {
        "jpeg_640x480": encode(picture(640, 480, 2), "JPEG", quality=90),
        "png_333x517": encode(picture(333, 517, 3), "PNG"),
        "rgba_png": encode(rgba, "PNG"),
        "grayscale_png": encode(picture(256, 192, 4).convert("L"), "PNG"),
        "palette_png": encode(picture(300, 200, 5).convert("P", palette=Image.Palette.ADAPTIVE), "PNG"),
        "exif_rot90_jpeg": encode(picture(320, 160, 6), "JPEG", exif=exif),
        "exif_rot180_jpeg": encode(picture(96, 300, 7), "JPEG", exif=exif3),
        "jpeg_1024x768": encode(picture(1024, 768, 8), "JPEG", quality=85),
        "tiny_png_28x28": encode(picture(28, 28, 9), "PNG"),
    }


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    with LLM(str(tiny_ckpt), max_num_batched_tokens=128, preprocess_workers=2) as engine:
        yield engine


def test_formats_match_transformers(llm, hf_oracle):
    cases = format_cases()
    convs = [user(image_part(data), "What do you see?") for data in cases.values()]
    outs = llm.chat(convs, GREEDY)
    for name, conv, out in zip(cases, convs, outs):
        assert out.prompt_token_ids == hf_oracle.inputs(conv)["input_ids"][0].tolist(), name
        assert out.token_ids == hf_oracle.generate(conv, MAX_NEW), name
    # The EXIF rotation really changed the grid (the rotated image is taller than wide).
    rotated = outs[list(cases).index("exif_rot90_jpeg")]
    assert rotated.visual_tokens[0] > 0


def test_same_image_at_other_positions_reuses_the_embedding(llm, hf_oracle):
    data = make_image(448, 336, 77)
    convs = [
        user(image_part(data), "Describe it."),
        user("First some words, then the picture: ", image_part(data), " What is it?"),
        [
            {"role": "system", "content": "Be brief."},
            *user("Look:", image_part(make_image(56, 56, 5)), image_part(data)),
        ],
    ]
    stats = llm.engine.vision.stats
    for i, conv in enumerate(convs):
        before_images, before_hits = stats.images, stats.cache_hits
        (out,) = llm.chat([conv], GREEDY)
        assert out.token_ids == hf_oracle.generate(conv, MAX_NEW)
        if i > 0:
            assert stats.cache_hits > before_hits  # served from the embedding cache
            # Only the new 56×56 image in the third prompt needed the encoder.
            assert stats.images - before_images == (1 if i == 2 else 0)


REDIS_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from lm_engine import LLM, SamplingParams
    sys.path.insert(0, {root!r})
    from tests.support import image_part, make_image, user
    llm = LLM({ckpt!r}, redis_url={url!r}, redis_key_prefix={prefix!r})
    convs = [user(image_part(make_image(224, 224, s)), "What is it?") for s in (11, 12, 13)]
    outs = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=12))
    llm.engine.embedding_cache.l2.flush(5.0)
    print(json.dumps({{"tokens": [o.token_ids for o in outs], "encoded": llm.engine.vision.stats.images,
                      "stats": llm.engine.embedding_cache.stats()}}))
    """
)


def run_engine_process(tiny_ckpt, url: str, prefix: str) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = REDIS_SCRIPT.format(root=root, ckpt=str(tiny_ckpt), url=url, prefix=prefix)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.redis
def test_second_process_reuses_embeddings_from_redis(tiny_ckpt, redis_db_url):
    prefix = f"vlmserve-test-{uuid.uuid4().hex}:"
    first = run_engine_process(tiny_ckpt, redis_db_url, prefix)
    second = run_engine_process(tiny_ckpt, redis_db_url, prefix)
    assert first["encoded"] == 3 and first["stats"]["redis"]["puts"] >= 3
    assert second["encoded"] == 0, (
        "the second process called the encoder despite Redis holding the embeddings"
    )
    assert second["stats"]["redis"]["hits"] == 3
    assert second["tokens"] == first["tokens"]


def test_unreachable_redis_does_not_fail_requests(tiny_ckpt, hf_oracle):
    # Port 9 on loopback: nothing listens, every Redis call fails fast.
    llm = LLM(str(tiny_ckpt), redis_url="redis://127.0.0.1:9/0")
    convs = [user(image_part(make_image(224, 224, 20 + i)), "What is it?") for i in range(4)]
    outs = llm.chat(convs, GREEDY)
    for conv, out in zip(convs, outs):
        assert out.token_ids == hf_oracle.generate(conv, MAX_NEW)
    redis_stats = llm.engine.embedding_cache.stats()["redis"]
    assert redis_stats["errors"] >= 1
