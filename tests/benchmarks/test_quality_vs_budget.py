"""benchmarks/quality_vs_budget.py's own logic, without a server: how each ladder level is reached, the task set
as a load.py trace, and the scoring of replies under overload (against hand-counted answers)."""

from __future__ import annotations

import argparse
import base64
import json

import pytest

from benchmarks import load
from benchmarks.quality_vs_budget import (
    DEFAULT_MAX_TOKENS,
    check_max_tokens,
    how_to_reach,
    resolve_model,
    score,
    task_trace,
)
from tools import demo_tasks


def test_without_model_it_measures_what_serve_loads_without_one(tmp_path, monkeypatch):
    import api.cli
    from tools import demo

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(demo, "demo_checkpoint", lambda: tmp_path)
    assert api.cli.default_checkpoint() == str(tmp_path)  # what `vlmserve serve` resolves
    assert resolve_model(None)[0] == tmp_path


def test_each_level_is_reached_as_a_client_reaches_it():
    ladder = [100352, 50176, 25088, 3136]
    assert [how_to_reach(k, ladder) for k in range(4)] == [(0, "high"), (1, "auto"), (2, "auto"), (0, "low")]
    assert how_to_reach(0, [3136]) == (0, "high")  # a one-level ladder: the full budget only


def test_a_max_tokens_that_would_cut_an_answer_short_is_refused():
    """At 8 tokens, "the number NNNN" (9 tokens in the demo tokenizer) came back cut to three digits and was
    scored wrong; the default must hold every answer of the set."""
    model = resolve_model(None)[0]
    ex = next(e for i in range(100) if len((e := demo_tasks.sample(0, i, "number")).qa["number"]) == 4)
    with pytest.raises(SystemExit, match="takes 9 tokens"):
        check_max_tokens(model, [(ex, "describe")], 8)
    check_max_tokens(model, [(ex, "describe")], 9)
    check_max_tokens(model, demo_tasks.eval_set(7, 12), DEFAULT_MAX_TOKENS)


def test_the_trace_carries_each_image_and_its_exact_question():
    items = demo_tasks.eval_set(7, 2)
    trace, store = task_trace(items, 8, seed=3)
    assert len(trace.requests) == len(items)
    assert trace.requests[0].t_unit == 0 and all(
        a.t_unit < b.t_unit for a, b in zip(trace.requests, trace.requests[1:])
    )
    target = load.Target("http://127.0.0.1:1/v1", "demo")
    for i, (ex, task) in enumerate(items):
        body = json.loads(load.build_body(trace.requests[i], store, target))
        image, text = body["messages"][0]["content"]
        head, b64 = image["image_url"]["url"].split(",", 1)
        assert head == f"data:{demo_tasks.mime(ex)};base64" and base64.b64decode(b64) == ex.data
        assert "detail" not in image["image_url"]  # auto: the controller's level
        assert text == {"type": "text", "text": demo_tasks.QUESTIONS[task]}
        assert body["max_tokens"] == 8 and body["temperature"] == 0


def _rec(index: int, text: str, ttft_s: float, level: int, status: int = 200) -> load.RequestRecord:
    r = load.RequestRecord(index, start_s=0.0, status=status, e2e_s=ttft_s + 0.1, text=text)
    if status != 200:
        r.fail("http", "overloaded")
        return r
    r.chunk_times_s = [ttft_s, ttft_s + 0.1]
    r.usage = {"completion_tokens": 2, "visual_levels": [level]}
    return r


def test_score_counts_correct_answers_within_the_slos():
    items = demo_tasks.eval_set(7, 1)  # color, shape, count, number, describe
    answers = [ex.qa[task] for ex, task in items]
    records = [
        _rec(0, f"  {answers[0].upper()}\n", 0.5, 0),  # right (case, spaces), in time
        _rec(1, answers[1], 5.0, 1),  # right, TTFT over the SLO
        _rec(2, answers[2] + "0", 0.5, 1),  # wrong, in time
        _rec(3, answers[3], 0.5, 0, status=503),  # shed
    ]
    args = argparse.Namespace(slo_ttft_ms=2000.0, slo_tpot_ms=500.0)
    q = score(records, items, args)
    assert (q["answered"], q["correct"], q["within_slo"], q["correct_within_slo"]) == (3, 2, 2, 1)
    assert q["accuracy_answered"] == 2 / 3
    assert q["accuracy_by_level"] == {"0": {"n": 1, "accuracy": 1.0}, "1": {"n": 2, "accuracy": 0.5}}
    assert q["accuracy_by_task"]["count"] == {"n": 1, "accuracy": 0.0}
