"""A demo checkpoint's accuracy on quality_vs_budget's evaluation set, offline: a minute, not a server run.

    .venv/bin/python benchmarks/demo_eval.py                       # the embedded demo checkpoint, every level
    .venv/bin/python benchmarks/demo_eval.py --model DIR --levels 0 --tasks count,number

The same images and questions as ``quality_vs_budget.py`` (``--seed`` 20000, ``--per-task`` 200), the same
ladder (``default_ladder`` of the checkpoint's preprocessor config), scored the way ``train-demo`` scores its
held-out set: transformers' Qwen2-VL loaded from the directory, the prompt and pixels made by train-demo's
``Encoder`` (the server's preprocessing), exact match by teacher forcing, which equals greedy exact match
(every answer token and the end of turn the argmax). Under bfloat16 autocast where train-demo would use it.
It is a development loop for the training recipe, not the issue's figure: that stays quality_vs_budget's,
through the server. The two agree: on 2026-12-03 the shipped checkpoint at full budget read color 1.0, shape
1.0, count 0.68 and number 0.635 here (`--levels 0`, 35 s), as through the server (count: the same hits and
misses per true count); describe read 0.755 here against the server's 67.0 %, which was quality_vs_budget's own fault (its
max_tokens of 8 cut every "the number NNNN" short; it now refuses a max_tokens an answer does not fit in).

Besides the table it prints what the notes on the recipe use: counts by true count and the direction of the
errors, and by visual tokens (the same images are counted better at lower budgets), numbers by length, and
numbers by the digits' height in the pixels the tower sees (after the resize to the level's budget): whether a
miss is a number too small to read at that budget or one the model misreads.
"""

from __future__ import annotations

if not __package__:  # run by path: the repository root onto sys.path, once (benchmarks/_path.py)
    import _path  # noqa: F401

import argparse
import sys
import time
from collections import Counter, defaultdict

import torch

from benchmarks.quality_vs_budget import level_name, model_ladder, resolve_model
from preprocess.grid import smart_resize
from tools import demo_tasks as tasks
from tools import demo_train

GLYPH_BINS = (12, 16, 24, 40)  # px: the bins' edges
BIN_NAMES = ("<12", "12-16", "16-24", "24-40", ">=40")
COUNT_TOKENS = 64  # counts are split at this many visual tokens: more tokens, more misses (2026-12-04)


def seen_glyph_height(ex: tasks.Example, min_pixels: int, max_pixels: int) -> float:
    """The number's ink height (px) in the image the tower sees: its digits' boxes, scaled as the
    preprocessing resizes the image at ``max_pixels``."""
    width, height = ex.size
    seen_height, _ = smart_resize(height, width, min_pixels=min_pixels, max_pixels=max_pixels)
    ys = [y for _, box in ex.outlines for _, y in box]
    return (max(ys) - min(ys)) * seen_height / height


def replies(model, enc, cfg, exs, task: str, max_pixels: int) -> list[tuple[bool, str, int]]:
    """Per example, in order, asked ``task``: (exact match, the reply's first token as text, visual tokens).
    Teacher forced, as train-demo's ``forward``; the first answer token's argmax is the greedy reply's first
    token."""
    out = []
    with torch.no_grad(), cfg.autocast():
        for start in range(0, len(exs), 8):
            chunk = exs[start : start + 8]
            batch = demo_train.make_batch(enc, chunk, [max_pixels] * len(chunk), task_filter=task)
            feats, _, _ = demo_train.encode_images(model, batch)
            logits, where = demo_train.answer_logits(model, batch, feats)
            guesses = logits.argmax(-1).split(where.sum(dim=1).tolist())
            targets = batch["labels"][where].split(where.sum(dim=1).tolist())
            for guess, target, rows in zip(guesses, targets, feats):
                out.append((bool((guess == target).all()), enc.tok.decode([int(guess[0])]), rows.shape[0]))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint directory (default: what `vlmserve serve` loads)")
    p.add_argument("--seed", type=int, default=20000)
    p.add_argument("--per-task", type=int, default=200)
    p.add_argument("--levels", default="all", help="ladder levels, e.g. 0 or 0,3 (default: all)")
    p.add_argument("--tasks", default=",".join(tasks.TASKS), help="comma-separated (default: all five)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    from transformers import Qwen2VLForConditionalGeneration

    torch.set_num_threads(args.threads)
    path, label = resolve_model(args.model)
    ladder = model_ladder(path)
    levels = range(len(ladder)) if args.levels == "all" else [int(x) for x in args.levels.split(",")]
    wanted = args.tasks.split(",")
    unknown = set(wanted) - set(tasks.TASKS)
    if unknown:
        raise SystemExit(f"--tasks: unknown {sorted(unknown)}; known: {', '.join(tasks.TASKS)}")
    by_task: dict[str, list[tasks.Example]] = defaultdict(list)
    for ex, task in tasks.eval_set(args.seed, args.per_task):
        if task in wanted:
            by_task[task].append(ex)
    model = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    enc, cfg = demo_train.Encoder(path), demo_train.TrainConfig()
    print(f"checkpoint: {label}; seed {args.seed}, {args.per_task} per task; bfloat16 autocast: {cfg.bf16()}")
    for level in levels:
        t0 = time.perf_counter()
        got = {task: replies(model, enc, cfg, exs, task, ladder[level]) for task, exs in by_task.items()}
        tokens = [n for rows in got.values() for _, _, n in rows]
        cells = " ".join(f"{t} {sum(ok for ok, _, _ in rows) / len(rows):.3f}" for t, rows in got.items())
        print(
            f"L{level} ({level_name(level, ladder)}, {sum(tokens) / len(tokens):.1f} visual tokens): {cells} "
            f"[{time.perf_counter() - t0:.0f} s]"
        )
        if "count" in got:
            table: dict[str, Counter] = defaultdict(Counter)
            by_tokens: dict[tuple[int, bool], list[bool]] = defaultdict(list)
            for ex, (ok, reply, rows) in zip(by_task["count"], got["count"]):
                n, r = int(ex.qa["count"]), reply.strip()
                table[str(n)]["ok" if ok else "over" if r.isdigit() and int(r) > n else "under/other"] += 1
                by_tokens[n, rows > COUNT_TOKENS].append(ok)
            print("  count by true count:", {k: dict(v) for k, v in sorted(table.items())})
            print(
                f"  count by true count and visual tokens (<= / > {COUNT_TOKENS}):",
                {
                    f"{n} {'>' if many else '<='}": f"{sum(v)}/{len(v)}"
                    for (n, many), v in sorted(by_tokens.items())
                },
            )
        if "number" in got:
            lengths: dict[int, list[bool]] = defaultdict(list)
            glyphs: dict[tuple[int, int], list[bool]] = defaultdict(list)
            for ex, (ok, _, _) in zip(by_task["number"], got["number"]):
                px = seen_glyph_height(ex, enc.pre.min_pixels, ladder[level])
                lengths[len(ex.qa["number"])].append(ok)
                glyphs[len(ex.qa["number"]), sum(px >= edge for edge in GLYPH_BINS)].append(ok)
            print("  number by length:", {k: f"{sum(v)}/{len(v)}" for k, v in sorted(lengths.items())})
            print(
                "  number by digits and seen glyph height (px):",
                {f"{n}: {BIN_NAMES[b]}": f"{sum(v)}/{len(v)}" for (n, b), v in sorted(glyphs.items())},
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
