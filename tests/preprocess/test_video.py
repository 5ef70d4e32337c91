"""Video preprocessing against transformers' video processors (Qwen2-VL's and Qwen3-VL's): the frames each family
samples, and the patches and grid made from the same frames; decoding that seeks against decoding everything."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
import torch

from preprocess import PreprocessError
from preprocess.video import (
    VideoConfig,
    decode_frames,
    pack_frames,
    plan_video,
    preprocess_video,
    probe_video,
)
from tests.support import make_clip, make_image


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def family(request, tiny_ckpt, qwen3_tiny_ckpt):
    from transformers import AutoProcessor

    ckpt = tiny_ckpt if request.param == "qwen2" else qwen3_tiny_ckpt
    return VideoConfig.from_checkpoint(ckpt, request.param), AutoProcessor.from_pretrained(
        str(ckpt)
    ).video_processor


def _all_frames(data: bytes) -> list[np.ndarray]:
    with av.open(io.BytesIO(data)) as c:
        return [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]


def _reference(vp, frames: np.ndarray, plan, info):
    from transformers.video_utils import VideoMetadata

    md = VideoMetadata(total_num_frames=info.frames, fps=info.fps, width=info.width, height=info.height,
                       frames_indices=list(plan.indices))  # fmt: skip
    return vp(videos=[frames], video_metadata=[md], do_sample_frames=False, cap_pixels_per_frame=False,
              return_tensors="pt")  # fmt: skip


@pytest.mark.parametrize(
    "frames,size,fps,gop",
    [(7, (64, 48), 4, 3), (20, (90, 50), 8, 5), (13, (40, 72), 2, 100)],
)
def test_sampling_and_patches_equal_transformers(family, frames, size, fps, gop):
    from transformers.video_utils import VideoMetadata

    config, vp = family
    clip = make_clip(frames=frames, width=size[0], height=size[1], fps=fps, gop=gop)
    info = probe_video(clip, config)
    assert (info.frames, info.width, info.height, info.fps) == (frames, *size, fps)
    plan = plan_video(info, config)
    md = VideoMetadata(total_num_frames=frames, fps=float(fps), width=size[0], height=size[1])
    assert list(plan.indices) == [int(i) for i in vp.sample_frames(md, fps=config.fps)]
    decoded = decode_frames(clip, plan, config)
    everything = _all_frames(clip)  # seeking decodes exactly the frames a full decode gives
    assert all(np.array_equal(decoded[k], everything[i]) for k, i in enumerate(plan.indices))
    patches, grid = preprocess_video(clip, config, plan)
    ref = _reference(vp, decoded, plan, info)
    assert tuple(ref["video_grid_thw"][0].tolist()) == grid
    assert torch.equal(torch.from_numpy(patches), ref["pixel_values_videos"])


def test_odd_frame_list_pads_the_last_temporal_patch(family):
    config, vp = family
    frames = [make_image(56, 42, seed, "PNG") for seed in range(5)]
    info = probe_video(pack_frames(frames), config, list_fps=2.0)
    plan = plan_video(info, config)
    assert plan.indices == (0, 1, 2, 3, 4) and plan.grid[0] == 3
    patches, grid = preprocess_video(pack_frames(frames), config, plan)
    ref = _reference(vp, decode_frames(pack_frames(frames), plan, config), plan, info)
    assert tuple(ref["video_grid_thw"][0].tolist()) == grid
    assert torch.equal(torch.from_numpy(patches), ref["pixel_values_videos"])


def test_request_overrides_change_the_plan(family):
    config, _ = family
    info = probe_video(make_clip(frames=24, width=160, height=120, fps=8), config)
    base = plan_video(info, config)
    assert len(plan_video(info, config, fps=4.0).indices) > len(base.indices)
    assert len(plan_video(info, config, fps=8.0, max_frames=6).indices) <= 6
    small = plan_video(info, config, max_pixels=config.factor**2 * 2 * 4)
    assert small.grid[1] * small.grid[2] < base.grid[1] * base.grid[2]
    with pytest.raises(PreprocessError) as e:
        plan_video(info, config, max_frames=config.max_sampled_frames + 1)
    assert e.value.code == "too_many_frames"


FAULT = b"\x00VLMSERVE-TEST-FAULT:"


def test_pool_decodes_videos_and_a_dead_worker_leaks_nothing(tiny_ckpt):
    import os

    from preprocess import PreprocessPool, PreprocessWorkerError
    from preprocess.video import VideoJob

    config = VideoConfig.from_checkpoint(tiny_ckpt, "qwen2")
    clip = make_clip(frames=12, width=80, height=60, fps=4, gop=4)
    job = VideoJob(config, plan_video(probe_video(clip, config), config))
    want, grid = preprocess_video(clip, config, job.plan)
    with PreprocessPool(1, _fault_prefix=FAULT) as pool:
        assert pool.wait_ready(120)
        ours = lambda: {n for n in os.listdir("/dev/shm") if n.startswith(pool._slot_prefix + "_")}  # noqa: E731
        got = pool.run(clip, job)
        assert got.grid_thw == grid and np.array_equal(got.patches, want)
        del got
        # A worker that made an output slot and died (as a decoder crashing mid-clip would): the request
        # fails alone, the slot and the dead worker's other segments are unlinked, the next video decodes.
        before = ours()
        with pytest.raises(PreprocessWorkerError):
            pool.run(FAULT + b"late-exit", job)
        assert not (ours() - before)
        with pytest.raises(PreprocessError) as e:
            pool.run(clip[: len(clip) // 2], job)  # truncated: fails inside the worker, as a client error
        assert e.value.code == "corrupt"
        again = pool.run(clip, job)
        assert np.array_equal(again.patches, want)
        del again
    assert not ours()


@pytest.mark.parametrize(
    "codec,fmt", [("libx264", "mp4"), ("libvpx-vp9", "webm"), ("mjpeg", "avi"), ("libx264", "matroska")]
)
def test_seeking_decodes_the_frames_a_full_decode_gives(codec, fmt):
    """Other codecs and containers (H.264 with B-frames, VP9 in WebM without a frame count in its header,
    MJPEG in AVI): the frames picked by seeking equal those of a full decode."""
    config = VideoConfig(min_frames=2)
    clip = make_clip(frames=30, width=64, height=48, fps=10, codec=codec, fmt=fmt, gop=6)
    info = probe_video(clip, config)
    assert info.frames == 30
    plan = plan_video(info, config, fps=2.0)
    decoded = decode_frames(clip, plan, config)
    everything = _all_frames(clip)
    assert len(everything) == 30
    assert all(np.array_equal(decoded[k], everything[i]) for k, i in enumerate(plan.indices))
