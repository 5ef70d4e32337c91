"""Reading tensors from a local Hugging Face checkpoint directory (single file or sharded index)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def checkpoint_files(path: str | Path) -> list[Path]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"checkpoint {path}: shard {f.name} named in {index.name} is missing")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"checkpoint {path} has neither model.safetensors nor model.safetensors.index.json"
    )


def iter_checkpoint_tensors(
    path: str | Path, prefixes: tuple[str, ...] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if prefixes is None or name.startswith(prefixes):
                    yield name, f.get_tensor(name)
