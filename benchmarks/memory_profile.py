"""Where a server's memory goes between two points of a soak: Python objects and the C heap, measured.

Runs the app in this process (uvicorn on a thread, 127.0.0.1, a free port; the configuration ``vlmserve
serve`` gives it), drives it with one of ``benchmarks/soak.py``'s mixes from ``--concurrency`` clients and,
once ``--first`` and again once ``--second`` requests have finished (clients drained, ``gc.collect()``),
takes: a tracemalloc snapshot (started after start-up), a census of gc-tracked objects by type, glibc's
``mallinfo2`` (bytes in use, free but kept in the heap, mmapped) and arena count, and this process's RSS
and PSS. Prints the differences: the allocation sites that grew, the types whose instances grew, and where
the rest of the growth sits (in use vs kept free by the allocator).

    .venv/bin/python benchmarks/memory_profile.py --mix text --first 500 --second 1500
    .venv/bin/python benchmarks/memory_profile.py --mix distinct-random --env MALLOC_ARENA_MAX=2

``--env`` is applied to this process before torch is imported (allocator and oneDNN settings read it once).
"""

from __future__ import annotations

if not __package__:  # run by path: the repository root onto sys.path, once (benchmarks/_path.py)
    import _path  # noqa: F401

import argparse
import asyncio
import contextlib
import ctypes
import gc
import os
import sys
import threading
import time
import tracemalloc
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import httpx

from benchmarks import harness, soak


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks")
        + ("uordblks", "fordblks", "keepcost")
    ]


def malloc_state() -> dict[str, float]:
    """glibc's view, MB: sbrk heap (``arena``), in use (``uordblks``), free but kept (``fordblks``), mmapped
    (``hblkhd``); and the number of arenas (``malloc_info``'s heaps)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    mi = libc.mallinfo2()
    out = {k: getattr(mi, k) / 2**20 for k in ("arena", "uordblks", "fordblks", "hblkhd")}
    path = f"/tmp/vlmserve-malloc-info-{os.getpid()}.xml"
    libc.fopen.restype = ctypes.c_void_p
    fp = libc.fopen(path.encode(), b"w")
    libc.malloc_info(0, ctypes.c_void_p(fp))
    libc.fclose(ctypes.c_void_p(fp))
    out["arenas"] = Path(path).read_text().count("<heap nr=")
    os.unlink(path)
    return out


def census() -> Counter[str]:
    return Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects())


def own_memory() -> dict[str, float]:
    m = soak.smaps_rollup(os.getpid())
    return {"rss_mb": m["Rss"] / 1024, "pss_mb": m["Pss"] / 1024}


def take(label: str) -> dict:
    gc.collect()
    return {
        "label": label,
        "snapshot": tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen *>")]
        ),
        "census": census(),
        "malloc": malloc_state(),
        "memory": own_memory(),
    }


# ---------------------------------------------------------------- the in-process server


def start_server(model: Path, port: int):
    import uvicorn

    from api.config import ServerArgs
    from api.server import create_app
    from lm_engine.config import EngineConfig

    engine = EngineConfig(
        model=str(model), preprocess_workers=min(4, os.cpu_count() or 1), visual_budget="adaptive"
    )
    app = create_app(ServerArgs(engine=engine, served_model_names=["soak"], log_level="warning"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.1)
    return server, thread


async def send(client: httpx.AsyncClient, indices: range, args: argparse.Namespace, run: soak.Run) -> None:
    todo = iter(indices)

    async def loop() -> None:
        for i in todo:
            body = await asyncio.to_thread(soak.make_body, args.mix, i, args.seed, args.max_tokens)
            await soak._one(client, body, run)
            run.done += 1

    await asyncio.gather(*(loop() for _ in range(args.concurrency)))


async def drive(base_url: str, args: argparse.Namespace) -> list[dict]:
    run = soak.Run(args.second)
    points = []
    async with httpx.AsyncClient(base_url=base_url, timeout=120.0, trust_env=False) as client:
        await send(client, range(10**7, 10**7 + args.warmup), args, soak.Run(0))
        tracemalloc.start(args.frames)
        await send(client, range(0, args.first), args, run)
        points.append(take(f"after {args.first}"))
        await send(client, range(args.first, args.second), args, run)
        points.append(take(f"after {args.second}"))
    print(f"statuses: {run.statuses}; errors: {run.errors[:3]}", flush=True)
    return points


# ---------------------------------------------------------------- report


def report(a: dict, b: dict, top: int) -> str:
    lines = [f"== {a['label']} → {b['label']} =="]
    for key in ("memory", "malloc"):
        diffs = ", ".join(f"{k} {a[key][k]:.1f} → {b[key][k]:.1f}" for k in a[key])
        lines.append(f"{key}: {diffs}")
    stats = b["snapshot"].compare_to(a["snapshot"], "lineno")
    total = sum(s.size_diff for s in stats)
    lines.append(f"\ntracemalloc: {total / 2**20:+.2f} MB of traced Python allocations; top sites:")
    lines += [
        f"  {s.size_diff / 1024:+9.1f} KiB {s.count_diff:+7d} blocks  {s.traceback}" for s in stats[:top]
    ]
    lines.append("\ntop sites' callers:")
    for s in b["snapshot"].compare_to(a["snapshot"], "traceback")[: min(top, 5)]:
        lines.append(f"  {s.size_diff / 1024:+9.1f} KiB:")
        lines += [f"      {frame}" for frame in s.traceback.format()[-12:]]
    grown = (b["census"] - a["census"]).most_common(top)
    lines.append("\ngc-tracked objects that grew in number:")
    lines += [f"  {n:+8d}  {name}" for name, n in grown]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mix", default="distinct-random", choices=soak.MIXES)
    p.add_argument("--first", type=int, default=500)
    p.add_argument("--second", type=int, default=1500)
    p.add_argument("--concurrency", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--frames", type=int, default=12, help="tracemalloc traceback depth")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    p.add_argument("--model", help="this checkpoint directory instead of a generated preset")
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE set before torch is imported")
    p.add_argument("--out", default=None, help="also write the report here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.update(dict(kv.split("=", 1) for kv in args.env))
    model = harness.ensure_checkpoint(args.preset, 0, args.model)
    server, thread = start_server(model, harness.free_port())
    try:
        points = asyncio.run(drive(f"http://127.0.0.1:{server.config.port}", args))
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    text = report(*points, args.top)
    print(text)
    if args.out:
        with contextlib.suppress(OSError):
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
