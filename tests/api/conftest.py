"""API-test fixtures: one real server process per session (behind the test net guard), a local image
server and a canary listener on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import openai
import pytest

from tests.support import REPO, QuietHandler, free_port, make_clip, make_image, parse_metrics, wait_idle

NETGUARD = Path(__file__).resolve().parent / "netguard"

# Names the server process may resolve (the guard answers them; nothing reaches DNS).
TEST_HOSTS = {
    "images.test": "127.0.0.1",  # the image server, allowed by --allowed-media-domains
    "rebind.test": "127.0.0.1",  # loopback behind a name: must be refused
    "evil.test": "10.0.0.1",  # private behind a name: must be refused
    "meta.test": "169.254.169.254",  # cloud metadata behind a name
}
MAX_MEDIA_BYTES = 300_000
MEDIA_TIMEOUT_S = 1.5
MAX_MODEL_LEN = 512
IMAGE_LIMIT = 2

PNG = make_image(160, 120, 21)
JPEG = make_image(224, 224, 22, "JPEG")
CLIP = make_clip(frames=9, width=64, height=48, fps=4, seed=3)  # a moving coloured square, MPEG-4 in MP4


# ---------------------------------------------------------------- local HTTP image server


class ImageServer:
    """Serves test images on 127.0.0.1; counts connections and requests per path. ``/slow.png`` answers only
    once the server closes: no media timeout can be too long for it, on any machine."""

    def __init__(self) -> None:
        self.hits: Counter[str] = Counter()
        self.connections = 0
        self.closing = threading.Event()
        owner = self

        class Handler(QuietHandler):
            def _send(self, status: int, body: bytes, ctype: str = "image/png", headers=()) -> None:
                self.send_body(status, body, ctype, headers)

            def do_GET(self) -> None:
                parts = urlsplit(self.path)
                owner.hits[parts.path] += 1
                q = parse_qs(parts.query)
                if parts.path == "/img.png":
                    self._send(200, PNG)
                elif parts.path == "/img.jpg":
                    self._send(200, JPEG, "image/jpeg")
                elif parts.path == "/clip.mp4":
                    self._send(200, CLIP, "video/mp4")
                elif parts.path == "/corrupt.png":
                    self._send(200, PNG[:300])
                elif parts.path == "/big.png":
                    self._send(200, b"\x89PNG" + b"\0" * (MAX_MEDIA_BYTES + 10))
                elif parts.path == "/big-chunked.png":
                    # No Content-Length: only the streaming cap can stop it.
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    chunk = b"\0" * 65536
                    try:
                        for _ in range(64):  # 4 MiB at most, far over the cap
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.write(b"0\r\n\r\n")
                    except OSError:
                        pass  # the server hung up at its cap, as it should
                elif parts.path == "/redirect":
                    self._send(302, b"", "text/plain", [("Location", q["to"][0])])
                elif parts.path == "/loop":
                    self._send(307, b"", "text/plain", [("Location", "/loop")])
                elif parts.path == "/slow.png":
                    owner.closing.wait()
                    with contextlib.suppress(OSError):  # the client gave up long ago
                        self._send(200, PNG)
                else:
                    self._send(404, b"not found", "text/plain")

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def get_request(self):
                conn = super().get_request()
                owner.connections += 1
                return conn

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str, host: str = "images.test") -> str:
        return f"http://{host}:{self.port}{path}"

    def close(self) -> None:
        self.closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()


class Canary:
    """A listener on 127.0.0.1 that only counts the connections it accepts (it must see none)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


# ---------------------------------------------------------------- the server process


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    base_url: str
    log_path: Path
    guard_log: Path
    guard_report: Path
    images: ImageServer
    canary: Canary
    media_dir: Path
    http: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.http = httpx.Client(base_url=self.base_url, timeout=60)

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, **kw)

    def post_chat(self, body: dict | bytes | str) -> httpx.Response:
        if isinstance(body, dict):
            return self.http.post("/v1/chat/completions", json=body)
        return self.http.post(
            "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
        )

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self.http.get("/metrics").text)

    def guard_events(self) -> list[dict]:
        if not self.guard_log.exists():
            return []
        return [json.loads(line) for line in self.guard_log.read_text().splitlines() if line]

    def wait_idle(self, timeout: float = 5.0) -> dict[str, float]:
        """Metrics once no request runs or waits and every KV block is free (or the last look on timeout)."""
        return wait_idle(self.metrics, timeout)

    def stop(self, timeout_s: float = 30) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.http.close()

    def assert_alive(self) -> None:
        assert self.proc.poll() is None, f"server exited: {self.log_path.read_text()[-3000:]}"
        assert self.http.get("/health").status_code == 200


def start_server(tmp: Path, ckpt: Path, images: ImageServer, canary: Canary, *extra: str) -> ServerProcess:
    port = free_port()
    media_dir = tmp / "media"
    media_dir.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.update(
        PYTHONPATH=os.pathsep.join([str(NETGUARD), str(REPO)]),
        VLMSERVE_TEST_HOSTS=json.dumps(TEST_HOSTS),
        VLMSERVE_NETGUARD_LOG=str(tmp / "netguard.log"),
        VLMSERVE_NETGUARD_REPORT=str(tmp / "netguard.json"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    cmd = [
        sys.executable, "-m", "api.cli", "serve",
        "--model", str(ckpt),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--served-model-name", "tiny",
        "--num-kv-blocks", "256",
        "--max-num-seqs", "32",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-batched-tokens", "512",
        "--limit-mm-per-prompt", f"image={IMAGE_LIMIT}",
        "--max-media-bytes", str(MAX_MEDIA_BYTES),
        "--media-fetch-timeout", str(MEDIA_TIMEOUT_S),
        "--allowed-media-domains", "images.test",
        "--allowed-local-media-path", str(media_dir),
        "--visual-budget", "fixed",  # every image at full resolution, as transformers sees it
        "--uvicorn-log-level", "warning",
        *extra,
    ]  # fmt: skip
    log_path = tmp / "server.log"
    with open(log_path, "w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    server = ServerProcess(
        proc, f"http://127.0.0.1:{port}", log_path, tmp / "netguard.log", tmp / "netguard.json", images, canary,
        media_dir,
    )  # fmt: skip
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text()[-5000:]}")
        try:
            if server.http.get("/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not become healthy:\n{log_path.read_text()[-5000:]}")


@pytest.fixture(scope="session")
def image_server():
    s = ImageServer()
    yield s
    s.close()


@pytest.fixture(scope="session")
def canary():
    c = Canary()
    yield c
    c.close()


@pytest.fixture(scope="session")
def server(tmp_path_factory, tiny_ckpt, image_server, canary):
    s = start_server(tmp_path_factory.mktemp("server"), tiny_ckpt, image_server, canary)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def guarded_server(server):
    """The server, once its net guard proved itself (see netguard/sitecustomize.py)."""
    report = json.loads(server.guard_report.read_text())
    assert report["ok"], report
    return server
