"""Decoding only the GOPs that hold the sampled frames (preprocess/video.py) against decoding every frame and
picking (what transformers' PyAV loader does), on generated clips: CPU seconds per clip, one thread, best of 3.

    .venv/bin/python benchmarks/video_decode.py            # 60 s at 640x360, 30 fps; GOP 1 s and 8 s
    .venv/bin/python benchmarks/video_decode.py --seconds 20
    .venv/bin/python benchmarks/video_decode.py --torchcodec   # also torchcodec's get_frames_at, where installed

The frames each way decodes are compared (they must be equal; torchcodec's colour conversion is compared, not
required equal). torchcodec is not a dependency: it needs the system's FFmpeg libraries and a wheel matched to
the torch build (``pip install --no-deps torchcodec`` beside Debian's libavcodec59 and friends, for this run).
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


def decode_torchcodec(data: bytes, indices: tuple[int, ...]) -> np.ndarray:
    """The same frames through torchcodec (its exact seek mode: it scans the file for every frame's position
    first, then decodes from the keyframe before each wanted frame), one FFmpeg thread, RGB24 HWC."""
    from torchcodec.decoders import VideoDecoder

    decoder = VideoDecoder(data, seek_mode="exact", num_ffmpeg_threads=1, dimension_order="NHWC")
    return decoder.get_frames_at(list(indices)).data.numpy()


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
    p.add_argument(
        "--torchcodec", action="store_true", help="also time torchcodec's decode of the same frames"
    )
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
        if args.torchcodec:
            theirs = decode_torchcodec(data, plan.indices)
            reference = decode_all(data, plan.indices)
            diff = np.abs(theirs.astype(int) - reference.astype(int))
            t_tc = best(decode_torchcodec, data, plan.indices)
            print(
                f"{'  torchcodec, decode only':<34}{len(plan.indices):>14}{'':>10}{t_tc:>13.2f}"
                f"{t_all / t_tc:>7.1f}x   (pixels off PyAV's rgb24: {np.mean(diff > 0):.1%}, at most {diff.max()})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
