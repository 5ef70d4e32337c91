"""Vision tower throughput: our tower against transformers' tower on the same images, same dtype, one run.

Images of mixed resolution (224² … 2048×1536, resized by the checkpoint's own smart-resize rule) are packed
into one varlen batch and encoded by

- ``ours``: ``encoder.models.build_vision_tower`` (attention chosen by timing, see ``--attention``);
- ``hf packed``: transformers' ``Qwen2VisionTransformerPretrainedModel`` (SDPA) on the same packed batch;
- ``hf single``: the same, one image at a time (its better mode on a CPU: SDPA runs per image either way).

The machine's rates are measured first, in the same process: matmul GFLOP/s in the compute dtype and
``scaled_dot_product_attention`` GFLOP/s (one 1024-patch image of the tower's heads). Per tower it prints
patches/s and the achieved GFLOP/s of the linear layers and of the attention core (softmax(q·kᵀ)·v, rotary
included) separately, timed by module hooks in a second, profiled pass, and their fraction of the matmul
rate. Pixels are random (the work does not depend on them).

    .venv/bin/python benchmarks/encoder_throughput.py                 # the small preset, ~1-2 min
    .venv/bin/python benchmarks/encoder_throughput.py --quick         # 3 images, seconds
    .venv/bin/python benchmarks/encoder_throughput.py --dtype float32 --attention torch
    .venv/bin/python benchmarks/encoder_throughput.py --rows-per-pass 0   # ours in one pass, as before
    .venv/bin/python benchmarks/encoder_throughput.py --family qwen3_vl           # Qwen3-VL (deepstack)
    python3 benchmarks/encoder_throughput.py --quick --device cuda    # on a GPU (benchmarks/gpu_check.sh)
"""

from __future__ import annotations

if not __package__:  # run by path: the repository root onto sys.path, once (benchmarks/_path.py)
    import _path  # noqa: F401

import argparse
import json
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.nn import functional as F

from benchmarks.harness import ensure_checkpoint

RESULTS = Path(__file__).parent / "results" / "encoder_throughput"
SIZES = [(224, 224), (448, 336), (640, 480), (336, 896), (800, 600), (1024, 768), (1280, 720), (1600, 1200),
         (1536, 2048), (2048, 1536)]  # fmt: skip
QUICK_SIZES = [(224, 224), (640, 480), (1024, 768)]
CPU = torch.device("cpu")


@dataclass
class Result:
    name: str
    seconds: float
    patches: int
    linear_s: float = 0.0
    attention_s: float = 0.0
    notes: dict = field(default_factory=dict)


def cpu_flags() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "?"
    flags = {f for f in out.split() if f in ("avx2", "avx512f", "avx512_bf16") or f.startswith("amx")}
    found = " ".join(sorted(flags)) or "none"
    emulated = os.environ.get("VLMSERVE_EMULATED_ISA")  # benchmarks/as_avx2.sh
    return f"{emulated}, emulated on {found}" if emulated else found


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a GPU runs asynchronously; the CPU needs nothing)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn, repeat: int, device: torch.device = CPU) -> float:
    fn()
    sync(device)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def machine_rates(
    dtype: torch.dtype,
    heads: int,
    head_dim: int,
    repeat: int,
    peak: bool = False,
    device: torch.device = CPU,
) -> dict[str, float]:
    """GFLOP/s of a 2048×1024 · 1024×4096 matmul and of SDPA over 1024 tokens, in ``dtype`` on ``device``; with
    ``peak`` also the CPU's arithmetic peak for that dtype (``benchmarks/cpu_peak.py``; absent without the
    instruction, and on a GPU), which bounds every tower's rate."""
    a, b = torch.randn(2048, 1024).to(device, dtype), torch.randn(1024, 4096).to(device, dtype)
    mm = best_time(lambda: a @ b, repeat, device)
    q = torch.randn(1, heads, 1024, head_dim).to(device, dtype)
    sdpa = best_time(lambda: F.scaled_dot_product_attention(q, q, q), repeat, device)
    rates = {
        "matmul_gflops": 2 * 2048 * 1024 * 4096 / mm / 1e9,
        "sdpa_gflops": 4 * 1024 * 1024 * heads * head_dim / sdpa / 1e9,
    }
    if peak and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        from benchmarks.cpu_peak import peak_gflops

        found = peak_gflops(str(dtype).removeprefix("torch."), torch.get_num_threads())
        if found is not None:
            rates["peak_gflops"] = found
    return rates


def work(cfg, grids: list[tuple[int, int, int]]) -> dict[str, float]:
    """FLOPs of the linear layers and of the attention core (q·kᵀ and P·v) for these images; Qwen2.5-VL's
    window blocks attend within their windows only."""
    e, n = cfg.embed_dim, sum(t * h * w for t, h, w in grids)
    merged, width = n // cfg.spatial_merge_size**2, e * cfg.spatial_merge_size**2
    mlp = 2 * e * cfg.mlp_hidden if hasattr(cfg, "mlp_hidden") else 3 * e * cfg.intermediate_size
    per_patch = cfg.patch_dim * e + cfg.depth * (3 * e * e + e * e + mlp)
    mergers = 1 + len(getattr(cfg, "deepstack_indexes", ()))  # Qwen3-VL: one merger per deepstack level too
    linear = 2 * (n * per_patch + mergers * merged * (width * width + width * cfg.out_hidden))
    full = sum(t * 4 * (h * w) ** 2 * e for t, h, w in grids)
    if hasattr(cfg, "window_size"):
        from encoder.models.qwen2_5_vl import window_order

        unit = cfg.spatial_merge_size**2
        _, lengths = window_order(
            grids, cfg.spatial_merge_size, cfg.window_size // cfg.spatial_merge_size // cfg.patch_size
        )
        windowed = sum(4 * (n_units * unit) ** 2 * e for n_units in lengths)
        n_full = len(cfg.fullatt_block_indexes)
        attention = n_full * full + (cfg.depth - n_full) * windowed
    else:
        attention = cfg.depth * full
    return {"linear": float(linear), "attention": float(attention), "patches": n}


class HookTimer:
    """Wall time inside Linear/Conv3d modules, and inside attention modules less their own projections. A gated
    MLP whose gate, up and silu · up run as one call of the float32 kernel (the gate and up modules are then never
    called) counts whole as linear time."""

    def __init__(
        self,
        model: torch.nn.Module,
        attention_cls: tuple[type, ...],
        device: torch.device = CPU,
    ) -> None:
        from encoder.models.qwen2_5_vl import GatedMlp
        from runtime.linear import KernelLinear, PackedLinear

        self.times = {"linear": 0.0, "attention": 0.0, "projections": 0.0}
        self.device = device
        self.handles = []
        inside = {id(m) for a in model.modules() if isinstance(a, attention_cls) for m in a.modules()}
        one_pass = [m for m in model.modules() if isinstance(m, GatedMlp) and m.one_pass()]
        skip = {id(sub) for m in one_pass for sub in m.modules()}
        for mod in one_pass:
            self._time(mod, ["linear"])
        for mod in model.modules():
            if id(mod) in skip:
                continue
            if isinstance(mod, (torch.nn.Linear, PackedLinear, KernelLinear, torch.nn.Conv3d)):
                self._time(mod, ["linear", "projections"] if id(mod) in inside else ["linear"])
            elif isinstance(mod, attention_cls):
                self._time(mod, ["attention"])

    def _time(self, mod: torch.nn.Module, into: list[str]) -> None:
        start: list[float] = []

        def pre(*_):
            sync(self.device)
            start.append(time.perf_counter())

        def post(*_):
            sync(self.device)
            elapsed = time.perf_counter() - start.pop()
            for key in into:
                self.times[key] += elapsed

        self.handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]

    def close(self) -> tuple[float, float]:
        """(linear seconds, attention-core seconds)."""
        for h in self.handles:
            h.remove()
        t = self.times
        return t["linear"], t["attention"] - t["projections"]


def run_tower(name: str, fn, model, attention_cls, patches: int, repeat: int, device: torch.device) -> Result:
    seconds = best_time(fn, repeat, device)
    timer = HookTimer(model, attention_cls, device)
    fn()
    sync(device)
    linear, attention = timer.close()
    return Result(name, seconds, patches, linear, attention)


def compute_dtype(model_dir: Path, dtype: str) -> torch.dtype:
    """The dtype the engine computes this checkpoint in for ``--dtype`` (``auto``: the start-up probe's)."""
    from lm_engine.config import EngineConfig
    from lm_engine.models.registry import load_model_config

    return EngineConfig(str(model_dir), dtype=dtype).resolve_dtype(load_model_config(model_dir).dtype)


def image_grids(model_dir: Path, sizes: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(t, h, w) patch grids of images of ``sizes`` (width, height) after the checkpoint's smart-resize."""
    from preprocess import PreprocessConfig, smart_resize

    pp = PreprocessConfig.from_checkpoint(model_dir)
    grids = []
    for w, h in sizes:
        rh, rw = smart_resize(h, w, pp.factor, pp.min_pixels, pp.max_pixels)
        grids.append((1, rh // pp.patch_size, rw // pp.patch_size))
    return grids


def build_ours(
    model_dir: Path, dtype: torch.dtype, attention: str, device: torch.device = CPU
) -> tuple[dict, torch.nn.Module]:
    """(config.json, our tower with the checkpoint's weights on ``device``, linear layers packed as the server
    runs it)."""
    from encoder.models import build_vision_tower
    from runtime.linear import pack_linears

    config = json.loads((model_dir / "config.json").read_text())
    ours = build_vision_tower(config, model_dir, dtype=dtype, device=device, attention=attention)
    pack_linears(ours)
    return config, ours


def build_qwen3_towers(model_dir: Path, dtype: torch.dtype, attention: str, device: torch.device):
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionAttention, Qwen3VLVisionModel

    from encoder.models.qwen2_vl import Attention
    from runtime.weights import read_tensors

    config, ours = build_ours(model_dir, dtype, attention, device)
    hf_cfg = Qwen3VLVisionConfig(**config["vision_config"])
    hf_cfg._attn_implementation = "sdpa"
    hf = Qwen3VLVisionModel._from_config(hf_cfg, dtype=dtype).eval()
    state = {
        k.removeprefix("model.visual."): t for k, t in read_tensors(model_dir, ("model.visual.",)).items()
    }
    hf.load_state_dict(state)
    return ours, (Attention,), hf.to(device), (Qwen3VLVisionAttention,)


def build_towers(model_dir: Path, dtype: torch.dtype, attention: str, device: torch.device = CPU):
    """(ours, our attention classes, transformers' tower, its attention classes), both on ``device`` with the
    checkpoint's weights."""
    if json.loads((model_dir / "config.json").read_text()).get("model_type") == "qwen3_vl":
        return build_qwen3_towers(model_dir, dtype, attention, device)
    import transformers.models.qwen2_5_vl.modeling_qwen2_5_vl as hf25
    import transformers.models.qwen2_vl.modeling_qwen2_vl as hf2
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig

    from encoder.models import family_of
    from encoder.models.qwen2_vl import Attention
    from runtime.weights import read_tensors

    config, ours = build_ours(model_dir, dtype, attention, device)
    if family_of(config) == "qwen2_5_vl":
        cfg_cls, model_cls, attn_cls = (
            Qwen2_5_VLVisionConfig,
            hf25.Qwen2_5_VisionTransformerPretrainedModel,
            hf25.Qwen2_5_VLVisionAttention,
        )
    else:
        cfg_cls, model_cls, attn_cls = (
            Qwen2VLVisionConfig,
            hf2.Qwen2VisionTransformerPretrainedModel,
            hf2.VisionAttention,
        )
    v = {k: val for k, val in config["vision_config"].items() if k in cfg_cls.__dataclass_fields__}
    hf_cfg = cfg_cls(**v)
    hf_cfg._attn_implementation = "sdpa"
    hf = model_cls._from_config(hf_cfg, dtype=dtype).eval()
    state = {k.removeprefix("visual."): t for k, t in read_tensors(model_dir, ("visual.",)).items()}
    hf.load_state_dict(state)
    return ours, (Attention,), hf.to(device), (attn_cls,)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", type=Path, default=None, help="checkpoint directory (default: the small preset)"
    )
    ap.add_argument(
        "--family", default="qwen2_vl", choices=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"], help="of the default"
    )
    ap.add_argument("--dtype", default="auto", help="auto (as the engine resolves it), float32 or bfloat16")
    ap.add_argument("--attention", default="auto", choices=["auto", "torch", "cpu-kernel"])
    ap.add_argument(
        "--rows-per-pass",
        type=int,
        default=None,
        help="our tower's patches per pass (default: the tower's own; 0: the whole batch in one pass)",
    )
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda: both towers and the rates there")
    ap.add_argument(
        "--profile", action="store_true", help="then one pass of ours and of hf packed under torch's profiler"
    )
    ap.add_argument("--quick", action="store_true", help="3 images, 1 repeat")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)

    model_dir = ensure_checkpoint("small", 0, args.model, family=args.family)
    dtype = compute_dtype(model_dir, args.dtype)
    device = torch.device(args.device)
    ours, ours_attn, hf, hf_attn = build_towers(model_dir, dtype, args.attention, device)
    if args.rows_per_pass is not None:
        ours.rows_per_pass = args.rows_per_pass
    cfg = ours.cfg
    repeat = 1 if args.quick else args.repeat
    grids = image_grids(model_dir, QUICK_SIZES if args.quick else SIZES)
    flops = work(cfg, grids)
    n = int(flops["patches"])
    pixels = torch.randn(n, cfg.patch_dim).to(device)
    grid = torch.tensor(grids, device=device)
    # best of 20 (~0.15 s on a CPU): the machine's rate, not one slow moment of it. NOTE: best of 3 read 749 and
    # 2,692 GFLOP/s in two runs a minute apart (a 2-vCPU Xeon with AMX, 2026-12-05), and this rate is the
    # denominator of every fraction below.
    rates = machine_rates(dtype, cfg.num_heads, cfg.head_dim, max(20, repeat), peak=True, device=device)
    with torch.no_grad():
        results = [run_tower("ours", lambda: ours(pixels, grid), ours, ours_attn, n, repeat, device)]
        results.append(
            run_tower(
                "hf packed", lambda: hf(pixels.to(dtype), grid_thw=grid), hf, hf_attn, n, repeat, device
            )
        )
        results.append(
            run_tower(
                "hf single", lambda: _one_by_one(hf, pixels, grids, dtype), hf, hf_attn, n, repeat, device
            )
        )
    args.rows_per_pass_used = ours.rows_per_pass
    args.linears = linear_kinds(ours)
    report(args, model_dir, dtype, grids, flops, rates, results, ours.attend.name)
    if args.profile:
        with torch.no_grad():
            profile_pass("ours", lambda: ours(pixels, grid), device)
            profile_pass("hf packed", lambda: hf(pixels.to(dtype), grid_thw=grid), device)


def profile_pass(name: str, fn, device: torch.device, rows: int = 14) -> None:
    """One warm pass under torch's profiler: the ops with the most self time on the host and, on a GPU, on the
    device, and the pass's kernel launches and host↔device synchronisations."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    fn()
    sync(device)
    with profile(activities=activities) as prof:
        with record_function("tower_pass"):
            fn()
        sync(device)
    table = prof.key_averages()
    print(f"\n== profile: {name} ==")
    print(table.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=48))
    if device.type == "cuda":
        print(table.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=48))
        names = events_within(prof, "tower_pass")  # the pass's own calls, not the timing sync after it
        launches = sum(n in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC") for n in names)
        syncs = sum("Synchronize" in n for n in names)
        copies = sum(n in ("cudaMemcpy", "cudaMemcpyAsync") for n in names)
        print(f"{name}: {launches} kernel launches, {syncs} synchronisations, {copies} memcpy calls")


def events_within(prof, label: str) -> list[str]:
    """Names of the profiled host events that started inside the ``record_function(label)`` range."""
    events = prof.events()
    span = next(e for e in events if e.name == label and e.device_type == torch.autograd.DeviceType.CPU)
    start, end = span.time_range.start, span.time_range.end
    return [e.name for e in events if e is not span and start <= e.time_range.start <= end]


def linear_kinds(model: torch.nn.Module) -> str:
    """Which implementation runs the tower's linear layers, e.g. ``KernelLinear × 26``."""
    from collections import Counter

    from runtime.linear import KernelLinear, PackedLinear

    kinds = (KernelLinear, PackedLinear, torch.nn.Linear)
    counts = Counter(type(m).__name__ for m in model.modules() if isinstance(m, kinds))
    return ", ".join(f"{name} × {n}" for name, n in sorted(counts.items())) or "none"


def _one_by_one(hf, pixels: torch.Tensor, grids, dtype) -> None:
    start = 0
    for t, h, w in grids:
        hf(
            pixels[start : start + t * h * w].to(dtype),
            grid_thw=torch.tensor([[t, h, w]], device=pixels.device),
        )
        start += t * h * w


def report(args, model_dir, dtype, grids, flops, rates, results: list[Result], attention: str) -> None:
    mm = rates["matmul_gflops"]
    name = str(dtype).removeprefix("torch.")
    where = (
        args.device if args.device == "cpu" else f"{args.device} ({torch.cuda.get_device_name(args.device)})"
    )
    print(f"model {model_dir}  dtype {name}  device {where}  threads {torch.get_num_threads()}  "
          f"CPU flags: {cpu_flags()}")  # fmt: skip
    print(f"images {len(grids)}  patches {int(flops['patches'])}  our attention: {attention}  "
          f"rows per pass: {args.rows_per_pass_used}  our linear layers: {args.linears}")  # fmt: skip
    peak = rates.get("peak_gflops")
    print(f"machine: matmul {mm:.0f} GFLOP/s, SDPA {rates['sdpa_gflops']:.0f} GFLOP/s ({name})"
          + (f"; arithmetic peak {peak:.0f} GFLOP/s (benchmarks/cpu_peak.py)" if peak else ""))  # fmt: skip
    print(
        f"{'tower':10} {'s':>7} {'patches/s':>10} {'linear GF/s':>12} {'attn GF/s':>10} {'attn/mm':>8} {'all GF/s':>9}"
    )
    rows = []
    for r in results:
        lin = flops["linear"] / r.linear_s / 1e9 if r.linear_s else 0.0
        att = flops["attention"] / r.attention_s / 1e9 if r.attention_s else 0.0
        total = (flops["linear"] + flops["attention"]) / r.seconds / 1e9
        rows.append({**asdict(r), "linear_gflops": lin, "attention_gflops": att, "gflops": total})
        print(
            f"{r.name:10} {r.seconds:7.3f} {r.patches / r.seconds:10.0f} {lin:12.0f} {att:10.0f} {att / mm:8.2f} {total:9.0f}"
        )
    best_hf = min(results[1:], key=lambda r: r.seconds)
    speedup = best_hf.seconds / results[0].seconds
    print(f"ours / best transformers mode ({best_hf.name}): {speedup:.2f}x patches/s; "
          f"our attention at {rows[0]['attention_gflops'] / mm:.0%} of the matmul rate, "
          f"whole tower at {rows[0]['gflops'] / mm:.0%}")  # fmt: skip
    if peak:
        # no tower outruns the arithmetic peak: the most any tower could gain over the best other mode
        best_rate = max(row["gflops"] for row in rows[1:])
        print(f"ceiling: a tower at the arithmetic peak would be {peak / best_rate:.2f}x the best "
              f"transformers mode ({best_rate:.0f} GFLOP/s); ours is at {rows[0]['gflops'] / peak:.0%} of the peak")  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    tag = ("-quick" if args.quick else "") + ("" if args.device == "cpu" else f"-{args.device.split(':')[0]}")
    out = RESULTS / f"{time.strftime('%Y%m%d-%H%M%S')}{tag}.json"
    out.write_text(json.dumps({
        "dtype": name, "device": where, "cpu_flags": cpu_flags(), "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(), "grids": grids, "flops": flops, "rates": rates,
        "attention": attention, "rows_per_pass": args.rows_per_pass_used, "linears": args.linears, "results": rows,
        "speedup_vs_best_hf": speedup,
    }, indent=2) + "\n")  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
