"""The engine through the encoder tier: greedy outputs equal the in-process encoder's whichever way the
embeddings travel (shared memory, inline over TCP, Redis), and a pool that is too slow or unreachable costs
a bounded wait, then a local encode or a 503 with Retry-After, never a hang or a leaked KV block. Qwen3-VL's
deepstack levels travel in the one entry.

The pool's pace is set by its test hook (a held batch) and the client's deadline by an injected clock.
"""

from __future__ import annotations

import json
import socket
import time

import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from api.config import ServerArgs
from api.server import create_app
from cache import codec
from lm_engine import LLM, SamplingParams
from lm_engine.config import EngineConfig
from tests.conftest import ENGINE_REDIS_URL
from tests.encoder.test_pipeline import jobs_for
from tests.encoder.tier_support import assert_fell_back, start_pool
from tests.support import data_url, make_image, mixed_requests, user

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
REDIS_PREFIX = "vlmserve-test-enc:"


@pytest.fixture(scope="module")
def pool(tmp_path_factory, tiny_ckpt):
    extra = ("--redis-url", ENGINE_REDIS_URL, "--redis-key-prefix", REDIS_PREFIX, "--redis-ttl-s", "60")
    p = start_pool(tmp_path_factory.mktemp("pool"), tiny_ckpt, "--workers", "1", *extra)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def expected(tiny_ckpt):
    """Token ids of every mixed request, encoder in-process."""
    with LLM(str(tiny_ckpt), num_kv_blocks=128, embedding_cache_bytes=0) as llm:
        return [o.token_ids for o in llm.chat(mixed_requests(), GREEDY)]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens here once the socket closes


@pytest.mark.parametrize("way", ["shm-unix", "shm-tcp", "inline", "redis"])
def test_greedy_through_the_pool_equals_in_process(way, pool, expected, tiny_ckpt, monkeypatch, request):
    url = f"unix://{pool.socket_path}" if way == "shm-unix" else pool.tcp_url
    kw = {}
    if way in ("inline", "redis"):  # as an engine on another host sees the pool
        monkeypatch.setattr("encoder.tier.client.host_id", lambda: "another-host")
    if way == "redis":
        kw = dict(redis_url=request.getfixturevalue("redis_db_url"), redis_key_prefix=REDIS_PREFIX)
    with LLM(str(tiny_ckpt), num_kv_blocks=128, embedding_cache_bytes=0, encoder_url=url, **kw) as llm:
        got = [o.token_ids for o in llm.chat(mixed_requests(), GREEDY)]
        vision = llm.engine.vision
        assert vision._ship == ("shm" if way.startswith("shm") else way)
        assert vision.remote.fallbacks == {} and vision.stats.images == 0  # nothing encoded in-process
        assert vision.remote.received >= 10 and vision.remote.shipped_bytes > 0
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, f"request {i}"


def test_pool_too_slow_costs_a_bounded_wait_then_a_local_encode(pool, tiny_ckpt):
    now = [0.0]
    with LLM(str(tiny_ckpt), num_kv_blocks=32, embedding_cache_bytes=0, encoder_url=pool.tcp_url) as llm:
        vision = llm.engine.vision
        vision.clock = lambda: now[0]
        jobs = jobs_for(llm, [make_image(240, 200, 201, "JPEG")])
        started = pool.started_batches()
        pool.hold()
        try:
            vision.submit(jobs)
            pool.wait_batch_started(started)  # the pool has it, and sits on it
            assert vision.take_results() == []
            now[0] += vision.timeout_s  # the deadline passes
            results = collect(vision, 1)
        finally:
            pool.release()
        assert results[0].error is None and vision.remote.fallbacks == {"timeout": 1}
        assert vision.stats.images == 1  # encoded here
        torch.testing.assert_close(results[0].embedding, results_alone(llm, jobs[0]), rtol=1e-5, atol=1e-5)
        pool.wait_for(lambda st: st["keys_in_flight"] == 0, what="the pool's late answer")
        assert vision.take_results() == [] and vision.pending == 0  # the late answer is not delivered twice


def results_alone(llm: LLM, job):
    from preprocess import preprocess

    px = preprocess(job.data, llm.engine.preprocess_config, job.max_pixels)
    return llm.engine.runner.encode_images(torch.from_numpy(px.patches), torch.tensor([px.grid_thw]))


def collect(vision, n: int, bound_s: float = 120.0) -> list:
    """``n`` results from the pipeline (a bound against hanging, not a pace)."""
    out, deadline = [], time.monotonic() + bound_s
    while len(out) < n:
        assert time.monotonic() < deadline, "no result: the client hung"
        vision.wait(0.05)
        out += vision.take_results()
    return out


def metrics(client: TestClient) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            out[s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()))] = s.value
    return out


def idle_metrics(client: TestClient, bound_s: float = 30.0) -> dict[str, float]:
    """Metrics once the engine's published state shows no request and every KV block free (or the last look)."""
    deadline = time.monotonic() + bound_s
    while True:
        m = metrics(client)
        busy = m["vlmserve_num_requests_running"] or m["vlmserve_num_requests_waiting"]
        if not busy and m["vlmserve_kv_cache_blocks_free"] == m["vlmserve_kv_cache_blocks_total"]:
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.02)


def image_chat(seed: int) -> dict:
    return {
        "messages": user(
            {"type": "image_url", "image_url": {"url": data_url(make_image(160, 120, seed))}}, "What is it?"
        ),
        "max_tokens": 4,
        "temperature": 0,
    }


def app(ckpt, **engine_kw) -> TestClient:
    engine = EngineConfig(model=str(ckpt), num_kv_blocks=64, embedding_cache_bytes=0, **engine_kw)
    return TestClient(create_app(ServerArgs(engine=engine)), raise_server_exceptions=False)


@pytest.mark.parametrize("fallback", ["fail", "local"])
def test_pool_unreachable(fallback, tiny_ckpt):
    url = f"tcp://127.0.0.1:{closed_port()}"
    with app(tiny_ckpt, encoder_url=url, encoder_fallback=fallback, encoder_timeout_s=600) as client:
        resp = client.post("/v1/chat/completions", json=image_chat(202))
        assert_fell_back(resp, fallback)
        m = idle_metrics(client)
        assert m["vlmserve_encoder_remote_fallbacks_total{reason=unreachable}"] == 1
        assert m["vlmserve_kv_cache_blocks_free"] == m["vlmserve_kv_cache_blocks_total"]
        text = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        assert client.post("/v1/chat/completions", json=text).status_code == 200


def test_pool_too_slow_fail_mode_is_a_503_and_frees_everything(pool, tiny_ckpt):
    started = pool.started_batches()
    pool.hold()  # the pool sits on every batch until released: it is too slow, whatever the machine
    try:
        with app(tiny_ckpt, encoder_url=pool.tcp_url, encoder_fallback="fail", encoder_timeout_s=1) as client:
            resp = client.post("/v1/chat/completions", json=image_chat(203))
            assert pool.wait_batch_started(started)
            assert resp.status_code == 503, resp.text
            assert "Retry-After" in resp.headers
            m = idle_metrics(client)
            assert m["vlmserve_encoder_remote_fallbacks_total{reason=timeout}"] == 1
            assert m["vlmserve_kv_cache_blocks_free"] == m["vlmserve_kv_cache_blocks_total"]
            assert m["vlmserve_num_requests_running"] == 0 and m["vlmserve_num_requests_waiting"] == 0
    finally:
        pool.release()


@pytest.mark.timeout(1800)  # NOTE: writes a checkpoint and starts a pool; minutes on a crowded machine
def test_qwen3_deepstack_levels_through_the_pool_equal_in_process(qwen3_tiny_ckpt, monkeypatch):
    """Qwen3-VL through ``encoder_workers=1``: every shipped entry carries all deepstack levels, and greedy
    outputs equal the in-process encoder's."""
    vision_cfg = json.loads((qwen3_tiny_ckpt / "config.json").read_text())["vision_config"]
    levels, width = len(vision_cfg["deepstack_visual_indexes"]), vision_cfg["out_hidden_size"]
    assert levels > 0
    kw = dict(num_kv_blocks=128, embedding_cache_bytes=0)
    with LLM(str(qwen3_tiny_ckpt), **kw) as llm:
        want = [o.token_ids for o in llm.chat(mixed_requests(), GREEDY)]
    entries, decode = [], codec.decode

    def recorded(digest, data, want_levels=0):
        emb = decode(digest, data, want_levels)
        entries.append((bytes(data[8:9])[0], tuple(emb.shape)))  # the entry's own level count (byte 8)
        return emb

    monkeypatch.setattr("encoder.tier.client.codec.decode", recorded)
    with LLM(str(qwen3_tiny_ckpt), encoder_workers=1, **kw) as llm:
        got = [o.token_ids for o in llm.chat(mixed_requests(), GREEDY)]
        vision = llm.engine.vision
        assert vision._ship == "shm" and vision.remote.fallbacks == {} and vision.stats.images == 0
    assert len(entries) >= 10 and all(
        lv == levels and shape[1] == width * (1 + levels) for lv, shape in entries
    )
    for i, (g, e) in enumerate(zip(got, want, strict=True)):
        assert g == e, f"request {i}"
