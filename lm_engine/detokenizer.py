"""Incremental detokenization that never emits a partial UTF-8 character."""

from __future__ import annotations

from collections.abc import Callable

from lm_engine.sequence import Sequence

REPLACEMENT = "\ufffd"


def detokenize_step(seq: Sequence, decode: Callable[[list[int]], str]) -> str:
    """Append the text the newest output tokens complete to ``seq.output_text``; returns it.

    Decodes a short window (from ``detok_prefix_offset``) twice and emits the difference, holding
    tokens back while they end in an incomplete byte sequence (decoded as U+FFFD).
    """
    out = seq.output_token_ids
    prefix = decode(out[seq.detok_prefix_offset : seq.detok_read_offset])
    full = decode(out[seq.detok_prefix_offset :])
    if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
        delta = full[len(prefix) :]
        seq.detok_prefix_offset = seq.detok_read_offset
        seq.detok_read_offset = len(out)
        seq.output_text += delta
        return delta
    return ""


def flush(seq: Sequence, decode: Callable[[list[int]], str]) -> str:
    """At the end of a sequence, emit whatever is still held back (a dangling byte shows as U+FFFD)."""
    out = seq.output_token_ids
    prefix = decode(out[seq.detok_prefix_offset : seq.detok_read_offset])
    full = decode(out[seq.detok_prefix_offset :])
    delta = full[len(prefix) :] if len(full) > len(prefix) else ""
    seq.detok_prefix_offset = seq.detok_read_offset = len(out)
    seq.output_text += delta
    return delta
