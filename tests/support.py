"""Test helpers shared across folders: test images, chat builders, and transformers as the oracle."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps


def make_image(width: int, height: int, seed: int, fmt: str = "PNG") -> bytes:
    """A structured random picture (gradient + blocks + noise) encoded as ``fmt``."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([(xx * (seed % 7 + 1)) % 256, (yy * (seed % 5 + 2)) % 256, ((xx + yy) * 3) % 256], -1)
    noise = rng.integers(0, 64, size=(height, width, 3))
    arr = ((base + noise) % 256).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


def image_part(data: bytes) -> dict:
    return {"type": "image", "image": data}


def user(*parts) -> list[dict]:
    content = [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}]


class HFOracle:
    """transformers' own processor + generate() on the same checkpoint (fp32, greedy)."""

    def __init__(self, ckpt: Path) -> None:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.processor = AutoProcessor.from_pretrained(str(ckpt))
        self.model = AutoModelForImageTextToText.from_pretrained(str(ckpt), dtype=torch.float32).eval()
        self._memo: dict[tuple, list[int]] = {}

    def inputs(self, conv: list[dict]):
        images, msgs = [], []
        for m in conv:
            content = m["content"]
            if isinstance(content, list):
                parts = []
                for p in content:
                    if p.get("type") == "image":
                        # NOTE: as transformers' own load_image does: EXIF orientation applied (its processor alone
                        # does not rotate PIL images), alpha left to the processor's convert_to_rgb.
                        images.append(ImageOps.exif_transpose(Image.open(io.BytesIO(p["image"]))))
                        parts.append({"type": "image"})
                    else:
                        parts.append(p)
                content = parts
            msgs.append({"role": m["role"], "content": content})
        text = self.processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return self.processor(text=[text], images=images or None, return_tensors="pt")

    @torch.no_grad()
    def generate(self, conv: list[dict], max_new_tokens: int) -> list[int]:
        key = (repr(conv), max_new_tokens)
        if key not in self._memo:
            inputs = self.inputs(conv)
            out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
            self._memo[key] = out[0, inputs["input_ids"].shape[1] :].tolist()
        return self._memo[key]
