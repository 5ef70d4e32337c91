"""The checks to run when a GPU is lent (``benchmarks/gpu_check.sh`` runs this; at most ~9 minutes).

Sections, each printing PASS/FAIL lines and a summary at the end:

1. ``kernels``: the Triton paged-decode and KV-write kernels, compiled (not interpreted), against the torch
   backend over dtypes, head dims, GQA ratios, block sizes, ragged contexts and split counts; then the
   start-up warm-up plan: after it, a decode step compiles nothing new.
2. ``bf16``: first-token agreement on long prompts and the equivalence scenarios in bf16, on the GPU
   (``benchmarks/bf16_agreement.py --device cuda``).
3. ``e2e``: ``LLM(device="cuda")`` on the tiny preset: greedy ids against transformers ``generate()`` on the
   same GPU (float32 both, the equivalence scenarios with images and chunked prefill), a prefix-cache hit
   that changes nothing, seeded sampling with ``n=2`` reproducible, and the blocks all freed.
4. ``syncs``: one steady decode step under the profiler: host↔device synchronisations counted (the sampler's
   one ``.tolist()`` is the only one expected).
5. ``serve``: ``vlmserve serve --device cuda`` on the embedded demo model (the README's main command, its encoder
   thread and preprocessing pool included): healthy, and the colour and shape of fixed task-set images answered
   right over HTTP (the shipped model answers those questions on every such image on the CPU).
6. ``encoder``: our Qwen2-VL, Qwen2.5-VL and Qwen3-VL towers on the GPU against transformers' towers on the same
   packed mixed-resolution pixels (a grid that is not a multiple of Qwen2.5-VL's window among them): float32
   within float32 rounding, the packed batch equal to each image alone, and bf16 no further from the float32
   reference than transformers' own bf16 tower is (times of both printed). ``gpu_check.sh`` then runs
   ``encoder_throughput.py --quick --device cuda`` for the first two families.

    python3 benchmarks/gpu_check.py                 # all sections
    python3 benchmarks/gpu_check.py kernels e2e     # some
    .venv/bin/python benchmarks/gpu_check.py --cpu e2e serve encoder   # a dry run of the script itself, no GPU
"""

from __future__ import annotations

if not __package__:  # run by path: the repository root onto sys.path, once (benchmarks/_path.py)
    import _path  # noqa: F401

import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

RESULTS: list[tuple[str, bool, str]] = []
# --cpu: the sections that need no CUDA-only feature, on the CPU (checks this script, not a GPU)
DEVICE = "cuda"


def check(name: str, ok: bool, detail: str = "") -> None:
    RESULTS.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)


def tiny_checkpoint() -> Path:
    from tools.qwen2_vl_make import make_checkpoint

    return make_checkpoint(Path(tempfile.mkdtemp()) / "tiny", preset="tiny", seed=0)


# -- 1. kernels ------------------------------------------------------------------------------------------
def _decode_case(dtype, heads, kv_heads, head_dim, block_size, lens, splits, gen):
    from lm_engine.attention import triton_kernels
    from lm_engine.attention.torch_backend import paged_decode

    need = [-(-c // block_size) for c in lens]
    num_blocks = sum(need) + 4
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lens), max(need) + 1, dtype=torch.int32)
    start = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[start : start + n]
        start += n
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(dtype).cuda()
    v = torch.randn(shape, generator=gen).to(dtype).cuda()
    q = torch.randn(len(lens), heads, head_dim + 8, generator=gen).to(dtype).cuda()[..., :head_dim]
    ctx = torch.tensor(lens, dtype=torch.int32).cuda()
    tables = tables.cuda()
    scale = head_dim**-0.5
    ref = paged_decode(q.float(), k.float(), v.float(), tables, ctx, scale)
    out = triton_kernels.triton_paged_decode(q, k, v, tables, ctx, scale, max(lens), num_splits=splits)
    tol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    return float((out.float() - ref).abs().max()), tol


def check_kernels() -> None:
    from lm_engine.attention import triton_kernels
    from lm_engine.attention.torch_backend import write_kv

    gen = torch.Generator().manual_seed(0)
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    groups, blocks, splits = [1, 2, 4, 8], [8, 16, 32], [None, 1, 2, 3, 8]
    i = 0
    for dtype in dtypes:
        for head_dim in (64, 80, 128, 256):
            group, block, split = groups[i % 4], blocks[i % 3], splits[i % 5]
            i += 1
            kv_heads = 2
            lens = [1, block, block + 1] + torch.randint(2, 3000, (5,), generator=gen).tolist()
            err, tol = _decode_case(dtype, kv_heads * group, kv_heads, head_dim, block, lens, split, gen)
            name = f"decode {str(dtype)[6:]} d{head_dim} gqa{group} bs{block} splits={split}"
            check(name, err <= tol, f"max err {err:.2e} (tol {tol:.0e})")
    for dtype in dtypes:
        kv = torch.randn(40, 6, 128, generator=gen).to(dtype).cuda()
        key, value = kv[:, :3].contiguous(), kv[:, 3:]
        slots = torch.randperm(64 * 16, generator=gen)[:40].cuda()
        slots[[0, 7]] = -1
        k_cache = torch.zeros(64, 16, 3, 128, dtype=dtype, device="cuda")
        v_cache = torch.zeros_like(k_cache)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        write_kv(key, value, k_ref, v_ref, slots)
        triton_kernels.triton_write_kv(key, value, k_cache, v_cache, slots)
        check(f"write_kv {str(dtype)[6:]}", torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref))
    _check_warmup()


def _check_warmup() -> None:
    """After the backend's warm-up, decode launches over many batch shapes compile nothing new."""
    from lm_engine.attention import triton_kernels
    from lm_engine.attention.triton_backend import TritonBackend

    kv_heads, heads, head_dim, block_size, max_len = 2, 12, 128, 16, 8192
    shape = (max_len // block_size + 8, block_size, kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    t0 = time.perf_counter()
    TritonBackend().warmup(k_cache, v_cache, heads, max_len)
    warm_s = time.perf_counter() - t0

    def cache_sizes() -> int:
        """Compiled variants of the decode kernels (each device cache entry leads with its kernel dict)."""
        kernels = (triton_kernels._paged_decode_kernel, triton_kernels._reduce_splits_kernel)
        return sum(len(entry[0]) for k in kernels for entry in k.device_caches.values())

    before = cache_sizes()
    gen = torch.Generator().manual_seed(1)
    for num_seqs in (1, 2, 3, 5, 8, 17, 40, 64):
        lens = torch.randint(1, max_len, (num_seqs,), generator=gen)
        tables = torch.randint(
            0, shape[0], (num_seqs, int(lens.max()) // block_size + 1 + num_seqs % 3), dtype=torch.int32
        )
        q = torch.randn(num_seqs, heads, head_dim, dtype=torch.bfloat16, device="cuda")
        triton_kernels.triton_paged_decode(
            q, k_cache, v_cache, tables.cuda(), lens.to(torch.int32).cuda(), 0.1, int(lens.max())
        )
    torch.cuda.synchronize()
    check(
        "warm-up covers live decode shapes",
        cache_sizes() == before,
        f"(warm-up {warm_s:.1f} s, {before} variants)",
    )


# -- 2. bf16 ---------------------------------------------------------------------------------------------
def check_bf16(ckpt: Path) -> None:
    from benchmarks.bf16_agreement import run

    rec = run(str(ckpt), 20, DEVICE)
    rows = rec["first_token_agreement"]
    ours = int(rows["engine bf16 vs transformers bf16"]["all"].split("/")[0])
    floor = int(rows["transformers bf16 vs transformers float32 (noise floor)"]["all"].split("/")[0])
    check("bf16 first tokens at least as close as the noise floor", ours >= floor, f"{ours} vs {floor}")


# -- 3. end to end ---------------------------------------------------------------------------------------
def check_e2e(ckpt: Path) -> None:
    from lm_engine import LLM, SamplingParams
    from tests.support import HFOracle, image_part, make_image, mixed_requests, user

    oracle = HFOracle(ckpt, torch.float32, DEVICE)
    convs = mixed_requests()
    refs = [oracle.generate(c, 20) for c in convs]
    greedy = SamplingParams(temperature=0.0, max_tokens=20)
    with LLM(str(ckpt), device=DEVICE, dtype="float32", max_num_batched_tokens=96) as llm:
        outs = llm.chat(convs, greedy)
        same = sum(o.token_ids == r for o, r in zip(outs, refs))
        check(f"greedy ids equal transformers on {DEVICE}", same == len(refs), f"{same}/{len(refs)}")
        again = llm.chat(convs, greedy)
        cached = sum(o.num_cached_tokens for o in again)
        check(
            "prefix hit changes nothing",
            cached > 0 and all(a.token_ids == o.token_ids for a, o in zip(again, outs)),
            f"{cached} cached tokens",
        )
        conv = user(image_part(make_image(224, 224, 3)), "Describe it.")
        params = SamplingParams(n=2, temperature=1.0, top_p=0.9, seed=5, max_tokens=16, ignore_eos=True)
        a, b = llm.chat([conv], params)[0], llm.chat([conv], params)[0]
        check(
            "seeded n=2 sampling reproducible",
            [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs],
            str([len(c.token_ids) for c in a.outputs]),
        )
        bm = llm.engine.block_manager
        check("every block freed", bm.num_free_blocks == bm.num_blocks)


# -- 4. synchronisations ---------------------------------------------------------------------------------
def check_syncs(ckpt: Path) -> None:
    from torch.profiler import ProfilerActivity, profile, record_function

    from benchmarks.encoder_throughput import events_within
    from lm_engine import LLM, SamplingParams
    from tests.support import user

    with LLM(str(ckpt), device="cuda", max_num_batched_tokens=256) as llm:
        eng = llm.engine
        for i in range(8):
            eng.add_request(
                f"r{i}", user(f"question {i}: tell me more"), SamplingParams(max_tokens=64, ignore_eos=True)
            )
        for _ in range(6):  # prefill done, decoding
            eng.step()
        torch.cuda.synchronize()
        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        with profile(activities=activities) as prof, record_function("vlmserve_step"):
            eng.step()
        # NOTE: only what the step called: leaving the profiler synchronises the device itself (a
        # cudaDeviceSynchronize the first GPU run counted against the step)
        names = events_within(prof, "vlmserve_step")
        syncs = [n for n in names if "Synchronize" in n]
        copies = [n for n in names if n in ("cudaMemcpy", "cudaMemcpyAsync")]
        print("sync calls:", syncs, "| memcpy calls:", len(copies))
        check(
            "one device sync per decode step", len(syncs) <= 1, f"{len(syncs)} syncs, {len(copies)} memcpys"
        )
        while eng.has_unfinished():
            eng.step()


# -- 5. serve --------------------------------------------------------------------------------------------
SERVE_SEED = 30_000  # tests/tools/test_shipped_demo.py's fixed images


def check_serve() -> None:
    import httpx

    from benchmarks.harness import ServerProcess, free_port, vlmserve_here_argv
    from benchmarks.quality_vs_budget import data_url
    from tools import demo_tasks as tasks

    port = free_port()
    # no --model: the embedded demo model, as `vlmserve serve` serves by default
    argv = vlmserve_here_argv(None, port, ["--device", DEVICE])
    log = Path(tempfile.mkdtemp()) / "serve.log"
    # start() raises with the log's tail if the server exits or is not healthy in time: the section fails
    with ServerProcess(f"vlmserve --device {DEVICE}", argv, port, log) as server:
        server.start(timeout_s=240)
        check(f"vlmserve serve --device {DEVICE} healthy", True, f"after {server.startup_s:.0f} s")
        asked = [(ex, task) for ex, task in tasks.eval_set(SERVE_SEED, 3) if task in ("color", "shape")]
        right = 0
        with httpx.Client(timeout=120, trust_env=False) as client:
            for ex, task in asked:
                content = [
                    {"type": "image_url", "image_url": {"url": data_url(ex)}},
                    {"type": "text", "text": ex.question(task)},
                ]
                body = {"model": "vlmserve-demo", "messages": [{"role": "user", "content": content}]}
                reply = client.post(
                    server.base_url + "/v1/chat/completions", json=body | {"max_tokens": 8, "temperature": 0}
                )
                reply.raise_for_status()
                answer = reply.json()["choices"][0]["message"]["content"]
                right += tasks.normalize(answer) == tasks.normalize(ex.qa[task])
        check(
            f"served on {DEVICE}: colour and shape of fixed images",
            right == len(asked),
            f"{right}/{len(asked)}",
        )


# -- 6. encoder ------------------------------------------------------------------------------------------
# (t, h, w) patch grids: 22×30 and 10×6 are not multiples of Qwen2.5-VL's 8-patch window
ENCODER_GRIDS = [(1, 16, 16), (1, 22, 30), (1, 36, 28), (1, 10, 6)]


def _hf_levels(out) -> list[torch.Tensor]:
    """transformers' tower output as [merged rows, *deepstack levels] (Qwen3-VL has the levels)."""
    if isinstance(out, torch.Tensor):
        return [out]
    return [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64; NaN anywhere reads as infinitely far."""
    a, b = a.double(), b.double()
    err = float((a - b).norm() / b.norm())
    return err if err == err else float("inf")


def _timed(fn, device: torch.device) -> tuple[object, float]:
    from benchmarks.encoder_throughput import best_time

    out = fn()
    return out, best_time(fn, 3, device)


def check_encoder() -> None:
    from benchmarks.encoder_throughput import build_towers
    from tools import qwen2_vl_make, qwen3_vl_make

    device = torch.device(DEVICE)
    # float32 means float32 here: no TF32 in transformers' patch convolution or either side's matmuls
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    root = Path(tempfile.mkdtemp())
    for family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        path = root / family
        if family == "qwen3_vl":
            qwen3_vl_make.make_checkpoint(path, preset="tiny", seed=0)
        else:
            qwen2_vl_make.make_checkpoint(path, preset="tiny", seed=0, family=family)
        _check_tower(
            family, {dt: build_towers(path, dt, "auto", device) for dt in (torch.float32, torch.bfloat16)}
        )


def _check_tower(family: str, towers: dict) -> None:
    """One family's towers ({dtype: build_towers(...)}) against transformers' on the same pixels."""
    device = torch.device(DEVICE)
    ours32, hf32 = towers[torch.float32][0], towers[torch.float32][2]
    n = sum(t * h * w for t, h, w in ENCODER_GRIDS)
    gen = torch.Generator().manual_seed(7)
    pixels = torch.randn(n, ours32.cfg.patch_dim, generator=gen).to(device)
    grid = torch.tensor(ENCODER_GRIDS, device=device)
    with torch.no_grad():
        want, hf_s = _timed(lambda: _hf_levels(hf32(pixels, grid_thw=grid)), device)
        got, ours_s = _timed(lambda: ours32(pixels, grid), device)
        got = list(got.chunk(len(want), dim=-1))
        err = max(_rel(g, w) for g, w in zip(got, want))
        check(
            f"{family} tower float32 equals transformers on {DEVICE}",
            all(g.shape == w.shape for g, w in zip(got, want)) and err <= 1e-4,
            f"rel err {err:.1e} over {len(want)} level(s); {n} patches: ours {ours_s * 1e3:.1f} ms, "
            f"transformers {hf_s * 1e3:.1f} ms",
        )
        ours32.rows_per_pass = 0  # every image in one packed pass
        packed = ours32(pixels, grid)
        start, rows, worst = 0, 0, 0.0
        for t, h, w in ENCODER_GRIDS:
            alone = ours32(pixels[start : start + t * h * w], torch.tensor([[t, h, w]], device=device))
            worst = max(worst, _rel(packed[rows : rows + alone.shape[0]], alone))
            start, rows = start + t * h * w, rows + alone.shape[0]
        check(
            f"{family} packed batch equals each image alone",
            rows == packed.shape[0] and worst <= 1e-4,
            f"rel err {worst:.1e}",
        )
        ours16, hf16 = towers[torch.bfloat16][0], towers[torch.bfloat16][2]
        floor_levels, hf16_s = _timed(lambda: _hf_levels(hf16(pixels.bfloat16(), grid_thw=grid)), device)
        got16, ours16_s = _timed(lambda: ours16(pixels, grid), device)
        got16 = list(got16.chunk(len(want), dim=-1))
        ours_err = max(_rel(g, w) for g, w in zip(got16, want))
        floor = max(_rel(f, w) for f, w in zip(floor_levels, want))
        check(
            f"{family} tower bf16 as close to float32 as transformers' bf16 tower",
            ours_err <= 1.5 * floor + 1e-3,
            f"rel err {ours_err:.1e} vs transformers bf16 {floor:.1e}; ours {ours16_s * 1e3:.1f} ms, "
            f"transformers {hf16_s * 1e3:.1f} ms",
        )


def main() -> int:
    global DEVICE
    args = sys.argv[1:]
    if "--cpu" in args:
        args.remove("--cpu")
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    wanted = set(args) or {"kernels", "bf16", "e2e", "syncs", "serve", "encoder"}
    if DEVICE == "cpu" and wanted & {"kernels", "syncs"}:
        print("--cpu runs bf16, e2e, serve and encoder only (kernels and syncs need CUDA)")
        return 2
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU dry run"
    print(f"torch {torch.__version__}, {name}, sections {sorted(wanted)}", flush=True)
    ckpt = tiny_checkpoint()
    sections = {
        "kernels": check_kernels,
        "bf16": lambda: check_bf16(ckpt),
        "e2e": lambda: check_e2e(ckpt),
        "syncs": lambda: check_syncs(ckpt),
        "serve": check_serve,
        "encoder": check_encoder,
    }
    for name, fn in sections.items():
        if name not in wanted:
            continue
        t0 = time.perf_counter()
        try:
            fn()
        except Exception:
            traceback.print_exc()
            check(f"section {name} ran", False)
        print(f"-- {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    failed = [n for n, ok, _ in RESULTS if not ok]
    print(
        f"\n{len(RESULTS) - len(failed)}/{len(RESULTS)} checks passed"
        + (f"; failed: {failed}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
