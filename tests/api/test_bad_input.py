"""Bad input: each answered with a 4xx and the OpenAI error body while the server keeps serving; nothing
leaks KV blocks. The SSRF cases run against a server whose process cannot reach past loopback (see
netguard/sitecustomize.py), and prove that refused URLs were never connected to."""

from __future__ import annotations

import struct
import zlib

import pytest

from tests.api.conftest import IMAGE_LIMIT, MAX_MEDIA_BYTES, MAX_MODEL_LEN, PNG
from tests.support import data_url


def with_image(url: str, text: str = "What is this?") -> dict:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4}


def png_header_only(width: int, height: int) -> bytes:
    """A small PNG whose header declares width×height (a decompression bomb's calling card)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 1024)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def assert_error(resp, status: int, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error" if status in (400, 413) else err["type"])
    if code is not None:
        assert err["code"] == code, err
    return err


OK = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_netguard_refuses_non_loopback_in_server_process(server):
    """The harness check: inside the server process a connect to 10.0.0.1 fails at once, from the guard."""
    import json

    report = json.loads(server.guard_report.read_text())
    assert report["pid"] == server.proc.pid
    for path in ("sync", "asyncio"):
        assert report[path]["errno"] == 101, report  # ENETUNREACH
        assert "vlmserve test net guard" in report[path]["message"]
    assert "vlmserve test net guard" in report["dns"]["message"]
    assert report["seconds"] < 1.0
    assert report["tripped"] == [] and report["ok"]


@pytest.mark.parametrize(
    "body, code",
    [
        pytest.param(b'{"messages": [{"role": "user", "content": "hi"}', "json_invalid", id="malformed-json"),
        pytest.param(b"\xff\xfe not json", None, id="binary-garbage"),
        pytest.param(b"[" * 100_000, None, id="deeply-nested"),
        pytest.param({**OK, "temperature": "hot"}, "float_type", id="temperature-str"),
        pytest.param({**OK, "n": "2"}, "int_type", id="n-str"),
        pytest.param({**OK, "max_tokens": 1.5}, "int_type", id="max-tokens-float"),
        pytest.param({**OK, "stream": "yes"}, "bool_type", id="stream-str"),
        pytest.param({**OK, "messages": "hi"}, "list_type", id="messages-str"),
        pytest.param({**OK, "messages": [{"role": "wizard", "content": "hi"}]}, None, id="bad-role"),
        pytest.param(
            {**OK, "messages": [{"role": "user", "content": [{"type": "audio"}]}]}, None, id="bad-part"
        ),
        pytest.param({**OK, "stop": [1, 2]}, None, id="stop-ints"),
        pytest.param({**OK, "top_p": 0}, "greater_than", id="top-p-zero"),
        pytest.param({**OK, "seed": 2**70}, "less_than_equal", id="seed-huge"),
        pytest.param({**OK, "messages": []}, "too_short", id="empty-messages"),
        pytest.param({"model": "tiny"}, "missing", id="no-messages"),
        pytest.param({**OK, "max_tokens": 0}, "greater_than_equal", id="max-tokens-0"),
        pytest.param({**OK, "max_tokens": -1}, "greater_than_equal", id="max-tokens-negative"),
        pytest.param({**OK, "max_completion_tokens": 0}, "greater_than_equal", id="max-completion-tokens-0"),
        pytest.param({**OK, "n": 1000}, "less_than_equal", id="n-too-big"),
        pytest.param({**OK, "n": 64}, None, id="n-over-max-num-seqs"),
        pytest.param({**OK, "stream_options": {"include_usage": True}}, None, id="stream-options-no-stream"),
        pytest.param({**OK, "logprobs": "yes"}, "bool_type", id="logprobs-str"),
        pytest.param({**OK, "logprobs": True, "top_logprobs": 21}, "less_than_equal", id="top-logprobs-21"),
        pytest.param({**OK, "response_format": "json"}, "dict_type", id="response-format-str"),
        pytest.param({**OK, "presence_penalty": 2.5}, "less_than_equal", id="presence-penalty-high"),
        pytest.param({**OK, "logit_bias": {"15": 101}}, "less_than_equal", id="logit-bias-high"),
        pytest.param({**OK, "logit_bias": {"15": "up"}}, "float_type", id="logit-bias-str"),
        pytest.param({**OK, "repetition_penalty": 0}, "greater_than", id="repetition-penalty-0"),
        pytest.param({**OK, "min_p": 1.5}, "less_than_equal", id="min-p-high"),
        pytest.param({**OK, "min_tokens": 3}, None, id="min-tokens-over-max-tokens"),
        # Integers a step could not hold in a tensor are refused at the door (they used to fail the whole step).
        pytest.param({**OK, "top_k": 10**400}, "less_than_equal", id="top-k-huge"),
        pytest.param({**OK, "max_tokens": 10**30}, "less_than_equal", id="max-tokens-huge"),
        pytest.param(
            {**OK, "min_tokens": 10**30, "max_tokens": None}, "less_than_equal", id="min-tokens-huge"
        ),
        pytest.param(
            {**OK, "logit_bias": {str(i): 1 for i in range(301)}}, "too_long", id="logit-bias-301-entries"
        ),
        pytest.param({**OK, "stop": "x" * 1025}, None, id="stop-string-too-long"),
    ],
)
def test_malformed_requests(server, body, code):
    assert_error(server.post_chat(body), 400, code)


TOOL = {
    "type": "function",
    "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}},
}


@pytest.mark.parametrize(
    "options, param",
    [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"functions": [TOOL["function"]]}, "functions"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"prediction": {"type": "content", "content": "hi"}}, "prediction"),
    ],
)
def test_options_that_would_change_the_answer_are_refused(server, options, param):
    """Legacy functions, audio, predicted outputs, …: vlmserve does none of them, and answering as if they had
    not been asked would hand back something other than what was asked for. Streaming or not. (Structured output
    and tools: tests/api/test_structured_output.py.)"""
    for stream in (False, True):
        err = assert_error(server.post_chat({**OK, **options, "stream": stream}), 400, "unsupported")
        assert err["param"] == param, err


def test_those_options_at_their_defaults_are_served(server):
    """What SDKs and agent frameworks send when the option is unset."""
    defaults = {
        "top_logprobs": 0,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "response_format": {"type": "text"},
        "tools": [TOOL],
        "tool_choice": "none",
        "logit_bias": {"15": 0},
        "modalities": ["text"],
        "repetition_penalty": 1.0,
        "min_p": 0.0,
        "min_tokens": 0,
        "parallel_tool_calls": True,
    }
    resp = server.post_chat({**OK, **defaults})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] is not None
    assert server.post_chat({**OK, "tools": [], "tool_choice": "auto", "logit_bias": {}}).status_code == 200


def test_unknown_model_and_route(server):
    assert_error(server.post_chat({**OK, "model": "gpt-4o"}), 404, "model_not_found")
    assert_error(server.http.get("/v1/nope"), 404)
    assert_error(server.http.get("/v1/chat/completions"), 405)


def test_unknown_fields_are_ignored(server):
    """As in vLLM: extra (e.g. newer OpenAI) fields do not fail a request; wrong types of known ones do."""
    assert server.post_chat({**OK, "some_future_option": {"x": [1]}}).status_code == 200


def test_bad_images(server, image_server):
    assert_error(server.post_chat(with_image(data_url(PNG[:300]))), 400, "corrupt")
    assert_error(server.post_chat(with_image("data:image/png;base64,!!!notbase64")), 400, "invalid_image_url")
    assert_error(server.post_chat(with_image(data_url(b"GIF89a-not-really"))), 400)
    assert_error(server.post_chat(with_image(image_server.url("/corrupt.png"))), 400, "corrupt")
    assert_error(server.post_chat(with_image(image_server.url("/missing.png"))), 400, "media_fetch_failed")
    assert_error(server.post_chat(with_image("ftp://images.test/a.png")), 400, "invalid_image_url")
    # A corrupt image in a streaming request fails before the stream starts: a plain 400, not an SSE error.
    assert_error(server.post_chat({**with_image(data_url(PNG[:300])), "stream": True}), 400, "corrupt")


def test_decompression_bomb(server):
    err = assert_error(server.post_chat(with_image(data_url(png_header_only(30000, 30000)))), 400)
    assert err["code"] == "decompression_bomb"


def test_byte_caps(server, image_server):
    assert_error(server.post_chat(with_image(image_server.url("/big.png"))), 413, "media_too_large")
    assert_error(server.post_chat(with_image(image_server.url("/big-chunked.png"))), 413, "media_too_large")
    assert_error(
        server.post_chat(with_image(data_url(b"\0" * (MAX_MEDIA_BYTES + 1)))), 413, "media_too_large"
    )


def test_too_many_images_fetches_nothing(server, image_server):
    before = image_server.connections
    body = with_image(image_server.url("/img.png"))
    body["messages"][0]["content"] = [
        {"type": "image_url", "image_url": {"url": image_server.url(f"/img.png?{i}")}}
        for i in range(IMAGE_LIMIT + 1)
    ]
    assert_error(server.post_chat(body), 400, "too_many_images")
    assert image_server.connections == before


def test_prompt_longer_than_max_model_len(server):
    body = {**OK, "messages": [{"role": "user", "content": "word " * (MAX_MODEL_LEN * 2)}]}
    assert_error(server.post_chat(body), 400, "context_length_exceeded")
    assert_error(server.post_chat({**body, "stream": True}), 400, "context_length_exceeded")


def test_file_urls_outside_the_allowed_path(server, tmp_path):
    media = server.media_dir
    (media / "ok.png").write_bytes(PNG)
    outside = tmp_path / "secret.png"
    outside.write_bytes(PNG)
    (media / "link.png").symlink_to(outside)
    for url in (
        "file:///etc/passwd",
        f"file://{media}/../{media.name}/../../{outside.relative_to(tmp_path.anchor)}",
        f"file://{media}/link.png",
        f"file://{media}/%2e%2e/secret.png",
        "file://otherhost/etc/passwd",
    ):
        assert_error(server.post_chat(with_image(url)), 400)
    assert_error(server.post_chat(with_image(f"file://{media}/missing.png")), 400, "media_fetch_failed")
    assert server.post_chat(with_image(f"file://{media}/ok.png")).status_code == 200


SSRF_URLS = [
    "http://127.0.0.1:{canary}/x.png",
    "http://localhost:{canary}/x.png",
    "http://rebind.test:{canary}/x.png",
    "http://[::1]:{canary}/x.png",
    "http://[::ffff:127.0.0.1]:{canary}/x.png",
    "http://0.0.0.0:{canary}/x.png",
    "http://2130706433:{canary}/x.png",  # legacy numeric forms of 127.0.0.1 the C resolver accepts
    "http://127.1:{canary}/x.png",
    "http://0x7f000001:{canary}/x.png",
    "http://10.0.0.1/x.png",
    "http://evil.test/x.png",
    "http://169.254.169.254/latest/meta-data/",
    "http://meta.test/latest/meta-data/",
    "http://[fd00:ec2::254]/latest/meta-data/",
    "http://[::ffff:10.0.0.1]/x.png",
    "http://192.168.1.1/x.png",
    "https://172.16.0.1/x.png",
    "http://224.0.0.1/x.png",
]


@pytest.mark.parametrize("template", SSRF_URLS)
def test_ssrf_refused_without_connecting(guarded_server, canary, template):
    url = template.format(canary=canary.port)
    before = len(guarded_server.guard_events())
    err = assert_error(guarded_server.post_chat(with_image(url)), 400)
    assert err["code"] in ("media_url_forbidden", "media_fetch_failed"), err
    assert canary.accepted == 0
    # The API refused before any socket: the guard never even saw an attempt.
    assert guarded_server.guard_events()[before:] == []


@pytest.mark.parametrize(
    "target", ["http://10.0.0.1/x.png", "http://127.0.0.1:{canary}/", "http://evil.test/"]
)
def test_redirect_to_private_address_refused(guarded_server, image_server, canary, target):
    target = target.format(canary=canary.port)
    before_hits = image_server.hits["/redirect"]
    before_events = len(guarded_server.guard_events())
    url = image_server.url(f"/redirect?to={target}")
    err = assert_error(guarded_server.post_chat(with_image(url)), 400, "media_url_forbidden")
    assert "resolves to" in err["message"]
    assert image_server.hits["/redirect"] == before_hits + 1  # the allowed first hop was fetched
    assert canary.accepted == 0
    assert guarded_server.guard_events()[before_events:] == []


def test_redirect_limits(guarded_server, image_server):
    err = assert_error(
        guarded_server.post_chat(with_image(image_server.url("/loop"))), 400, "media_fetch_failed"
    )
    assert "redirected more than" in err["message"]
    url = image_server.url("/redirect?to=file:///etc/passwd")
    assert_error(guarded_server.post_chat(with_image(url)), 400, "media_url_forbidden")


def test_slow_image_server_times_out(guarded_server, image_server):
    assert_error(
        guarded_server.post_chat(with_image(image_server.url("/slow.png"))), 400, "media_fetch_timeout"
    )


def test_redirect_chain_within_allowed_host_is_followed(guarded_server, image_server):
    url = image_server.url("/redirect?to=" + image_server.url("/img.png"))
    assert guarded_server.post_chat(with_image(url)).status_code == 200


def test_zz_after_all_bad_input_nothing_leaked(server):
    """Runs last in this module: the server still serves, and no KV block or request is left behind."""
    server.assert_alive()
    assert server.post_chat(OK).status_code == 200
    m = server.wait_idle()
    assert m["vlmserve_num_requests_running"] == 0
    assert m["vlmserve_num_requests_waiting"] == 0
    assert m["vlmserve_kv_cache_blocks_free"] == m["vlmserve_kv_cache_blocks_total"] == 256
    assert m["vlmserve_requests_total{status=client_error}"] > 30
    assert m.get("vlmserve_requests_total{status=server_error}", 0) == 0
