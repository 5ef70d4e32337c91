"""JPEG draft mode: speed and pixel difference against the exact (transformers-equal) path.

Draft decodes a large JPEG at 1/2, 1/4 or 1/8 scale in the IDCT when the target grid is at least
2x smaller per side, then resizes from there. The grid is unchanged; the pixels are not quite.

    .venv/bin/python benchmarks/preprocess_draft.py [--repeats 5]
"""

from __future__ import annotations

if not __package__:  # run by path: the repository root onto sys.path, once (benchmarks/_path.py)
    import _path  # noqa: F401

import argparse
import statistics
import time

import numpy as np

from benchmarks.preprocess_throughput import encode, synth_rgb

SOURCES = [(4032, 3024), (2048, 1536), (1280, 960)]
BUDGETS = {"256 tok": 28 * 28 * 256, "1280 tok": 28 * 28 * 1280, "4096 tok": 28 * 28 * 4096}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import torch

    from preprocess import PreprocessConfig, preprocess

    torch.set_num_threads(1)  # as in a pool worker
    exact_cfg = PreprocessConfig()
    draft_cfg = exact_cfg.replace(draft=True)
    # Normalized units -> 0..255 levels, per channel.
    levels = (np.asarray(exact_cfg.image_std, dtype=np.float32) * 255).reshape(1, 3, 1)

    def timed(data: bytes, config: PreprocessConfig, budget: int):
        preprocess(data, config, budget)  # warm-up
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            out = preprocess(data, config, budget)
            times.append(time.perf_counter() - start)
        return out, statistics.median(times)

    print(f"{'source':>10} {'budget':>9} {'grid':>10} {'exact ms':>9} {'draft ms':>9} {'speedup':>8} "
          f"{'mean |d|':>9} {'p99 |d|':>8} {'max |d|':>8}  (|d| in 0-255 levels)")  # fmt: skip
    for i, (w, h) in enumerate(SOURCES):
        data = encode(synth_rgb(w, h, seed=100 + i), "JPEG")
        for label, budget in BUDGETS.items():
            exact, t_exact = timed(data, exact_cfg, budget)
            draft, t_draft = timed(data, draft_cfg, budget)
            assert draft.grid_thw == exact.grid_thw
            diff = np.abs(draft.patches - exact.patches).reshape(exact.patches.shape[0], 3, -1) * levels
            _, gh, gw = exact.grid_thw
            print(
                f"{w}x{h:<5} {label:>9} {f'{gh}x{gw}':>10} {t_exact * 1e3:9.1f} {t_draft * 1e3:9.1f} "
                f"{t_exact / t_draft:7.2f}x {diff.mean():9.2f} {np.percentile(diff, 99):8.1f} {diff.max():8.1f}"
            )


if __name__ == "__main__":
    main()
