"""The token arithmetic of one scheduler step: the token budget, the prefill cap beside decodes, and each
client's fair share of the prefill tokens; and who was served recently, which orders the clients."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from lm_engine.sequence import Sequence


@dataclass(slots=True)
class StepBudget:
    """Tokens one step may still schedule.

    Decodes take one token each from ``tokens``. Prefill then gets what is left, at most
    ``prefill_cap`` when decodes run beside it (a long prefill chunk stalls every stream for its length), and
    shares it between clients max-min fairly: each client with prefill work gets an equal share, a client
    wanting less leaves the rest to the others, and nobody is cut below one block while tokens remain. Any
    chunk may cut through an image's placeholder span: its rows are sliced, never re-encoded.
    """

    tokens: int
    prefill_cap: int | None = None
    block_size: int = 16
    allowance: dict[str, int] = field(default_factory=dict)

    def plan_prefill(self, candidates: Iterable[Sequence], with_decodes: bool) -> None:
        """Split the prefill tokens between the clients of ``candidates`` by what they could use this step."""
        if with_decodes and self.prefill_cap is not None:
            self.tokens = min(self.tokens, self.prefill_cap)
        demand: dict[str, int] = {}
        for seq in candidates:
            demand[seq.client_key] = demand.get(seq.client_key, 0) + seq.num_uncomputed
        self.allowance = fair_shares(demand, self.tokens, self.block_size)

    def grant(self, client: str, want: int) -> int:
        """Tokens a chunk of ``client``'s may take now (≤ ``want``); charged to the budget by ``spend``."""
        return max(0, min(want, self.tokens, self.allowance.get(client, 0)))

    def spend(self, client: str, tokens: int) -> None:
        self.tokens -= tokens
        self.allowance[client] = self.allowance.get(client, 0) - tokens


def fair_shares(demand: dict[str, int], total: int, floor: int) -> dict[str, int]:
    """Max-min fair split of ``total`` by ``demand`` (water-filling), each share at least ``floor`` tokens of
    what its client wants."""
    shares = {c: 0 for c in demand}
    left = total
    wanting = sorted((d, c) for c, d in demand.items() if d > 0)
    while wanting and left > 0:
        level = max(1, left // len(wanting))
        d, c = wanting[0]
        if (
            d - shares[c] <= level
        ):  # the smallest demand fits in an equal split: satisfy it, re-split the rest
            left -= d - shares[c]
            shares[c] = d
            wanting.pop(0)
            continue
        for _, c in wanting:
            shares[c] += level
        left -= level * len(wanting)
        break
    for c, d in demand.items():
        shares[c] = max(shares[c], min(d, floor))
    return shares


class ClientUsage:
    """Tokens scheduled per client recently (decayed each step): prefill goes to the least-served first."""

    def __init__(self, decay: float = 0.97) -> None:
        self.decay = decay
        self.served: defaultdict[str, float] = defaultdict(float)

    def of(self, client: str) -> float:
        return self.served.get(client, 0.0)

    def step(self) -> None:
        for client in list(self.served):
            self.served[client] *= self.decay
            if self.served[client] < 1:
                del self.served[client]

    def record(self, client: str, tokens: int) -> None:
        self.served[client] += tokens
