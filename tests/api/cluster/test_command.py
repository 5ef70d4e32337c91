"""`vlmserve cluster`'s command line: refusals before anything starts, and the config for another host."""

from __future__ import annotations

import subprocess
import sys

import pytest

from api.cli import main
from api.cluster import command
from api.cluster.haproxy import BalancerConfig
from api.cluster.launcher import Cluster, ClusterSpec
from tests.support import REPO


def vlmserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "api.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def refused(monkeypatch, capsys):
    """``vlmserve cluster`` in this process (no interpreter to start): returns (exit code, stderr); anything
    that got as far as starting the cluster fails the test instead."""
    monkeypatch.setattr(command, "run_cluster", lambda spec: pytest.fail(f"the cluster started: {spec}"))

    def run(*args: str) -> tuple[int, str]:
        try:
            return main(list(args)), capsys.readouterr().err
        except SystemExit as exc:  # argparse has printed its message; a SystemExit("text") carries it
            err = capsys.readouterr().err
            if isinstance(exc.code, int):
                return exc.code, err
            return 1, err + str(exc.code)

    return run


def test_write_config_for_a_balancer_elsewhere_is_valid_haproxy(haproxy_bin, tmp_path):
    out = vlmserve(
        "cluster", "--replica-addr", "10.0.0.11:8001", "--replica-addr", "10.0.0.12:8001",
        "--port", "8000", "--write-config", str(tmp_path),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    cfg = (tmp_path / "haproxy.cfg").read_text()
    assert "server r0 10.0.0.11:8001 id 1" in cfg and "server r1 10.0.0.12:8001 id 2" in cfg
    assert f"lua-load {(tmp_path / 'route.lua').resolve()}" in cfg
    check = subprocess.run(
        [haproxy_bin, "-c", "-f", str(tmp_path / "haproxy.cfg")], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_flags_the_cluster_owns_and_typos_are_refused_before_starting(tmp_path, refused):
    code, err = refused("cluster", "--model", str(tmp_path), "--", "--port", "9")
    assert code != 0 and "--port is set by the cluster" in err
    code, err = refused("cluster", "--model", str(tmp_path), "--", "--max-num-seqz", "9")
    assert code != 0 and "unrecognized arguments: --max-num-seqz" in err
    assert not list(tmp_path.iterdir())  # nothing was started or written


def test_balancer_config_refuses_a_key_that_cannot_fit_the_window():
    cfg = BalancerConfig(
        bind="127.0.0.1:1", replicas=[("r0", "127.0.0.1:2")], admin_socket="/x", key_chars=65536
    )
    with pytest.raises(ValueError, match="bufsize"):
        cfg.render()


@pytest.mark.parametrize("given", [["--hash-algorithm", "xxh3"], ["--hash-algorithm=xxh3"], []])
def test_the_shared_encoder_pool_hashes_as_the_replicas_do(tmp_path, given):
    """Replicas refuse a pool whose keys are of another algorithm; the launcher hands it theirs."""
    serve_args = ["--max-num-seqs", "4", *given]
    cluster = Cluster(
        ClusterSpec(2, str(tmp_path), encoder_workers=1, serve_args=serve_args, run_dir=tmp_path)
    )
    assert cluster.encoder is not None
    pool = cluster.encoder.cmd
    if given:
        assert pool[-len(given) :] == given
    else:  # both keep their one default
        assert not any(arg.startswith("--hash-algorithm") for arg in pool)
    assert all(r.cmd[-len(serve_args) :] == serve_args for r in cluster.replicas)
