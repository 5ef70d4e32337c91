"""A choice's text → what OpenAI's message holds: ``reasoning_content`` (a ``<think>`` block), ``content`` and
``tool_calls`` (Hermes-style ``<tool_call>{"name": …, "arguments": …}</tool_call>`` blocks).

One parser reads text as it streams and says what each piece is, as OpenAI's delta objects; the non-streamed
message is the same parser fed the whole text, so a client that assembles the stream gets the very message a
non-streamed request gets. Text that could still turn out to be a tag is held back until it cannot.
"""

from __future__ import annotations

import json
import re
import uuid

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# How a call starts when "name" comes first (the grammar writes it so; Qwen models do too): the arguments
# then stream as the model writes them. Anything else is parsed whole once the block closes.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:')


def _held(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class _Arguments:
    """Finds where a JSON object ends, character by character (strings and escapes respected)."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped, self.started = 0, False, False, False

    def take(self, text: str) -> tuple[str, int | None]:
        """The part of ``text`` that belongs to the value, and where in ``text`` it ended (None: not yet)."""
        start = 0
        for i, ch in enumerate(text):
            if not self.started:
                if ch.isspace():
                    continue
                self.started = True
                start = i
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return text[start : i + 1], i + 1
        return (text[start:] if self.started else ""), None


class OutputParser:
    """``feed`` text deltas, then ``finish``; each returns OpenAI delta objects in order.

    ``tools``: parse tool calls. ``reasoning``: the output may open with a ``<think>`` block (``thinking``: it
    starts inside one, the prompt having opened it)."""

    def __init__(self, tools: bool = False, reasoning: bool = False, thinking: bool = False) -> None:
        self.tools = tools
        self.state = "think" if thinking else ("start" if reasoning else "content")
        self.buf = ""
        self.calls = 0
        self.pending_ws = ""  # content that is only whitespace so far: dropped beside tool calls
        self.args: _Arguments | None = None
        self.after_think = False

    # -- public --------------------------------------------------------------------------------------------
    def feed(self, text: str) -> list[dict]:
        self.buf += text
        out: list[dict] = []
        while self._step(out, final=False):
            pass
        return _merged(out)

    def finish(self) -> list[dict]:
        out: list[dict] = []
        while self._step(out, final=True):
            pass
        if self.state == "head":  # a call cut off before its name: what was written is text
            self._content(out, CALL_OPEN + self.buf)
        elif self.state in ("content", "start"):
            self._content(out, self.buf)
        elif self.state == "think" and self.buf:
            out.append({"reasoning_content": self.buf})
        self.buf = ""
        if self.pending_ws and not self.calls:
            out.append({"content": self.pending_ws})  # NOTE: trailing whitespace of a plain answer is kept
        self.pending_ws = ""
        return _merged(out)

    # -- states --------------------------------------------------------------------------------------------
    def _step(self, out: list[dict], final: bool) -> bool:
        """One move of the state machine; False when it needs more text."""
        buf = self.buf
        if self.state == "start":  # reasoning allowed: does the output open a think block?
            stripped = buf.lstrip()
            if stripped.startswith(THINK_OPEN):
                self.buf, self.state = stripped[len(THINK_OPEN) :], "think"
                return True
            if not final and THINK_OPEN.startswith(stripped):
                return False
            self.state = "content"
            return True
        if self.state == "think":
            idx = buf.find(THINK_CLOSE)
            if idx >= 0:
                if idx:
                    out.append({"reasoning_content": buf[:idx]})
                self.buf, self.state, self.after_think = buf[idx + len(THINK_CLOSE) :], "content", True
                return True
            keep = 0 if final else _held(buf, THINK_CLOSE)
            if len(buf) > keep:
                out.append({"reasoning_content": buf[: len(buf) - keep]})
                self.buf = buf[len(buf) - keep :]
            return False
        if self.state == "content":
            if self.after_think:  # the blank lines after </think> separate; they are not the answer
                buf = self.buf = buf.lstrip()
                if not buf:
                    return False
                self.after_think = False
            idx = buf.find(CALL_OPEN) if self.tools else -1
            if idx >= 0:
                self._content(out, buf[:idx])
                self.pending_ws = ""  # whitespace beside a call is layout, not content
                self.buf, self.state = buf[idx + len(CALL_OPEN) :], "head"
                return True
            keep = _held(buf, CALL_OPEN) if self.tools and not final else 0
            self._content(out, buf[: len(buf) - keep])
            self.buf = buf[len(buf) - keep :]
            return False
        if self.state == "head":
            m = _HEAD.match(buf)
            if m is not None:
                self._open_call(out, json.loads(f'"{m.group(1)}"'))
                self.buf, self.state, self.args = buf[m.end() :], "args", _Arguments()
                return True
            if CALL_CLOSE in buf:
                self.state = "whole"
                return True
            return False
        if self.state == "args":
            assert self.args is not None
            taken, end = self.args.take(buf)
            if taken:
                out.append(_args_delta(self.calls - 1, taken))
            if end is not None:
                self.buf, self.state = buf[end:], "tail"
                return True
            self.buf = ""
            return False
        if self.state == "tail":  # after the arguments: the rest of the block up to its closing tag
            idx = buf.find(CALL_CLOSE)
            if idx < 0:
                if final:
                    self.buf = ""
                return False
            self.buf, self.state = buf[idx + len(CALL_CLOSE) :], "content"
            return True
        if self.state == "whole":  # a block in another layout: parsed once closed
            idx = buf.find(CALL_CLOSE)
            body, self.buf, self.state = buf[:idx], buf[idx + len(CALL_CLOSE) :], "content"
            try:
                call = json.loads(body)
            except ValueError:
                call = None
            if isinstance(call, dict) and isinstance(call.get("name"), str) and "arguments" in call:
                self._open_call(out, call["name"])
                out.append(_args_delta(self.calls - 1, json.dumps(call["arguments"], ensure_ascii=False)))
            else:
                self._content(out, CALL_OPEN + body + CALL_CLOSE)
            return True
        raise AssertionError(self.state)

    def _content(self, out: list[dict], text: str) -> None:
        """Content, its trailing whitespace held until more content follows (a tool call drops it)."""
        body = text.rstrip()
        if body:
            out.append({"content": self.pending_ws + body})
            self.pending_ws = ""
        self.pending_ws += text[len(body) :]

    def _open_call(self, out: list[dict], name: str) -> None:
        call = {"index": self.calls, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function"}
        out.append({"tool_calls": [{**call, "function": {"name": name, "arguments": ""}}]})
        self.calls += 1


def _args_delta(index: int, fragment: str) -> dict:
    return {"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}


def _merged(deltas: list[dict]) -> list[dict]:
    """Adjacent text deltas of one kind, and argument fragments of one call, joined."""
    out: list[dict] = []
    for d in deltas:
        prev = out[-1] if out else None
        if prev is not None and d.keys() == prev.keys() and "tool_calls" not in d:
            key = next(iter(d))
            prev[key] += d[key]
            continue
        if (
            prev is not None
            and "tool_calls" in d
            and "tool_calls" in prev
            and "id" not in d["tool_calls"][0]
            and prev["tool_calls"][0]["index"] == d["tool_calls"][0]["index"]
        ):
            prev["tool_calls"][0]["function"]["arguments"] += d["tool_calls"][0]["function"]["arguments"]
            continue
        out.append(d)
    return out


def message(parser: OutputParser, text: str) -> dict:
    """The whole message for ``text``: content (None when only tool calls were written), reasoning_content
    and tool_calls, as the streamed deltas assemble."""
    content, reasoning, calls = [], [], []
    for d in parser.feed(text) + parser.finish():
        if "content" in d:
            content.append(d["content"])
        elif "reasoning_content" in d:
            reasoning.append(d["reasoning_content"])
        else:
            call = d["tool_calls"][0]
            if "id" in call:
                calls.append({"id": call["id"], "type": "function", "function": dict(call["function"])})
            else:
                calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
    body: dict = {"role": "assistant", "content": "".join(content) if content or not calls else None}
    if reasoning:
        body["reasoning_content"] = "".join(reasoning)
    if calls:
        body["tool_calls"] = calls
    return body
