"""Can the demo preset's vision tower learn "which shape" from scratch? A probe for the train-demo recipe.

Trains only the demo preset's vision tower (transformers' Qwen2-VL module, as ``vlmserve train-demo`` does)
plus one linear head on each image's mean merged embedding to classify circle / square / triangle, and
prints the batch accuracy every 20 steps (each batch is unseen: the accuracy before the update is a
held-out figure). Two image sources:

- ``--images task``: the task set's single-shape images (``tools/demo_tasks.py``: colours on
  neutral backgrounds, 64-1024 px, any aspect ratio, JPEG/PNG), preprocessed at ``--max-pixels``;
- ``--images easy``: a black shape on white, 112 x 112, radius 20-40 px.

Measured 2026-12-01 (AMD EPYC 2 vCPUs, avx512_bf16; the defaults: 32 images per step, lr 1e-3, bf16
autocast, 181 steps): ``--images easy`` went from loss 1.10 to 0.40 (batch accuracy 0.56 at step 100, 0.81
at step 180); ``--images task`` stayed at chance (loss 1.11 at step 180, ln 3 = 1.10) for 5,800 images, and
a variant at 100,352 max_pixels did the same for 4,500. Whatever keeps train-demo's shape answers at chance
is in the task set's images, not in the decoder. One property at a time (same defaults, 141 steps):
``--black-on-white`` (the task set's sizes, aspect ratios, noise and JPEG, but black on white) began to
learn (loss 0.85-1.02 from step 80, batch accuracy 0.50-0.59); ``--radius 0.6,0.9`` (the colours, but
larger shapes) too (loss 0.93-1.01 from step 100); both flags together: loss 0.955 already at step 20.
Contrast and size both hold it back.

    .venv/bin/python benchmarks/demo_shape_probe.py --images easy
    .venv/bin/python benchmarks/demo_shape_probe.py --images task --max-pixels 12544 --steps 200
    .venv/bin/python benchmarks/demo_shape_probe.py --images task --black-on-white --steps 141
    .venv/bin/python benchmarks/demo_shape_probe.py --images task --radius 0.6,0.9 --steps 141
"""

from __future__ import annotations

if not __package__:  # run by path: the repository root onto sys.path, once (benchmarks/_path.py)
    import _path  # noqa: F401

import argparse
import io
import random
import tempfile
import time
from pathlib import Path


def easy_image(rng: random.Random) -> tuple[bytes, int]:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (112, 112), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    kind, r = rng.randrange(3), rng.uniform(20, 40)
    cx, cy = rng.uniform(r, 112 - r), rng.uniform(r, 112 - r)
    if kind == 0:
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=(0, 0, 0))
    elif kind == 1:
        draw.rectangle([cx - 0.85 * r, cy - 0.85 * r, cx + 0.85 * r, cy + 0.85 * r], fill=(0, 0, 0))
    else:
        draw.polygon([(cx, cy - r), (cx - 0.87 * r, cy + r / 2), (cx + 0.87 * r, cy + r / 2)], fill=(0, 0, 0))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue(), kind


def vary_task_set(black_on_white: bool, radius: str | None) -> None:
    """Change one property of the task set's single-shape images, in this process only."""
    from tools import demo_tasks as tasks

    if black_on_white:
        tasks.COLORS = {"black": (20, 20, 20)}
        tasks.BACKGROUNDS = ((245, 245, 245),)
    if radius:
        lo, hi = (float(x) for x in radius.split(","))

        def single(rng):  # the task set's _single with another radius range
            w, h = tasks._canvas(rng)
            color, shape = rng.choice(list(tasks.COLORS)), rng.choice(tasks.SHAPES)
            img = tasks._background((w, h), rng.choice(tasks.BACKGROUNDS), rng)
            r = min(w, h) / 2 * rng.uniform(lo, hi)
            cx, cy = rng.uniform(r, w - r), rng.uniform(r, h - r)
            rgb = tasks._jitter(tasks.COLORS[color], rng)
            outline = tasks._draw_shape(tasks.ImageDraw.Draw(img), shape, cx, cy, r, rgb, rng)
            return img, {"color": color, "shape": shape, "count": "1"}, ((cx, cy, shape),), (outline,)

        tasks._MAKERS["single"] = single


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", choices=["task", "easy"], default="task")
    ap.add_argument("--max-pixels", type=int, default=12544)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument(
        "--black-on-white", action="store_true", help="task images with every shape black on a white ground"
    )
    ap.add_argument(
        "--radius",
        default=None,
        help="LO,HI: task shapes' radius as a fraction of half the shorter side (the task set: 0.25,0.7)",
    )
    ap.add_argument(
        "--dense",
        action="store_true",
        help="also train per-patch heads: the kind of shape covering each patch, and how much of it",
    )
    ap.add_argument("--filter-init", action="store_true", help="start the patch embedding from edge filters")
    ap.add_argument("--eval-every", type=int, default=40, help="steps between held-out checks (96 images)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    vary_task_set(args.black_on_white, args.radius)

    import torch

    from preprocess.image import preprocess
    from tools import demo_tasks as tasks
    from tools import demo_train
    from tools.qwen2_vl_make import make_checkpoint

    torch.set_num_threads(2)
    ckpt = make_checkpoint(Path(tempfile.mkdtemp(prefix="demo-probe-")), preset=demo_train.PRESET)
    model = demo_train.build_model(0, filter_init=args.filter_init)
    pre = demo_train.Encoder(ckpt).pre
    head = torch.nn.Linear(model.config.text_config.hidden_size, 3)
    patch_head = torch.nn.Linear(model.config.vision_config.embed_dim, 5)  # none + 3 kinds, coverage
    params = [*model.model.visual.parameters(), *head.parameters(), *patch_head.parameters()]
    opt = torch.optim.AdamW(params, lr=args.lr)
    rng = random.Random(args.seed)
    compute = demo_train.TrainConfig().autocast  # bfloat16 where this CPU runs it fast, as train-demo
    held = [tasks.sample(args.seed + 1000, i, "single") for i in range(96)]
    held_pix = [preprocess(e.data, pre, args.max_pixels) for e in held]
    held_target = torch.tensor([tasks.SHAPES.index(e.qa["shape"]) for e in held])

    def held_out() -> str:
        with torch.no_grad(), compute():
            pix = torch.cat([torch.from_numpy(p.patches) for p in held_pix])
            grid = torch.tensor([p.grid_thw for p in held_pix])
            out = model.model.get_image_features(pix, grid, return_dict=True)
            pooled = head(torch.stack([m.mean(dim=0) for m in out.pooler_output])).float()
            probs = patch_head(out.last_hidden_state).float()[:, :4].softmax(-1)
            probs = probs[:, 1:]  # each patch votes with its probability of each kind (not "none")
            votes = torch.stack([v.sum(0) for v in probs.split([int(g.prod()) for g in grid])])
        a = (pooled.argmax(-1) == held_target).float().mean().item()
        b = (votes.argmax(-1) == held_target).float().mean().item()
        return f"held-out shape accuracy: pooled head {a:.2f}, patch vote {b:.2f}"

    t0 = time.perf_counter()
    for step in range(args.steps):
        if args.images == "easy":
            batch = [easy_image(rng) for _ in range(args.batch)]
        else:
            exs = [tasks.sample(args.seed, step * args.batch + j, "single") for j in range(args.batch)]
            batch = [(e.data, tasks.SHAPES.index(e.qa["shape"])) for e in exs]
        patches = [preprocess(data, pre, args.max_pixels) for data, _ in batch]
        if args.dense:
            kinds, covers = patch_targets(exs, patches)
        pixels = torch.cat([torch.from_numpy(p.patches) for p in patches])
        grid = torch.tensor([p.grid_thw for p in patches])
        target = torch.tensor([k for _, k in batch])
        with compute():
            out = model.model.get_image_features(pixels, grid, return_dict=True)
            merged = out.pooler_output
            logits = head(torch.stack([m.mean(dim=0) for m in merged])).float()
            dense = patch_head(out.last_hidden_state).float() if args.dense else None
        loss = torch.nn.functional.cross_entropy(logits, target)
        if dense is not None:
            dense_loss = torch.nn.functional.cross_entropy(dense[:, :4], kinds)
            dense_loss = dense_loss + torch.nn.functional.mse_loss(torch.sigmoid(dense[:, 4]), covers) * 4
            loss = loss + dense_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if args.eval_every and (step % args.eval_every == 0 or step == args.steps - 1):
            print(f"step {step:4d}  {held_out()}", flush=True)
        if step % 20 == 0 or step == args.steps - 1:
            acc = (logits.argmax(-1) == target).float().mean().item()
            if dense is not None:
                # the image's shape read from its patches: the kind most probable over the covered patches
                probs = dense[:, 1:4].softmax(-1) * (kinds > 0).unsqueeze(1)
                sizes = [int(g.prod()) for g in grid]
                votes = torch.stack([v.sum(0) for v in probs.split(sizes)])
                edge = (covers > 0.05) & (covers < 0.95)
                hits = dense[edge, :4].argmax(-1) == kinds[edge]
                print(
                    f"           patch vote accuracy {(votes.argmax(-1) == target).float().mean().item():.2f}"
                    f"  edge-patch accuracy {hits.float().mean().item():.2f}"
                )
            print(
                f"step {step:4d}  loss {loss.item():.3f}  batch accuracy {acc:.2f}  {time.perf_counter() - t0:5.0f} s"
            )
    return 0


def patch_targets(exs: list, patches: list) -> tuple:
    """The per-patch heads' targets, in the tower's patch order: each patch's kind of shape (0: none, where the
    shape covers 15 % of it or less) and how much of it the shape covers."""
    import torch

    from tools import demo_tasks as tasks
    from tools import demo_train

    kinds, covers = [], []
    for e, p in zip(exs, patches):
        _, gh, gw = p.grid_thw
        cov = torch.from_numpy(tasks.coverage(e, gh, gw)).amax(dim=0)  # [gh, gw], one shape
        order = demo_train.patch_order(gh, gw)
        label = tasks.SHAPES.index(e.qa["shape"]) + 1
        kinds.append(torch.where(cov > 0.15, label, 0).flatten()[order])
        covers.append(cov.flatten()[order])
    return torch.cat(kinds), torch.cat(covers)


if __name__ == "__main__":
    raise SystemExit(main())
