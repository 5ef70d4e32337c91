"""The offline entry point: batch generation without a server."""

from __future__ import annotations

import itertools
from dataclasses import fields

from tqdm.auto import tqdm

from lm_engine.config import EngineConfig
from lm_engine.engine import LLMEngine
from lm_engine.outputs import RequestOutput
from lm_engine.sampling_params import SamplingParams
from runtime.memory import bound_native_caches, huge_page_tensors


class LLM:
    """``LLM(model=DIR, **engine options).chat(conversations, SamplingParams(...))``.

    ``model``: a checkpoint directory (the embedded demo model's is ``tools.demo.demo_checkpoint()``).
    """

    def __init__(self, model: str, **kwargs) -> None:
        # NOTE: before the engine's warm-up runs the first matmul, as `vlmserve serve` and `batch` do; it keeps
        # what the environment already sets, so a second LLM (or a caller's own call) changes nothing.
        bound_native_caches()
        huge_page_tensors()
        known = {f.name for f in fields(EngineConfig)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown LLM options: {sorted(unknown)}")
        self.engine = LLMEngine(EngineConfig(model=str(model), **kwargs))
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the vision pipeline's threads and the preprocess processes."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def chat(
        self,
        conversations: list[list[dict]] | list[dict],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One output per conversation; ``params`` is one for all or a list, one per conversation."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # a single conversation
        if isinstance(params, list):
            if len(params) != len(conversations):
                raise ValueError(f"{len(params)} sampling params for {len(conversations)} conversations")
            per_conv = params
        else:
            per_conv = [params or SamplingParams()] * len(conversations)
        ids = []
        for conv, conv_params in zip(conversations, per_conv):
            rid = f"offline-{next(self._ids)}"
            self.engine.add_request(rid, conv, conv_params)
            ids.append(rid)
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="requests", disable=not use_tqdm)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]
