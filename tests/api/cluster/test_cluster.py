"""`vlmserve cluster --replicas 2 --encoder-workers 1` on the tiny checkpoint, end to end: outputs, routing by
image with prefix hits, text balance, the shared encoder pool, and a replica killed mid-run. The balancer's own state (admin socket, request log) is
the record of where each request went."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from api.cluster.haproxy import AdminSocket
from tests.api.cluster.conftest import REDIS_PREFIX, balancer_log_line
from tests.support import REPO, data_url, free_port, make_image, parse_metrics, wait_idle

SERVE_ARGS = [
    "--num-kv-blocks", "256",
    "--max-num-seqs", "16",
    "--max-model-len", "512",
    "--max-num-batched-tokens", "512",
    "--visual-budget", "fixed",
    "--preprocess-workers", "0",
    "--uvicorn-log-level", "warning",
]  # fmt: skip
IMAGES = [make_image(160, 120, 40 + i) for i in range(6)]


@dataclass
class RunningCluster:
    proc: subprocess.Popen
    run_dir: Path
    url: str
    http: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.http = httpx.Client(base_url=self.url, timeout=120)

    @property
    def state(self) -> dict:
        return json.loads((self.run_dir / "cluster.json").read_text())

    @property
    def admin(self) -> AdminSocket:
        return AdminSocket(self.state["admin_socket"])

    def replica(self, name: str) -> dict:
        return next(r for r in self.state["replicas"] if r["name"] == name)

    def chat(self, body: dict, **headers: str) -> httpx.Response:
        return self.http.post("/v1/chat/completions", json=body, headers=headers)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def all_up(self) -> bool:
        states = self.admin.servers()
        return len(states) == 2 and all(s.up for s in states.values())

    def session_for(self, name: str) -> str:
        for i in range(200):
            resp = self.chat(text("?", max_tokens=1), **{"x-session-id": f"s{i}"})
            if resp.headers["x-vlmserve-replica"] == name:
                return f"s{i}"
        raise AssertionError(f"no session id maps to {name}")


def start_cluster(
    tmp: Path, ckpt: Path, redis_url: str, replicas: int, encoder_workers: int = 0
) -> RunningCluster:
    port = free_port()
    base = free_port()
    cmd = [
        sys.executable, "-m", "api.cli", "cluster", "--encoder-workers", str(encoder_workers),
        "--replicas", str(replicas), "--model", str(ckpt), "--served-model-name", "tiny",
        "--port", str(port), "--replica-base-port", str(base), "--run-dir", str(tmp),
        "--redis-url", redis_url, "--drain-timeout", "60",
        "--", *SERVE_ARGS, "--redis-key-prefix", REDIS_PREFIX,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    with open(tmp / "launcher.log", "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    cluster = RunningCluster(proc, tmp, f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 300
    while not ((tmp / "cluster.json").exists() and cluster.state["ready"]):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"cluster did not start:\n{(tmp / 'launcher.log').read_text()[-5000:]}")
        time.sleep(0.2)
    return cluster


def stop_cluster(cluster: RunningCluster) -> int:
    cluster.proc.send_signal(signal.SIGTERM)
    try:
        return cluster.proc.wait(120)
    finally:
        if cluster.proc.poll() is None:
            cluster.proc.kill()
        cluster.http.close()


@pytest.fixture(scope="module")
def cluster(haproxy_bin, redis_url, tiny_ckpt, tmp_path_factory):
    """Two replicas sharing one encoder pool (--encoder-workers 1), as a one-host deployment runs them; the
    pool stops with the cluster. NOTE: one cluster for the module: each start costs ~25 s of CPU."""
    c = start_cluster(tmp_path_factory.mktemp("cluster"), tiny_ckpt, redis_url, replicas=2, encoder_workers=1)
    pool = c.state["encoder"]
    yield c
    assert stop_cluster(c) == 0, (c.run_dir / "launcher.log").read_text()[-3000:]
    deadline = (
        time.monotonic() + 60
    )  # the pool stops with the cluster (and is reaped once its parent is gone)
    while Path(f"/proc/{pool['pid']}").exists() and "Z" not in _proc_state(pool["pid"]):
        assert time.monotonic() < deadline, "the encoder pool outlived its cluster"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def single_server(tiny_ckpt, tmp_path_factory):
    """One plain `vlmserve serve` with the replicas' flags: what the cluster's answers must equal."""
    port = free_port()
    log = tmp_path_factory.mktemp("single") / "server.log"
    cmd = [sys.executable, "-m", "api.cli", "serve", "--model", str(tiny_ckpt), "--served-model-name", "tiny",
           "--port", str(port), *SERVE_ARGS]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    deadline = time.monotonic() + 300
    while True:
        try:
            if http.get("/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(log.read_text()[-3000:])
        time.sleep(0.2)
    yield http
    proc.terminate()
    proc.wait(30)
    http.close()


@pytest.fixture
def healthy(cluster):
    """Every test starts with both replicas in rotation (a killed one is restarted by the launcher)."""
    deadline = time.monotonic() + 300
    while not cluster.all_up():
        assert time.monotonic() < deadline, cluster.admin.servers()
        time.sleep(0.1)
    return cluster


def text(question: str, **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": question}], "max_tokens": 8, **extra}


def ask_image(image: bytes, question: str, **extra) -> dict:
    content = [
        {"type": "image_url", "image_url": {"url": data_url(image)}},
        {"type": "text", "text": question},
    ]
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 8, **extra}


def metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=30).text)


def requests_seen(url: str) -> float:
    return sum(v for k, v in metrics(url).items() if k.startswith("vlmserve_requests_total"))


# ---------------------------------------------------------------- answers and routing


def test_greedy_output_equals_a_single_servers(healthy, single_server):
    bodies = [
        text("Tell me about paged attention."),
        ask_image(IMAGES[0], "What is here?"),
        ask_image(IMAGES[1], "Colors?"),
    ]
    for name in ("r0", "r1"):  # through each replica in turn
        session = healthy.session_for(name)
        for body in bodies:
            body = {**body, "temperature": 0, "max_tokens": 16, "return_token_ids": True}
            got = healthy.chat(body, **{"x-session-id": session})
            want = single_server.post("/v1/chat/completions", json=body)
            assert got.status_code == want.status_code == 200, got.text
            assert got.headers["x-vlmserve-replica"] == name
            g, w = got.json()["choices"][0], want.json()["choices"][0]
            assert (g["token_ids"], g["message"]["content"]) == (w["token_ids"], w["message"]["content"])


def test_questions_about_one_image_meet_on_one_replica_and_hit_its_prefix_cache(healthy):
    client = healthy.client()
    image = make_image(200, 150, 77)
    replicas, cached = [], []
    for i in range(10):
        raw = client.chat.completions.with_raw_response.create(
            model="tiny",
            messages=ask_image(image, f"Question number {i}: what do you see?")["messages"],
            max_tokens=4,
            temperature=0,
            user=f"user-{i}",
        )
        replicas.append(raw.headers["x-vlmserve-replica"])
        assert raw.headers["x-vlmserve-route"] == "image"
        cached.append(raw.parse().usage.prompt_tokens_details.cached_tokens)
    assert len(set(replicas)) == 1, replicas
    # The first question may share the chat template's opening block with earlier requests; the others
    # reuse the image's blocks too.
    assert all(c > cached[0] for c in cached[1:]), cached


def test_text_requests_spread_over_both_replicas(healthy):
    got = Counter(healthy.chat(text(f"Count to {i}.")).headers["x-vlmserve-replica"] for i in range(8))
    assert set(got) == {"r0", "r1"}, got
    # Concurrent ones too: each goes where fewer are in flight.
    with ThreadPoolExecutor(4) as pool:
        resps = list(pool.map(lambda i: healthy.chat(text(f"Say {i}", max_tokens=32)), range(8)))
    assert {r.status_code for r in resps} == {200}
    assert {r.headers["x-vlmserve-replica"] for r in resps} == {"r0", "r1"}


def test_replicas_share_one_encoder_pool(healthy, single_server):
    """One `vlmserve encoder` for both replicas: every new image is encoded there (the replicas' counters of
    pool requests grow by the number of distinct images) and the answers equal one server's."""
    pool = healthy.state["encoder"]
    assert pool["url"].startswith("unix://") and pool["pid"], pool

    def sent() -> float:
        return sum(
            metrics(healthy.replica(n)["url"]).get("vlmserve_encoder_remote_requests_total", 0)
            for n in ("r0", "r1")
        )

    images = [make_image(176, 132, 9000 + i + os.getpid() % 1000) for i in range(6)]  # new to Redis
    sessions = {name: healthy.session_for(name) for name in ("r0", "r1")}
    before, homes = sent(), set()
    for i, image in enumerate(images):
        body = {**ask_image(image, f"Describe {i}."), "temperature": 0, "max_tokens": 8}
        # NOTE: sent half to each replica by session, so both draw on the pool whatever the images hash to
        got = healthy.chat({**body, "return_token_ids": True}, **{"x-session-id": sessions[f"r{i % 2}"]})
        want = single_server.post("/v1/chat/completions", json={**body, "return_token_ids": True})
        assert got.status_code == want.status_code == 200, got.text
        assert got.json()["choices"][0]["token_ids"] == want.json()["choices"][0]["token_ids"]
        homes.add(got.headers["x-vlmserve-replica"])
    assert homes == {"r0", "r1"} and sent() - before == len(images), (homes, sent() - before)


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


# ---------------------------------------------------------------- failures


def test_replica_killed_mid_run(healthy):
    """SIGKILL one replica during 40 requests: only requests it had already taken fail, it leaves rotation
    within 2 s by the balancer's own account, the next 20 all succeed, the survivor leaks nothing, and the
    restarted replica rejoins."""
    victim, survivor = "r1", "r0"
    pid = healthy.replica(victim)["pid"]
    answered_by_victim, killed = threading.Event(), threading.Event()
    down_after: list[float] = []
    killed_at: list[float] = []

    def one(i: int) -> tuple[str, int | None, str | None]:
        if i >= 20:
            killed.wait(300)  # NOTE: so the kill lands mid-run, whatever the machine's speed
        rid = f"kill-{i}-{uuid.uuid4().hex[:6]}"
        body = ask_image(IMAGES[i % len(IMAGES)], f"Q{i}?") if i % 2 else text(f"Question {i}?")
        try:
            resp = healthy.chat({**body, "max_tokens": 24}, **{"x-request-id": rid})
        except httpx.TransportError:
            return rid, None, None
        if resp.status_code == 200 and resp.headers["x-vlmserve-replica"] == victim:
            answered_by_victim.set()
        return rid, resp.status_code, resp.headers.get("x-vlmserve-replica")

    def killer() -> None:
        answered_by_victim.wait(300)
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)
        killed.set()
        while healthy.admin.servers()[victim].up:
            time.sleep(0.01)
        down_after.append(time.monotonic() - killed_at[0])

    k = threading.Thread(target=killer)
    k.start()
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(40)))
    k.join(300)
    failed = [r for r in results if r[1] != 200]
    # Every failure was a request the balancer had already handed to the victim (connection established,
    # then cut by the kill): none that had not reached it, none re-sent.
    for rid, status, _ in failed:
        line = balancer_log_line(healthy.run_dir / "haproxy.log", rid)
        assert line["server"] == victim and line["retries"] == "0" and line["term"][0] == "S", (status, line)
        assert status in (None, 502)
    assert len(failed) <= 4  # at most the requests in flight
    after = [healthy.chat(text(f"After {i}?")) for i in range(20)]
    figure = {
        "sent": 40, "answered": 40 - len(failed), "failed": len(failed),
        "out_of_rotation_s": round(down_after[0], 3), "next_20_ok": sum(r.status_code == 200 for r in after),
    }  # fmt: skip
    print(f"\nkill figure: {json.dumps(figure)}")
    assert down_after[0] < 2.0, figure  # the balancer's own state; checks 500 ms, then 250 ms apart, fall 2
    assert figure["next_20_ok"] == 20
    m = wait_idle(lambda: metrics(healthy.replica(survivor)["url"]), 60, poll_s=0.05)
    assert m["vlmserve_num_requests_running"] == m["vlmserve_num_requests_waiting"] == 0
    assert m["vlmserve_kv_cache_blocks_free"] == m["vlmserve_kv_cache_blocks_total"]
    # The launcher restarts the victim; HAProxy's checks put it back and its keys return to it.
    deadline = time.monotonic() + 300
    while not healthy.admin.servers()[victim].up:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert healthy.replica(victim)["restarts"] >= 1
    assert healthy.chat(text("back?"), **{"x-session-id": healthy.session_for(victim)}).status_code == 200


def test_stream_cut_midway_ends_in_an_error_not_a_hang(healthy):
    victim, other = "r0", "r1"
    session = healthy.session_for(victim)
    before = requests_seen(healthy.replica(other)["url"])
    client = openai.OpenAI(base_url=f"{healthy.url}/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Write a long story."}],
        max_tokens=400,
        extra_body={"ignore_eos": True},
        stream=True,
        extra_headers={"x-session-id": session},
    )
    chunks = iter(stream)
    next(chunks)  # the stream is running on the victim
    pid = healthy.replica(victim)["pid"]
    os.kill(pid, signal.SIGSTOP)  # NOTE: frozen first, so it cannot finish before the kill lands
    os.kill(pid, signal.SIGKILL)
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        for _ in chunks:
            pass
    assert requests_seen(healthy.replica(other)["url"]) == before  # not re-sent to the other replica


def test_sigterm_drains_then_stops_everything(haproxy_bin, redis_url, tiny_ckpt, tmp_path):
    c = start_cluster(tmp_path, tiny_ckpt, redis_url, replicas=1)
    pids = [c.state["haproxy_pid"], *(r["pid"] for r in c.state["replicas"])]
    try:
        with c.http.stream(
            "POST",
            "/v1/chat/completions",
            json={**text("Go on."), "max_tokens": 300, "ignore_eos": True, "stream": True},
        ) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data:")
            c.proc.send_signal(signal.SIGTERM)
            # The listener closes at once; the open stream still runs to its end.
            deadline = time.monotonic() + 60
            while True:
                try:
                    httpx.get(f"{c.url}/health", timeout=2)
                except httpx.TransportError:
                    break
                assert time.monotonic() < deadline
                time.sleep(0.05)
            events = [line for line in lines if line.startswith("data:")]
        assert events[-1] == "data: [DONE]"
        assert c.proc.wait(120) == 0
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if c.proc.poll() is None:
            c.proc.kill()
