"""Structured output and tool calls through the real server and the `openai` client, on the demo model:
outputs checked by jsonschema (never by the grammar library that made them), streamed tool calls assembled
by the client equal to the non-streamed ones, free requests unaffected by constrained neighbours, and every
refusal a 400 naming the part of the request at fault."""

from __future__ import annotations

import base64
import io
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import jsonschema
import pytest
from PIL import Image, ImageDraw
from pydantic import BaseModel
from tokenizers import Tokenizer

from tests.api.conftest import start_server
from tests.structured_schemas import COLORS, SCHEMAS, SHAPES
from tests.support import is_idle
from tools import demo

# The README's picture: a red circle on grey, 96 × 96.
RED_CIRCLE = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAGAAAABgAQMAAADYVuV7AAAABlBMVEWAgIDXIyNzYI4YAAAAtklEQVR42u3SMU7EQAy"
    "F4S/OSlBQUNIRbhJuyJHmKBwhJUirDMV4UNiNNh3VuvDMk/+xn0bmHkfxegYjWGIovfBQ6wIBLzz9iinPgJmhPxlqrbVkpaMCJ3hO8ShTbI1EEk4p"
    "JptOM23QnzcjmuGhXHfbivQ4u42lng6w/xJru30eYLXdyi1s1H/xfQcrtDbRxrXRgQXOe0a/ZIokLCnWNJ1bNfPWG5R0G4msdvftm4+rHb3HRfwAU"
    "VcnBbQDSI8AAAAASUVORK5CYII="
)
MODEL = "tiny"  # the name conftest's server serves under


def _green_triangle() -> str:
    """The README's Python example's picture: a green triangle on blue-grey, 320 × 240, drawn as it draws it."""
    picture = Image.new("RGB", (320, 240), (150, 165, 180))
    ImageDraw.Draw(picture).polygon([(160, 40), (250, 200), (70, 200)], fill=(40, 160, 60))
    buf = io.BytesIO()
    picture.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


GREEN_TRIANGLE = _green_triangle()


def ask(question: str, url: str = RED_CIRCLE) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": question},
            ],
        }
    ]


def _object(properties: dict) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


DESCRIBE = _object({"color": {"type": "string", "enum": COLORS}, "shape": {"type": "string", "enum": SHAPES}})
COUNT = _object({"n": {"type": "integer", "minimum": 1, "maximum": 6}})
TOOLS = [
    {
        "type": "function",
        "function": {"name": "describe_shape", "description": "Record the shape.", "parameters": DESCRIBE},
    },
    {"type": "function", "function": {"name": "count_shapes", "parameters": COUNT}},
]
PARAMS = {"describe_shape": DESCRIBE, "count_shapes": COUNT}


@pytest.fixture(scope="module")
def server(tmp_path_factory, image_server, canary):
    s = start_server(
        tmp_path_factory.mktemp("structured"),
        demo.SHIPPED,
        image_server,
        canary,
        *("--dtype", "float32", "--max-model-len", "2048"),  # the tools' system message is ~600 tokens
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=120)


def _json_schema(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def _stream_text(stream) -> tuple[str, str | None]:
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


# ---------------------------------------------------------------- response_format


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_every_schema_gets_a_valid_object(client, server, stream):
    def one(item):
        name, schema = item
        kw = dict(model=MODEL, messages=ask("Describe the image."), temperature=0, max_tokens=160)
        if stream:
            return _stream_text(
                client.chat.completions.create(**kw, response_format=_json_schema(name, schema), stream=True)
            )
        resp = client.chat.completions.create(**kw, response_format=_json_schema(name, schema))
        return resp.choices[0].message.content, resp.choices[0].finish_reason

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, SCHEMAS.items()))
    assert len(SCHEMAS) >= 20
    for (name, schema), (text, finish) in zip(SCHEMAS.items(), results):
        assert finish == "stop", (name, text)
        jsonschema.validate(json.loads(text), schema)
    assert is_idle(server.wait_idle())


class Shape(BaseModel):
    color: Literal["red", "green", "blue", "yellow", "orange", "purple", "black", "white"]
    shape: Literal["circle", "square", "triangle"]


def test_the_demo_model_fills_a_pydantic_model_from_the_picture(client):
    """The README's example: the client's parse() with a pydantic model; the demo model sees a red circle."""
    resp = client.beta.chat.completions.parse(
        model=MODEL, messages=ask("What color is the shape?"), response_format=Shape, temperature=0
    )
    assert resp.choices[0].message.parsed == Shape(color="red", shape="circle")
    assert resp.choices[0].finish_reason == "stop"


def test_max_tokens_and_stop_strings_end_structured_output_as_openai_says(client):
    kw = dict(model=MODEL, messages=ask("What color is the shape?"), temperature=0)
    fmt = _json_schema("shape", SCHEMAS["enum-color-shape"])
    cut = client.chat.completions.create(**kw, response_format=fmt, max_tokens=4)
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 4
    stopped = client.chat.completions.create(**kw, response_format=fmt, stop=[", "])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == '{"color": "red"'
    obj = client.chat.completions.create(**kw, response_format={"type": "json_object"}, max_tokens=6)
    assert obj.choices[0].message.content.startswith("{")


def test_vllm_structured_outputs_fields(client):
    kw = dict(model=MODEL, messages=ask("What shape is this?"), temperature=0, max_tokens=40)
    choice = client.chat.completions.create(**kw, extra_body={"structured_outputs": {"choice": SHAPES}})
    assert choice.choices[0].message.content in SHAPES
    regex = client.chat.completions.create(**kw, extra_body={"guided_regex": "[A-Z][0-9]{3}"})
    assert len(regex.choices[0].message.content) == 4 and regex.choices[0].message.content[1:].isdigit()
    schema = client.chat.completions.create(**kw, extra_body={"guided_json": SCHEMAS["integer-range"]})
    jsonschema.validate(json.loads(schema.choices[0].message.content), SCHEMAS["integer-range"])


def test_free_requests_get_the_tokens_they_get_alone(client, server):
    free = [
        dict(messages=ask("Describe the image."), temperature=0),
        dict(messages=[{"role": "user", "content": "What shape is this?"}], temperature=1.0, seed=11),
    ]

    def run(kw: dict) -> list[int]:
        body = {"model": MODEL, "max_tokens": 12, "ignore_eos": True, "return_token_ids": True, **kw}
        resp = server.post_chat(body)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["token_ids"]

    alone = [run(kw) for kw in free]
    constrained = [
        dict(messages=ask("Describe the image."), temperature=0, response_format=_json_schema(n, SCHEMAS[n]))
        for n in ("nested-object", "array-of-objects", "mixed-record")
    ]
    with ThreadPoolExecutor(5) as pool:
        mixed = list(pool.map(run, constrained + free))
    assert mixed[-2:] == alone


# ---------------------------------------------------------------- tools


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def _streamed_calls(stream) -> tuple[list[tuple[str, str]], str | None, str]:
    """The calls as the openai client's deltas assemble them (by index: name once, argument fragments)."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"name": "", "arguments": "", "ids": 0})
                if d.id:
                    call["ids"] += 1
                    assert d.type == "function" and d.function.name
                call["name"] += (d.function.name or "") if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
    assert all(c["ids"] == 1 for c in calls.values()), calls  # id, type and name once per call
    return [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], finish, content


@pytest.mark.parametrize(
    "options, names",
    [
        ({"tool_choice": "required"}, None),
        ({"tool_choice": "required", "parallel_tool_calls": False}, None),
        ({"tool_choice": {"type": "function", "function": {"name": "count_shapes"}}}, ["count_shapes"]),
    ],
    ids=["required", "required-single", "named"],
)
def test_enforced_tool_calls_streamed_equal_whole(client, options, names):
    kw = dict(
        model=MODEL,
        messages=ask("What color is the shape?"),
        tools=TOOLS,
        temperature=0,
        max_tokens=120,
        **options,
    )
    whole = client.chat.completions.create(**kw).choices[0]
    calls = _calls(whole.message)
    assert calls and whole.finish_reason == "tool_calls" and whole.message.content is None
    if names is not None or options.get("parallel_tool_calls") is False:
        assert len(calls) == 1
    if names is not None:
        assert [n for n, _ in calls] == names
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), PARAMS[name])
    streamed, finish, content = _streamed_calls(client.chat.completions.create(**kw, stream=True))
    assert streamed == calls and finish == "tool_calls" and content == ""


# Two calls written as the text of the answer (a regex makes the demo model write them): what `auto` parses.
TWO_CALLS = (
    r'Checking\.\n<tool_call>\n\{"name": "describe_shape", "arguments": \{"color": "(red|blue)", "shape": "circle"\}\}'
    r'\n</tool_call>\n<tool_call>\n\{"arguments": \{"n": [1-6]\}, "name": "count_shapes"\}\n</tool_call>'
)


def test_auto_parses_the_calls_the_model_writes(client):
    kw = dict(
        model=MODEL, messages=ask("What color is the shape?"), tools=TOOLS, tool_choice="auto", temperature=0
    )
    kw.update(max_tokens=240, extra_body={"guided_regex": TWO_CALLS})
    whole = client.chat.completions.create(**kw).choices[0]
    calls = _calls(whole.message)
    assert [n for n, _ in calls] == ["describe_shape", "count_shapes"]
    assert json.loads(calls[0][1])["shape"] == "circle" and 1 <= json.loads(calls[1][1])["n"] <= 6
    assert whole.message.content == "Checking." and whole.finish_reason == "tool_calls"
    streamed, finish, content = _streamed_calls(client.chat.completions.create(**kw, stream=True))
    assert streamed == calls and finish == "tool_calls" and content == "Checking."


def test_tool_turns_reach_the_prompt_in_hermes_format(server):
    """A conversation with an assistant's call and the tool's result; the prompt, decoded by the tokenizer
    itself, carries the tools, the call and the result as Qwen's format writes them."""
    messages = ask("What color is the shape?") + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "describe_shape",
                        "arguments": '{"color": "red", "shape": "circle"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"ok": true}'},
        {"role": "user", "content": "Thanks."},
    ]
    tok = Tokenizer.from_file(str(demo.SHIPPED / "tokenizer.json"))

    def prompt(**kw) -> str:
        resp = server.post_chat(
            {"model": MODEL, "messages": messages, "max_tokens": 2, "return_token_ids": True, **kw}
        )
        assert resp.status_code == 200, resp.text
        return tok.decode(resp.json()["prompt_token_ids"], skip_special_tokens=False)

    text = prompt(tools=TOOLS)
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n" + json.dumps(TOOLS[1]) + "\n</tools>" in text
    call = '<tool_call>\n{"name": "describe_shape", "arguments": {"color": "red", "shape": "circle"}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in text
    assert '<|im_start|>user\n<tool_response>\n{"ok": true}\n</tool_response><|im_end|>' in text
    assert "<tools>" not in prompt(tools=TOOLS, tool_choice="none")


# The README's tool: its pydantic model's schema, as the openai client sends it.
SHAPE_TOOL = [
    {"type": "function", "function": {"name": "describe_shape", "parameters": Shape.model_json_schema()}}
]
README_PICTURES = [
    (RED_CIRCLE, {"color": "red", "shape": "circle"}),
    (GREEN_TRIANGLE, {"color": "green", "shape": "triangle"}),
]


@pytest.mark.parametrize(
    "question", ["Describe the image.", "What color is the shape?"], ids=["describe", "color"]
)
@pytest.mark.parametrize("picture, want", README_PICTURES, ids=["red-circle", "green-triangle"])
def test_the_demo_model_calls_the_readme_tool_with_what_the_picture_shows(client, picture, want, question):
    """The README's tool example: ``tool_choice: "required"`` with the ``describe_shape`` tool; the grammar
    makes the call well formed, the arguments (the model's choice) say what the picture shows."""
    resp = client.chat.completions.create(
        model=MODEL, messages=ask(question, picture), tools=SHAPE_TOOL, tool_choice="required", temperature=0
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, Shape.model_json_schema())
    assert (call.function.name, arguments) == ("describe_shape", want)


@pytest.mark.parametrize("picture, want", README_PICTURES, ids=["red-circle", "green-triangle"])
def test_auto_answers_in_text_or_with_a_valid_call(client, picture, want):
    """``tool_choice: "auto"``: the model chooses; what it writes is either a text answer (no call block left in
    it) or calls that parse, name an offered tool and validate against its parameters."""
    for tools, question in ((SHAPE_TOOL, "Describe the image."), (TOOLS, "What color is the shape?")):
        params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        kw = dict(
            model=MODEL, messages=ask(question, picture), tools=tools, tool_choice="auto", temperature=0
        )
        choice = client.chat.completions.create(**kw, max_tokens=120).choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            for call in choice.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
        else:
            assert choice.finish_reason == "stop"
            assert choice.message.content and "<tool_call>" not in choice.message.content


# ---------------------------------------------------------------- refusals


def _post(server, body: dict) -> httpx.Response:
    return server.post_chat({"model": MODEL, "messages": ask("What shape is this?"), "max_tokens": 4, **body})


BAD_TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "not": {"required": ["a"]}}},
}


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "schema",
        ),
        (
            {"response_format": _json_schema("x", {"type": "array", "uniqueItems": True})},
            "response_format.json_schema.schema",
            "uniqueItems",
        ),
        (
            {"response_format": _json_schema("x", {"type": "string", "pattern": "^(?=a)b$"})},
            "response_format.json_schema.schema",
            "look",
        ),
        (
            {"response_format": _json_schema("x", {"$ref": "#/$defs/missing"})},
            "response_format.json_schema.schema",
            "missing",
        ),
        (
            {"response_format": _json_schema("x", {"type": "strin"})},
            "response_format.json_schema.schema",
            "strin",
        ),
        (
            {"response_format": _json_schema("bad name!", {"type": "object"})},
            "response_format.json_schema.name",
            "name",
        ),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "function"),
        (
            {"tools": [{"type": "function", "function": {"name": "has space"}}]},
            "tools[0].function.name",
            "names",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name", "describe_shape"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
            "tools[0].function.parameters",
            "schema",
        ),
        ({"tools": [BAD_TOOL], "tool_choice": "required"}, "tools[0].function.parameters", "not"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        ({"tool_choice": "required"}, "tool_choice", "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "required"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "only one",
        ),
        ({"guided_regex": "[a-"}, "guided_regex", "regex"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "choice"),
        (
            {"structured_outputs": {"grammar": "start: nothing_defined"}},
            "structured_outputs.grammar",
            "nothing_defined",
        ),
    ],
)
def test_bad_schemas_and_tools_are_400_naming_the_part(server, body, param, words):
    for stream in (False, True):
        resp = _post(server, {**body, "stream": stream})
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", err
        assert words.lower() in err["message"].lower(), err
    assert is_idle(server.wait_idle())
