"""Constrained decoding: grammars compiled once per text, a matcher per constrained sequence, and the token
masks a step applies to its logits before sampling (llguidance does the grammar work).

A constrained request's ``SamplingParams.grammar`` holds its grammar as llguidance text (Lark, or the JSON
form ``grammar_from_json_schema`` makes). ``Grammars.compile`` turns it into a template matcher, cached by
that text; callers compile on their own threads (the server does, on its executor), so a slow grammar never
holds up the engine's step, which then only copies the template. ``MaskJob`` computes a step's masks on a
worker thread while the forward pass runs (llguidance drops the GIL), and applies them once logits exist.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np
import torch
from tokenizers import Tokenizer

from lm_engine.device import to_device

# JSON as the grammar writes it: one space after ':' and ',', no other whitespace. A small model given free
# whitespace can spend its whole max_tokens on newlines; this is the form json.dumps prints.
JSON_OPTIONS = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
_CACHE_SIZE = 256


class GrammarError(ValueError):
    """A grammar or schema the library cannot compile: the client's error, with the library's reason."""


def json_schema_grammar(schema: dict | bool) -> str:
    """A JSON schema → grammar text. ``True`` / ``{}``: any JSON value."""
    if schema is True or schema == {}:
        schema = {}
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    except (ValueError, TypeError, RecursionError) as exc:
        raise GrammarError(str(exc) or type(exc).__name__) from None


def json_object_grammar() -> str:
    """Any JSON object (OpenAI's ``json_object``)."""
    return json_schema_grammar({"type": "object"})


def regex_grammar(pattern: str) -> str:
    return llguidance.LLMatcher.grammar_from_regex(pattern)


def lark_grammar(lark: str) -> str:
    return llguidance.LLMatcher.grammar_from_lark(lark)


def choice_grammar(choices: list[str]) -> str:
    """Exactly one of ``choices``. JSON's string escapes are Lark's too."""
    if not choices:
        raise GrammarError("choice needs at least one string")
    return lark_grammar("start: " + " | ".join(json.dumps(c) for c in choices))


def _schema_rule(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def tool_call_grammar(tools: list[tuple[str, dict]], parallel: bool) -> str:
    """Hermes-style calls to one of ``tools`` ((name, parameters schema) pairs), each
    ``<tool_call>\\n{"name": …, "arguments": …}\\n</tool_call>``; several in a row when ``parallel``. The
    arguments follow the function's parameter schema; "name" comes first, as the tool parser expects."""
    rules, names = [], []
    for i, (name, params) in enumerate(tools):
        call = {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        names.append(f"call_{i}")
        rules.append(f"call_{i}: {_schema_rule(call)}")
    body = " | ".join(names)
    calls = 'tool_call ("\\n" tool_call)*' if parallel else "tool_call"
    head = [f"start: {calls}", f'tool_call: "<tool_call>\\n" ({body}) "\\n</tool_call>"']
    return lark_grammar("\n".join(head + rules) + "\n")


@dataclass(frozen=True, slots=True)
class Grammar:
    """A compiled grammar: the template every sequence's matcher is copied from."""

    text: str
    template: llguidance.LLMatcher

    def matcher(self) -> llguidance.LLMatcher:
        return self.template.deep_copy()


class Grammars:
    """Compiles grammars for one tokenizer and logits width; thread-safe; an LRU of compiled grammars by text.

    ``width``: the logits' columns (the model's vocab_size). Ids the tokenizer does not have (a padded
    vocabulary) are never allowed; ``eos_ids`` end a finished grammar."""

    def __init__(self, tokenizer: Tokenizer, width: int, eos_ids: list[int]) -> None:
        self.width = max(width, tokenizer.get_vocab_size(with_added_tokens=True))
        self._source, self._eos_ids = tokenizer, list(eos_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer, built on first use (a second for a 150k vocabulary): an engine
        that never sees a constrained request never pays for it."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self._source.to_str(), n_vocab=self.width, eos_token=self._eos_ids
                )
            return self._tokenizer

    def compile(self, text: str) -> Grammar:
        """The compiled grammar (cached); GrammarError if the library refuses it. Takes from a millisecond to
        about a second (large schemas): call it off the engine's thread where latency matters."""
        with self._lock:
            hit = self._cache.get(text)
            if hit is not None:
                self._cache.move_to_end(text)
                return hit
        # NOTE: outside the lock: compiles run in parallel, and a slow one does not hold cache hits up. The
        # matcher compiles the grammar (llguidance drops the GIL meanwhile) and holds its error if it has one.
        template = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if template.is_error():
            raise GrammarError(template.get_error())
        grammar = Grammar(text, template)
        with self._lock:
            self._cache[text] = grammar
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def __len__(self) -> int:
        return len(self._cache)


@dataclass(slots=True)
class GrammarState:
    """A sequence's matcher. ``after``: text that must appear in the output before the grammar applies (a
    reasoning model's ``</think>``); until then the sequence samples freely."""

    matcher: llguidance.LLMatcher
    after: str | None = None

    @property
    def active(self) -> bool:
        return self.after is None

    def advance(self, token: int) -> bool:
        """Consume ``token`` (sampled under this state's mask); False if the grammar refuses it."""
        return self.after is not None or self.matcher.consume_token(token)

    def notice(self, output_text: str) -> None:
        """The output so far: once it holds ``after``, the grammar applies from the next token on."""
        if self.after is not None and self.after in output_text:
            self.after = None

    @property
    def stopped(self) -> bool:
        """The grammar is complete and can take nothing more (only an end-of-sequence token)."""
        return self.after is None and self.matcher.is_stopped()

    def fork(self) -> GrammarState:
        return GrammarState(self.matcher.deep_copy(), self.after)


def _fill(executor: llguidance.LLExecutor | None, pairs: list, bitmask: torch.Tensor) -> None:
    """Each (matcher, row)'s mask into ``bitmask`` (int32, contiguous, on the CPU): row by row on this thread,
    or on llguidance's threads. NOTE: through the matchers' own pointer API, not ``llguidance.torch``, whose
    import compiles a kernel with torch.compile and so pulls torch._dynamo into the server."""
    row_bytes = bitmask.shape[1] * 4
    if executor is None or len(pairs) < 4:
        for matcher, row in pairs:
            matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * row_bytes, row_bytes)
    else:
        executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), row_bytes, bitmask.shape[0])


class MaskJob:
    """One step's masks: computed on a worker thread from ``start`` on, applied by ``apply``."""

    def __init__(
        self,
        pool: ThreadPoolExecutor | _Inline,
        executor: llguidance.LLExecutor | None,
        width: int,
        states: list,
    ) -> None:
        self.rows = {id(state): i for i, state in enumerate(states)}
        self.bitmask = torch.zeros(len(states), (width + 31) // 32, dtype=torch.int32)
        pairs = [(s.matcher, i) for i, s in enumerate(states)]
        self.states = states
        self._done: Future = pool.submit(_fill, executor, pairs, self.bitmask)

    def apply(self, logits: torch.Tensor, states: list[GrammarState | None]) -> list[int]:
        """Mask ``logits`` in place, row i by ``states[i]`` (None: a free row, untouched). Returns the rows whose
        matcher is in an error state (nothing is allowed there: the caller fails them)."""
        self._done.result()
        rows, picks, broken = [], [], []
        for row, state in enumerate(states):
            if state is None or id(state) not in self.rows:
                continue
            if state.matcher.is_error():
                broken.append(row)
                continue
            rows.append(row)
            picks.append(self.rows[id(state)])
        if not rows:
            return broken
        # Bit j of word w allows token 32·w + j: the words' bytes unpacked least significant bit first (the
        # int32 words are little-endian on every platform torch runs on).
        words = self.bitmask.numpy()[picks].view(np.uint8)
        barred = np.unpackbits(words, axis=1, bitorder="little")[:, : logits.shape[1]] == 0
        if logits.device.type == "cpu" and logits.is_contiguous():
            # NOTE: numpy, in place: torch's elementwise kernels wake their thread pool for each op, which took
            # milliseconds per step on a busy 2-vCPU machine (measured: 15 ms for a [16, 8192] bool cast).
            values = logits.numpy()
            for i, row in enumerate(rows):
                np.copyto(values[row], -np.inf, where=barred[i])
        else:
            index = to_device(torch.tensor(rows), logits.device)
            barred_t = to_device(torch.from_numpy(barred), logits.device)
            logits.index_copy_(0, index, logits.index_select(0, index).masked_fill(barred_t, float("-inf")))
        return broken


class _Inline:
    """Runs a job at once, on the caller's thread (its Future already done)."""

    def submit(self, fn, *args) -> Future:
        done: Future = Future()
        try:
            done.set_result(fn(*args))
        except BaseException as exc:
            done.set_exception(exc)
        return done

    def shutdown(self, wait: bool = True) -> None:
        pass


class GrammarMasks:
    """Starts each step's ``MaskJob``: on a worker thread while the forward pass runs (``overlap``, the default),
    which spreads many rows over llguidance's threads, or at once on the engine's thread.

    NOTE: on 2 vCPUs with torch's threads on both, the worker competes with the pass for a core; measured
    (benchmarks/structured.py, small preset, batch 16, every row constrained) the two ways came out +12 % and
    +1.5 % a step overlapped against +4.3 % inline in two runs under other load, so neither wins there for
    certain, and overlapping is what frees the step wherever the pass leaves the CPU idle (an accelerator).
    ``threads``: llguidance's; default a quarter of the CPUs, and none of its own below 8 CPUs (its pool took
    1.6 ms a step on 2 vCPUs for 4 rows' masks that one thread computes in 0.26 ms: its threads spin)."""

    def __init__(self, width: int, overlap: bool = True, threads: int | None = None) -> None:
        self.width = width
        self.overlap = overlap
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="vlmserve-grammar") if overlap else _Inline()
        threads = threads if threads is not None else (os.cpu_count() or 1) // 4
        self._executor = llguidance.LLExecutor(threads) if threads > 1 else None

    def start(self, states: list[GrammarState]) -> MaskJob | None:
        """The masks of ``states`` (active ones only), computing from now on; None when there are none."""
        live = [s for s in states if s.active]
        return MaskJob(self._pool, self._executor, self.width, live) if live else None

    def close(self) -> None:
        self._pool.shutdown(wait=False)
