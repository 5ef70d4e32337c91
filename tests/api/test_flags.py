"""One source per default: every flag of ``serve``, ``encoder`` and ``cluster`` that sets a field of a settings
class defaults to that field's own default (a default changed in the class changes the flag with it)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from api.cli import build_parser
from api.cluster.haproxy import BalancerConfig
from api.cluster.launcher import ClusterSpec
from api.config import ConnectionLimits, ServerArgs
from api.media import MediaConfig
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


# -- serve: every flag is a settings field's ------------------------------------------------------------------
SERVE_CLASSES = (EngineConfig, ServerArgs, ConnectionLimits, MediaConfig)
# serve's flags whose field is named otherwise (found by name, the rest must name their field exactly)
SERVE_FIELDS = {
    "embedding_cache_mb": (EngineConfig, "embedding_cache_bytes"),
    "encoder_timeout": (EngineConfig, "encoder_timeout_s"),
    "api_key": (ServerArgs, "api_keys"),
    "api_key_file": (ServerArgs, "api_keys"),
    "served_model_name": (ServerArgs, "served_model_names"),
    "uvicorn_log_level": (ServerArgs, "log_level"),
    "header_timeout": (ConnectionLimits, "header_timeout_s"),
    "body_timeout": (ConnectionLimits, "body_timeout_s"),
    "max_media_bytes": (MediaConfig, "max_bytes"),
    "media_fetch_timeout": (MediaConfig, "read_timeout"),
    "allowed_media_domains": (MediaConfig, "allowed_domains"),
    "allow_private_media": (MediaConfig, "allow_private"),
    "allowed_local_media_path": (MediaConfig, "allowed_local_path"),
}
# serve's flags that set no settings field, and what they set instead
SERVE_NOT_SETTINGS = {"remeasure_probes": "the environment the server and its workers read"}
# defaults decided when the server starts: the keys from $VLMSERVE_API_KEY, the names from the model
SERVE_RUNTIME_DEFAULTS = {"api_key", "api_key_file", "served_model_name"}
# a flag's value as its field holds it
SERVE_CONVERTED = {
    "embedding_cache_mb": lambda mb: mb << 20,
    "allowed_media_domains": frozenset,
    "trusted_proxies": lambda text: [a for a in text.split(",") if a],
}


def _serve_flags() -> list[argparse.Action]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [a for a in sub.choices["serve"]._actions if a.dest != "help"]


def _serve_field(dest: str) -> tuple[type, dataclasses.Field]:
    cls, name = SERVE_FIELDS.get(dest) or (None, dest)
    found = [
        (c, f) for c in ([cls] if cls else SERVE_CLASSES) for f in dataclasses.fields(c) if f.name == name
    ]
    assert len(found) == 1, f"serve --{dest.replace('_', '-')}: fields named {name!r}: {found}"
    return found[0]


def _field_default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def test_every_serve_flag_sets_one_settings_field():
    flags = [a.dest for a in _serve_flags()]
    assert len(flags) >= 40
    for dest in flags:
        if dest not in SERVE_NOT_SETTINGS:
            _serve_field(dest)


def _serve_flags_with_class_defaults() -> list[tuple[argparse.Action, type, dataclasses.Field]]:
    """serve's flags whose default is their settings field's (not the command line's own, not decided at start)."""
    out = []
    for action in _serve_flags():
        dest = action.dest
        if dest in SERVE_NOT_SETTINGS or dest in SERVE_RUNTIME_DEFAULTS or ("serve", dest) in OWN:
            continue
        cls, f = _serve_field(dest)
        if (
            f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        ):  # not the model
            out.append((action, cls, f))
    return out


def test_serve_flags_default_to_their_settings_fields():
    checked = 0
    for action, cls, f in _serve_flags_with_class_defaults():
        dest = action.dest
        value = SERVE_CONVERTED.get(dest, lambda v: v)(action.default)
        assert value == _field_default(f), (
            f"serve --{dest.replace('_', '-')}: {value!r}, {cls.__name__}.{f.name}"
        )
        checked += 1
    assert checked >= 35


def _moved(value):
    """Another value of the default's kind (a marker where it has none)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + (3 << 20)
    if isinstance(value, float):
        return value + 0.5
    if isinstance(value, str):
        return value + "-moved"
    return {dict: {"image": 9}, frozenset: frozenset({"moved.example"}), list: ["10.9.9.9"]}.get(
        type(value), object()
    )


def test_a_changed_settings_default_moves_every_serve_flag(monkeypatch):
    """Each serve default is read from its settings class when the parser is built, not restated."""
    moved = {}
    for action, _, f in _serve_flags_with_class_defaults():
        new = _moved(_field_default(f))
        if f.default is dataclasses.MISSING:
            monkeypatch.setattr(f, "default_factory", lambda new=new: new)
        else:
            monkeypatch.setattr(f, "default", new)
        moved[action.dest] = new
    assert len(moved) >= 35
    for action in _serve_flags():
        if action.dest in moved:
            value = SERVE_CONVERTED.get(action.dest, lambda v: v)(action.default)
            assert value == moved[action.dest], f"serve --{action.dest.replace('_', '-')} did not move"


def test_the_serve_command_builds_its_engine_config_from_every_flag(monkeypatch, tiny_ckpt: Path):
    """Every engine flag of ``vlmserve serve`` reaches EngineConfig (a flag renamed on one side only would be
    silently dropped): a value other than the flag's default for each arrives."""
    import api.server
    from api.cli import main

    got = {}
    monkeypatch.setattr(api.server, "run_server", lambda server_args, startup: got.update(s=server_args))
    given = {  # flag: (EngineConfig's field, its value)
        "--dtype": ("dtype", "float32"),
        "--device": ("device", "cuda:1"),
        "--block-size": ("block_size", 32),
        "--max-num-batched-tokens": ("max_num_batched_tokens", 1000),
        "--max-num-seqs": ("max_num_seqs", 7),
        "--max-model-len": ("max_model_len", 999),
        "--num-kv-blocks": ("num_kv_blocks", 77),
        "--attention-backend": ("attention_backend", "torch"),
        "--kv-cache-memory": ("kv_cache_memory", 1 << 30),
        "--memory-utilization": ("memory_utilization", 0.5),
        "--preprocess-workers": ("preprocess_workers", 3),
        "--embedding-cache-mb": ("embedding_cache_bytes", 5 << 20),
        "--redis-url": ("redis_url", "redis://127.0.0.1:1/0"),
        "--redis-key-prefix": ("redis_key_prefix", "q:"),
        "--hash-algorithm": ("hash_algorithm", "sha256"),
        "--visual-budget": ("visual_budget", "fixed"),
        "--visual-level": ("visual_level", 1),
        "--ttft-slo-ms": ("ttft_slo_ms", 123.0),
        "--tpot-slo-ms": ("tpot_slo_ms", 45.0),
        "--max-queued-requests": ("max_queued_requests", 8),
        "--max-queued-tokens": ("max_queued_tokens", 9000),
        "--encoder-url": ("encoder_url", "tcp://127.0.0.1:9"),
        "--encoder-workers": ("encoder_workers", 2),
        "--encoder-threads": ("encoder_threads", 3),
        "--encoder-nice": ("encoder_nice", 4),
        "--encoder-timeout": ("encoder_timeout_s", 5.5),
        "--encoder-auth-token-file": ("encoder_auth_token_file", "/nonexistent/token"),
        "--encoder-fallback": ("encoder_fallback", "fail"),
        "--no-enable-prefix-caching": ("enable_prefix_caching", False),
        "--slo-admission": ("slo_admission", True),
        "--video-fps": ("video_fps", 1.5),
        "--video-max-frames": ("video_max_frames", 12),
        "--video-max-duration": ("video_max_duration_s", 30.0),
        "--video-max-frame-pixels": ("video_max_frame_pixels", 100000),
        "--video-max-tokens": ("video_max_tokens", 999),
    }
    typed = {"--kv-cache-memory": "1GiB", "--embedding-cache-mb": "5"}  # as typed, where not str(value)
    argv = ["serve", "--model", str(tiny_ckpt)]
    for flag, (_, value) in given.items():
        argv += [flag] if isinstance(value, bool) else [flag, typed.get(flag, str(value))]
    assert main(argv) == 0
    engine = got["s"].engine
    engine_flags = [a.dest for a in _serve_flags() if a.dest not in SERVE_NOT_SETTINGS]
    engine_flags = [d for d in engine_flags if _serve_field(d)[0] is EngineConfig and d != "model"]
    defaults = vars(build_parser().parse_args(["serve"]))
    defaults = {
        _serve_field(d)[1].name: SERVE_CONVERTED.get(d, lambda v: v)(defaults[d]) for d in engine_flags
    }
    assert sorted(defaults) == sorted(field for field, _ in given.values())  # every engine flag is given
    for field, value in given.values():
        assert getattr(engine, field) == value != defaults[field], field
    assert engine.model == str(tiny_ckpt)
