"""The output parser: a text streamed in any split assembles (as the openai client assembles deltas) to the
message the whole text gives, and that message holds what the text was built from."""

from __future__ import annotations

import json
import random

import pytest

from api.output_parser import OutputParser, message

CALL_A = {
    "name": "describe_shape",
    "arguments": {"color": "red", "note": 'a "}" in a string', "xs": [1, {"y": []}]},
}
CALL_B = {"name": "count_shapes", "arguments": {"n": 3}}


def block(call: dict, layout: str = "name-first") -> str:
    if layout == "arguments-first":
        call = {"arguments": call["arguments"], "name": call["name"]}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


CASES = [
    # (text, parser options, content, reasoning, calls)
    ("just an answer", {"tools": True}, "just an answer", None, []),
    ("a <tool but no call <tool_call", {"tools": True}, "a <tool but no call <tool_call", None, []),
    (block(CALL_A), {"tools": True}, None, None, [CALL_A]),
    (
        "Let me look.\n" + block(CALL_A) + "\n" + block(CALL_B),
        {"tools": True},
        "Let me look.",
        None,
        [CALL_A, CALL_B],
    ),
    (block(CALL_B, "arguments-first") + "\n\n", {"tools": True}, None, None, [CALL_B]),
    (
        "<tool_call>\n{not json}\n</tool_call>",
        {"tools": True},
        "<tool_call>\n{not json}\n</tool_call>",
        None,
        [],
    ),
    ("<think>first, the colour\n</think>\n\nred", {"reasoning": True}, "red", "first, the colour\n", []),
    (
        "the colour is red</think>\n" + block(CALL_B),
        {"tools": True, "thinking": True},
        None,
        "the colour is red",
        [CALL_B],
    ),
    ("no reasoning here", {"reasoning": True}, "no reasoning here", None, []),
    (block(CALL_A), {}, block(CALL_A), None, []),  # tools not offered: the text is the answer
]


def assemble(deltas: list[dict]) -> tuple[str | None, str | None, list[dict]]:
    content = reasoning = None
    calls: dict[int, dict] = {}
    for d in deltas:
        if "content" in d:
            content = (content or "") + d["content"]
        if "reasoning_content" in d:
            reasoning = (reasoning or "") + d["reasoning_content"]
        for c in d.get("tool_calls", []):
            entry = calls.setdefault(c["index"], {"name": "", "arguments": ""})
            assert ("id" in c) == (entry["name"] == "")  # id, type and name come once, first
            entry["name"] += c["function"].get("name", "")
            entry["arguments"] += c["function"]["arguments"]
    return content, reasoning, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("text, options, content, reasoning, calls", CASES)
def test_streamed_in_any_split_equals_the_whole(text, options, content, reasoning, calls):
    whole = message(OutputParser(**options), text)
    assert whole["content"] == content
    assert whole.get("reasoning_content") == reasoning
    got = [
        {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
        for c in whole.get("tool_calls", [])
    ]
    assert got == calls
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in whole.get("tool_calls", [])]
    rng = random.Random(0)
    for trial in range(30):
        parser, deltas, i = OutputParser(**options), [], 0
        while i < len(text):
            step = 1 if trial == 0 else rng.randint(1, 12)
            deltas += parser.feed(text[i : i + step])
            i += step
        deltas += parser.finish()
        streamed_content, streamed_reasoning, streamed_calls = assemble(deltas)
        assert streamed_content == (content if content else None) or (
            streamed_content is None and not content
        )
        assert streamed_reasoning == reasoning
        assert [(c["name"], c["arguments"]) for c in streamed_calls] == want


def test_a_call_cut_off_by_max_tokens_keeps_what_was_written():
    text = block(CALL_A)[:60]
    whole = message(OutputParser(tools=True), text)
    [call] = whole["tool_calls"]
    assert call["function"]["name"] == "describe_shape"
    assert text.endswith(call["function"]["arguments"])
