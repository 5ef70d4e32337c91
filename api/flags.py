"""What the commands' flags share: defaults read from the settings classes (one source for each default), and
the flags that ``serve``, ``encoder`` and ``cluster`` each take in the same sense."""

from __future__ import annotations

import argparse
import dataclasses

HASH_HELP = (
    "identity hash of image bytes, embedding-cache keys and prefix-cache blocks (default: %(default)s, the fastest "
    "cryptographic one measured). Servers sharing Redis or an encoder pool must agree; keys of another algorithm "
    "are never read as their own. xxh3 is faster but NOT collision resistant: a client can craft an image that "
    "collides with another's and be answered from its cached embeddings and KV (or make others be answered from "
    "its own); use it only where every client is trusted"
)


def default(cls, name: str):
    """A settings dataclass's own default for field ``name``: what the flag for it defaults to."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def fields_from(cls, args: argparse.Namespace, **given) -> dict:
    """The parsed flags named as fields of ``cls``, and ``given`` (what a flag does not say as is)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {**{k: v for k, v in vars(args).items() if k in names}, **given}


def settings_from(cls, args: argparse.Namespace, **given):
    """``cls`` built from the parsed flags named as its fields, and ``given`` (what a flag does not say as is)."""
    return cls(**fields_from(cls, args, **given))


def add_compute(p: argparse.ArgumentParser | argparse._ArgumentGroup, cls) -> None:
    """--dtype and --device, as ``cls`` (EngineConfig, TierSettings) defaults them."""
    p.add_argument(
        "--dtype",
        default=default(cls, "dtype"),
        help="auto (the checkpoint's own), float32, bfloat16, float16",
    )
    p.add_argument("--device", default=default(cls, "device"))


def add_embedding_cache(
    g: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls,
    cache_field: str,
    redis_help: str,
    hash_help: str,
) -> None:
    """The embedding cache's flags (in-process size, Redis, key prefix, hash algorithm), as ``cls`` defaults
    them (``cache_field``: its byte-size field)."""
    from preprocess.hashing import HASH_ALGORITHMS  # here: importing api.cli stays light (worker processes)

    g.add_argument(
        "--embedding-cache-mb",
        type=int,
        default=default(cls, cache_field) >> 20,
        help="in-process embedding cache (L1) size",
    )
    g.add_argument("--redis-url", default=default(cls, "redis_url"), help=redis_help)
    g.add_argument(
        "--redis-key-prefix",
        default=default(cls, "redis_key_prefix"),
        help="prefix of the keys in Redis (the engines' and the encoder pool's must agree)",
    )
    g.add_argument(
        "--hash-algorithm", default=default(cls, "hash_algorithm"), choices=HASH_ALGORITHMS, help=hash_help
    )
