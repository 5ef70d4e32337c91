"""vlmserve: encoder — image items → connector embeddings (cache lookup, preprocessing, batched ViT)."""

from encoder.pipeline import Encoded, EncodeJob, EncoderClient, VisionPipeline, vision_fingerprint

__all__ = ["EncodeJob", "Encoded", "EncoderClient", "VisionPipeline", "vision_fingerprint"]
