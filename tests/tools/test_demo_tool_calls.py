"""The demo task set's tool requests (``demo_tools``) and the rows train-demo's tool phase makes of them: the
prompt is the server's own (its processor's tokens for the same messages and tools), the tools section parses
back to the tools offered, and every call reply parses as a Hermes block whose arguments validate against the
called function's schema (jsonschema) and say what the picture shows."""

from __future__ import annotations

import json
import random
import re
from typing import Literal

import jsonschema
import pytest
import torch
from pydantic import BaseModel

from lm_engine.processor import InputProcessor, normalize_messages
from tools import demo
from tools import demo_tasks as tasks
from tools import demo_tool_calls as demo_tools
from tools.demo_train import Encoder, make_batch

N = 300
CALL = re.compile(r"<tool_call>\n(.*)\n</tool_call>", re.S)
TOOLS_SECTION = re.compile(r"<tools>\n(.*)\n</tools>", re.S)


@pytest.fixture(scope="module")
def requests() -> list[tuple[tasks.Example, list[dict], list[tuple[str, str]]]]:
    out = []
    for i in range(N):
        ex = tasks.sample(5, i)
        tools, pairs = demo_tools.training_request(ex, random.Random(i))
        out.append((ex, tools, pairs))
    return out


def _shows(ex: tasks.Example) -> list:
    """Every value the picture's answers take, as text and as a number where it is one."""
    return [*ex.qa.values(), *(int(v) for v in ex.qa.values() if v.isdigit())]


def test_calls_parse_and_validate_against_the_called_function(requests):
    calls = texts = 0
    for ex, tools, pairs in requests:
        by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        for question, reply in pairs:
            if not reply.startswith("<tool_call>"):
                assert reply in ex.qa.values() and question in tasks.QUESTIONS.values(), (question, reply)
                texts += 1
                continue
            body = json.loads(CALL.fullmatch(reply).group(1))
            assert list(body) == ["name", "arguments"] and body["name"] in by_name
            jsonschema.validate(body["arguments"], by_name[body["name"]])
            assert all(v in _shows(ex) for v in body["arguments"].values()), (ex.qa, body)
            if set(body["arguments"].values()) & {ex.qa.get("color"), ex.qa.get("shape")}:
                assert ex.kind == "single"
            calls += 1
    # plain answers with tools offered are a minority, but there
    assert 0.05 < texts / (texts + calls) < 0.25, (texts, calls)


def test_requests_vary_names_layout_and_questions(requests):
    functions, properties, questions, offered = set(), set(), set(), set()
    orders = set()
    for _, tools, pairs in requests:
        offered.add(len(tools))
        for t in tools:
            functions.add(t["function"]["name"])
            props = list(t["function"]["parameters"]["properties"])
            properties.update(props)
            if len(props) == 2:
                orders.add(tuple(props))
        questions.update(q for q, _ in pairs)
    assert offered == {1, 2}
    assert len(functions) >= 15 and len(properties) >= 12
    assert len(orders) >= 6  # colour and shape properties both ways round, under several names
    assert set(tasks.QUESTIONS.values()) < questions and len(questions) >= 9


def test_unseen_names_never_occur_in_training():
    seen, unseen = demo_tools.TRAINING, demo_tools.UNSEEN
    for field in ("functions", "properties", "descriptions"):
        a, b = getattr(seen, field), getattr(unseen, field)
        assert not {w for ws in a.values() for w in ws if w} & {w for ws in b.values() for w in ws if w}
    assert not set(seen.free) & set(unseen.free)
    assert not set(seen.function_descriptions) - {""} & set(unseen.function_descriptions) - {""}


def test_readme_tool_is_what_the_client_sends_for_the_readme_model():
    class Shape(BaseModel):
        color: Literal["red", "green", "blue", "yellow", "orange", "purple", "black", "white"]
        shape: Literal["circle", "square", "triangle"]

    sent = {
        "type": "function",
        "function": {"name": "describe_shape", "parameters": Shape.model_json_schema()},
    }
    assert json.dumps(demo_tools.README_TOOL) == json.dumps(sent)


def test_training_rows_are_the_servers_prompts(requests):
    """The tool phase's row for a picture and a question: the server's processor's token ids for the same
    messages and tools (its template, its tools section), then the reply and the end of turn; the tools
    section in the prompt parses back to the tools offered."""
    path = demo.SHIPPED
    enc = Encoder(path)
    from lm_engine.models.registry import load_model_config
    from preprocess import PreprocessConfig

    processor = InputProcessor(path, load_model_config(path), PreprocessConfig.from_checkpoint(path))
    budget = enc.pre.max_pixels // 2
    for ex, tools, pairs in requests[:6]:
        system = demo_tools.system_text(tools)
        lines = TOOLS_SECTION.search(system).group(1).split("\n")
        assert [json.loads(line) for line in lines] == tools
        batch = make_batch(enc, [ex], [budget], asks=[(system, pairs)], targets=False)
        ids, block, labels = batch["input_ids"][0], batch["block"][0], batch["labels"][0]
        for k, (question, reply) in enumerate(pairs, start=1):
            messages = [
                {
                    "role": "user",
                    "content": [{"type": "image", "image": ex.data}, {"type": "text", "text": question}],
                }
            ]
            chat = normalize_messages(messages)
            chat.tools = tools
            want = processor.process_chat(chat, budget=lambda detail: budget).token_ids
            row = ids[(block == 0) | (block == k)].tolist()
            answer = enc.tok.encode(reply, add_special_tokens=False).ids + [enc.end]
            assert row == want + answer
            assert labels[block == k].tolist()[-len(answer) - 1 : -1] == answer


def test_eval_cases_ask_for_a_call_the_picture_answers():
    for names in (None, demo_tools.TRAINING, demo_tools.UNSEEN):
        cases = demo_tools.eval_cases(50_000, 30, names)
        for case in cases:
            fn = next(t for t in case.tools if t["function"]["name"] == case.name)["function"]
            jsonschema.validate(case.arguments, fn["parameters"])
            assert all(v in _shows(case.example) for v in case.arguments.values())
        assert {c.example.kind for c in cases} == ({"single"} if names is None else set(tasks.KINDS))


def test_value_weight_falls_on_the_values_the_picture_gives(requests):
    """``tool_value_weight``: in a tools row the weighted labels are the call's argument values, token for token
    (their text is the values, quotes left out), every other label (the frame, a plain answer, the end of turn)
    weighs 1; the weighted mean equals the plain mean where the weight is 1."""
    enc = Encoder(demo.SHIPPED)
    budget = enc.pre.max_pixels // 4
    for ex, tools, pairs in requests[:40]:
        system = demo_tools.system_text(tools)
        batch = make_batch(enc, [ex], [budget], asks=[(system, pairs)], targets=False, value_weight=4.0)
        plain = make_batch(enc, [ex], [budget], asks=[(system, pairs)], targets=False)
        assert "label_weight" not in plain and torch.equal(batch["labels"], plain["labels"])
        labels, weight, block = batch["labels"][0], batch["label_weight"][0], batch["block"][0]
        for k, (_, reply) in enumerate(pairs, start=1):
            mine = block == k
            heavy = labels[mine & (weight == 4.0)].tolist()
            assert set(weight[mine & (labels != -100)].tolist()) <= {1.0, 4.0}
            if not reply.startswith("<tool_call>"):
                assert heavy == []
                continue
            arguments = json.loads(CALL.fullmatch(reply).group(1))["arguments"]
            assert enc.tok.decode(heavy) == "".join(str(v) for v in arguments.values()), (reply, heavy)
