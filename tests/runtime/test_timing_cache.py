"""Start-up probe results are kept per CPU and library version, measured again when either changes or when asked,
and the cache file can never stop a start-up."""

from __future__ import annotations

import json

import pytest

from runtime import timing_cache
from runtime.timing_cache import cache_path, cached_probe

ZEN4 = {
    "cpu_model": "AMD EPYC 9R14",
    "cpu_flags": "avx2 avx512f avx512_bf16",
    "torch": "2.9.0",
    "probe_version": "1",
}


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("VLMSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("VLMSERVE_REMEASURE_PROBES", raising=False)
    return tmp_path


class Probe:
    """A measurement that counts its runs and answers what it is told."""

    def __init__(self, value=True) -> None:
        self.value, self.runs = value, 0

    def __call__(self):
        self.runs += 1
        return self.value


def test_a_second_start_reads_what_the_first_measured(cache_dir):
    probe = Probe("kernel")
    assert cached_probe("vision_attention", {"heads": 16}, probe, identity=ZEN4) == "kernel"
    assert cached_probe("vision_attention", {"heads": 16}, Probe("torch"), identity=ZEN4) == "kernel"
    assert probe.runs == 1
    assert cache_path() == cache_dir / "probes.json"
    (entry,) = json.loads(cache_path().read_text()).values()
    assert (
        entry["name"] == "vision_attention" and entry["args"] == {"heads": 16} and entry["value"] == "kernel"
    )


@pytest.mark.parametrize(
    "changed",
    [
        {"cpu_model": "Intel Xeon Platinum 8488C"},
        {"cpu_flags": "avx2"},  # the same model name with AVX-512 switched off (another VM type)
        {"torch": "2.10.0"},
        {"probe_version": "2"},
    ],
)
def test_another_cpu_or_library_version_measures_again(changed):
    cached_probe("matmul_is_fast", {"dtype": "bfloat16"}, Probe(True), identity=ZEN4)
    probe = Probe(False)
    assert cached_probe("matmul_is_fast", {"dtype": "bfloat16"}, probe, identity={**ZEN4, **changed}) is False
    assert probe.runs == 1
    # both machines' results are kept side by side
    assert cached_probe("matmul_is_fast", {"dtype": "bfloat16"}, Probe(None), identity=ZEN4) is True


def test_other_arguments_are_another_probe():
    cached_probe("matmul_is_fast", {"dtype": "bfloat16"}, Probe(True), identity=ZEN4)
    probe = Probe(False)
    assert cached_probe("matmul_is_fast", {"dtype": "float16"}, probe, identity=ZEN4) is False
    assert probe.runs == 1


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"\xff\xfe\x00", b""])
def test_a_corrupt_file_is_ignored_and_rewritten(cache_dir, content):
    (cache_dir / "probes.json").write_bytes(content)
    probe = Probe(1.5)
    assert cached_probe("p", {}, probe, identity=ZEN4) == 1.5
    assert probe.runs == 1
    assert list(json.loads(cache_path().read_text()).values())[0]["value"] == 1.5
    assert cached_probe("p", {}, Probe(0.0), identity=ZEN4) == 1.5


def test_an_unwritable_cache_directory_only_costs_a_measurement(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("VLMSERVE_CACHE_DIR", str(blocker / "below"))  # cannot be made: its parent is a file
    probe = Probe("sdpa")
    assert cached_probe("causal_prefill", {}, probe, identity=ZEN4) == "sdpa"
    assert cached_probe("causal_prefill", {}, probe, identity=ZEN4) == "sdpa"
    assert probe.runs == 2


def test_remeasure_measures_and_overwrites(monkeypatch):
    cached_probe("p", {}, Probe("old"), identity=ZEN4)
    assert cached_probe("p", {}, Probe("new"), identity=ZEN4, remeasure=True) == "new"
    assert cached_probe("p", {}, Probe("other"), identity=ZEN4) == "new"
    monkeypatch.setenv("VLMSERVE_REMEASURE_PROBES", "1")  # what `vlmserve serve --remeasure-probes` sets
    assert cached_probe("p", {}, Probe("newest"), identity=ZEN4) == "newest"


def test_only_measurements_count_as_probe_time():
    ticks = iter([10.0, 10.25])
    before = timing_cache.measured_seconds()
    cached_probe("timed", {}, Probe(), identity=ZEN4, clock=lambda: next(ticks))
    cached_probe("timed", {}, Probe(), identity=ZEN4, clock=lambda: pytest.fail("a hit is not timed"))
    assert timing_cache.measured_seconds() - before == pytest.approx(0.25)


def test_the_identity_names_this_cpu_and_torch():
    import torch

    identity = timing_cache.machine_identity()
    assert identity["torch"] == torch.__version__
    assert identity["probe_version"] == str(timing_cache.PROBE_VERSION)
    assert {"cpu_model", "cpu_flags", "threads"} <= identity.keys()


def test_the_start_up_probes_go_through_the_cache(monkeypatch):
    """The matmul dtype probe (runtime/dtypes.py) is read back in a new process: here, with the per-process
    verdicts forgotten."""
    import torch

    from runtime import dtypes as config

    monkeypatch.setattr(config, "_FAST", {})
    monkeypatch.setattr(config, "probe_matmul", lambda dtype: True)
    assert config.cpu_matmul_is_fast(torch.bfloat16) is True
    monkeypatch.setattr(config, "_FAST", {})
    monkeypatch.setattr(config, "probe_matmul", lambda dtype: pytest.fail("measured again"))
    assert config.cpu_matmul_is_fast(torch.bfloat16) is True
