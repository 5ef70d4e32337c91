"""`vlmserve cluster`: N `vlmserve serve` replicas on this machine behind HAProxy, supervised.

Start-up: the shared encoder pool if asked for (`vlmserve encoder`, on a Unix socket in the run directory:
the replicas get embeddings from it as shared memory), the replicas (each its own process group, loopback
ports, the shared Redis), then — once every replica answers /health — HAProxy on the public port, so the port
opens only when the cluster can serve.
While running: a replica (or the encoder pool) that exits is restarted (with back-off) on its port, and HAProxy's health checks
take it out of rotation and back in. SIGINT/SIGTERM drains: HAProxy's soft stop closes the listener and
waits for the requests in flight, then the replicas stop, then this process exits. A second signal stops
everything at once. `cluster.json` in the run directory names every process (pids, ports, logs, the
HAProxy admin socket) for operators and tests.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from api.cluster.haproxy import LUA, AdminSocket, BalancerConfig, find_haproxy

log = logging.getLogger("vlmserve.cluster")

RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
HEALTHY_RESET_S = 60.0  # a replica up this long starts its back-off again from the shortest delay
BALANCER_MIN_UPTIME_S = 10.0  # HAProxy dying sooner than this after a start is a fault, not a stall


class ClusterError(RuntimeError):
    pass


@dataclass(slots=True)
class ClusterSpec:
    replicas: int
    model: str
    served_model_names: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    replica_base_port: int | None = None  # default: port + 1, port + 2, ...
    redis_url: str | None = "redis://127.0.0.1:6379/0"
    encoder_workers: int = 0
    serve_args: list[str] = field(default_factory=list)  # extra `vlmserve serve` flags for every replica
    remote: list[str] = field(default_factory=list)  # "host:port" of replicas run elsewhere: none start here
    run_dir: Path | None = None
    restart: bool = True
    startup_timeout_s: float = 900.0
    balancer: BalancerConfig | None = None  # knobs; bind, replicas and admin socket are filled in


def _die_with_parent() -> None:
    # NOTE: children run in their own sessions (a terminal's Ctrl-C must reach only this process, which
    # drains in order), so they would outlive a launcher killed with SIGKILL; the kernel sends them
    # SIGTERM instead (Linux's PR_SET_PDEATHSIG).
    os.setsid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


@dataclass(slots=True)
class Replica:
    name: str
    port: int
    cmd: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0
    restart_at: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        with open(self.log_path, "a") as out:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                self.cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
            )  # fmt: skip
        self.started_at = time.monotonic()
        self.restart_at = None

    def signal_group(self, sig: int) -> None:
        """Signal the replica and its children (preprocess workers), which share its process group."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def log_tail(self, chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""


def _flag_as_given(args: list[str], flag: str) -> list[str]:
    """``flag`` with its value as ``args`` give it (``--flag V`` or ``--flag=V``; the last one wins), or []."""
    found: list[str] = []
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            found = [flag, args[i + 1]]
        elif arg.startswith(flag + "="):
            found = [arg]
    return found


class Cluster:
    def __init__(self, spec: ClusterSpec) -> None:
        if spec.replicas < 1 and not spec.remote:
            raise ClusterError("--replicas must be at least 1")
        self.spec = spec
        self.run_dir = Path(spec.run_dir or tempfile.mkdtemp(prefix="vlmserve-cluster-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        base = spec.replica_base_port or spec.port + 1
        local = 0 if spec.remote else spec.replicas
        self.replicas = [
            Replica(f"r{i}", base + i, [], self.run_dir / f"replica-r{i}.log") for i in range(local)
        ]
        self.encoder, self.encoder_url = (
            self._encoder_pool() if spec.encoder_workers and local else (None, None)
        )
        for r in self.replicas:
            r.cmd = self._serve_cmd(r)
        self.balancer = spec.balancer or BalancerConfig(bind="", replicas=[], admin_socket="")
        self.balancer.bind = f"{spec.host}:{spec.port}"
        self.balancer.replicas = [(r.name, f"127.0.0.1:{r.port}") for r in self.replicas] or [
            (f"r{i}", addr) for i, addr in enumerate(spec.remote)
        ]
        sock = self.run_dir / "haproxy.sock"
        if len(str(sock)) > 100:  # NOTE: a Unix socket path has room for 107 bytes
            sock = Path(tempfile.mkdtemp(prefix="vlmserve-lb-")) / "haproxy.sock"
        self.balancer.admin_socket = str(sock)
        self.admin = AdminSocket(self.balancer.admin_socket)
        self.haproxy: subprocess.Popen | None = None
        self._haproxy_cmd: list[str] = []
        self._haproxy_started = 0.0
        self._stopping = False

    # ------------------------------------------------------------ start-up

    def _encoder_pool(self) -> tuple[Replica, str]:
        """The one `vlmserve encoder` every replica here sends its cache misses to (a process like a replica:
        logged, restarted with back-off, stopped last)."""
        sock = self.run_dir / "encoder.sock"
        if len(str(sock)) > 100:  # NOTE: a Unix socket path has room for 107 bytes
            sock = Path(tempfile.mkdtemp(prefix="vlmserve-enc-")) / "encoder.sock"
        cmd = [sys.executable, "-m", "api.cli", "encoder", "--model", self.spec.model, "--socket", str(sock)]
        # NOTE: no Redis for the pool: the replicas here take embeddings as shared memory, and put them in the
        # shared Redis themselves (under their own key prefix).
        cmd += ["--workers", str(self.spec.encoder_workers)]
        # NOTE: the replicas refuse a pool that keys images with another algorithm than theirs.
        cmd += _flag_as_given(self.spec.serve_args, "--hash-algorithm")
        return Replica("encoder", 0, cmd, self.run_dir / "encoder.log"), f"unix://{sock}"

    def _serve_cmd(self, r: Replica) -> list[str]:
        cmd = [sys.executable, "-m", "api.cli", "serve", "--model", self.spec.model]
        if self.spec.served_model_names:
            cmd += ["--served-model-name", *self.spec.served_model_names]
        cmd += ["--host", "127.0.0.1", "--port", str(r.port), "--replica-name", r.name]
        # NOTE: the balancer replaces any X-Forwarded-For a client sent with the client's real address
        # (haproxy.cfg.in), so the replicas take it from there and from nowhere else.
        cmd += ["--trusted-proxies", "127.0.0.1"]
        if self.spec.redis_url:
            cmd += ["--redis-url", self.spec.redis_url]
        if self.encoder is not None:
            cmd += ["--encoder-url", self.encoder_url]
        if "--preprocess-workers" not in self.spec.serve_args:
            # NOTE: the replicas share this machine's cores; serve's own default assumes it has them all.
            cmd += ["--preprocess-workers", str(max(1, min(4, (os.cpu_count() or 1) // self.spec.replicas)))]
        return cmd + self.spec.serve_args

    def start(self) -> None:
        haproxy = find_haproxy()
        if self.encoder is not None:
            self.encoder.start()
            self._wait_encoder_ready()
        for r in self.replicas:
            r.start()
        self._write_state(ready=False)
        log.info("starting %d replicas (logs in %s)", len(self.replicas), self.run_dir)
        self._wait_replicas_healthy()
        cfg = self.run_dir / "haproxy.cfg"
        cfg.write_text(self.balancer.render())
        check = subprocess.run([haproxy, "-c", "-q", "-f", str(cfg)], capture_output=True, text=True)
        if check.returncode != 0:
            raise ClusterError(f"HAProxy refused {cfg}:\n{check.stdout}{check.stderr}")
        self._haproxy_cmd = [haproxy, "-db", "-f", str(cfg)]
        self._start_haproxy()
        self._wait_balancer_ready()
        self._write_state(ready=True)

    def _start_haproxy(self) -> None:
        with open(self.run_dir / "haproxy.log", "a") as out:
            self.haproxy = subprocess.Popen(
                self._haproxy_cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
            )  # fmt: skip
        self._haproxy_started = time.monotonic()

    def _wait_encoder_ready(self) -> None:
        """Until the pool prints its ready line (its workers have loaded the tower and preprocessing runs)."""
        pool, deadline = self.encoder, time.monotonic() + self.spec.startup_timeout_s
        while "vlmserve encoder ready" not in pool.log_tail(100_000):
            if pool.proc.poll() is not None:
                raise ClusterError(f"the encoder pool exited with {pool.proc.returncode}:\n{pool.log_tail()}")
            if time.monotonic() > deadline:
                raise ClusterError(f"the encoder pool was not ready in time; see {pool.log_path}")
            time.sleep(0.1)

    def _wait_replicas_healthy(self) -> None:
        deadline = time.monotonic() + self.spec.startup_timeout_s
        pending = list(self.replicas)
        with httpx.Client(timeout=2.0) as http:
            while pending:
                for r in list(pending):
                    if r.proc is not None and r.proc.poll() is not None:
                        raise ClusterError(
                            f"replica {r.name} exited with {r.proc.returncode} while starting:\n{r.log_tail()}"
                        )
                    with contextlib.suppress(httpx.HTTPError):
                        if http.get(f"{r.url}/health").status_code == 200:
                            pending.remove(r)
                            log.info("replica %s ready on %s", r.name, r.url)
                if time.monotonic() > deadline:
                    raise ClusterError(f"replicas {[r.name for r in pending]} not healthy in time")
                time.sleep(0.2)

    def _wait_balancer_ready(self) -> None:
        # Local replicas answered /health already; remote ones may still be starting.
        deadline = time.monotonic() + (self.spec.startup_timeout_s if self.spec.remote else 30)
        while True:
            if self.haproxy is not None and self.haproxy.poll() is not None:
                tail = (self.run_dir / "haproxy.log").read_text(errors="replace")[-3000:]
                raise ClusterError(f"HAProxy exited with {self.haproxy.returncode}:\n{tail}")
            with contextlib.suppress(OSError):
                states = self.admin.servers()
                # NOTE: remote replicas come and go on their own; one in rotation is enough to serve.
                if len(states) == len(self.balancer.replicas) and (
                    all(s.up for s in states.values())
                    or (self.spec.remote and any(s.up for s in states.values()))
                ):
                    return
            if time.monotonic() > deadline:
                raise ClusterError("HAProxy did not report every replica up")
            time.sleep(0.1)

    def _write_state(self, *, ready: bool) -> None:
        state = {
            "ready": ready,
            "url": f"http://{self.spec.host}:{self.spec.port}",
            "launcher_pid": os.getpid(),
            "haproxy_pid": self.haproxy.pid if self.haproxy else None,
            "admin_socket": self.balancer.admin_socket,
            "haproxy_log": str(self.run_dir / "haproxy.log"),
            "encoder": None
            if self.encoder is None
            else {
                "url": self.encoder_url,
                "pid": self.encoder.proc and self.encoder.proc.pid,
                "restarts": self.encoder.restarts,
                "log": str(self.encoder.log_path),
            },
            "replicas": [
                {
                    "name": r.name,
                    "url": r.url,
                    "pid": r.proc.pid if r.proc else None,
                    "restarts": r.restarts,
                    "log": str(r.log_path),
                }
                for r in self.replicas
            ],  # fmt: skip
            "spec": {k: v for k, v in asdict(self.spec).items() if k not in ("balancer", "run_dir")},
        }
        tmp = self.run_dir / "cluster.json.tmp"
        tmp.write_text(json.dumps(state, indent=2, default=str))
        tmp.replace(self.run_dir / "cluster.json")

    # ------------------------------------------------------------ running

    def supervise(self, stop: threading.Event) -> None:
        """Restart replicas and the balancer when they exit, until ``stop`` is set."""
        while not stop.wait(0.2):
            now = time.monotonic()
            self._tend_balancer(now)
            for r in self.replicas + ([self.encoder] if self.encoder else []):
                self._tend(r, now)

    def _tend_balancer(self, now: float) -> None:
        # NOTE: HAProxy's watchdog aborts it when a thread stalls for seconds (seen on a machine thrashing
        # out of memory). Requests in flight through it are lost either way; new ones must find a listener.
        if self.haproxy is None or self.haproxy.poll() is None:
            return
        if now - self._haproxy_started < BALANCER_MIN_UPTIME_S:
            raise ClusterError(
                f"HAProxy exited with {self.haproxy.returncode} again at once; see {self.run_dir}"
            )
        log.error("HAProxy exited with %s; restarting it", self.haproxy.returncode)
        self._start_haproxy()
        self._write_state(ready=True)

    def _tend(self, r: Replica, now: float) -> None:
        if r.proc is None or r.proc.poll() is None:
            if r.proc is not None and now - r.started_at > HEALTHY_RESET_S:
                r.restarts = 0
            return
        if r.restart_at is None:
            r.signal_group(signal.SIGKILL)  # its preprocess workers, if any outlived it
            if not self.spec.restart:
                log.warning("replica %s exited with %s (not restarted)", r.name, r.proc.returncode)
                r.restart_at = float("inf")
                return
            delay = RESTART_BACKOFF_S[min(r.restarts, len(RESTART_BACKOFF_S) - 1)]
            log.warning("replica %s exited with %s; restarting in %.0fs", r.name, r.proc.returncode, delay)
            r.restart_at = now + delay
        elif now >= r.restart_at:
            r.restarts += 1
            r.start()
            self._write_state(ready=True)
            log.info(
                "replica %s restarted (pid %d); HAProxy takes it back once /health answers",
                r.name,
                r.proc.pid,
            )

    # ------------------------------------------------------------ shutdown

    def stop(self, drain: bool = True, force: threading.Event | None = None) -> None:
        """Drain (balancer soft stop, then replicas' graceful shutdown) or stop at once; idempotent."""
        if self._stopping:
            return
        self._stopping = True
        force = force or threading.Event()
        if self.haproxy is not None and self.haproxy.poll() is None:
            if drain:
                log.info("draining: the balancer stops accepting and waits for requests in flight")
                self.haproxy.send_signal(signal.SIGUSR1)
                self._wait(self.haproxy, self.balancer.drain_timeout_s + 5, force)
            self._kill(self.haproxy)
        for r in self.replicas:
            if r.proc is not None and r.proc.poll() is None:
                r.proc.send_signal(signal.SIGTERM)
        for r in self.replicas:
            if r.proc is not None:
                self._wait(r.proc, 30, force)
            r.signal_group(signal.SIGKILL)
        if self.encoder is not None and self.encoder.proc is not None:
            self.encoder.signal_group(signal.SIGTERM)
            self._wait(self.encoder.proc, 30, force)
            self.encoder.signal_group(signal.SIGKILL)
        self._write_state(ready=False)
        log.info("cluster stopped")

    @staticmethod
    def _wait(proc: subprocess.Popen, timeout_s: float, force: threading.Event) -> None:
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None and time.monotonic() < deadline and not force.is_set():
            time.sleep(0.05)

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def run_cluster(spec: ClusterSpec) -> int:
    """Start, supervise until SIGINT/SIGTERM, drain, exit. Returns the process exit code."""
    stop, force = threading.Event(), threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():
            log.warning("second %s: stopping without draining", name)
            force.set()
        else:
            log.info("%s received: stopping", name)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health probe
    cluster = Cluster(spec)
    code = 0
    try:
        cluster.start()
        print(
            f"vlmserve cluster: {len(cluster.balancer.replicas)} replicas behind HAProxy on "
            f"http://{spec.host}:{spec.port} "
            f"(state and logs: {cluster.run_dir})",
            flush=True,
        )
        cluster.supervise(stop)
    except ClusterError as exc:
        log.error("%s", exc)
        code = 1
    finally:
        cluster.stop(drain=not force.is_set() and code == 0, force=force)
    return code


def write_balancer_config(directory: Path, balancer: BalancerConfig) -> Path:
    """Write haproxy.cfg and route.lua into ``directory`` (for a balancer on another host); returns the cfg."""
    directory.mkdir(parents=True, exist_ok=True)
    lua = directory / LUA.name
    lua.write_text(LUA.read_text())
    balancer.lua_path = str(lua.resolve())
    cfg = directory / "haproxy.cfg"
    cfg.write_text(balancer.render())
    return cfg
