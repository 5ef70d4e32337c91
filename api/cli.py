"""The ``vlmserve`` command: serve, batch, demo, make-model, train-demo."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import time
from typing import TYPE_CHECKING

from api import flags

if TYPE_CHECKING:
    from collections.abc import Callable

    from api.media import MediaConfig

# NOTE: nothing heavy at module level (each function imports what it needs): worker processes that
# multiprocessing starts re-import the main module (`python -m api.cli`, or the `vlmserve` script that imports
# it), and torch et al. here cost every preprocess and encoder worker seconds of start-up.

# make-model's presets, named here so the parser needs no torch (a test checks them against the generators'):
# test shapes, then the published checkpoints' shapes, each of which implies its family.
MAKE_MODEL_PRESETS = ("tiny", "wide", "small", "demo")
PUBLISHED_PRESETS = (
    "qwen2-vl-2b",
    "qwen2.5-vl-3b",
    "qwen2.5-vl-7b",
    "qwen3-vl-2b",
    "qwen3-vl-4b",
    "qwen3-vl-8b",
)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    from lm_engine.config import EngineConfig

    e = functools.partial(flags.default, EngineConfig)
    p.add_argument(
        "--model", default=None, help="local Hugging Face checkpoint directory (default: the demo model)"
    )
    flags.add_compute(p, EngineConfig)
    p.add_argument("--block-size", type=int, default=e("block_size"))
    p.add_argument("--max-num-batched-tokens", type=int, default=e("max_num_batched_tokens"))
    p.add_argument("--max-num-seqs", type=int, default=e("max_num_seqs"))
    p.add_argument("--max-model-len", type=int, default=e("max_model_len"))
    p.add_argument(
        "--no-enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        default=e("enable_prefix_caching"),
    )
    p.add_argument(
        "--num-kv-blocks", type=int, default=e("num_kv_blocks"), help="fixed KV pool size (default: measured)"
    )
    p.add_argument(
        "--attention-backend", default=e("attention_backend"), choices=["auto", "torch", "cpu", "triton"]
    )
    m = p.add_argument_group("memory and start-up")
    m.add_argument(
        "--kv-cache-memory",
        "--kv-cache-memory-bytes",  # vLLM's name
        type=_size,
        default=e("kv_cache_memory"),
        metavar="SIZE",
        help="KV pool size, e.g. 4GiB, 512MiB or bytes (default: from --memory-utilization)",
    )
    m.add_argument(
        "--memory-utilization",
        "--gpu-memory-utilization",  # vLLM's name
        type=float,
        default=e("memory_utilization"),
        help="share of the memory available at start (CPU: before the weights load) that weights, activations, "
        "the server's own needs and the KV pool may take together (default: %(default)s)",
    )
    m.add_argument(
        "--remeasure-probes",
        action="store_true",
        help="time the start-up probes again instead of reading their cached results (~/.cache/vlmserve/"
        "probes.json, or $VLMSERVE_CACHE_DIR); same as VLMSERVE_REMEASURE_PROBES=1",
    )
    g = p.add_argument_group("vision path")
    g.add_argument(
        "--preprocess-workers",
        type=int,
        default=None,
        help="image decode/resize processes (default: min(4, cores); 0 = threads in the server process)",
    )
    v = p.add_argument_group("video")
    v.add_argument(
        "--video-fps",
        type=float,
        default=e("video_fps"),
        help="frames sampled per second of video unless a request asks (default: the checkpoint's, else 2)",
    )
    v.add_argument(
        "--video-max-frames", type=int, default=e("video_max_frames"), help="frames sampled per video at most"
    )
    v.add_argument(
        "--video-max-duration",
        dest="video_max_duration_s",
        type=float,
        default=e("video_max_duration_s"),
        help="seconds per video at most",
    )
    v.add_argument(
        "--video-max-frame-pixels",
        type=int,
        default=e("video_max_frame_pixels"),
        help="pixels per source frame at most (default: 4K UHD)",
    )
    v.add_argument(
        "--video-max-tokens",
        type=int,
        default=e("video_max_tokens"),
        help="visual tokens per video at most, after sampling and resizing",
    )
    flags.add_embedding_cache(
        g,
        EngineConfig,
        "embedding_cache_bytes",
        "Redis for the shared embedding cache (L2), e.g. redis://127.0.0.1:6379/0",
        flags.HASH_HELP,
    )


def _size(text: str) -> int:
    from runtime.memory import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _process_settings(args: argparse.Namespace) -> None:
    """What the engine flags ask of the whole process, its worker processes included (they read the environment)."""
    from runtime.timing_cache import REMEASURE_VARIABLE

    if args.remeasure_probes:
        os.environ[REMEASURE_VARIABLE] = "1"


def _engine_kwargs(args: argparse.Namespace, **given) -> dict:
    """EngineConfig's fields from the engine flags (serve, batch, demo): every flag named as its field
    (``flags.fields_from``), the two the command line says otherwise, and ``given``. The model is the caller's
    (serve and batch resolve the demo's)."""
    from lm_engine.config import EngineConfig

    kwargs = flags.fields_from(
        EngineConfig,
        args,
        preprocess_workers=(
            min(4, os.cpu_count() or 1) if args.preprocess_workers is None else args.preprocess_workers
        ),
        embedding_cache_bytes=args.embedding_cache_mb << 20,
        **given,
    )
    return {k: v for k, v in kwargs.items() if k != "model"}


def cmd_make_model(args: argparse.Namespace) -> int:
    from tools import qwen2_vl_make, qwen3_vl_make

    t0 = time.perf_counter()
    # A published shape stands for one family: it picks --family, and a contradicting one is refused.
    shape = qwen2_vl_make.PRESETS.get(args.preset) or qwen3_vl_make.PRESETS[args.preset].text
    family = args.family or shape.family or "qwen2_vl"
    if shape.family is not None and family != shape.family:
        raise SystemExit(
            f"vlmserve make-model: the {args.preset} preset exists for --family {shape.family} only "
            "(it implies it: leave --family out)"
        )
    if family == "qwen3_vl":
        path = qwen3_vl_make.make_checkpoint(args.out, preset=args.preset, seed=args.seed)
    else:
        path = qwen2_vl_make.make_checkpoint(args.out, preset=args.preset, seed=args.seed, family=family)
    print(f"wrote {family} {args.preset} checkpoint to {path} in {time.perf_counter() - t0:.1f}s")
    return 0


def _add_train_demo_parser(sub: argparse._SubParsersAction) -> None:
    from tools.demo_train import TrainConfig

    t = functools.partial(flags.default, TrainConfig)
    p = sub.add_parser(
        "train-demo",
        help="train the demo checkpoint on the synthetic task set (default run: up to 45 min on 2 CPU cores)",
        description="Trains the demo Qwen2-VL checkpoint (the 'demo' preset, about 12M parameters) to answer "
        "the synthetic task set's five questions (colour, shape, count, written number, description) and "
        "writes a normal checkpoint directory that transformers and vlmserve load. Deterministic for a seed: "
        "a fixed number of optimizer steps over images drawn from it. The default run takes up to 45 minutes "
        "on 2 CPU cores; progress and held-out accuracy go to stderr. With --from DIR it runs the tool phase "
        "alone, from a trained checkpoint.",
    )
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    _add_tool_phase_args(p, t)
    _add_training_args(p, t)
    p.set_defaults(func=cmd_train_demo)


def _add_tool_phase_args(p: argparse.ArgumentParser, t: Callable[[str], object]) -> None:
    """train-demo's --from and the tool phase's settings (``t``: a TrainConfig default by name)."""
    p.add_argument(
        "--from",
        dest="base",
        metavar="DIR",
        help="start from this trained demo checkpoint and run the tool phase alone: the model learns to read "
        "the picture with tools in its prompt and to answer with a <tool_call> (the shipped checkpoint is "
        "a run of the first two phases, then this)",
    )
    p.add_argument(
        "--tool-steps",
        type=int,
        default=t("tool_steps"),
        help="with --from: steps of the tool phase (default: %(default)s)",
    )
    p.add_argument(
        "--tool-images",
        type=int,
        default=t("tool_images"),
        help="with --from: pictures of a step's --batch-images asked with tools (default: %(default)s)",
    )
    p.add_argument(
        "--tool-lr",
        type=float,
        default=t("tool_lr"),
        help="with --from: peak learning rate (default: %(default)s)",
    )
    p.add_argument(
        "--tool-weight",
        type=float,
        default=t("tool_weight"),
        help="with --from: the tools rows' loss against the plain rows' (default: %(default)s)",
    )
    p.add_argument(
        "--tool-value-weight",
        type=float,
        default=t("tool_value_weight"),
        help="with --from: a call's argument values against the rest of the reply in the tools rows' loss "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--tool-merge",
        type=float,
        default=t("tool_merge"),
        help="with --from: write base + this * (trained - base); 1 writes the trained weights (default: "
        "%(default)s)",
    )
    p.add_argument(
        "--tool-kinds",
        type=_kind_shares,
        default=t("tool_kinds"),
        metavar="KIND=SHARE,...",
        help="with --from: the picture kinds asked with tools, e.g. single=0.5,many=0.25,number=0.25 "
        "(default: %(default)s)",
    )


def _add_training_args(p: argparse.ArgumentParser, t: Callable[[str], object]) -> None:
    """train-demo's settings of the first two phases (the tower alone, then the whole model)."""
    p.add_argument(
        "--seed", type=int, default=t("seed"), help="initialisation and task-set seed (default: %(default)s)"
    )
    p.add_argument(
        "--tower-steps",
        type=int,
        default=t("tower_steps"),
        help="first phase: steps of the vision tower alone (default: %(default)s)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=t("steps"),
        help="second phase: steps of the whole model (default: %(default)s)",
    )
    p.add_argument(
        "--batch-images", type=int, default=t("batch_images"), help="images per step (default: %(default)s)"
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=t("eval_every"),
        help="steps between held-out accuracy checks, 0 for none (default: %(default)s)",
    )
    p.add_argument(
        "--frozen-tower-blocks",
        type=int,
        default=t("frozen_tower_blocks"),
        help="second phase: the patch embedding and this many of the lowest vision blocks keep the first "
        "phase's weights (default: %(default)s)",
    )
    p.add_argument(
        "--decoder-attention",
        choices=("sdpa", "math"),
        default=t("decoder_attention"),
        help="second phase: the decoder's attention through torch's SDPA or as matmuls with a float32 "
        "softmax (default: %(default)s)",
    )
    p.add_argument(
        "--tower-snapshot",
        metavar="DIR",
        help="keep the tower phase's result in DIR; a later run with the same phase-1 settings starts the "
        "second phase from it and writes the same weights (for trying second-phase recipes quickly)",
    )
    p.add_argument(
        "--compute-dtype",
        choices=("auto", "bfloat16", "float32"),
        default=t("compute_dtype"),
        help="matmuls under bfloat16 autocast or in float32; auto: bfloat16 where a start-up timing finds it "
        "fast on this CPU (AVX512-BF16, AMX), float32 where it is emulated (default: %(default)s)",
    )


def _kind_shares(text: str) -> tuple[tuple[str, float], ...]:
    from tools.demo_train import KIND_WEIGHTS

    out = []
    for part in text.split(","):
        kind, _, share = part.partition("=")
        if kind not in KIND_WEIGHTS:
            raise argparse.ArgumentTypeError(f"unknown kind {kind!r}; known: {', '.join(KIND_WEIGHTS)}")
        out.append((kind, float(share)))
    return tuple(out)


def train_demo_config(args: argparse.Namespace):
    """The TrainConfig that ``vlmserve train-demo``'s flags ask for (every other field at its default)."""
    from tools.demo_train import TrainConfig

    return TrainConfig(
        seed=args.seed,
        tower_steps=args.tower_steps,
        steps=args.steps,
        batch_images=args.batch_images,
        eval_every=args.eval_every,
        compute_dtype=args.compute_dtype,
        frozen_tower_blocks=args.frozen_tower_blocks,
        decoder_attention=args.decoder_attention,
        tool_steps=args.tool_steps,
        tool_images=args.tool_images,
        tool_lr=args.tool_lr,
        tool_weight=args.tool_weight,
        tool_value_weight=args.tool_value_weight,
        tool_kinds=args.tool_kinds,
        tool_merge=args.tool_merge,
    )


def cmd_train_demo(args: argparse.Namespace) -> int:
    from runtime import memory
    from tools import demo_train

    # From a command line: run again under jemalloc where it is installed (memory.jemalloc_relaunch).
    if args.command_line is not None:
        relaunch = memory.jemalloc_relaunch([sys.executable, "-m", "api.cli", *args.command_line])
        if relaunch is not None:
            argv, env = relaunch
            print(f"[train-demo] restarting with {env['LD_PRELOAD']} preloaded", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os.execve(sys.executable, argv, env)
    if args.base is not None:
        path = demo_train.train_tools(args.out, args.base, train_demo_config(args))
    else:
        path = demo_train.train(args.out, train_demo_config(args), tower_snapshot=args.tower_snapshot)
    print(f"wrote the demo checkpoint to {path}")
    return 0


def _demo_conversations() -> list[tuple[list[dict], str | None]]:
    """(conversation, expected answer): a text prompt, and the task set's questions about three of its images
    (the demo model's; any other model answers them as it can)."""
    from tools import demo_tasks

    convs: list[tuple[list[dict], str | None]] = [
        ([{"role": "user", "content": "Write one sentence about paged attention."}], None)
    ]
    for index, kind in enumerate(("single", "many", "number")):
        example = demo_tasks.sample(40_000, index, kind)
        for task, answer in example.qa.items():
            content = [
                {"type": "image", "image": example.data},
                {"type": "text", "text": example.question(task)},
            ]
            convs.append(([{"role": "user", "content": content}], answer))
    return convs


def cmd_demo(args: argparse.Namespace) -> int:
    """Offline generation on the demo checkpoint: a text prompt and an image prompt, with timings."""
    from lm_engine import LLM, SamplingParams
    from lm_engine.memory import NotEnoughMemory

    _process_settings(args)
    t0 = time.perf_counter()
    try:
        llm = LLM(args.model, **_engine_kwargs(args))
    except NotEnoughMemory as exc:
        raise SystemExit(f"vlmserve demo: {exc}") from None
    print(f"engine ready in {time.perf_counter() - t0:.1f}s (model: {llm.engine.config.model})")
    convs = _demo_conversations()
    t0 = time.perf_counter()
    outs = llm.chat([c for c, _ in convs], SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    dt = time.perf_counter() - t0
    for (conv, expected), out in zip(convs, outs):
        content = conv[-1]["content"]
        question = content if isinstance(content, str) else content[-1]["text"]
        record = {
            "question": question,
            "prompt_tokens": len(out.prompt_token_ids),
            "visual_tokens": out.visual_tokens,
            "output_tokens": len(out.token_ids),
            "finish_reason": out.finish_reason,
            "text": out.text,
        }
        if expected is not None:
            record["expected"] = expected
        print(json.dumps(record, ensure_ascii=False))
    total = sum(len(o.token_ids) for o in outs)
    print(f"{total} tokens in {dt:.2f}s ({total / dt:.1f} tok/s)")
    return 0


def _add_media_args(p: argparse.ArgumentParser) -> None:
    """What a request may carry and where its images may come from (serve and batch alike)."""
    from api.config import DEFAULT_IMAGE_LIMIT, ServerArgs, parse_limit_mm
    from api.media import MediaConfig

    media = functools.partial(flags.default, MediaConfig)

    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use in 'model' (default: the model path)",
    )
    p.add_argument(
        "--limit-mm-per-prompt",
        type=parse_limit_mm,
        default=flags.default(ServerArgs, "limit_mm_per_prompt"),
        help=f"items per request, e.g. image=4 or '{{\"image\": 4}}' (default: image={DEFAULT_IMAGE_LIMIT})",
    )
    p.add_argument(
        "--allowed-local-media-path",
        default=media("allowed_local_path"),
        help="serve file:// image URLs from under this directory only (default: file:// refused)",
    )
    p.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=sorted(media("allowed_domains")),
        help="image URL hosts that may be fetched even when they resolve to private/loopback addresses",
    )
    p.add_argument(
        "--allow-private-media",
        action="store_true",
        default=media("allow_private"),
        help="fetch image URLs on private, loopback and link-local addresses (trusted networks only)",
    )
    p.add_argument("--max-media-bytes", type=int, default=media("max_bytes"), help="per-image byte cap")
    p.add_argument(
        "--max-video-bytes",
        type=int,
        default=media("max_video_bytes"),
        help="per-video byte cap (as received)",
    )
    p.add_argument(
        "--media-fetch-timeout",
        type=float,
        default=media("read_timeout"),
        help="read timeout (s) for image URLs",
    )


def _media_config(args: argparse.Namespace) -> MediaConfig:
    from api.media import MediaConfig

    return MediaConfig(
        max_bytes=args.max_media_bytes,
        max_video_bytes=args.max_video_bytes,
        read_timeout=args.media_fetch_timeout,
        allowed_domains=frozenset(args.allowed_media_domains),
        allow_private=args.allow_private_media,
        allowed_local_path=args.allowed_local_media_path,
    )


def default_checkpoint() -> str:
    """The checkpoint ``vlmserve serve`` loads without ``--model``: the embedded demo model."""
    from tools.demo import demo_checkpoint

    return str(demo_checkpoint())


def _default_model(args: argparse.Namespace) -> tuple[str, list[str]]:
    """The checkpoint to load and the names clients may use for it (the demo model without --model)."""
    if args.model is not None:
        return args.model, args.served_model_name or []
    print("no --model given: serving the embedded demo model (trained on the synthetic task set)", flush=True)
    return default_checkpoint(), args.served_model_name or ["vlmserve-demo"]


def _check_visual_level(args: argparse.Namespace, model: str) -> None:
    """--visual-level: a level of this model's ladder, under --visual-budget fixed (a clear error, not a
    traceback from the engine's start)."""
    if not args.visual_level:
        return
    from lm_engine.visual_budget import default_ladder
    from preprocess import PreprocessConfig

    pp = PreprocessConfig.from_checkpoint(model)
    ladder = default_ladder(pp.max_pixels, pp.min_pixels, pp.factor)
    if not 0 <= args.visual_level < len(ladder):
        raise SystemExit(
            f"vlmserve serve: --visual-level {args.visual_level} is not a level of this model's visual budget "
            f"ladder: levels 0..{len(ladder) - 1} (max_pixels {', '.join(map(str, ladder))})"
        )
    if args.visual_budget != "fixed":
        raise SystemExit(
            "vlmserve serve: --visual-level pins the budget of --visual-budget fixed; add that flag"
        )


def _add_server_args(p: argparse.ArgumentParser) -> None:
    from api.config import ServerArgs

    srv = functools.partial(flags.default, ServerArgs)
    p.add_argument(
        "--host", default=srv("host"), help="address to bind (default: 127.0.0.1, this machine only)"
    )
    p.add_argument("--port", type=int, default=srv("port"))
    _add_client_args(p)
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=srv("max_request_bytes"),
        help="largest request body accepted (data: URLs included); larger ones get 413",
    )
    _add_media_args(p)
    p.add_argument(
        "--uvicorn-log-level",
        default=srv("log_level"),
        choices=["critical", "error", "warning", "info", "debug"],
    )
    p.add_argument(
        "--replica-name",
        default=srv("replica_name"),
        help="name this server as a replica: every response carries it in x-vlmserve-replica",
    )
    p.add_argument(
        "--reasoning-parser",
        default=srv("reasoning_parser"),
        choices=["qwen3"],
        help="read a <think>...</think> block in the output as message.reasoning_content (Qwen3-VL Thinking); "
        "structured output and tool grammars apply after it",
    )
    _add_load_args(p)


def _add_client_args(p: argparse.ArgumentParser) -> None:
    """serve's clients and tenants: API keys, caches per key, proxies, fairness, connection limits."""
    from api.config import ConnectionLimits, ServerArgs

    srv = functools.partial(flags.default, ServerArgs)
    sec = p.add_argument_group("clients and tenants (README: Security)")
    sec.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 routes and /metrics; repeat for several keys, each its "
        "own tenant (default: $VLMSERVE_API_KEY)",
    )
    sec.add_argument(
        "--api-key-file",
        default=None,
        help="API keys, one per line as 'KEY [TENANT]' (keys sharing a tenant name are one tenant)",
    )
    sec.add_argument(
        "--cache-salt-per-api-key",
        action=argparse.BooleanOptionalAction,
        default=srv("cache_salt_per_api_key"),
        help="each API key's tenant gets its own prefix and embedding caches, so no tenant can tell what another "
        "sent from cached_tokens or a fast first token (default: on; off shares them across keys)",
    )
    sec.add_argument(
        "--metrics-public",
        action="store_true",
        default=srv("metrics_public"),
        help="serve /metrics without an API key even when keys are set",
    )
    sec.add_argument(
        "--trusted-proxies",
        default=",".join(srv("trusted_proxies")),
        help="comma-separated addresses of balancers whose X-Forwarded-For names the client (default: none; "
        "the peer's own address is the client's)",
    )
    sec.add_argument(
        "--fair-share-by-user",
        action="store_true",
        default=srv("fair_share_by_user"),
        help="share prefill fairly by the request's 'user' field too (only behind a gateway that sets it: "
        "otherwise a client names itself); default: by API key, else by client address",
    )
    limits = functools.partial(flags.default, ConnectionLimits)
    sec.add_argument(
        "--header-timeout",
        type=float,
        default=limits("header_timeout_s"),
        help="seconds a request's head may take to arrive (then 408 and the connection is closed)",
    )
    sec.add_argument(
        "--body-timeout",
        type=float,
        default=limits("body_timeout_s"),
        help="seconds a request's body may take to arrive after its head",
    )
    sec.add_argument(
        "--max-connections",
        type=int,
        default=limits("max_connections"),
        help="open client connections at most; a new one past it gets 503 and is closed",
    )


def _add_load_args(p: argparse.ArgumentParser) -> None:
    from lm_engine.config import EngineConfig

    e = functools.partial(flags.default, EngineConfig)
    g = p.add_argument_group("load control")
    g.add_argument(
        "--visual-budget",
        default="adaptive",  # NOTE: the server's own default; offline runs (EngineConfig) keep every image whole
        choices=["adaptive", "fixed"],
        help="adaptive: lower new images' max_pixels under load (default); fixed: always the configured maximum",
    )
    g.add_argument(
        "--visual-level",
        type=int,
        default=e("visual_level"),
        help="with --visual-budget fixed: the budget level detail=auto images get (0 = full max_pixels, then "
        "50 %%, 25 %%, the model's minimum); detail=high and low still get the full and the lowest",
    )
    g.add_argument(
        "--ttft-slo-ms", type=float, default=e("ttft_slo_ms"), help="time-to-first-token target under load"
    )
    g.add_argument(
        "--slo-admission",
        action=argparse.BooleanOptionalAction,
        default=e("slo_admission"),
        help="refuse new requests (503 with Retry-After) while the prefill work queued ahead would take longer "
        "than --ttft-slo-ms (default: with --visual-budget adaptive only)",
    )
    g.add_argument(
        "--tpot-slo-ms",
        type=float,
        default=e("tpot_slo_ms"),
        help="per-output-token target: while requests decode, each step carries only the prefill that fits "
        "it at the measured prefill rate (default: no cap, the whole --max-num-batched-tokens)",
    )
    g.add_argument(
        "--max-queued-requests",
        type=int,
        default=e("max_queued_requests"),
        help="refuse new work (503) past this queue",
    )
    g.add_argument(
        "--max-queued-tokens",
        type=int,
        default=e("max_queued_tokens"),
        help="refuse new work (503) past these queued tokens",
    )


def _api_keys(args: argparse.Namespace) -> dict[str, str]:
    """--api-key (each its own tenant), --api-key-file, else $VLMSERVE_API_KEY; key → tenant name."""
    from api.config import read_api_keys, tenant_name

    given = args.api_key or ([os.environ["VLMSERVE_API_KEY"]] if os.environ.get("VLMSERVE_API_KEY") else [])
    keys = {key: tenant_name(key) for key in given if key}
    if args.api_key_file:
        try:
            keys.update(read_api_keys(args.api_key_file))
        except (OSError, ValueError) as exc:
            raise SystemExit(f"vlmserve serve: --api-key-file: {exc}") from None
    return keys


def cmd_serve(args: argparse.Namespace) -> int:
    from api.config import ConnectionLimits, ServerArgs
    from api.server import run_server
    from lm_engine.config import EngineConfig
    from lm_engine.memory import NotEnoughMemory
    from lm_engine.startup import StartupPhases, process_age_s
    from runtime.memory import bound_native_caches, huge_page_tensors

    # The time from the process's start to here (the interpreter, torch's and the server's imports) is the
    # first phase of the start-up the engine logs.
    age = process_age_s() if args.command_line is not None else None
    startup = StartupPhases(before={"imports": age} if age is not None else None)
    bound_native_caches()  # NOTE: before the engine runs its first matmul
    huge_page_tensors()  # and before its first large tensor
    _process_settings(args)

    model, names = _default_model(args)
    _check_visual_level(args, model)
    server_args = ServerArgs(
        engine=EngineConfig(model=model, **_engine_kwargs(args, encoder_timeout_s=args.encoder_timeout)),
        host=args.host,
        port=args.port,
        served_model_names=names,
        api_keys=_api_keys(args),
        cache_salt_per_api_key=args.cache_salt_per_api_key,
        metrics_public=args.metrics_public,
        trusted_proxies=[a.strip() for a in args.trusted_proxies.split(",") if a.strip()],
        fair_share_by_user=args.fair_share_by_user,
        limits=ConnectionLimits(args.header_timeout, args.body_timeout, args.max_connections),
        limit_mm_per_prompt=args.limit_mm_per_prompt,
        media=_media_config(args),
        max_request_bytes=args.max_request_bytes,
        log_level=args.uvicorn_log_level,
        replica_name=args.replica_name,
        reasoning_parser=args.reasoning_parser,
    )
    try:
        run_server(server_args, startup)
    except NotEnoughMemory as exc:
        raise SystemExit(f"vlmserve serve: {exc}") from None
    return 0


def cmd_batch(args: argparse.Namespace) -> int:
    """OpenAI batch file in, batch output out, on the engine in this process (see api/batch.py)."""
    from api.batch import BatchOptions, run_batch
    from lm_engine.config import EngineConfig
    from lm_engine.engine import LLMEngine
    from lm_engine.memory import NotEnoughMemory
    from runtime.memory import bound_native_caches, huge_page_tensors

    bound_native_caches()
    huge_page_tensors()
    _process_settings(args)

    if not os.path.isfile(args.input):
        print(f"vlmserve batch: no such input file: {args.input}", file=sys.stderr)
        return 2
    options = BatchOptions(
        limit_mm_per_prompt=args.limit_mm_per_prompt,
        media=_media_config(args),
        max_in_flight=args.max_in_flight,
        progress=not args.disable_progress_bar,
    )
    model, options.served_model_names = _default_model(args)
    try:
        engine = LLMEngine(EngineConfig(model=model, **_engine_kwargs(args)))
    except NotEnoughMemory as exc:
        raise SystemExit(f"vlmserve batch: {exc}") from None
    try:
        summary = run_batch(engine, args.input, args.output, options)
    finally:
        engine.close()
    print(summary.report())
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary.as_dict(), f, indent=2)
    return 0


def _add_batch_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "batch",
        help="OpenAI batch file (JSONL of chat requests) in, results (JSONL, input order) out, offline",
        description="Runs every line of INPUT (OpenAI batch lines: custom_id, method POST, url "
        "/v1/chat/completions, body) on the engine in this process and writes one record per line to OUTPUT, "
        "in input order. Lines about the same image run back to back so its embedding and prefix stay cached. "
        "file:// image URLs are refused unless --allowed-local-media-path names their directory.",
    )
    p.add_argument("input", help="batch input file (.jsonl)")
    p.add_argument("output", help="where to write the results (.jsonl; replaced when the run completes)")
    _add_engine_args(p)
    _add_media_args(p)
    p.add_argument(
        "--max-in-flight",
        type=int,
        default=None,
        help="lines being prepared or run at once, which bounds memory (default: 2 x --max-num-seqs)",
    )
    p.add_argument("--disable-progress-bar", action="store_true")
    p.add_argument("--summary-json", default=None, help="also write the run's summary here, as JSON")
    p.set_defaults(func=cmd_batch)


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand's flags (their defaults read from the settings classes: api/flags.py)."""
    from api import encoder_command as encoder_tier

    parser = argparse.ArgumentParser(prog="vlmserve", description="Serve vision-language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "make-model", help="generate a Qwen2-VL, Qwen2.5-VL or Qwen3-VL checkpoint with random weights"
    )
    p.add_argument(
        "--preset",
        default="tiny",
        choices=[*MAKE_MODEL_PRESETS, *PUBLISHED_PRESETS],
        help="tiny, small: any family; wide, demo: Qwen2-VL only; the others are the published checkpoints' "
        "shapes (random weights, HF-like shards) and imply their family",
    )
    p.add_argument(
        "--family",
        default=None,
        choices=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"],
        help="default: the preset's own, else qwen2_vl",
    )
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_make_model)

    _add_train_demo_parser(sub)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (default: the demo model)")
    _add_engine_args(p)
    _add_server_args(p)
    encoder_tier.add_serve_args(p)
    p.set_defaults(func=cmd_serve)

    from api.cluster.command import add_parser as add_cluster_parser

    add_cluster_parser(sub)
    encoder_tier.add_parser(sub)

    _add_batch_parser(sub)

    p = sub.add_parser("demo", help="offline generation on the (demo) model")
    _add_engine_args(p)
    p.add_argument("--max-tokens", type=int, default=32)
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.command_line = sys.argv[1:] if argv is None else None  # None: called in-process (tests)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
