from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import torch

from cache import EmbeddingCache, EmbeddingKey, MemoryTier, RedisTier, codec

pytestmark = pytest.mark.redis
MakeKey = Callable[..., EmbeddingKey]
MakeTier = Callable[..., RedisTier]
SameBits = Callable[[torch.Tensor, torch.Tensor], bool]


@pytest.mark.parametrize("async_puts", [True, False], ids=["async-put", "sync-put"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_exact(
    make_tier: MakeTier,
    prefix: str,
    make_key: MakeKey,
    random_bits: Callable[..., torch.Tensor],
    same_bits: SameBits,
    dtype: torch.dtype,
    async_puts: bool,
) -> None:
    tier = make_tier(prefix=prefix, async_puts=async_puts)
    value = random_bits((37, 64), dtype, seed=3)  # every bit pattern, NaN payloads included
    tier.put(make_key(1), value)
    assert tier.flush()
    got = tier.get(make_key(1))
    assert got is not None and same_bits(got, value)
    assert tier.get(make_key(2)) is None
    stats = tier.stats()
    assert (stats["hits"], stats["misses"], stats["puts"], stats["errors"]) == (1, 1, 1, 0)


def test_get_many_keeps_order_across_hits_and_misses(
    make_tier: MakeTier, prefix: str, make_key: MakeKey, same_bits: SameBits
) -> None:
    tier = make_tier(prefix=prefix)
    values = {i: torch.full((4, 8), float(i)) for i in (0, 2, 5)}
    for i, v in values.items():
        tier.put(make_key(i), v)
    assert tier.flush()
    got = tier.get_many([make_key(i) for i in range(6)])
    assert [g is not None for g in got] == [i in values for i in range(6)]
    assert all(same_bits(got[i], v) for i, v in values.items())


def test_key_name_and_ttl(
    make_tier: MakeTier, prefix: str, make_key: MakeKey, redis_client: redis.Redis
) -> None:
    tier = make_tier(prefix=prefix, ttl_s=3600)
    tier.put(make_key(1), torch.zeros(3))
    forever = make_tier(prefix=prefix, ttl_s=None)
    forever.put(make_key(2), torch.zeros(3))
    assert tier.flush() and forever.flush()
    name = f"{prefix}emb:{make_key(1).digest()}"
    assert tier.redis_key(make_key(1)) == name
    assert 3590 <= redis_client.ttl(name) <= 3600
    assert redis_client.ttl(forever.redis_key(make_key(2))) == -1  # exists, no expiry


CHILD = textwrap.dedent(
    """
    import sys, torch
    from cache import EmbeddingKey, RedisTier
    url, prefix = sys.argv[1:3]
    key = lambda s: EmbeddingKey(s * 32, (1, 8, 8), "pre", "model")
    tier = RedisTier(url, prefix=prefix, async_puts=False, timeout_s=2.0, connect_timeout_s=2.0)
    got = tier.get(key("a"))
    expected = torch.linspace(-3, 3, 16 * 24, dtype=torch.float32).reshape(16, 24).to(torch.bfloat16)
    assert got is not None and torch.equal(got.view(torch.int16), expected.view(torch.int16)), got
    tier.put(key("b"), torch.arange(10, dtype=torch.float32) / 7)
    tier.close()
    print("child ok")
    """
)


def test_a_value_written_by_one_process_is_read_by_another(
    make_tier: MakeTier, prefix: str, redis_url: str, same_bits: SameBits
) -> None:
    def key(s: str) -> EmbeddingKey:
        return EmbeddingKey(s * 32, (1, 8, 8), "pre", "model")

    tier = make_tier(prefix=prefix, async_puts=False)
    tier.put(key("a"), torch.linspace(-3, 3, 16 * 24).reshape(16, 24).to(torch.bfloat16))
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, redis_url, prefix], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "child ok" in proc.stdout, proc.stderr
    got = tier.get(key("b"))
    assert got is not None and same_bits(got, torch.arange(10, dtype=torch.float32) / 7)


class _PickleBomb:
    """Unpickling this creates a directory: proof that a payload was (or was not) unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.mkdir, (str(self.marker),))


def test_corrupt_values_are_misses_and_never_unpickled(
    make_tier: MakeTier,
    prefix: str,
    make_key: MakeKey,
    redis_client: redis.Redis,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tier = make_tier(prefix=prefix)
    marker = tmp_path / "unpickled"
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(_PickleBomb(control)))
    assert control.exists(), "the payload must be live for this test to prove anything"
    torch_payload = io.BytesIO()
    torch.save({"emb": _PickleBomb(marker)}, torch_payload)
    valid_for_other_key = codec.encode(make_key(99).digest(), torch.ones(4, 4))
    damaged = {
        1: b"\x00garbage\xff" * 10,
        2: valid_for_other_key,  # a well-formed entry filed under the wrong key
        3: pickle.dumps(_PickleBomb(marker)),
        4: torch_payload.getvalue(),
        5: codec.encode(make_key(5).digest(), torch.ones(4, 4))[:-2],
    }
    for i, data in damaged.items():
        redis_client.set(tier.redis_key(make_key(i)), data)

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("deserialised a value read from Redis")

    for target, name in ((pickle, "loads"), (pickle, "load"), (torch, "load")):
        monkeypatch.setattr(target, name, forbidden)
    assert tier.get_many([make_key(i) for i in damaged]) == [None] * len(damaged)
    # Deleted on the first read: the next reader finds nothing rather than the same damage until the TTL.
    assert all(redis_client.exists(tier.redis_key(make_key(i))) == 0 for i in damaged)
    assert all(tier.get(make_key(i)) is None for i in damaged)
    assert not marker.exists()
    stats = tier.stats()
    assert (stats["corrupt"], stats["invalid"], stats["misses"], stats["hits"], stats["errors"]) == (
        5,
        5,
        10,
        0,
        0,
    )
    assert stats["breaker_state"] == "closed", "damaged data is not a backend failure"

    # The next put for a damaged key repairs it.
    tier.put(make_key(2), torch.full((4, 4), 2.0))
    assert tier.flush()
    got = tier.get(make_key(2))
    assert got is not None and torch.equal(got, torch.full((4, 4), 2.0))


def test_values_above_the_size_limit_are_not_written(
    make_tier: MakeTier, prefix: str, make_key: MakeKey
) -> None:
    tier = make_tier(prefix=prefix, max_value_bytes=1024)
    tier.put(make_key(1), torch.zeros(257))
    tier.put(make_key(2), torch.zeros(256))
    assert tier.flush()
    assert tier.get(make_key(1)) is None and tier.get(make_key(2)) is not None
    assert tier.stats()["dropped_puts"] == 1


def test_replicas_share_embeddings_and_l2_hits_are_promoted(
    make_tier: MakeTier, prefix: str, make_key: MakeKey, same_bits: SameBits
) -> None:
    replica_a = EmbeddingCache(MemoryTier(1 << 20), make_tier(prefix=prefix))
    replica_b = EmbeddingCache(MemoryTier(1 << 20), make_tier(prefix=prefix))
    value = torch.randn(64, 32).to(torch.bfloat16)
    replica_a.put(make_key(1), value)
    assert replica_a.l2 is not None and replica_a.l2.flush()  # type: ignore[attr-defined]

    assert not replica_b.contains(make_key(1))
    got = replica_b.get(make_key(1))  # L1 miss, L2 hit
    assert got is not None and same_bits(got, value)
    assert replica_b.contains(make_key(1))
    again = replica_b.get(make_key(1))  # now served by L1
    assert again is not None and same_bits(again, value)
    assert replica_b.get_many([make_key(1), make_key(2)])[1] is None

    stats = replica_b.stats()
    assert (stats["memory"]["hits"], stats["memory"]["misses"]) == (2, 2)
    assert (stats["redis"]["hits"], stats["redis"]["misses"]) == (1, 1)
