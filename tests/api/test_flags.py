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


def test_the_encoder_command_builds_its_settings_from_every_flag(monkeypatch):
    """``vlmserve encoder``'s flags reach TierSettings under their own names (a flag renamed on one side only
    would be silently dropped): a non-default value for each arrives."""
    import logging

    import api.encoder_command as command
    import encoder.tier.server as server
    import runtime.memory

    got = {}
    monkeypatch.setattr(server, "serve_forever", lambda settings, exit_with_parent: got.update(s=settings))
    monkeypatch.setattr(runtime.memory, "return_freed_buffers", lambda: None)  # leave this process's malloc
    monkeypatch.setattr(logging.getLogger(), "level", logging.getLogger().level)  # and its log level
    argv = [
        "encoder",
        "--model",
        "m",
        "--port",
        "5",
        "--socket",
        "/tmp/x.sock",
        "--workers",
        "3",
        "--threads",
        "2",
    ]
    argv += [
        "--dtype",
        "float32",
        "--preprocess-workers",
        "5",
        "--embedding-cache-mb",
        "7",
        "--redis-ttl-s",
        "9",
    ]
    argv += ["--redis-timeout-s", "0.5", "--max-batch-patches", "99", "--batch-timeout-s", "11"]
    argv += ["--max-connections", "13", "--send-timeout-s", "17", "--redis-key-prefix", "p:"]
    args = build_parser().parse_args(argv)
    assert command.cmd_encoder(args) == 0
    s = got["s"]
    assert (s.model, s.port, s.socket_path, s.workers, s.threads, s.dtype) == (
        "m",
        5,
        "/tmp/x.sock",
        3,
        2,
        "float32",
    )
    assert (s.preprocess_workers, s.cache_bytes, s.redis_ttl_s, s.redis_timeout_s) == (5, 7 << 20, 9, 0.5)
    assert (s.max_batch_patches, s.batch_timeout_s, s.max_connections, s.send_timeout_s) == (99, 11, 13, 17)
    assert s.redis_key_prefix == "p:" and s.auth_token is None
