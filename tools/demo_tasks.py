"""The demo model's synthetic task set: images drawn with PIL, questions with one exact answer each.

Five questions, in exactly these phrasings (the README lists them):

- "What color is the shape?"   -> red | green | blue | yellow | orange | purple | black | white
- "What shape is this?"        -> circle | square | triangle
- "How many shapes are there?" -> 1 ... 6
- "What number is written?"    -> the 1-4 digit number
- "Describe the image."        -> "a red circle", "3 shapes" or "the number 4071"

Images are 64 to 1024 px per side with aspect ratios from 1:3 to 3:1, on plain or lightly noisy
backgrounds, stored as JPEG or PNG. Numbers are dark DejaVu Sans digits on a light background, glyph
heights 12 to 120 px, anywhere in the image; a glyph is at least 1/20 of the image's longer side, so
every number is legible at the model's full visual budget and lower budgets cost accuracy.

Everything is a pure function of the seed: ``sample(seed, index)`` gives the same image bytes,
question and answer on every machine with the same Pillow and font.
"""

from __future__ import annotations

import functools
import io
import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (215, 35, 35),
    "green": (40, 160, 60),
    "blue": (40, 70, 210),
    "yellow": (240, 220, 40),
    "orange": (245, 140, 20),
    "purple": (135, 50, 170),
    "black": (20, 20, 20),
    "white": (245, 245, 245),
}
SHAPES = ("circle", "square", "triangle")
# Shape images sit on neutral backgrounds that are none of the named colours: mid greys and muted tints,
# away from both black and white, so "the shape's colour" is never ambiguous with the background's.
BACKGROUNDS: tuple[tuple[int, int, int], ...] = (
    (128, 128, 128),
    (96, 96, 96),
    (170, 170, 170),
    (190, 180, 160),
    (150, 165, 180),
    (165, 180, 155),
    (180, 160, 170),
    (110, 105, 95),
)
QUESTIONS = {
    "color": "What color is the shape?",
    "shape": "What shape is this?",
    "count": "How many shapes are there?",
    "number": "What number is written?",
    "describe": "Describe the image.",
}
TASKS = tuple(QUESTIONS)
# What each kind of image can be asked: a single shape answers color, shape, count (1) and describe.
KIND_TASKS = {
    "single": ("color", "shape", "count", "describe"),
    "many": ("count", "describe"),
    "number": ("number", "describe"),
}
MIN_SIDE, MAX_SIDE = 64, 1024
MIN_GLYPH, MAX_GLYPH = 12, 120
FONT_PATHS = (
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
)


@dataclass(frozen=True, slots=True)
class Example:
    """One image with every question it answers; ``data`` is the encoded file (``fmt`` JPEG or PNG)."""

    kind: str
    data: bytes
    fmt: str
    size: tuple[int, int]
    qa: dict[str, str]  # task -> answer
    # (x, y, label) of every object's centre in image pixels: label is a shape name or a digit, and a
    # shape's colour name follows after a space ("circle red"). Training reads them; scoring never does.
    objects: tuple[tuple[float, float, str], ...] = ()
    # Each object's outline in image pixels, in the order of ``objects``: ("ellipse", (x0, y0, x1, y1)) or
    # ("polygon", ((x, y), ...)); a digit's is its ink box. Training draws per-patch coverage from them.
    outlines: tuple[tuple[str, tuple], ...] = ()
    # ``sample(..., picture=True)``: the drawn picture itself where the file would be a PNG (whose pixels it
    # is to the byte), and ``data`` empty; None otherwise.
    picture: Image.Image | None = None

    def question(self, task: str) -> str:
        return QUESTIONS[task]


def font_path() -> str:
    for path in FONT_PATHS:
        if Path(path).is_file():
            return path
    raise FileNotFoundError(
        "DejaVu Sans not found (looked in " + ", ".join(FONT_PATHS) + "): install the Debian package "
        "fonts-dejavu-core (bin/setup does this)"
    )


@functools.lru_cache(maxsize=256)
def _font(px: int) -> ImageFont.FreeTypeFont:
    return ImageFont.truetype(font_path(), px)


def _jitter(rgb: tuple[int, int, int], rng: random.Random, amount: int = 18) -> tuple[int, int, int]:
    return tuple(max(0, min(255, c + rng.randint(-amount, amount))) for c in rgb)  # type: ignore[return-value]


def _canvas(rng: random.Random) -> tuple[int, int]:
    """(width, height): the longer side log-uniform in [64, 1024], aspect ratio in [1:3, 3:1]."""
    long_side = round(math.exp(rng.uniform(math.log(MIN_SIDE), math.log(MAX_SIDE))))
    ratio = math.exp(rng.uniform(0.0, math.log(3.0)))
    short_side = max(MIN_SIDE, round(long_side / ratio), math.ceil(long_side / 3))  # rounding stays <= 3:1
    return (long_side, short_side) if rng.random() < 0.5 else (short_side, long_side)


def _background(size: tuple[int, int], rgb: tuple[int, int, int], rng: random.Random) -> Image.Image:
    """A plain background, or (one in three) the same colour with light per-pixel noise."""
    img = Image.new("RGB", size, _jitter(rgb, rng, 10))
    return _add_noise(img, rng) if rng.random() < 1 / 3 else img


def _add_noise(img: Image.Image, rng: random.Random) -> Image.Image:
    # NOTE: numpy seeded from `rng`, not Image.effect_noise: Pillow draws that from C's unseeded rand(), so
    # every call gave different pixels and the task set was not a function of its seed.
    sigma = rng.uniform(8, 20)
    grey = np.random.default_rng(rng.getrandbits(64)).normal(128.0, sigma, (img.height, img.width))
    noise = Image.fromarray(np.clip(grey, 0, 255).astype(np.uint8)).convert("RGB")  # grey noise around 128
    return Image.blend(img, noise, rng.uniform(0.04, 0.10))


def _draw_shape(
    draw: ImageDraw.ImageDraw, kind: str, cx: float, cy: float, r: float, rgb, rng
) -> tuple[str, tuple]:
    """A filled shape inscribed in the circle of radius ``r`` around (cx, cy); returns its outline."""
    if kind == "circle":
        box = (cx - r, cy - r, cx + r, cy + r)
        draw.ellipse(list(box), fill=rgb)
        return "ellipse", box
    if kind == "square":
        h = r / math.sqrt(2) * rng.uniform(0.85, 1.0)  # corners inside the circle: apart from its neighbours
        draw.rectangle([cx - h, cy - h, cx + h, cy + h], fill=rgb)
        return "polygon", ((cx - h, cy - h), (cx + h, cy - h), (cx + h, cy + h), (cx - h, cy + h))
    turn = rng.uniform(-0.25, 0.25)  # mostly upright
    pts = tuple(
        (cx + r * math.sin(turn + k * 2 * math.pi / 3), cy - r * math.cos(turn + k * 2 * math.pi / 3))
        for k in range(3)
    )
    draw.polygon(pts, fill=rgb)
    return "polygon", pts


def _single(rng: random.Random) -> tuple[Image.Image, dict[str, str], tuple]:
    w, h = _canvas(rng)
    color, shape = rng.choice(list(COLORS)), rng.choice(SHAPES)
    img = _background((w, h), rng.choice(BACKGROUNDS), rng)
    r = min(w, h) / 2 * rng.uniform(0.25, 0.7)  # under 40 % of the area: the shape is the minority colour
    cx, cy = rng.uniform(r, w - r), rng.uniform(r, h - r)
    outline = _draw_shape(ImageDraw.Draw(img), shape, cx, cy, r, _jitter(COLORS[color], rng), rng)
    qa = {"color": color, "shape": shape, "count": "1", "describe": f"a {color} {shape}"}
    return img, qa, ((cx, cy, f"{shape} {color}"),), (outline,)


def _many(rng: random.Random) -> tuple[Image.Image, dict[str, str], tuple]:
    """2-6 non-overlapping shapes of mixed colours and kinds on a neutral background."""
    while True:
        w, h = _canvas(rng)
        n = rng.randint(2, 6)
        # Shapes sized so that n of them fit: radius from the area each one gets.
        r_max = min(min(w, h) / 4.5, math.sqrt(w * h / (n * math.pi)) / 2.2)
        if r_max < 6:
            continue
        circles: list[tuple[float, float, float]] = []
        for _ in range(200 * n):
            if len(circles) == n:
                break
            r = rng.uniform(max(5.0, 0.55 * r_max), r_max)
            cx, cy = rng.uniform(r + 1, w - r - 1), rng.uniform(r + 1, h - r - 1)
            # NOTE: at least 3 px apart: rasterised circles of a few pixels reach a pixel past their radius
            if all(math.hypot(cx - x, cy - y) > r + q + max(3.0, 0.15 * (r + q)) for x, y, q in circles):
                circles.append((cx, cy, r))
        if len(circles) == n:
            break
    img = _background((w, h), rng.choice(BACKGROUNDS), rng)
    draw = ImageDraw.Draw(img)
    objects, outlines = [], []
    for cx, cy, r in circles:
        shape = rng.choice(SHAPES)
        color = rng.choice(list(COLORS))
        outlines.append(_draw_shape(draw, shape, cx, cy, r, _jitter(COLORS[color], rng), rng))
        objects.append((cx, cy, f"{shape} {color}"))
    return img, {"count": str(n), "describe": f"{n} shapes"}, tuple(objects), tuple(outlines)


def _number(rng: random.Random) -> tuple[Image.Image, dict[str, str], tuple]:
    """A 1-4 digit number, dark on light, glyph height in [12, 120] px and >= 1/20 of the longer side."""
    while True:
        w, h = _canvas(rng)
        text = _random_number(rng)
        lo = max(MIN_GLYPH, math.ceil(max(w, h) / 20))
        hi = _glyph_ceiling(len(text), w, h)
        if hi >= lo:
            break
    glyph = round(math.exp(rng.uniform(math.log(lo), math.log(hi))))
    size = max(6, round(glyph / 0.73))
    # NOTE: 0.73 is the flat digits' ratio; round ones (0, 3, 6, 8, 9) overshoot it, and rounding the size
    # adds a pixel: step the size until the measured ink is within the bounds and inside the image.
    while True:
        font = _font(size)
        left, top, right, bottom = font.getbbox(text)
        tw, th = right - left, bottom - top
        if size > 6 and (th > MAX_GLYPH or tw > w - 2 or th > h - 2):
            size -= 1
        elif th < lo and _fits(_font(size + 1).getbbox(text), w, h):
            size += 1
        else:
            break
    img = _background((w, h), _light(rng), rng)
    x, y = rng.uniform(0, w - tw) - left, rng.uniform(0, h - th) - top
    ImageDraw.Draw(img).text((x, y), text, font=font, fill=_dark(rng))
    objects, outlines = _digit_marks(font, text, x, y)
    return img, {"number": text, "describe": f"the number {text}"}, objects, outlines


def _random_number(rng: random.Random) -> str:
    """A 1-4 digit number (its length uniform), no leading zero."""
    digits = rng.randint(1, 4)
    return str(rng.randint(1 if digits == 1 else 10 ** (digits - 1), 10**digits - 1))


def _glyph_ceiling(digits: int, w: int, h: int) -> int:
    """The tallest glyph (px) a number of ``digits`` may have in a w x h image: it must fit with a margin.
    The digits' ink is ~0.73 of the font size tall and ~0.64 of it wide per digit."""
    return min(MAX_GLYPH, int((h - 4) * 0.95), int((w - 4) / (0.64 * digits / 0.73 + 0.1)))


def _light(rng: random.Random) -> tuple[int, int, int]:
    """A number image's background: light, any tint."""
    return (rng.randint(200, 255), rng.randint(200, 255), rng.randint(200, 255))


def _dark(rng: random.Random) -> tuple[int, int, int]:
    """A number's ink: dark, any tint."""
    return (rng.randint(0, 70), rng.randint(0, 70), rng.randint(0, 70))


def _digit_marks(font: ImageFont.FreeTypeFont, text: str, x: float, y: float) -> tuple[tuple, tuple]:
    """Each digit of ``text`` drawn at (x, y): its centre and label, and its ink box as an outline."""
    left, top, right, bottom = font.getbbox(text)
    mid_y = y + top + (bottom - top) / 2
    objects = tuple(
        (x + font.getlength(text[:i]) + font.getlength(ch) / 2, mid_y, ch) for i, ch in enumerate(text)
    )
    outlines = []
    for i, ch in enumerate(text):
        x0, y0, x1, y1 = font.getbbox(ch)
        dx = x + font.getlength(text[:i])
        outlines.append(
            ("polygon", ((dx + x0, y + y0), (dx + x1, y + y0), (dx + x1, y + y1), (dx + x0, y + y1)))
        )
    return objects, tuple(outlines)


def _numbers(rng: random.Random) -> tuple[Image.Image, dict[str, str], tuple, tuple]:
    """Training only (the tower's phase; never in the task set): up to 5 numbers, sized as ``_number``'s,
    scattered without overlap. A number image's digits cover a few of its patches; these put several times
    as many digits under the per-cell heads for the same tower work. No question applies to them."""
    w, h = _canvas(rng)
    img = _background((w, h), _light(rng), rng)
    draw = ImageDraw.Draw(img)
    lo = max(MIN_GLYPH, math.ceil(max(w, h) / 20))
    want = rng.randint(2, 5)
    boxes: list[tuple[float, float, float, float]] = []
    objects: tuple = ()
    outlines: tuple = ()
    for _ in range(30 * want):
        if len(boxes) == want:
            break
        text = _random_number(rng)
        hi = _glyph_ceiling(len(text), w, h)
        if hi < lo:
            continue
        glyph = round(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        font = _font(max(6, round(glyph / 0.73)))
        left, top, right, bottom = font.getbbox(text)
        tw, th = right - left, bottom - top
        if tw > w - 2 or th > h - 2:
            continue
        x, y = rng.uniform(0, w - tw) - left, rng.uniform(0, h - th) - top
        gap = max(2.0, 0.3 * th)  # numbers apart by a third of a glyph: each one reads as its own
        box = (x + left - gap, y + top - gap, x + right + gap, y + bottom + gap)
        if any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in boxes):
            continue
        boxes.append(box)
        draw.text((x, y), text, font=font, fill=_dark(rng))
        marks = _digit_marks(font, text, x, y)
        objects, outlines = objects + marks[0], outlines + marks[1]
    return img, {}, objects, outlines


def _fits(bbox: tuple[int, int, int, int], w: int, h: int) -> bool:
    left, top, right, bottom = bbox
    return bottom - top <= min(MAX_GLYPH, h - 2) and right - left <= w - 2


KINDS = ("single", "many", "number")  # the task set's kinds; "numbers" is training's alone
_MAKERS = {"single": _single, "many": _many, "number": _number, "numbers": _numbers}


def sample(
    seed: int, index: int, kind: str | None = None, fmt: str | None = None, picture: bool = False
) -> Example:
    """Example ``index`` of the task set with ``seed``; ``kind`` forces the image kind, ``fmt`` the encoding
    (the same picture: "PNG" gives its exact pixels, which is how the tests measure what it shows).
    ``picture``: a PNG example keeps the drawn picture instead of encoding it (``Example.picture``), for a
    caller that would only decode the file again (training; a JPEG's pixels need the lossy round trip)."""
    rng = random.Random(f"vlmserve-demo:{seed}:{index}")
    kind = kind or rng.choice(KINDS)
    img, qa, objects, outlines = _MAKERS[kind](rng)
    drawn = "JPEG" if rng.random() < 0.5 else "PNG"
    fmt = fmt or drawn
    kept = None
    buf = io.BytesIO()
    if fmt == "JPEG":
        img.save(buf, format="JPEG", quality=rng.randint(80, 95))
    elif picture:
        kept = img
    else:
        img.save(buf, format="PNG", compress_level=1)
    return Example(
        kind=kind,
        data=buf.getvalue(),
        fmt=fmt,
        size=img.size,
        qa=qa,
        objects=objects,
        outlines=outlines,
        picture=kept,
    )


def coverage(example: Example, rows: int, cols: int, sub: int = 7) -> np.ndarray:
    """[objects, rows, cols]: the fraction of each cell of a rows x cols grid over the whole image that each
    object's outline covers (the image stretched to the grid, as the preprocessor's resize does)."""
    width, height = example.size
    sx, sy = cols * sub / width, rows * sub / height
    out = np.zeros((len(example.outlines), rows, cols), dtype=np.float32)
    for k, (form, coords) in enumerate(example.outlines):
        mask = Image.new("L", (cols * sub, rows * sub), 0)
        draw = ImageDraw.Draw(mask)
        if form == "ellipse":
            x0, y0, x1, y1 = coords
            draw.ellipse([x0 * sx, y0 * sy, x1 * sx, y1 * sy], fill=255)
        else:
            draw.polygon([(x * sx, y * sy) for x, y in coords], fill=255)
        cells = np.asarray(mask, dtype=np.float32).reshape(rows, sub, cols, sub) / 255.0
        out[k] = cells.mean(axis=(1, 3))
    return out


def eval_set(seed: int, per_task: int) -> list[tuple[Example, str]]:
    """(example, task) pairs: ``per_task`` distinct images for each of the five questions."""
    out: list[tuple[Example, str]] = []
    index = 0
    for task in TASKS:
        kinds = [k for k, tasks in KIND_TASKS.items() if task in tasks]
        for i in range(per_task):
            # Counting sees one shape a sixth of the time (1 of 6 answers); describe sees every kind.
            if task == "count":
                kind = "single" if i % 6 == 0 else "many"
            else:
                kind = kinds[i % len(kinds)]
            out.append((sample(seed, index, kind), task))
            index += 1
    return out


def mime(example: Example) -> str:
    return "image/jpeg" if example.fmt == "JPEG" else "image/png"


def normalize(answer: str) -> str:
    """How replies are scored: exact match after stripping whitespace and case."""
    return answer.strip().lower()
