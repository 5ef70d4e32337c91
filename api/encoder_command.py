"""``vlmserve encoder``: its flags, and the encoder-tier flags of ``vlmserve serve``."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
from collections.abc import Callable

from api import flags


def add_parser(sub) -> None:
    from encoder.tier.server import TierSettings

    d = functools.partial(flags.default, TierSettings)
    p = sub.add_parser(
        "encoder",
        help="a pool of vision-encoder processes serving any number of `vlmserve serve --encoder-url` engines",
    )
    p.add_argument("--model", required=True, help="the checkpoint directory the engines serve")
    _add_listen_args(p, d)
    p.add_argument(
        "--workers", type=int, default=d("workers"), help="encoder processes, each with its own vision tower"
    )
    p.add_argument(
        "--threads", type=int, default=d("threads"), help="torch threads per worker (default: torch's own)"
    )
    p.add_argument(
        "--nice",
        type=int,
        default=0,
        help="lower the pool's CPU priority by this much (workers and preprocess processes inherit it), so "
        "language engines sharing the cores take them first",
    )
    flags.add_compute(p, TierSettings)
    p.add_argument(
        "--preprocess-workers",
        type=int,
        default=d("preprocess_workers"),
        help="decode/resize processes (default: %(default)s)",
    )
    flags.add_embedding_cache(
        p,
        TierSettings,
        "cache_bytes",
        "Redis for engines on other hosts (the L2 format, with a TTL)",
        "the engines' --hash-algorithm (keys hashed otherwise are refused); xxh3 only for trusted clients",
    )
    p.add_argument(
        "--redis-ttl-s",
        type=int,
        default=d("redis_ttl_s"),
        help="how long a shipped embedding stays in Redis",
    )
    p.add_argument(
        "--redis-timeout-s",
        type=float,
        default=d("redis_timeout_s"),
        help="bound on each Redis call (connect, write)",
    )
    _add_batch_limits(p, d)
    p.add_argument(
        "--exit-with-parent", action="store_true", help="stop when the process that started it ends"
    )
    p.set_defaults(func=cmd_encoder)


def _add_listen_args(p: argparse.ArgumentParser, d: Callable[[str], object]) -> None:
    """Where engines reach the pool, and the secret they must hold (``d``: a TierSettings default by name)."""
    p.add_argument("--port", type=int, default=d("port"), help="TCP port for engines (tcp://HOST:PORT)")
    p.add_argument(
        "--host",
        default=d("host"),
        help="address to bind (default: this machine only; any other needs --auth-token-file)",
    )
    p.add_argument(
        "--auth-token-file",
        default=None,
        help="a file holding the secret engines must prove they hold (their --encoder-auth-token-file); "
        "never sent, checked in the handshake; refused if every user may read it",
    )
    p.add_argument(
        "--socket",
        default=d("socket_path"),
        help="Unix socket for engines on this host, which get embeddings as shared memory (default with "
        "--port: encoder-PORT.sock in $XDG_RUNTIME_DIR/vlmserve, else in TMPDIR/vlmserve-UID; that "
        "directory is made 0700, and refused if it exists with another owner or looser permissions)",
    )


def _add_batch_limits(p: argparse.ArgumentParser, d: Callable[[str], object]) -> None:
    """The bounds on a batch, a worker and an engine's connection."""
    p.add_argument("--max-batch-patches", type=int, default=d("max_batch_patches"))
    p.add_argument(
        "--batch-timeout-s",
        type=float,
        default=d("batch_timeout_s"),
        help="a worker that has not finished a batch by then is killed and replaced; the batch's images fail "
        "(a batch whose worker dies fails too: it is never run again on another worker)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=d("max_connections"),
        help="engine connections served at once; one more is told so and closed",
    )
    p.add_argument(
        "--send-timeout-s",
        type=float,
        default=d("send_timeout_s"),
        help="an engine that takes no frame for this long is dropped (it never holds up the others)",
    )


def cmd_encoder(args: argparse.Namespace) -> int:
    from encoder.tier import auth
    from encoder.tier.server import TierSettings, serve_forever

    if args.port is None and args.socket is None:
        print("vlmserve encoder: give --port, --socket or both", file=sys.stderr)
        return 2
    try:  # NOTE: before any model loads, so a misconfigured pool fails at once
        token = auth.read_token(args.auth_token_file) if args.auth_token_file else None
        if args.port is not None:
            auth.check_exposure(args.host, token)
    except auth.TokenFileError as exc:
        print(f"vlmserve encoder: {exc}", file=sys.stderr)
        return 2
    socket_path = args.socket
    if socket_path is None:
        try:
            socket_path = auth.default_socket_path(args.port)
        except PermissionError as exc:
            print(f"vlmserve encoder: {exc}", file=sys.stderr)
            return 2
    from runtime.memory import huge_page_tensors, return_freed_buffers

    logging.getLogger().setLevel(logging.INFO)
    return_freed_buffers()
    huge_page_tensors()  # NOTE: before serve_forever starts the workers, which inherit it
    if args.nice:
        os.nice(args.nice)  # NOTE: before serve_forever starts the workers, which inherit it
    serve_forever(
        flags.settings_from(
            TierSettings,
            args,
            socket_path=socket_path,
            cache_bytes=args.embedding_cache_mb << 20,
            auth_token=token,
        ),
        exit_with_parent=args.exit_with_parent,
    )
    return 0


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from lm_engine.config import EngineConfig

    e = functools.partial(flags.default, EngineConfig)
    g = p.add_argument_group("encoder tier")
    g.add_argument(
        "--encoder-url",
        default=e("encoder_url"),
        help="send embedding-cache misses to this `vlmserve encoder` pool (tcp://HOST:PORT or unix:///PATH) "
        "instead of encoding in this process",
    )
    g.add_argument(
        "--encoder-workers",
        type=int,
        default=e("encoder_workers"),
        help="start a local encoder pool of N processes with the server",
    )
    g.add_argument(
        "--encoder-threads",
        type=int,
        default=e("encoder_threads"),
        help="torch threads per worker of the --encoder-workers pool (default: torch's own)",
    )
    g.add_argument(
        "--encoder-nice",
        type=int,
        default=e("encoder_nice"),
        help="CPU priority the --encoder-workers pool gives up (0-19): the decode loop sharing the cores "
        "preempts image encoding, so streams keep their pace while large images encode",
    )
    g.add_argument(
        "--encoder-timeout",
        type=float,
        default=e("encoder_timeout_s"),
        help="seconds an image may wait for the pool (then fallback)",
    )
    g.add_argument(
        "--encoder-auth-token-file",
        default=e("encoder_auth_token_file"),
        help="the secret of a pool started with --auth-token-file (this server proves it holds it, and talks "
        "only to a pool that proves the same)",
    )
    g.add_argument(
        "--encoder-fallback",
        default=e("encoder_fallback"),
        choices=["local", "fail"],
        help="when the pool is unreachable or too slow: encode in this process, or answer 503 with Retry-After",
    )
