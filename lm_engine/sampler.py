"""Turns the logits of sequences that reached their last token into next tokens, on the logits' device."""

from __future__ import annotations

from collections.abc import Collection

import torch

from lm_engine.device import to_device
from lm_engine.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_ids: Collection[int] = ()) -> list[int]:
    """logits [N, V] (float32, any device), one row per sequence; greedy rows take the argmax.

    Everything stays on the logits' device: the per-row settings go over in one copy, all random rows draw
    in one batch, and one ``.tolist()`` is the step's only device sync. A seeded row draws from its own
    generator, which lives on that device too (the engine makes it there). Rows whose parameters adjust
    logits (penalties, logit_bias, min_tokens, which bars ``eos_ids``) are adjusted first, row by row.
    """
    if any(s.params.adjusts_logits for s in seqs):
        logits = _adjusted(logits, seqs, eos_ids)
    greedy = logits.argmax(dim=-1)
    if all(s.params.greedy for s in seqs):
        return greedy.tolist()
    knobs = _settings(seqs, logits.shape[1], logits.dtype)
    temps, top_k, top_p, is_greedy, min_p = to_device(knobs, logits.device).unbind(dim=1)
    scaled = logits / temps.unsqueeze(1)
    if any(s.params.min_p > 0.0 for s in seqs):
        probs = scaled.softmax(dim=-1)
        low = probs < min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        scaled = scaled.masked_fill(low, float("-inf"))  # the likeliest token always stays (min_p <= 1)
    order = None
    if any(s.params.top_k or s.params.top_p < 1.0 for s in seqs):
        probs, order = _filtered(scaled, top_k, top_p)
    else:
        probs = scaled.softmax(dim=-1)
    drawn = _race(probs, seqs)
    if order is not None:
        drawn = order.gather(1, drawn.unsqueeze(1)).squeeze(1)
    return torch.where(is_greedy.bool(), greedy, drawn).tolist()


def token_logprobs(
    logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]
) -> list[tuple[float, list[tuple[int, float]]] | None]:
    """Per row: the sampled token's log-probability under the raw logits and the k likeliest (id, logprob)
    pairs, k = its params' ``logprobs``; None for rows that did not ask. One device sync."""
    rows = [j for j, s in enumerate(seqs) if s.params.logprobs is not None]
    out: list[tuple[float, list[tuple[int, float]]] | None] = [None] * len(seqs)
    if not rows:
        return out
    index = to_device(torch.tensor(rows), logits.device)
    lp = logits.index_select(0, index).float().log_softmax(dim=-1)
    chosen = lp.gather(1, to_device(torch.tensor([[tokens[j]] for j in rows]), logits.device)).squeeze(1)
    k = max(seqs[j].params.logprobs for j in rows)
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    chosen, top_lp, top_ids = chosen.tolist(), top_lp.tolist(), top_ids.tolist()
    for i, j in enumerate(rows):
        want = seqs[j].params.logprobs
        out[j] = (chosen[i], list(zip(top_ids[i][:want], top_lp[i][:want])))
    return out


def _settings(seqs: list[Sequence], vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """[N, 5] per row: temperature, top-k (vocab: off), top-p, greedy flag, min-p."""
    rows = []
    for s in seqs:
        p = s.params
        # NOTE: greedy rows draw too (their pick is discarded), at temperature 1 so nothing divides by 0.
        top_k = min(p.top_k, vocab) or vocab  # NOTE: past the vocabulary means all of it (as vLLM clamps)
        rows.append((1.0 if p.greedy else p.temperature, top_k, p.top_p, float(p.greedy), p.min_p))
    return torch.tensor(rows, dtype=dtype)


def _adjusted(logits: torch.Tensor, seqs: list[Sequence], eos_ids: Collection[int]) -> torch.Tensor:
    """A copy of ``logits`` with each row's adjustments applied, in vLLM's order: min_tokens, logit_bias, then the
    repetition penalty (over prompt and generated tokens, as transformers' processor), then the frequency and
    presence penalties (over generated tokens: OpenAI's formula)."""
    logits = logits.clone()
    vocab, device = logits.shape[1], logits.device
    rows = [(row, s, s.params) for row, s in enumerate(seqs) if s.params.adjusts_logits]
    for row, s, p in rows:
        if s.num_output_tokens < p.min_tokens:
            barred = [t for t in {*eos_ids, *p.stop_token_ids} if 0 <= t < vocab]
            if barred:
                logits[row, to_device(torch.tensor(barred), device)] = float("-inf")
    _add_bias(logits, [(row, *p.bias_tensors()) for row, _, p in rows if p.logit_bias])
    for row, s, p in rows:
        x = logits[row]
        if p.repetition_penalty != 1.0:
            ids = to_device(torch.tensor(sorted(set(s.token_ids))), device)
            seen = x[ids]
            x[ids] = torch.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty)
        generated = s.token_ids[s.num_prompt_tokens :]
        if (p.frequency_penalty or p.presence_penalty) and generated:
            ids, counts = torch.tensor(generated).unique(return_counts=True)
            ids, counts = to_device(ids, device), to_device(counts.to(x.dtype), device)
            x[ids] -= counts * p.frequency_penalty + p.presence_penalty
    return logits


def _add_bias(logits: torch.Tensor, biased: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
    """Every row's logit_bias in one scatter, from the (ids, values) tensors each request built once: a
    request's bias costs a step no Python work per entry, however many entries and choices it has. Ids past
    the logits' width are ignored."""
    if not biased:
        return
    rows = torch.cat([torch.full_like(ids, row) for row, ids, _ in biased])
    ids = torch.cat([ids for _, ids, _ in biased])
    values = torch.cat([values for _, _, values in biased]).to(logits.dtype)
    keep = ids < logits.shape[1]
    index = to_device(torch.stack([rows[keep], ids[keep]]), logits.device)
    logits.index_put_((index[0], index[1]), to_device(values[keep], logits.device), accumulate=True)


def _race(probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """One draw per row: argmax(p / E) with E ~ Exp(1) samples p exactly (the Gumbel-max trick), batched."""
    race = torch.empty_like(probs)
    if all(s.generator is None for s in seqs):
        race.exponential_()
    else:
        for j, s in enumerate(seqs):
            race[j].exponential_(generator=s.generator)  # NOTE: a seeded row depends on its own seed only
    # NOTE: an exponential draw can be exactly 0; a floor keeps p / E finite, and a zero p stays zero.
    return (probs / race.clamp_(min=torch.finfo(race.dtype).tiny)).argmax(dim=-1)


def _filtered(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's probabilities in descending order (and that order), after top-k and then top-p."""
    ordered, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(scaled.shape[1], device=scaled.device).unsqueeze(0)
    ordered = ordered.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    probs = ordered.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always survives).
    drop = (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
    drop[:, 0] = False  # NOTE: a top_p that underflows to 0 must still leave the top token
    return probs.masked_fill(drop, 0.0), order
