"""The engine under load: a burst lowers the visual budget and it recovers; shedding; fairness.

Time here is the engine's injected clock, advanced by each model step: the dwell, the measured prefill rate
and every TTFT are in those virtual seconds, so no verdict depends on how fast the machine runs the steps.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from types import MappingProxyType

import pytest

from lm_engine import EngineConfig, EngineOverloaded, LLMEngine, SamplingParams
from lm_engine.admission import Admission, AdmissionState, Ticket
from lm_engine.sequence import SequenceStatus
from tests.lm_engine.pacing import VirtualClock, encoded_first, paced
from tests.support import image_part, make_image, user

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
DWELL_S = 0.15
STEP_S = 0.05  # virtual seconds a model step takes in the burst test: a third of the dwell


def adaptive_engine(tiny_ckpt, clock: VirtualClock | None = None, **kw) -> LLMEngine:
    cfg = dict(
        model=str(tiny_ckpt),
        max_num_batched_tokens=64,
        visual_budget="adaptive",
        budget_dwell_s=DWELL_S,
        ttft_slo_ms=300.0,
    )
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), clock=clock or time.monotonic)


def drain(engine: LLMEngine, outputs: dict) -> None:
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out


def test_burst_lowers_level_and_it_returns_to_full(tiny_ckpt):
    # A ladder whose every level changes a 448×448 image's grid.
    clock = VirtualClock()
    engine = adaptive_engine(tiny_ckpt, clock, visual_ladder=(448 * 448, 224 * 448, 224 * 224, 56 * 56))
    paced(engine, clock, STEP_S)
    encoded_first(engine)
    images = [make_image(448, 448, s) for s in range(40)]
    outputs: dict = {}
    # A burst: new requests keep arriving faster than 64 tokens/step can prefill them.
    shed = 0
    for i, img in enumerate(images):
        try:
            engine.add_request(f"b{i}", engine.process_chat(user(image_part(img), "what?")), PARAMS)
        except EngineOverloaded:
            shed += 1  # admission control may refuse at the bottom of the ladder; that is allowed
        for _ in range(2):
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out
    drain(engine, outputs)
    served = sorted(outputs, key=lambda r: int(r[1:]))
    assert len(served) + shed == len(images) and len(served) > len(images) // 2
    levels = [outputs[r].visual_levels[0] for r in served]
    assert levels[0] == 0 and max(levels) > 0, levels
    tokens = [outputs[r].visual_tokens[0] for r in served]
    assert min(tokens) < tokens[0]  # lowered levels really mean fewer visual tokens
    # After the burst the level climbs back: a quiet spell, then a request gets full resolution.
    clock.advance(4 * DWELL_S * (engine.load.visual_budget.lowest + 1))
    engine.add_request("after", engine.process_chat(user(image_part(images[0]), "what?")), PARAMS)
    drain(engine, outputs)
    assert outputs["after"].visual_levels == [0]
    assert engine.load.visual_budget.level == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.close()


@dataclass
class SlowBurst:
    """A burst run on steps longer than the dwell, with the TTFT SLO set from the step time."""

    step_s: float
    slo_s: float
    # Per step: (the level a new image would get right after it, prefill tokens still queued, the worst TTFT
    # seen so far (None before any), the admission state published).
    trace: list[tuple] = field(default_factory=list)
    refused: tuple | None = None  # (EngineOverloaded, time of refusal) for a request tried while overloaded
    drained_at: float | None = None  # when the queue of prefill work first emptied
    outputs: dict = field(default_factory=dict)
    level_after_idle: int | None = None
    polite_ttft_s: float | None = None  # run_slow_burst(polite=True): another client's request, sent then


BURST = 10  # requests of ~180 tokens: 7 steps of 256, below the 8 the token-based pressure treats as a limit
SLOW_STEP_S = 0.2  # virtual seconds per step: four dwells


@pytest.fixture(scope="module")
def slow_burst(tiny_ckpt) -> SlowBurst:
    return run_slow_burst(tiny_ckpt)


def run_slow_burst(tiny_ckpt, polite: bool = False, **config) -> SlowBurst:
    """The burst, all from one client (``""``); ``polite``: when the first refusal comes, another client
    (``"polite"``) sends a short request too."""
    # Two levels, so the first step down reaches the floor; a 50 ms dwell, far shorter than a step.
    clock = VirtualClock()
    engine = adaptive_engine(
        tiny_ckpt,
        clock,
        max_num_batched_tokens=256,
        visual_ladder=(448 * 448, 56 * 56),
        budget_dwell_s=0.05,
        ttft_slo_ms=1e6,
        **config,
    )
    paced(engine, clock, SLOW_STEP_S)
    for i in range(3):  # prompts like the burst's, 2 full steps of them: the prefill rate is measured
        engine.add_request(f"warm{i}", user(f"warm up {i} " + "word " * 140), PARAMS)
    drain(engine, {})
    assert engine.load.prefill_rate.tokens_per_s is not None
    # The requests finishing in the 2nd step see 2 steps of TTFT, those in the 3rd see 3: an SLO between.
    run = SlowBurst(step_s=SLOW_STEP_S, slo_s=2.5 * SLOW_STEP_S)
    engine.load.ttft_slo_s = run.slo_s
    assert engine.load.visual_budget.level_for("auto") == 0
    prompts = [engine.process_chat(user(f"question {i} " + "word " * 140)) for i in range(BURST)]
    assert sum(len(p.token_ids) for p in prompts) < 8 * 256
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, PARAMS)
    worst_ttft = None
    while engine.has_unfinished():
        for out in engine.step():
            m = out.metrics
            if m["first_token_time"] is not None:
                ttft = m["first_token_time"] - m["arrival_time"]
                if out.request_id == "polite":
                    run.polite_ttft_s = ttft
                else:
                    worst_ttft = max(worst_ttft or 0.0, ttft)
            if out.finished:
                run.outputs[out.request_id] = out
        queued = engine.load.queued_prefill_tokens()
        run.trace.append(
            (engine.load.visual_budget.level_for("auto"), queued, worst_ttft, engine.admission.state)
        )
        if queued == 0 and run.drained_at is None:
            run.drained_at = clock()
        if engine.admission.state.overloaded and run.refused is None:
            with pytest.raises(EngineOverloaded) as err:
                engine.add_request("late", user("one more"), PARAMS)
            run.refused = (err.value, clock())
            if polite:  # admitted: fair sharing serves it beside the burst
                engine.add_request("polite", user("one more"), PARAMS, client_key="polite")
    clock.advance(3 * 0.05)  # idle for whole dwells
    run.level_after_idle = engine.load.visual_budget.level_for("auto")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    engine.close()
    return run


def test_long_steps_under_load_keep_the_lowered_level(slow_burst):
    trace = slow_burst.trace
    first = next((i for i, (level, *_) in enumerate(trace) if level > 0), None)
    assert first is not None, trace
    # Each step lasts several dwells, yet while more than a step of prefill work waits none of that is idle
    # time (with less, the level may legitimately start climbing back).
    for level, queued, _, _ in trace[first:]:
        if queued > 256:
            assert level == 1, trace
    # After the burst: idle for whole dwells, and new images get full resolution again.
    assert trace[-1][1] == 0 and slow_burst.level_after_idle == 0


def test_level_drops_on_the_expected_wait_before_any_slow_ttft(slow_burst):
    trace = slow_burst.trace
    first = next(i for i, (level, *_) in enumerate(trace) if level > 0)
    worst_ttft_then = trace[first][2]
    assert worst_ttft_then is None or worst_ttft_then < slow_burst.slo_s, (slow_burst, trace)
    assert max(t for *_, t, _ in trace if t is not None) > slow_burst.slo_s  # the burst did miss the SLO


def test_saturation_refuses_new_work_fast_and_keeps_admitted_work(slow_burst):
    run = slow_burst
    states = [state for *_, state in run.trace]
    assert any(s.overloaded for s in states), run.trace
    for state in states:
        if state.overloaded:
            # Only while the queue ahead takes longer than the SLO (or, hysteresis, most of it), at any level.
            assert state.expected_wait_s >= 0.75 * run.slo_s
            assert state.reason and "queued work is ahead of a new request" in state.reason
        elif state.expected_wait_s is not None:
            assert state.expected_wait_s <= run.slo_s
    assert not states[-1].overloaded
    # Retry-After: whole seconds, about when the queue had drained.
    err, refused_at = run.refused
    assert err.retry_after_s >= 1 and err.retry_after_s == int(err.retry_after_s)
    assert abs(err.retry_after_s - (run.drained_at - refused_at)) <= 1 + 0.5 * err.retry_after_s
    # Nothing admitted was dropped.
    assert sorted(run.outputs) == sorted(f"r{i}" for i in range(BURST))
    assert all(o.outputs[0].finish_reason == "length" for o in run.outputs.values())


@pytest.mark.parametrize(
    "visual_budget, slo_admission, refuses",
    [("fixed", None, False), ("fixed", True, True), ("adaptive", False, False), ("adaptive", None, True)],
)
def test_admission_by_the_slo_follows_its_own_setting(tiny_ckpt, visual_budget, slo_admission, refuses):
    """``slo_admission``: None refuses over the SLO with an adaptive budget only (the fixed one is the plain
    baseline); True adds it to a fixed budget, False takes it from an adaptive one. Nothing admitted is lost."""
    run = run_slow_burst(tiny_ckpt, visual_budget=visual_budget, slo_admission=slo_admission)
    states = [state for *_, state in run.trace]
    assert any(s.overloaded for s in states) is refuses
    assert (run.refused is not None) is refuses
    if visual_budget == "fixed":
        assert all(level == 0 for level, *_ in run.trace)  # the ladder never moves
    else:
        assert any(level > 0 for level, *_ in run.trace)
    # A request's own prefill counts where no ladder reads the queue (load.py's NOTE): a fixed budget, half
    # the SLO of wait ahead on.
    published = [s.own_from_s for s in states if s.ttft_slo_s is not None]
    own = pytest.approx(0.5 * run.slo_s) if visual_budget == "fixed" else None
    assert published and all(o == own for o in published) if refuses else not published
    assert sorted(run.outputs) == sorted(f"r{i}" for i in range(BURST))


def test_another_client_is_admitted_and_served_in_time_while_one_client_overloads(tiny_ckpt):
    """The queue is one client's: a request of another client's waits only for its fair share of the steps,
    so admission control lets it in while it refuses the first client, and its TTFT is within the SLO."""
    run = run_slow_burst(tiny_ckpt, polite=True)
    assert run.refused is not None  # the burst's own client was refused ...
    assert run.polite_ttft_s is not None and run.polite_ttft_s <= run.slo_s  # ... the other admitted, in time
    assert sorted(run.outputs) == sorted(["polite", *(f"r{i}" for i in range(BURST))])
    assert max(t for *_, t, _ in run.trace if t is not None) > run.slo_s  # while the burst missed it


def test_a_client_with_little_of_the_queue_is_admitted_while_overloaded():
    queued = MappingProxyType({"hog": 5000, "other": 300})
    state = AdmissionState(True, 5.0, "5.3 s of queued work is ahead", 5.3, queued, 1000.0, 1.5)
    # max-min fair shares: a new client's 100 tokens are done once each other client got 100 more
    assert state.fair_wait_s("new", 100) == pytest.approx(0.3)
    assert state.fair_wait_s("other", 0) == pytest.approx(0.6)
    # the hog's next request waits behind all of its own work and as much of everyone else's
    assert state.fair_wait_s("hog", 100) == pytest.approx((5100 + 300) / 1000)
    admission = Admission()
    admission.state = state
    admission.check(0, "new")
    admission.admit(100, "new").release()
    admission.admit(0, "other").release()
    with pytest.raises(EngineOverloaded, match="ahead"):
        admission.check(0, "hog")
    with pytest.raises(EngineOverloaded):
        admission.admit(1400, "new")  # 1,400 + 1,400 of the hog's + 300: 3.1 s
    # Requests let in after the state was published count as queued until the next one is ("new"'s 100 tokens
    # above among them): a k-th new client of 100 tokens waits for 100 of the hog's, "other"'s, "new"'s and
    # each earlier one's, (400 + 100 k) ms, so 12 get in within 1.5 s, then none until the next publish.
    admitted, refused = [], 0
    for k in range(20):
        try:
            admitted.append(admission.admit(100, f"client{k}"))
        except EngineOverloaded:
            refused += 1
    assert (len(admitted), refused) == (12, 8)
    # a publish starts the count afresh (a step's state would hold those requests in queued_by_client)
    admission.state = state
    admission.admit(100, "client19").release()
    for ticket in admitted:
        ticket.release()
    # a state without what the exemption needs refuses everyone, as does one with no rate measured
    for bare in (AdmissionState(True, 5.0, "overloaded", 5.3), AdmissionState(True, 5.0, "o", None, queued)):
        admission.state = bare
        with pytest.raises(EngineOverloaded):
            admission.check(0, "new")
    assert (admission.queued_requests, admission.queued_tokens) == (0, 0)


def test_what_was_admitted_since_the_last_step_counts_before_the_next_one_says_so():
    """A step can be long: the requests let in during it are queued ahead of the next one, so admission
    control adds their prefill to the published queue's wait instead of waiting for the step to end."""
    state = AdmissionState(
        False, 2.0, None, 1.5, MappingProxyType({"": 1500}), 1000.0, admit_within_s=1.5, ttft_slo_s=2.0
    )
    admission = Admission()
    admission.state = state
    tickets = [admission.admit(300), admission.admit(300)]  # 1.5 s, then 1.8 s ahead of them: in
    with pytest.raises(EngineOverloaded, match="2.1 s of queued work is ahead"):
        admission.admit(300)
    tickets.append(admission.admit(300, "other"))  # another client: its fair share, 0.6 s
    admission.state = state  # the next step's state: what it counts is its own again
    tickets.append(admission.admit(300))
    # Past own_from_s of wait ahead, the request's own prefill counts as well; below, a big request is not
    # refused for its own size.
    one = MappingProxyType({"": 1200})
    admission.state = dataclasses.replace(state, expected_wait_s=1.2, own_from_s=1.0, queued_by_client=one)
    tickets.append(admission.admit(500))  # 1.2 + 0.5 s
    with pytest.raises(EngineOverloaded, match="1.7 s of queued work is ahead of a new request and its own"):
        admission.admit(500)  # 1.7 + 0.5 s
    tickets.append(admission.admit(200))  # 1.7 + 0.2 s
    one = MappingProxyType({"": 500})
    admission.state = dataclasses.replace(state, expected_wait_s=0.5, own_from_s=1.0, queued_by_client=one)
    tickets.append(admission.admit(5000))  # 0.5 s ahead, 5 s of its own
    # with admission by the SLO off (no ttft_slo_s), nothing is refused on the wait
    admission.state = AdmissionState(False, 2.0, None, 1.9, prefill_tokens_per_s=1000.0)
    tickets += [admission.admit(300) for _ in range(10)]
    for ticket in tickets:
        ticket.release()
    assert (admission.queued_requests, admission.queued_tokens) == (0, 0)


def test_detail_low_and_high_ignore_the_controller(tiny_ckpt):
    engine = adaptive_engine(tiny_ckpt)
    engine.load.visual_budget.level = 2
    img = make_image(1024, 1024, 1)  # above the full budget, so every level changes its grid
    conv = lambda detail: user({"type": "image", "image": img, "detail": detail}, "?")  # noqa: E731
    low, auto, high = (engine.process_chat(conv(d)) for d in ("low", "auto", "high"))
    ladder = engine.load.visual_budget.ladder
    assert [i.max_pixels for p in (low, auto, high) for i in p.images] == [ladder[-1], ladder[2], ladder[0]]
    assert low.images[0].length < auto.images[0].length < high.images[0].length
    with pytest.raises(ValueError):
        engine.process_chat(conv("ultra"))
    engine.close()


def test_saturated_engine_sheds_new_work_but_keeps_admitted(tiny_ckpt):
    engine = adaptive_engine(tiny_ckpt, max_queued_requests=6)
    for i in range(6):
        engine.add_request(f"q{i}", user(f"question {i} " * 5), PARAMS)
    with pytest.raises(EngineOverloaded) as err:
        engine.add_request("too-many", user("one more"), PARAMS)
    assert err.value.retry_after_s >= 1
    outputs: dict = {}
    drain(engine, outputs)
    assert sorted(outputs) == [f"q{i}" for i in range(6)]  # nothing admitted was dropped
    # Saturation (published by the controller's update): refuse, with the state's reason and Retry-After.
    engine.admission.state = AdmissionState(overloaded=True, retry_after_s=7.0, reason="test saturation")
    with pytest.raises(EngineOverloaded, match="test saturation") as err:
        engine.add_request("shed", user("hello"), PARAMS)
    assert err.value.retry_after_s == 7.0
    # The server decides on its event loop and hands its ticket over: the engine does not decide again.
    engine.add_request("admitted-anyway", user("hello"), PARAMS, ticket=Ticket(None, 0))
    drain(engine, outputs)
    assert "admitted-anyway" in outputs
    engine.close()


def test_one_client_with_huge_images_does_not_starve_another(tiny_ckpt):
    def steps_until_first_token(fair: bool) -> int:
        engine = LLMEngine(EngineConfig(model=str(tiny_ckpt), max_num_batched_tokens=64))
        big = [make_image(1024, 768, s) for s in range(4)]
        # The hog's images are in the embedding cache (encoded once before), its prompts are not.
        for i, img in enumerate(big):
            engine.add_request(f"warm{i}", user(image_part(img), "describe"), SamplingParams(max_tokens=1))
        drain(engine, {})
        engine.block_manager.reset_prefix_cache()
        for i, img in enumerate(big):
            engine.add_request(f"hog{i}", user(image_part(img), "describe"), PARAMS, client_key="hog")
        hogs = [s for st in engine.requests.values() for s in st.seqs]
        while not engine.scheduler.running or any(
            s.status is SequenceStatus.WAITING_FOR_IMAGES for s in hogs
        ):
            engine.step()  # until every hog is ready and its prefill (~4,000 tokens) is under way
        engine.add_request("small", user("hi"), PARAMS, client_key="polite" if fair else "hog")
        for step in range(1, 10_000):
            for out in engine.step():
                if out.request_id == "small" and out.token_ids:
                    engine.close()
                    return step
        raise AssertionError("never served")

    # ~4000 tokens of image prefill ahead of it: FIFO makes the small request wait for all of them.
    fair, unfair = steps_until_first_token(True), steps_until_first_token(False)
    assert fair <= 2 and unfair > 20, (fair, unfair)


def _prefill_per_step(engine: LLMEngine, steps: int) -> list[tuple[int, int]]:
    """(decode tokens, prefill tokens) of each of the next ``steps`` steps."""
    seen = []
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        dec = sum(1 for c in out.chunks if c.seq.num_output_tokens)  # streams: they have output already
        seen.append((dec, sum(c.num_tokens for c in out.chunks) - dec))
        return out

    engine.scheduler.schedule = spy
    try:
        for _ in range(steps):
            engine.step()
    finally:
        engine.scheduler.schedule = schedule
    return seen


def test_prefill_beside_decodes_fits_the_tpot_target(tiny_ckpt):
    """While a request streams, a step carries only the prefill the per-token target allows at the measured
    rate; with nothing decoding, prefill gets the whole token budget again."""
    engine = LLMEngine(
        EngineConfig(model=str(tiny_ckpt), max_num_batched_tokens=256, num_kv_blocks=128, tpot_slo_ms=100.0)
    )
    long_prompt = user(" ".join(f"word{i}" for i in range(400)))
    stream = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    engine.add_request("a", engine.process_chat(user("hi")), stream)
    while not engine.requests["a"].seqs[0].num_output_tokens:
        engine.step()
    engine.load.prefill_rate.observe(1000, 1.0)  # as if measured: 1000 prefill tokens/s
    engine.load.prefill_rate.observe = lambda tokens, seconds: None  # hold it there for the check
    engine.add_request("b", engine.process_chat(long_prompt), PARAMS)
    steps = _prefill_per_step(engine, 3)
    cap = int(1000 * 0.100 * 0.8)
    assert all(dec == 1 for dec, _ in steps), steps
    assert all(0 < pre <= cap for _, pre in steps), steps
    # Without a target the same situation fills the budget.
    engine.config.tpot_slo_ms = None
    ((dec, pre),) = _prefill_per_step(engine, 1)
    assert dec == 1 and pre > cap, (dec, pre)
    engine.abort("a")
    engine.config.tpot_slo_ms = 100.0
    ((dec, pre),) = _prefill_per_step(engine, 1)
    assert dec == 0 and pre > cap, (dec, pre)  # nobody streams: the whole budget
