"""The encoder pool's trust boundary: whoever connects to ``vlmserve encoder`` is an engine until it proves
otherwise, and nothing one connection sends can hurt another.

- a key is checked against its bytes: a frame whose image hash does not match its payload (a forged key) is
  refused and nothing is cached under it;
- ``max_pixels`` is clamped to the pool's own maximum; a frame past the preprocessing byte limit is refused
  from its prefix, before its payload is read; connections past ``--max-connections`` are told and closed;
- an engine that never reads holds up no other engine's deliveries (each connection writes on its own
  thread, within a send timeout) and is dropped.

- with ``--auth-token-file`` only engines that prove they hold the secret are served (and engines holding
  one talk only to a pool that proves it too); a non-loopback address without a secret is refused at
  start-up; the default Unix socket lives in a directory only this user may enter.

The pool's pace is set by its test hook (held batches), never by a deadline; timeouts here only bound a hang.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from encoder.tier import auth, wire
from lm_engine import LLM, SamplingParams
from preprocess import preprocess
from tests.encoder.test_tier_pool import encode_here
from tests.encoder.tier_support import RawEngine, start_pool
from tests.support import REPO, image_part, make_image, user

pytestmark = pytest.mark.timeout(1200)  # NOTE: a pool process starts here; minutes on a crowded machine

MAX_CONNECTIONS = 4
SEND_TIMEOUT_S = 3
HANG_GUARD_S = 60.0  # a bound against hanging, not a pace


TOKEN = b"a test secret, 32 bytes or more.."


@pytest.fixture(scope="module")
def runtime_dir(tmp_path_factory) -> Path:
    """$XDG_RUNTIME_DIR for the pools here: their default socket goes in it."""
    return tmp_path_factory.mktemp("run")


@pytest.fixture(scope="module")
def pool(tmp_path_factory, tiny_ckpt, runtime_dir):
    p = start_pool(
        tmp_path_factory.mktemp("pool"),
        tiny_ckpt,
        *("--workers", "1", "--max-connections", str(MAX_CONNECTIONS)),
        *("--send-timeout-s", str(SEND_TIMEOUT_S)),
        socket_path=False,  # the default: a private directory
        env={"XDG_RUNTIME_DIR": str(runtime_dir)},
    )
    yield p
    p.stop()


@pytest.fixture(scope="module")
def secured(tmp_path_factory, tiny_ckpt, runtime_dir):
    """A pool that serves only engines proving they hold ``TOKEN``."""
    p = start_pool(
        tmp_path_factory.mktemp("secured"),
        tiny_ckpt,
        *("--workers", "1"),
        token=TOKEN,
        socket_path=False,
        env={"XDG_RUNTIME_DIR": str(runtime_dir)},
    )
    yield p
    p.stop()


def token_file(tmp_path: Path, token: bytes = TOKEN, mode: int = 0o600) -> Path:
    path = tmp_path / "token"
    path.write_bytes(token + b"\n")
    path.chmod(mode)
    return path


@pytest.fixture(scope="module")
def inproc(tiny_ckpt):
    with LLM(str(tiny_ckpt), num_kv_blocks=32, embedding_cache_bytes=0) as llm:
        yield llm


def served(pool, **kw) -> RawEngine:
    """A connection the pool serves (retried while the pool still counts connections just closed)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        eng = RawEngine(pool.socket_path, **kw)
        if eng.hello.get("op") == "hello":
            eng.sock.settimeout(HANG_GUARD_S)
            return eng
        eng.close()
        assert time.monotonic() < deadline, f"the pool kept refusing: {eng.hello}"
        time.sleep(0.05)


def test_a_forged_key_is_refused_and_nothing_is_cached_under_it(pool, inproc):
    cfg = inproc.engine.preprocess_config
    victim, attacker = make_image(320, 240, 401, "JPEG"), make_image(320, 240, 402, "JPEG")
    before = pool.stats()
    with served(pool) as eng:
        key = eng.key(victim, cfg)
        assert key.grid == eng.key(attacker, cfg).grid  # the forged frame is consistent but for the hash
        eng.encode(1, key, attacker)  # the victim's key, the attacker's picture
        rid, emb, header = eng.result({1: key})
        assert rid == 1 and emb is None and header["kind"] == "key", header
        eng.encode(2, key, victim)  # the victim's own request: encoded now, not served from a poisoned cache
        rid, emb, header = eng.result({2: key})
    assert rid == 2 and "error" not in header, header
    torch.testing.assert_close(emb, encode_here(inproc, victim), rtol=1e-5, atol=1e-5)
    after = pool.stats()
    assert after["refused_keys"] - before["refused_keys"] == 1
    assert after["images_encoded"] - before["images_encoded"] == 1
    assert after["cache_hits"] == before["cache_hits"]


def test_max_pixels_above_the_pools_maximum_is_clamped(pool, inproc):
    cfg = inproc.engine.preprocess_config
    data = make_image(1200, 900, 403, "JPEG")  # above the checkpoint's max_pixels
    assert cfg.max_pixels < 1200 * 900
    before = pool.stats()
    with served(pool) as eng:
        key = eng.key(data, cfg)  # the grid at the pool's maximum
        assert tuple(preprocess(data, cfg, 16 * cfg.max_pixels).grid_thw) != key.grid
        wire.send(
            eng.sock,
            {"op": "encode", "id": 1, "key": wire.key_to_json(key), "max_pixels": 16 * cfg.max_pixels},
            data,
        )
        rid, emb, header = eng.result({1: key})
    assert rid == 1 and "error" not in header, header
    t, h, w = key.grid
    assert emb.shape[0] == t * h * w // cfg.merge_size**2
    torch.testing.assert_close(emb, encode_here(inproc, data), rtol=1e-5, atol=1e-5)
    assert pool.stats()["clamped"] - before["clamped"] == 1


@pytest.mark.parametrize("declared", ["1 GiB", "limit + 1"])
def test_an_oversize_frame_is_refused_from_its_prefix(declared, pool, inproc):
    size = 1 << 30 if declared == "1 GiB" else inproc.engine.preprocess_config.max_bytes + 1
    with served(pool) as eng:
        head = b'{"op":"encode","id":1}'
        eng.sock.sendall(struct.pack("<4sIQ", wire.MAGIC, len(head), size) + head)  # and not one payload byte
        header, _, _ = eng.reader.read()  # the refusal, with nothing more sent: no wait for the payload
        assert header["op"] == "error" and header["kind"] == "protocol", header
        with pytest.raises(EOFError):
            eng.reader.read()


def test_connections_past_the_limit_are_told_and_closed(pool):
    pool.wait_for(lambda s: s["connections"] == 1, what="only the stats connection open")
    before = pool.stats()
    engines = [served(pool) for _ in range(MAX_CONNECTIONS)]
    try:
        extra = RawEngine(pool.socket_path)
        with extra:
            assert extra.hello["op"] == "error" and extra.hello["kind"] == "busy", extra.hello
            assert f"at most {MAX_CONNECTIONS}" in extra.hello["error"]
            extra.sock.settimeout(HANG_GUARD_S)
            with pytest.raises(EOFError):
                extra.reader.read()
        engines.pop().close()
        with served(pool) as again:  # a slot freed is a slot served: nothing leaked
            wire.send(again.sock, {"op": "stats"})
            stats, _, _ = again.reader.read()
    finally:
        for eng in engines:
            eng.close()
    assert stats["connections"] == MAX_CONNECTIONS
    assert stats["refused_connections"] - before["refused_connections"] >= 1
    pool.wait_for(lambda s: s["connections"] == 1, what="every connection closed")


def test_an_engine_that_never_reads_does_not_hold_up_another(pool, inproc):
    """Engine A asks for an image and then stops reading (a small receive buffer it never drains, and a flood
    of requests whose answers pile up); engine B waits for the same image. B gets it while A is still stalled,
    and A is dropped after the send timeout."""
    cfg = inproc.engine.preprocess_config
    data = make_image(256, 192, 404, "JPEG")
    before = pool.stats()
    pool.hold()
    stalled = RawEngine(pool.tcp_url, ship="inline", rcvbuf=4096)
    try:
        key = stalled.key(data, cfg)
        stalled.encode(1, key, data)
        pool.wait_for(lambda s: s["waiting"] - before["waiting"] == 1, what="A's wait")
        # Answers A will never take: twice what the kernel can buffer between us (the pool's send buffer at
        # its largest, A's receive buffer), so whoever writes them to A must wait on A.
        reply = len(json.dumps(pool.stats()))
        wmem_max = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
        stalled.sock.settimeout(2.0)
        for _ in range(2 * (wmem_max + 65536) // reply + 1):
            try:
                wire.send(stalled.sock, {"op": "stats", "pad": "x" * 1024})
            except OSError:  # the pool stopped reading A (or dropped it): A is stalled either way
                break
        with served(pool) as other:
            other.encode(7, key, data)
            pool.wait_for(
                lambda s: s["waiting"] - before["waiting"] in (1, 2) and s["joined"] > before["joined"]
            )
            pool.release()
            rid, emb, header = other.result({7: key})  # raises on the guard's timeout if held up
        assert rid == 7 and header["via"] == "shm", header
        torch.testing.assert_close(emb, encode_here(inproc, data), rtol=1e-5, atol=1e-5)
        pool.wait_for(lambda s: s["slow_drops"] - before["slow_drops"] == 1, what="A dropped")
    finally:
        pool.release()
        stalled.close()


# -- who may connect -------------------------------------------------------------------------------------


def test_an_engine_without_the_secret_or_with_a_wrong_one_is_refused(secured, inproc):
    cfg = inproc.engine.preprocess_config
    data = make_image(200, 160, 405, "JPEG")
    before = secured.stats()
    with RawEngine(secured.tcp_url, ship="inline", token=TOKEN) as eng:  # the secret: served
        assert eng.hello["op"] == "hello", eng.hello
        eng.sock.settimeout(HANG_GUARD_S)
        key = eng.key(data, cfg)
        eng.encode(1, key, data)
        rid, emb, header = eng.result({1: key})
    assert rid == 1 and header["via"] == "inline", header
    torch.testing.assert_close(emb, encode_here(inproc, data), rtol=1e-5, atol=1e-5)

    with RawEngine(secured.socket_path) as eng:  # no secret: a challenge it cannot answer
        assert eng.hello["op"] == "challenge", eng.hello
        eng.sock.settimeout(HANG_GUARD_S)
        wire.send(eng.sock, {"op": "stats"})  # asked anyway: refused, and the connection closed
        header, _, _ = eng.reader.read()
        assert header["op"] == "error", header
        with pytest.raises(EOFError):
            eng.reader.read()
    with RawEngine(secured.tcp_url, token=b"not the secret, but long enough") as eng:
        assert eng.hello["op"] == "error" and eng.hello["kind"] == "auth", eng.hello
        eng.sock.settimeout(HANG_GUARD_S)
        with pytest.raises(EOFError):
            eng.reader.read()
    after = secured.stats()
    assert after["requests"] - before["requests"] == 1  # only the engine with the secret was heard
    assert after["auth_failures"] - before["auth_failures"] == 1


def test_a_server_holding_the_secret_is_served_and_one_without_encodes_itself(
    secured, pool, tiny_ckpt, tmp_path
):
    messages = user(image_part(make_image(224, 160, 406)), "?")
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    secret = str(token_file(tmp_path))
    kw = dict(num_kv_blocks=32, embedding_cache_bytes=0)
    with LLM(str(tiny_ckpt), encoder_url=secured.tcp_url, encoder_auth_token_file=secret, **kw) as llm:
        served_answer = llm.chat([messages], greedy)[0].token_ids
        vision = llm.engine.vision
        assert vision.remote.fallbacks == {} and vision.stats.images == 0 and vision.remote.received == 1
        assert vision._ship == "shm"  # the same-host switch to the Unix socket authenticates too
    with LLM(str(tiny_ckpt), encoder_url=secured.tcp_url, **kw) as llm:  # no secret: refused, encodes itself
        assert llm.chat([messages], greedy)[0].token_ids == served_answer
        assert (
            llm.engine.vision.remote.fallbacks == {"unreachable": 1} and llm.engine.vision.stats.images == 1
        )
    # And a server holding a secret does not trust a pool that cannot prove it holds the same one.
    with LLM(str(tiny_ckpt), encoder_url=pool.tcp_url, encoder_auth_token_file=secret, **kw) as llm:
        assert llm.chat([messages], greedy)[0].token_ids == served_answer
        assert (
            llm.engine.vision.remote.fallbacks == {"unreachable": 1} and llm.engine.vision.stats.images == 1
        )


def test_a_token_file_every_user_may_read_or_a_short_secret_is_refused(tmp_path):
    assert auth.read_token(token_file(tmp_path)) == TOKEN
    assert auth.read_token(token_file(tmp_path, mode=0o640)) == TOKEN  # shared with a group: fine
    with pytest.raises(auth.TokenFileError, match="every user"):
        auth.read_token(token_file(tmp_path, mode=0o644))
    with pytest.raises(auth.TokenFileError, match="fewer than 16"):
        auth.read_token(token_file(tmp_path, b"short"))
    with pytest.raises(auth.TokenFileError, match="cannot read"):
        auth.read_token(tmp_path / "missing")


def encoder_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "api.cli", "encoder", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_binding_beyond_loopback_without_a_secret_is_refused_at_start_up(tiny_ckpt):
    assert auth.is_loopback("127.0.0.1") and auth.is_loopback("::1") and auth.is_loopback("localhost")
    assert not auth.is_loopback("0.0.0.0") and not auth.is_loopback("") and not auth.is_loopback("192.0.2.1")
    # NOTE: TEST-NET-1, an address no host has: even a pool that failed to refuse could not listen on it.
    done = encoder_cli("--model", str(tiny_ckpt), "--host", "192.0.2.1", "--port", "0")
    assert done.returncode == 2, done.stderr
    assert "--auth-token-file" in done.stderr and "reachable from other machines" in done.stderr


def test_the_default_socket_directory_is_private(pool, runtime_dir):
    where = Path(pool.socket_path).parent
    assert where == runtime_dir / "vlmserve"
    st = where.stat()
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()


def test_a_socket_directory_open_to_others_or_not_ours_is_refused(tmp_path, tiny_ckpt):
    fresh = auth.private_dir(tmp_path / "fresh")
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o755)
    with pytest.raises(PermissionError, match="open to other users"):
        auth.private_dir(loose)
    (link := tmp_path / "link").symlink_to(fresh)
    with pytest.raises(PermissionError, match="not a directory"):
        auth.private_dir(link)
    if os.geteuid() == 0:  # only root can give a directory away
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 4242, 4242)
        with pytest.raises(PermissionError, match="belongs to uid 4242"):
            auth.private_dir(theirs)
    # At start-up: a clear refusal, before any model loads.
    (tmp_path / "run" / "vlmserve").mkdir(parents=True)
    (tmp_path / "run" / "vlmserve").chmod(0o755)
    done = encoder_cli(
        "--model", str(tiny_ckpt), "--port", "0", env={"XDG_RUNTIME_DIR": str(tmp_path / "run")}
    )
    assert done.returncode == 2 and "open to other users" in done.stderr, done.stderr


def test_nothing_from_a_socket_or_redis_is_unpickled():
    """Frames are JSON and raw bytes, stored embeddings ``cache.codec`` entries, and worker pipes carry bytes
    (``send_bytes``/``recv_bytes``): no module on those paths may reach for an unpickler. A guard on the
    code, since a pickle that slipped in would run whatever a peer sent."""
    import ast

    modules = sorted((REPO / "encoder" / "tier").glob("*.py")) + sorted((REPO / "cache").glob("*.py"))
    found = []
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                found += [
                    f"{path.name}: import {n}"
                    for n in names
                    if n.split(".")[0] in ("pickle", "marshal", "dill")
                ]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                call = ast.unparse(node.func)
                if call in ("torch.load", "np.load", "numpy.load") or (
                    node.func.attr == "recv" and not node.args
                ):
                    found.append(f"{path.name}:{node.lineno}: {call}()")  # Connection.recv() unpickles
    assert found == []
