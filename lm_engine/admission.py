"""Admission control: whether new work is taken on, for the offline engine and the server alike. Every rule
that refuses a request lives here.

- **Saturation** (:class:`AdmissionPolicy`, after each step): the prefill work already queued takes longer than
  the TTFT target, so no visual budget for the new request's images could keep it; refused until the wait falls
  below ``shed_low`` of the target.
- **The wait ahead** (:meth:`Admission._check`, between steps, while admission by the SLO is on): the queue's
  wait plus what was admitted since the last step (and, past ``own_from_s``, the request's own prefill) passes
  the target.
- **Fair share**: a client whose own fair-share wait is within ``admit_within_s`` gets in anyway.
- **Queue bounds**: requests submitted but not yet scheduled, and their prompt tokens.

:class:`AdmissionPolicy` turns what :class:`~lm_engine.load.LoadControl` measured into one published
``AdmissionState`` after each step; :class:`Admission` decides on that snapshot on any thread. A request
admitted holds a ``Ticket`` on the queue counts until the scheduler first runs it or it ends, whichever comes
first.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from lm_engine.visual_budget import QUEUE_SHARE, BudgetSignals


class EngineOverloaded(RuntimeError):
    """New work refused by admission control (a 503 with Retry-After to an HTTP client)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(slots=True, frozen=True)
class AdmissionState:
    """The load controller's view of new work, published by the engine after each step.

    NOTE: other threads (the API's event loop) read ``Admission.state`` without a lock. That is safe: the
    engine thread only ever replaces the whole immutable snapshot with one attribute store, and a reference
    load or store is atomic in CPython (with or without the GIL), so a reader sees one update's state or the
    next one's, never a mix. It can be one step old; a decision on it is no less right than one a step earlier.
    """

    overloaded: bool = False  # the queued prefill work takes longer than the TTFT SLO
    retry_after_s: float = 1.0  # the expected time to drain what is queued (≥ 1 s)
    reason: str | None = None  # why new work is refused, when overloaded
    expected_wait_s: float | None = None  # of the queued prefill work, None until throughput is measured
    # What still lets a client in while overloaded: prefill is shared max-min fairly between clients
    # (lm_engine/step_budget.py), so a request waits behind another client's queued work only up to as much
    # as its own client has queued, itself included (``fair_wait_s``). A client whose wait is within
    # ``admit_within_s`` is admitted; None: no such exemption. The mapping is never changed once published.
    queued_by_client: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    prefill_tokens_per_s: float | None = None
    admit_within_s: float | None = None
    # While admission by the SLO is on: the queue's wait plus that of what was admitted since this state was
    # published, past this, refuses a request before the next step says so (a step can be long). Once that
    # wait ahead passes ``own_from_s``, the request's own prefill counts too (its first token comes after
    # it); below, it does not, so no request is refused for its own size alone. None: never (see load.py).
    ttft_slo_s: float | None = None
    own_from_s: float | None = None

    def fair_wait_s(
        self, client: str, num_tokens: int, since: Mapping[str, int] = MappingProxyType({})
    ) -> float | None:
        """How long a new request of ``client``'s with ``num_tokens`` prompt tokens waits for its prefill to
        end, if every client with queued work gets an equal share of each step (None: no rate measured).
        ``since``: tokens per client admitted after this state was published, queued as well."""
        rate = self.prefill_tokens_per_s
        if not rate:
            return None
        queued = dict(self.queued_by_client)
        for c, q in since.items():
            queued[c] = queued.get(c, 0) + q
        own = queued.get(client, 0) + num_tokens
        others = sum(min(q, own) for c, q in queued.items() if c != client)
        return (own + others) / rate


def queue_ahead_reason(wait_s: float, slo_s: float, own_s: float = 0.0) -> str:
    """Why a request is refused when the work queued ahead of it takes ``wait_s`` (and its own prefill
    ``own_s``), past the TTFT SLO."""
    own = f" and its own prompt {own_s:.1f} s more" if own_s else ""
    return (
        f"{wait_s:.1f} s of queued work is ahead of a new request{own}, over the {slo_s:.1f} s "
        "time-to-first-token target"
    )


class AdmissionPolicy:
    """The refusal rules' settings and the one state they carry (saturation's hysteresis); after each step
    :meth:`observe` reads what was measured and :meth:`publish` makes the ``AdmissionState`` that new requests
    are judged by until the next.

    ``sheds``: saturation refuses new work (else it is only reported: the visual budget still counts it as
    pressure). ``adaptive``: the visual budget adapts; then a request's own prefill never counts against it
    (NOTE: with the adaptive budget the queue is the ladder's signal too. Counting a request's own prefill there
    refused more, the shorter queue hid the load, and the ladder stepped back up mid-burst: 74 and 77 of 96
    requests within the SLOs against 85 and 83 without (benchmarks/visual_budget.py, 2 s SLO, 2026-12-05).
    With a fixed budget only admission reads the queue.)"""

    def __init__(
        self,
        ttft_slo_s: float,
        sheds: bool,
        adaptive: bool,
        shed_low: float = 0.75,
        queue_share: float = QUEUE_SHARE,
    ) -> None:
        if not 0 < shed_low <= 1 or not 0 < queue_share <= 1:
            raise ValueError("need 0 < shed_low <= 1 and 0 < queue_share <= 1")
        self.ttft_slo_s = ttft_slo_s
        self.sheds, self.adaptive = sheds, adaptive
        self.shed_low = shed_low  # saturated until the expected wait falls below this share of the SLO
        self.queue_share = (
            queue_share  # of the SLO, what queueing may take before a request's own prefill counts
        )
        self.saturated = False

    def observe(self, signals: BudgetSignals) -> bool:
        """Whether the queue is saturated after this step: its expected wait passed the SLO and has not yet
        fallen below ``shed_low`` of it. An idle engine, or one with no prefill rate measured (tokens alone say
        nothing about time), is not.

        NOTE: until 2026-12-05 this waited for the visual budget's lowest level. Under a burst at 2x the
        sustainable rate (benchmarks/quality_vs_budget.py, shipped demo model) the three dwells that takes let
        the queue grow to 3-6 s of work, and most requests admitted meanwhile missed the 2 s TTFT SLO (TTFT
        p50 2.9 s)."""
        wait = signals.expected_wait_s
        if not signals.busy or wait is None:
            self.saturated = False
        elif wait > self.ttft_slo_s:
            self.saturated = True
        else:
            self.saturated = self.saturated and wait >= self.shed_low * self.ttft_slo_s
        return self.saturated

    def publish(self, signals: BudgetSignals, queued_by_client: Mapping[str, int] | None) -> AdmissionState:
        """The state new requests are judged by until the next step (after :meth:`observe` of the same
        signals). ``queued_by_client``: measured where admission by the SLO is on (:attr:`sheds`)."""
        wait, slo = signals.expected_wait_s, self.ttft_slo_s
        overloaded = self.sheds and self.saturated
        reason = queue_ahead_reason(wait, slo) if overloaded else None
        state = AdmissionState(overloaded, self.retry_after_s(signals), reason, wait)
        if not self.sheds or queued_by_client is None:
            return state
        return dataclasses.replace(
            state,
            queued_by_client=MappingProxyType(
                queued_by_client
            ),  # a fresh dict each step, never changed again
            prefill_tokens_per_s=signals.prefill_tokens_per_s,
            admit_within_s=self.shed_low * slo,
            ttft_slo_s=slo,
            own_from_s=None if self.adaptive else self.queue_share * slo,
        )

    @staticmethod
    def retry_after_s(signals: BudgetSignals) -> float:
        """Whole seconds until what is queued now has been prefilled, at the measured throughput (1-60)."""
        rate = signals.prefill_tokens_per_s
        if rate is None:  # nothing measured yet: a rough 50 ms per full step
            wait = signals.queued_tokens / max(1, signals.token_budget) * 0.05
        else:
            wait = signals.queued_tokens / rate
        return float(max(1, min(60, math.ceil(wait))))


class Ticket:
    """One admitted request's place in the queue counts; ``release`` (idempotent) gives it back."""

    __slots__ = ("_owner", "tokens")

    def __init__(self, owner: Admission | None, tokens: int) -> None:
        self._owner = owner
        self.tokens = tokens

    def release(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            owner._release(self.tokens)


class Admission:
    """Decides admission; thread-safe, and never waits for the engine (the server asks on its event loop)."""

    def __init__(self, max_queued_requests: int | None = None, max_queued_tokens: int | None = None) -> None:
        self.max_queued_requests = max_queued_requests
        self.max_queued_tokens = max_queued_tokens
        self._lock = threading.Lock()
        self._state = AdmissionState()
        # prompt tokens per client admitted since ``state`` was published: a step can be long, and every
        # request let in meanwhile is queued ahead of the next one
        self._admitted_since: dict[str, int] = {}
        self.queued_requests = 0  # admitted, not yet scheduled or ended
        self.queued_tokens = 0
        self.num_rejected = 0

    @property
    def state(self) -> AdmissionState:
        return self._state

    @state.setter
    def state(self, state: AdmissionState) -> None:
        with self._lock:
            self._state = state
            self._admitted_since = {}

    def check(self, num_tokens: int = 0, client: str = "") -> None:
        """Raise EngineOverloaded if a request of ``client``'s with ``num_tokens`` prompt tokens would be
        refused now (ask with 0 before any work is spent on a request: media, preprocessing)."""
        with self._lock:
            self._check(num_tokens, client)

    def admit(self, num_tokens: int, client: str = "", ticket: Ticket | None = None) -> Ticket:
        """Check and count a request in one step (no other request gets in between). With the ``ticket`` the
        request got before its prompt was known (the server takes one before fetching any media, with 0
        tokens, so fetches cannot pile up uncounted), its prompt tokens are checked and added to it; on a
        refusal the ticket is left as it was (its holder releases it)."""
        with self._lock:
            counted = ticket is not None and ticket._owner is self
            self._check(num_tokens, client, counted=counted)
            if not counted:
                self.queued_requests += 1
                ticket = Ticket(self, 0)
            self.queued_tokens += num_tokens
            ticket.tokens += num_tokens
            self._admitted_since[client] = self._admitted_since.get(client, 0) + num_tokens
        return ticket

    def _check(self, num_tokens: int, client: str, counted: bool = False) -> None:
        state = self.state
        requests, tokens = self.max_queued_requests, self.max_queued_tokens
        reason = state.reason if state.overloaded else None
        rate, slo = state.prefill_tokens_per_s, state.ttft_slo_s
        if reason is None and slo is not None and rate and state.expected_wait_s is not None:
            ahead = state.expected_wait_s + sum(self._admitted_since.values()) / rate
            own = num_tokens / rate if state.own_from_s is not None and ahead > state.own_from_s else 0.0
            if ahead + own > slo:
                reason = queue_ahead_reason(ahead, slo, own)
        if reason is not None and state.admit_within_s is not None:
            wait = state.fair_wait_s(client, num_tokens, self._admitted_since)
            if wait is not None and wait <= state.admit_within_s:
                reason = None  # the queue is other clients' work: fair sharing serves this one in time
        if reason is None and requests is not None and self.queued_requests - counted >= requests:
            reason = f"{self.queued_requests} requests are already queued"
        if reason is None and tokens is not None and self.queued_tokens + num_tokens > tokens:
            reason = "the queue of prompt tokens is full"
        if reason is not None:
            self.num_rejected += 1
            raise EngineOverloaded(f"overloaded: {reason}; retry shortly", retry_after_s=state.retry_after_s)

    def _release(self, tokens: int) -> None:
        with self._lock:
            self.queued_requests -= 1
            self.queued_tokens -= tokens
