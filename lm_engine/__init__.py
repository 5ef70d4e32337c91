"""vlmserve's paged-KV language engine."""

from __future__ import annotations

from lm_engine.admission import EngineOverloaded
from lm_engine.config import EngineConfig
from lm_engine.engine import LLMEngine
from lm_engine.llm import LLM
from lm_engine.outputs import CompletionOutput, RequestOutput
from lm_engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineOverloaded",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]
