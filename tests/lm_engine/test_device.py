"""Device hygiene that a CPU can check: which errors are fatal, per-thread binding, one host→device copy."""

from __future__ import annotations

import threading

import torch

from lm_engine import LLM, SamplingParams, model_runner
from lm_engine.device import DeviceBinding, is_fatal_device_error
from lm_engine.step_inputs import build_step
from tests.support import image_part, make_image, user


def test_fatal_device_errors():
    for message in (
        "CUDA error: device-side assert triggered",
        "CUDA error: an illegal memory access was encountered",
        "CUDA error: misaligned address",
    ):
        assert is_fatal_device_error(RuntimeError(message))
    assert is_fatal_device_error(torch.AcceleratorError("anything"))
    assert not is_fatal_device_error(RuntimeError("shape mismatch"))
    assert not is_fatal_device_error(ValueError("CUDA error"))  # only the runtime raises those


def test_binding_sets_the_device_once_in_every_thread(monkeypatch):
    calls: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda d: calls.append((threading.current_thread().name, d))
    )
    bind = DeviceBinding(torch.device("cuda:1"))
    for _ in range(3):
        bind()
    worker = threading.Thread(target=lambda: [bind(), bind()], name="encoder")
    worker.start()
    worker.join()
    assert [name for name, _ in calls] == [threading.current_thread().name, "encoder"]
    assert {d for _, d in calls} == {1}
    DeviceBinding(torch.device("cpu"))()
    assert len(calls) == 2


def test_binding_of_plain_cuda_names_the_creating_threads_device(monkeypatch):
    """``--device cuda`` binds every worker thread to the device current where the engine was built (a new
    thread's own current device is 0), by index: torch 2.11's set_device refuses an index-less device, which
    the first GPU run of benchmarks/gpu_check.py hit."""
    calls: list[int] = []

    def set_device(d):
        if isinstance(d, torch.device) and d.index is None:  # as torch's _get_device_index raises
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{d}")
        calls.append(d.index if isinstance(d, torch.device) else int(d))

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    bind = DeviceBinding(torch.device("cuda"))
    assert bind.device == torch.device("cuda:3")
    worker = threading.Thread(target=bind)
    worker.start()
    worker.join()
    assert calls == [3]


def test_step_inputs_travel_in_one_buffer(tiny_ckpt, monkeypatch):
    """Every integer input of a step (ids, positions, slots, block tables, image rows, logit rows) is a view
    of one host→device copy, not a copy of its own."""
    with LLM(str(tiny_ckpt), num_kv_blocks=64, max_num_batched_tokens=64) as llm:
        eng = llm.engine
        batches = []
        monkeypatch.setattr(
            model_runner, "build_step", lambda *args: batches.append(build_step(*args)) or batches[-1]
        )
        # A long prompt whose image comes last, admitted first; a short one joins once it runs, so a later
        # step carries the short one's decode beside the long one's image rows.
        eng.add_request(
            "long", user("a longer one " * 30, image_part(make_image(224, 224, 1))), SamplingParams()
        )
        while not batches:
            eng.step()
        eng.add_request(
            "short", user("hi"), SamplingParams(max_tokens=8), "B"
        )  # another client: a fair share

        def mixed():
            return [b for b in batches if b.meta.num_decode_tokens and b.mm_rows is not None]

        while eng.has_unfinished() and not mixed():
            eng.step()
        step = mixed()[0]
        m = step.meta
        views = [step.input_ids, step.positions, m.slot_mapping, step.mm_rows, step.logit_rows]
        views += m.prefill_block_tables
        assert len({v.untyped_storage().data_ptr() for v in views}) == 1
        assert all(v.data_ptr() % 64 == 0 for v in views)
        # every slot a real one, so the layers' KV writes skip looking: as the slots themselves say
        assert all(b.meta.all_slots_written == bool((b.meta.slot_mapping >= 0).all()) for b in batches)
        assert all(b.meta.all_slots_written for b in batches)
