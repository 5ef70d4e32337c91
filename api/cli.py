"""The ``vlmserve`` command: serve, demo, make-model."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="local Hugging Face checkpoint directory (default: the demo model)"
    )
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's own), float32, bfloat16, float16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="fixed KV pool size (default: measured)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        num_kv_blocks=args.num_kv_blocks,
        attention_backend=args.attention_backend,
    )


def cmd_make_model(args: argparse.Namespace) -> int:
    from lm_engine.models.qwen2_vl_make import make_checkpoint

    t0 = time.perf_counter()
    path = make_checkpoint(args.out, preset=args.preset, seed=args.seed)
    print(f"wrote {args.preset} checkpoint to {path} in {time.perf_counter() - t0:.1f}s")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Offline generation on the demo checkpoint: a text prompt and an image prompt, with timings."""
    import io

    import numpy as np
    from PIL import Image

    from lm_engine import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, **_engine_kwargs(args))
    print(f"engine ready in {time.perf_counter() - t0:.1f}s (model: {llm.engine.config.model})")
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray((rng.random((448, 448, 3)) * 255).astype(np.uint8)).save(buf, format="JPEG")
    image = buf.getvalue()
    convs = [
        [{"role": "user", "content": "Write one sentence about paged attention."}],
        [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": image},
                    {"type": "text", "text": "What is in this picture?"},
                ],
            }
        ],
    ]
    t0 = time.perf_counter()
    outs = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    dt = time.perf_counter() - t0
    for out in outs:
        print(
            json.dumps(
                {
                    "prompt_tokens": len(out.prompt_token_ids),
                    "visual_tokens": out.visual_tokens,
                    "output_tokens": len(out.token_ids),
                    "finish_reason": out.finish_reason,
                    "text": out.text,
                },
                ensure_ascii=False,
            )
        )
    total = sum(len(o.token_ids) for o in outs)
    print(
        f"{total} tokens in {dt:.2f}s ({total / dt:.1f} tok/s). The demo weights are random: the text is "
        "meaningless, the pipeline and timings are real."
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vlmserve", description="Serve vision-language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-model", help="generate a Qwen2-VL checkpoint with random weights")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_make_model)

    p = sub.add_parser("demo", help="offline generation on the (demo) model")
    _add_engine_args(p)
    p.add_argument("--max-tokens", type=int, default=32)
    p.set_defaults(func=cmd_demo)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
