"""Turns the logits of sequences that reached their last token into next tokens."""

from __future__ import annotations

import torch

from lm_engine.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits [N, V] (float32), one row per sequence; greedy rows take the argmax."""
    out = logits.argmax(dim=-1).tolist()
    random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if not random_rows:
        return out
    rows = torch.tensor(random_rows)
    sub = logits[rows]
    temps = torch.tensor([seqs[i].params.temperature for i in random_rows], dtype=sub.dtype).unsqueeze(1)
    sub = sub / temps
    sorted_logits, order = sub.sort(dim=-1, descending=True)
    vocab = sub.shape[1]
    ks = torch.tensor([seqs[i].params.top_k or vocab for i in random_rows]).clamp(max=vocab).unsqueeze(1)
    ranks = torch.arange(vocab).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= ks, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    top_ps = torch.tensor([seqs[i].params.top_p for i in random_rows], dtype=probs.dtype).unsqueeze(1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always survives).
    drop = (probs.cumsum(dim=-1) - probs) >= top_ps
    drop[:, 0] = False  # NOTE: a top_p that underflows to 0 must still leave the top token
    probs = probs.masked_fill(drop, 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    for j, i in enumerate(random_rows):
        pick = torch.multinomial(probs[j], 1, generator=seqs[i].generator)
        out[i] = int(order[j, pick])
    return out
