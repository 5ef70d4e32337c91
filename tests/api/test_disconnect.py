"""Clients that hang up: their requests are aborted and their KV blocks freed."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx

N_CLIENTS = 20


def long_request(i: int, **kw) -> dict:
    # ignore_eos + many tokens: left alone, each would run for seconds.
    return dict(
        model="tiny",
        messages=[{"role": "user", "content": f"Client {i}: tell me everything you know."}],
        max_tokens=400,
        temperature=1.0,
        seed=i,
        extra_body={"ignore_eos": True},
        **kw,
    )


def test_streaming_clients_hanging_up_after_first_token(guarded_server):
    server = guarded_server
    server.wait_idle()
    aborted_before = server.metrics().get("vlmserve_requests_total{status=aborted}", 0)
    client = server.client()

    def hang_up_after_first_token(i: int) -> float:
        stream = client.chat.completions.create(stream=True, **long_request(i))
        for chunk in stream:
            if any(c.delta.content for c in chunk.choices):
                break
        stream.close()
        return time.monotonic()

    with ThreadPoolExecutor(N_CLIENTS) as pool:
        last_hang_up = max(pool.map(hang_up_after_first_token, range(N_CLIENTS)))
    m = server.wait_idle(timeout=1.0)
    elapsed = time.monotonic() - last_hang_up
    assert m["vlmserve_num_requests_running"] == 0
    assert m["vlmserve_num_requests_waiting"] == 0
    assert m["vlmserve_kv_cache_blocks_free"] == m["vlmserve_kv_cache_blocks_total"]
    assert elapsed < 1.0, f"idle only {elapsed:.2f}s after the last hang-up"
    assert m["vlmserve_requests_total{status=aborted}"] - aborted_before == N_CLIENTS
    server.assert_alive()


def test_non_streaming_client_timing_out(guarded_server):
    server = guarded_server
    server.wait_idle()
    aborted_before = server.metrics().get("vlmserve_requests_total{status=aborted}", 0)
    body = long_request(99)
    body.update(body.pop("extra_body"))
    try:
        httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=0.5)
        raise AssertionError("the request should have outlived the client's timeout")
    except httpx.ReadTimeout:
        t0 = time.monotonic()
    m = server.wait_idle(timeout=1.0)
    assert m["vlmserve_kv_cache_blocks_free"] == m["vlmserve_kv_cache_blocks_total"]
    assert m["vlmserve_num_requests_running"] == 0, (
        f"still running {time.monotonic() - t0:.2f}s after hang-up"
    )
    assert m["vlmserve_requests_total{status=aborted}"] - aborted_before == 1
    server.assert_alive()
