"""Constrained decoding in the engine: outputs match their grammar (checked by jsonschema and re, not by the
grammar library), free rows in a mixed batch get exactly what they get alone, and padded vocabulary ids stay
masked."""

from __future__ import annotations

import base64
import json
import re

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer

from lm_engine import LLM, SamplingParams
from lm_engine.processor import InputError
from lm_engine.structured import (
    GrammarMasks,
    Grammars,
    GrammarState,
    choice_grammar,
    json_schema_grammar,
    regex_grammar,
    tool_call_grammar,
)
from tests.structured_schemas import COLORS, SCHEMAS, SHAPES
from tests.support import image_part, make_image, user
from tools import demo

CONV = user(image_part(make_image(128, 96, 5)), "Describe the image.")
# The README's picture: a red circle on grey.
README_IMAGE = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAGAAAABgAQMAAADYVuV7AAAABlBMVEWAgIDXIyNzYI4YAAAAtklEQVR42u3SMU7EQAyF4S/OSlBQUNIRbhJuyJHmKBwhJUirDMV4UNiNNh3VuvDMk/"
    "+xn0bmHkfxegYjWGIovfBQ6wIBLzz9iinPgJmhPxlqrbVkpaMCJ3hO8ShTbI1EEk4pJptOM23QnzcjmuGhXHfbivQ4u42lng6w/xJru30eYLXdyi1s1H/"
    "xfQcrtDbRxrXRgQXOe0a/ZIokLCnWNJ1bNfPWG5R0G4msdvftm4+rHb3HRfwAUVcnBbQDSI8AAAAASUVORK5CYII="
)


@pytest.fixture(scope="module")
def llm():
    with LLM(str(demo.SHIPPED), dtype="float32", num_kv_blocks=512) as engine:
        yield engine


def test_every_schema_is_honoured_in_one_batch(llm):
    params = [
        SamplingParams(temperature=0.0, max_tokens=160, grammar=json_schema_grammar(s))
        for s in SCHEMAS.values()
    ]
    outs = llm.chat([CONV] * len(SCHEMAS), params)
    for (name, schema), out in zip(SCHEMAS.items(), outs):
        assert out.finish_reason == "stop", (name, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    assert (
        not llm.engine.requests
        and llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    )


def test_sampled_choices_follow_the_grammar(llm):
    """n > 1 at temperature 1: each choice forks the matcher and keeps to the grammar on its own path."""
    schema = SCHEMAS["array-of-objects"]
    out = llm.chat(
        CONV,
        SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=160, grammar=json_schema_grammar(schema)),
    )[0]
    for choice in out.outputs:
        jsonschema.validate(json.loads(choice.text), schema)
    [regex] = llm.chat(
        CONV, SamplingParams(temperature=1.0, seed=1, max_tokens=40, grammar=regex_grammar(r"[A-Z]{2}-\d{3}"))
    )
    assert re.fullmatch(r"[A-Z]{2}-\d{3}", regex.text)
    [pick] = llm.chat(
        CONV,
        SamplingParams(temperature=1.0, seed=2, max_tokens=40, grammar=choice_grammar(["yes", "no way"])),
    )
    assert pick.text in ("yes", "no way")


def test_free_rows_are_untouched_by_constrained_neighbours(llm):
    """Free requests in a batch with constrained ones get the very tokens they get alone (and the same
    log-probabilities, to rounding)."""
    convs = [
        CONV,
        user("What shape is this?"),
        CONV,
        user(image_part(make_image(96, 96, 9)), "Describe the image."),
    ]
    free = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True, logprobs=2),
    ]
    alone = [llm.chat(convs[i], free[i])[0] for i in range(2)]
    constrained = [
        SamplingParams(temperature=0.0, max_tokens=60, grammar=json_schema_grammar(SCHEMAS["nested-object"]))
    ] * 2
    mixed = llm.chat(convs, free + constrained)
    for a, m in zip(alone, mixed[:2]):
        assert m.token_ids == a.token_ids
        # NOTE: a batch's matmuls round differently from a lone row's (~1e-7): the masks are not applied to
        # free rows at all (test_padded_vocabulary_ids_stay_masked checks that bit for bit).
        got, want = ([e.logprob for e in o.outputs[0].logprobs] for o in (m, a))
        assert max(abs(x - y) for x, y in zip(got, want)) < 1e-5
    for out in mixed[2:]:
        jsonschema.validate(json.loads(out.text), SCHEMAS["nested-object"])


def test_max_tokens_cuts_structured_output_with_length(llm):
    [out] = llm.chat(
        CONV,
        SamplingParams(temperature=0.0, max_tokens=3, grammar=json_schema_grammar(SCHEMAS["nested-object"])),
    )
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_tool_call_grammar_names_the_function_and_follows_its_parameters(llm):
    params = {
        "type": "object",
        "properties": {"color": {"enum": COLORS}, "shape": {"enum": SHAPES}},
        "required": ["color", "shape"],
        "additionalProperties": False,
    }
    count = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 6}},
        "required": ["n"],
        "additionalProperties": False,
    }
    grammar = tool_call_grammar([("describe_shape", params), ("count", count)], parallel=False)
    [out] = llm.chat(CONV, SamplingParams(temperature=0.0, max_tokens=80, grammar=grammar))
    m = re.fullmatch(r"<tool_call>\n(.*)\n</tool_call>", out.text, re.S)
    assert m, out.text
    call = json.loads(m.group(1))
    assert list(call) == ["name", "arguments"] and call["name"] in ("describe_shape", "count")
    jsonschema.validate(call["arguments"], params if call["name"] == "describe_shape" else count)


def test_a_grammar_the_library_refuses_is_an_input_error(llm):
    before = llm.engine.block_manager.num_free_blocks
    with pytest.raises(InputError, match="uniqueItems"):
        llm.engine.add_request(
            "bad", CONV, SamplingParams(grammar=json_schema_grammar({"type": "array", "uniqueItems": True}))
        )
    assert "bad" not in llm.engine.requests and llm.engine.block_manager.num_free_blocks == before


def test_padded_vocabulary_ids_stay_masked():
    """Logits wider than the tokenizer (released checkpoints pad vocab_size): the extra ids are never allowed,
    however large their logits; a free row keeps every value bit for bit."""
    tok = Tokenizer.from_file(str(demo.SHIPPED / "tokenizer.json"))
    width = tok.get_vocab_size(with_added_tokens=True) + 77
    grammars = Grammars(tok, width, [tok.token_to_id("<|im_end|>")])
    state = GrammarState(grammars.compile(choice_grammar(["red", "blue"])).matcher())
    job = GrammarMasks(grammars.width).start([state])
    logits = torch.randn(2, width)
    logits[:, -77:] = 1e4
    free = logits[1].clone()
    assert job.apply(logits, [state, None]) == []
    assert torch.isinf(logits[0, -77:]).all()
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert allowed and all(
        tok.decode([t]) in ("r", "b", "red", "blue", "re", "bl", "blu")
        or "red".startswith(tok.decode([t]))
        or "blue".startswith(tok.decode([t]))
        for t in allowed
    )
    assert torch.equal(logits[1], free)


def test_the_grammar_applies_after_the_reasoning_marker(llm):
    """``grammar_after``: free text until the output holds the marker, the grammar from the next token on (a
    reasoning model's "</think>"; here the demo model's own first word stands in for it)."""
    conv = user(image_part(README_IMAGE), "What color is the shape?")
    [free] = llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=8))
    assert free.text == "red"
    grammar = choice_grammar([", a circle"])
    [late] = llm.chat(
        conv, SamplingParams(temperature=0.0, max_tokens=20, grammar=grammar, grammar_after="red")
    )
    assert late.text == "red, a circle" and late.finish_reason == "stop"
    [early] = llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=20, grammar=grammar))
    assert early.text == ", a circle"


def test_logprobs_of_constrained_rows_are_the_models_own(llm):
    """As for free rows: the model's distribution before the mask, so the first step's top alternatives equal
    those of the same prompt's unconstrained first step, and the chosen token's logprob is read from it too."""
    grammar = json_schema_grammar(SCHEMAS["enum-color-shape"])
    [free] = llm.chat(CONV, SamplingParams(temperature=0.0, max_tokens=1, logprobs=5))
    [held] = llm.chat(CONV, SamplingParams(temperature=0.0, max_tokens=3, logprobs=5, grammar=grammar))
    first_free, first_held = free.outputs[0].logprobs[0], held.outputs[0].logprobs[0]
    assert [(t, round(lp, 4)) for t, _, lp in first_held.top] == [
        (t, round(lp, 4)) for t, _, lp in first_free.top
    ]
    assert held.text.startswith("{") and all(e.logprob > -1e9 for e in held.outputs[0].logprobs)
    by_token = {t: lp for t, _, lp in first_free.top}
    if first_held.token_id in by_token:
        assert abs(first_held.logprob - by_token[first_held.token_id]) < 1e-5


def test_every_way_of_computing_masks_agrees(llm):
    """A worker thread during the forward pass, at once on the engine thread, or spread over llguidance's own
    threads: the same greedy outputs, each valid."""
    engine = llm.engine
    default = engine.masks
    params = [
        SamplingParams(temperature=0.0, max_tokens=160, grammar=json_schema_grammar(s))
        for s in SCHEMAS.values()
    ]
    modes = {"worker": {}, "inline": {"overlap": False}, "llguidance threads": {"threads": 2}}
    texts = {}
    try:
        for name, kw in modes.items():
            engine.masks = GrammarMasks(default.width, **kw)
            texts[name] = [o.text for o in llm.chat([CONV] * len(SCHEMAS), params)]
            engine.masks.close()
    finally:
        engine.masks = default
    assert texts["worker"] == texts["inline"] == texts["llguidance threads"]
    for text, schema in zip(texts["worker"], SCHEMAS.values()):
        jsonschema.validate(json.loads(text), schema)
