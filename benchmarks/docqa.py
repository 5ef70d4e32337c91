"""Document-page QA through `vlmserve batch`, with the caches on and off.

Generates report pages as a scanner or PDF renderer would give them — letter size at 150 and 200 dpi
(1275x1650 and 1700x2200 px), white, with a title, a byline, section headings, word-wrapped paragraphs and a
bordered table — half as PNG and half as JPEG, asks each page several questions, and writes an OpenAI batch
file whose lines are shuffled (as questions arrive from many users, not grouped by page). Then it runs
`vlmserve batch` on it twice on the generated `small` preset (bf16, random weights: the answers are noise, the
timings are real), in a fresh process each time:

  on   the offline defaults: embedding cache (512 MiB) and prefix cache on
  off  --no-enable-prefix-caching --embedding-cache-mb 0: every question re-encodes and re-prefills its page

With the caches on, `vlmserve batch` runs each page's first question, then its other questions once the page's
embedding and KV blocks are cached, so a page is decoded, resized, encoded by the vision tower and prefilled
(~1280 visual tokens at the checkpoint's max_pixels) once instead of once per question. The table gives wall
time (the batch itself, engine start-up excluded), requests/s, the speed-up, and the hit rates behind it.

    .venv/bin/python benchmarks/docqa.py            # 20 pages x 6 questions, max_tokens 16 (~18 minutes on 2 cores)
    .venv/bin/python benchmarks/docqa.py --quick    # 4 pages x 3 questions, max_tokens 8 (smoke test)

Everything is written under benchmarks/out/ (git-ignored): the checkpoint, pages, batch files, outputs and a
results JSON.
"""

from __future__ import annotations

if not __package__:  # run by path: the repository root onto sys.path, once (benchmarks/_path.py)
    import _path  # noqa: F401

import argparse
import io
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness import ensure_checkpoint

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "benchmarks" / "out"
LETTER_IN = (8.5, 11.0)

WORDS = (
    "the quarterly results show steady growth across all regions while operating costs remained within budget "
    "and the board approved further investment in research logistics customer support and new markets our "
    "analysis suggests demand will continue to rise although supply constraints may limit shipments in the "
    "coming months management expects margins to improve as automation reduces waste and the new facility "
    "reaches full capacity early next year pending regulatory approval of the expansion plan"
).split()
SECTIONS = ["Summary", "Background", "Financial results", "Operations", "Outlook", "Risks", "Method"]
REGIONS = ["North", "South", "East", "West", "Central", "Pacific", "Atlantic", "Overseas"]
AUTHORS = ["A. Rivera", "M. Chen", "K. Okafor", "S. Lindqvist", "P. Sharma", "J. Novak"]
TITLES = ["Quarterly Report", "Annual Review", "Operations Update", "Regional Performance", "Board Memo"]
QUESTIONS = [
    "What is the title of this document?",
    "Who is the author of this page?",
    "Which region had the highest revenue in the table?",
    "What is the total in the last row of the table?",
    "List the section headings on this page.",
    "Summarise the first paragraph in one sentence.",
    "What date appears under the title?",
    "How many rows does the table have?",
]


# ---------------------------------------------------------------- pages


def find_font(bold: bool = False) -> str | None:
    """A TrueType sans font (DejaVu via fc-list, else a known path), or None for PIL's built-in font."""
    want = "DejaVuSans-Bold.ttf" if bold else "DejaVuSans.ttf"
    try:
        listing = subprocess.run(["fc-list", ":", "file"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        listing = ""
    for entry in listing.splitlines():
        path = entry.split(":", 1)[0].strip()
        if Path(path).name == want:
            return path
    fallback = Path("/usr/share/fonts/truetype/dejavu") / want
    return str(fallback) if fallback.is_file() else None


def load_font(size: int, bold: bool = False):
    from PIL import ImageFont

    path = find_font(bold)
    return ImageFont.truetype(path, size) if path else ImageFont.load_default(size)


def render_page(seed: int, dpi: int) -> tuple[object, dict]:
    """A report page at letter size and ``dpi``; returns the PIL image and the facts the questions ask about."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    width, height = round(LETTER_IN[0] * dpi), round(LETTER_IN[1] * dpi)
    pt = dpi / 72  # pixels per typographic point
    page = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(page)
    margin = round(0.9 * dpi)
    text_w = width - 2 * margin
    title_f, head_f = load_font(round(20 * pt), bold=True), load_font(round(13 * pt), bold=True)
    body_f, bold_f, small_f = (
        load_font(round(10.5 * pt)),
        load_font(round(10.5 * pt), True),
        load_font(round(9 * pt)),
    )
    line_h = round(15 * pt)

    title = f"{rng.choice(TITLES)} {2019 + seed % 7}-Q{1 + seed % 4}"
    author = rng.choice(AUTHORS)
    date = f"{1 + rng.randrange(28):02d}/{1 + rng.randrange(12):02d}/{2020 + rng.randrange(6)}"
    y = margin
    draw.text((margin, y), title, font=title_f, fill="black")
    y += round(30 * pt)
    draw.text((margin, y), f"Prepared by {author}  ·  {date}  ·  Internal", font=small_f, fill=(70, 70, 70))
    y += round(16 * pt)
    draw.line((margin, y, width - margin, y), fill=(40, 40, 40), width=max(1, round(pt)))
    y += round(14 * pt)

    def paragraph(y: int, lines: int) -> int:
        words = [rng.choice(WORDS).capitalize()]
        rows: list[str] = []
        while len(rows) < lines:
            word = rng.choice(WORDS)
            if draw.textlength(" ".join([*words, word]), font=body_f) > text_w:
                rows.append(" ".join(words))
                words = []
            words.append(word)
        rows[-1] = rows[-1][: max(10, len(rows[-1]) // 2)].rstrip() + "."
        for row in rows:
            draw.text((margin, y), row, font=body_f, fill="black")
            y += line_h
        return y + round(8 * pt)

    facts: dict = {"title": title, "author": author, "date": date, "sections": []}
    for i, name in enumerate(rng.sample(SECTIONS, 5)):
        room = (height - margin - y) // line_h - 3  # lines left under a heading
        if room < 3 or (i == 1 and room < 16):  # the second section also holds the table
            break
        facts["sections"].append(name)
        draw.text((margin, y), f"{i + 1}. {name}", font=head_f, fill=(20, 30, 90))
        y += round(22 * pt)
        y = paragraph(y, min(room, rng.randint(3, 7)))
        if i == 1:
            y = draw_table(draw, rng, margin, y, text_w, pt, body_f, bold_f, facts)
    draw.text(
        (margin, height - margin // 2), f"Page {1 + seed % 40} of 40", font=small_f, fill=(100, 100, 100)
    )
    return page, facts


def draw_table(draw, rng, x0: int, y: int, width: int, pt: float, body_f, bold_f, facts: dict) -> int:
    """A bordered revenue table (region, revenue, cost, margin) with a total row."""
    regions = rng.sample(REGIONS, rng.randint(4, 6))
    rows = []
    for region in regions:
        revenue = rng.randint(120, 990) * 1000
        cost = int(revenue * rng.uniform(0.55, 0.9))
        rows.append([region, f"{revenue:,}", f"{cost:,}", f"{(revenue - cost) / revenue:.1%}"])
    total_rev = sum(int(r[1].replace(",", "")) for r in rows)
    total_cost = sum(int(r[2].replace(",", "")) for r in rows)
    rows.append(["Total", f"{total_rev:,}", f"{total_cost:,}", f"{(total_rev - total_cost) / total_rev:.1%}"])
    facts["top_region"] = max(rows[:-1], key=lambda r: int(r[1].replace(",", "")))[0]
    facts["total"] = rows[-1][1]
    header = ["Region", "Revenue ($)", "Cost ($)", "Margin"]
    cols = [0.0, 0.34, 0.6, 0.84]
    row_h = round(18 * pt)
    lw = max(1, round(pt / 2))
    top = y
    for r, cells in enumerate([header, *rows]):
        if r == 0:
            draw.rectangle((x0, y, x0 + width, y + row_h), fill=(225, 230, 240))
        font = bold_f if r in (0, len(rows)) else body_f
        for c, cell in enumerate(cells):
            draw.text(
                (x0 + cols[c] * width + round(6 * pt), y + round(3 * pt)), cell, font=font, fill="black"
            )
        y += row_h
        draw.line((x0, y, x0 + width, y), fill=(60, 60, 60), width=lw)
    draw.rectangle((x0, top, x0 + width, y), outline=(60, 60, 60), width=lw)
    for c in cols[1:]:
        cx = x0 + round(c * width)
        draw.line((cx, top, cx, y), fill=(60, 60, 60), width=lw)
    return y + round(14 * pt)


def write_pages(directory: Path, n: int) -> list[Path]:
    """``n`` pages: even ones 150 dpi, odd ones 200 dpi; alternating PNG and JPEG (quality 85) in pairs."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        dpi = 150 if i % 2 == 0 else 200
        fmt = "PNG" if (i // 2) % 2 == 0 else "JPEG"
        page, _ = render_page(seed=i, dpi=dpi)
        path = directory / f"page{i:03d}_{dpi}dpi.{fmt.lower().replace('jpeg', 'jpg')}"
        buf = io.BytesIO()
        page.save(buf, format=fmt, **({"quality": 85} if fmt == "JPEG" else {"optimize": False}))
        path.write_bytes(buf.getvalue())
        paths.append(path)
    return paths


def write_batch(path: Path, pages: list[Path], questions: int, max_tokens: int, media: str, seed: int) -> int:
    import base64

    lines = []
    for p, page in enumerate(pages):
        if media == "file":
            url = page.resolve().as_uri()
        else:
            mime = "image/png" if page.suffix == ".png" else "image/jpeg"
            url = f"data:{mime};base64,{base64.b64encode(page.read_bytes()).decode()}"
        for q in range(questions):
            question = QUESTIONS[(p + q) % len(QUESTIONS)]
            body = {
                "model": "small",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": url}},
                            {"type": "text", "text": question},
                        ],
                    }
                ],
                "max_tokens": max_tokens,
                "temperature": 0.0,
            }
            lines.append(
                {"custom_id": f"page{p}-q{q}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            )
    random.Random(seed).shuffle(lines)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return len(lines)


# ---------------------------------------------------------------- runs


MODES = {
    "on": [],
    "off": ["--no-enable-prefix-caching", "--embedding-cache-mb", "0"],
    "prefix-only": ["--embedding-cache-mb", "0"],
    "embedding-only": ["--no-enable-prefix-caching"],
}


def run_mode(mode: str, ckpt: Path, batch: Path, work: Path, media_dir: Path, extra: list[str]) -> dict:
    out, summary = work / f"output-{mode}.jsonl", work / f"summary-{mode}.json"
    cmd = [
        sys.executable, "-m", "api.cli", "batch", str(batch), str(out),
        "--model", str(ckpt), "--served-model-name", "small",
        "--allowed-local-media-path", str(media_dir),
        "--summary-json", str(summary),
        *MODES[mode], *extra,
    ]  # fmt: skip
    print(f"\n[{mode}] {' '.join(cmd[2:])}", flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    result = json.loads(summary.read_text())
    result["process_s"] = time.perf_counter() - t0
    # NOTE: other processes on the machine skew one mode against the other; the 5-minute load says how much.
    result["loadavg_5m"] = os.getloadavg()[1]
    result["texts"] = {
        (rec := json.loads(raw))["custom_id"]: rec["response"]["body"]["choices"][0]["message"]["content"]
        for raw in out.read_text().splitlines()
        if json.loads(raw)["error"] is None
    }
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=20)
    ap.add_argument("--questions", type=int, default=6, help="questions per page")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="4 pages x 3 questions, max_tokens 8")
    ap.add_argument("--modes", default="on,off", help=f"comma-separated, from {', '.join(MODES)}")
    ap.add_argument("--media", choices=["file", "data"], default="file", help="file:// or data: image URLs")
    ap.add_argument("--seed", type=int, default=0, help="line shuffle")
    ap.add_argument(
        "--engine-args", default="", help="extra `vlmserve batch` flags, e.g. '--preprocess-workers 2'"
    )
    args = ap.parse_args()
    if args.quick:
        args.pages, args.questions, args.max_tokens = 4, 3, 8
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
    if unknown:
        ap.error(f"unknown modes {sorted(unknown)}")

    os.chdir(ROOT)
    ckpt = ensure_checkpoint("small")
    work = OUT_DIR / f"docqa-{args.pages}x{args.questions}"
    shutil.rmtree(work, ignore_errors=True)
    t0 = time.perf_counter()
    pages = write_pages(work / "pages", args.pages)
    batch = work / "batch.jsonl"
    n = write_batch(batch, pages, args.questions, args.max_tokens, args.media, args.seed)
    sizes = sorted(p.stat().st_size for p in pages)
    print(
        f"{len(pages)} pages ({sizes[0] // 1024}-{sizes[-1] // 1024} KiB, PNG/JPEG, 150/200 dpi) and {n} "
        f"questions (max_tokens {args.max_tokens}) written to {work} in {time.perf_counter() - t0:.1f}s",
        flush=True,
    )
    extra = args.engine_args.split()
    results = {m: run_mode(m, ckpt, batch, work, work / "pages", extra) for m in modes}

    print(f"\nDocument QA: {args.pages} pages x {args.questions} questions, small preset, max_tokens "
          f"{args.max_tokens}, {os.cpu_count()} CPU cores")  # fmt: skip
    header = (
        f"{'mode':<15}{'wall s':>8}{'req/s':>8}{'out tok/s':>10}{'emb hit':>9}{'prefix hit':>11}"
        f"{'encoded':>9}{'ok':>6}{'load 5m':>9}"
    )
    print(header)
    print("-" * len(header))
    for m, r in results.items():
        print(
            f"{m:<15}{r['wall_s']:>8.1f}{r['requests_per_s']:>8.2f}{r['output_tokens_per_s']:>10.1f}"
            f"{r['embedding_hit_rate']:>9.1%}{r['prefix_hit_rate']:>11.1%}{r['images_encoded']:>9}"
            f"{r['ok']:>6}{r['loadavg_5m']:>9.1f}"
        )
    report = {
        "pages": args.pages,
        "questions": args.questions,
        "max_tokens": args.max_tokens,
        "cpu_count": os.cpu_count(),
        "results": {m: {k: v for k, v in r.items() if k != "texts"} for m, r in results.items()},
    }
    if "on" in results and "off" in results:
        on, off = results["on"], results["off"]
        speedup = on["requests_per_s"] / off["requests_per_s"]
        same = sum(on["texts"].get(k) == v for k, v in off["texts"].items())
        verdict = "meets" if speedup >= 3 else "MISSES"
        print(f"\nspeed-up, caches on vs off: {speedup:.2f}x requests/s ({verdict} the 3x target)")
        print(
            f"caches on: {on['images_encoded']} pages encoded for {on['ok']} questions; "
            f"{on['prefix_hit_rate']:.1%} of prompt tokens served by the prefix cache, "
            f"{on['embedding_hit_rate']:.1%} of embedding lookups hit "
            f"({on['embedding_lookups']} lookups: a later question needs the page's embedding only for image rows "
            "in a block the prefix cache cannot serve, the one the image shares with the question)"
        )
        why = (
            ""
            if same == len(off["texts"])
            else " (half-precision sums depend on how a prefill is batched and chunked, which the caches change; "
            "random weights leave near-tied logits)"
        )
        print(f"answers identical with caches on and off: {same}/{len(off['texts'])}{why}")
        report["speedup"] = speedup
        report["identical_answers"] = same
    (work / "results.json").write_text(json.dumps(report, indent=2))
    print(f"results: {work / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
