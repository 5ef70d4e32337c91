"""Reading tensors from a local Hugging Face checkpoint directory (single file or sharded index), for the
vision towers and the decoders alike.

With a sharded index and name prefixes, only the shards that hold a wanted tensor are opened (the vision
tower loads without reading the decoder's shards)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


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
