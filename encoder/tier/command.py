"""``vlmserve encoder``: its flags, and the encoder-tier flags of ``vlmserve serve``."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from preprocess.hashing import DEFAULT_HASH, HASH_ALGORITHMS


def add_parser(sub) -> None:
    p = sub.add_parser(
        "encoder",
        help="a pool of vision-encoder processes serving any number of `vlmserve serve --encoder-url` engines",
    )
    p.add_argument("--model", required=True, help="the checkpoint directory the engines serve")
    p.add_argument("--port", type=int, default=None, help="TCP port for engines (tcp://HOST:PORT)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
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
        default=None,
        help="Unix socket for engines on this host, which get embeddings as shared memory (default with "
        "--port: encoder-PORT.sock in $XDG_RUNTIME_DIR/vlmserve, else in TMPDIR/vlmserve-UID; that "
        "directory is made 0700, and refused if it exists with another owner or looser permissions)",
    )
    p.add_argument("--workers", type=int, default=1, help="encoder processes, each with its own vision tower")
    p.add_argument("--threads", type=int, default=0, help="torch threads per worker (default: torch's own)")
    p.add_argument(
        "--nice",
        type=int,
        default=0,
        help="lower the pool's CPU priority by this much (workers and preprocess processes inherit it), so "
        "language engines sharing the cores take them first",
    )
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--preprocess-workers", type=int, default=None, help="decode/resize processes (default: 2)"
    )
    p.add_argument("--embedding-cache-mb", type=int, default=256, help="the pool's own embedding cache")
    p.add_argument(
        "--redis-url", default=None, help="Redis for engines on other hosts (the L2 format, with a TTL)"
    )
    p.add_argument("--redis-key-prefix", default="vlmserve:", help="the engines' --redis-key-prefix")
    p.add_argument("--redis-ttl-s", type=int, default=600, help="how long a shipped embedding stays in Redis")
    p.add_argument(
        "--redis-timeout-s", type=float, default=0.1, help="bound on each Redis call (connect, write)"
    )
    p.add_argument("--max-batch-patches", type=int, default=16384)
    p.add_argument(
        "--hash-algorithm",
        default=DEFAULT_HASH,
        choices=HASH_ALGORITHMS,
        help="the engines' --hash-algorithm (keys hashed otherwise are refused); xxh3 only for trusted clients",
    )
    p.add_argument(
        "--batch-timeout-s",
        type=float,
        default=120.0,
        help="a worker that has not finished a batch by then is killed and replaced; the batch's images fail "
        "(a batch whose worker dies fails too: it is never run again on another worker)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=64,
        help="engine connections served at once; one more is told so and closed",
    )
    p.add_argument(
        "--send-timeout-s",
        type=float,
        default=10.0,
        help="an engine that takes no frame for this long is dropped (it never holds up the others)",
    )
    p.add_argument(
        "--exit-with-parent", action="store_true", help="stop when the process that started it ends"
    )
    p.set_defaults(func=cmd_encoder)


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
    from runtime.memory import return_freed_buffers

    logging.getLogger().setLevel(logging.INFO)
    return_freed_buffers()
    if args.nice:
        os.nice(args.nice)  # NOTE: before serve_forever starts the workers, which inherit it
    serve_forever(
        TierSettings(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            workers=args.workers,
            threads=args.threads,
            host=args.host,
            port=args.port,
            socket_path=socket_path,
            preprocess_workers=2 if args.preprocess_workers is None else args.preprocess_workers,
            cache_bytes=args.embedding_cache_mb << 20,
            redis_url=args.redis_url,
            redis_key_prefix=args.redis_key_prefix,
            redis_ttl_s=args.redis_ttl_s,
            redis_timeout_s=args.redis_timeout_s,
            max_batch_patches=args.max_batch_patches,
            hash_algorithm=args.hash_algorithm,
            batch_timeout_s=args.batch_timeout_s,
            max_connections=args.max_connections,
            send_timeout_s=args.send_timeout_s,
            auth_token=token,
        ),
        exit_with_parent=args.exit_with_parent,
    )
    return 0


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("encoder tier")
    g.add_argument(
        "--encoder-url",
        default=None,
        help="send embedding-cache misses to this `vlmserve encoder` pool (tcp://HOST:PORT or unix:///PATH) "
        "instead of encoding in this process",
    )
    g.add_argument(
        "--encoder-workers",
        type=int,
        default=0,
        help="start a local encoder pool of N processes with the server",
    )
    g.add_argument(
        "--encoder-threads",
        type=int,
        default=0,
        help="torch threads per worker of the --encoder-workers pool (default: torch's own)",
    )
    g.add_argument(
        "--encoder-nice",
        type=int,
        default=10,
        help="CPU priority the --encoder-workers pool gives up (0-19): the decode loop sharing the cores "
        "preempts image encoding, so streams keep their pace while large images encode",
    )
    g.add_argument(
        "--encoder-timeout",
        type=float,
        default=30.0,
        help="seconds an image may wait for the pool (then fallback)",
    )
    g.add_argument(
        "--encoder-auth-token-file",
        default=None,
        help="the secret of a pool started with --auth-token-file (this server proves it holds it, and talks "
        "only to a pool that proves the same)",
    )
    g.add_argument(
        "--encoder-fallback",
        default="local",
        choices=["local", "fail"],
        help="when the pool is unreachable or too slow: encode in this process, or answer 503 with Retry-After",
    )


def serve_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        encoder_url=args.encoder_url,
        encoder_workers=args.encoder_workers,
        encoder_threads=args.encoder_threads,
        encoder_nice=args.encoder_nice,
        encoder_timeout_s=args.encoder_timeout,
        encoder_fallback=args.encoder_fallback,
        encoder_auth_token_file=args.encoder_auth_token_file,
    )
