"""`vlmserve encoder` as a process, spoken to by hand: the wire format, embeddings equal to the in-process
encoder's, one encode per key across engines, a batch that kills its worker or hangs (it fails alone and
is never run again), an engine that disconnects (its queued keys dropped unless another engine waits for
them).

The pace is set by the pool's test hook (workers hold each batch while a file exists), never by a deadline.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time

import pytest
import torch

from encoder.tier import wire
from lm_engine import LLM
from preprocess import preprocess
from tests.encoder.tier_support import RawEngine, running_pool
from tests.support import make_image


@pytest.fixture(scope="module")
def pool(tmp_path_factory, tiny_ckpt):
    yield from running_pool(tmp_path_factory, tiny_ckpt, "pool", "--workers", "2")


@pytest.fixture(scope="module")
def lone_pool(tmp_path_factory, tiny_ckpt):
    """One worker (one encoder thread): while it holds a batch, every other key waits in the queue."""
    yield from running_pool(tmp_path_factory, tiny_ckpt, "lone_pool", "--workers", "1")


TIMEOUT_S = 10  # --batch-timeout-s of ``timeout_pool``: far above a tiny batch, however busy the machine


@pytest.fixture(scope="module")
def timeout_pool(tmp_path_factory, tiny_ckpt):
    yield from running_pool(
        tmp_path_factory, tiny_ckpt, "timeout_pool", "--workers", "1", "--batch-timeout-s", str(TIMEOUT_S)
    )


@pytest.fixture(scope="module")
def inproc(tiny_ckpt):
    """The in-process path the pool must agree with."""
    with LLM(str(tiny_ckpt), num_kv_blocks=32, embedding_cache_bytes=0) as llm:
        yield llm


def encode_here(llm: LLM, data: bytes) -> torch.Tensor:
    px = preprocess(data, llm.engine.preprocess_config)
    return llm.engine.runner.encode_images(torch.from_numpy(px.patches), torch.tensor([px.grid_thw]))


def test_frames_round_trip_with_descriptors():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        reader = wire.Reader(b, max_payload=1 << 20)
        fd = wire.memfd_with(b"shared bytes")
        wire.send(a, {"op": "x", "fd": True, "size": 12}, fd=fd)
        os.close(fd)
        wire.send(a, {"op": "y"}, b"\x00payload\xff" * 1000)
        header, payload, got = reader.read()
        assert header == {"op": "x", "fd": True, "size": 12} and payload == b""
        assert wire.read_fd(got, 12) == b"shared bytes"
        header, payload, got = reader.read()
        assert header == {"op": "y"} and payload == b"\x00payload\xff" * 1000 and got is None
        a.sendall(b"NOPE" + b"\0" * 12)
        with pytest.raises(wire.ProtocolError):
            reader.read()
    c, d = socket.socketpair()
    with c, d:
        wire.send(c, {"op": "big"}, b"x" * 2048)
        with pytest.raises(wire.ProtocolError):  # past the reader's payload cap: refused before reading it
            wire.Reader(d, max_payload=1024).read()


def test_same_image_from_two_engines_is_encoded_once(pool, inproc):
    cfg = inproc.engine.preprocess_config
    shared, other = make_image(320, 240, 101, "JPEG"), make_image(200, 300, 102)
    before = pool.stats()
    pool.hold()
    with RawEngine(pool.socket_path) as e1, RawEngine(pool.socket_path) as e2:
        k_shared, k_other = e1.key(shared, cfg), e1.key(other, cfg)
        e1.encode(1, k_shared, shared)
        e1.encode(2, k_other, other)
        e2.encode(7, k_shared, shared)
        pool.wait_for(lambda s: s["waiting"] == 3, what="three waits")
        pool.release()
        got1 = {rid: emb for rid, emb, _ in (e1.result({1: k_shared, 2: k_other}) for _ in range(2))}
        rid, got2, header = e2.result({7: k_shared})
    assert rid == 7 and header["via"] == "shm"
    after = pool.stats()
    assert after["images_encoded"] - before["images_encoded"] == 2  # not 3
    assert after["joined"] - before["joined"] == 1
    assert torch.equal(got1[1], got2)
    torch.testing.assert_close(got1[1], encode_here(inproc, shared), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got1[2], encode_here(inproc, other), rtol=1e-5, atol=1e-5)


@contextlib.contextmanager
def poisoned(pool):
    """Every batch begun meanwhile dies mid-batch, wherever it runs (as if its image crashed the tower); yields
    the pids killed."""
    started = pool.started_batches()
    killed: list[int] = []
    stop = threading.Event()

    def poison() -> None:
        seen = set(started)
        while not stop.is_set():
            for pid, n in sorted(set(pool.started_batches()) - seen):
                seen.add((pid, n))
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.01)

    pool.hold()  # each batch waits at its start, so the kill lands mid-batch
    watcher = threading.Thread(target=poison, daemon=True)
    watcher.start()
    try:
        yield killed
    finally:
        stop.set()
        watcher.join()
        pool.release()


def test_a_batch_that_kills_its_worker_fails_and_is_not_run_again(pool, inproc):
    """A poisoned image kills every tower it reaches: the first death fails its batch with a clear error; no
    other worker is handed it, so one worker dies, not the pool."""
    cfg = inproc.engine.preprocess_config
    data, after_it = make_image(448, 448, 103, "JPEG"), make_image(256, 320, 109)
    before = pool.stats()
    with poisoned(pool) as killed, RawEngine(pool.socket_path) as eng:
        eng.sock.settimeout(120)  # a bound against hanging, not a pace
        key = eng.key(data, cfg)
        eng.encode(1, key, data)
        rid, emb, header = eng.result({1: key})
    assert rid == 1 and emb is None and header["kind"] == "batch_failed", header
    assert "died" in header["error"] and "not retried" in header["error"]
    after = pool.wait_for(lambda s: len(s["worker_pids"]) == 2, what="a replacement worker")
    assert len(killed) == 1 and killed[0] not in after["worker_pids"]
    assert after["worker_deaths"] - before["worker_deaths"] == 1
    assert after["failed_batches"] - before["failed_batches"] == 1
    with RawEngine(pool.socket_path) as eng:  # the pool goes on serving
        eng.sock.settimeout(120)
        key = eng.key(after_it, cfg)
        eng.encode(2, key, after_it)
        rid, emb, header = eng.result({2: key})
    assert rid == 2 and "error" not in header, header
    torch.testing.assert_close(emb, encode_here(inproc, after_it), rtol=1e-5, atol=1e-5)


def test_an_engine_does_not_encode_itself_an_image_that_killed_a_pool_worker(pool, tiny_ckpt):
    """The engine's in-process fallback is for a pool that is away, not for an image that crashed a tower:
    encoding it here could crash the engine. It fails its own request (a 500), nothing else."""
    from encoder.tier.client import EncoderBatchFailed
    from tests.encoder.test_pipeline import jobs_for
    from tests.encoder.test_tier_client import collect

    with LLM(str(tiny_ckpt), num_kv_blocks=32, embedding_cache_bytes=0, encoder_url=pool.tcp_url) as llm:
        vision = llm.engine.vision
        jobs = jobs_for(llm, [make_image(288, 224, 112, "JPEG")])
        with poisoned(pool) as killed:
            vision.submit(jobs)
            results = collect(vision, 1)
        assert isinstance(results[0].error, EncoderBatchFailed), results[0]
        assert vision.remote.fallbacks == {} and vision.stats.images == 0 and len(killed) == 1
    pool.wait_for(lambda s: len(s["worker_pids"]) == 2, what="a replacement worker")


def test_a_batch_that_hangs_times_out_and_fails_only_its_own_images(timeout_pool, inproc):
    """A worker that never finishes its batch: past --batch-timeout-s the batch's images fail with a clear
    error and the worker is replaced; the image queued behind it is encoded by the replacement."""
    pool, cfg = timeout_pool, inproc.engine.preprocess_config
    hung, behind = make_image(320, 256, 110, "JPEG"), make_image(224, 288, 111)
    before = pool.stats()
    started = pool.started_batches()
    pool.hold()
    try:
        with RawEngine(pool.socket_path) as eng:
            eng.sock.settimeout(120)  # a bound against hanging, not a pace
            k_hung, k_behind = eng.key(hung, cfg), eng.key(behind, cfg)
            eng.encode(1, k_hung, hung)
            pid, _ = pool.wait_batch_started(started)
            pool.hold_only(pid)  # this worker never finishes; its replacement is not held
            eng.encode(2, k_behind, behind)
            results = {
                rid: (emb, header)
                for rid, emb, header in (eng.result({1: k_hung, 2: k_behind}) for _ in range(2))
            }
    finally:
        pool.stop_holding()
    emb, header = results[1]
    assert emb is None and header["kind"] == "batch_failed", header
    assert f"within {TIMEOUT_S} s" in header["error"], header
    emb, header = results[2]
    assert "error" not in header, header
    torch.testing.assert_close(emb, encode_here(inproc, behind), rtol=1e-5, atol=1e-5)
    after = pool.wait_for(lambda s: len(s["worker_pids"]) == 1, what="a replacement worker")
    assert pid not in after["worker_pids"]
    assert after["timed_out_batches"] - before["timed_out_batches"] == 1
    assert after["worker_deaths"] == before["worker_deaths"]


def test_engine_gone_while_its_embeddings_are_in_flight_leaves_nothing_behind(pool, inproc):
    cfg = inproc.engine.preprocess_config
    images = [make_image(256, 256, 104), make_image(300, 180, 105, "JPEG")]
    before = pool.stats()
    pool.hold()
    eng = RawEngine(pool.socket_path)
    for i, data in enumerate(images):
        eng.encode(i, eng.key(data, cfg), data)
    pool.wait_for(lambda s: s["waiting"] == 2, what="the engine's two waits")
    eng.close()
    # Gone: its waits are dropped while its images are held in a worker (or still on their way to one).
    pool.wait_for(lambda s: s["waiting"] == 0, timeout=30, what="its waits dropped")
    pool.release()
    after = pool.wait_for(
        lambda s: s["pipeline_pending"] == 0 and s["keys_in_flight"] == 0, what="the pool drained"
    )
    dropped, cancelled = after["dropped"] - before["dropped"], after["cancelled"] - before["cancelled"]
    # Each image either finished into the pool's cache (dropped, shipped nowhere) or was never encoded.
    assert dropped + cancelled == 2
    assert after["images_encoded"] - before["images_encoded"] == dropped
    assert after["shipped"] == before["shipped"] and after["shipped_bytes"] == before["shipped_bytes"]


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in os.listdir(f"/proc/{p}/task"):
            with open(f"/proc/{p}/task/{task}/children") as f:
                kids = [int(c) for c in f.read().split()]
            out += kids
            todo += kids
    return out


def test_local_pool_gives_up_cpu_priority_to_the_engine(tiny_ckpt):
    """serve --encoder-workers starts its pool at a lower CPU priority (--encoder-nice), workers and
    preprocess processes included, and with the threads asked for; the kernel's own record is the oracle."""
    from encoder.tier.client import start_local_pool

    base = os.getpriority(os.PRIO_PROCESS, 0)
    proc, url = start_local_pool(str(tiny_ckpt), 1, "float32", "cpu", threads=1, nice=5)
    try:
        assert url.startswith("unix://")
        family = [proc.pid, *_descendants(proc.pid)]
        assert len(family) >= 2, "the pool runs its worker in a process of its own"
        assert {os.getpriority(os.PRIO_PROCESS, p) for p in family} == {min(19, base + 5)}
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        assert argv[argv.index(b"--threads") + 1] == b"1"
        # and glibc returns freed pixel buffers: the worker processes start with a fixed mmap threshold
        for pid in family[1:]:
            with open(f"/proc/{pid}/environ", "rb") as f:
                assert b"MALLOC_MMAP_THRESHOLD_=131072" in f.read().split(b"\0"), pid
    finally:
        proc.terminate()
        proc.wait(30)


def test_queued_keys_of_a_gone_engine_are_dropped_unless_another_engine_waits(lone_pool, inproc):
    pool, cfg = lone_pool, inproc.engine.preprocess_config
    running, alone, shared = make_image(256, 192, 106), make_image(192, 256, 107), make_image(224, 224, 108)
    before = pool.stats()
    started = pool.started_batches()
    pool.hold()
    gone, stays = RawEngine(pool.socket_path), RawEngine(pool.socket_path)
    try:
        k_running, k_alone, k_shared = (gone.key(d, cfg) for d in (running, alone, shared))
        gone.encode(1, k_running, running)
        pool.wait_batch_started(started)  # the only worker holds it: the keys below queue behind it
        gone.encode(2, k_alone, alone)
        gone.encode(3, k_shared, shared)
        stays.encode(9, k_shared, shared)  # single flight: this engine waits for the same key
        pool.wait_for(
            lambda s: s["pipeline_queued"] == 2 and s["waiting"] == 4, what="two keys queued behind the batch"
        )
        gone.close()
        mid = pool.wait_for(lambda s: s["waiting"] == 1, what="the gone engine's waits dropped")
        assert mid["cancelled"] - before["cancelled"] == 1  # k_alone; k_running is in the tower already
        assert mid["pipeline_pending"] == 2 and mid["keys_in_flight"] == 2  # k_running and k_shared
        pool.release()
        stays.sock.settimeout(120)  # a bound against hanging, not a pace
        rid, emb, header = stays.result({9: k_shared})
    finally:
        pool.release()
        gone.close()
        stays.close()
    assert rid == 9 and header["via"] == "shm"
    torch.testing.assert_close(emb, encode_here(inproc, shared), rtol=1e-5, atol=1e-5)
    after = pool.wait_for(
        lambda s: s["pipeline_pending"] == 0 and s["keys_in_flight"] == 0 and s["pipeline_queued"] == 0,
        what="the pool drained",
    )
    assert after["images_encoded"] - before["images_encoded"] == 2  # k_running and k_shared, never k_alone
    assert after["dropped"] - before["dropped"] == 1  # k_running: finished into the pool's cache only
    assert after["cancelled"] - before["cancelled"] == 1
    assert after["waiting"] == 0 and after["shipped"]["shm"] - before["shipped"].get("shm", 0) == 1
