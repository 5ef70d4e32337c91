"""Chat completions through a real server process, driven by the official `openai` client.

Greedy output is checked against transformers' generate() and the offline LLM.chat, token for token:
the request asks for the vLLM-style ``return_token_ids`` extension, so the ids compared are the ones
the server generated, and the text is checked to be what the same tokenizer decodes from them.
"""

from __future__ import annotations

import itertools

import openai
import pytest

from lm_engine import LLM, SamplingParams
from tests.api.conftest import JPEG, PNG
from tests.support import data_url, image_part, make_image, user

MAX_NEW = 12


def image_url_part(url: str, detail: str | None = None) -> dict:
    spec = {"url": url} if detail is None else {"url": url, "detail": detail}
    return {"type": "image_url", "image_url": spec}


def greedy(client, messages, **kw):
    return client.chat.completions.create(
        model="tiny",
        messages=messages,
        temperature=0.0,
        max_tokens=kw.pop("max_tokens", MAX_NEW),
        extra_body={"return_token_ids": True, **kw.pop("extra_body", {})},
        **kw,
    )


@pytest.fixture(scope="module")
def client(guarded_server):
    return guarded_server.client()


@pytest.fixture(scope="module")
def offline(tiny_ckpt):
    with LLM(str(tiny_ckpt), num_kv_blocks=128) as llm:
        yield llm


CONVERSATIONS = {
    "one-image": (
        user(image_url_part(data_url(JPEG, "image/jpeg")), "What is in this picture?"),
        user(image_part(JPEG), "What is in this picture?"),
    ),
    "text-multi-turn": (
        [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": [{"type": "text", "text": "And another?"}]},
        ],
        [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": [{"type": "text", "text": "And another?"}]},
        ],
    ),
    "two-images": (
        user(
            image_url_part(data_url(PNG)), "versus", image_url_part(data_url(JPEG, "image/jpeg")), "Compare."
        ),
        user(image_part(PNG), "versus", image_part(JPEG), "Compare."),
    ),
}


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_greedy_equals_transformers_and_offline(client, hf_oracle, offline, name):
    messages, conv = CONVERSATIONS[name]
    resp = greedy(client, messages)
    choice = resp.choices[0]
    hf_ids = hf_oracle.generate(conv, MAX_NEW)
    assert choice.token_ids == hf_ids
    off = offline.chat(conv, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))[0]
    assert off.token_ids == hf_ids
    # The text streamed out token by token is what the tokenizer decodes from all the ids at once.
    text = hf_oracle.processor.tokenizer.decode(hf_ids, skip_special_tokens=True)
    assert choice.message.content == off.text == text
    inputs = hf_oracle.inputs(conv)
    assert resp.prompt_token_ids == inputs["input_ids"][0].tolist()
    # Usage: prompt/completion counts and each image's visual tokens (transformers' grid / the 2x2 merge).
    grids = inputs["image_grid_thw"].tolist() if "image_grid_thw" in inputs else []
    assert resp.usage.visual_tokens == [t * h * w // 4 for t, h, w in grids]
    details = resp.usage.prompt_tokens_details
    assert details.image_tokens == sum(resp.usage.visual_tokens)
    assert details.text_tokens == resp.usage.prompt_tokens - details.image_tokens
    assert resp.usage.prompt_tokens == len(resp.prompt_token_ids)
    assert resp.usage.completion_tokens == len(choice.token_ids) == MAX_NEW
    assert choice.finish_reason == "length"
    assert resp.model == "tiny" and resp.id.startswith("chatcmpl-")


def test_streaming_equals_non_streaming(client):
    messages = user(image_url_part(data_url(PNG)), "Describe it.")
    full = greedy(client, messages)
    stream = greedy(client, messages, stream=True, stream_options={"include_usage": True})
    text, ids, finish, usage, roles = "", [], None, None, 0
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        (c,) = chunk.choices
        roles += c.delta.role == "assistant"
        text += c.delta.content or ""
        ids += c.token_ids or []
        finish = c.finish_reason or finish
    assert roles == 1
    assert text == full.choices[0].message.content
    assert ids == full.choices[0].token_ids
    assert finish == "length"
    assert usage.completion_tokens == MAX_NEW and usage.prompt_tokens == full.usage.prompt_tokens
    assert usage.visual_tokens == full.usage.visual_tokens


def test_http_image_equals_same_bytes_inline(client, image_server):
    before = image_server.hits["/img.png"]
    by_url = greedy(client, user(image_url_part(image_server.url("/img.png")), "What is it?"))
    inline = greedy(client, user(image_url_part(data_url(PNG)), "What is it?"))
    assert image_server.hits["/img.png"] == before + 1
    assert by_url.choices[0].token_ids == inline.choices[0].token_ids
    assert by_url.usage.visual_tokens == inline.usage.visual_tokens


def test_file_url_under_allowed_path(client, guarded_server):
    (guarded_server.media_dir / "page.png").write_bytes(PNG)
    by_file = greedy(client, user(image_url_part(f"file://{guarded_server.media_dir}/page.png"), "Read it."))
    inline = greedy(client, user(image_url_part(data_url(PNG)), "Read it."))
    assert by_file.choices[0].token_ids == inline.choices[0].token_ids


def test_two_images_in_one_message(client, hf_oracle, image_server):
    messages = user(
        image_url_part(data_url(JPEG, "image/jpeg"), "high"),
        "and",
        {"type": "image_url", "image_url": image_server.url("/img.png")},  # the plain-string form
        "Compare them.",
    )
    resp = greedy(client, messages)
    conv = user(image_part(JPEG), "and", image_part(PNG), "Compare them.")
    grids = hf_oracle.inputs(conv)["image_grid_thw"].tolist()
    assert resp.usage.visual_tokens == [t * h * w // 4 for t, h, w in grids]
    assert resp.choices[0].token_ids == hf_oracle.generate(conv, MAX_NEW)


def test_detail_sets_the_visual_budget(guarded_server):
    """detail=low always gets the lowest visual budget level; high the full one (reported per image)."""
    big = make_image(640, 480, 23, "JPEG")
    body = {
        "model": "tiny",
        "max_tokens": 2,
        "messages": user(
            image_url_part(data_url(big, "image/jpeg"), "low"),
            image_url_part(data_url(big, "image/jpeg"), "high"),
        ),
    }
    resp = guarded_server.post_chat(body)
    assert resp.status_code == 200
    usage = resp.json()["usage"]
    low, high = usage["visual_tokens"]
    assert low < high
    assert usage["visual_levels"][0] > 0 and usage["visual_levels"][1] == 0
    assert resp.headers["X-Visual-Budget-Levels"] == ",".join(map(str, usage["visual_levels"]))


def test_n2_sampled_choices(client):
    messages = user("Tell me a story.")
    resp = client.chat.completions.create(
        model="tiny", messages=messages, n=2, temperature=1.0, max_tokens=16, seed=7
    )
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.choices[0].message.content != resp.choices[1].message.content
    assert resp.usage.completion_tokens == 32
    # Streaming n=2 with the same seed gives the same two texts.
    stream = client.chat.completions.create(
        model="tiny", messages=messages, n=2, temperature=1.0, max_tokens=16, seed=7, stream=True
    )
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in resp.choices]


def test_seed_reproducibility(client):
    def sample(seed):
        return (
            client.chat.completions.create(
                model="tiny",
                messages=user("Say something."),
                temperature=1.0,
                top_p=0.95,
                max_tokens=16,
                seed=seed,
            )
            .choices[0]
            .message.content
        )

    a, b, c = sample(1234), sample(1234), sample(4321)
    assert a == b
    assert a != c


def test_top_k_one_is_greedy(client):
    messages = user("Count to five.")
    greedy_text = greedy(client, messages).choices[0].message.content
    top1 = client.chat.completions.create(
        model="tiny", messages=messages, temperature=1.0, max_tokens=MAX_NEW, extra_body={"top_k": 1}
    )
    assert top1.choices[0].message.content == greedy_text


def streamed_greedy(client, messages, **kw) -> tuple[list[str], str | None]:
    """The text deltas of a streamed greedy request with one choice, and its finish reason."""
    stream = client.chat.completions.create(
        model="tiny", messages=messages, temperature=0.0, stream=True, **kw
    )
    deltas, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            deltas.append(c.delta.content or "")
            finish = c.finish_reason or finish
    return deltas, finish


def test_stop_strings(client):
    messages = user("Write a long sentence about the sea and the wind.")
    full = greedy(client, messages, max_tokens=24).choices[0].message.content
    stop = full[6:9]
    expected = full[: full.find(stop)]
    for stop_arg in (stop, [stop, "\x00never"]):
        resp = greedy(client, messages, max_tokens=24, stop=stop_arg)
        assert resp.choices[0].message.content == expected
        assert resp.choices[0].finish_reason == "stop"
    deltas, finish = streamed_greedy(client, messages, max_tokens=24, stop=[stop])
    assert "".join(deltas) == expected and finish == "stop"


def spanning_stop(tokenizer, text: str, ids: list[int]) -> tuple[str, int]:
    """A 4-character stop string made of the last 2 characters of one generated token and the first 2 of
    the next (its first place in ``text``), and how many tokens it takes to complete it."""
    ends = [len(tokenizer.decode(ids[: k + 1], skip_special_tokens=True)) for k in range(len(ids))]
    for k in range(1, len(ids) - 1):
        start, cut, end = ends[k - 1] - 2, ends[k - 1], ends[k]
        pieces = (tokenizer.decode(ids[k - 1 : k]), tokenizer.decode(ids[k : k + 1]))
        if start < 1 or end - cut < 2 or pieces != (text[ends[k - 2] if k > 1 else 0 : cut], text[cut:end]):
            continue  # too early, a short next token, or a character split across tokens
        stop = text[start : cut + 2]
        if text.find(stop) == start:
            return stop, k + 1
    raise AssertionError(f"no stop string spans two tokens in {text!r}")


def test_stop_string_spanning_two_tokens(client, hf_oracle):
    """The stop string's characters come from two consecutive tokens: the text ends right before it, the
    ids end with the token that completed it, and no streamed delta ever carried any part of it."""
    messages = user("Write a long sentence about the sea and the wind.")
    full = greedy(client, messages, max_tokens=24).choices[0]
    stop, n = spanning_stop(hf_oracle.processor.tokenizer, full.message.content, full.token_ids)
    expected = full.message.content[: full.message.content.find(stop)]
    resp = greedy(client, messages, max_tokens=24, stop=[stop])
    (c,) = resp.choices
    assert (c.message.content, c.finish_reason, c.token_ids) == (expected, "stop", full.token_ids[:n])
    deltas, finish = streamed_greedy(client, messages, max_tokens=24, stop=[stop])
    for text in itertools.accumulate(deltas):
        assert expected.startswith(text), f"{text!r} went past {expected!r}: part of {stop!r} leaked"
    assert ("".join(deltas), finish) == (expected, "stop")


def fresh_image(seed: int) -> bytes:
    """An image that only the calling test sends (its own size and seed): nothing of it is cached before."""
    return make_image(168, 112, 6100 + seed)


def before_image(resp, tokenizer) -> int:
    """How many prompt tokens precede the first image's placeholders (the chat template's system turn)."""
    return resp.prompt_token_ids.index(tokenizer.convert_tokens_to_ids("<|vision_start|>")) + 1


def test_cached_tokens_on_repeated_prompt(client, guarded_server, hf_oracle):
    messages = user(image_url_part(data_url(fresh_image(1))), "What do you see here?")
    hits_before = guarded_server.wait_idle()["vlmserve_prefix_cache_hits_total"]
    first = greedy(client, messages)
    second = greedy(client, messages)
    p = first.usage.prompt_tokens
    cached1 = first.usage.prompt_tokens_details.cached_tokens
    cached2 = second.usage.prompt_tokens_details.cached_tokens
    assert cached1 <= before_image(first, hf_oracle.processor.tokenizer)  # at most the template before it
    assert cached2 >= p - 16  # all full blocks but the last (16-token blocks)
    assert second.choices[0].token_ids == first.choices[0].token_ids
    m = guarded_server.wait_idle()
    assert m["vlmserve_prefix_cache_hits_total"] - hits_before >= cached1 + cached2


LONG_TAIL = "Describe it in detail, please: every colour, every shape and every line that you can see in it."
COUNTS = {
    "vlmserve_requests_total{status=ok}": 3,
    "vlmserve_time_to_first_token_seconds_count": 3,
    "vlmserve_time_per_output_token_seconds_count": 3,
    "vlmserve_e2e_request_latency_seconds_count": 3,
    "vlmserve_generation_tokens_total": 3 * MAX_NEW,
    # One image in three requests: decoded and encoded once. The second request (other text before the
    # image, so no prefix hit) found its embedding in the embedding cache's memory tier; the third (the
    # first again) found all of the image's KV in the prefix cache and needed no embedding at all.
    "vlmserve_preprocess_images_total": 1,
    "vlmserve_encoder_images_total": 1,
    "vlmserve_encoder_batches_total": 1,
    "vlmserve_encoder_batch_images_count": 1,
    "vlmserve_embedding_cache_hits_total{tier=memory}": 1,
}


def test_models_health_and_metrics(client, guarded_server, hf_oracle):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert guarded_server.http.get("/health").json() == {"status": "ok"}
    before = guarded_server.wait_idle()
    image = image_url_part(data_url(fresh_image(2)))
    resps = [greedy(client, user(*parts)) for parts in [(image, LONG_TAIL), ("Look: ", image, LONG_TAIL)]]
    resps.append(greedy(client, user(image, LONG_TAIL)))
    m = guarded_server.wait_idle()
    assert {name: m.get(name, 0) - before.get(name, 0) for name in COUNTS} == COUNTS
    grown = {name: m[name] - before[name] for name in m if name.endswith("_tokens_total")}
    assert grown["vlmserve_prompt_tokens_total"] == sum(r.usage.prompt_tokens for r in resps)
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in resps]
    assert grown["vlmserve_cached_prompt_tokens_total"] == sum(cached)
    assert cached[2] > before_image(resps[2], hf_oracle.processor.tokenizer) + max(
        resps[2].usage.visual_tokens
    )
    assert m["vlmserve_prefix_cache_hits_total"] - before["vlmserve_prefix_cache_hits_total"] >= sum(cached)
    assert 0 < m["vlmserve_prefix_cache_hit_rate"] < 1  # a miss and a hit at least, whatever ran before
    assert m["vlmserve_kv_cache_blocks_total"] == 256
    assert m["vlmserve_engine_alive"] == 1
    assert m["vlmserve_visual_budget_level"] == 0  # --visual-budget fixed
    assert "vlmserve_preprocess_copied_results_total" in m  # copies happen only when the encoder falls behind


def test_logprobs_through_the_openai_client(client, hf_oracle):
    """logprobs / top_logprobs as the openai client parses them: per generated token its text, bytes and
    log-probability (transformers' log-softmax at that step), the top alternatives; streamed the same."""
    messages, conv = CONVERSATIONS["one-image"]
    resp = greedy(client, messages, logprobs=True, top_logprobs=3)
    choice = resp.choices[0]
    content = choice.logprobs.content
    assert len(content) == len(choice.token_ids) == MAX_NEW
    scores = hf_oracle.model.generate(
        **hf_oracle.inputs(conv),
        max_new_tokens=MAX_NEW,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    ).logits
    tokenizer = hf_oracle.processor.tokenizer
    for tok, item, step in zip(choice.token_ids, content, scores):
        ref = step[0].float().log_softmax(-1)
        assert abs(item.logprob - ref[tok].item()) < 1e-4
        assert item.token == tokenizer.decode([tok]) and bytes(item.bytes) == item.token.encode()
        top_ids = ref.topk(3).indices.tolist()
        assert [t.token for t in item.top_logprobs] == [tokenizer.decode([t]) for t in top_ids]
        assert item.top_logprobs[0].token == item.token  # greedy
    stream = greedy(client, messages, stream=True, logprobs=True, top_logprobs=3)
    streamed = [item for chunk in stream for c in chunk.choices if c.logprobs for item in c.logprobs.content]
    assert [(i.token, i.logprob) for i in streamed] == [(i.token, i.logprob) for i in content]
    assert [[t.logprob for t in i.top_logprobs] for i in streamed] == [
        [t.logprob for t in i.top_logprobs] for i in content
    ]
    plain = greedy(client, messages)
    assert plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        greedy(client, messages, top_logprobs=2)
