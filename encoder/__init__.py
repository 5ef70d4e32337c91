"""vlmserve: encoder — image items → connector embeddings (cache lookup, preprocessing, batched ViT)."""

from encoder.pipeline import VisionPipeline, vision_fingerprint

__all__ = ["VisionPipeline", "vision_fingerprint"]
