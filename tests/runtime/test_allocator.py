"""``vlmserve train-demo`` runs under jemalloc where the system has it (``runtime.memory.jemalloc_relaunch``):
glibc's malloc took 10-14 % of a training step's CPU time. The relaunch happens once, keeps the user's own
``LD_PRELOAD`` and ``MALLOC_CONF``, and ``VLMSERVE_ALLOCATOR=system`` turns it off."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from runtime import memory
from tests.support import REPO


def test_relaunch_preloads_jemalloc_once(tmp_path):
    lib = tmp_path / "libjemalloc.so.2"
    lib.write_bytes(b"")
    paths = (str(tmp_path / "missing.so"), str(lib))
    argv = ["python", "-m", "api.cli", "train-demo", "--out", "x"]

    got = memory.jemalloc_relaunch(argv, {"PATH": "/bin"}, paths)
    assert got is not None
    new_argv, env = got
    assert new_argv == argv
    assert env["LD_PRELOAD"] == str(lib) and env["MALLOC_CONF"] == memory.JEMALLOC_CONF
    assert env["PATH"] == "/bin"
    assert memory.jemalloc_relaunch(argv, env, paths) is None  # the relaunched process runs on

    _, env = memory.jemalloc_relaunch(argv, {"LD_PRELOAD": "/opt/mine.so", "MALLOC_CONF": "narenas:1"}, paths)
    assert env["LD_PRELOAD"] == f"{lib}:/opt/mine.so" and env["MALLOC_CONF"] == "narenas:1"

    assert memory.jemalloc_relaunch(argv, {"VLMSERVE_ALLOCATOR": "system"}, paths) is None
    assert memory.jemalloc_relaunch(argv, {}, (str(tmp_path / "missing.so"),)) is None


def test_train_demo_command_runs_under_jemalloc_where_installed(tmp_path):
    """The real command line, in a fresh process: the trainer's first line names the allocator it got, and
    the run still writes its checkpoint. bin/setup installs jemalloc (Debian's libjemalloc2). The run records
    oneDNN's per-shape caches capped (uncapped, a default run grew to 24 GB: every batch is another shape)."""
    out = tmp_path / "ckpt"
    unset = ("LD_PRELOAD", "MALLOC_CONF", "VLMSERVE_ALLOCATOR", *memory._CACHE_VARIABLES)
    env = {k: v for k, v in os.environ.items() if k not in unset}
    cmd = [sys.executable, "-m", "api.cli", "train-demo", "--out", str(out), "--tower-steps", "0"]
    cmd += ["--steps", "1", "--batch-images", "2", "--eval-every", "0"]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lib = memory.installed_jemalloc()
    assert lib is not None, "jemalloc is missing: bin/setup installs Debian's libjemalloc2"
    assert f"restarting with {lib}" in run.stderr
    assert "jemalloc's malloc" in run.stderr, run.stderr[-2000:]
    assert (out / "model.safetensors").is_file() and (out / "demo_training.json").is_file()
    meta = json.loads((out / "demo_training.json").read_text())
    assert meta["native_caches"] == {
        name: str(memory.NATIVE_CACHE_ENTRIES) for name in memory._CACHE_VARIABLES
    }
    assert 0 < meta["peak_rss_gb"] < 8


def test_release_free_pages_hands_jemallocs_kept_pages_back():
    """Under jemalloc keeping every freed page (train-demo's relaunch), 400 MB allocated and freed stay resident
    until ``release_free_pages``, which returns them; under glibc it reports that it did nothing."""
    lib = memory.installed_jemalloc()
    assert lib is not None, "jemalloc is missing: bin/setup installs Debian's libjemalloc2"
    script = (
        "import torch\n"
        "from runtime import memory\n"
        "x = [torch.ones(1 << 20) for _ in range(100)]\n"  # 100 × 4 MB, touched
        "del x\n"
        "kept = memory.rss_bytes()\n"
        "ok = memory.release_free_pages()\n"
        "print(memory.allocator_in_use(), ok, kept, memory.rss_bytes())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF")}
    jem = {**env, "LD_PRELOAD": lib, "MALLOC_CONF": memory.JEMALLOC_CONF}
    for environ, allocator in ((jem, "jemalloc"), (env, "glibc")):
        run = subprocess.run(
            [sys.executable, "-c", script], cwd=REPO, env=environ, capture_output=True, text=True, timeout=120
        )
        assert run.returncode == 0, run.stderr[-2000:]
        name, ok, kept, after = run.stdout.split()
        assert name == allocator and ok == str(allocator == "jemalloc")
        if allocator == "jemalloc":
            assert int(kept) - int(after) > 300e6, (kept, after)
