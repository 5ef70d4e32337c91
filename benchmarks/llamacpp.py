"""llama.cpp's ``llama-server`` as the peer for the real-size benchmark: built, converted, started, stopped.

llama.cpp comes from the PyPI sdist of ``llama-cpp-python``, which vendors it (``vendor/llama.cpp``); it is
built once for this CPU (``-march=native``) and cached outside the repository, with the conversion tools in a
venv of their own (torch, transformers, sentencepiece: none of them touch the project's venv).

    .venv/bin/python benchmarks/llamacpp.py --hf /tmp/tinyq2               # build, convert, serve, 2 requests
    .venv/bin/python benchmarks/llamacpp.py --hf /tmp/tinyq2 --quantize Q8_0

From another benchmark::

    from benchmarks import llamacpp
    try:
        bin_dir = llamacpp.ensure_built()
        model, mmproj = llamacpp.convert(ckpt)                      # bf16 GGUF (+ vision projector)
    except llamacpp.PeerUnavailable as e:
        print(f"llama.cpp skipped: {e}")
    else:
        with llamacpp.LlamaServer(model, mmproj, ctx=4096, slots=8) as srv:
            ...  # OpenAI client on srv.base_url + "/v1"; srv.startup_s, srv.rss_bytes()

Cache (``$VLMSERVE_LLAMACPP_CACHE``, default ``~/.cache/vlmserve/llamacpp``): ``src/`` the sdist and its
extracted tree, ``build-<version>-<key>/`` one build per (version, CPU flags, compiler, cmake options),
``venv/`` the converter's venv, ``gguf/<checkpoint key>/`` conversions and quantizations.
"""

from __future__ import annotations

if not __package__:  # run by path: the repository root onto sys.path, once (benchmarks/_path.py)
    import _path  # noqa: F401

import argparse
import base64
import contextlib
import fcntl
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
# NOTE: from the sdist's CHANGELOG.md ("update llama.cpp to ggml-org/llama.cpp@0c1e57098"); the sdist has no .git.
LLAMA_CPP_COMMIT = "0c1e57098"
TARGETS = ("llama-server", "llama-quantize")
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",  # -march=native: the cache key holds the CPU flags
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DBUILD_SHARED_LIBS=OFF",  # self-contained binaries in bin/
    "-DLLAMA_OPENSSL=OFF",  # no HTTPS: the server binds loopback and nothing is downloaded
    # NOTE: the web UI is not built and its prebuilt assets are not fetched (the default would download
    # them from a Hugging Face bucket at build time); LLAMA_CURL is gone in this version (ignored).
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
)
QUANT_KINDS = ("Q8_0", "Q4_K_M")


class PeerUnavailable(RuntimeError):
    """llama.cpp cannot be built, converted to or started here; the benchmark skips the peer with this message."""


def cache_root() -> Path:
    return Path(os.environ.get("VLMSERVE_LLAMACPP_CACHE", "~/.cache/vlmserve/llamacpp")).expanduser()


def _log(msg: str) -> None:
    print(f"[llamacpp] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One builder/converter at a time per cache entry (two benchmark runs may start together)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---------------------------------------------------------------- build


def cpu_flags(cpuinfo: str | None = None) -> list[str]:
    """The first CPU's flags from /proc/cpuinfo, sorted (what -march=native compiles for)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return []
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return sorted(set(value.split()))
    return []


def _compiler_id(cxx: str | None) -> str:
    if not cxx:
        return ""
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return cxx
    return out.splitlines()[0] if out else cxx


def build_key(
    version: str = LLAMA_CPP_PYTHON_VERSION,
    flags: Sequence[str] | None = None,
    compiler: str = "",
    options: Sequence[str] = CMAKE_OPTIONS,
    targets: Sequence[str] = TARGETS,
) -> str:
    """Directory name of one build: a binary built with -march=native is only reused on the same CPU flags."""
    flags = cpu_flags() if flags is None else flags
    blob = json.dumps(
        {"flags": sorted(flags), "compiler": compiler, "options": list(options), "targets": sorted(targets)},
        sort_keys=True,
    )
    return f"build-{version}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def find_toolchain(path: str | None = None) -> tuple[str, str, str]:
    """(cmake, C compiler, C++ compiler) from PATH, or PeerUnavailable naming what is missing."""
    cmake = shutil.which("cmake", path=path)
    cc = next((c for n in ("cc", "gcc", "clang") if (c := shutil.which(n, path=path))), None)
    cxx = next((c for n in ("c++", "g++", "clang++") if (c := shutil.which(n, path=path))), None)
    missing = [
        name for name, found in (("cmake", cmake), ("a C compiler", cc), ("a C++ compiler", cxx)) if not found
    ]
    if missing:
        raise PeerUnavailable(
            f"llama.cpp needs {', '.join(missing)} to build (apt-get install cmake g++); not found on PATH"
        )
    return cmake, cc, cxx  # type: ignore[return-value]


def _run_logged(
    argv: Sequence[str],
    log_path: Path,
    what: str,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    echo: bool = True,
) -> None:
    """Runs argv, appending its output to log_path and echoing progress lines; PeerUnavailable on failure."""
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(map(str, argv))}\n")
        log.flush()
        try:
            proc = subprocess.Popen(
                list(map(str, argv)),
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
            )
        except OSError as e:
            raise PeerUnavailable(f"{what}: cannot run {argv[0]}: {e}") from e
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            # NOTE: cmake's "[ 42%] Building ..." lines are the progress; the rest goes to the log only.
            if echo and (line.startswith("[") or "error" in line.lower()):
                print(f"  {line.rstrip()[:160]}", file=sys.stderr, flush=True)
        rc = proc.wait()
    if rc != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-25:])
        raise PeerUnavailable(f"{what} failed (exit {rc}); full log: {log_path}\n{tail}")


def source_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """The extracted sdist (downloaded with pip on first use); its llama.cpp is ``vendor/llama.cpp``."""
    src = cache_root() / "src"
    tree = src / f"llama_cpp_python-{version}"
    if (tree / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        return tree
    with _locked(src / ".lock"):
        if (tree / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
            return tree
        sdist = src / f"llama_cpp_python-{version}.tar.gz"
        if not sdist.is_file():
            _log(f"downloading the llama-cpp-python {version} sdist from PyPI ...")
            _run_logged(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-binary",
                    ":all:",
                    "--no-deps",
                    "--disable-pip-version-check",
                    f"llama-cpp-python=={version}",
                    "-d",
                    src,
                ],
                src / "download.log",
                "pip download llama-cpp-python",
                echo=False,
            )
        tmp = src / f".extract-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        with tarfile.open(sdist) as tf:
            tf.extractall(tmp, filter="data")
        shutil.rmtree(tree, ignore_errors=True)
        (tmp / tree.name).rename(tree)
        shutil.rmtree(tmp, ignore_errors=True)
    return tree


def llama_cpp_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    return source_dir(version) / "vendor" / "llama.cpp"


def ensure_built(version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int | None = None) -> Path:
    """The bin directory holding ``llama-server`` and ``llama-quantize``, built on first use (minutes)."""
    cmake, cc, cxx = find_toolchain()
    build = cache_root() / build_key(version, compiler=_compiler_id(cxx))
    stamp = build / "vlmserve-build.json"
    bin_dir = build / "bin"
    if stamp.is_file() and all((bin_dir / t).is_file() for t in TARGETS):
        return bin_dir
    src = llama_cpp_dir(version)
    with _locked(build.parent / f"{build.name}.lock"):
        if stamp.is_file() and all((bin_dir / t).is_file() for t in TARGETS):
            return bin_dir
        build.mkdir(parents=True, exist_ok=True)
        log = build / "build.log"
        jobs = jobs or os.cpu_count() or 2
        env = {**os.environ, "CC": cc, "CXX": cxx}
        _log(
            f"building llama.cpp {LLAMA_CPP_COMMIT} (llama-cpp-python {version}) in {build}; "
            f"~7 min on 2 cores; log: {log}"
        )
        t0 = time.perf_counter()
        _run_logged(
            [cmake, "-S", src, "-B", build, *CMAKE_OPTIONS], log, "cmake configure", env=env, echo=False
        )
        _run_logged(
            [cmake, "--build", build, "-j", str(jobs), "--target", *TARGETS], log, "cmake build", env=env
        )
        missing = [t for t in TARGETS if not (bin_dir / t).is_file()]
        if missing:
            raise PeerUnavailable(f"build finished without {missing} in {bin_dir}; log: {log}")
        elapsed = time.perf_counter() - t0
        stamp.write_text(
            json.dumps(
                {
                    "llama_cpp_python": version,
                    "llama_cpp_commit": LLAMA_CPP_COMMIT,
                    "targets": list(TARGETS),
                    "options": list(CMAKE_OPTIONS),
                    "compiler": _compiler_id(cxx),
                    "build_s": round(elapsed, 1),
                    "jobs": jobs,
                    "cpu_flags": cpu_flags(),
                },
                indent=1,
            )
        )
        _log(f"built in {elapsed:.0f} s: {bin_dir}")
    return bin_dir


# ---------------------------------------------------------------- conversion


# NOTE: a CPU-only torch: the default wheel pulls ~3 GB of CUDA libraries the converter never uses.
TORCH_CANDIDATES = ("torch==2.13.0+cpu", "torch")


def converter_requirements(llama_dir: Path) -> list[str]:
    """The vendored converter's own pins (requirements/requirements-convert_hf_to_gguf.txt and its -r includes),
    without torch (chosen separately: TORCH_CANDIDATES), gguf (its gguf-py is used, matching the build) and
    index options (the PyTorch index is not reachable everywhere)."""
    reqs: list[str] = []

    def read(path: Path) -> None:
        for raw in path.read_text().splitlines():
            line = raw.split("#", 1)[0].strip()
            if not line or line.startswith("--"):
                continue
            if line.startswith("-r"):
                read((path.parent / line[2:].strip()).resolve())
                continue
            name = line.split(";")[0]
            for sep in "=<>~!":
                name = name.split(sep)[0]
            if name.strip().lower() in ("torch", "gguf"):
                continue
            reqs.append(line)

    read(llama_dir / "requirements" / "requirements-convert_hf_to_gguf.txt")
    # gguf-py's own dependencies (it is put on sys.path, not installed)
    return [*reqs, "tqdm>=4.27", "pyyaml>=5.1", "requests>=2.25"]


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_venv(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """The converter's interpreter: a venv of its own under the cache (never the project's venv)."""
    venv = cache_root() / "venv"
    py = _venv_python(venv)
    llama_dir = llama_cpp_dir(version)
    reqs = converter_requirements(llama_dir)
    stamp = venv / "vlmserve-venv.json"
    want = {"requirements": reqs}
    with contextlib.suppress(OSError, ValueError):
        if py.is_file() and json.loads(stamp.read_text()).get("requirements") == reqs:
            return py
    with _locked(cache_root() / "venv.lock"):
        log = cache_root() / "venv.log"
        if not py.is_file():
            _log(f"creating the converter's venv {venv}")
            _run_logged([sys.executable, "-m", "venv", venv], log, "python -m venv", echo=False)
        pip = [py, "-m", "pip", "install", "--disable-pip-version-check", "--quiet"]
        torch_ok = False
        for spec in TORCH_CANDIDATES:
            _log(f"installing {spec} into the converter's venv ...")
            try:
                _run_logged([*pip, spec], log, f"pip install {spec}", echo=False)
            except PeerUnavailable as e:
                _log(f"{spec}: not installable here ({str(e).splitlines()[0]})")
                continue
            torch_ok = True
            break
        if not torch_ok:
            raise PeerUnavailable(f"no torch could be installed into {venv}; log: {log}")
        _log(f"installing the converter's requirements: {' '.join(reqs)}")
        _run_logged([*pip, *reqs], log, "pip install (converter requirements)", echo=False)
        want["torch"] = subprocess.run(
            [py, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True
        ).stdout.strip()
        stamp.write_text(json.dumps(want, indent=1))
    return py


# The vendored converter, run in the converter's venv with two additions. A BPE tokenizer whose pre-tokenizer
# hash it does not know (ours is trained locally, so its token ids differ from every published one) is named
# by its tokenizer.json split regex when that regex is exactly one llama.cpp implements. The name only picks
# llama.cpp's pre-tokenizer regex, so an equal regex is the right name; anything else still fails loudly.
# And a tower shallower than 3 blocks (the tiny presets) gets its projector's name table built for 3: the
# merger's ``mlp.2`` is looked up in the block-indexed table, which only holds indexes below the depth.
_CONVERT_SHIM = r"""
import json, runpy, sys
from pathlib import Path

llama_dir = Path(sys.argv[1])
sys.argv = [str(llama_dir / "convert_hf_to_gguf.py"), *sys.argv[2:]]
sys.path[0:0] = [str(llama_dir), str(llama_dir / "gguf-py")]
from conversion import base

KNOWN_SPLIT_REGEX = %(known)s
_orig = base.TextModel.get_vocab_base_pre

def _split_regexes(pre):
    if not isinstance(pre, dict):
        return []
    if pre.get("type") == "Sequence":
        return [r for p in pre.get("pretokenizers", []) for r in _split_regexes(p)]
    if pre.get("type") == "Split":
        return [pre.get("pattern", {}).get("Regex")]
    return []

def get_vocab_base_pre(self, tokenizer):
    try:
        return _orig(self, tokenizer)
    except NotImplementedError:
        tok = json.loads((Path(self.dir_model) / "tokenizer.json").read_text())
        regexes = _split_regexes(tok.get("pre_tokenizer"))
        name = KNOWN_SPLIT_REGEX.get(regexes[0]) if len(regexes) == 1 else None
        if name is None:
            raise
        base.logger.warning("vlmserve: BPE pre-tokenizer hash not in this converter's list; tokenizer.json's "
                            "split regex is exactly %%r's, so tokenizer.ggml.pre = %%r", name, name)
        return name

base.TextModel.get_vocab_base_pre = get_vocab_base_pre

_mmproj_init = base.MmprojModel.__init__

def mmproj_init(self, *args, **kwargs):
    _mmproj_init(self, *args, **kwargs)
    if 0 < self.block_count < 3:
        self.tensor_map = base.gguf.get_tensor_name_map(base.gguf.MODEL_ARCH.MMPROJ, 3)

base.MmprojModel.__init__ = mmproj_init
runpy.run_path(sys.argv[0], run_name="__main__")
"""
# tokenizer.json split regexes of pre-tokenizers llama.cpp implements (src/llama-vocab.cpp quotes each
# "original regex from tokenizer.json"); make-model's tokenizers use qwen2's in every family.
KNOWN_SPLIT_REGEX = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
}

_CKPT_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.json",
    "chat_template.jinja",
    "generation_config.json",
    "preprocessor_config.json",
    "model.safetensors.index.json",
)


def checkpoint_key(hf_dir: Path, version: str = LLAMA_CPP_PYTHON_VERSION) -> str:
    """A conversion's cache key: the small files' bytes, and each weight file's name, size, mtime and header
    (the first 64 KiB: the safetensors header names every tensor, its dtype, shape and offsets)."""
    hf_dir = Path(hf_dir)
    h = hashlib.sha256(f"llama-cpp-python {version}\n".encode())
    for name in _CKPT_FILES:
        p = hf_dir / name
        if p.is_file():
            h.update(f"{name}\n".encode())
            h.update(p.read_bytes())
    weights = sorted(hf_dir.glob("*.safetensors"))
    if not weights:
        raise FileNotFoundError(f"no *.safetensors in {hf_dir}")
    for p in weights:
        st = p.stat()
        h.update(f"{p.name} {st.st_size} {st.st_mtime_ns}\n".encode())
        with open(p, "rb") as f:
            h.update(f.read(65536))
    return h.hexdigest()[:16]


def _convert_one(py: Path, llama_dir: Path, hf_dir: Path, out: Path, outtype: str, mmproj: bool) -> None:
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    argv = [
        py,
        "-c",
        _CONVERT_SHIM % {"known": repr(KNOWN_SPLIT_REGEX)},
        llama_dir,
        hf_dir,
        "--outtype",
        outtype,
        "--outfile",
        tmp,
    ]
    if mmproj:
        argv.append("--mmproj")
    log = out.parent / "convert.log"
    try:
        # NOTE: the converter's own torch/transformers, not the project's: a clean environment for it.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        env["HF_HUB_OFFLINE"] = "1"
        _run_logged(
            argv, log, f"convert_hf_to_gguf{' --mmproj' if mmproj else ''} ({hf_dir})", env=env, echo=False
        )
        tmp.rename(out)
    finally:
        tmp.unlink(missing_ok=True)


def convert(
    hf_dir: str | Path,
    out_dir: str | Path | None = None,
    outtype: str = "bf16",
    mmproj_outtype: str | None = None,
    version: str = LLAMA_CPP_PYTHON_VERSION,
) -> tuple[Path, Path | None]:
    """(model GGUF, vision projector GGUF or None) for a Hugging Face checkpoint directory, converted once.

    ``out_dir`` defaults to ``<cache>/gguf/<checkpoint_key>``; a checkpoint rewritten in place (new mtimes or
    header) gets a new key. The projector is ``mmproj_outtype`` (default: ``outtype``)."""
    hf_dir = Path(hf_dir).resolve()
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir / 'config.json'} not found (a Hugging Face checkpoint directory?)")
    out = Path(out_dir) if out_dir else cache_root() / "gguf" / checkpoint_key(hf_dir, version)
    mmproj_outtype = mmproj_outtype or outtype
    model = out / f"model-{outtype}.gguf"
    proj = out / f"mmproj-{mmproj_outtype}.gguf"
    has_vision = "vision_config" in json.loads((hf_dir / "config.json").read_text())
    if model.is_file() and (proj.is_file() or not has_vision):
        return model, proj if has_vision else None
    py = ensure_venv(version)
    llama_dir = llama_cpp_dir(version)
    out.mkdir(parents=True, exist_ok=True)
    with _locked(out / ".lock"):
        (out / "source.txt").write_text(f"{hf_dir}\n")
        if not model.is_file():
            _log(f"converting {hf_dir} -> {model}")
            t0 = time.perf_counter()
            _convert_one(py, llama_dir, hf_dir, model, outtype, mmproj=False)
            _log(f"converted in {time.perf_counter() - t0:.1f} s ({model.stat().st_size / 2**20:.1f} MiB)")
        if has_vision and not proj.is_file():
            _log(f"converting the vision tower and merger -> {proj}")
            _convert_one(py, llama_dir, hf_dir, proj, mmproj_outtype, mmproj=True)
    return model, proj if has_vision else None


def quantize(gguf: str | Path, kind: str, bin_dir: Path | None = None, threads: int | None = None) -> Path:
    """``llama-quantize`` of a (bf16) GGUF to ``kind`` (Q8_0, Q4_K_M), next to it, once."""
    if kind not in QUANT_KINDS:
        raise ValueError(f"quantize: kind {kind!r} not in {QUANT_KINDS}")
    gguf = Path(gguf)
    stem = gguf.stem.rsplit("-", 1)[0] if "-" in gguf.stem else gguf.stem
    out = gguf.with_name(f"{stem}-{kind}.gguf")
    if out.is_file():
        return out
    bin_dir = bin_dir or ensure_built()
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    _log(f"quantizing {gguf.name} -> {out.name}")
    t0 = time.perf_counter()
    try:
        _run_logged(
            [bin_dir / "llama-quantize", gguf, tmp, kind, str(threads or os.cpu_count() or 2)],
            gguf.parent / "quantize.log",
            f"llama-quantize {kind}",
            echo=False,
        )
        tmp.rename(out)
    finally:
        tmp.unlink(missing_ok=True)
    _log(f"quantized in {time.perf_counter() - t0:.1f} s ({out.stat().st_size / 2**20:.1f} MiB)")
    return out


# ---------------------------------------------------------------- server


def server_argv(
    bin_dir: Path,
    model: Path,
    mmproj: Path | None,
    port: int,
    *,
    ctx: int = 4096,
    slots: int = 1,
    threads: int | None = None,
    image_min_tokens: int | None = None,
    image_max_tokens: int | None = None,
    no_webui: bool = True,
    extra: Sequence[str] = (),
) -> list[str]:
    """``llama-server`` on loopback. ``ctx`` is the whole KV cache (llama.cpp splits it over the ``slots``);
    without ``image_*_tokens`` llama.cpp sizes Qwen-VL images to 8..4096 visual tokens, not by the checkpoint's
    preprocessor_config (pass vlmserve's budget to compare like with like)."""
    threads = threads or os.cpu_count() or 2
    argv = [str(Path(bin_dir) / "llama-server"), "-m", str(model)]
    if mmproj is not None:
        argv += ["--mmproj", str(mmproj)]
    argv += [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-c",
        str(ctx),
        "-np",
        str(slots),
        "-t",
        str(threads),
        "-tb",
        str(threads),
    ]
    if image_min_tokens is not None:
        argv += ["--image-min-tokens", str(image_min_tokens)]
    if image_max_tokens is not None:
        argv += ["--image-max-tokens", str(image_max_tokens)]
    if no_webui:
        argv.append("--no-webui")
    return argv + list(extra)


def _has_flag(bin_dir: Path, flag: str) -> bool:
    try:
        out = subprocess.run(
            [str(Path(bin_dir) / "llama-server"), "--help"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return flag in (out.stdout + out.stderr)


def proc_memory(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile (a mapped GGUF counts here), RssShmem of a process, in bytes."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0]) * 1024
    return out


class LlamaServer:
    """``llama-server`` in its own process group, ready when ``/health`` answers 200, always stopped on exit.

    ``startup_s``: from spawn to the first 200 of ``/health`` (polled every 50 ms); ``base_url`` +
    ``/v1/chat/completions`` is OpenAI's API; ``memory()``/``rss_bytes()`` read /proc on demand; the log
    goes to ``log_path`` (default: next to the model)."""

    def __init__(
        self,
        model: str | Path,
        mmproj: str | Path | None = None,
        *,
        ctx: int = 4096,
        slots: int = 1,
        threads: int | None = None,
        port: int | None = None,
        log_path: str | Path | None = None,
        image_min_tokens: int | None = None,
        image_max_tokens: int | None = None,
        extra: Sequence[str] = (),
        bin_dir: Path | None = None,
        ready_timeout_s: float = 300.0,
    ) -> None:
        from benchmarks import harness  # NOTE: late: only the server part needs it (and httpx)

        bin_dir = bin_dir or ensure_built()
        self.model, self.mmproj = Path(model), Path(mmproj) if mmproj else None
        port = port or harness.free_port()
        self.argv = server_argv(
            bin_dir,
            self.model,
            self.mmproj,
            port,
            ctx=ctx,
            slots=slots,
            threads=threads,
            image_min_tokens=image_min_tokens,
            image_max_tokens=image_max_tokens,
            no_webui=_has_flag(bin_dir, "--no-webui"),
            extra=extra,
        )
        log_path = Path(log_path) if log_path else self.model.with_name(f"llama-server-{self.model.stem}.log")
        self._proc = harness.ServerProcess("llama-server", self.argv, port, log_path)
        self.ready_timeout_s = ready_timeout_s
        self.startup_s: float | None = None

    @property
    def base_url(self) -> str:
        return self._proc.base_url

    @property
    def log_path(self) -> Path:
        return self._proc.log_path

    @property
    def pid(self) -> int:
        if self._proc.proc is None:
            raise RuntimeError("llama-server is not running")
        return self._proc.proc.pid

    def start(self) -> LlamaServer:
        _log(f"starting: {' '.join(self.argv)}")
        try:
            self._proc.start(timeout_s=self.ready_timeout_s, poll_s=0.05)
        except RuntimeError as exc:  # it exited, or was not healthy in time
            self.stop()
            raise PeerUnavailable(f"llama-server: {exc}") from None
        except BaseException:
            self.stop()
            raise
        self.startup_s = self._proc.startup_s
        _log(f"ready after {self.startup_s:.2f} s on {self.base_url} (pid {self.pid})")
        return self

    def memory(self) -> dict[str, int]:
        return proc_memory(self.pid)

    def rss_bytes(self) -> int:
        return self.memory()["VmRSS"]

    def stop(self) -> None:
        self._proc.stop()

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---------------------------------------------------------------- smoke check


def _png_data_url(size: int = 224) -> str:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), (240, 240, 230))
    draw = ImageDraw.Draw(img)
    draw.ellipse((size // 8, size // 8, size // 2, size // 2), fill=(200, 30, 30))
    draw.rectangle((size // 2, size // 2, size - size // 8, size - size // 8), fill=(30, 60, 200))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def smoke(server: LlamaServer, max_tokens: int = 16) -> list[dict]:
    """One text and one image chat request through the ``openai`` client; their replies and timings."""
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=300)
    requests = [
        ("text", [{"role": "user", "content": "Say something about the sea."}]),
        (
            "image",
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": _png_data_url()}},
                        {"type": "text", "text": "What is in this picture?"},
                    ],
                }
            ],
        ),
    ]
    results = []
    for kind, messages in requests:
        t0 = time.perf_counter()
        resp = client.chat.completions.create(
            model="llama", messages=messages, max_tokens=max_tokens, temperature=0.0
        )
        elapsed = time.perf_counter() - t0
        results.append(
            {
                "kind": kind,
                "seconds": round(elapsed, 3),
                "reply": resp.choices[0].message.content,
                "finish_reason": resp.choices[0].finish_reason,
                "prompt_tokens": resp.usage.prompt_tokens if resp.usage else None,
                "completion_tokens": resp.usage.completion_tokens if resp.usage else None,
            }
        )
    return results


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf", required=True, type=Path, help="Hugging Face checkpoint directory")
    ap.add_argument("--outtype", default="bf16", choices=["bf16", "f16", "f32"])
    ap.add_argument("--quantize", choices=QUANT_KINDS, help="serve this llama-quantize type of the GGUF")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--slots", type=int, default=1)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--no-image", action="store_true", help="serve without the vision projector")
    args = ap.parse_args(argv)
    try:
        t0 = time.perf_counter()
        bin_dir = ensure_built()
        t_build = time.perf_counter() - t0
        t0 = time.perf_counter()
        model, mmproj = convert(args.hf, outtype=args.outtype)
        if args.quantize:
            model = quantize(model, args.quantize, bin_dir)
        t_convert = time.perf_counter() - t0
    except PeerUnavailable as e:
        print(f"llama.cpp unavailable: {e}", file=sys.stderr)
        return 2
    if args.no_image:
        mmproj = None
    print(
        f"llama.cpp {LLAMA_CPP_COMMIT} (llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}): {bin_dir} "
        f"(ensure_built {t_build:.1f} s)"
    )
    print(
        f"model {model} ({model.stat().st_size / 2**20:.1f} MiB), mmproj {mmproj} (convert/quantize {t_convert:.1f} s)"
    )
    with LlamaServer(
        model, mmproj, ctx=args.ctx, slots=args.slots, threads=args.threads, bin_dir=bin_dir
    ) as srv:
        print(f"ready in {srv.startup_s:.2f} s; RSS {srv.rss_bytes() / 2**20:.1f} MiB; log {srv.log_path}")
        kinds = ["text"] if mmproj is None else ["text", "image"]
        for r in smoke(srv, args.max_tokens):
            if r["kind"] in kinds:
                print(json.dumps(r, ensure_ascii=False))
        mem = srv.memory()
        print("memory after: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in mem.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
