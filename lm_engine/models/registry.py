"""Decoder families by the checkpoint's ``model_type`` (as ``encoder.models`` maps it to the vision tower):
each family's config reader and decoder class."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from encoder.models import family_of, read_config
from lm_engine.models.qwen2_vl import Qwen2VLConfig, Qwen2VLDecoder
from lm_engine.models.qwen3_vl import Qwen3VLConfig, Qwen3VLDecoder

_DECODERS: dict[str, tuple[type, type[nn.Module]]] = {
    "qwen2_vl": (Qwen2VLConfig, Qwen2VLDecoder),
    "qwen2_5_vl": (Qwen2VLConfig, Qwen2VLDecoder),  # Qwen2-VL's decoder; only the tower differs
    "qwen3_vl": (Qwen3VLConfig, Qwen3VLDecoder),
}

# NOTE: every family's config subclasses Qwen2VLConfig, so a dispatch on the config's type must take its own
# class before a base's (``build_decoder``), never the first isinstance match
ModelConfig = Qwen2VLConfig


def load_model_config(path: str | Path) -> ModelConfig:
    """The decoder config of the checkpoint at ``path``, by its family."""
    cfg_file = Path(path) / "config.json"
    family = family_of(read_config(path))
    if family not in _DECODERS:
        raise ValueError(f"{cfg_file}: no decoder for model_type {family!r}; supported: {sorted(_DECODERS)}")
    return _DECODERS[family][0].from_dir(path)


def build_decoder(cfg: ModelConfig) -> nn.Module:
    """The (uninitialised) decoder for ``cfg``'s family: its own class's, else its nearest base's."""
    by_config = {config_cls: decoder_cls for config_cls, decoder_cls in _DECODERS.values()}
    for cls in type(cfg).__mro__:
        if cls in by_config:
            return by_config[cls](cfg)
    raise TypeError(f"no decoder for config {type(cfg).__name__}")
