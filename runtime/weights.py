"""Reading tensors from a local Hugging Face checkpoint directory (single file or sharded index), for the
vision towers and the decoders alike.

With a sharded index and name prefixes, only the shards that hold a wanted tensor are opened (the vision
tower loads without reading the decoder's shards)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

# What nn.Linear, nn.Embedding, nn.Conv3d, nn.LayerNorm and the like call to fill their parameters when built.
_INITS = (
    "uniform_", "normal_", "trunc_normal_", "constant_", "zeros_", "ones_", "xavier_uniform_", "xavier_normal_",
    "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
)  # fmt: skip


@contextlib.contextmanager
def uninitialized(dtype: torch.dtype):
    """Build modules whose every parameter the checkpoint then overwrites: parameters are made in ``dtype`` and
    left unfilled. At the 2B shape, drawing random weights that loading replaces took 20 s of a 70 s start, and
    building in float32 before casting took twice the weights' memory (33 GB at the 7B shape, on a 24 GB
    machine). Tensors a module makes with an explicit dtype (rotary frequencies in float32) keep it; the
    loaders refuse a checkpoint that leaves a parameter unset."""
    saved = {name: getattr(nn.init, name) for name in _INITS}
    previous = torch.get_default_dtype()
    try:
        for name in _INITS:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        torch.set_default_dtype(dtype)
        yield
    finally:
        torch.set_default_dtype(previous)
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def checkpoint_shards(path: str | Path) -> dict[Path, list[str] | None]:
    """Shard → the tensor names the index says it holds (``None`` for a single file: every name in it)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        shards: dict[Path, list[str] | None] = {}
        for name, shard in sorted(weight_map.items(), key=lambda kv: kv[1]):
            shards.setdefault(path / shard, []).append(name)
        for f in shards:
            if not f.is_file():
                raise FileNotFoundError(f"checkpoint {path}: shard {f.name} named in {index.name} is missing")
        return shards
    single = path / "model.safetensors"
    if single.is_file():
        return {single: None}
    raise FileNotFoundError(
        f"checkpoint {path} has neither model.safetensors nor model.safetensors.index.json"
    )


def iter_checkpoint_tensors(
    path: str | Path, prefixes: tuple[str, ...] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor, or for those whose name starts with one of ``prefixes``."""
    for file, names in checkpoint_shards(path).items():
        if prefixes is not None and names is not None and not any(n.startswith(prefixes) for n in names):
            continue
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if prefixes is None or name.startswith(prefixes):
                    yield name, f.get_tensor(name)


def read_tensors(path: str | Path, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Every tensor whose name starts with one of ``prefixes``, by its checkpoint name."""
    return dict(iter_checkpoint_tensors(path, prefixes))
