"""Servers with the encoder tier: through a separate `vlmserve encoder` (--encoder-url) and with a pool of
their own (--encoder-workers 2), greedy outputs equal the in-process server's request by request; two servers
sharing one pool encode an image they are both sent at once a single time."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.api.conftest import JPEG, PNG, start_server
from tests.api.test_chat import CONVERSATIONS, greedy, image_url_part
from tests.encoder.tier_support import running_pool
from tests.support import data_url, make_image, user

# NOTE: five server processes and two encoder pools start here; on a crowded 2-core machine that alone can
# pass the suite's 300 s default.
pytestmark = pytest.mark.timeout(1200)

SCENARIOS = {name: messages for name, (messages, _) in CONVERSATIONS.items()}
SCENARIOS["large-jpeg"] = user(
    image_url_part(data_url(make_image(640, 480, 31, "JPEG"), "image/jpeg")), "Count."
)
SCENARIOS["png-then-jpeg"] = user(
    image_url_part(data_url(PNG)), "then", image_url_part(data_url(JPEG, "image/jpeg")), "Why?"
)


@pytest.fixture(scope="module")
def pool(tmp_path_factory, tiny_ckpt):
    yield from running_pool(tmp_path_factory, tiny_ckpt, "pool", "--workers", "2")


@pytest.fixture(scope="module")
def tier_servers(tmp_path_factory, tiny_ckpt, image_server, canary, pool):
    """Two servers on the shared pool, and one with a local pool of two workers (started side by side)."""
    extra = {
        "url": ("--encoder-url", pool.tcp_url),
        "url2": ("--encoder-url", pool.tcp_url),
        "workers": ("--encoder-workers", "2"),
    }
    with ThreadPoolExecutor(len(extra)) as ex:
        futures = {
            name: ex.submit(
                start_server, tmp_path_factory.mktemp(name), tiny_ckpt, image_server, canary, *args
            )
            for name, args in extra.items()
        }
    started = {name: f.result() for name, f in futures.items() if f.exception() is None}
    try:
        for f in futures.values():
            f.result()  # raises the first start-up failure
        yield started
    finally:
        for s in started.values():
            s.stop()


@pytest.mark.parametrize("target", ["url", "workers"])
def test_greedy_equals_the_in_process_server(target, tier_servers, guarded_server):
    tier, plain = tier_servers[target].client(), guarded_server.client()
    for name, messages in SCENARIOS.items():
        want = greedy(plain, messages).choices[0].token_ids
        assert greedy(tier, messages).choices[0].token_ids == want, name
    m = tier_servers[target].metrics()
    assert m["vlmserve_encoder_remote_requests_total"] >= 1
    assert m["vlmserve_encoder_remote_shipped_bytes_total"] > 0
    assert sum(v for k, v in m.items() if k.startswith("vlmserve_encoder_remote_fallbacks_total")) == 0
    assert m["vlmserve_encoder_images_total"] == 0  # nothing encoded in the server process


def test_two_servers_sending_one_image_at_once_encode_it_once(tier_servers, pool):
    messages = user(image_url_part(data_url(make_image(512, 384, 32, "JPEG"), "image/jpeg")), "What is it?")
    before = pool.stats()
    answers: dict[str, list[int]] = {}

    def send(name: str) -> None:
        answers[name] = greedy(tier_servers[name].client(), messages).choices[0].token_ids

    pool.hold()
    try:
        threads = [threading.Thread(target=send, args=(name,)) for name in ("url", "url2")]
        for t in threads:
            t.start()
        pool.wait_for(lambda s: s["waiting"] - before["waiting"] == 2, what="both servers waiting")
    finally:
        pool.release()
    for t in threads:
        t.join(120)
    assert answers["url"] == answers["url2"] and len(answers["url"]) > 0
    after = pool.stats()
    assert after["images_encoded"] - before["images_encoded"] == 1
    assert after["joined"] - before["joined"] == 1
    assert after["shipped"]["shm"] - before["shipped"].get("shm", 0) == 2
