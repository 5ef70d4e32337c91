"""What an image's embedding must look like to the model that reads it.

Everything read back from a cache tier (Redis above all: any replica, or anyone who can reach it, writes
there) or received from the encoder pool is untrusted input: the codec proves an entry is well formed, this
proves it fits its key. A tensor of another dtype, row count or width would fail the engine step that places
it, and with it every request of that step; checked here, it is a miss instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cache.key import EmbeddingKey

# (key, tensor) -> why the tensor cannot be the key's embedding, or None when it can.
Check = Callable[[EmbeddingKey, torch.Tensor], str | None]


@dataclass(frozen=True, slots=True)
class EmbeddingLayout:
    """One row per merged visual token of the key's grid, ``row_width`` wide (the main embedding and every
    deepstack level), in the model's dtype. None leaves that part unchecked."""

    merge_size: int
    row_width: int | None = None
    dtype: torch.dtype | None = None
    levels: int | None = None

    def rows(self, key: EmbeddingKey) -> int:
        return math.prod(key.grid) // self.merge_size**2

    def problem(self, key: EmbeddingKey, tensor: torch.Tensor) -> str | None:
        if self.levels is not None and key.levels != self.levels:
            return f"the key asks for {key.levels} deepstack levels, the model has {self.levels}"
        if self.dtype is not None and tensor.dtype != self.dtype:
            return f"dtype {tensor.dtype}, the model's is {self.dtype}"
        rows, width = self.rows(key), self.row_width
        shape = tuple(tensor.shape)
        if len(shape) != 2 or shape[0] != rows or (width is not None and shape[1] != width):
            return f"shape {shape}, grid {key.grid} needs ({rows}, {width if width is not None else 'any'})"
        if key.levels and shape[1] % (1 + key.levels):
            return f"rows of width {shape[1]} do not split into {1 + key.levels} levels"
        return None
