"""Video parts through a real server process, driven by the official `openai` client: a generated clip (a moving
coloured square) as a data: URL, as file:// and over http from an allowed host answers as transformers'
generate() does; a frame list as vLLM sends it; bad videos in a table, each a 4xx with the OpenAI error body and
its reason, the server serving on."""

from __future__ import annotations

import base64
import io
from fractions import Fraction

import av
import numpy as np
import pytest

from tests.api.conftest import CLIP
from tests.api.test_bad_input import OK, assert_error
from tests.support import data_url, make_clip, make_image, user

MAX_NEW = 10


def video_url_part(url: str, **extra) -> dict:
    return {"type": "video_url", "video_url": {"url": url, **extra}}


def greedy(client, messages):
    resp = client.chat.completions.create(
        model="tiny",
        messages=messages,
        temperature=0.0,
        max_tokens=MAX_NEW,
        extra_body={"return_token_ids": True},
    )
    return resp.choices[0].token_ids, resp.usage


@pytest.fixture(scope="module")
def client(guarded_server):
    return guarded_server.client()


def test_clip_as_data_url_file_and_http_equals_transformers(client, guarded_server, image_server, hf_oracle):
    ref = hf_oracle.generate(user({"type": "video", "video": CLIP}, "What moves?"), MAX_NEW)
    ids, usage = greedy(client, user(video_url_part(data_url(CLIP, "video/mp4")), "What moves?"))
    assert ids == ref
    assert usage.prompt_tokens_details.video_tokens == sum(usage.visual_tokens) > 0
    assert usage.prompt_tokens_details.image_tokens == 0 and usage.visual_levels == [0]
    (guarded_server.media_dir / "clip.mp4").write_bytes(CLIP)
    by_file, _ = greedy(
        client, user(video_url_part(f"file://{guarded_server.media_dir}/clip.mp4"), "What moves?")
    )
    assert by_file == ref
    before = image_server.hits["/clip.mp4"]
    by_http, _ = greedy(client, user(video_url_part(image_server.url("/clip.mp4")), "What moves?"))
    assert by_http == ref and image_server.hits["/clip.mp4"] == before + 1


def test_frame_list_and_sampling_fields(client, hf_oracle):
    frames = [make_image(56, 42, seed, "JPEG") for seed in range(4)]
    url = "data:video/jpeg;base64," + ",".join(base64.b64encode(f).decode() for f in frames)
    ids, _ = greedy(client, user(video_url_part(url, fps=2.0), "Four frames."))
    assert ids == hf_oracle.generate(
        user({"type": "video", "video": frames, "fps": 2.0}, "Four frames."), MAX_NEW
    )
    # A lower frame rate asked by the request samples fewer frames: fewer visual tokens.
    long = data_url(make_clip(frames=24, width=64, height=48, fps=8, seed=4), "video/mp4")
    _, dense = greedy(client, user(video_url_part(long, fps=4.0), "Count."))
    _, sparse = greedy(client, user(video_url_part(long, fps=1.0), "Count."))
    assert sum(sparse.visual_tokens) < sum(dense.visual_tokens)


def _audio_only() -> bytes:
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("aac", rate=16000)
        frame = av.AudioFrame.from_ndarray(
            np.zeros((1, 1024), dtype=np.float32), format="fltp", layout="mono"
        )
        frame.sample_rate = 16000
        for _ in range(4):
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def _long_clip() -> bytes:
    """Seven frames, a hundred seconds each: 700 s, over the 600 s default."""
    return make_clip(frames=7, width=32, height=32, fps=Fraction(1, 100), gop=1)


BAD = {
    "zero-length": (lambda: b"", 400, "empty"),
    "not a video": (lambda: b"hello, this is text and not a video at all" * 4, 400, "unsupported_format"),
    "truncated": (lambda: CLIP[: len(CLIP) // 2], 400, "corrupt"),
    "audio-only": (_audio_only, 400, "no_video_stream"),
    "unsupported codec": (
        lambda: make_clip(frames=4, codec="ffv1", fmt="matroska"),
        400,
        "unsupported_codec",
    ),
    "too long": (_long_clip, 400, "too_long"),
    "too many pixels": (lambda: make_clip(frames=2, width=3856, height=2176, gop=1), 400, "too_many_pixels"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_videos_are_400s_with_the_reason(guarded_server, name):
    make, status, code = BAD[name]
    body = {
        "model": "tiny",
        "messages": user(video_url_part(data_url(make(), "video/mp4")), "Hi"),
        "max_tokens": 2,
    }
    err = assert_error(guarded_server.post_chat(body), status, code)
    assert "video" in err["message"]


def test_limits_on_frames_count_and_fields(guarded_server):
    clip = data_url(CLIP, "video/mp4")
    over = {"model": "tiny", "messages": user(video_url_part(clip, max_frames=65), "Hi"), "max_tokens": 2}
    assert_error(guarded_server.post_chat(over), 400, "too_many_frames")
    two = {
        "model": "tiny",
        "messages": user(video_url_part(clip), video_url_part(clip), "Hi"),
        "max_tokens": 2,
    }
    assert_error(guarded_server.post_chat(two), 400, "too_many_videos")
    bad_fps = {"model": "tiny", "messages": user(video_url_part(clip, fps=-1), "Hi"), "max_tokens": 2}
    assert guarded_server.post_chat(bad_fps).status_code == 400
    assert guarded_server.post_chat(OK).status_code == 200


def test_video_url_ssrf_refused_without_connecting(guarded_server, canary):
    before = len(guarded_server.guard_events())
    for url in (f"http://127.0.0.1:{canary.port}/v.mp4", "http://evil.test/v.mp4", "http://10.0.0.1/v.mp4"):
        body = {"model": "tiny", "messages": user(video_url_part(url), "Hi"), "max_tokens": 2}
        err = assert_error(guarded_server.post_chat(body), 400)
        assert err["code"] in ("media_url_forbidden", "media_fetch_failed"), err
    assert canary.accepted == 0 and guarded_server.guard_events()[before:] == []


def test_zz_nothing_leaked(server):
    server.assert_alive()
    m = server.wait_idle()
    assert m["vlmserve_kv_cache_blocks_free"] == m["vlmserve_kv_cache_blocks_total"]
