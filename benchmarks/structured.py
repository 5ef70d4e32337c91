"""Structured output's cost: the decode step with every row, half the rows or no row constrained by a JSON
schema, against the unconstrained step, at batch 1 and 16; grammar compile time over the test schema set; and
llguidance against xgrammar on the same tokenizer (compile time, per-token mask time).

Steps are timed in one process on one engine (the generated ``small`` preset by default: 8,192-token
vocabulary), configurations interleaved round by round so drift hits them alike; each configuration's figures
are the lower quartile and the median of all its steps (a shared machine only ever adds time to a step).
Constrained rows follow a schema that needs far more than ``--tokens`` tokens (an array of ≥ 64 objects with
enums, bounded integers and short strings), so every measured step masks them. Also reported, timed directly:
the mask work per step (on the worker thread, beside the forward pass) and what constraining costs the engine
thread (waiting for the masks after the forward pass, applying them, advancing the matchers).

    .venv/bin/python benchmarks/structured.py                  # small preset, batch 1 and 16, ~5 min
    .venv/bin/python benchmarks/structured.py --model DIR      # any checkpoint
"""

from __future__ import annotations

if not __package__:  # run by path: the repository root onto sys.path, once (benchmarks/_path.py)
    import _path  # noqa: F401

import argparse
import json
import os
import random
import statistics
import threading
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch

from benchmarks.engine_throughput import machine_line
from benchmarks.harness import ensure_checkpoint, time_each
from lm_engine import structured
from lm_engine.config import EngineConfig
from lm_engine.engine import LLMEngine
from lm_engine.sampling_params import SamplingParams
from lm_engine.structured import Grammars, json_schema_grammar
from tests.structured_schemas import COLORS, SCHEMAS, SHAPES

OUT_DIR = Path(__file__).resolve().parent / "results" / "structured"
LONG = {
    "type": "array",
    "minItems": 64,
    "items": {
        "type": "object",
        "properties": {
            "shape": {"enum": SHAPES},
            "color": {"enum": COLORS},
            "count": {"type": "integer", "minimum": 1, "maximum": 99},
            "label": {"type": "string", "maxLength": 6},
        },
        "required": ["shape", "color", "count", "label"],
        "additionalProperties": False,
    },
}
WORDS = "the old lighthouse stands by a grey sea where boats come home at night and gulls cry".split()


class MaskClock:
    """Sums, per step, the mask work on the worker thread (beside the forward pass) and what constraining costs
    the engine thread itself: the wait for the masks, applying them and advancing the matchers."""

    def __init__(self) -> None:
        self.work = self.engine_thread = self.wait = 0.0
        fill, apply, advance = structured._fill, structured.MaskJob.apply, structured.GrammarState.advance

        def timed_fill(*a):
            t = time.perf_counter()
            fill(*a)
            self.work += time.perf_counter() - t
            if threading.current_thread() is threading.main_thread():  # masks computed inline: serial work
                self.engine_thread += time.perf_counter() - t

        def timed_apply(job, *a):
            t = time.perf_counter()
            job._done.result()
            self.wait += time.perf_counter() - t
            out = apply(job, *a)
            self.engine_thread += time.perf_counter() - t
            return out

        def timed_advance(state, token):
            t = time.perf_counter()
            out = advance(state, token)
            self.engine_thread += time.perf_counter() - t
            return out

        structured._fill = timed_fill
        structured.MaskJob.apply = timed_apply
        structured.GrammarState.advance = timed_advance

    def reset(self) -> None:
        self.work = self.engine_thread = self.wait = 0.0


def decode_steps(engine: LLMEngine, batch: int, constrained: int, tokens: int, seed: int, clock: MaskClock):
    """Decode steps of ``batch`` text requests (``constrained`` of them under LONG): each step's wall seconds,
    and per step the mask work (worker thread), constraining's time on the engine thread, and the part of it
    spent waiting for masks."""
    grammar = json_schema_grammar(LONG)
    rng = random.Random(seed)
    ids = []
    for i in range(batch):
        prompt = [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(12))}]
        params = SamplingParams(temperature=0.0, max_tokens=tokens + 4, ignore_eos=i >= constrained)
        if i < constrained:
            params.grammar = grammar
        rid = f"b{batch}-c{constrained}-s{seed}-{i}"
        engine.add_request(rid, prompt, params)
        ids.append(rid)
    while any(not s.output_token_ids for st in engine.requests.values() for s in st.seqs):
        engine.step()  # the prefills and each row's first token
    engine.step()
    clock.reset()
    steps = time_each(engine.step, tokens)
    for rid in ids:
        engine.abort(rid)
    return steps, clock.work / tokens, clock.engine_thread / tokens, clock.wait / tokens


def compile_times(engine: LLMEngine) -> list[float]:
    """Seconds to compile each schema of the set on a fresh cache (validation, matcher, first mask)."""
    eos = sorted(engine.outputs.eos_ids)
    grammars = Grammars(engine.processor.tokenizer, engine.model_config.vocab_size, eos)
    _ = grammars.tokenizer  # built once per engine, not per grammar
    masks = structured.GrammarMasks(grammars.width)
    out = []
    for schema in SCHEMAS.values():
        t0 = time.perf_counter()
        grammar = grammars.compile(json_schema_grammar(schema))
        job = masks.start([structured.GrammarState(grammar.matcher())])
        job._done.result()
        out.append(time.perf_counter() - t0)
    masks.close()
    return out


def library_comparison(engine: LLMEngine, steps: int = 48) -> dict:
    """llguidance and xgrammar on this model's tokenizer: compile and per-token mask time over the schema set,
    each walking a random path of allowed tokens."""
    import llguidance
    import llguidance.torch as lt

    tok = engine.processor.tokenizer
    width = engine.model_config.vocab_size
    eos = sorted(engine.outputs.eos_ids)
    opts = structured.JSON_OPTIONS
    res: dict = {"llguidance": {"version": version("llguidance")}}
    lltok = llguidance.LLTokenizer(tok.to_str(), n_vocab=width, eos_token=eos)
    shifts = torch.arange(32, dtype=torch.int32)

    def allowed(bm: torch.Tensor) -> list[int]:
        return ((bm[0].unsqueeze(-1) >> shifts) & 1).flatten()[:width].nonzero().flatten().tolist()

    compile_s, mask_s = [], []
    for schema in SCHEMAS.values():
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(
            lltok,
            llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=opts),
            log_level=0,
        )
        bm = lt.allocate_token_bitmask(1, width)
        lt.fill_next_token_bitmask(m, bm)
        compile_s.append(time.perf_counter() - t0)
        rng = random.Random(0)
        for _ in range(steps):
            t0 = time.perf_counter()
            lt.fill_next_token_bitmask(m, bm)
            mask_s.append(time.perf_counter() - t0)
            t = rng.choice(allowed(bm))
            if t in eos or not m.consume_token(t) or m.is_stopped():
                break
    res["llguidance"].update(compile_s=compile_s, mask_s=mask_s)
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return res
    info = xgr.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_object=tok), vocab_size=width, stop_token_ids=eos
    )
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    compile_s, mask_s, failed = [], [], []
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        try:
            compiled = compiler.compile_json_schema(
                json.dumps(schema), any_whitespace=False, separators=(", ", ": ")
            )
        except Exception:
            failed.append(name)
            continue
        m = xgr.GrammarMatcher(compiled)
        bm = xgr.allocate_token_bitmask(1, width)
        m.fill_next_token_bitmask(bm)
        compile_s.append(time.perf_counter() - t0)
        rng = random.Random(0)
        for _ in range(steps):
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bm)
            mask_s.append(time.perf_counter() - t0)
            t = rng.choice(allowed(bm))
            if t in eos or not m.accept_token(t) or m.is_terminated():
                break
    res["xgrammar"] = {
        "version": version("xgrammar"),
        "compile_s": compile_s,
        "mask_s": mask_s,
        "failed": failed,
    }
    return res


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", type=Path, default=None, help="checkpoint (default: the generated small preset)"
    )
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--tokens", type=int, default=12, help="decode steps timed per configuration and round")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    model = ensure_checkpoint("small", 0, args.model)
    engine = LLMEngine(
        EngineConfig(model=str(model), num_kv_blocks=1024, max_num_seqs=32, max_model_len=1024)
    )
    clock = MaskClock()
    print(f"machine: {machine_line()}")
    print(
        f"model: {model} (vocab {engine.model_config.vocab_size}, {engine.dtype}), torch {torch.__version__}"
    )
    batches = [int(b) for b in args.batch_sizes.split(",")]
    # "all" twice: masks computed beside the forward pass on a worker thread, and inline on the engine's thread;
    # "half" in the mode the engine picks for this machine.
    default = engine.masks
    modes = {
        "overlapped": structured.GrammarMasks(default.width, overlap=True),
        "inline": structured.GrammarMasks(default.width, overlap=False),
    }
    print(f"engine's choice here: {'overlapped' if default.overlap else 'inline'} "
          f"({torch.get_num_threads()} torch threads on {os.cpu_count()} CPUs)")  # fmt: skip
    configs = [
        (b, name, c, mode)
        for b in batches
        for name, c, mode in (
            ("free", 0, None),
            ("all, overlapped", b, "overlapped"),
            ("all, inline", b, "inline"),
            ("half", b // 2, None),
            ("none", 0, None),
        )
    ]
    decode_steps(engine, max(batches), max(batches), 4, 99, clock)  # warm: first grammar, first masks
    times: dict[tuple[int, str], list] = {}
    for r in range(args.rounds):
        # NOTE: the order rotates each round: whichever runs first after a batch size changes pays for it.
        for b, name, c, mode in configs[r % len(configs) :] + configs[: r % len(configs)]:
            if name == "half" and c == 0:
                continue
            engine.masks = modes[mode] if mode else default
            times.setdefault((b, name), []).append(decode_steps(engine, b, c, args.tokens, r, clock))
    engine.masks = default
    rows = []
    # NOTE: the lower quartile of every step of a configuration: on a shared machine other processes only ever
    # add time, so the least disturbed steps say what a step costs; the median is printed beside it.
    print(f"\n{'batch':>5} {'constrained':>15} {'p25 ms/step':>11} {'vs free':>8} {'median ms':>9} {'vs free':>8} "
          f"{'mask work ms':>12} {'engine thread ms':>16} {'of free p25':>11} {'of it waiting':>13}")  # fmt: skip
    for b in batches:
        free = [t for run in times[(b, "free")] for t in run[0]]
        free_p25, free_med = pct(free, 25), statistics.median(free)
        for name in ("free", "all, overlapped", "all, inline", "half", "none"):
            if (b, name) not in times:
                continue
            runs = times[(b, name)]
            steps = [t for run in runs for t in run[0]]
            p25, med = pct(steps, 25), statistics.median(steps)
            work, thread, wait = (statistics.median(run[k] for run in runs) for k in (1, 2, 3))
            rows.append({"batch": b, "rows": name, "p25_s": p25, "median_s": med, "p25_vs_free": p25 / free_p25 - 1,
                         "median_vs_free": med / free_med - 1, "mask_work_s": work, "engine_thread_s": thread,
                         "engine_thread_vs_free_p25": thread / free_p25, "mask_wait_s": wait})  # fmt: skip
            print(f"{b:>5} {name:>15} {p25 * 1e3:>11.2f} {p25 / free_p25 - 1:>+8.1%} {med * 1e3:>9.2f} "
                  f"{med / free_med - 1:>+8.1%} {work * 1e3:>12.3f} {thread * 1e3:>16.3f} {thread / free_p25:>11.1%} "
                  f"{wait * 1e3:>13.3f}")  # fmt: skip
    comp = compile_times(engine)
    print(f"\ngrammar compile over {len(comp)} schemas (matcher + first mask): "
          f"p50 {pct(comp, 50) * 1e3:.2f} ms, p99 {pct(comp, 99) * 1e3:.2f} ms, max {max(comp) * 1e3:.2f} ms")  # fmt: skip
    libs = library_comparison(engine)
    print("\nlibrary       version   compile p50/p99 ms   mask per token p50/mean/p99 µs   schemas")
    for lib, r in libs.items():
        c, m = r["compile_s"], r["mask_s"]
        note = f"{len(c)}/{len(SCHEMAS)}" + (
            f" (failed: {', '.join(r['failed'])})" if r.get("failed") else ""
        )
        print(f"{lib:<13} {r['version']:<9} {pct(c, 50) * 1e3:>7.2f} / {pct(c, 99) * 1e3:<8.2f}   "
              f"{pct(m, 50) * 1e6:>8.1f} / {statistics.mean(m) * 1e6:.1f} / {pct(m, 99) * 1e6:<8.1f}      {note}")  # fmt: skip
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    out = OUT_DIR / f"structured-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(
        json.dumps(
            {
                "machine": machine_line(),
                "model": str(model),
                "steps": rows,
                "compile_s": comp,
                "libraries": libs,
            },
            indent=1,
        )
    )
    print(f"\nwrote {out}")
    engine.close()


if __name__ == "__main__":
    main()
