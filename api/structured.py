"""What a request asks its output to be: ``response_format``, vLLM's ``structured_outputs`` / ``guided_*``, and
``tools`` with ``tool_choice`` → the grammar the engine enforces, the tools the prompt offers and whether the
output's tool calls are parsed. Every refusal is a 400 naming the part of the request at fault."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from api.errors import APIError
from api.protocol import ChatCompletionRequest
from lm_engine.structured import (
    GrammarError,
    Grammars,
    choice_grammar,
    json_object_grammar,
    json_schema_grammar,
    lark_grammar,
    regex_grammar,
    tool_call_grammar,
)

_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True, slots=True)
class OutputPlan:
    grammar: str | None = None  # llguidance text the output must match
    grammar_param: str | None = None  # the request part a grammar that does not compile is blamed on
    tool_schemas: tuple[tuple[str, str], ...] = ()  # (param, grammar) per enforced tool: checked one by one
    tools: list[dict] | None = None  # OpenAI tool objects for the prompt
    parse_tools: bool = False  # the output's <tool_call> blocks become message.tool_calls


def _bad(message: str, param: str, code: str = "invalid_request") -> APIError:
    return APIError(400, message, param=param, code=code)


def _response_format(fmt: dict) -> tuple[str, str] | None:
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object_grammar(), "response_format"
    if kind != "json_schema":
        raise _bad(
            f"response_format type {kind!r} is not supported: use 'text', 'json_object' or 'json_schema'",
            "response_format.type",
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad("response_format json_schema needs a json_schema object", "response_format.json_schema")
    name = spec.get("name")
    if name is not None and (not isinstance(name, str) or not _TOOL_NAME.fullmatch(name)):
        raise _bad(
            "json_schema.name must be 1-64 letters, digits, '_' or '-'", "response_format.json_schema.name"
        )
    if not isinstance(spec.get("strict", False), bool | None):
        raise _bad("json_schema.strict must be a boolean", "response_format.json_schema.strict")
    schema = spec.get("schema")
    param = "response_format.json_schema.schema"
    if not isinstance(schema, dict):
        raise _bad("response_format json_schema needs a schema object", param)
    return _schema_grammar(schema, param), param


def _schema_grammar(schema: object, param: str) -> str:
    try:
        return json_schema_grammar(schema)
    except GrammarError as exc:
        raise _bad(f"the JSON schema is not supported: {exc}", param, "invalid_json_schema") from None


def _vllm(req: ChatCompletionRequest) -> list[tuple[str, str]]:
    """vLLM's ``structured_outputs`` and ``guided_*`` fields, as (grammar, param) pairs."""
    found = []
    so = req.structured_outputs or {}
    fields = [(f"structured_outputs.{k}", k, v) for k, v in so.items() if v is not None]
    for k in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{k}")
        if value is not None:
            fields.append((f"guided_{k}", k, value))
    for param, kind, value in fields:
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError:
                    raise _bad("the JSON schema is not valid JSON", param) from None
            found.append((_schema_grammar(value, param), param))
        elif kind == "regex" and isinstance(value, str):
            found.append((regex_grammar(value), param))
        elif (
            kind == "choice" and isinstance(value, list) and value and all(isinstance(c, str) for c in value)
        ):
            found.append((choice_grammar(value), param))
        elif kind == "grammar" and isinstance(value, str):
            found.append((lark_grammar(value), param))
        else:
            raise _bad(
                f"{param}: expected json (a schema), regex (a string), choice (a list of strings) or grammar "
                "(a Lark grammar)",
                param,
            )
    return found


def _tools(req: ChatCompletionRequest) -> list[tuple[str, dict]]:
    """(name, parameters schema) per tool, checked."""
    out, seen = [], set()
    for i, tool in enumerate(req.tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _bad('each tool must be {"type": "function", "function": {...}}', f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _bad("a tool needs a function object", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise _bad("function names are 1-64 letters, digits, '_' or '-'", f"{where}.function.name")
        if name in seen:
            raise _bad(f"two tools are named {name!r}", f"{where}.function.name")
        seen.add(name)
        params = fn.get("parameters", _NO_PARAMETERS)
        if not isinstance(params, dict):
            raise _bad("function parameters must be a JSON schema object", f"{where}.function.parameters")
        out.append((name, params))
    return out


def output_plan(req: ChatCompletionRequest) -> OutputPlan:
    """The request's output plan; an APIError (400) for anything malformed or unsupported."""
    tools = _tools(req)
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    named = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        named = fn.get("name") if choice.get("type") == "function" and isinstance(fn, dict) else None
        if not isinstance(named, str):
            raise _bad(
                'tool_choice must be "none", "auto", "required" or {"type": "function", ...}', "tool_choice"
            )
        if named not in {n for n, _ in tools}:
            raise _bad(f"tool_choice names {named!r}, which is not among the tools", "tool_choice")
    elif choice not in ("none", "auto", "required"):
        raise _bad(
            'tool_choice must be "none", "auto", "required" or {"type": "function", ...}', "tool_choice"
        )
    elif choice == "required" and not tools:
        raise _bad('tool_choice "required" needs tools', "tool_choice")
    sources = []
    if (fmt := req.response_format) is not None and (found := _response_format(fmt)) is not None:
        sources.append(found)
    sources += _vllm(req)
    tool_schemas: tuple[tuple[str, str], ...] = ()
    if named is not None or choice == "required":
        enforced = [(n, p) for n, p in tools if named is None or n == named]
        parallel = named is None and req.parallel_tool_calls is not False
        sources.append((tool_call_grammar(enforced, parallel), "tool_choice"))
        tool_schemas = tuple(
            (f"tools[{i}].function.parameters", _schema_grammar(p, f"tools[{i}].function.parameters"))
            for i, (n, p) in enumerate(tools)
            if named is None or n == named
        )
    if len(sources) > 1:
        raise _bad(
            "only one of response_format, structured_outputs / guided_*, and a required or named tool_choice "
            "may constrain the output",
            sources[1][1],
        )
    grammar, param = sources[0] if sources else (None, None)
    offered = req.tools if tools and choice != "none" else None
    return OutputPlan(grammar, param, tool_schemas, offered, parse_tools=offered is not None)


def compile_plan(plan: OutputPlan, grammars: Grammars) -> None:
    """Compile the plan's grammar into the engine's cache (a worker thread's job: it can take a second);
    a 400 naming the request part whose grammar the library refuses."""
    for param, grammar in plan.tool_schemas:
        _compile(grammars, grammar, param)
    if plan.grammar is not None:
        _compile(grammars, plan.grammar, plan.grammar_param or "response_format")


def _compile(grammars: Grammars, grammar: str, param: str) -> None:
    try:
        grammars.compile(grammar)
    except GrammarError as exc:
        raise _bad(f"{param} cannot be enforced: {exc}", param, "unsupported_grammar") from None
