"""Schemathesis against the live server's own OpenAPI schema: valid and schema-violating requests, a fixed
number of cases from a fixed seed (the same cases on any machine, however long they take); none may get a 5xx
(and the server must still serve after)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

# 160 in all: about the cases a 30 s budget per mode reached on a 2-core AVX-512 machine, now the same on any.
MAX_CASES = {GenerationMode.POSITIVE: 90, GenerationMode.NEGATIVE: 70}


def bound_load(body) -> None:
    """Keep generated chat requests cheap: few tokens and choices (fuzzing the schema, not the throughput)."""
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > 4:
            body[key] = 4
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 4
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool) and body["n"] > 2:
        body["n"] = 2


@pytest.mark.parametrize("mode", list(MAX_CASES), ids=lambda m: m.value)
def test_openapi_fuzz_finds_no_server_error(guarded_server, mode):
    server = guarded_server
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {(op.method.upper(), op.path) for op in ops} >= {
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
        ("GET", "/health"),
        ("GET", "/metrics"),
    }
    strategy = st.one_of([op.as_strategy(generation_mode=mode) for op in ops])
    seen: list[tuple[str, int]] = []

    @settings(
        max_examples=MAX_CASES[mode],
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def run(case):
        bound_load(case.body)
        resp = case.call(base_url=server.base_url, timeout=30)
        seen.append((case.operation.path, resp.status_code))
        assert resp.status_code < 500, (
            f"{case.method} {case.path} {case.body!r} -> {resp.status_code} {resp.text}"
        )

    run()
    assert len(seen) == MAX_CASES[mode], len(seen)  # every case ran: none skipped for lack of time
    if mode is GenerationMode.NEGATIVE:
        assert any(status == 400 for _, status in seen)
    else:
        assert any(path == "/v1/chat/completions" and status == 200 for path, status in seen)
    server.assert_alive()
    m = server.wait_idle()
    assert m["vlmserve_kv_cache_blocks_free"] == m["vlmserve_kv_cache_blocks_total"]
