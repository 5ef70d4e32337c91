"""The engine talks to one interface, EncoderClient, whichever encodes its images: both the in-process pipeline
and the encoder tier's client implement every member of it, methods with the interface's parameters."""

from __future__ import annotations

import inspect

from encoder import EncoderClient, VisionPipeline
from encoder.tier.client import RemoteVisionPipeline
from preprocess import PreprocessConfig

MEMBERS = {"fatal", "stats", "pending", "submit", "take_results", "wait", "close"}


def _methods(cls) -> dict[str, list[str]]:
    return {
        name: list(inspect.signature(value).parameters)
        for name, value in vars(cls).items()
        if not name.startswith("_") and inspect.isfunction(value)
    }


def test_both_pipelines_implement_the_whole_interface():
    declared = {n for n, v in vars(EncoderClient).items() if isinstance(v, property)} | set(
        _methods(EncoderClient)
    )
    assert declared == MEMBERS
    local = VisionPipeline(lambda pixels, grid: pixels, PreprocessConfig(), merge_size=2)
    try:
        assert isinstance(local, EncoderClient)  # every member, the attributes set in __init__ included
    finally:
        local.close()
    for name in MEMBERS:  # the remote client's are all on the class (properties delegate to its fallback)
        assert hasattr(RemoteVisionPipeline, name), name
    for cls in (VisionPipeline, RemoteVisionPipeline):
        ours = _methods(cls)
        for name, params in _methods(EncoderClient).items():
            assert ours[name] == params, f"{cls.__name__}.{name}{ours[name]} against {params}"


def test_the_check_fails_for_a_partial_client():
    class Partial:
        pending = 0

        def submit(self, jobs):
            pass

    assert not isinstance(Partial(), EncoderClient)
