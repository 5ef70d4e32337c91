"""Decoding only the GOPs that hold the sampled frames (preprocess/video.py) against decoding every frame and
picking (what transformers' PyAV loader does), on generated clips: CPU seconds per clip, one thread, best of 3.

    .venv/bin/python benchmarks/video_decode.py            # 60 s at 640x360, 30 fps; GOP 1 s and 8 s
    .venv/bin/python benchmarks/video_decode.py --seconds 20

The frames each way decodes are compared (they must be equal).
"""

from __future__ import annotations

if not __package__:  # run by path: the repository root onto sys.path, once (benchmarks/_path.py)
    import _path  # noqa: F401

import argparse
import io
import sys
import time

import av
import numpy as np
import torch

from benchmarks.harness import OUT_DIR, machine, machine_line
from preprocess.video import VideoConfig, decode_frames, plan_video, probe_video
from tests.support import make_clip


def decode_all(data: bytes, indices: tuple[int, ...]) -> np.ndarray:
    with av.open(io.BytesIO(data)) as c:
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    return np.stack([frames[i] for i in indices])


def best(fn, *args, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t = time.process_time()
        fn(*args)
        times.append(time.process_time() - t)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="video_decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=int, default=60)
    p.add_argument("--width", type=int, default=640)
    p.add_argument("--height", type=int, default=360)
    p.add_argument("--fps", type=int, default=30)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    config = VideoConfig(max_sampled_frames=64)
    folder = OUT_DIR / "video_decode"
    folder.mkdir(parents=True, exist_ok=True)
    print(machine_line(machine()))
    print(f"{'clip':<34}{'frames picked':>14}{'all (s)':>10}{'seeking (s)':>13}{'ratio':>8}")
    for gop_s in (1, 8):
        gop = gop_s * args.fps
        path = folder / f"{args.seconds}s-{args.width}x{args.height}-{args.fps}fps-gop{gop}.mp4"
        if not path.is_file():
            frames = args.seconds * args.fps
            path.write_bytes(make_clip(frames, args.width, args.height, args.fps, gop=gop))
        data = path.read_bytes()
        plan = plan_video(probe_video(data, config), config)
        ours = decode_frames(data, plan, config)
        assert np.array_equal(ours, decode_all(data, plan.indices)), "seeking decoded other frames"
        t_all = best(decode_all, data, plan.indices)
        t_seek = best(decode_frames, data, plan, config)
        name = f"{args.seconds}s {args.width}x{args.height} GOP {gop_s}s"
        print(f"{name:<34}{len(plan.indices):>14}{t_all:>10.2f}{t_seek:>13.2f}{t_all / t_seek:>7.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
