from __future__ import annotations

import ctypes
import gc
import json
import random
import subprocess
import sys
import threading
import tracemalloc
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from cache import EmbeddingKey, MemoryTier
from cache.memory import entry_bytes

MakeKey = Callable[..., EmbeddingKey]


def emb(nbytes: int, fill: float = 1.0) -> torch.Tensor:
    assert nbytes % 4 == 0
    return torch.full((nbytes // 4,), fill, dtype=torch.float32)


def cost(make_key: MakeKey, nbytes: int) -> int:
    """The charge of an entry of `nbytes` of data (the keys of make_key all cost the same)."""
    return entry_bytes(make_key(0), emb(nbytes))


def table(n: int) -> int:
    """The OrderedDict's own bytes with n entries, while no more than 5 were ever inserted (no resize yet)."""
    return sys.getsizeof(OrderedDict.fromkeys(range(n)))


# The tests up to the real-memory one check the LRU's policy given each entry's charge and the table's
# measured size; whether those charges cover the real memory is
# test_many_small_entries_stay_within_the_cap_in_real_memory's business.


def test_lru_evicts_least_recently_used_first(make_key: MakeKey) -> None:
    a, b, c, d = (make_key(i) for i in range(4))
    cap = 3 * cost(make_key, 100) + table(3)
    tier = MemoryTier(capacity_bytes=cap)
    for k in (a, b, c):
        tier.put(k, emb(100))
    assert tier.get(a) is not None  # a is now most recent; b is the oldest
    tier.put(d, emb(100))
    assert tier.lru_order() == [c, a, d]
    assert tier.get(b) is None
    assert tier.stats() == {
        "hits": 1,
        "misses": 1,
        "evictions": 1,
        "rejected": 0,
        "invalid": 0,
        "entries": 3,
        "bytes": cap,
        "capacity_bytes": cap,
    }


def test_one_large_entry_evicts_several(make_key: MakeKey) -> None:
    small = cost(make_key, 100)
    tier = MemoryTier(capacity_bytes=4 * small + table(4))
    for i in range(4):
        tier.put(make_key(i), emb(100))
    big = 4 * ((2 * small + 100) // 4)  # charged more than two small entries, at most three
    assert 3 * small - 4 < cost(make_key, big) <= 3 * small
    tier.put(make_key(9), emb(big))
    assert tier.lru_order() == [make_key(3), make_key(9)]
    assert tier.stats()["bytes"] == small + cost(make_key, big) + table(2)


def test_entry_larger_than_capacity_is_not_stored(make_key: MakeKey) -> None:
    tier = MemoryTier(capacity_bytes=cost(make_key, 200) + table(1))
    tier.put(make_key(0), emb(100))
    tier.put(make_key(1), emb(204))
    assert tier.lru_order() == [make_key(0)]
    # Replacing a key with an oversize value drops the stale old value too.
    tier.put(make_key(0), emb(400, fill=2.0))
    assert tier.get(make_key(0)) is None
    assert tier.stats()["rejected"] == 2 and tier.stats()["bytes"] == table(0)


def test_replacing_a_key_updates_value_and_bytes(make_key: MakeKey) -> None:
    tier = MemoryTier(capacity_bytes=10 * cost(make_key, 100))
    tier.put(make_key(0), emb(100, fill=1.0))
    tier.put(make_key(0), emb(200, fill=2.0))
    got = tier.get(make_key(0))
    assert got is not None and torch.equal(got, emb(200, fill=2.0))
    assert tier.stats()["bytes"] == cost(make_key, 200) + table(1) and len(tier) == 1


def test_contains_counts_nothing_and_keeps_recency(make_key: MakeKey) -> None:
    tier = MemoryTier(capacity_bytes=2 * cost(make_key, 100) + table(2))
    tier.put(make_key(0), emb(100))
    tier.put(make_key(1), emb(100))
    assert tier.contains(make_key(0)) and not tier.contains(make_key(5))
    tier.put(make_key(2), emb(100))  # key 0 is still the LRU entry despite the contains()
    assert tier.lru_order() == [make_key(1), make_key(2)]
    assert tier.stats()["hits"] == 0 and tier.stats()["misses"] == 0


def test_a_view_of_a_larger_tensor_is_stored_compactly(make_key: MakeKey) -> None:
    batch = torch.randn(1000, 64)  # e.g. a packed encoder output for many images
    view = batch[10:20]
    tier = MemoryTier(capacity_bytes=1 << 20)
    tier.put(make_key(0), view)
    stored = tier.get(make_key(0))
    assert stored is not None and torch.equal(stored, view)
    assert stored.untyped_storage().nbytes() == view.nbytes  # not the batch's 256 KB
    assert tier.stats()["bytes"] == entry_bytes(make_key(0), view.clone()) + table(1)


class LRUModel:
    """Oracle: the LRU over (key -> charge). The table's size is the interpreter's, so the model keeps an
    OrderedDict of the same shape (int keys, the same inserts, pops and moves) to read it from."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.entries: OrderedDict[int, int] = OrderedDict()

    def put(self, key: int, charge: int) -> None:
        self.entries.pop(key, None)
        if charge + table(1) <= self.cap:
            self.entries[key] = charge
        while self.entries and sum(self.entries.values()) + sys.getsizeof(self.entries) > self.cap:
            self.entries.popitem(last=False)
        if not self.entries:
            self.entries.clear()

    def get(self, key: int) -> bool:
        if key in self.entries:
            self.entries.move_to_end(key)
            return True
        return False


@pytest.mark.parametrize("seed", range(5))
def test_matches_a_model_under_random_operations(make_key: MakeKey, seed: int) -> None:
    rng = random.Random(seed)
    cap = 3 * cost(make_key, 0) + table(3) + 1000  # up to three tiny entries, fewer as they grow
    tier = MemoryTier(capacity_bytes=cap)
    model = LRUModel(cap)
    values: dict[int, float] = {}
    for step in range(600):
        k = rng.randrange(12)
        if rng.random() < 0.5:
            nbytes = 4 * rng.randrange(0, (cap - cost(make_key, 0)) // 3)  # a quarter above the capacity
            tier.put(make_key(k), emb(nbytes, fill=float(step)))
            model.put(k, cost(make_key, nbytes))
            values[k] = float(step)
        else:
            got = tier.get(make_key(k))
            assert (got is not None) == model.get(k)
            if got is not None:
                assert got.numel() == 0 or got[0].item() == values[k]
        assert tier.lru_order() == [make_key(k) for k in model.entries]
        assert tier.stats()["bytes"] == sum(model.entries.values()) + sys.getsizeof(model.entries) <= cap


def test_concurrent_use_keeps_the_byte_accounting_exact(make_key: MakeKey) -> None:
    cap = 6 * cost(make_key, 400)
    tier = MemoryTier(capacity_bytes=cap)
    n_gets = [0] * 4

    def worker(w: int) -> None:
        rng = random.Random(w)
        for _ in range(3000):
            key = make_key(rng.randrange(40))
            if rng.random() < 0.5:
                tier.put(key, emb(4 * rng.randrange(1, 200)))
            else:
                tier.get(key)
                n_gets[w] += 1

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = tier.stats()
    held = [(k, tier.get(k)) for k in tier.lru_order()]
    table_now = sys.getsizeof(tier._entries)  # its size depends on how the threads interleaved
    assert stats["bytes"] == sum(entry_bytes(k, t) for k, t in held if t is not None) + table_now <= cap
    assert stats["hits"] + stats["misses"] == sum(n_gets)


# --- Real memory: tracemalloc and glibc's heap counters as the oracle -------------------------------------


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
        )
        + ("keepcost",)
    ]


def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    fn = getattr(ctypes.CDLL(None), "mallinfo2", None)  # glibc >= 2.33
    if fn is None:
        return None
    fn.restype = _MallInfo2
    return fn


def _fill(tier: MemoryTier, puts: int, seed: int, own_fingerprints: bool = False) -> None:
    """Many small entries (0-256 bytes of data), a tenth of them replacing a recent key. Keys are rebuilt
    from their number, so nothing here outlives the call except what the tier keeps."""
    rng = random.Random(seed)

    def key(i: int) -> EmbeddingKey:
        # Grid sides above 256 are int objects of their own. A server's keys share their fingerprints; keys
        # decoded from the wire (the encoder tier) have their own strings.
        pre, model = ("pre-v1", "model-a") if not own_fingerprints else (f"pre-{i % 1}", f"model-{i % 1}")
        return EmbeddingKey(f"{i:032x}", (1, 50 + i % 400, 7), pre, model)

    for i in range(puts):
        k = key(rng.randrange(max(0, i - 50), i) if i and rng.random() < 0.1 else i)
        tier.put(k, torch.full((rng.randrange(0, 65),), float(i)))


def _held_by_a_filled_tier(
    cap: int, puts: int, seed: int, undercount: bool = False, **fill: bool
) -> dict[str, int]:
    """Bytes that a tier keeps after `_fill`, measured from outside it, in a process of its own.

    The C heap (glibc's in-use bytes, all arenas and mmapped chunks) holds the tensors' C++ objects and data
    and the Python blocks over 512 bytes (the OrderedDict's table); tracemalloc sees the Python blocks, of
    which those up to 512 bytes live in pymalloc's mmapped arenas, outside the C heap. The same seeded fill
    runs once per meter, since tracemalloc's own bookkeeping is on the C heap.
    """
    import cache.memory

    if undercount:
        cache.memory.entry_bytes = lambda key, tensor: tensor.nbytes
    mallinfo2 = _mallinfo2()
    assert mallinfo2 is not None

    def c_heap() -> int:
        info = mallinfo2()
        return info.uordblks + info.hblkhd

    _fill(MemoryTier(cap), 300, seed + 1)  # first-use allocations (torch, interpreter caches) out of the way
    gc.collect()
    before = c_heap()
    tier = MemoryTier(cap)
    _fill(tier, puts, seed, **fill)
    gc.collect()
    native = c_heap() - before
    charged, entries = tier.stats()["bytes"], len(tier)
    del tier
    gc.collect()

    tracemalloc.start()
    tier = MemoryTier(cap)
    _fill(tier, puts, seed, **fill)
    gc.collect()
    snapshot = tracemalloc.take_snapshot()
    tracemalloc.stop()
    assert len(tier) == entries
    python = sum(-(-t.size // 16) * 16 for t in snapshot.traces if t.size <= 512)  # pymalloc's 16-byte sizes
    return {
        "held": native + python,
        "native": native,
        "python": python,
        "charged": charged,
        "entries": entries,
    }


def _measure_in_a_fresh_process(runs: list[dict[str, object]]) -> list[dict[str, int]]:
    """`_held_by_a_filled_tier(**run)` for each run, in one new process."""
    # NOTE: a process of its own: another test's threads allocating meanwhile would move the C-heap meter.
    code = (
        "import json, tests.cache.test_memory_tier as t; "
        f"print(json.dumps([t._held_by_a_filled_tier(**run) for run in {runs!r}]))"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


# What no entry is charged for: the tier object and its lock (under 1 KB).
SLACK = 4 << 10


@pytest.mark.skipif(_mallinfo2() is None, reason="needs glibc's mallinfo2 to measure the C heap")
@pytest.mark.timeout(900)  # a fresh process importing torch: minutes on a loaded machine, seconds otherwise
def test_many_small_entries_stay_within_the_cap_in_real_memory() -> None:
    cap, puts = 512 << 10, 3000
    runs: list[dict[str, object]] = [
        {"cap": cap, "puts": puts, "seed": 0},
        {"cap": cap, "puts": puts, "seed": 0, "own_fingerprints": True},
        # Each entry charged its tensor bytes only, as before (last: it patches the module).
        {"cap": cap, "puts": puts, "seed": 0, "undercount": True},
    ]
    shared, own, old = _measure_in_a_fresh_process(runs)
    for got in (shared, own):
        assert got["charged"] <= cap
        assert got["held"] <= cap + SLACK, got
        # ...and the charges are not far above the real cost: the cache gets most of its budget.
        assert got["held"] >= 0.75 * cap, got
        assert got["entries"] < puts  # it evicted, so the bound was reached and held under churn
    # The oracle tells: the old charges let the same traffic hold several times the cap.
    assert old["entries"] > shared["entries"] and old["held"] > 3 * cap, old
