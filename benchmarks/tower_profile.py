"""Where our vision tower's time goes: per block kind (full attention or window), per part of a block, and the
attention core alone, on encoder_throughput's images.

Builds our tower as ``encoder_throughput.py`` does (the small preset of ``--family`` unless ``--model``; the
dtype the engine resolves; linear layers packed as the server runs them), encodes the ten mixed-resolution
images once to warm up, then once more with forward hooks on every block's parts (``attn``, ``mlp``,
``norm1``, ``norm2``), the patch embedding and the merger, and with the attention core (the varlen call,
rotary included) timed by segment kind: ``window`` where every segment is at most 64 patches, ``full``
elsewhere. Prints seconds per part and the attention cores' GFLOP/s (4 · L² · head_dim · heads per segment).
Hooks cost a little; the untimed pass's total is printed beside the hooked one.

    .venv/bin/python benchmarks/tower_profile.py --family qwen2_5_vl
    .venv/bin/python benchmarks/tower_profile.py --family qwen2_vl
"""

from __future__ import annotations

if not __package__:  # run by path: the repository root onto sys.path, once (benchmarks/_path.py)
    import _path  # noqa: F401

import argparse
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks import encoder_throughput as et
from benchmarks.harness import ensure_checkpoint

WINDOW_ROWS = 64  # a segment this short or shorter counts as a window


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", type=Path, default=None, help="checkpoint directory (default: the small preset)"
    )
    ap.add_argument("--family", default="qwen2_5_vl", choices=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument(
        "--side",
        type=int,
        default=None,
        help="one side² image instead of the benchmark's ten (real_size: 1024)",
    )
    args = ap.parse_args()
    model_dir = ensure_checkpoint("small", 0, args.model, family=args.family)
    _, tower = et.build_ours(model_dir, et.compute_dtype(model_dir, args.dtype), "auto")
    dtype = tower.dtype
    grids = et.image_grids(model_dir, [(args.side, args.side)] if args.side else et.SIZES)
    n = sum(t * h * w for t, h, w in grids)
    pixels, grid = torch.randn(n, tower.cfg.patch_dim), torch.tensor(grids)
    with torch.no_grad():
        tower(pixels, grid)  # warm-up: picks the attention, loads the kernel
        start = time.perf_counter()
        tower(pixels, grid)
        plain = time.perf_counter() - start

    seconds: dict[str, float] = defaultdict(float)
    flops: dict[str, float] = defaultdict(float)

    def timed(name: str, module: torch.nn.Module) -> None:
        module.register_forward_pre_hook(lambda m, a: setattr(m, "_t0", time.perf_counter()))
        module.register_forward_hook(
            lambda m, a, o: seconds.__setitem__(name, seconds[name] + time.perf_counter() - m._t0)
        )

    full = set(getattr(tower.cfg, "fullatt_block_indexes", range(len(tower.blocks))))
    for i, block in enumerate(tower.blocks):
        kind = "full" if i in full else "window"
        timed(f"{kind} blocks", block)
        for part in ("attn", "mlp", "norm1", "norm2"):
            timed(f"{kind} blocks: {part}", getattr(block, part))
    timed("patch embedding", tower.patch_embed)
    timed("merger", tower.merger)
    attend = tower.attend
    heads, head_dim = tower.cfg.num_heads, tower.cfg.head_dim

    def core(qkv, cos, sin, segments, scale):
        t0 = time.perf_counter()
        out = attend(qkv, cos, sin, segments, scale)
        kind = "window" if segments.longest <= WINDOW_ROWS else "full"
        seconds[f"attention core: {kind}"] += time.perf_counter() - t0
        flops[kind] += sum(
            4 * (b - a) ** 2 * head_dim * heads for a, b in zip(segments.bounds, segments.bounds[1:])
        )
        return out

    tower.attend = core
    with torch.no_grad():
        start = time.perf_counter()
        tower(pixels, grid)
        hooked = time.perf_counter() - start
    tower.attend = attend
    print(f"{args.family}, {dtype}, attention {attend.name}, {n} patches in {len(grids)} images")
    print(f"total {plain:.3f} s (hooked pass {hooked:.3f} s)")
    for name in sorted(seconds):
        kind = name.removeprefix("attention core: ")
        rate = f"  {flops[kind] / seconds[name] / 1e9:6.0f} GFLOP/s" if kind in flops else ""
        print(f"  {name:24s} {seconds[name]:7.3f} s  {seconds[name] / hooked:5.1%}{rate}")


if __name__ == "__main__":
    main()
