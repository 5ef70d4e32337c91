"""The visual budget controller on synthetic signals: pressure → level, hysteresis, dwell, recovery; the
admission policy's saturation beside it, as LoadControl feeds both; and the signals' own sources (TTFT
window, prefill throughput)."""

from __future__ import annotations

import pytest

from lm_engine.admission import AdmissionPolicy
from lm_engine.visual_budget import (
    BudgetSignals,
    PrefillRate,
    TTFTWindow,
    VisualBudgetController,
    default_ladder,
)

LADDER = [1_000_000, 500_000, 250_000, 3136]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def controller(clock: Clock, **kw) -> VisualBudgetController:
    return VisualBudgetController(
        ladder=LADDER, ttft_slo_s=1.0, dwell_s=1.0, drain_steps=4, clock=clock, **kw
    )


def policy(sheds: bool = True, adaptive: bool = True) -> AdmissionPolicy:
    """Saturation's hysteresis: refused past the 1 s SLO, until the wait falls under 0.75 s."""
    return AdmissionPolicy(ttft_slo_s=1.0, sheds=sheds, adaptive=adaptive)


def step(c: VisualBudgetController, p: AdmissionPolicy, s: BudgetSignals) -> int:
    """One LoadControl update: the policy observes, the controller counts its saturation as pressure."""
    return c.update(s, saturated=p.observe(s))


def sig(queued=0, kv=0.0, ttft=None, budget=100, rate=None, busy=True) -> BudgetSignals:
    """``rate``: measured prefill tokens/s (None: not measured yet); ``busy``: the engine has work at all."""
    return BudgetSignals(
        queued_tokens=queued,
        token_budget=budget,
        kv_usage=kv,
        recent_ttft_s=ttft,
        prefill_tokens_per_s=rate,
        busy=busy,
    )


def run(
    c: VisualBudgetController,
    clock: Clock,
    s: BudgetSignals,
    seconds: float,
    dt: float = 0.1,
    p: AdmissionPolicy | None = None,
) -> list[int]:
    levels = []
    for _ in range(round(seconds / dt)):
        clock.t += dt
        levels.append(step(c, p, s) if p is not None else c.update(s))
    return levels


def test_each_signal_maps_to_pressure():
    c = controller(Clock())
    assert c.compute_pressure(sig(queued=400)) == pytest.approx(1.0)  # 4 steps × 100 tokens
    assert c.compute_pressure(sig(kv=0.45)) == pytest.approx(0.5)
    assert c.compute_pressure(sig(queued=1, ttft=3.0)) == pytest.approx(3.0)
    assert c.compute_pressure(sig(queued=0, ttft=3.0)) == 0.0  # a stale TTFT with nothing queued
    assert c.compute_pressure(sig(queued=40, kv=0.09, ttft=0.2)) == pytest.approx(0.2)


def test_sustained_pressure_steps_down_once_per_dwell_to_the_floor():
    clock = Clock()
    c = controller(clock)
    levels = run(c, clock, sig(queued=1000), 5.0)
    assert levels[0] == 0
    first_drop = levels.index(1)
    assert 1.0 <= (first_drop + 1) * 0.1 <= 1.25  # one dwell (+ a tick) of sustained pressure first
    assert levels.index(2) - first_drop == pytest.approx(10, abs=1)  # then one level per dwell
    assert levels[-1] == c.lowest
    assert c.max_pixels() == LADDER[-1]


def test_hysteresis_band_holds_the_level():
    clock = Clock()
    c = controller(clock)
    run(c, clock, sig(queued=1000), 1.5)
    assert c.level == 1
    # Pressure 0.75 sits between low (0.5) and high (1.0): nothing moves, however long.
    assert set(run(c, clock, sig(queued=300), 10.0)) == {1}


def test_short_spikes_do_not_oscillate():
    clock = Clock()
    c = controller(clock)
    for _ in range(10):  # 0.5 s over, 0.5 s under: never a full dwell either way
        run(c, clock, sig(queued=1000), 0.5)
        run(c, clock, sig(queued=0), 0.5)
    assert c.level == 0 and not c.history


def test_shedding_counts_as_pressure_while_the_queue_it_keeps_short_reads_low():
    """Admission control refuses work while the queue takes longer than the SLO, so the queue falls back into
    the band right after: a sawtooth that never spends a whole dwell above ``high``. The spells of saturation
    count as pressure for a dwell after each, so the ladder steps down under it; once they stop, the band
    holds the level again."""
    clock = Clock()
    c, p = controller(clock), policy()  # SLO 1 s, dwell 1 s, queueing may take half the SLO
    over, band = sig(queued=150, rate=100.0), sig(queued=40, rate=100.0)  # waits of 1.5 s and 0.4 s
    assert c.compute_pressure(band) == pytest.approx(0.8)  # between low and high
    for _ in range(6):  # 0.3 s saturated, 0.4 s in the band
        run(c, clock, over, 0.3, p=p)
        assert p.saturated
        run(c, clock, band, 0.4, p=p)
        assert not p.saturated
    assert c.level >= 2
    settled = run(c, clock, band, 6.0, p=p)
    assert len(set(settled[15:])) == 1  # a dwell after the last refusal spell, nothing moves


def test_queue_pressure_is_the_expected_wait_against_the_slo():
    c = controller(Clock())  # SLO 1 s, of which queueing may take half
    assert c.compute_pressure(sig(queued=200, rate=100.0)) == pytest.approx(4.0)  # 2 s of queue
    assert c.compute_pressure(sig(queued=200, rate=10_000.0)) == pytest.approx(0.04)  # drains in 20 ms
    assert sig(queued=200, rate=100.0).expected_wait_s == pytest.approx(2.0)
    # Before any throughput is measured: tokens against what drain_steps steps take.
    assert c.compute_pressure(sig(queued=200)) == pytest.approx(0.5)
    assert sig(queued=200).expected_wait_s is None


def test_slow_queue_steps_down_before_any_ttft_is_seen():
    clock = Clock()
    c = controller(clock)
    # 200 tokens are half of what 4 steps of 100 take (no pressure by tokens), and no TTFT came back yet,
    # but at 50 tokens/s they are 4 s of waiting against a 1 s SLO.
    levels = run(c, clock, sig(queued=200, rate=50.0), 2.5)
    assert levels[-1] == 2 and sig(queued=200, rate=50.0).expected_wait_s == pytest.approx(4.0)
    # The same queue drained at 5000 tokens/s is no reason to lower anything.
    fast = controller(clock)
    assert set(run(fast, clock, sig(queued=200, rate=5000.0), 5.0)) == {0}


def test_long_steps_under_load_do_not_reset_the_level():
    clock = Clock()
    c = controller(clock)
    run(c, clock, sig(queued=1000, rate=100.0), 4.0)
    assert c.level == c.lowest
    # Engine steps of 3 s (three dwells each) with work still queued: no update comes for 3 s, yet that is
    # not idle time. Read mid-step (as the API does for a new image) and at each update, the level holds.
    for _ in range(5):
        clock.t += 1.5
        assert c.level_for("auto") == c.lowest
        clock.t += 1.5
        assert c.update(sig(queued=1000, rate=100.0)) == c.lowest
    # When the queue empties (decodes still running, so not idle), long steps climb one level per update
    # once the first has seen the low pressure, never straight back to full resolution.
    levels = []
    for _ in range(c.lowest + 1):
        clock.t += 3.0
        levels.append(c.update(sig(queued=0, rate=100.0)))
    assert levels == list(range(c.lowest, -1, -1))


def test_recovery_after_the_burst_and_after_idle():
    clock = Clock()
    c = controller(clock)
    run(c, clock, sig(queued=1000), 4.0)
    assert c.level == c.lowest
    levels = run(c, clock, sig(queued=0), 4.0)
    assert levels[-1] == 0 and sorted(levels, reverse=True) == levels  # monotone climb back
    # Once the engine reports no work it stops updating; each whole dwell of that quiet spell counts as a
    # dwell below `low`, both for readers in between and for the next update.
    run(c, clock, sig(queued=1000), 4.0)
    assert c.update(sig(busy=False)) == c.lowest
    clock.t += 1.5
    assert c.level_for("auto") == c.lowest - 1
    clock.t += 30.0
    assert c.level_for("auto") == 0 and c.max_pixels() == LADDER[0]
    assert c.update(sig(queued=50)) == 0 and c.level == 0


def test_prefill_rate_weighs_steps_by_their_length():
    r = PrefillRate(horizon_s=1e9)  # no forgetting: plain ratios of sums
    assert r.tokens_per_s is None
    r.observe(100, 1.0)
    assert r.tokens_per_s == pytest.approx(100.0)
    r.observe(0, 1.0)  # a step that waited on the encoder: time, no tokens
    assert r.tokens_per_s == pytest.approx(50.0)
    r.observe(300, 0.01)  # a tiny step moves a ratio of sums far less than it would a mean of ratios
    assert r.tokens_per_s == pytest.approx(400 / 2.01)
    # The past fades with time, not with the number of steps: many short encoder waits (1 s in all) cost
    # about as much as one long one.
    many, one = PrefillRate(horizon_s=5.0), PrefillRate(horizon_s=5.0)
    for r in (many, one):
        r.observe(5000, 5.0)
    for _ in range(20):
        many.observe(0, 0.05)
    one.observe(0, 1.0)
    assert many.tokens_per_s == pytest.approx(one.tokens_per_s, rel=0.02)
    assert 0.6 * 1000 < many.tokens_per_s < 0.9 * 1000
    waiting = PrefillRate()
    for _ in range(20):
        waiting.observe(0, 1.0)
    assert waiting.tokens_per_s is None  # no token yet: not measured, rather than an infinite wait


def test_detail_semantics_and_fixed_mode():
    clock = Clock()
    c = controller(clock)
    run(c, clock, sig(queued=1000), 2.5)
    assert c.level == 2
    assert c.max_pixels("auto") == LADDER[2] and c.max_pixels(None) == LADDER[2]
    assert c.max_pixels("low") == LADDER[-1] and c.max_pixels("high") == LADDER[0]
    fixed = controller(Clock(), enabled=False)
    run(fixed, clock, sig(queued=1000), 5.0)
    assert (
        fixed.level == 0 and fixed.max_pixels("auto") == LADDER[0] and fixed.max_pixels("low") == LADDER[-1]
    )


def test_fixed_mode_pins_the_level_of_auto_images():
    """``fixed_level`` is what detail=auto gets while the controller is off, whatever the load says; ``high``
    and ``low`` keep their meaning; a level off the ladder is refused."""
    clock = Clock()
    pinned = controller(clock, enabled=False, fixed_level=1)
    for load in (sig(queued=0), sig(queued=100_000, kv=1.0, ttft=9.0)):
        run(pinned, clock, load, 3.0)
        assert pinned.max_pixels("auto") == pinned.max_pixels(None) == LADDER[1]
        assert pinned.level_for("auto") == 1
        assert pinned.max_pixels("high") == LADDER[0] and pinned.max_pixels("low") == LADDER[-1]
    for bad in (-1, len(LADDER)):
        with pytest.raises(ValueError, match="fixed_level"):
            controller(Clock(), enabled=False, fixed_level=bad)


def test_engine_config_takes_a_visual_level_only_under_a_fixed_budget():
    from lm_engine.config import EngineConfig

    assert EngineConfig("m", visual_budget="fixed", visual_level=2).visual_level == 2
    with pytest.raises(ValueError, match="visual_level"):
        EngineConfig("m", visual_budget="adaptive", visual_level=1)
    with pytest.raises(ValueError, match="visual_level"):
        EngineConfig("m", visual_budget="fixed", visual_level=-1)


def test_saturated_while_the_queue_ahead_takes_longer_than_the_slo():
    clock = Clock()
    c, p = controller(clock), policy()  # SLO 1 s; saturation ends once the wait is under 0.75 s
    slow = sig(queued=500, rate=100.0)  # 5 s of queue
    levels = run(c, clock, slow, 4.0, p=p)
    assert levels[-1] == c.lowest
    assert p.saturated and slow.expected_wait_s == pytest.approx(5.0)
    # Hysteresis: 0.9 s is within the SLO but above the exit threshold: keep refusing.
    assert p.observe(sig(queued=90, rate=100.0))
    assert not p.observe(sig(queued=70, rate=100.0))
    assert not p.observe(sig(queued=90, rate=100.0))  # and back in only above the SLO
    assert p.observe(sig(queued=150, rate=100.0))
    assert not p.observe(sig(busy=False))  # an idle engine refuses nothing
    # No measured throughput, no saturation (tokens alone say nothing about time).
    c2, p2 = controller(clock), policy()
    run(c2, clock, sig(queued=10_000), 6.0, p=p2)
    assert c2.level == c2.lowest and not p2.saturated


def test_only_a_shedding_policy_refuses_and_a_fixed_budget_counts_the_own_prompt():
    slow, by_client = sig(queued=500, rate=100.0), {"a": 300, "b": 200}
    shedding = policy()
    shedding.observe(slow)
    state = shedding.publish(slow, by_client)
    assert state.overloaded and "5.0 s of queued work" in state.reason and state.expected_wait_s == 5.0
    assert state.retry_after_s == 5.0 and dict(state.queued_by_client) == by_client
    assert state.admit_within_s == pytest.approx(0.75) and state.ttft_slo_s == 1.0
    assert (
        state.own_from_s is None
    )  # the adaptive budget reads the queue: a request's own prompt never counts
    fixed = policy(adaptive=False)
    fixed.observe(slow)
    assert fixed.publish(slow, by_client).own_from_s == pytest.approx(0.5)  # past half the SLO of queue
    # Saturation is still seen where nothing is refused (the visual budget counts it as pressure).
    never = policy(sheds=False)
    assert never.observe(slow)
    state = never.publish(slow, None)
    assert not state.overloaded and state.reason is None and state.ttft_slo_s is None
    assert state.expected_wait_s == 5.0
    # Before any rate is measured, the retry hint is a rough 50 ms per full step (at least 1 s).
    assert AdmissionPolicy.retry_after_s(sig(queued=10_000)) == 5.0
    assert AdmissionPolicy.retry_after_s(sig(queued=10)) == 1.0


def test_saturation_does_not_wait_for_the_floor():
    # A queue that already takes longer than the SLO is refused at once, at any level: no budget for the
    # new request's images shortens the work ahead of it. The level steps down meanwhile, one dwell at a
    # time, so what is admitted later costs less.
    clock = Clock()
    c, p = controller(clock), policy()  # SLO 1 s, dwell 1 s
    clock.t += 0.1
    step(c, p, sig(queued=500, rate=100.0))  # 5 s of queue
    assert c.level == 0 and p.saturated
    seen = []
    for _ in range(40):
        clock.t += 0.1
        step(c, p, sig(queued=500, rate=100.0))
        seen.append((c.level, p.saturated))
    assert all(sat for _, sat in seen)
    assert [level for level, _ in seen] == sorted(level for level, _ in seen)  # stepping down only
    assert seen[-1] == (c.lowest, True)
    # Over the queue's share of the SLO but within the SLO itself (0.8 s): lowering the level is the
    # answer, not refusing work.
    c2, p2 = controller(clock), policy()
    levels = run(c2, clock, sig(queued=80, rate=100.0), 4.0, p=p2)
    assert levels[-1] == c2.lowest and not p2.saturated


def test_ladder_and_ttft_window():
    assert default_ladder(1_003_520, 3136) == [1_003_520, 501_760, 250_880, 3136]
    assert default_ladder(6272, 3136) == [6272, 3136]
    with pytest.raises(ValueError):
        VisualBudgetController(ladder=[100, 200], ttft_slo_s=1.0)
    clock = Clock()
    w = TTFTWindow(window_s=5.0, clock=clock)
    assert w.percentile() is None
    for i in range(10):
        w.add(float(i))
    assert w.percentile(0.9) == 9.0
    clock.t = 6.0
    assert w.percentile() is None
