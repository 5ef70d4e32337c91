"""The demo task set against pixel oracles: what an image shows is measured with Pillow and numpy, never read
from the generator's own bookkeeping (shape positions, glyph sizes), so a drawing bug cannot hide."""

from __future__ import annotations

import io
import random
import re

import numpy as np
import pytest
from PIL import Image

from tools import demo_tasks as tasks

N = 300  # samples per property: every kind, format, colour, shape and count occurs
ISSUE_QUESTIONS = {
    "What color is the shape?",
    "What shape is this?",
    "How many shapes are there?",
    "What number is written?",
    "Describe the image.",
}
COLOR_NAMES = ("red", "green", "blue", "yellow", "orange", "purple", "black", "white")
GREY = (128, 128, 128)  # the one background that is not a palette colour
# A pixel differs from the background beyond this RGB distance: the light noise moves it by a few units, the
# closest shape colour (a jittered orange on yellow) by 40 at least.
DIFFERS = 25


@pytest.fixture(scope="module")
def examples() -> list[tasks.Example]:
    return [tasks.sample(7, i) for i in range(N)]


@pytest.fixture(scope="module")
def lossless() -> list[tasks.Example]:
    """The same pictures encoded as PNG: exact pixels for the oracles that count or measure them."""
    return [tasks.sample(7, i, fmt="PNG") for i in range(N)]


def pixels(ex: tasks.Example) -> np.ndarray:
    """[H, W, 3] int32, decoded by Pillow from the example's bytes."""
    return np.asarray(Image.open(io.BytesIO(ex.data)).convert("RGB"), dtype=np.int32)


def background(px: np.ndarray) -> np.ndarray:
    """The background colour: the median of the one-pixel frame (a shape touches the edge at a point at most)."""
    frame = np.concatenate([px[0], px[-1], px[:, 0], px[:, -1]])
    return np.median(frame, axis=0)


def nearest(rgb, palette: dict[str, tuple[int, int, int]]) -> str:
    names = list(palette)
    dist = [np.linalg.norm(np.asarray(rgb, dtype=float) - palette[n]) for n in names]
    return names[int(np.argmin(dist))]


def count_components(mask: np.ndarray) -> int:
    """Connected components (8-connectivity) of a boolean mask: union-find over the runs of each row."""
    padded = np.pad(mask.astype(np.int8), ((0, 0), (1, 1)))
    rows_s, starts = np.nonzero(np.diff(padded, axis=1) == 1)
    rows_e, ends = np.nonzero(np.diff(padded, axis=1) == -1)  # exclusive; same order as the starts
    assert (rows_s == rows_e).all()
    parent = list(range(len(starts)))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    by_row: dict[int, list[int]] = {}
    for k, r in enumerate(rows_s.tolist()):
        by_row.setdefault(r, []).append(k)
    for r, runs in by_row.items():
        for a in runs:
            for b in by_row.get(r + 1, ()):
                # 8-connected: the runs overlap or touch diagonally
                if starts[a] <= ends[b] and starts[b] <= ends[a]:
                    parent[find(a)] = find(b)
    return len({find(k) for k in range(len(starts))})


def test_count_components_oracle():
    """The labeling itself against hand-made masks (diagonal contact joins, a one-pixel gap separates)."""
    m = np.zeros((8, 10), dtype=bool)
    m[1:3, 1:3] = True
    m[3, 3] = True  # diagonal to the block: same component
    m[1:4, 5] = True
    m[5:7, 7:9] = True
    m[6, 1:5] = True
    assert count_components(m) == 4
    u = np.zeros((5, 5), dtype=bool)
    u[0:4, 0] = u[0:4, 4] = u[4, :] = True  # a U: its two arms meet only through the bottom row
    assert count_components(u) == 1
    assert count_components(np.zeros((3, 3), dtype=bool)) == 0


def test_questions_are_the_issue_phrasings():
    assert set(tasks.QUESTIONS.values()) == ISSUE_QUESTIONS
    assert len(tasks.QUESTIONS) == 5
    assert set(tasks.COLORS) == set(COLOR_NAMES)
    assert set(tasks.SHAPES) == {"circle", "square", "triangle"}


def test_palette_colours_look_like_their_names():
    """Each palette RGB is nearer its own name's web colour than any other name's (yellow is not orange)."""
    web = {
        "red": (255, 0, 0),
        "green": (0, 128, 0),
        "blue": (0, 0, 255),
        "yellow": (255, 255, 0),
        "orange": (255, 165, 0),
        "purple": (128, 0, 128),
        "black": (0, 0, 0),
        "white": (255, 255, 255),
    }
    for name, rgb in tasks.COLORS.items():
        assert nearest(rgb, web) == name


def test_same_seed_and_index_give_the_same_bytes():
    """Noisy backgrounds included (a third of the images): the noise comes from the seed too."""
    for i in range(12):
        a, b = tasks.sample(3, i), tasks.sample(3, i)
        assert a.data == b.data and a.qa == b.qa and a.kind == b.kind and a.size == b.size
    assert all(tasks.sample(3, i).data != tasks.sample(4, i).data for i in range(12))
    assert len({tasks.sample(3, i).data for i in range(12)}) == 12


def test_forced_format_encodes_the_same_picture():
    for i in range(12):
        ex = tasks.sample(3, i)
        for fmt in ("PNG", "JPEG"):
            forced = tasks.sample(3, i, fmt=fmt)
            assert Image.open(io.BytesIO(forced.data)).format == forced.fmt == fmt
            assert (forced.kind, forced.size, forced.qa) == (ex.kind, ex.size, ex.qa)
            if fmt == ex.fmt:
                assert forced.data == ex.data


def test_sizes_aspect_ratios_and_formats(examples):
    fmts = set()
    for ex in examples:
        img = Image.open(io.BytesIO(ex.data))
        img.load()
        assert img.format == ex.fmt, "the stated format is the encoded one"
        fmts.add(img.format)
        assert img.size == ex.size
        w, h = img.size
        assert 64 <= w <= 1024 and 64 <= h <= 1024, img.size
        assert max(w, h) <= 3 * min(w, h), f"aspect ratio of {img.size} is beyond 3:1"
    assert fmts == {"JPEG", "PNG"}
    longs = [max(ex.size) for ex in examples]
    assert min(longs) < 128 and max(longs) > 768, "the whole range of sizes is drawn"


def test_aspect_ratio_at_the_rounding_edge():
    """Sample (0, 1653) draws a ratio just under 3:1 whose short side rounded down (78 x 235 before the fix)."""
    w, h = tasks.sample(0, 1653).size
    assert max(w, h) <= 3 * min(w, h), (w, h)


def test_answers_have_the_issue_forms(examples):
    seen: dict[str, set[str]] = {t: set() for t in tasks.TASKS}
    for ex in examples:
        assert set(ex.qa) == set(tasks.KIND_TASKS[ex.kind])
        for task, answer in ex.qa.items():
            seen[task].add(answer)
            assert tasks.normalize(answer) == answer, "answers are already in their scored form"
        if ex.kind == "single":
            assert ex.qa["count"] == "1"
            assert ex.qa["describe"] == f"a {ex.qa['color']} {ex.qa['shape']}"
        elif ex.kind == "many":
            assert re.fullmatch(r"[2-6]", ex.qa["count"])
            assert ex.qa["describe"] == f"{ex.qa['count']} shapes"
        else:
            assert re.fullmatch(r"[1-9][0-9]{0,3}", ex.qa["number"])
            assert ex.qa["describe"] == f"the number {ex.qa['number']}"
    assert seen["color"] == set(COLOR_NAMES)
    assert seen["shape"] == {"circle", "square", "triangle"}
    assert seen["count"] == {str(n) for n in range(1, 7)}
    assert {len(n) for n in seen["number"]} == {1, 2, 3, 4}


def test_single_shape_has_the_named_colour(lossless):
    palette = dict(tasks.COLORS)
    names = list(palette)
    rgb = np.asarray([palette[n] for n in names], dtype=float)
    singles = [ex for ex in lossless if ex.kind == "single"]
    assert len(singles) > 50
    for ex in singles:
        px = pixels(ex)
        bg = background(px)
        shape = px[np.linalg.norm(px - bg, axis=-1) > DIFFERS]
        assert len(shape) >= 50, f"{ex.size}: only {len(shape)} pixels differ from the background"
        name = ex.qa["color"]
        votes = np.argmin(np.linalg.norm(shape[:, None, :] - rgb[None], axis=-1), axis=1)
        assert np.mean(votes == names.index(name)) > 0.99, "every pixel of the shape is the named colour"
        assert nearest(bg, {**palette, "grey": GREY}) != name, "the background has another colour"


# Images whose squares' corners (once outside the circle the spacing kept apart) touched a neighbour.
TOUCHING = [(0, 26), (0, 118), (0, 257)]


def test_count_equals_connected_components(lossless):
    """The shapes are the connected regions that differ from the background: none touches another."""
    checked = set()
    for ex in lossless + [tasks.sample(seed, i, "many", fmt="PNG") for seed, i in TOUCHING]:
        if ex.kind == "number":
            continue
        px = pixels(ex)
        mask = np.linalg.norm(px - background(px), axis=-1) > DIFFERS
        assert count_components(mask) == int(ex.qa["count"]), (ex.kind, ex.size, ex.qa)
        checked.add(ex.qa["count"])
    assert checked == {str(n) for n in range(1, 7)}


# Numbers whose round digits (0, 3, 6, 8, 9) once drew ink 122-123 px tall for a 120 px glyph.
OVERSHOOT = [(1, 40), (1, 646), (1, 2103)]


def test_numbers_are_dark_glyphs_of_legible_height(lossless):
    numbers = [ex for ex in lossless if ex.kind == "number"]
    numbers += [tasks.sample(seed, i, "number", fmt="PNG") for seed, i in OVERSHOOT]
    assert len(numbers) > 60
    heights = []
    for ex in numbers:
        lum = pixels(ex) @ np.array([0.299, 0.587, 0.114])
        dark = lum < 128
        assert dark.any()
        rows = np.nonzero(dark.any(axis=1))[0]
        height = rows[-1] - rows[0] + 1
        heights.append(height)
        assert 12 - 1 <= height <= 120 + 1, (ex.size, ex.qa, height)
        assert height >= max(ex.size) / 20 - 1, (ex.size, ex.qa, height)
        assert np.median(lum[dark]) < 100 and np.median(lum[~dark]) > 180, "dark text on a light background"
    assert min(heights) < 30 and max(heights) > 100, "the whole range of glyph heights is drawn"


def test_eval_set_asks_each_question_of_images_that_answer_it():
    pairs = tasks.eval_set(11, 6)
    assert [t for _, t in pairs] == [t for t in tasks.TASKS for _ in range(6)]
    for ex, task in pairs:
        assert task in ex.qa and task in tasks.KIND_TASKS[ex.kind]
    assert len({ex.data for ex, _ in pairs}) == len(pairs)


def test_global_random_state_does_not_change_the_output():
    """The generator draws from its own RNG: the global ``random`` state does not change its output."""
    random.seed(1)
    a = tasks.sample(5, 0).data
    random.seed(2)
    assert tasks.sample(5, 0).data == a


def test_outline_coverage_matches_the_drawn_pixels(lossless):
    """``coverage`` (what training labels each patch with) against the pixels that differ from the background,
    on a grid over the image: shapes and digits' ink boxes alike."""
    checked = 0
    for ex in lossless[:120]:
        px = pixels(ex)
        ink = np.linalg.norm(px - background(px), axis=2) > DIFFERS
        h, w = ink.shape
        rows, cols = max(2, h // 16), max(2, w // 16)
        cov = tasks.coverage(ex, rows, cols, sub=16).sum(axis=0)
        assert cov.shape == (rows, cols) and len(ex.outlines) == len(ex.objects)
        # the pixel oracle on the same grid: each cell's share of differing pixels
        ys = (np.arange(h) * rows // h)[:, None]
        xs = (np.arange(w) * cols // w)[None, :]
        cell = ys * cols + xs
        seen = np.bincount(cell.ravel(), ink.ravel(), rows * cols) / np.bincount(
            cell.ravel(), None, rows * cols
        )
        seen = seen.reshape(rows, cols)
        if ex.kind == "number":
            # ink boxes hold the glyphs' strokes and the gaps between them: every inked cell is in a box
            assert (cov[seen > 0.05] > 0).all(), ex
        else:
            # filled shapes: the outline's share of each cell is the drawn share, up to rasterisation
            assert np.abs(cov - seen).max() < 0.3, (ex, np.abs(cov - seen).max())
            assert np.abs(cov - seen).mean() < 0.02
        checked += 1
    assert checked == 120


def test_several_number_images_are_training_only_and_drawn_where_marked():
    """The tower's several-number images: never a task-set kind, and their digits' ink boxes (what the per-cell
    targets come from) hold all the ink the pixels show, and every box has ink inside."""
    assert "numbers" not in tasks.KINDS and all(
        ex.kind in tasks.KINDS for ex in (tasks.sample(7, i) for i in range(60))
    )
    digits = 0
    for i in range(40):
        ex = tasks.sample(9, i, "numbers", fmt="PNG")
        assert ex.qa == {} and len(ex.objects) == len(ex.outlines) > 0
        assert all(label.isdigit() for _, _, label in ex.objects)
        lum = pixels(ex) @ np.array([0.299, 0.587, 0.114])
        dark = lum < 128
        boxed = np.zeros_like(dark)
        for _, coords in ex.outlines:
            (x0, y0), (x1, y1) = coords[0], coords[2]
            box = (slice(max(0, int(y0)), int(np.ceil(y1)) + 1), slice(max(0, int(x0)), int(np.ceil(x1)) + 1))
            assert dark[box].any(), (ex.size, coords)
            boxed[box] = True
        assert not (dark & ~boxed).any(), "every dark pixel is inside a digit's box"
        digits += len(ex.objects)
    assert digits > 40 * 2.5 * 2, "several numbers an image, on average"
