"""Identity hash candidates on this CPU: throughput, whether they let other Python threads run, and what the
choice costs a request.

Image identity, embedding keys and prefix-block chains use one algorithm (preprocess/hashing.py). The default
must be cryptographic (clients choose the bytes, and XXH3 collisions are built in milliseconds:
tests/xxh3_collision.py) and the same on every machine (replicas share Redis), so it is picked once, from this
measurement: the fastest cryptographic candidate. xxh3 is the baseline (today's speed, the trusted opt-in).

1. MB/s of each candidate on random bytes of several sizes (best of ``--repeats``), and each against xxh3.
2. Whether a call lets other Python threads run: the longest pause of a Python thread while another hashes
   96 MB once, against the call's own time (a call that holds the GIL pauses it throughout, as the bytes.count
   control shows). The API hashes images on its prompt threads beside the event loop and the engine thread.
3. Per-request cost: ``InputProcessor.process_image`` (hash, header probe, grid plan, key) on a 2 MP and a 4 MP
   JPEG, a 4 MP PNG and a 12 MB BMP, under xxh3 and under each cryptographic candidate (best of repeats).

    .venv/bin/python benchmarks/hashing.py [--repeats 9]

Prints the CPU flags that decide these rates (sha_ni for sha256, avx512/avx2 for blake3) and writes its JSON
under ``benchmarks/results/hashing/``.
"""

from __future__ import annotations

if not __package__:  # run by path: the repository root onto sys.path, once (benchmarks/_path.py)
    import _path  # noqa: F401

import argparse
import json
import os
import platform
import threading
import time
from pathlib import Path

from benchmarks.preprocess_throughput import encode, synth_rgb
from preprocess.hashing import DEFAULT_HASH, HASH_ALGORITHMS, TRUSTED_ONLY, digest

RESULTS = Path(__file__).parent / "results" / "hashing"
SIZES_MB = (0.0625, 1, 4, 8, 12)
CRYPTOGRAPHIC = tuple(a for a in HASH_ALGORITHMS if a not in TRUSTED_ONLY)
_FLAGS = ("sha_ni", "avx2", "avx512f", "avx512vl", "avx512bw", "vaes", "aes")


def cpu_flags() -> str:
    """The model name and the flags the candidates' fast paths use, from /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    info = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    info = {k.strip(): v.strip() for k, v in info.items()}
    have = set(info.get("flags", "").split())
    return f"{info.get('model name', '?')}; {' '.join(f for f in _FLAGS if f in have) or 'none of ' + str(_FLAGS)}"


def best_seconds(fn, repeats: int) -> float:
    fn()  # once untimed (first touch of the buffer, lazy set-up)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def throughput(repeats: int) -> dict[str, dict[str, float]]:
    """MB/s per algorithm per size (MB = 10^6 bytes)."""
    out: dict[str, dict[str, float]] = {a: {} for a in HASH_ALGORITHMS}
    for mb in SIZES_MB:
        data = os.urandom(int(mb * 1_000_000))
        for a in HASH_ALGORITHMS:
            seconds = best_seconds(lambda a=a, data=data: digest(data, a), repeats)
            out[a][str(mb)] = len(data) / seconds / 1e6
    return out


def longest_stall(fn) -> tuple[float, float]:
    """(longest pause of another Python thread while ``fn`` runs once in a thread, ``fn``'s own time), in ms.
    A call that holds the GIL pauses the other thread for all of it; one that releases it, for no more than the
    OS scheduler does."""
    done, span = threading.Event(), [0.0, 0.0]

    def work() -> None:
        span[0] = time.perf_counter()
        fn()
        span[1] = time.perf_counter()
        done.set()

    stamps = [time.perf_counter()]
    t = threading.Thread(target=work)
    t.start()
    while not done.is_set():
        stamps.append(time.perf_counter())
        time.sleep(0.0002)
    stamps.append(time.perf_counter())
    t.join()
    gaps = [b - a for a, b in zip(stamps, stamps[1:]) if b > span[0] and a < span[1]]
    return max(gaps, default=0.0) * 1e3, (span[1] - span[0]) * 1e3


def gil_stalls(mb: int = 96, rounds: int = 3) -> dict[str, tuple[float, float]]:
    """Per candidate, and for a call known to hold the GIL (bytes.count), the round with the shortest stall."""
    data = os.urandom(mb * 1_000_000)
    calls = {a: (lambda a=a: digest(data, a)) for a in HASH_ALGORITHMS}
    calls["control: bytes.count (holds the GIL)"] = lambda: data.count(b"\x00\x01\x02")
    return {
        name: min((longest_stall(fn) for _ in range(rounds)), key=lambda r: r[0])
        for name, fn in calls.items()
    }


def request_images() -> dict[str, bytes]:
    images = {
        "2 MP JPEG (1600x1200)": encode(synth_rgb(1600, 1200, 1), "JPEG"),
        "4 MP JPEG (2304x1728)": encode(synth_rgb(2304, 1728, 2), "JPEG"),
        "4 MP PNG (2304x1728)": encode(synth_rgb(2304, 1728, 3), "PNG"),
        "12 MB BMP (2000x2000)": encode(synth_rgb(2000, 2000, 4), "BMP"),
    }
    return images


def per_request(repeats: int) -> dict[str, dict]:
    """``process_image`` per image (ms) under each algorithm, on the shipped demo checkpoint's processor."""
    from lm_engine.models.registry import load_model_config
    from lm_engine.processor import InputProcessor
    from preprocess import PreprocessConfig
    from tools.demo import demo_checkpoint

    path = demo_checkpoint()
    cfg, pp = load_model_config(path), PreprocessConfig.from_checkpoint(path)
    processors = {a: InputProcessor(path, cfg, pp, a) for a in HASH_ALGORITHMS}
    out = {}
    for name, data in request_images().items():
        ms = {
            a: best_seconds(lambda p=p, data=data: p.process_image(data), repeats) * 1e3
            for a, p in processors.items()
        }
        out[name] = {"bytes": len(data), "ms": ms}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()

    flags = cpu_flags()
    print(f"CPU: {flags}  ({os.cpu_count()} logical cores; load average {os.getloadavg()[0]:.2f})")

    rates = throughput(args.repeats)
    print("\nthroughput, MB/s (best of repeats; in brackets: its rate over xxh3's)")
    print(f"{'size MB':>8} " + " ".join(f"{a:>18}" for a in HASH_ALGORITHMS))
    for mb in SIZES_MB:
        cells = []
        for a in HASH_ALGORITHMS:
            r = rates[a][str(mb)]
            cells.append(f"{r:10.0f}" + (f" [{r / rates['xxh3'][str(mb)]:5.3f}]" if a != "xxh3" else " " * 8))
        print(f"{mb:8g} " + " ".join(f"{c:>18}" for c in cells))
    at = {a: rates[a]["12"] for a in CRYPTOGRAPHIC}
    fastest = max(at, key=at.get)
    others = ", ".join(f"{a} {at[fastest] / r:.1f}x" for a, r in at.items() if a != fastest)
    print(f"fastest cryptographic at 12 MB: {fastest} (against {others}); the default is {DEFAULT_HASH}")

    stalls = gil_stalls()
    print("\nlongest pause of another Python thread during one 96 MB call (ms), of the call's own time (ms):")
    for name, (pause, call) in stalls.items():
        print(f"  {name:>38}: {pause:6.1f} of {call:6.1f}")

    requests = per_request(args.repeats)
    print("\nInputProcessor.process_image, ms per image (best of repeats)")
    print(
        f"{'image':>24} {'MB':>6} "
        + " ".join(f"{a:>9}" for a in HASH_ALGORITHMS)
        + f"  {DEFAULT_HASH} - xxh3"
    )
    for name, row in requests.items():
        ms = row["ms"]
        print(
            f"{name:>24} {row['bytes'] / 1e6:6.2f} "
            + " ".join(f"{ms[a]:9.2f}" for a in HASH_ALGORITHMS)
            + f"  {ms[DEFAULT_HASH] - ms['xxh3']:+.2f} ms ({ms[DEFAULT_HASH] / ms['xxh3']:.2f}x)"
        )

    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{time.strftime('%Y%m%d-%H%M%S')}.json"
    record = {
        "cpu": flags,
        "machine": platform.machine(),
        "cores": os.cpu_count(),
        "load_average": os.getloadavg()[0],
        "default": DEFAULT_HASH,
        "fastest_cryptographic_12mb": fastest,
        "mb_per_s": rates,
        "gil_stall_ms_of_call_ms_96mb": stalls,
        "process_image_ms": requests,
    }
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
