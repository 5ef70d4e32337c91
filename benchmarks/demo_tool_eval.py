"""A demo checkpoint's tool calls through ``vlmserve serve`` and the ``openai`` client: held-out pictures, a tool
offered, ``tool_choice: "required"`` (the grammar writes the call's frame; the model chooses the values), and a
call is right when its arguments equal what the picture shows.

    .venv/bin/python benchmarks/demo_tool_eval.py                   # the embedded demo checkpoint
    .venv/bin/python benchmarks/demo_tool_eval.py --model DIR --per-group 150

Three groups of ``--per-group`` requests on pictures of ``--seed`` 50000 (a seed nothing else draws from),
built by ``tools/demo_tool_calls.py``'s ``eval_cases``: ``readme``, the README's ``describe_shape`` tool
(its pydantic ``Shape`` schema) on single shapes asked "Describe the image."; ``seen``, functions named, worded
and laid out as train-demo's tool phase makes them (one picture kind in three each: single shapes, several
shapes, numbers; a second function that does not fit the picture 30 % of the time; one of the questions or a
free phrasing); ``unseen``, the same with function and property names, descriptions and phrasings training
never shows. Reported per group and per what the function reads (colour, shape, both, count, number), beside
the plain questions' accuracy on the same kinds of picture (``benchmarks/demo_eval.py``): a tool call of a
count is right about as often as the count is. Results go to ``benchmarks/results/demo_tool_eval/``.
"""

from __future__ import annotations

if not __package__:  # run by path: the repository root onto sys.path, once (benchmarks/_path.py)
    import _path  # noqa: F401

import argparse
import base64
import contextlib
import json
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

from benchmarks.harness import (
    OUT_DIR,
    RESULTS_DIR,
    ServerProcess,
    bulk_dir,
    free_port,
    machine,
    results_header,
    vlmserve_here_argv,
)
from benchmarks.quality_vs_budget import resolve_model
from tools import demo_tasks as tasks
from tools import demo_tool_calls as demo_tools

GROUPS = {"readme": None, "seen": demo_tools.TRAINING, "unseen": demo_tools.UNSEEN}


def ask(client, model: str, case: demo_tools.ToolCase, tool_choice: str) -> dict:
    url = f"data:{tasks.mime(case.example)};base64," + base64.b64encode(case.example.data).decode()
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": case.question},
            ],
        }
    ]
    resp = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=case.tools,
        tool_choice=tool_choice,
        temperature=0,
        max_tokens=96,
    )
    msg = resp.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]
    right = False
    if len(calls) == 1 and calls[0][0] == case.name:
        with contextlib.suppress(ValueError):
            right = json.loads(calls[0][1]) == case.arguments
    return {
        "question": case.question,
        "want": {"name": case.name, "arguments": case.arguments},
        "calls": calls,
        "content": msg.content,
        "right": right,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint directory (default: what `vlmserve serve` loads)")
    p.add_argument("--seed", type=int, default=50_000)
    p.add_argument("--per-group", type=int, default=150)
    p.add_argument("--tool-choice", choices=("required", "auto"), default="required")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--vlmserve-arg", action="append", default=[], help="extra `vlmserve serve` argument")
    args = p.parse_args()

    from openai import OpenAI

    path, label = resolve_model(args.model)
    cases = {g: demo_tools.eval_cases(args.seed, args.per_group, names) for g, names in GROUPS.items()}
    port = free_port()
    argv = vlmserve_here_argv(path, port, ["--max-model-len", "2048", *args.vlmserve_arg])
    t0 = time.perf_counter()
    results: dict[str, list[dict]] = {}
    with ServerProcess("vlmserve", argv, port, OUT_DIR / "demo_tool_eval" / "server.log") as srv:
        srv.start()
        client = OpenAI(base_url=srv.base_url + "/v1", api_key="unused", timeout=300)
        model = client.models.list().data[0].id
        for group, group_cases in cases.items():
            with ThreadPoolExecutor(args.concurrency) as pool:
                results[group] = list(
                    pool.map(lambda c: ask(client, model, c, args.tool_choice), group_cases)
                )
    print(
        f"checkpoint: {label}; seed {args.seed}, {args.per_group} per group, tool_choice {args.tool_choice}, "
        f"temperature 0 [{time.perf_counter() - t0:.0f} s]"
    )
    summary = {}
    for group, recs in results.items():
        by: dict[str, list[bool]] = defaultdict(list)
        for case, rec in zip(cases[group], recs):
            by[case.reads].append(rec["right"])
        right = sum(r["right"] for r in recs)
        summary[group] = {
            "accuracy": right / len(recs),
            "by_reading": {k: sum(v) / len(v) for k, v in sorted(by.items())},
            "n": len(recs),
        }
        cells = " ".join(f"{k} {sum(v)}/{len(v)}" for k, v in sorted(by.items()))
        print(f"  {group}: {right}/{len(recs)} = {100 * right / len(recs):.1f} % ({cells})")
    out = RESULTS_DIR / "demo_tool_eval"
    out.mkdir(parents=True, exist_ok=True)
    body = {**results_header("benchmarks/demo_tool_eval.py", args, path, machine()), "summary": summary}
    (out / "results.json").write_text(json.dumps(body, indent=1) + "\n")
    bulk = bulk_dir(out)
    bulk.mkdir(parents=True, exist_ok=True)
    (bulk / "records.json").write_text(json.dumps(results) + "\n")
    print(f"wrote {out}/results.json, {bulk}/records.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
