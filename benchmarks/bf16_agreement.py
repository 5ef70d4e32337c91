"""bfloat16 agreement with transformers: first greedy tokens on long prompts, and the equivalence scenarios.

Both sides load the same checkpoint in the dtype under test (forced, so this runs on any CPU; on one without
AVX512-BF16/AMX bfloat16 is emulated and slow). Rows of the long-prompt table:

- the engine in bf16 against transformers bf16 (what ``dtype=auto`` runs where bf16 is fast);
- the engine in float32 against transformers float32 (the equivalence tests' setting);
- transformers bf16 against transformers float32 (the noise floor: what bf16 itself costs);
- the engine in bf16 with its rotary frequencies rounded to bf16 (issue 12's bug, re-created by rounding
  ``inv_freq`` in place) against transformers bf16.

Then the equivalence scenarios (``tests.support.mixed_requests``: text, one and two images, chunked prefill
through image spans) generate ``--max-new`` greedy tokens in bf16 on both sides; the agreement rate is the
share of requests whose tokens are identical, with the mean length of the matching prefix.

    .venv/bin/python benchmarks/bf16_agreement.py                  # tiny preset, ~1 min
    .venv/bin/python benchmarks/bf16_agreement.py --model DIR      # any Qwen2-VL checkpoint directory
"""

from __future__ import annotations

if not __package__:  # run by path: the repository root onto sys.path, once (benchmarks/_path.py)
    import _path  # noqa: F401

import argparse
import json
import platform
import random
import tempfile
import time
from pathlib import Path

import torch

from lm_engine import LLM, SamplingParams
from tests.support import HFOracle, mixed_requests, user

WORDS = "lighthouse keeper sea storm night ship harbor wave light rock the a and of to".split()
TARGET_TOKENS = (335, 600, 900, 1200, 1500, 1800, 2100, 2400, 2700, 3026)
RESULTS = Path(__file__).parent / "results" / "bf16_agreement"


def long_prompts(oracle: HFOracle) -> tuple[list[list[dict]], list[torch.Tensor]]:
    """Text prompts near each target length (in the checkpoint's own tokens) and their input ids."""
    rng = random.Random(0)
    convs, ids = [], []
    for target in TARGET_TOKENS:
        words = [rng.choice(WORDS) for _ in range(target // 2)]
        while True:
            conv = user(" ".join(words))
            input_ids = oracle.inputs(conv)["input_ids"]
            if input_ids.shape[1] >= target:
                break
            words += [rng.choice(WORDS) for _ in range(max(8, (target - input_ids.shape[1]) // 2))]
        convs.append(conv)
        ids.append(input_ids)
    return convs, ids


@torch.no_grad()
def hf_first_tokens(oracle: HFOracle, ids: list[torch.Tensor]) -> list[int]:
    return [int(oracle.model(input_ids=i.to(oracle.model.device)).logits[0, -1].argmax()) for i in ids]


def engine_first_tokens(
    model: str, dtype: str, convs: list[list[dict]], device: str, round_rotary: bool = False
) -> list[int]:
    with LLM(model, dtype=dtype, device=device, max_model_len=4096, enable_prefix_caching=False) as llm:
        rotary = llm.engine.runner.model.rotary
        if round_rotary:
            rotary.inv_freq.copy_(rotary.inv_freq.to(torch.bfloat16).float())
        outs = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=1))
    return [o.token_ids[0] for o in outs]


def agreement(a: list[int], b: list[int], lengths: list[int]) -> tuple[str, str]:
    both = sum(x == y for x, y in zip(a, b))
    long = [(x, y) for x, y, n in zip(a, b, lengths) if n >= 1500]
    return f"{both}/{len(a)}", f"{sum(x == y for x, y in long)}/{len(long)}"


def scenarios(model: str, oracle: HFOracle, max_new: int, device: str) -> dict:
    """The equivalence scenarios in bf16, both sides greedy."""
    convs = mixed_requests()
    with LLM(
        model, dtype="bfloat16", device=device, max_num_batched_tokens=96, enable_prefix_caching=True
    ) as llm:
        ours = [o.token_ids for o in llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=max_new))]
    ref = [oracle.generate(c, max_new) for c in convs]
    prefix = []
    for a, b in zip(ours, ref):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefix.append(n)
    return {
        "requests": len(convs),
        "identical": sum(a == b for a, b in zip(ours, ref)),
        "mean_matching_prefix": sum(prefix) / len(prefix),
        "max_new_tokens": max_new,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the generated tiny preset)")
    ap.add_argument("--max-new", type=int, default=20)
    ap.add_argument("--device", default="cpu", help="where both sides run (cpu, cuda)")
    args = ap.parse_args()
    run(args.model, args.max_new, args.device)


def run(model: str | None, max_new: int, device: str) -> dict:
    """The whole comparison; prints the table and returns the record (also written to results.json)."""
    if model is None:
        from tools.qwen2_vl_make import make_checkpoint

        model = str(make_checkpoint(Path(tempfile.mkdtemp()) / "tiny", preset="tiny", seed=0))
    t0 = time.perf_counter()
    f32 = HFOracle(Path(model), torch.float32, device)
    convs, ids = long_prompts(f32)
    lengths = [i.shape[1] for i in ids]
    hf32 = hf_first_tokens(f32, ids)
    b16 = HFOracle(Path(model), torch.bfloat16, device)
    hf16 = hf_first_tokens(b16, ids)
    rows = {
        "engine bf16 vs transformers bf16": agreement(
            engine_first_tokens(model, "bfloat16", convs, device), hf16, lengths
        ),
        "engine float32 vs transformers float32": agreement(
            engine_first_tokens(model, "float32", convs, device), hf32, lengths
        ),
        "transformers bf16 vs transformers float32 (noise floor)": agreement(hf16, hf32, lengths),
        "engine bf16, rotary rounded to bf16 (the old bug) vs transformers bf16": agreement(
            engine_first_tokens(model, "bfloat16", convs, device, round_rotary=True), hf16, lengths
        ),
    }
    print(f"model {model}; prompt tokens {lengths}")
    print(f"{'':72s} {'all':>7s} {'>=1500':>7s}")
    for name, (all_, long) in rows.items():
        print(f"{name:72s} {all_:>7s} {long:>7s}")
    scen = scenarios(model, b16, max_new, device)
    print(
        f"equivalence scenarios in bf16: {scen['identical']}/{scen['requests']} requests identical to "
        f"transformers bf16 over {scen['max_new_tokens']} tokens; mean matching prefix "
        f"{scen['mean_matching_prefix']:.1f} tokens"
    )
    out = RESULTS if device == "cpu" else RESULTS.with_name(f"bf16_agreement_{device.split(':')[0]}")
    out.mkdir(parents=True, exist_ok=True)
    flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    record = {
        "model": model,
        "device": device,
        "prompt_tokens": lengths,
        "first_token_agreement": {k: {"all": a, ">=1500": b} for k, (a, b) in rows.items()},
        "scenarios_bf16": scen,
        "cpu": platform.processor() or platform.machine(),
        "bf16_flags": [f for f in ("avx512_bf16", "amx_bf16", "amx_tile") if f" {f}" in flags],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    (out / "results.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out / 'results.json'} ({record['seconds']} s)")
    return record


if __name__ == "__main__":
    main()
