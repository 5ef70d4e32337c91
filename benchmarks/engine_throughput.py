"""Engine throughput: our paged-KV engine against transformers ``generate()`` on the same requests.

A mix of image requests (224² … 1024×768, some with two images, some text-only, every image distinct,
prompts of varying length) on the generated ``small`` preset (stored in bf16; every mode computes in the
dtype the engine's ``auto`` resolves to, float32 on a CPU slow at bf16), each forced to emit exactly
``--output-tokens`` tokens, run in one process through:

- ``engine``: ``LLM.chat`` over all requests at once (continuous batching, chunked prefill);
- ``hf single``: transformers ``generate()`` one request at a time;
- ``hf batch B``: transformers ``generate()`` on left-padded batches of B, in arrival order and
  sorted by prompt length (the stronger baseline).

Every mode includes its own preprocessing (chat template, image resize/patchify). Visual token counts
come from the checkpoint's preprocessor config on both sides; prompt token ids are compared request by
request. Greedy agreement between the engine and ``hf single`` is printed, not asserted (in bf16 near-ties
flip legitimately).

    .venv/bin/python benchmarks/engine_throughput.py            # 64 requests × 64 tokens, minutes
    .venv/bin/python benchmarks/engine_throughput.py --quick    # 8 requests × 16 tokens, ~3 min
    .venv/bin/python benchmarks/engine_throughput.py --batch-sizes 8,16 --hf-orders sorted  # issue 2's run
    .venv/bin/python benchmarks/engine_throughput.py --family qwen3_vl --quick    # Qwen3-VL (deepstack)
"""

from __future__ import annotations

if not __package__:  # run by path: the repository root onto sys.path, once (benchmarks/_path.py)
    import _path  # noqa: F401

import argparse
import io
import json
import os
import platform
import resource
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from benchmarks.harness import ensure_checkpoint

# (images as (width, height)) per request, cycled; distinct pixels per request via the seed.
MIX: list[tuple[tuple[int, int], ...]] = [
    ((224, 224),),
    ((448, 336),),
    ((640, 480),),
    ((896, 672),),
    ((1024, 768),),
    ((224, 224), (640, 480)),
    (),
    ((448, 336), (896, 672)),
]
WORDS = (
    "describe the picture please what colour shape object left right top bottom corner count how many "
    "lines blocks gradient noise region texture pattern compare first second image page document table "
    "answer briefly detail summary list every visible item near far edge center background foreground"
).split()


# -- a shared machine ----------------------------------------------------------------------------------------
def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:9]]
    idle = vals[3] + vals[4]
    return sum(vals) - idle, sum(vals)


def _own_cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class Contention:
    """Share of the machine's CPU time that other processes took while a mode ran (0 = a fair run)."""

    def __enter__(self) -> Contention:
        self.jiffies, self.own, self.share = _cpu_jiffies(), _own_cpu_s(), 0.0
        return self

    def __exit__(self, *exc) -> None:
        busy0, total0 = self.jiffies
        busy1, total1 = _cpu_jiffies()
        hz = os.sysconf("SC_CLK_TCK")
        if total1 > total0:
            others = (busy1 - busy0) / hz - (_own_cpu_s() - self.own)
            self.share = max(0.0, others / ((total1 - total0) / hz))


def wait_idle(max_wait_s: float, busy_below: float = 0.10) -> None:
    """Timings on 2 cores are meaningless while another process computes: wait for a quiet machine."""
    start, hz = time.monotonic(), os.sysconf("SC_CLK_TCK")
    while True:
        (b0, t0), own0 = _cpu_jiffies(), _own_cpu_s()
        time.sleep(2.0)
        (b1, t1), own1 = _cpu_jiffies(), _own_cpu_s()
        busy = ((b1 - b0) / hz - (own1 - own0)) / max((t1 - t0) / hz, 1e-9)
        if busy < busy_below:
            return
        if time.monotonic() - start > max_wait_s:
            print(f"  WARNING: the machine is still {100 * busy:.0f}% busy; timing anyway", flush=True)
            return
        print(f"  waiting for an idle machine ({100 * busy:.0f}% busy) …", flush=True)


# -- requests ------------------------------------------------------------------------------------------------
def make_image(width: int, height: int, seed: int, fmt: str) -> bytes:
    """A structured random picture (gradient + noise), as tests/support.py draws them."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([(xx * (seed % 7 + 1)) % 256, (yy * (seed % 5 + 2)) % 256, ((xx + yy) * 3) % 256], -1)
    arr = ((base + rng.integers(0, 64, size=(height, width, 3))) % 256).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def make_requests(n: int, seed: int = 0) -> list[list[dict]]:
    """``n`` single-turn chats following MIX; prompts of 4–160 words, images alternately PNG and JPEG."""
    rng = np.random.default_rng(seed)
    convs = []
    for i in range(n):
        parts: list[dict] = []
        for j, (w, h) in enumerate(MIX[i % len(MIX)]):
            fmt = "PNG" if (i + j) % 2 else "JPEG"
            parts.append({"type": "image", "image": make_image(w, h, seed=1000 * seed + 10 * i + j, fmt=fmt)})
        words = rng.choice(WORDS, size=int(rng.integers(4, 161)))
        parts.append({"type": "text", "text": f"Request {i}: " + " ".join(words) + "?"})
        convs.append([{"role": "user", "content": parts}])
    return convs


# -- the modes -------------------------------------------------------------------------------------------------
@dataclass
class Result:
    name: str
    wall_s: float
    outputs: list[list[int]]
    prompt_ids: list[list[int]] = field(default_factory=list)
    notes: str = ""
    others: float = 0.0  # CPU share other processes took meanwhile
    timer: StageTimer | None = None


class StageTimer:
    """Wraps methods of live engine objects (no engine changes) and sums their wall time per label."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, obj, attr: str, label) -> None:
        fn = getattr(obj, attr)

        def timed(*args, **kwargs):
            name = label(*args, **kwargs) if callable(label) else label
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
                self.calls[name] += 1

        setattr(obj, attr, timed)


def _step_kind(sched, *_, **__) -> str:
    if all(c.num_tokens == 1 for c in sched.chunks):
        return "decoder forward, decode-only steps"
    return "decoder forward, steps with prefill chunks"


def run_engine(model: Path, convs, max_tokens: int, args, warmup) -> tuple[Result, str]:
    from lm_engine import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=str(model),
        dtype=args.dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=args.prefix_caching,
        attention_backend=args.attention_backend,
    )
    print(f"  engine attention backend: {llm.engine.runner.backend.name}", flush=True)
    llm.chat(warmup, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    print(f"  engine load + warm-up: {time.perf_counter() - t0:.1f} s", flush=True)

    eng = llm.engine
    timer = StageTimer()
    timer.wrap(eng.processor, "process_chat", "prompt processing (template, tokenize, probe)")
    timer.wrap(eng.runner, "execute", _step_kind)
    vision = getattr(eng, "vision", None)  # the encoder thread's pipeline, where the engine has one
    if vision is not None:
        timer.wrap(vision, "wait", "idle, waiting for image embeddings")
        vision_s0 = vision.stats.encode_seconds
    else:
        timer.wrap(eng.runner, "encode_images", "vision tower + merger")
    steps0 = eng.step_count
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    wait_idle(args.wait_idle)
    with Contention() as busy:
        t0 = time.perf_counter()
        outs = llm.chat(convs, params)
        wall = time.perf_counter() - t0
    timer.calls["steps"] = eng.step_count - steps0
    side = ""
    if vision is not None:
        st = vision.stats
        side = (
            f"encoder thread (overlaps the above): vision tower + merger {st.encode_seconds - vision_s0:.2f} s "
            f"in {st.batches} batches of {st.batch_images[-8:]} … images, "
            f"{st.cache_hits} embedding-cache hits"
        )
    cached = sum(o.num_cached_tokens for o in outs)
    res = Result(
        "engine",
        wall,
        [list(o.token_ids) for o in outs],
        [list(o.prompt_token_ids) for o in outs],
        notes=f"{timer.calls['steps']} steps, {cached} prompt tokens from the prefix cache",
        others=busy.share,
        timer=timer,
    )
    if hasattr(eng, "close"):
        eng.close()
    return res, side


class HFRunner:
    def __init__(self, model: Path, dtype: torch.dtype) -> None:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.processor = AutoProcessor.from_pretrained(str(model))
        self.model = AutoModelForImageTextToText.from_pretrained(str(model), dtype=dtype).eval()

    def inputs(self, convs: list[list[dict]]):
        texts, images = [], []
        for conv in convs:
            msgs = []
            for m in conv:
                parts = []
                for p in m["content"]:
                    if p["type"] == "image":
                        images.append(Image.open(io.BytesIO(p["image"])))
                        parts.append({"type": "image"})
                    else:
                        parts.append(p)
                msgs.append({"role": m["role"], "content": parts})
            texts.append(self.processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
        self.processor.tokenizer.padding_side = "left"
        return self.processor(text=texts, images=images or None, padding=True, return_tensors="pt")

    @torch.inference_mode()
    def generate(self, convs: list[list[dict]], max_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
        """Greedy, exactly ``max_tokens`` new tokens per row; returns (outputs, unpadded prompt ids)."""
        inputs = self.inputs(convs)
        out = self.model.generate(
            **inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False
        )
        width = inputs["input_ids"].shape[1]
        mask = inputs["attention_mask"].bool()
        prompts = [ids[m].tolist() for ids, m in zip(inputs["input_ids"], mask)]
        return [row[width:].tolist() for row in out], prompts

    def run(
        self, convs, max_tokens: int, batch_size: int, lengths: list[int] | None, wait_s: float
    ) -> Result:
        """Batches of ``batch_size`` (1 = one request at a time); with ``lengths``, grouped by prompt length."""
        order = list(range(len(convs)))
        if lengths is not None:
            order.sort(key=lambda i: lengths[i])
        outs: list[list[int]] = [[] for _ in convs]
        prompts: list[list[int]] = [[] for _ in convs]
        padded = real = 0
        timer = self._timed()
        wait_idle(wait_s)
        with Contention() as busy:
            t0 = time.perf_counter()
            for s in range(0, len(order), batch_size):
                idx = order[s : s + batch_size]
                o, p = self.generate([convs[i] for i in idx], max_tokens)
                for i, row, prompt in zip(idx, o, p):
                    outs[i], prompts[i] = row, prompt
                padded += len(idx) * max(map(len, p))
                real += sum(map(len, p))
            wall = time.perf_counter() - t0
        self._untimed()
        if batch_size == 1:
            return Result("hf single", wall, outs, prompts, others=busy.share, timer=timer)
        name = f"hf batch {batch_size}" + (", sorted" if lengths is not None else "")
        pad = f"padding {100 * (padded - real) / padded:.0f}% of prompt rows"
        return Result(name, wall, outs, prompts, notes=pad, others=busy.share, timer=timer)

    def _timed(self) -> StageTimer:
        """Time the stages of generate() by wrapping instance attributes (removed by ``_untimed``)."""
        timer = StageTimer()
        timer.wrap(self, "inputs", "preprocess (chat template, processor)")
        timer.wrap(self.model.model.visual, "forward", "vision tower + merger")

        def lm_kind(*args, **kwargs) -> str:
            x = kwargs.get("inputs_embeds")
            x = x if x is not None else kwargs.get("input_ids")
            return (
                "decoder forward, prefill"
                if x is not None and x.shape[1] > 1
                else "decoder forward, decode steps"
            )

        timer.wrap(self.model.model.language_model, "forward", lm_kind)
        return timer

    def _untimed(self) -> None:
        for obj, attr in ((self, "inputs"), (self.model.model.visual, "forward")):
            del obj.__dict__[attr]
        del self.model.model.language_model.__dict__["forward"]


# -- report ----------------------------------------------------------------------------------------------------
def machine_line() -> str:
    model, flags = platform.processor() or "?", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags]
    line = f"{model}, {os.cpu_count()} CPUs ({', '.join(isa) or 'no avx512/amx'})"
    emulated = os.environ.get("VLMSERVE_EMULATED_ISA")  # benchmarks/as_avx2.sh
    return f"{line}, running as {emulated}" if emulated else line


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, float]:
    """(requests with identical outputs, mean common prefix as a fraction of the output length)."""
    same, frac = 0, 0.0
    for x, y in zip(a, b):
        same += x == y
        k = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        frac += k / max(len(x), 1)
    return same, frac / max(len(a), 1)


def print_table(results: list[Result], n_requests: int, out_tokens: int) -> None:
    eng = results[0]
    print(f"{'mode':22} {'wall s':>8} {'req/s':>7} {'out tok/s':>10} {'engine ×':>9} {'others':>7}  notes")
    for r in results:
        print(
            f"{r.name:22} {r.wall_s:8.1f} {n_requests / r.wall_s:7.2f} {out_tokens / r.wall_s:10.1f} "
            f"{r.wall_s / eng.wall_s:9.2f} {100 * r.others:6.0f}%  {r.notes}"
        )
    if len(results) > 1:
        best = min(results[1:], key=lambda r: r.wall_s)
        ratio = best.wall_s / eng.wall_s
        verdict = "meets" if ratio >= 2 else "MISSES"
        print(f"engine / best transformers mode ({best.name}): {ratio:.2f}× ({verdict} the 2× target)")
    if any(r.others > 0.1 for r in results):
        print(
            "WARNING: other processes took >10% of the CPUs during some modes ('others'); rerun on a quiet machine"
        )


def print_agreement(results: list[Result]) -> None:
    """Greedy outputs, engine vs transformers one at a time; padded batches vs one at a time for scale."""
    single = next((r for r in results if r.name == "hf single"), None)
    if single is None:
        return
    n = len(single.outputs)
    print()
    for r in results:
        if r is not single:
            same, frac = agreement(r.outputs, single.outputs)
            print(
                f"greedy agreement, {r.name} vs hf single: {same}/{n} identical, common prefix {100 * frac:.0f}%"
            )


def print_split(r: Result, rest_label: str, side: str = "") -> None:
    print(f"{r.name} time split ({r.wall_s:.1f} s wall):")
    accounted = 0.0
    for label, sec in r.timer.seconds.items():
        accounted += sec
        print(f"  {label:50} {sec:7.2f} s {100 * sec / r.wall_s:5.1f}%  ({r.timer.calls[label]} calls)")
    rest = r.wall_s - accounted
    print(f"  {rest_label:50} {rest:7.2f} s {100 * rest / r.wall_s:5.1f}%")
    if side:
        print(f"  {side}")


def _done(r: Result) -> None:
    print(f"  {r.wall_s:.1f} s (others took {100 * r.others:.0f}% of the CPUs)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: generate small)")
    parser.add_argument(
        "--family", default="qwen2_vl", choices=["qwen2_vl", "qwen3_vl"], help="family of the generated model"
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", default="8,16", help="transformers padded batch sizes")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads, all modes")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="auto: what the engine resolves (bf16, or float32 on a CPU slow at bf16), for every mode",
    )
    parser.add_argument(
        "--hf-orders", default="arrival,sorted", help="transformers batch orders: arrival, sorted (by length)"
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    parser.add_argument(
        "--attention-backend", default="auto", choices=["auto", "torch", "cpu"], help="the engine's"
    )
    parser.add_argument("--skip-hf-single", action="store_true", help="the slowest mode; skip when iterating")
    parser.add_argument("--engine-only", action="store_true", help="no transformers modes (profiling)")
    parser.add_argument(
        "--wait-idle", type=float, default=300, help="max seconds to wait for a quiet machine per mode"
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 8 requests × 16 tokens, batch 8")
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.output_tokens, args.batch_sizes = 8, 16, "8"
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]

    torch.set_num_threads(args.threads)
    import transformers

    model = ensure_checkpoint("small", 0, args.model, family=args.family)
    convs = make_requests(args.num_requests)
    warmup = make_requests(2, seed=99)  # distinct images: nothing cached for the timed runs
    n_img = sum(p["type"] == "image" for c in convs for p in c[0]["content"])
    print(time.strftime("%Y-%m-%d %H:%M"), "·", machine_line())
    print(
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__}"
    )
    print(
        f"{model} ({args.dtype}): {len(convs)} requests ({n_img} images), "
        f"{args.output_tokens} output tokens each, greedy"
    )

    from lm_engine.config import EngineConfig
    from lm_engine.models.registry import load_model_config

    compute = EngineConfig(str(model), dtype=args.dtype).resolve_dtype(load_model_config(model).dtype)
    print(f"compute dtype: {compute} (every mode; --dtype {args.dtype})")
    print("engine …", flush=True)
    eng, side = run_engine(model, convs, args.output_tokens, args, warmup)
    results = [eng]
    _done(eng)
    lengths = [len(p) for p in eng.prompt_ids]
    image_token = json.loads((model / "config.json").read_text())["image_token_id"]
    visual = sum(p.count(image_token) for p in eng.prompt_ids)
    print(f"  prompts: {sum(lengths)} tokens ({visual} visual), {min(lengths)}–{max(lengths)} per request")

    if not args.engine_only:
        hf = HFRunner(model, compute)
        for conv in warmup:  # lazy kernels and the allocator, as the engine's warm-up does
            hf.generate([conv], 4)
        modes = [] if args.skip_hf_single else [(1, None)]
        orders = [{"arrival": None, "sorted": lengths}[o] for o in args.hf_orders.split(",") if o]
        modes += [(bs, order) for bs in batch_sizes for order in orders]
        for bs, order in modes:
            print(f"hf batch {bs}{', sorted' if order else ''} …", flush=True)
            results.append(hf.run(convs, args.output_tokens, bs, order, args.wait_idle))
            _done(results[-1])
    for r in results:
        assert all(len(o) == args.output_tokens for o in r.outputs), f"{r.name}: output lengths differ"
    if len(results) > 1:
        same = sum(a == b for a, b in zip(eng.prompt_ids, results[1].prompt_ids))
        print(f"prompt token ids identical, engine vs transformers: {same}/{len(convs)}")

    print()
    print_table(results, len(convs), len(convs) * args.output_tokens)
    print()
    print_split(eng, "rest: scheduling, sampling, detokenizing, Python", side)
    if len(results) > 1:
        print()
        print_split(min(results[1:], key=lambda r: r.wall_s), "rest: generate() loop, lm_head, Python")
    print_agreement(results)


if __name__ == "__main__":
    main()
