"""Page QA: time to first token when one page is asked 8 questions in a row.

A document page (letter size at 150 dpi, 1275x1650 PNG: headings, paragraphs, a table) is asked
8 different questions one after another, each a fresh single-turn chat [page image, question].
Question 1 pays for everything: decode, resize and patchify, the vision tower, and the prefill of
the page's ~1240 visual tokens. Questions 2-8 should hit the embedding cache (keyed by the image
bytes' hash) and the prefix cache (KV blocks whose hashes include that image hash), leaving only
the question's own tokens to prefill. The same run is repeated with both caches off for contrast.

On the generated `small` preset (bf16, random weights: the answers are noise, the timings are
real). Before each mode, one warm-up request on a different page pays the one-time costs (thread
and worker start, first calls), so question 1 is a true cache miss but not a cold start. Each
repeat uses a new page (new text, so new bytes and a new hash).

TTFT is measured from just before the request is handed to the engine (chat template, image hash
and header probe included) to the step that samples the first token, both on time.monotonic().

    .venv/bin/python benchmarks/page_qa_ttft.py [--repeats 3] [--preprocess-workers 2]
"""

from __future__ import annotations

if not __package__:  # run by path: the repository root onto sys.path, once (benchmarks/_path.py)
    import _path  # noqa: F401

import argparse
import io
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.harness import ensure_checkpoint
from benchmarks.preprocess_throughput import wait_idle

OUT_DIR = Path(__file__).parent / "out"
FONT_DIR = Path("/usr/share/fonts/truetype/dejavu")
QUESTIONS = [
    "What is the title of this document?",
    "Summarise the second paragraph in one sentence.",
    "Which region had the highest revenue in the table?",
    "How many rows does the table have?",
    "What date is mentioned in the header?",
    "List the section headings.",
    "What is the total in the last row of the table?",
    "Who is the author of the report?",
]
WORDS = (
    "the quarterly results show steady growth across all regions while operating costs remained within "
    "budget and the board approved further investment in research logistics customer support and new "
    "markets our analysis suggests demand will continue to rise although supply constraints may limit "
    "shipments in the coming months management expects margins to improve as automation reduces waste"
).split()


def font(size: int, bold: bool = False):
    from PIL import ImageFont

    path = FONT_DIR / ("DejaVuSans-Bold.ttf" if bold else "DejaVuSans.ttf")
    return ImageFont.truetype(str(path), size) if path.is_file() else ImageFont.load_default(size)


def make_page(seed: int) -> bytes:
    """A 1275x1650 (letter at 150 dpi) report page as PNG; `seed` changes its text."""
    import random

    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    page = Image.new("RGB", (1275, 1650), "white")
    draw = ImageDraw.Draw(page)
    margin, width = 110, 1275 - 220
    body, small = font(22), font(18)

    def paragraph(y: int, lines: int) -> int:
        """Random sentences word-wrapped to the text width, ending with a short line."""
        rows, line = [], [rng.choice(WORDS).capitalize()]
        while len(rows) < lines - 1:
            word = rng.choice(WORDS)
            if draw.textlength(" ".join([*line, word]), font=body) > width:
                rows.append(line)
                line = []
            line.append(word)
        rows.append(line[:1] + rng.choices(WORDS, k=rng.randint(3, 8)))
        for row in rows:
            draw.text((margin, y), " ".join(row) + ("." if row is rows[-1] else ""), "black", body)
            y += 32
        return y + 18

    draw.text((margin, 70), f"Acme Corp. - Report {seed:04d}", "dimgray", small)
    draw.text((1275 - margin - 190, 70), f"12 March 20{20 + seed % 10}", "dimgray", small)
    draw.line((margin, 100, margin + width, 100), "gray", 2)
    draw.text((margin, 130), f"Quarterly Operations Review {seed % 4 + 1}", "black", font(40, bold=True))
    draw.text((margin, 190), f"Prepared by J. Doe{seed % 7} for the board", "dimgray", small)
    y = 250
    for section in ("1. Summary", "2. Regional performance"):
        draw.text((margin, y), section, "black", font(30, bold=True))
        y = paragraph(y + 50, rng.randint(4, 6))

    rows = [("Region", "Q1", "Q2", "Q3", "Q4", "Total")]
    for region in ("North", "South", "East", "West", "Central", "Overseas"):
        q = [rng.randint(80, 990) for _ in range(4)]
        rows.append((region, *map(str, q), str(sum(q))))
    cols = [margin + i * width // 6 for i in range(6)] + [margin + width]
    for r, row in enumerate(rows):
        top = y + r * 42
        if r == 0:
            draw.rectangle((margin, top, margin + width, top + 42), fill="gainsboro")
        draw.line((margin, top, margin + width, top), "black", 1)
        for c, cell in enumerate(row):
            draw.text((cols[c] + 12, top + 9), cell, "black", font(22, bold=r == 0))
    bottom = y + len(rows) * 42
    draw.line((margin, bottom, margin + width, bottom), "black", 1)
    for x in cols:
        draw.line((x, y, x, bottom), "black", 1)
    y = bottom + 40

    for section in ("3. Risks", "4. Outlook"):
        draw.text((margin, y), section, "black", font(30, bold=True))
        y = paragraph(y + 50, rng.randint(3, 5))
    draw.text((margin, 1650 - 80), f"Page {seed % 40 + 1} of 40 - confidential", "dimgray", small)
    buf = io.BytesIO()
    page.save(buf, "PNG")
    return buf.getvalue()


def ask(llm, page: bytes, question: str, max_tokens: int) -> dict:
    """One single-turn chat through the engine; returns its TTFT and what the caches did."""
    from lm_engine import SamplingParams

    engine = llm.engine
    hits0, queries0 = engine.block_manager.prefix_hits, engine.block_manager.prefix_queries
    vision0 = (engine.vision.stats.cache_hits, engine.vision.stats.images, engine.vision.stats.encode_seconds)
    pool = engine.preprocess_pool
    pre0 = pool.stats.total_seconds if pool is not None else 0.0
    conv = [
        {"role": "user", "content": [{"type": "image", "image": page}, {"type": "text", "text": question}]}
    ]
    start = time.monotonic()
    out = llm.chat([conv], SamplingParams(temperature=0, max_tokens=max_tokens))[0]
    assert out.error is None, out.error
    m = out.metrics
    return {
        "ttft": m["first_token_time"] - start,
        "engine_ttft": m["first_token_time"] - m["arrival_time"],  # from add_request's Sequence
        "prompt": len(out.prompt_token_ids),
        "prefix_hit": engine.block_manager.prefix_hits - hits0,
        "prefix_query": engine.block_manager.prefix_queries - queries0,
        "emb_hit": engine.vision.stats.cache_hits - vision0[0],
        "encoded": engine.vision.stats.images - vision0[1],
        "encode_s": engine.vision.stats.encode_seconds - vision0[2],
        "preprocess_s": (pool.stats.total_seconds - pre0) if pool is not None else float("nan"),
    }


def run_mode(model: Path, args, caches: bool) -> list[list[dict]]:
    from lm_engine import LLM

    options = {"embedding_cache_bytes": 512 << 20, "enable_prefix_caching": True} if caches else {
        "embedding_cache_bytes": 0,
        "enable_prefix_caching": False,
    }  # fmt: skip
    llm = LLM(
        str(model),
        preprocess_workers=args.preprocess_workers,
        kv_cache_memory=args.kv_cache_mb << 20,
        **options,
    )
    try:
        if args.preprocess_workers:
            llm.engine.preprocess_pool.wait_ready(300)
        ask(llm, make_page(seed=9999), "Warm-up: what is on this page?", args.max_tokens)
        runs = []
        for r in range(args.repeats):
            wait_idle(args.wait_idle)
            page = make_page(seed=r)
            runs.append([ask(llm, page, q, args.max_tokens) for q in QUESTIONS])
        return runs
    finally:
        llm.close()


def summarise(label: str, runs: list[list[dict]]) -> float:
    print(f"\n{label}")
    print(
        f"{'question':>8} {'TTFT ms (median)':>16} {'per repeat':>24} {'engine ms':>9} "
        f"{'prompt':>6} {'prefix hit':>10} {'emb hit':>7} {'encoded':>7} {'preproc ms':>10} {'encode ms':>9}"
    )
    for q in range(len(QUESTIONS)):
        cells = [run[q] for run in runs]
        ttfts = [c["ttft"] * 1e3 for c in cells]
        last = cells[-1]
        print(
            f"{q + 1:>8} {statistics.median(ttfts):16.1f} {' '.join(f'{t:7.1f}' for t in ttfts):>24} "
            f"{statistics.median(c['engine_ttft'] * 1e3 for c in cells):9.1f} {last['prompt']:>6} "
            f"{last['prefix_hit']:>4}/{last['prefix_query']:<5} {last['emb_hit']:>7} {last['encoded']:>7} "
            f"{statistics.median(c['preprocess_s'] * 1e3 for c in cells):10.1f} "
            f"{statistics.median(c['encode_s'] * 1e3 for c in cells):9.1f}"
        )
    ratios = [
        statistics.mean(run[q]["ttft"] for q in range(1, len(QUESTIONS))) / run[0]["ttft"] for run in runs
    ]
    print(
        f"mean TTFT(q2..q8) / TTFT(q1): {statistics.median(ratios):.3f}  "
        f"(per repeat: {', '.join(f'{r:.3f}' for r in ratios)})"
    )
    return statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: small preset)")
    parser.add_argument("--repeats", type=int, default=3, help="pages, each asked all 8 questions")
    parser.add_argument("--preprocess-workers", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kv-cache-mb", type=int, default=512)
    parser.add_argument("--wait-idle", type=float, default=60, help="seconds to wait for a quiet machine")
    parser.add_argument("--save-page", action="store_true", help=f"write the first page to {OUT_DIR}")
    args = parser.parse_args()

    import PIL
    import torch

    from preprocess import PreprocessConfig, plan_grid, probe

    model = ensure_checkpoint("small", 0, args.model)
    page = make_page(seed=0)
    if args.save_page:
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        (OUT_DIR / "page_qa_page.png").write_bytes(page)
    grid = plan_grid(probe(page), PreprocessConfig.from_checkpoint(model), None)
    print(
        f"model {model} | torch {torch.__version__}, {torch.get_num_threads()} threads, PIL {PIL.__version__} | "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}"
    )
    print(
        f"page 1275x1650 PNG ({len(page) / 1e3:.0f} kB) -> grid {grid[1]}x{grid[2]} patches, "
        f"{grid[1] * grid[2] // 4} visual tokens | {len(QUESTIONS)} questions x {args.repeats} pages, "
        f"max_tokens={args.max_tokens}, preprocess_workers={args.preprocess_workers}"
    )
    print("warm-up: one request on a different page before each mode")
    on = run_mode(model, args, caches=True)
    off = run_mode(model, args, caches=False)
    r_on = summarise("caches on (embedding cache 512 MiB + prefix caching)", on)
    r_off = summarise("caches off (embedding_cache_bytes=0, enable_prefix_caching=False)", off)
    print(
        f"\nratio with caches: {r_on:.3f} (target <= 0.3)   without: {r_off:.3f}   load {os.getloadavg()[0]:.2f}"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
