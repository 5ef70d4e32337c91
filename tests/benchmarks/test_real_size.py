"""benchmarks/real_size.py's arithmetic and plumbing, with no model of real size and no verdict on this machine's
speed: the decode floor's byte count from safetensors headers, the start-up line, the process tree's memory, the
per-token stream timing, the arguments, and one ``--quick --peer none`` run end to end on the tiny preset."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from benchmarks import real_size

EMBED = torch.zeros(100, 8, dtype=torch.bfloat16)  # 1,600 bytes
UP = torch.zeros(16, 8, dtype=torch.bfloat16)  # 256
NORM = torch.zeros(8, dtype=torch.bfloat16)  # 16
QKV = torch.zeros(24, 8, dtype=torch.bfloat16)  # 384, tower (Qwen2-VL layout)
MERGER = torch.zeros(8, 8, dtype=torch.bfloat16)  # 128, tower (transformers 5 layout)


def _ckpt(path: Path, tensors: dict[str, torch.Tensor], config: dict, shards: int = 1) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(tensors, path / "model.safetensors")
        return path
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, path / file)
        weight_map |= dict.fromkeys(part, file)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def _common() -> dict[str, torch.Tensor]:
    return {
        "model.embed_tokens.weight": EMBED,
        "model.layers.0.mlp.up_proj.weight": UP,
        "model.norm.weight": NORM,
        "visual.blocks.0.attn.qkv.weight": QKV,
        "model.visual.merger.mlp.0.weight": MERGER,
    }


def test_floor_untied_head_counts_the_output_projection_not_the_input_embedding(tmp_path: Path) -> None:
    tensors = {**_common(), "lm_head.weight": EMBED.clone()}
    w = real_size.weight_bytes(_ckpt(tmp_path / "untied", tensors, {"tie_word_embeddings": False}))
    assert w["total_bytes"] == 1600 + 1600 + 256 + 16 + 384 + 128
    assert w["vision_bytes"] == 384 + 128
    assert w["decoder_bytes"] == 1600 + 1600 + 256 + 16
    assert not w["tied"]
    # a step gathers one row of the input embedding per token, and reads the whole output projection
    assert w["floor_bytes"] == 1600 + 256 + 16
    assert w["decoder_params"] == 2 * 800 + 128 + 8


def test_floor_tied_head_counts_the_embedding_once(tmp_path: Path) -> None:
    w = real_size.weight_bytes(
        _ckpt(tmp_path / "tied", _common(), {"text_config": {"tie_word_embeddings": True}}, shards=2)
    )
    assert w["files"] == 2
    assert w["tied"]
    assert w["decoder_bytes"] == w["floor_bytes"] == 1600 + 256 + 16
    assert w["lm_head_bytes"] == 1600
    # a tied checkpoint that stores lm_head as well: the same matrix, once in memory and once per step
    both = real_size.weight_bytes(
        _ckpt(
            tmp_path / "tied-stored",
            {**_common(), "lm_head.weight": EMBED.clone()},
            {"tie_word_embeddings": True},
        )
    )
    assert both["decoder_bytes"] == both["floor_bytes"] == 1600 + 256 + 16
    assert both["decoder_params"] == 800 + 128 + 8


def test_floor_reads_only_the_shards_the_index_names(tmp_path: Path) -> None:
    path = _ckpt(tmp_path / "sharded", _common(), {}, shards=2)
    save_file({"stray.weight": EMBED}, path / "consolidated.safetensors")
    assert real_size.weight_bytes(path)["total_bytes"] == 1600 + 256 + 16 + 384 + 128


def test_floor_ms_is_bytes_over_bandwidth() -> None:
    assert real_size.floor_ms(3_090_000_000, 30.0) == pytest.approx(103.0)
    assert real_size.floor_ms(1, None) is None


def test_parse_startup_line() -> None:
    log = (
        "2026-12-06 13:57:10,589 INFO vlmserve.memory: oneDNN shape caches\n"
        "2026-12-06 13:57:21,000 INFO vlmserve.api: start-up 12.4 s: load weights 3.1 s, pack 5.2 s, "
        "warm-up 4.1 s\n"
    )
    assert real_size.parse_startup(log) == {
        "total_s": 12.4,
        "phases": {"load weights": 3.1, "pack": 5.2, "warm-up": 4.1},
    }
    assert real_size.parse_startup("INFO serving on http://127.0.0.1:8000\n") is None
    odd = real_size.parse_startup("start-up 2.0 s: probes 0.5 s, cached probes")
    assert odd == {"total_s": 2.0, "phases": {"probes": 0.5}, "unparsed": ["cached probes"]}


def test_llamacpp_kv_bytes_sums_its_buffers() -> None:
    log = "llama_kv_cache:        CPU KV buffer size =   448.00 MiB\nother\nKV buffer size = 64.00 MiB\n"
    assert real_size.llamacpp_kv_bytes(log) == 512 * 2**20
    assert real_size.llamacpp_kv_bytes("nothing") is None


CHILD = """
import os, subprocess, sys, time
if sys.argv[1] == "parent":
    kid = subprocess.Popen([sys.executable, "-c", sys.argv[2], "child", sys.argv[2]], stdout=sys.stdout)
    print("parent", os.getpid(), flush=True)
    time.sleep(60)
else:
    block = bytearray(96 << 20)
    for i in range(0, len(block), 4096):
        block[i] = 1
    print("child", os.getpid(), flush=True)
    time.sleep(60)
"""


def test_tree_rss_sums_a_spawned_child() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, "parent", CHILD],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        pids = dict(proc.stdout.readline().split() for _ in range(2))
        child = int(pids["child"])
        assert child in real_size.process_tree(proc.pid)
        tree = real_size.tree_rss(proc.pid)
        assert tree["processes"] == 2
        child_rss = real_size.vm_rss(child)
        assert child_rss > 96 << 20
        slack = 8 << 20  # the two were read at slightly different times
        assert tree["bytes"] >= tree["main_bytes"] + child_rss - slack
        assert real_size.tree_rss(child)["processes"] == 1
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_stream_counts_tokens_per_event_in_both_dialects() -> None:
    ours = real_size.Stream(status=200)
    ours.on_event({"choices": [{"delta": {"role": "assistant", "content": ""}, "token_ids": []}]}, 0.05)
    ours.on_event({"choices": [{"delta": {"content": "a"}, "token_ids": [5]}]}, 0.1)
    ours.on_event({"choices": [{"delta": {}, "token_ids": [6, 7]}]}, 0.3)  # two tokens, no text yet
    ours.on_event({"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 9}}, 0.31)
    assert ours.events == [(0.1, 1), (0.3, 2)]
    assert ours.ttft_s == 0.1 and ours.tokens == 3 and ours.prompt_tokens == 9
    assert ours.token_gaps_s() == pytest.approx([0.1, 0.1])

    peer = real_size.Stream(status=200)
    peer.on_event({"choices": [{"delta": {"role": "assistant", "content": None}}]}, 0.01)
    peer.on_event({"choices": [{"delta": {"content": "x"}}], "timings": {"predicted_n": 1}}, 0.2)
    peer.on_event({"choices": [{"delta": {"content": "yz"}}], "timings": {"predicted_n": 3}}, 0.6)
    peer.on_event(
        {"choices": [{"delta": {}, "finish_reason": "length"}], "timings": {"predicted_n": 3}}, 0.61
    )
    assert peer.events == [(0.2, 1), (0.6, 2)]
    assert peer.token_gaps_s() == pytest.approx([0.2, 0.2])

    plain = real_size.Stream(status=200)
    for i, text in enumerate(["", "a", "b"]):
        plain.on_event({"choices": [{"delta": {"content": text}}]}, i * 0.1)
    assert plain.events == [(0.1, 1), (0.2, 1)]


def test_parse_args() -> None:
    args = real_size.parse_args(["--model", "/x/qwen2-vl-2b"])
    assert (args.tokens, args.streams, args.prefill_tokens, args.images, args.image_tokens) == (
        64,
        [1, 8, 16],
        2000,
        8,
        32,
    )
    assert args.peer == "llamacpp" and args.label == "qwen2-vl-2b" and args.skip == set()
    quick = real_size.parse_args(
        [
            "--model=/x/m",
            "--quick",
            "--tokens=5",
            "--streams=16,1",
            "--skip=tower,images",
            "--label=run",
            "--vlmserve-arg=--max-num-seqs",
            "--vlmserve-arg=8",
            "--llamacpp-arg=--mlock",
            "--peer=none",
        ]
    )
    assert quick.tokens == 5 and quick.streams == [1, 16]  # given values win over --quick's
    assert quick.prefill_tokens == real_size.QUICK["prefill_tokens"]
    assert quick.skip == {"tower", "images"} and quick.label == "run" and quick.peer == "none"
    assert quick.vlmserve_arg == ["--max-num-seqs", "8"] and quick.llamacpp_arg == ["--mlock"]
    for bad in (["--skip=warp"], ["--streams=a"], ["--streams=0"], ["--images=9"], ["--peer=vllm"]):
        with pytest.raises(SystemExit):
            real_size.parse_args(["--model", "/x", *bad])


def test_cpu_info_keeps_the_vector_and_matrix_flags() -> None:
    info = real_size.cpu_info(
        "model name\t: Some CPU\nflags\t\t: fpu sse avx avx2 avx512f avx512_bf16 amx_tile fma\n"
    )
    assert info == {"cpu_model": "Some CPU", "flags": ["amx_tile", "avx2", "avx512_bf16", "avx512f"]}


@pytest.mark.slow
def test_quick_run_end_to_end(tiny_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The whole harness on the tiny preset: a server started and stopped, every section filled in, the JSON
    written. ~20 s on 2 cores."""
    rc = real_size.main(
        [
            "--model",
            str(tiny_ckpt),
            "--quick",
            "--peer",
            "none",
            "--label",
            "smoke",
            "--results-dir",
            str(tmp_path / "results"),
            "--log-dir",
            str(tmp_path / "logs"),
        ]
    )
    assert rc == 0
    (out,) = (tmp_path / "results").glob("smoke-*.json")
    r = json.loads(out.read_text())
    vl = r["vlmserve"]
    assert "error" not in vl and vl["ready_s"] > 0
    assert vl["decode"]["1"]["ok"] == 1 and vl["decode"]["4"]["ok"] == 4
    assert vl["decode"]["4"]["tokens"] == 4 * real_size.QUICK["tokens"]
    assert vl["prefill"]["prompt_tokens"] >= real_size.QUICK["prefill_tokens"]
    assert vl["images"]["ok"] == real_size.QUICK["images"]
    assert vl["rss_after_load"]["bytes"] > 0 and vl["kv_cache_bytes"] > 0
    assert r["machine"]["before"]["read_gbs"] > 0 and r["floor"]["ms_best"] > 0
    assert r["tower"]["float32"]["tower"]["gflops"] > 0 and r["tower"]["float32"]["prefill"]["gflops"] > 0
    for part in ("tower", "prefill"):  # each round against the matmul rate measured just before it
        x = r["tower"]["float32"][part]
        assert len(x["round_matmul_gflops"]) == len(x["round_seconds"]) == 1
        want = x["flops"] / x["round_seconds"][0] / 1e9 / x["round_matmul_gflops"][0]
        assert x["vs_matmul"] == pytest.approx(want) == r["ratios"][f"{part}_float32_vs_matmul"]
    assert r["ratios"]["decode_1_vs_floor"] > 0
    assert list((tmp_path / "logs").glob("smoke-*-vlmserve.log"))
    out_text = capsys.readouterr().out
    assert "decode 1 stream(s), ms/token" in out_text and "others' CPU share" in out_text
    assert 0 <= vl["cpu"]["others_share"] <= 1
