"""The app in-process (no sockets beyond the test client): API key, engine faults, and the media policy."""

from __future__ import annotations

import base64
import ipaddress
import json
import threading
import time

import pytest
from fastapi.testclient import TestClient

from api import chat
from api.config import ServerArgs, parse_limit_mm
from api.media import MediaConfig
from api.server import create_app
from api.ssrf import AddressGuard, is_public_address
from lm_engine import LLMEngine
from lm_engine.config import EngineConfig
from tests.support import EOS_PROBE

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}


def make_client(ckpt, engine_kw: dict | None = None, **server_kw) -> TestClient:
    args = ServerArgs(
        engine=EngineConfig(model=str(ckpt), num_kv_blocks=64, **(engine_kw or {})), **server_kw
    )
    return TestClient(create_app(args), raise_server_exceptions=False)


def test_api_key(tiny_ckpt):
    with make_client(tiny_ckpt, api_key="s3cret") as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
            resp = client.get("/v1/models", headers=headers)
            assert resp.status_code == 401
            assert resp.json()["error"]["code"] == "invalid_api_key"
            # The key is checked before the body: a bad body without a key is still a 401.
            assert client.post("/v1/chat/completions", content=b"{", headers=headers).status_code == 401
        ok = {"Authorization": "Bearer s3cret"}
        assert client.get("/v1/models", headers=ok).status_code == 200
        assert client.post("/v1/chat/completions", json=CHAT, headers=ok).status_code == 200
        assert client.get("/health").status_code == 200  # probes need no key
        # /metrics tells what was served (cache hits, queue lengths): a key's holders only, unless public.
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers=ok).status_code == 200
    with make_client(tiny_ckpt, api_key="s3cret", metrics_public=True) as client:
        assert client.get("/metrics").status_code == 200
        assert client.get("/v1/models").status_code == 401


def test_several_api_keys_each_a_tenant(tiny_ckpt, tmp_path):
    from api.config import read_api_keys

    path = tmp_path / "keys"
    path.write_text("# tenants\nk-alpha alpha\nk-beta beta\n\nk-alpha2 alpha\nk-anon\n")
    keys = read_api_keys(path)
    assert keys["k-alpha"] == keys["k-alpha2"] == "alpha" and keys["k-beta"] == "beta"
    assert keys["k-anon"].startswith("key-") and "k-anon" not in keys["k-anon"]
    with make_client(tiny_ckpt, api_keys=keys) as client:
        for key in keys:
            resp = client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"})
            assert resp.status_code == 200, resp.text
        assert (
            client.post(
                "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer k-alph"}
            ).status_code
            == 401
        )
    path.write_text("k-1\nk-1 again\n")
    with pytest.raises(ValueError, match="listed twice"):
        read_api_keys(path)


def test_a_large_body_is_parsed_off_the_event_loop(tiny_ckpt, monkeypatch):
    """Megabytes of JSON parsed on the event loop hold every other client (and the balancer's health checks)
    for seconds; past the threshold the body is parsed on a worker thread, message by message, with the same
    verdicts as the one-call parse of a small body."""
    import api.server
    from api.protocol import ChatCompletionRequest

    threads: dict[str, list[str]] = {"small": [], "large": []}
    real_small, real_large = ChatCompletionRequest.model_validate_json, api.server.parse_large_request

    def small(raw, *args, **kw):
        threads["small"].append(threading.current_thread().name)
        return real_small(raw, *args, **kw)

    def large(raw):
        threads["large"].append(threading.current_thread().name)
        return real_large(raw)

    monkeypatch.setattr(ChatCompletionRequest, "model_validate_json", small)
    monkeypatch.setattr(api.server, "parse_large_request", large)
    pad = {"role": "system", "content": "x" * 400}
    cases = [
        (CHAT, 200, None),
        ({**CHAT, "messages": [pad, *CHAT["messages"]]}, 200, None),
        ({**CHAT, "messages": [pad, {"role": "wizard", "content": "hi"}]}, 400, "messages.1.role"),
        ({**CHAT, "messages": [pad, *CHAT["messages"]], "n": "2"}, 400, "n"),
        ({**CHAT, "messages": [pad, {"role": "user", "content": [{"type": "audio"}]}]}, 400, None),
    ]
    loops: list[str] = []
    for padded in (False, True):
        with make_client(tiny_ckpt, parse_off_loop_bytes=300 if padded else 10**6) as client:
            loops.append(client.portal.call(lambda: threading.current_thread().name))
            for body, status, param in cases:
                resp = client.post("/v1/chat/completions", json=body)
                assert resp.status_code == status, resp.text
                if param is not None:
                    assert resp.json()["error"]["param"] == param
            bad = client.post("/v1/chat/completions", content=b'{"messages": [' + b" " * 400)
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "json_invalid"
    assert set(threads["small"]) <= set(loops) and len(threads["small"]) == len(cases) + 1 + 1
    assert threads["large"] and not set(threads["large"]) & set(loops)


def test_request_body_cap(tiny_ckpt):
    with make_client(tiny_ckpt, max_request_bytes=2000) as client:
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
        resp = client.post("/v1/chat/completions", json=big)
        assert resp.status_code == 413
        assert resp.json()["error"]["code"] == "request_too_large"

        def chunked():  # no Content-Length: the bytes are counted as they arrive
            body = json.dumps(big).encode()
            for i in range(0, len(body), 1000):
                yield body[i : i + 1000]

        resp = client.post(
            "/v1/chat/completions", content=chunked(), headers={"Content-Type": "application/json"}
        )
        assert resp.status_code == 413
        assert resp.json()["error"]["code"] == "request_too_large"
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_an_oversized_prompt_is_refused_before_the_template_and_tokenizer(tiny_ckpt):
    """Megabytes of text that cannot fit the context are refused at a glance (no token is longer than the
    longest in the vocabulary): the chat template and the tokenizer never see them, so they cost the requests
    beside them nothing."""
    with make_client(tiny_ckpt) as client:
        processor = client.app.state.engine.engine.processor
        rendered: list[int] = []
        render = processor.render
        processor.render = lambda messages, *tools: (
            rendered.append(len(str(messages))) or render(messages, *tools)
        )
        huge = {**CHAT, "messages": [{"role": "user", "content": "word " * 800_000}]}  # 4 MB
        resp = client.post("/v1/chat/completions", json=huge)
        assert resp.status_code == 400
        assert resp.json()["error"]["code"] == "context_length_exceeded"
        assert rendered == []
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert len(rendered) == 1 and rendered[0] < 1000


def test_null_user_content_is_a_400(tiny_ckpt):
    with make_client(tiny_ckpt) as client:
        resp = client.post(
            "/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": None}]}
        )
        assert resp.status_code == 400
        assert "must not be null" in resp.json()["error"]["message"]
        # An assistant turn without content (e.g. one that only called tools) is fine.
        history = [{"role": "assistant", "content": None}, {"role": "user", "content": "hi"}]
        assert client.post("/v1/chat/completions", json={**CHAT, "messages": history}).status_code == 200


def test_admission_control_refusal_is_503_with_retry_after(tiny_ckpt):
    with make_client(tiny_ckpt, {"max_queued_requests": 0}) as client:
        resp = client.post("/v1/chat/completions", json=CHAT)
        assert resp.status_code == 503
        assert resp.json()["error"]["code"] == "overloaded"
        assert int(resp.headers["Retry-After"]) >= 1
        assert 'vlmserve_requests_total{status="unavailable"} 1.0' in client.get("/metrics").text
        assert client.get("/health").status_code == 200


def test_engine_step_failure_fails_the_request_and_keeps_serving(tiny_ckpt):
    with make_client(tiny_ckpt) as client:
        engine = client.app.state.engine.engine
        real_step = engine.step
        calls = {"n": 0}

        def flaky_step():
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("simulated kernel fault")
            return real_step()

        engine.step = flaky_step
        resp = client.post("/v1/chat/completions", json=CHAT)
        assert resp.status_code == 500
        assert resp.json()["error"] == {
            "message": "the engine failed while running this request: RuntimeError",
            "type": "server_error",
            "param": None,
            "code": "engine_error",
        }
        # Its blocks were freed, the invariants hold, and the next request is served.
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert client.get("/health").status_code == 200
        metrics = client.get("/metrics").text
        assert 'vlmserve_requests_total{status="server_error"} 1.0' in metrics
        assert "vlmserve_kv_cache_blocks_free 64.0" in metrics


def test_engine_thread_death_turns_health_not_ready(tiny_ckpt):
    with make_client(tiny_ckpt) as client:
        engine = client.app.state.engine.engine

        def broken_step():
            raise RuntimeError("simulated fault")

        def broken_invariants():
            # Slow, so that a server answering the request before it marks the thread dead is caught.
            time.sleep(0.3)
            raise AssertionError("simulated corrupt block table")

        engine.step = broken_step
        engine.check_integrity = broken_invariants
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 500
        health = client.get("/health")
        assert health.status_code == 503
        assert health.json()["error"]["code"] == "engine_unavailable"
        resp = client.post("/v1/chat/completions", json=CHAT)
        assert resp.status_code == 503
        assert "vlmserve_engine_alive 0.0" in client.get("/metrics").text


@pytest.mark.parametrize("where", ["step", "vision tower"])
def test_a_fatal_device_error_stops_the_engine(tiny_ckpt, where):
    """A device-side assert or illegal address poisons every later kernel: the engine stops and /health says
    so, rather than failing request after request (the block invariants would still hold)."""
    from tests.support import make_image

    fault = RuntimeError("CUDA error: an illegal memory access was encountered")
    with make_client(tiny_ckpt) as client:
        engine = client.app.state.engine.engine
        body = CHAT
        if where == "step":

            def broken(*args):
                raise fault

            engine.step = broken
        else:
            engine.vision.encode = lambda pixels, grid: (_ for _ in ()).throw(fault)
            url = "data:image/png;base64," + base64.b64encode(make_image(56, 56, 1)).decode()
            content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]
            body = {**CHAT, "messages": [{"role": "user", "content": content}]}
        resp = client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 500, resp.json()  # the server's fault, not the image's
        assert client.get("/health").status_code == 503
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 503


def test_eos_and_ignore_eos(eos_ckpt, eos_oracle):
    """A choice that ends by EOS reports finish_reason "stop", streamed or not, at transformers' last token;
    with ignore_eos it runs on to max_tokens as transformers does with no EOS at all."""
    body = {"messages": EOS_PROBE, "max_tokens": 20, "temperature": 0, "return_token_ids": True}
    stopped = eos_oracle.generate(EOS_PROBE, 20)
    assert len(stopped) < 20, "the probe must end by EOS for this test to bite"
    with make_client(eos_ckpt) as client:
        (choice,) = client.post("/v1/chat/completions", json=body).json()["choices"]
        assert (choice["token_ids"], choice["finish_reason"]) == (stopped, "stop")
        resp = client.post("/v1/chat/completions", json={**body, "stream": True})
        events = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
        choices = [c for e in events for c in e["choices"]]
        assert [t for c in choices for t in c.get("token_ids") or []] == stopped
        assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["stop"]
        (choice,) = client.post("/v1/chat/completions", json={**body, "ignore_eos": True}).json()["choices"]
        assert choice["token_ids"] == eos_oracle.generate(EOS_PROBE, 20, eos_token_id=None)
        assert choice["finish_reason"] == "length"


def test_min_tokens_and_logit_bias_reach_the_sampler(eos_ckpt, eos_oracle):
    """OpenAI's logit_bias (token ids as strings) and vLLM's min_tokens over HTTP give transformers' tokens
    with its sequence_bias and min_new_tokens; a logit_bias key that is not a token id is a 400."""
    body = {"messages": EOS_PROBE, "max_tokens": 20, "temperature": 0, "return_token_ids": True}
    stopped = eos_oracle.generate(EOS_PROBE, 20)
    banned = stopped[1]
    with make_client(eos_ckpt) as client:
        resp = client.post("/v1/chat/completions", json={**body, "min_tokens": len(stopped) + 4})
        (choice,) = resp.json()["choices"]
        assert choice["token_ids"] == eos_oracle.generate(EOS_PROBE, 20, min_new_tokens=len(stopped) + 4)
        assert len(choice["token_ids"]) >= len(stopped) + 4
        resp = client.post("/v1/chat/completions", json={**body, "logit_bias": {str(banned): -100}})
        (choice,) = resp.json()["choices"]
        assert choice["token_ids"] == eos_oracle.generate(EOS_PROBE, 20, sequence_bias={(banned,): -100.0})
        assert banned not in choice["token_ids"]
        for key in ("x", "-1", "10000000", "1.5"):
            resp = client.post("/v1/chat/completions", json={**body, "logit_bias": {key: 1}})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "logit_bias", resp.text


def test_streaming_engine_failure_is_an_sse_error_event(tiny_ckpt, monkeypatch):
    """A step that fails after the response started ends the stream with an SSE error event and [DONE]."""
    # NOTE: paced by events, not by a step count: steps that only wait for the image's encoding return
    # nothing (how many there are depends on the machine), and an output not yet read when the failure
    # comes is replaced by the error (the request failed), so the fault waits until a token chunk was
    # written to the response.
    chunk_sent = threading.Event()
    real_deltas = chat._ChunkWriter.deltas

    def deltas_noting_tokens(self, out):
        delta = real_deltas(self, out)
        if delta is not None:
            chunk_sent.set()
        return delta

    monkeypatch.setattr(chat._ChunkWriter, "deltas", deltas_noting_tokens)
    with make_client(tiny_ckpt) as client:
        engine = client.app.state.engine.engine
        real_step = engine.step
        fault = {"armed": False, "fired": False}

        def step_failing_mid_stream():
            if fault["armed"] and not fault["fired"]:
                fault["fired"] = chunk_sent.wait(timeout=60)
                raise RuntimeError("simulated fault")
            outputs = real_step()
            fault["armed"] = any(c.token_ids for o in outputs for c in o.outputs)
            return outputs

        engine.step = step_failing_mid_stream
        body = {**CHAT, "max_tokens": 8, "stream": True, "return_token_ids": True}
        resp = client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200
        assert fault["fired"], "no token chunk was written before the fault"
        events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert '"code":"engine_error"' in events[-2]
        # mid-stream: the first token's chunk went out before the error
        sent = [t for e in events[:-2] for c in json.loads(e)["choices"] for t in c["token_ids"]]
        assert 0 < len(sent) < 8, events


@pytest.mark.parametrize(
    "address, public",
    [
        ("8.8.8.8", True),
        ("2001:4860:4860::8888", True),
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("172.16.0.1", False),
        ("192.168.0.1", False),
        ("100.64.0.1", False),  # carrier-grade NAT
        ("169.254.169.254", False),
        ("100.100.100.200", False),
        ("0.0.0.0", False),
        ("224.0.0.1", False),
        ("255.255.255.255", False),
        ("::1", False),
        ("fe80::1", False),
        ("fd00:ec2::254", False),
        ("::ffff:10.0.0.1", False),  # IPv4-mapped
        ("2002:a00:1::1", False),  # 6to4 of 10.0.0.1
        ("64:ff9b::a00:1", False),  # NAT64 of 10.0.0.1
        ("64:ff9b::808:808", True),  # NAT64 of 8.8.8.8
    ],
)
def test_public_address_policy(address, public):
    assert is_public_address(ipaddress.ip_address(address)) is public


@pytest.mark.parametrize(
    "guard, host, allowed",
    [
        (AddressGuard(), "127.0.0.1", False),
        (AddressGuard(), "10.0.0.1", False),
        (AddressGuard(allow_private=True), "10.0.0.1", True),
        (AddressGuard(frozenset({"10.0.0.1"})), "10.0.0.1", True),
        (AddressGuard(frozenset({"10.0.0.2"})), "10.0.0.1", False),
        (AddressGuard(), "2130706433", False),  # 127.0.0.1 in a legacy numeric form
    ],
)
def test_address_guard(guard, host, allowed):
    """Numeric hosts only: resolving them is a parse, no lookup leaves the machine."""
    import asyncio

    from api.errors import APIError

    if allowed:
        assert asyncio.run(guard.resolve(host, 80)) == [host]
    else:
        with pytest.raises(APIError) as exc:
            asyncio.run(guard.resolve(host, 80))
        assert exc.value.code == "media_url_forbidden"


def test_limit_mm_per_prompt_parsing():
    assert parse_limit_mm("image=4") == {"image": 4}
    assert parse_limit_mm("image=4,video=0") == {"image": 4, "video": 0}
    assert parse_limit_mm('{"image": 2}') == {"image": 2}
    for bad in ("image", "image=-1", '{"image": true}', "pixels=3", "[1]"):
        with pytest.raises(ValueError):
            parse_limit_mm(bad)


def test_allowed_local_media_path_must_be_a_directory(tmp_path):
    with pytest.raises(ValueError):
        MediaConfig(allowed_local_path=tmp_path / "missing")
    assert MediaConfig(allowed_local_path=tmp_path).allowed_local_path == tmp_path.resolve()


def test_given_engine_is_used(tiny_ckpt):
    engine = LLMEngine(EngineConfig(model=str(tiny_ckpt), num_kv_blocks=32))
    app = create_app(ServerArgs(engine=engine.config, served_model_names=["a", "b"]), engine=engine)
    with TestClient(app) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["a", "b"]
        assert client.post("/v1/chat/completions", json={**CHAT, "model": "b"}).json()["model"] == "b"
        assert "vlmserve_kv_cache_blocks_total 32.0" in client.get("/metrics").text


def test_unread_outputs_merge_their_deltas():
    """A slow reader gets one output carrying every delta it missed (memory O(tokens), not O(tokens²))."""
    import asyncio

    from api.async_engine import RequestStream
    from lm_engine.outputs import CompletionOutput, RequestOutput

    class Owner:
        aborted: list[str] = []

        def abort(self, request_id):
            self.aborted.append(request_id)

        def _dequeue(self, stream):
            pass

    def out(ids: list[int], text: str, delta_ids, delta_text, finished=False):
        c = CompletionOutput(0, ids, text, "length" if finished else None, None, delta_text, delta_ids)
        return RequestOutput("r", [1], [c], finished)

    async def main():
        owner = Owner()
        stream = RequestStream("r", owner)
        stream.push(out([5], "a", [5], "a"))
        stream.push(out([5, 6], "ab", [6], "b"))
        stream.push(out([5, 6, 7], "abc", [7], "c", finished=True))
        got = [o async for o in stream]
        assert len(got) == 1
        (c,) = got[0].outputs
        assert (c.delta_token_ids, c.delta_text, c.token_ids) == ([5, 6, 7], "abc", [5, 6, 7])
        stream.close()
        assert owner.aborted == []  # finished: nothing to abort
        unfinished = RequestStream("u", owner)
        unfinished.push(out([5], "a", [5], "a"))
        unfinished.close()
        assert owner.aborted == ["u"]

    asyncio.run(main())


def test_tenants_and_salts_share_no_cached_tokens(tiny_ckpt):
    """cached_tokens must not tell a tenant what another sent: each API key's tenant, and each request
    cache_salt, has prefix-cache entries of its own; within one tenant and salt the cache still hits."""
    long_text = "Please read this long shared preamble about rivers and mountains. " * 6
    body = {"messages": [{"role": "user", "content": long_text}], "max_tokens": 2, "temperature": 0}
    keys = {"k-a": "alpha", "k-b": "beta"}

    def cached(client, key: str, **extra) -> tuple[int, list]:
        resp = client.post(
            "/v1/chat/completions", json={**body, **extra}, headers={"Authorization": f"Bearer {key}"}
        )
        assert resp.status_code == 200, resp.text
        out = resp.json()
        return out["usage"]["prompt_tokens_details"]["cached_tokens"], out["choices"][0]["message"]["content"]

    with make_client(tiny_ckpt, api_keys=keys) as client:
        first, text = cached(client, "k-a")
        assert first == 0
        assert cached(client, "k-a")[0] > 0  # the same tenant hits
        assert cached(client, "k-b") == (0, text)  # another tenant does not, and gets the same answer
        assert cached(client, "k-a", cache_salt="s1") == (0, text)  # nor another salt within a tenant
        assert cached(client, "k-a", cache_salt="s1")[0] > 0
        assert cached(client, "k-a", cache_salt="s2")[0] == 0
    with make_client(tiny_ckpt, api_keys=keys, cache_salt_per_api_key=False) as client:
        assert cached(client, "k-a")[0] == 0
        assert cached(client, "k-b")[0] > 0  # the operator chose to share across keys
        assert cached(client, "k-b", cache_salt="s1")[0] == 0  # a request's own salt still applies
