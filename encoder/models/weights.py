"""The vision tower's tensors, read straight from a local checkpoint's safetensors (single file or sharded).

With a sharded index only the shards that hold a wanted tensor are opened, so a tower loads without
reading the decoder's shards."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


def _files_by_name(path: Path) -> dict[Path, list[str] | None]:
    """Shard → the tensor names it holds (``None``: every name in the file)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files: dict[Path, list[str] | None] = {}
        for name, shard in weight_map.items():
            files.setdefault(path / shard, []).append(name)
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"checkpoint {path}: shard {f.name} named in {index.name} is missing")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return {single: None}
    raise FileNotFoundError(
        f"checkpoint {path} has neither model.safetensors nor model.safetensors.index.json"
    )


def read_tensors(path: str | Path, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Every tensor whose name starts with one of ``prefixes``, by its checkpoint name."""
    out: dict[str, torch.Tensor] = {}
    for file, names in _files_by_name(Path(path)).items():
        if names is not None and not any(n.startswith(prefixes) for n in names):
            continue
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if name.startswith(prefixes):
                    out[name] = f.get_tensor(name)
    return out
