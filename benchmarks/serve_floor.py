"""How fast serve_compare's trace can go on this machine at all: the same requests through the offline engine.

    .venv/bin/python benchmarks/serve_floor.py        # reads benchmarks/results/serve_compare/ (~8 min)

Runs the trace of the latest ``serve_compare.py`` run (rebuilt from the spec in its ``results.json``, same images, same prompts,
full-resolution visual budget as ``--visual-budget fixed``) through ``LLM.chat`` in one process, all
requests at once, twice:

- ``max_tokens 1``: every image encoded and every prompt prefilled, no decoding: the work no serving
  strategy can skip, so ``64 / wall`` bounds any server's request throughput on this machine;
- ``max_tokens`` of the trace (128, ``ignore_eos``): the offline engine's own throughput, the most a
  server built on it could reach with no HTTP, streaming, media decoding or arrival gaps.

Each is divided by the request throughput ``transformers serve`` reached in the same results.json: the
largest ratio vlmserve could show against it on this machine. Writes ``floor.json`` beside the results.
"""

from __future__ import annotations

if not __package__:  # run by path: the repository root onto sys.path, once (benchmarks/_path.py)
    import _path  # noqa: F401

import argparse
import base64
import json
import sys
import time
from pathlib import Path

from benchmarks import load

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks/results/serve_compare")
    parser.add_argument("--model", type=Path, default=ROOT / "benchmarks/out/small-seed0")
    args = parser.parse_args()

    results = json.loads((args.results / "results.json").read_text())
    hf = results["runs"].get("transformers serve")
    hf_rps = hf["summary"]["request_throughput"] if hf else None
    vl_rps = results["runs"]["vlmserve"]["summary"]["request_throughput"]
    trace = load.make_trace(load.TraceSpec(**results["trace"]["spec"]))
    if trace.digest() != results["trace"]["digest"]:
        print(
            "serve_floor: the trace rebuilt from results.json's spec differs from its digest", file=sys.stderr
        )
        return 1
    images = load.ImageStore(trace, ROOT / "benchmarks/out/load-images")
    images.prepare()
    if images.mismatched:
        print(f"serve_floor: images {images.mismatched} differ from the trace's digests", file=sys.stderr)
        return 1
    convs = []
    for req in trace.requests:
        parts = [{"type": "image_url", "image_url": {"url": images.urls[i].decode()}} for i in req.images]
        convs.append([{"role": "user", "content": [*parts, {"type": "text", "text": req.prompt}]}])
    max_tokens = max(r.max_tokens for r in trace.requests)
    # The warm-up's image is not in the trace: the embedding cache starts cold for every trace image.
    warm = base64.b64encode(load.synth_image(224, 224, "png", seed=987654)).decode()
    warmup = [
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{warm}"}},
                    {"type": "text", "text": "hi"},
                ],
            }
        ]
    ]

    from lm_engine import LLM, SamplingParams

    rows = []
    for tokens in (1, max_tokens):
        llm = LLM(model=str(args.model), max_num_batched_tokens=2048, visual_budget="fixed")
        llm.chat(warmup, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        t0 = time.perf_counter()
        outs = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
        wall = time.perf_counter() - t0
        assert all(len(o.token_ids) == tokens for o in outs)
        rps = len(convs) / wall
        prompt_mean = sum(len(o.prompt_token_ids) for o in outs) / len(outs)
        rows.append(
            {"max_tokens": tokens, "wall_s": wall, "req_per_s": rps, "prompt_tokens_mean": prompt_mean}
        )
        print(
            f"max_tokens {tokens:4}: {wall:7.1f} s, {rps:.3f} req/s, prompt tokens mean {prompt_mean:.0f}",
            flush=True,
        )
        if hasattr(llm.engine, "close"):
            llm.engine.close()
        del llm

    print(
        f"\nserve_compare's run: vlmserve {vl_rps:.3f} req/s, transformers serve {hf_rps or float('nan'):.3f}"
    )
    for row in rows:
        row["bound_vs_transformers"] = row["req_per_s"] / hf_rps if hf_rps else None
        what = "encode + prefill only" if row["max_tokens"] == 1 else "offline engine, full decode"
        print(
            f"  {what:28} {row['req_per_s']:.3f} req/s = {row['bound_vs_transformers']:.2f}x transformers serve"
        )
    (args.results / "floor.json").write_text(
        json.dumps({"results_created": results["created"], "rows": rows}, indent=1) + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
