"""One hostile request among live ones gets its own 400; the requests decoding beside it finish with the tokens
they get alone (a real server process)."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.support import is_idle, wait_idle

PROMPTS = ["Tell me about rivers.", "List three colours:", "Write a short poem about the sea."]
HOSTILE = [
    {"top_k": 10**400, "temperature": 0.7},  # used to fail the step of every request beside it
    {"top_k": 2**64, "temperature": 0.7},  # fits no int64 either
    {"min_tokens": 10**30, "max_tokens": None},
    {"logit_bias": {str(i): 1 for i in range(5000)}},  # per-step work on the engine thread for every token
]


def body(prompt: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "temperature": 0, **extra}


def stream_tokens(base_url: str, prompt: str, started) -> list[int]:
    """A streamed greedy request's token ids; ``started`` is set once its first token arrived."""
    ids: list[int] = []
    with httpx.Client(base_url=base_url, timeout=120) as http:
        req = body(prompt, stream=True, return_token_ids=True, ignore_eos=True)
        with http.stream("POST", "/v1/chat/completions", json=req) as resp:
            assert resp.status_code == 200, resp.read()
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for choice in chunk["choices"]:
                    ids += choice.get("token_ids") or []
                if ids:
                    started()
    return ids


def test_a_hostile_request_among_live_ones_fails_alone(server):
    alone = [stream_tokens(server.base_url, p, lambda: None) for p in PROMPTS]
    assert all(len(ids) == 24 for ids in alone)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        streaming = [threading.Event() for _ in PROMPTS]
        futures = [pool.submit(stream_tokens, server.base_url, p, e.set) for p, e in zip(PROMPTS, streaming)]
        for e in streaming:
            assert e.wait(120)
        for extra in HOSTILE:  # while the others decode
            resp = server.post_chat(body("Say something.", **extra))
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"]["type"] == "invalid_request_error"
        together = [f.result() for f in futures]
    assert together == alone
    server.assert_alive()
    assert is_idle(wait_idle(server.metrics, 30))
