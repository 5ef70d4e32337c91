"""benchmarks/llamacpp.py without llama.cpp: cache keys, the server's command line, the converter shim's
pre-tokenizer rule, and the skip path (PeerUnavailable) when the toolchain or the build fails. No network,
no build, no conversion: fakes stand in for cmake and for the vendored converter."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks import llamacpp

CPUINFO = "processor\t: 0\nflags\t\t: fpu avx2 sse avx512f\nbugs\t\t: none\nprocessor\t: 1\nflags\t\t: fpu\n"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("VLMSERVE_LLAMACPP_CACHE", str(root))
    return root


def _fake_sdist(root: Path, version: str = llamacpp.LLAMA_CPP_PYTHON_VERSION) -> Path:
    """An extracted 'sdist' whose llama.cpp is just a CMakeLists.txt (enough for source_dir to reuse it)."""
    llama = root / "src" / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    llama.mkdir(parents=True)
    (llama / "CMakeLists.txt").write_text("project(fake)\n")
    return llama


def _fake_bin(tmp_path: Path, names: dict[str, str]) -> str:
    """A PATH holding only the given executables (name -> shell body)."""
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    for name, body in names.items():
        p = d / name
        p.write_text(f"#!/bin/sh\n{body}\n")
        p.chmod(0o755)
    return str(d)


def test_cpu_flags_are_the_first_cpus_sorted():
    assert llamacpp.cpu_flags(CPUINFO) == ["avx2", "avx512f", "fpu", "sse"]
    assert llamacpp.cpu_flags("model name: x\n") == []


def test_build_key_follows_version_flags_compiler_and_options():
    base = llamacpp.build_key("0.3.36", ["avx2", "fma"], "g++ 12")
    assert base == llamacpp.build_key("0.3.36", ["fma", "avx2"], "g++ 12")  # order of flags does not matter
    assert base.startswith("build-0.3.36-")
    others = {
        llamacpp.build_key("0.3.35", ["avx2", "fma"], "g++ 12"),
        llamacpp.build_key("0.3.36", ["avx2", "fma", "avx512_bf16"], "g++ 12"),  # -march=native differs
        llamacpp.build_key("0.3.36", ["avx2", "fma"], "g++ 13"),
        llamacpp.build_key("0.3.36", ["avx2", "fma"], "g++ 12", options=("-DGGML_NATIVE=OFF",)),
    }
    assert base not in others and len(others) == 4


def test_checkpoint_key_changes_with_the_weights_not_the_directory(tmp_path: Path):
    a = tmp_path / "a"
    a.mkdir()
    (a / "config.json").write_text('{"model_type": "qwen2_vl"}')
    (a / "model.safetensors").write_bytes(b"\x08" + b"\0" * 100)
    key = llamacpp.checkpoint_key(a)
    b = tmp_path / "b"
    b.mkdir()
    for name in ("config.json", "model.safetensors"):
        (b / name).write_bytes((a / name).read_bytes())
        st = (a / name).stat()
        os.utime(b / name, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert llamacpp.checkpoint_key(b) == key
    st = (a / "model.safetensors").stat()
    os.utime(a / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # rewritten in place
    assert llamacpp.checkpoint_key(a) != key
    (b / "config.json").write_text('{"model_type": "qwen2_5_vl"}')
    assert llamacpp.checkpoint_key(b) != key
    (b / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError):
        llamacpp.checkpoint_key(b)


def test_server_argv_binds_loopback_with_the_given_sizes(tmp_path: Path):
    argv = llamacpp.server_argv(
        tmp_path,
        Path("/m/model.gguf"),
        Path("/m/mmproj.gguf"),
        8123,
        ctx=8192,
        slots=8,
        threads=2,
        image_max_tokens=1024,
        extra=["--metrics"],
    )
    assert argv[0] == str(tmp_path / "llama-server")

    def opt(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    assert (opt("-m"), opt("--mmproj"), opt("--host"), opt("--port")) == (
        "/m/model.gguf",
        "/m/mmproj.gguf",
        "127.0.0.1",
        "8123",
    )
    assert (opt("-c"), opt("-np"), opt("-t"), opt("-tb"), opt("--image-max-tokens")) == (
        "8192",
        "8",
        "2",
        "2",
        "1024",
    )
    assert "--image-min-tokens" not in argv
    assert argv[-2:] == ["--no-webui", "--metrics"]
    text_only = llamacpp.server_argv(tmp_path, Path("m.gguf"), None, 1, no_webui=False)
    assert "--mmproj" not in text_only and "--no-webui" not in text_only


def test_converter_requirements_drop_torch_gguf_and_index_options(tmp_path: Path):
    req = tmp_path / "requirements"
    req.mkdir()
    (req / "requirements-convert_legacy_llama.txt").write_text(
        "numpy~=2.2.6\nsentencepiece>=0.1.98,<0.3.0\n\ntransformers==4.57.6\n\ngguf>=0.1.0\n"
    )
    (req / "requirements-convert_hf_to_gguf.txt").write_text(
        "-r ./requirements-convert_legacy_llama.txt\n--extra-index-url https://download.pytorch.org/whl/cpu\n"
        "# a comment\ntorch==2.11.0\n"
    )
    reqs = llamacpp.converter_requirements(tmp_path)
    assert reqs[:3] == ["numpy~=2.2.6", "sentencepiece>=0.1.98,<0.3.0", "transformers==4.57.6"]
    assert not any(r.startswith(("torch", "gguf", "--")) for r in reqs)
    assert "pyyaml>=5.1" in reqs  # gguf-py's own dependencies


def _fake_converter(tmp_path: Path) -> Path:
    """A llama.cpp tree whose converter asks get_vocab_base_pre for a name and maps one merger tensor, as the
    real one does: unknown tokenizer hash -> NotImplementedError; a name table sized by the tower's depth."""
    llama = tmp_path / "llama.cpp"
    (llama / "conversion").mkdir(parents=True)
    (llama / "gguf-py" / "gguf").mkdir(parents=True)
    (llama / "gguf-py" / "gguf" / "__init__.py").write_text(
        textwrap.dedent("""
        class MODEL_ARCH:
            MMPROJ = "mmproj"
        def get_tensor_name_map(arch, n_blocks):
            return {f"visual.merger.mlp.{b}": f"mm.{b}" for b in range(n_blocks)}
    """)
    )
    (llama / "conversion" / "__init__.py").write_text("")
    (llama / "conversion" / "base.py").write_text(
        textwrap.dedent("""
        import logging
        import gguf
        logger = logging.getLogger("fake")
        class TextModel:
            def __init__(self, dir_model):
                self.dir_model = dir_model
            def get_vocab_base_pre(self, tokenizer):
                raise NotImplementedError("BPE pre-tokenizer was not recognized")
        class MmprojModel:
            def __init__(self, depth):
                self.block_count = depth
                self.tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, depth)
    """)
    )
    (llama / "convert_hf_to_gguf.py").write_text(
        textwrap.dedent("""
        import sys
        from conversion import base
        print("pre", base.TextModel(sys.argv[1]).get_vocab_base_pre(None))
        print("mlp2", base.MmprojModel(2).tensor_map.get("visual.merger.mlp.2"))
    """)
    )
    return llama


def _run_shim(llama: Path, ckpt: Path) -> subprocess.CompletedProcess:
    code = llamacpp._CONVERT_SHIM % {"known": repr(llamacpp.KNOWN_SPLIT_REGEX)}
    return subprocess.run(
        [sys.executable, "-c", code, str(llama), str(ckpt)], capture_output=True, text=True, timeout=60
    )


def _tokenizer(ckpt: Path, regex: str) -> None:
    import json

    ckpt.mkdir(exist_ok=True)
    (ckpt / "tokenizer.json").write_text(
        json.dumps(
            {
                "pre_tokenizer": {
                    "type": "Sequence",
                    "pretokenizers": [
                        {
                            "type": "Split",
                            "pattern": {"Regex": regex},
                            "behavior": "Isolated",
                            "invert": False,
                        },
                        {
                            "type": "ByteLevel",
                            "add_prefix_space": False,
                            "trim_offsets": True,
                            "use_regex": False,
                        },
                    ],
                }
            }
        )
    )


def test_shim_names_a_known_split_regex_and_fails_on_an_unknown_one(tmp_path: Path):
    llama = _fake_converter(tmp_path)
    qwen2_regex = next(iter(llamacpp.KNOWN_SPLIT_REGEX))
    _tokenizer(tmp_path / "ours", qwen2_regex)
    proc = _run_shim(llama, tmp_path / "ours")
    assert proc.returncode == 0, proc.stderr
    assert "pre qwen2" in proc.stdout
    assert "mlp2 mm.2" in proc.stdout  # a 2-block tower's merger still maps
    _tokenizer(tmp_path / "other", r"\s+|\S+")
    proc = _run_shim(llama, tmp_path / "other")
    assert proc.returncode != 0 and "NotImplementedError" in proc.stderr


def test_missing_cmake_is_peer_unavailable(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PATH", _fake_bin(tmp_path, {"cc": "exit 0", "c++": "exit 0"}))
    with pytest.raises(llamacpp.PeerUnavailable, match="cmake"):
        llamacpp.ensure_built()
    assert not cache.exists()  # nothing downloaded or configured


def test_missing_compiler_is_peer_unavailable(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PATH", _fake_bin(tmp_path, {"cmake": "exit 0"}))
    with pytest.raises(llamacpp.PeerUnavailable, match="C compiler"):
        llamacpp.ensure_built()


def test_failed_build_is_peer_unavailable_and_leaves_no_stamp(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
):
    _fake_sdist(cache)
    path = _fake_bin(
        tmp_path,
        {
            "cmake": 'case "$1" in --build) echo "error: fake compile failure"; exit 2;; *) exit 0;; esac',
            "cc": "exit 0",
            "c++": "echo 'fake c++ 1.0'",
        },
    )
    monkeypatch.setenv("PATH", path)
    with pytest.raises(llamacpp.PeerUnavailable, match="cmake build failed") as e:
        llamacpp.ensure_built()
    assert "fake compile failure" in str(e.value)
    assert not list(cache.glob("build-*/vlmserve-build.json"))


def test_a_finished_build_is_reused(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch):
    _fake_sdist(cache)
    calls = tmp_path / "calls"
    # a fake cmake that "builds" by creating the targets' files in <build>/bin
    path = _fake_bin(
        tmp_path,
        {
            "cmake": f'echo "$@" >> {calls}\n'
            f'if [ "$1" = "--build" ]; then {shutil.which("mkdir")} -p "$2/bin"; '
            f'{shutil.which("touch")} "$2/bin/llama-server" "$2/bin/llama-quantize"; fi',
            "cc": "exit 0",
            "c++": "echo 'fake c++ 1.0'",
        },
    )
    monkeypatch.setenv("PATH", path)
    bin_dir = llamacpp.ensure_built(jobs=1)
    assert (bin_dir / "llama-server").is_file()
    assert (bin_dir.parent / "vlmserve-build.json").is_file()
    assert bin_dir.parent.parent == cache
    n = len(calls.read_text().splitlines())
    assert n == 2  # configure + build
    assert llamacpp.ensure_built(jobs=1) == bin_dir
    assert len(calls.read_text().splitlines()) == n  # cached: cmake not run again


def test_quantize_rejects_an_unknown_kind(tmp_path: Path):
    with pytest.raises(ValueError, match="Q5_0"):
        llamacpp.quantize(tmp_path / "model-bf16.gguf", "Q5_0", bin_dir=tmp_path)


def test_proc_memory_reads_this_process():
    mem = llamacpp.proc_memory(os.getpid())
    assert mem["VmRSS"] > 0 and mem["VmRSS"] >= mem["RssAnon"]
