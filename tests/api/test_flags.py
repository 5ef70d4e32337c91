"""One source per default: every flag of ``serve``, ``encoder`` and ``cluster`` that sets a field of a settings
class defaults to that field's own default (a default changed in the class changes the flag with it)."""

from __future__ import annotations

import dataclasses

import pytest

from api.cli import build_parser
from api.cluster.haproxy import BalancerConfig
from api.cluster.launcher import ClusterSpec
from encoder.tier.server import TierSettings
from lm_engine.config import EngineConfig

# flag dest → settings field, where the names differ
RENAMED = {
    "encoder_timeout": "encoder_timeout_s",
    "socket": "socket_path",
    "image_key_chars": "key_chars",
    "drain_timeout": "drain_timeout_s",
}
# where the command line picks its own on purpose
OWN = {
    # a server takes min(4, cores) worker processes; EngineConfig's 0 (threads in-process) suits an offline LLM
    ("serve", "preprocess_workers"),
    # a server lowers visual budgets under load; an offline engine (EngineConfig's "fixed") has no latency target
    ("serve", "visual_budget"),
}
# the flags whose value is converted on the way (MiB → bytes), checked against the field's value converted back
MIB = {"embedding_cache_mb": {"serve": "embedding_cache_bytes", "encoder": "cache_bytes"}}


def _parse(argv: list[str]):
    return vars(build_parser().parse_args(argv))


@pytest.mark.parametrize(
    ("argv", "classes"),
    [
        (["serve"], [EngineConfig]),
        (["encoder", "--model", "m", "--port", "1"], [TierSettings]),
        (["cluster"], [ClusterSpec, BalancerConfig]),
    ],
)
def test_flags_default_to_their_settings_fields(argv, classes):
    args = _parse(argv)
    explicit = {"--model": "model", "--port": "port"}
    given = {explicit[a] for a in argv if a in explicit}
    checked = 0
    for cls in classes:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for dest, value in args.items():
            name = RENAMED.get(dest, dest)
            if dest in given or name not in fields or (argv[0], dest) in OWN:
                continue
            f = fields[name]
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                continue  # a field without a default (the model, the replica count)
            want = f.default_factory() if f.default is dataclasses.MISSING else f.default
            assert value == want, (
                f"{argv[0]} --{dest.replace('_', '-')}: {value!r}, {cls.__name__}.{name}: {want!r}"
            )
            checked += 1
    for dest, fields_by_command in MIB.items():
        if dest in args and argv[0] in fields_by_command:
            field = next(
                f for c in classes for f in dataclasses.fields(c) if f.name == fields_by_command[argv[0]]
            )
            assert args[dest] << 20 == field.default
            checked += 1
    assert checked >= 5  # the test reads real flags, not an empty intersection


def test_a_changed_settings_default_moves_its_flag(monkeypatch):
    field = next(f for f in dataclasses.fields(TierSettings) if f.name == "batch_timeout_s")
    monkeypatch.setattr(field, "default", 33.0)
    assert _parse(["encoder", "--model", "m", "--port", "1"])["batch_timeout_s"] == 33.0
