"""Document-page QA through `vlmserve cluster --replicas 2`: routing by image against round-robin.

The same report pages as benchmarks/docqa.py (letter size at 150/200 dpi, PNG and JPEG), each asked several
questions; the questions of all pages are shuffled (as they arrive from many users) and sent as `data:` URLs
by a few concurrent clients to a fresh cluster per mode, the only difference being the balancer's routing:

  image        the cluster's rules: a page's questions meet on one replica (consistent hash of the image)
  round-robin  each request to the next replica in turn (HAProxy's `balance roundrobin`)

Both share Redis (a fresh key prefix per mode), so a page encoded on one replica is an embedding-cache hit
on the other; only the KV prefix cache is per replica. Each replica's KV pool holds `--cache-pages` pages
beyond its running requests: fewer than all the pages (a working set larger than one replica's cache, as
in production) but more than half (what each replica owns under image routing). `--kv-blocks 0` leaves
the pool to the server's own sizing (large: every page fits everywhere, and only the first question of a
page on each replica misses).

    .venv/bin/python benchmarks/cluster_docqa.py           # 16 pages x 4 questions, small preset (~10 min on 2 cores)
    .venv/bin/python benchmarks/cluster_docqa.py --quick   # 6 pages x 3 questions, tiny preset (~1 min)

Prints, per mode: requests/s, the prefix-cache hit rate (prompt tokens served by the replicas' prefix caches
/ prompt tokens, from their /metrics), the embedding-cache hit rate (L1 + Redis hits / lookups), requests per
replica; and the ratio of the prefix hit rates (target >= 1.5). Writes benchmarks/out/cluster-docqa-PxQ/.
"""

from __future__ import annotations

if not __package__:  # run by path: the repository root onto sys.path, once (benchmarks/_path.py)
    import _path  # noqa: F401

import argparse
import base64
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.docqa import OUT_DIR, QUESTIONS, write_pages
from benchmarks.harness import ensure_checkpoint, free_port

ROOT = Path(__file__).resolve().parents[1]

MODES = ("image", "round-robin")


def blocks_per_page(ckpt: Path, pages: list[Path], block_size: int, text_tokens: int = 64) -> int:
    """KV blocks one page's prompt needs at the checkpoint's max_pixels (the largest page)."""
    from PIL import Image

    from preprocess.config import PreprocessConfig
    from preprocess.grid import smart_resize

    cfg = PreprocessConfig.from_checkpoint(ckpt)
    factor = cfg.patch_size * cfg.merge_size
    tokens = 0
    for page in pages:
        w, h = Image.open(page).size
        rh, rw = smart_resize(h, w, factor=factor, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
        tokens = max(tokens, rh * rw // factor**2)
    return math.ceil((tokens + text_tokens) / block_size)


def requests_for(pages: list[Path], questions: int, max_tokens: int, seed: int) -> list[dict]:
    out = []
    for p, page in enumerate(pages):
        mime = "image/png" if page.suffix == ".png" else "image/jpeg"
        url = f"data:{mime};base64,{base64.b64encode(page.read_bytes()).decode()}"
        for q in range(questions):
            content = [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": QUESTIONS[(p + q) % len(QUESTIONS)]},
            ]
            body = {
                "model": "bench",
                "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "user": f"reader-{random.Random(seed * 1000 + p * 10 + q).randrange(1000)}",
            }
            out.append({"page": p, "body": json.dumps(body).encode()})
    random.Random(seed).shuffle(out)
    return out


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=60).text):
        for s in family.samples:
            key = s.name + (
                "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else ""
            )
            out[key] = s.value
    return out


def start_cluster(mode: str, ckpt: Path, work: Path, args: argparse.Namespace, kv_blocks: int) -> tuple:
    run_dir = work / f"run-{mode}"
    port, base = free_port(), free_port()
    prefix = f"vlmserve-bench-{uuid.uuid4().hex[:8]}:"
    serve = ["--max-num-seqs", "16", "--visual-budget", "fixed", "--uvicorn-log-level", "warning",
             "--redis-key-prefix", prefix]  # fmt: skip
    if kv_blocks:
        serve += ["--num-kv-blocks", str(kv_blocks)]
    cmd = [sys.executable, "-m", "api.cli", "cluster", "--replicas", str(args.replicas), "--model", str(ckpt),
           "--served-model-name", "bench", "--port", str(port), "--replica-base-port", str(base),
           "--run-dir", str(run_dir), "--redis-url", args.redis_url, "--routing", mode,
           *args.cluster_args.split(), "--", *serve, *args.serve_args.split()]  # fmt: skip
    shutil.rmtree(run_dir, ignore_errors=True)  # logs of an earlier run would mix with this one's
    run_dir.mkdir(parents=True)
    log = open(run_dir / "launcher.log", "w")  # noqa: SIM115 - the child writes to it until it exits
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 900
    state_path = run_dir / "cluster.json"
    while not (state_path.exists() and json.loads(state_path.read_text())["ready"]):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"cluster did not start:\n{(run_dir / 'launcher.log').read_text()[-4000:]}")
        time.sleep(0.5)
    return proc, json.loads(state_path.read_text()), prefix


def run_mode(mode: str, reqs: list[dict], ckpt: Path, work: Path, args, kv_blocks: int) -> dict:
    proc, state, prefix = start_cluster(mode, ckpt, work, args, kv_blocks)
    print(
        f"[{mode}] cluster up ({state['url']}); sending {len(reqs)} requests, {args.concurrency} at a time",
        flush=True,
    )
    http = httpx.Client(base_url=state["url"], timeout=600)

    def send(r: dict) -> dict:
        resp = http.post(
            "/v1/chat/completions", content=r["body"], headers={"Content-Type": "application/json"}
        )
        usage = resp.json().get("usage", {}) if resp.status_code == 200 else {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return {"page": r["page"], "status": resp.status_code, "replica": resp.headers.get("x-vlmserve-replica"),
                "prompt_tokens": usage.get("prompt_tokens", 0), "cached_tokens": cached}  # fmt: skip

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(send, reqs))
        wall = time.perf_counter() - t0
        per_replica = [scrape(r["url"]) for r in state["replicas"]]
    finally:
        http.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(300)
        clean_redis(args.redis_url, prefix)
    return summarize(mode, results, per_replica, wall)


def summarize(mode: str, results: list[dict], per_replica: list[dict], wall: float) -> dict:
    def total(name: str) -> float:
        return sum(m.get(name, 0.0) for m in per_replica)

    l1_hits, l1_misses = (
        total("vlmserve_embedding_cache_hits_total{tier=memory}"),
        total("vlmserve_embedding_cache_misses_total{tier=memory}"),
    )
    l2_hits = total("vlmserve_embedding_cache_hits_total{tier=redis}")
    lookups = l1_hits + l1_misses
    pages_per_replica = Counter((r["replica"], r["page"]) for r in results)
    ok = [r for r in results if r["status"] == 200]
    return {
        "mode": mode,
        "requests": len(results),
        "ok": len(ok),
        "wall_s": wall,
        "requests_per_s": len(ok) / wall,
        "prefix_hit_rate": total("vlmserve_prefix_cache_hits_total") / max(1.0, total("vlmserve_prefix_cache_queries_total")),
        "cached_token_share": sum(r["cached_tokens"] for r in ok) / max(1, sum(r["prompt_tokens"] for r in ok)),
        "embedding_hit_rate": (l1_hits + l2_hits) / lookups if lookups else 0.0,
        "embedding_l1_hits": l1_hits,
        "embedding_redis_hits": l2_hits,
        "embedding_lookups": lookups,
        "requests_per_replica": dict(Counter(r["replica"] for r in results)),
        "page_copies": len(pages_per_replica),  # (replica, page) pairs: how many replicas prefilled each page
        "loadavg_1m": os.getloadavg()[0],
    }  # fmt: skip


def clean_redis(url: str, prefix: str) -> None:
    import redis

    try:
        client = redis.Redis.from_url(url, socket_timeout=5)
        keys = list(client.scan_iter(match=f"{prefix}*", count=500))
        if keys:
            client.delete(*keys)
        client.close()
    except (redis.RedisError, OSError):
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster", "--replicas", dest="replicas", type=int, default=2)
    ap.add_argument("--pages", type=int, default=16)
    ap.add_argument("--questions", type=int, default=4, help="questions per page")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--preset", choices=["tiny", "small"], default="small")
    ap.add_argument("--cache-pages", type=int, default=10, help="pages each replica's KV pool keeps cached")
    ap.add_argument(
        "--kv-blocks", type=int, default=None, help="KV blocks per replica (0: the server sizes it)"
    )
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/11")
    ap.add_argument("--serve-args", default="", help="extra `vlmserve serve` flags for every replica")
    ap.add_argument(
        "--cluster-args", default="", help="extra `vlmserve cluster` flags, e.g. '--balance-factor 200'"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="6 pages x 3 questions on the tiny preset")
    args = ap.parse_args()
    if args.quick:
        args.pages, args.questions, args.preset, args.cache_pages = 6, 3, "tiny", 4
    os.chdir(ROOT)
    ckpt = ensure_checkpoint(args.preset)
    work = OUT_DIR / f"cluster-docqa-{args.pages}x{args.questions}"
    pages = write_pages(work / "pages", args.pages)
    bpp = blocks_per_page(ckpt, pages, block_size=16)
    kv_blocks = args.kv_blocks if args.kv_blocks is not None else (args.cache_pages + args.concurrency) * bpp
    reqs = requests_for(pages, args.questions, args.max_tokens, args.seed)
    print(
        f"{args.pages} pages x {args.questions} questions = {len(reqs)} requests, shuffled; {args.preset} preset; "
        f"{args.replicas} replicas, KV pool {kv_blocks or 'sized by the server'} blocks each "
        f"(~{bpp} per page); load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    results = {m: run_mode(m, reqs, ckpt, work, args, kv_blocks) for m in MODES}
    header = f"{'routing':<13}{'req/s':>7}{'prefix hit':>11}{'emb hit':>9}{'(L1/Redis/lookups)':>20}{'page copies':>12}  per replica"
    print("\n" + header + "\n" + "-" * (len(header) + 12))
    for m, r in results.items():
        emb = f"{r['embedding_l1_hits']:.0f}/{r['embedding_redis_hits']:.0f}/{r['embedding_lookups']:.0f}"
        print(
            f"{m:<13}{r['requests_per_s']:>7.2f}{r['prefix_hit_rate']:>11.1%}{r['embedding_hit_rate']:>9.1%}"
            f"{emb:>20}{r['page_copies']:>12}  {r['requests_per_replica']}"
        )
    img, rr = results["image"], results["round-robin"]
    ratio = img["prefix_hit_rate"] / rr["prefix_hit_rate"] if rr["prefix_hit_rate"] else float("inf")
    verdict = "meets" if ratio >= 1.5 else "MISSES"
    print(
        f"\nprefix hit rate, image routing / round-robin: {ratio:.2f}x ({verdict} the 1.5x target); "
        f"requests/s {img['requests_per_s'] / rr['requests_per_s']:.2f}x"
    )
    report = {
        "args": vars(args),
        "kv_blocks": kv_blocks,
        "blocks_per_page": bpp,
        "results": results,
        "prefix_ratio": ratio,
    }
    (work / "results.json").write_text(json.dumps(report, indent=2))
    print(f"results: {work / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
