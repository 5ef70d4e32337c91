"""The `vlmserve cluster` subcommand: its flags, and the checks made before anything starts."""

from __future__ import annotations

import argparse
import functools
import logging
from pathlib import Path

from api import flags
from api.cluster.haproxy import ROUTINGS, BalancerConfig, HAProxyMissing
from api.cluster.launcher import ClusterError, ClusterSpec, run_cluster, write_balancer_config

log = logging.getLogger("vlmserve.cluster")

# Flags the cluster sets on each replica itself.
_OWNED = ("--model", "--host", "--port", "--replica-name", "--redis-url", "--served-model-name")


def add_parser(sub: argparse._SubParsersAction) -> None:
    d = functools.partial(flags.default, ClusterSpec)
    p = sub.add_parser(
        "cluster",
        help="N serve replicas behind HAProxy, routed by image (see README: Several replicas)",
        description="Starts N `vlmserve serve` replicas on loopback ports and HAProxy in front of them on "
        "--port. Requests carrying the same image go to the same replica (its prefix cache hits); text "
        "goes to the least-loaded one; an x-session-id header, else the request's `user`, keeps a chat on "
        "one replica. Flags after `--` go to every replica's `vlmserve serve`.",
    )
    p.add_argument(
        "--replicas", type=int, default=2, help="serve replicas started here (default: %(default)s)"
    )
    p.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--host", default=d("host"), help="the balancer's address (default: this machine only)")
    p.add_argument("--port", type=int, default=d("port"), help="the balancer's port")
    p.add_argument(
        "--replica-base-port",
        type=int,
        default=d("replica_base_port"),
        help="replica ports (default: --port + 1..N)",
    )
    p.add_argument(
        "--redis-url",
        default=d("redis_url"),
        help="the embedding cache every replica shares ('' for none; default: the local Redis)",
    )
    p.add_argument(
        "--encoder-workers",
        type=int,
        default=d("encoder_workers"),
        help="start one shared encoder pool (`vlmserve encoder`) of M processes for every replica "
        "(default 0: each replica encodes its own images)",
    )
    p.add_argument(
        "--run-dir",
        type=Path,
        default=d("run_dir"),
        help="config, logs and cluster.json (default: a temp dir)",
    )
    p.add_argument("--no-restart", dest="restart", action="store_false", help="leave dead replicas dead")
    _add_balancer_args(p.add_argument_group("balancer"))
    p.add_argument("serve_args", nargs="*", help="after `--`: flags for every replica's `vlmserve serve`")
    p.set_defaults(func=cmd_cluster)


def _add_balancer_args(g: argparse._ArgumentGroup) -> None:
    b = functools.partial(flags.default, BalancerConfig)
    g.add_argument(
        "--replica-addr",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a replica running elsewhere (repeat); with it no replica starts here, only the balancer",
    )
    g.add_argument(
        "--balance-factor",
        type=int,
        default=b("balance_factor"),
        help="bounded load: a replica above this %% of the mean in-flight load takes no new image/session",
    )
    g.add_argument(
        "--balance-min-load",
        type=int,
        default=b("balance_min_load"),
        help="...unless it holds fewer than this many requests in flight (below it, keys never spill)",
    )
    g.add_argument("--image-key-chars", type=int, default=b("key_chars"), help="image URL characters hashed")
    g.add_argument("--bufsize", type=int, default=b("bufsize"), help="bytes of a request the balancer sees")
    g.add_argument(
        "--routing",
        choices=ROUTINGS,
        default=b("routing"),
        help="image: the rules above (default); round-robin: each request to the next replica (a baseline)",
    )
    g.add_argument(
        "--drain-timeout",
        type=int,
        default=b("drain_timeout_s"),
        help="seconds in-flight requests get on shutdown",
    )
    g.add_argument(
        "--write-config",
        type=Path,
        default=None,
        metavar="DIR",
        help="write haproxy.cfg and route.lua into DIR and exit (a balancer on another host)",
    )


def _check_serve_args(serve_args: list[str]) -> None:
    """Refuse typos and flags the cluster owns before any process starts."""
    from api.cli import _add_engine_args, _add_server_args

    owned = [a for a in serve_args if a.split("=", 1)[0] in _OWNED]
    if owned:
        raise SystemExit(f"vlmserve cluster: {', '.join(owned)} is set by the cluster; give it before `--`")
    serve = argparse.ArgumentParser(prog="vlmserve cluster ... -- (vlmserve serve flags)")
    _add_engine_args(serve)
    _add_server_args(serve)
    serve.parse_args(serve_args)  # exits with argparse's message on a bad flag


def cmd_cluster(args: argparse.Namespace) -> int:
    from api.cli import _default_model

    balancer = BalancerConfig(
        bind="",
        replicas=[],
        admin_socket="",
        key_chars=args.image_key_chars,
        bufsize=args.bufsize,
        balance_factor=args.balance_factor,
        balance_min_load=args.balance_min_load,
        drain_timeout_s=args.drain_timeout,
        routing=args.routing,
    )
    if args.write_config is not None:
        if not args.replica_addr:
            raise SystemExit("vlmserve cluster --write-config needs the replicas' --replica-addr HOST:PORT")
        balancer.bind = f"{args.host}:{args.port}"
        balancer.replicas = [(f"r{i}", a) for i, a in enumerate(args.replica_addr)]
        balancer.admin_socket = str((args.write_config / "haproxy.sock").resolve())
        print(f"wrote {write_balancer_config(args.write_config, balancer)}")
        return 0
    _check_serve_args(args.serve_args)
    model, names = (None, []) if args.replica_addr else _default_model(args)
    spec = ClusterSpec(
        replicas=args.replicas,
        model=str(model),
        served_model_names=names,
        host=args.host,
        port=args.port,
        replica_base_port=args.replica_base_port,
        redis_url=args.redis_url or None,
        encoder_workers=args.encoder_workers,
        serve_args=args.serve_args,
        remote=args.replica_addr,
        run_dir=args.run_dir,
        restart=args.restart,
        balancer=balancer,
    )
    try:
        return run_cluster(spec)
    except (HAProxyMissing, ClusterError) as exc:
        log.error("%s", exc)
        return 1
