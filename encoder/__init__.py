"""vlmserve: encoder — image items → connector embeddings (cache lookup, preprocessing, batched ViT)."""

from encoder.pipeline import Encoded, EncodeJob, VisionPipeline, vision_fingerprint

__all__ = ["EncodeJob", "Encoded", "VisionPipeline", "vision_fingerprint"]
