"""Preprocess throughput: our PreprocessPool against transformers' Qwen2-VL image processor.

Images/s over a mix of resolutions (224x224 .. 2048x1536, JPEG and PNG, synthetic but
photo-like), decode included on both sides. No checkpoint needed: the transformers processor is
built from the same config values as ours.

    .venv/bin/python benchmarks/preprocess_throughput.py [--workers 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import time

import numpy as np

SIZES = [(224, 224), (512, 384), (800, 600), (1024, 768), (1280, 960), (2048, 1536)]


def synth_rgb(width: int, height: int, seed: int) -> np.ndarray:
    """Smooth gradients and waves plus sensor-like noise: compresses like a photo."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    img = np.empty((height, width, 3), dtype=np.float32)
    for c in range(3):
        fx, fy = rng.uniform(0.5, 6, 2)
        phase = rng.uniform(0, 2 * np.pi)
        img[..., c] = 127 + 60 * np.sin(2 * np.pi * (fx * x / width + fy * y / height) + phase)
        img[..., c] += 50 * (x / width - 0.5) * rng.choice([-1, 1]) + 30 * (y / height - 0.5)
    img += rng.normal(0, 8, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def encode(rgb: np.ndarray, fmt: str) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def image_mix(seed: int = 0) -> list[bytes]:
    return [
        encode(synth_rgb(w, h, seed + i), fmt) for i, (w, h) in enumerate(SIZES) for fmt in ("JPEG", "PNG")
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="passes over the image mix; best is reported")
    parser.add_argument("--max-pixels", type=int, default=28 * 28 * 1280)
    args = parser.parse_args()

    import PIL
    import torch
    from PIL import Image, ImageOps
    from transformers import Qwen2VLImageProcessor

    from preprocess import PreprocessConfig, PreprocessPool, preprocess

    config = PreprocessConfig(max_pixels=args.max_pixels)
    images = image_mix()
    mb = sum(map(len, images)) / 1e6
    print(f"PIL {PIL.__version__} (pillow-simd: {'.post' in PIL.__version__}), torch {torch.__version__}")
    print(f"{os.cpu_count()} CPUs, torch intra-op threads in this process: {torch.get_num_threads()}")
    print(
        f"{len(images)} images ({mb:.1f} MB encoded), sizes {SIZES} x JPEG/PNG, max_pixels={args.max_pixels}"
    )

    hf = Qwen2VLImageProcessor(
        min_pixels=config.min_pixels,
        max_pixels=config.max_pixels,
        patch_size=config.patch_size,
        merge_size=config.merge_size,
        temporal_patch_size=config.temporal_patch_size,
        image_mean=list(config.image_mean),
        image_std=list(config.image_std),
    )

    def hf_one(data: bytes) -> np.ndarray:
        im = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
        return hf(images=im, return_tensors="np")["pixel_values"]

    def best_rate(fn) -> float:
        best = float("inf")
        for _ in range(args.rounds):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        return len(images) / best

    for data in images:  # warm-up: lazy imports, allocator
        hf_one(data)
    hf_rate = best_rate(lambda: [hf_one(d) for d in images])
    ours_inproc = best_rate(lambda: [preprocess(d, config) for d in images])

    with PreprocessPool(args.workers) as pool:
        pool.wait_ready(300)

        async def pass_over_mix():
            return await asyncio.gather(*(pool.submit(d, config) for d in images))

        results = asyncio.run(pass_over_mix())
        worst = max(float(np.abs(r.patches - hf_one(d)).max()) for r, d in zip(results, images))
        pool_rate = best_rate(lambda: asyncio.run(pass_over_mix()))

    print(f"max |ours - transformers| over the mix: {worst:.2e}")
    print(f"transformers Qwen2VLImageProcessor, 1 process : {hf_rate:7.1f} images/s")
    print(f"ours, preprocess() in 1 process                : {ours_inproc:7.1f} images/s")
    print(f"ours, PreprocessPool({args.workers} workers)                : {pool_rate:7.1f} images/s")
    print(f"ratio pool / transformers: {pool_rate / hf_rate:.2f}x")


if __name__ == "__main__":
    main()
