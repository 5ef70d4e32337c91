"""Vision towers + mergers of the supported families, by the checkpoint's ``model_type``."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch

from encoder.models.base import VisionTower
from encoder.models.qwen2_5_vl import Qwen25VisionConfig, Qwen25VisionTower
from encoder.models.qwen2_vl import Qwen2VisionTower, VisionConfig
from encoder.models.qwen3_vl import Qwen3VisionConfig, Qwen3VisionTower
from runtime.weights import uninitialized

_ARCHITECTURES = {
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "Qwen3VLForConditionalGeneration": "qwen3_vl",
}


def family_of(config: dict) -> str:
    """The checkpoint's family (``model_type``, or what its architecture names)."""
    model_type = config.get("model_type")
    if model_type in _TOWERS:
        return model_type
    for arch in config.get("architectures") or []:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]
    raise ValueError(f"no vision tower for model_type {model_type!r}; supported: {sorted(_TOWERS)}")


_WEIGHT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def read_config(checkpoint: str | Path) -> dict:
    """A checkpoint's config.json, read."""
    cfg_file = Path(checkpoint) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"checkpoint {checkpoint} has no config.json")
    return json.loads(cfg_file.read_text())


def checkpoint_dtype(config: dict) -> torch.dtype:
    """The dtype a checkpoint's config names for its weights, as its family writes it (Qwen3-VL's ``dtype`` in
    the text config, the older families' ``torch_dtype``); float32 where it names none. The decoder's config
    and the encoder tier read it here, so both resolve one compute dtype."""
    text = {**config, **(config.get("text_config") or {})}
    if family_of(config) == "qwen3_vl":
        name = text.get("dtype") or text.get("torch_dtype") or config.get("dtype")
    else:
        name = text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype")
    return _WEIGHT_DTYPES.get(str(name or "float32").replace("torch.", ""), torch.float32)


def merge_size(config: dict) -> int:
    """How many patches a side the merger folds into one token (the vision config's ``spatial_merge_size``)."""
    return int((config.get("vision_config") or {}).get("spatial_merge_size", 2))


_TOWERS = {
    "qwen2_vl": (Qwen2VisionTower, VisionConfig),
    "qwen2_5_vl": (Qwen25VisionTower, Qwen25VisionConfig),
    "qwen3_vl": (Qwen3VisionTower, Qwen3VisionConfig),
}


def build_vision_tower(
    config: dict,
    checkpoint: str | Path | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attention: str | None = None,
) -> VisionTower:
    """The tower of the family ``config`` (a config.json's content) names, in ``dtype`` on ``device``, with
    the checkpoint's weights when ``checkpoint`` is given, and its attention chosen: ``attention``, else
    ``$VLMSERVE_VISION_ATTENTION``, else ``auto`` (the faster on this machine, timed)."""
    attention = attention or os.environ.get("VLMSERVE_VISION_ATTENTION") or "auto"
    tower_cls, config_cls = _TOWERS[family_of(config)]
    device = torch.device(device)
    # NOTE: with a checkpoint every parameter is loaded from it: none is drawn first (see ``uninitialized``).
    build = uninitialized(dtype) if checkpoint is not None else contextlib.nullcontext()
    with torch.device(device), build:
        tower = tower_cls(config_cls.from_config(config), attention=attention)
    tower.to(dtype)
    if checkpoint is not None:
        tower.load_weights(checkpoint)
    tower.eval()
    tower.select_attention()
    if device.type != "cpu":
        # NOTE: the row budget keeps a CPU pass's activations in cache. A GPU pass is launch-bound at these
        # sizes (Qwen2.5-VL, three images on an H200: 565 launches, 2.7 ms of device time in a 26 ms pass),
        # and every extra pass repeats each block's launches: one pass. Not yet timed on a GPU against the
        # 4,096-row passes (the next lent GPU's gpu_check.sh prints it).
        tower.rows_per_pass = 0
    return tower


__all__ = [
    "checkpoint_dtype",
    "merge_size",
    "read_config",
    "Qwen25VisionConfig",
    "Qwen25VisionTower",
    "Qwen2VisionTower",
    "Qwen3VisionConfig",
    "Qwen3VisionTower",
    "VisionConfig",
    "VisionTower",
    "build_vision_tower",
    "family_of",
]
