"""`vlmserve batch`: OpenAI batch lines in, records out in input order, bad lines as error records, greedy
text equal to the offline LLM.chat, and the cache-aware order seen in what the caches did.

The batch asks 3 questions about each of 3 pages, interleaved (page 0 q0, page 1 q0, page 2 q0, page 0 q1, …),
so only an order that runs a page's questions after its first one has prefilled gets prefix-cache hits.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from api.batch import BatchOptions, run_batch
from api.media import MediaConfig
from lm_engine import LLM, EngineConfig, LLMEngine, SamplingParams
from tests.support import REPO, data_url, image_part, make_image

MAX_NEW = 8
BLOCK = 16
PAGES = [make_image(224, 224, 31), make_image(280, 196, 32, "JPEG"), make_image(196, 252, 33)]
MIMES = ["image/png", "image/jpeg", "image/png"]
QUESTIONS = ["What is the title?", "Summarise the table.", "Who wrote this page?"]
CORRUPT = PAGES[0][:300]  # a valid PNG header, truncated data: fails when decoded


def line(custom_id: str, messages: list[dict], **body) -> str:
    body = {"messages": messages, "max_tokens": MAX_NEW, "temperature": 0.0, "return_token_ids": True, **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


def ask_page(url: str, question: str) -> list[dict]:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]
    return [{"role": "user", "content": content}]


def batch_lines() -> tuple[list[str], dict[str, list[dict]]]:
    """The input lines, and the offline conversation of every line that should succeed, by custom_id."""
    lines, convs = [], {}
    for q, question in enumerate(QUESTIONS):
        for p, (page, mime) in enumerate(zip(PAGES, MIMES)):
            cid = f"page{p}-q{q}"
            lines.append(line(cid, ask_page(data_url(page, mime), question)))
            convs[cid] = [{"role": "user", "content": [image_part(page), {"type": "text", "text": question}]}]
        if q == 0:
            lines.append('{"custom_id": "broken", "url": ')  # invalid JSON
        if q == 1:
            text = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello!"}]
            lines.append(line("text-only", text))
            convs["text-only"] = text
            lines.append(line("corrupt", ask_page(data_url(CORRUPT), "What is this?")))
    return lines, convs


def custom_ids(lines: list[str]) -> list[str | None]:
    out = []
    for raw in lines:
        try:
            out.append(json.loads(raw)["custom_id"])
        except ValueError:
            out.append(None)
    return out


def read_records(path: Path) -> list[dict]:
    return [json.loads(raw) for raw in path.read_text().splitlines()]


def make_engine(ckpt: Path, **kw) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=str(ckpt), num_kv_blocks=256, block_size=BLOCK, preprocess_workers=0, **kw)
    )


@pytest.fixture(scope="module")
def batch_input(tmp_path_factory) -> tuple[Path, list[str], dict[str, list[dict]]]:
    lines, convs = batch_lines()
    path = tmp_path_factory.mktemp("batch") / "input.jsonl"
    path.write_text("\n".join(lines) + "\n\n")  # a trailing blank line is no line of the batch
    return path, lines, convs


@pytest.fixture(scope="module")
def oracle(tiny_ckpt, batch_input) -> dict[str, list[int]]:
    """Greedy token ids of every good line from the offline LLM.chat, caches off, one request at a time."""
    _, _, convs = batch_input
    with LLM(str(tiny_ckpt), num_kv_blocks=256, enable_prefix_caching=False, embedding_cache_bytes=0) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
        return {cid: llm.chat(conv, params)[0].token_ids for cid, conv in convs.items()}


def check_records(records: list[dict], lines: list[str], oracle: dict[str, list[int]]) -> dict[str, dict]:
    """Input order, error records for the bad lines, oracle text for the good ones; bodies by custom_id."""
    assert [r["custom_id"] for r in records] == custom_ids(lines)
    assert len({r["id"] for r in records}) == len(records)
    broken = records[custom_ids(lines).index(None)]
    assert broken["response"] is None and broken["error"]["code"] == "invalid_json_line"
    corrupt = next(r for r in records if r["custom_id"] == "corrupt")
    assert corrupt["error"] is not None and corrupt["error"]["message"]
    assert corrupt["response"]["status_code"] == 400
    assert corrupt["response"]["body"]["error"]["param"] == "image_url"
    bodies = {}
    for r in records:
        if r["custom_id"] in oracle:
            assert r["error"] is None and r["response"]["status_code"] == 200, r
            body = r["response"]["body"]
            assert body["object"] == "chat.completion" and body["id"] == r["response"]["request_id"]
            choice = body["choices"][0]
            assert choice["token_ids"] == oracle[r["custom_id"]], r["custom_id"]
            bodies[r["custom_id"]] = body
    assert set(bodies) == set(oracle)
    return bodies


def image_end(body: dict, image_token_id: int) -> int:
    ids = body["prompt_token_ids"]
    return len(ids) - ids[::-1].index(image_token_id)


def test_batch_in_input_order_matches_offline_and_reuses_pages(tiny_ckpt, batch_input, oracle, tmp_path):
    path, lines, _ = batch_input
    engine = make_engine(tiny_ckpt)
    try:
        summary = run_batch(
            engine, path, tmp_path / "out.jsonl", BatchOptions(progress=False, served_model_names=["demo"])
        )
        engine.check_integrity()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        engine.close()
    bodies = check_records(read_records(tmp_path / "out.jsonl"), lines, oracle)
    assert (summary.lines, summary.ok, summary.failed) == (len(lines), len(oracle), 2)
    assert summary.images_encoded == len(PAGES)
    # The cache-aware order: each page's first question prefilled the page; the two others, submitted only
    # after it, found the whole image span in the prefix cache. Submitted all at once, none would.
    pad = json.loads((tiny_ckpt / "config.json").read_text())["image_token_id"]
    for p in range(len(PAGES)):
        first, *rest = (bodies[f"page{p}-q{q}"] for q in range(len(QUESTIONS)))
        end = image_end(first, pad)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < end
        for body in rest:
            assert image_end(body, pad) == end
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= end // BLOCK * BLOCK
    assert summary.prefix_hit_tokens >= 2 * len(PAGES) * (end // BLOCK * BLOCK)


def test_batch_without_prefix_cache_hits_embedding_cache_within_bounds(
    tiny_ckpt, batch_input, oracle, tmp_path
):
    """Prefix caching off, at most 2 lines in flight: a page's questions go back to back, so each page is encoded
    once (its later questions hit the embedding cache or share the encoding in flight); the bound holds."""
    path, lines, _ = batch_input
    engine = make_engine(tiny_ckpt, enable_prefix_caching=False)
    peak = 0
    add_request = engine.add_request

    def counting_add(*args, **kw):
        nonlocal peak
        peak = max(peak, len(engine.requests) + 1)
        return add_request(*args, **kw)

    engine.add_request = counting_add
    try:
        options = BatchOptions(progress=False, max_in_flight=2)
        summary = run_batch(engine, path, tmp_path / "out.jsonl", options)
    finally:
        engine.close()
    check_records(read_records(tmp_path / "out.jsonl"), lines, oracle)
    assert peak <= 2
    assert summary.prefix_hit_tokens == 0
    assert summary.images_encoded == len(PAGES)
    assert summary.embedding_hits >= len(PAGES) * (len(QUESTIONS) - 2)  # the last of each page at least


def test_bad_lines_each_get_an_error_record(tiny_ckpt, tmp_path):
    media = tmp_path / "media"
    media.mkdir()
    (media / "page.png").write_bytes(PAGES[0])
    (tmp_path / "outside.png").write_bytes(PAGES[0])
    text = [{"role": "user", "content": "Hi"}]
    env = {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": text}}
    cases = [
        ("ok", line("ok", text), None),
        ("url", json.dumps({**env, "custom_id": "url", "url": "/v1/embeddings"}), "invalid_url"),
        ("method", json.dumps({**env, "custom_id": "method", "method": "GET"}), "invalid_method"),
        (None, json.dumps({k: v for k, v in env.items() if k != "custom_id"}), "missing_custom_id"),
        (None, "[1, 2]", "invalid_json_line"),
        ("body", line("body", text, temperature="hot"), 400),
        ("no-messages", line("no-messages", []), 400),
        ("model", line("model", text, model="gpt-4o"), 404),
        ("n", line("n", text, n=1000), 400),
        ("file-ok", line("file-ok", ask_page((media / "page.png").as_uri(), "What?")), None),
        ("file-outside", line("file-outside", ask_page((tmp_path / "outside.png").as_uri(), "What?")), (400, "media_url_forbidden")),
        ("loopback", line("loopback", ask_page("http://127.0.0.1:9/page.png", "What?")), (400, "media_url_forbidden")),
        ("scheme", line("scheme", ask_page("ftp://example.com/a.png", "What?")), 400),
        ("too-many", line("too-many", [{"role": "user", "content": ask_page(data_url(PAGES[0]), "a")[0]["content"] * 2}]), 400),
        ("bad-base64", line("bad-base64", ask_page("data:image/png;base64,!!!", "What?")), 400),
    ]  # fmt: skip
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(raw for _, raw, _ in cases) + "\n")
    engine = make_engine(tiny_ckpt)
    try:
        options = BatchOptions(
            progress=False,
            served_model_names=["tiny"],
            limit_mm_per_prompt={"image": 1},
            media=MediaConfig(allowed_local_path=media),
        )
        summary = run_batch(engine, path, tmp_path / "out.jsonl", options)
    finally:
        engine.close()
    records = read_records(tmp_path / "out.jsonl")
    assert [r["custom_id"] for r in records] == [cid for cid, _, _ in cases]
    for (_, _, expect), rec in zip(cases, records):
        if expect is None:
            assert rec["error"] is None and rec["response"]["status_code"] == 200, rec
        elif isinstance(expect, str):
            assert rec["response"] is None and rec["error"]["code"] == expect, rec
        else:
            status, code = expect if isinstance(expect, tuple) else (expect, rec["error"]["code"])
            assert rec["response"]["status_code"] == status and rec["error"]["code"] == code, rec
            assert rec["response"]["body"]["error"]["message"] == rec["error"]["message"]
    assert (summary.ok, summary.failed) == (2, len(cases) - 2)


def test_cli_end_to_end(tiny_ckpt, batch_input, oracle, tmp_path):
    path, lines, _ = batch_input
    out = tmp_path / "results" / "out.jsonl"
    proc = subprocess.run(
        [
            sys.executable, "-m", "api.cli", "batch", str(path), str(out),
            "--model", str(tiny_ckpt), "--num-kv-blocks", "256", "--preprocess-workers", "1",
            "--summary-json", str(tmp_path / "summary.json"),
        ],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_records(read_records(out), lines, oracle)
    assert f"lines: {len(lines)} ({len(oracle)} ok, 2 failed)" in proc.stdout
    assert "prefix cache:" in proc.stdout and "embedding cache:" in proc.stdout
    assert f"{len(lines)}/{len(lines)}" in proc.stderr  # the progress bar
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["images_encoded"] == len(PAGES) and summary["prefix_hit_rate"] > 0
    assert [p.name for p in out.parent.iterdir()] == ["out.jsonl"]  # no spill or temporary file left


def test_tools_in_batch_lines_give_parsed_calls(tmp_path):
    """Lines with tools: the calls come back as the server gives them (OpenAI's chat.completion, read by the
    ``openai`` client's own types), enforced calls valid for their function's parameters (jsonschema), and the
    calls a model writes under ``auto`` parsed out of its text."""
    import jsonschema
    from openai.types.chat import ChatCompletion

    from tests.api.test_structured_output import PARAMS, TOOLS, TWO_CALLS, ask
    from tools import demo

    question = ask("What color is the shape?")
    named = {"type": "function", "function": {"name": "count_shapes"}}
    cases = {
        "required": dict(tools=TOOLS, tool_choice="required", max_tokens=120),
        "named": dict(tools=TOOLS, tool_choice=named, max_tokens=120),
        "auto-written": dict(tools=TOOLS, tool_choice="auto", max_tokens=240, guided_regex=TWO_CALLS),
        "none": dict(tools=TOOLS, tool_choice="none", max_tokens=6),
        "plain": dict(max_tokens=6),
    }
    path = tmp_path / "in.jsonl"
    path.write_text("".join(line(cid, question, **body) + "\n" for cid, body in cases.items()))
    engine = LLMEngine(
        EngineConfig(
            model=str(demo.SHIPPED),
            dtype="float32",
            max_model_len=2048,
            num_kv_blocks=512,
            preprocess_workers=0,
        )
    )
    try:
        summary = run_batch(
            engine, path, tmp_path / "out.jsonl", BatchOptions(progress=False, served_model_names=["demo"])
        )
    finally:
        engine.close()
    assert (summary.ok, summary.failed) == (len(cases), 0)
    records = {r["custom_id"]: r for r in read_records(tmp_path / "out.jsonl")}
    done = {
        cid: ChatCompletion.model_validate(r["response"]["body"]).choices[0] for cid, r in records.items()
    }
    for cid in ("required", "named"):
        choice = done[cid]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, cid
        calls = choice.message.tool_calls
        assert calls and all(c.type == "function" and c.id for c in calls)
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    assert [c.function.name for c in done["named"].message.tool_calls] == ["count_shapes"]
    written = done["auto-written"]
    assert [c.function.name for c in written.message.tool_calls] == ["describe_shape", "count_shapes"]
    assert written.message.content == "Checking." and written.finish_reason == "tool_calls"
    for cid in ("none", "plain"):  # no tools in the prompt or the answer: plain text
        assert done[cid].message.tool_calls is None and done[cid].message.content, cid
    # tools reach the prompt only where they are offered: "none" leaves them out, as the server does
    ids = {cid: records[cid]["response"]["body"]["prompt_token_ids"] for cid in cases}
    assert ids["none"] == ids["plain"] and len(ids["required"]) > len(ids["plain"])
