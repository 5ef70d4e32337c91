"""vlmserve: preprocess — image bytes → Qwen2-VL pixel patches, in a CPU process pool.

Where an image is hashed (hashing.py), probed without decoding (probe.py), given its grid
(grid.py) and turned into patches (image.py); pool.py runs that in worker processes.
"""

from preprocess.config import PreprocessConfig
from preprocess.errors import PreprocessError, PreprocessWorkerError
from preprocess.grid import num_visual_tokens, plan_grid, smart_resize
from preprocess.hashing import image_hash
from preprocess.image import PixelPatches, preprocess
from preprocess.pool import PoolStats, PreprocessPool
from preprocess.probe import ImageInfo, probe

__all__ = [
    "ImageInfo",
    "PixelPatches",
    "PoolStats",
    "PreprocessConfig",
    "PreprocessError",
    "PreprocessPool",
    "PreprocessWorkerError",
    "image_hash",
    "num_visual_tokens",
    "plan_grid",
    "preprocess",
    "probe",
    "smart_resize",
]
