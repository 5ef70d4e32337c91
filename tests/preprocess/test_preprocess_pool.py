"""PreprocessPool: same numbers as in-process preprocess(), crash isolation, no leaked shared
memory, no zombies, and an event loop that keeps running while workers are busy."""

from __future__ import annotations

import asyncio
import errno
import os
import time

import numpy as np
import pytest
import torch

from preprocess import PreprocessConfig, PreprocessError, PreprocessPool, PreprocessWorkerError, preprocess
from preprocess.worker import MAX_IDLE_SLOTS
from tests.support import run_fresh

FAULT = b"\x00VLMSERVE-TEST-FAULT:"
TICKS = 20
WAIT_S = 60.0  # a bound on waiting for a condition, far past any machine's pace: reaching it fails the test


def _our_segments(pool: PreprocessPool) -> set[str]:
    # NOTE: only this pool's segments: other pools on the machine (a server, a benchmark) have their own.
    return {name for name in os.listdir("/dev/shm") if name.startswith(pool._slot_prefix + "_")}


@pytest.fixture(scope="module")
def pool():
    with PreprocessPool(2, _fault_prefix=FAULT) as p:
        assert p.wait_ready(120)
        yield p
    assert not _our_segments(p)


@pytest.fixture(scope="module")
def images(make_image):
    return [
        make_image("jpeg", 333, 517, seed=1),
        make_image("png", 1024, 768, seed=2),
        make_image("rgba_png", 1000, 60, seed=3),
        make_image("jpeg", 400, 240, seed=4, orientation=6),
    ]


def test_pool_matches_in_process(pool, images, config):
    async def go():
        jobs = [(data, mp) for data in images for mp in (None, 28 * 28 * 64)]
        results = await asyncio.gather(*(pool.submit(data, config, mp) for data, mp in jobs))
        return jobs, results

    jobs, results = asyncio.run(go())
    for (data, mp), got in zip(jobs, results):
        want = preprocess(data, config, mp)
        assert got.grid_thw == want.grid_thw
        assert got.patches.dtype == np.float32
        assert np.array_equal(got.patches, want.patches)
    assert pool.run(images[0], config).grid_thw == preprocess(images[0], config).grid_thw


def test_bad_input_error_crosses_the_process_boundary(pool, config, images):
    with pytest.raises(PreprocessError) as info:
        pool.run(b"definitely not an image", config)
    assert info.value.code == "unsupported_format"
    with pytest.raises(PreprocessError) as info:
        pool.run(images[0], config.replace(max_bytes=10))
    assert info.value.code == "too_many_bytes"


@pytest.mark.parametrize("fault", [b"exit", b"segv"])
def test_dead_worker_fails_only_its_request(pool, images, config, fault):
    before = pool.stats.worker_restarts
    old_pids = set(pool.worker_pids())

    async def go():
        good = [pool.submit(images[i % 2], config, 28 * 28 * 64) for i in range(6)]
        bad = pool.submit(FAULT + fault, config)
        return await asyncio.gather(*good[:3], bad, *good[3:], return_exceptions=True)

    results = asyncio.run(go())
    crashed = results.pop(3)
    assert isinstance(crashed, PreprocessWorkerError)
    assert "died" in str(crashed) and ("exit code 3" in str(crashed) or "SIGSEGV" in str(crashed))
    assert all(not isinstance(r, BaseException) for r in results), results
    assert pool.stats.worker_restarts == before + 1
    assert len(pool.worker_pids()) == 2 and set(pool.worker_pids()) != old_pids
    assert pool.run(images[1], config).grid_thw == preprocess(images[1], config).grid_thw


def test_shared_memory_is_bounded_and_cleaned_up(pool, images, config):
    # Small, then larger budgets, results dropped at once: each worker reuses its slots, creates
    # bigger ones as needed and retires idle ones beyond MAX_IDLE_SLOTS, which must be unlinked.
    for budget in (28 * 28 * 16, None, 2048 * 2048):
        for data in images:
            pool.run(data, config, budget)
    live = _our_segments(pool)
    assert 0 < len(live) <= pool.num_workers * (MAX_IDLE_SLOTS + 2), live  # + one inbox each
    with pytest.raises(PreprocessError):
        pool.run(images[0][:500], config)  # truncated: fails inside the worker
    # A worker creates a segment the parent has never heard of, then dies:
    # the parent must find and unlink it, and the dead worker's older segments too.
    with pytest.raises(PreprocessWorkerError):
        pool.run(FAULT + b"late-exit", config)
    after = _our_segments(pool)
    assert after < live, (after, live)
    assert pool.run(images[1], config).grid_thw == preprocess(images[1], config).grid_thw


def _mapped_segments(array: np.ndarray) -> set[str]:
    """Names of the /dev/shm files whose mapping in this process holds `array`'s first byte."""
    address = array.ctypes.data
    names = set()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi and len(fields) >= 6 and fields[5].startswith("/dev/shm/"):
                names.add(fields[5][len("/dev/shm/") :])
    return names


def test_results_are_leased_slots_not_copies(images, config):
    # One worker, so every result comes from the same set of slots.
    with PreprocessPool(1, leases_per_worker=3) as p:
        want = [preprocess(data, config) for data in images]
        held = [p.run(data, config) for data in images[:3]]
        for got in held:
            # The array lies in one of this pool's shared-memory segments: handed over, not copied.
            assert _mapped_segments(got.patches) & _our_segments(p), "result is not in a pool slot"
            assert not got.patches.flags.owndata
        over = p.run(images[3], config)  # a fourth lease would exceed leases_per_worker
        assert over.patches.flags.owndata and not _mapped_segments(over.patches)
        assert p.stats.copied == 1
        assert np.array_equal(over.patches, want[3].patches)

        # Leased slots are never written while held: more requests, and the held results stay intact.
        tensor = torch.from_numpy(held[0].patches[5:])  # a view of a view keeps the lease too
        first = held[0].patches.copy()
        del held[0]
        for data in images * 2:
            p.run(data, config)
        assert torch.equal(tensor, torch.from_numpy(first[5:]))
        for got, w in zip(held, want[1:3]):
            assert np.array_equal(got.patches, w.patches)

        # Released leases go back to the worker: a long stream of dropped results creates nothing.
        del held, tensor, got  # (got: the loop variable above holds a result too)
        p.run(images[0], config)  # carries the releases to the worker
        segments = _our_segments(p)
        for data in images * 3:
            p.run(data, config)
        assert _our_segments(p) <= segments
        assert len(segments) <= MAX_IDLE_SLOTS + 2  # and the inbox
        copied = p.stats.copied
        assert [p.run(data, config).patches.flags.owndata for data in images] == [False] * 4
        assert p.stats.copied == copied

        kept = p.run(images[1], config)
    # The pool is closed and its segments unlinked, yet a result still held stays readable.
    assert not _our_segments(p)
    assert np.array_equal(kept.patches, want[1].patches)


def test_a_lease_outlives_its_dead_worker(images, config):
    # One worker, so the request that kills it surely reaches the worker whose slot we hold.
    with PreprocessPool(1, _fault_prefix=FAULT) as p:
        kept = p.run(images[1], config)
        name = _mapped_segments(kept.patches) & _our_segments(p)
        assert name
        with pytest.raises(PreprocessWorkerError):
            p.run(FAULT + b"exit", config)
        assert not (name & _our_segments(p))  # unlinked with its worker
        assert np.array_equal(kept.patches, preprocess(images[1], config).patches)
        assert p.run(images[0], config).grid_thw == preprocess(images[0], config).grid_thw


def test_full_shared_memory_fails_the_request_not_the_server(monkeypatch, images, config):
    # /dev/shm full: reserving the inbox's pages fails with ENOSPC (instead of a SIGBUS in the
    # server on the first write): that request gets an error, the worker and the pool carry on.
    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    with PreprocessPool(1) as p:
        assert p.wait_ready(120)
        pids = p.worker_pids()
        monkeypatch.setattr(os, "posix_fallocate", no_space)
        with pytest.raises(PreprocessWorkerError, match="no shared memory.*No space left"):
            p.run(images[0], config)
        monkeypatch.undo()
        assert np.array_equal(p.run(images[0], config).patches, preprocess(images[0], config).patches)
        assert p.worker_pids() == pids and p.stats.worker_restarts == 0
    assert not _our_segments(p)


def test_hung_worker_is_killed_after_timeout(pool, images, config):
    old = pool.timeout_s
    pool.timeout_s = 1.0
    try:
        start = time.monotonic()
        with pytest.raises(PreprocessWorkerError, match="longer than 1.0 s"):
            pool.run(FAULT + b"hang", config)
        # The hang lasts an hour: only the 1 s timeout ends it sooner.
        assert time.monotonic() - start < WAIT_S
    finally:
        pool.timeout_s = old
    assert pool.run(images[0], config).grid_thw == preprocess(images[0], config).grid_thw


def test_event_loop_keeps_ticking_while_workers_are_busy(pool, config, tmp_path):
    """Every worker is held busy until the event loop has ticked TICKS times: the jobs can only finish if
    submitting and awaiting them left the loop free (a blocked loop leaves the file unmade and the workers
    die of waiting, which fails the jobs with PreprocessWorkerError)."""
    go = tmp_path / "go"
    ticks = 0

    async def main():
        async def ticker():
            nonlocal ticks
            while ticks < TICKS:
                await asyncio.sleep(0.001)
                ticks += 1
            go.touch()

        jobs = [pool.submit(FAULT + b"wait:" + os.fsencode(go), config) for _ in range(pool.num_workers)]
        task = asyncio.create_task(ticker())
        results = await asyncio.gather(*jobs, return_exceptions=True)
        await task
        return results

    results = asyncio.run(main())
    assert ticks == TICKS
    # Not images, so once let go they fail in the worker (which lives on), not with it.
    assert all(isinstance(r, PreprocessError) for r in results), results


def test_stats_and_latency_hook(pool, images, config):
    seen: list[float] = []
    before = pool.stats.images
    pool.on_latency = seen.append
    try:
        pool.run(images[0], config)
        with pytest.raises(PreprocessError):
            pool.run(b"", config)
    finally:
        pool.on_latency = None
    assert pool.stats.images == before + 1
    assert len(seen) == 2 and all(s > 0 for s in seen)
    assert pool.stats.total_seconds >= sum(seen) and pool.stats.mean_seconds > 0


def _gone(pid: int) -> bool:
    # kill(pid, 0) still succeeds on a zombie, so this also proves the worker was reaped.
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_close_reaps_workers_and_refuses_new_work(images, config):
    p = PreprocessPool(1)
    p.run(images[0], config)
    pids = p.worker_pids()
    p.close()
    deadline = time.monotonic() + WAIT_S
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pids and all(_gone(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="closed"):
        p.run(images[0], config)
    p.close()  # idempotent


def test_spawn_start_method(images):
    config = PreprocessConfig(resize_backend="pil")  # the spawned worker still imports torch at warm-up
    with PreprocessPool(1, start_method="spawn") as p:
        got = p.run(images[2], config)
    assert np.array_equal(got.patches, preprocess(images[2], config).patches)


def test_cancelled_requests_do_not_disturb_the_pool(pool, images, config):
    async def go():
        tasks = [asyncio.create_task(pool.submit(images[1], config)) for _ in range(8)]
        await asyncio.sleep(0.01)
        for task in tasks[3:]:
            task.cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(go())
    assert all(not isinstance(r, BaseException) for r in results[:3])
    assert pool.run(images[0], config).grid_thw == preprocess(images[0], config).grid_thw
    with pytest.raises(ValueError, match="max_pixels"):
        pool.run(images[0], config, max_pixels=0)
    with pytest.raises(ValueError, match="leases_per_worker"):
        PreprocessPool(1, leases_per_worker=-1)


WORKER_IMPORTS = r"""
import json, sys
import numpy as np
from preprocess import PreprocessConfig, PreprocessPool, preprocess
from preprocess.image import pil_resize_matches_torchvision
from tests.support import make_image

def torch_loaded(pid):
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch_cpu" in f.read()

data = make_image(333, 517, 1)
report = {"pil_exact": pil_resize_matches_torchvision()}
for resample in ("bicubic", "nearest"):
    config = PreprocessConfig(resample=resample)
    with PreprocessPool(1) as pool:
        assert pool.wait_ready(120)
        got = pool.run(data, config)
        want = preprocess(data, config)
        report[resample] = {
            "equal": got.grid_thw == want.grid_thw and bool(np.array_equal(got.patches, want.patches)),
            "torch": torch_loaded(pool.worker_pids()[0]),
        }
print(json.dumps(report))
"""


def test_workers_import_torch_only_to_resize_with_it():
    """A forkserver worker resizes with PIL where PIL gives torch's bytes (the parent's verdict), so it never
    loads libtorch (seconds of start-up per pool); resampling that needs torch (nearest-exact) imports it
    there and still gives in-process numbers. A fresh process, so no other pool has preloaded torch."""
    report = run_fresh(WORKER_IMPORTS)
    assert report["bicubic"]["equal"] and report["nearest"]["equal"]
    assert report["bicubic"]["torch"] == (not report["pil_exact"])
    assert report["nearest"]["torch"]
