"""Tools in the prompt, in the Qwen families' Hermes-style format, for chat templates that do not carry them.

What Qwen2.5's own template writes: the function signatures in the system message between ``<tools>`` tags,
with the instruction to answer ``<tool_call>{"name": …, "arguments": …}</tool_call>``; an assistant's calls as
those blocks; tool results as a user turn of ``<tool_response>`` blocks (consecutive results in one turn).
Messages arrive normalized (lm_engine/processor.py) and leave as plain system/user/assistant messages.
"""

from __future__ import annotations

import contextlib
import json

DEFAULT_SYSTEM = "You are a helpful assistant."

_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call>"
)


def tools_text(tools: list[dict]) -> str:
    """The system message's tools section: one function signature (OpenAI's tool object) per line."""
    lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return _TOOLS_HEADER + lines + _TOOLS_FOOTER


def call_block(name: str, arguments: object) -> str:
    """One call as the model writes it. ``arguments``: a JSON string (OpenAI's form) or the parsed value."""
    if isinstance(arguments, str):
        # NOTE: a client may send back text the model wrote that is not JSON; it goes in as a string.
        with contextlib.suppress(ValueError):
            arguments = json.loads(arguments)
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _text(content: str | list[dict]) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if p.get("type") == "text")


def has_tool_turns(messages: list[dict]) -> bool:
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def with_tools(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """``messages`` (normalized) with the tools in the system message, calls and results as plain turns."""
    out: list[dict] = []
    if tools:
        first = messages[0] if messages else None
        if first is not None and first["role"] == "system":
            system = _text(first["content"])
            messages = messages[1:]
        else:
            system = DEFAULT_SYSTEM
        out.append({"role": "system", "content": f"{system}\n\n{tools_text(tools)}"})
    for msg in messages:
        role, content = msg["role"], msg["content"]
        if role == "tool":
            block = f"<tool_response>\n{_text(content)}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        elif role == "assistant" and msg.get("tool_calls"):
            parts = [_text(content)] if _text(content) else []
            for call in msg["tool_calls"]:
                fn = call.get("function", {})
                parts.append(call_block(fn.get("name", ""), fn.get("arguments", "{}")))
            out.append({"role": "assistant", "content": "\n".join(parts)})
        else:
            out.append({"role": role, "content": content})
    for msg in out:
        msg.pop("_tool_results", None)
    return out
