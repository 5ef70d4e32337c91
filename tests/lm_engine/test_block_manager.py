"""Block manager unit tests: reference counts, LRU eviction, exact-match confirmation, copy-on-write."""

from __future__ import annotations

import pytest

from cache import EmbeddingKey
from lm_engine import prefix_cache
from lm_engine.block_manager import BlockManager
from lm_engine.sampling_params import SamplingParams
from lm_engine.sequence import ImageItem, Sequence
from preprocess.hashing import image_hash
from tests.xxh3_collision import colliding_bmps

BS = 4


def seq_of(tokens: list[int], images: list[ImageItem] | None = None, cache_salt: str = "") -> Sequence:
    return Sequence(
        "r", list(tokens), len(tokens), SamplingParams(), images=images or [], cache_salt=cache_salt
    )


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)


def test_prefix_hit_reuses_blocks_and_keeps_last_token_uncached():
    bm = BlockManager(16, BS)
    a = seq_of(list(range(12)))
    bm.allocate(a)
    compute_all(bm, a)
    b = seq_of(list(range(12)))
    bm.allocate(b)
    # 12 tokens = 3 full blocks, but the last token must be computed: only 2 blocks hit.
    assert b.num_computed_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    bm.check_integrity([a, b])
    bm.free(a)
    bm.free(b)
    bm.check_integrity([])
    assert bm.num_free_blocks == 16


def test_freed_blocks_are_evicted_lru_and_lazily():
    bm = BlockManager(6, BS, watermark=0)
    first = seq_of([1] * 8 + [9])
    bm.allocate(first)
    compute_all(bm, first)
    bm.free(first)
    # The freed, hashed blocks still serve a hit ...
    again = seq_of([1] * 8 + [9])
    assert bm.cached_prefix_tokens(again) == 8
    # ... until allocation pressure reuses them (least recently freed first).
    hog = seq_of(list(range(100, 124)))
    bm.allocate(hog)
    assert bm.cached_prefix_tokens(again) == 0
    bm.check_integrity([hog])


def test_hash_collision_is_rejected_by_exact_comparison(monkeypatch):
    bm = BlockManager(16, BS)
    monkeypatch.setattr(prefix_cache, "hash_block", lambda key, algorithm=None: b"42")  # every block collides
    monkeypatch.setattr("lm_engine.block_manager.hash_block", lambda key, algorithm=None: b"42")
    a = seq_of([1, 2, 3, 4, 5])
    bm.allocate(a)
    compute_all(bm, a)
    b = seq_of([7, 7, 7, 7, 5])
    assert bm.cached_prefix_tokens(b) == 0  # same hash, different tokens: no hit


def test_image_identity_separates_identical_placeholder_blocks():
    pad = 99
    img = lambda name: ImageItem(offset=1, length=6, key=EmbeddingKey(name, (1, 4, 6), "pre", "model"))  # noqa: E731
    bm = BlockManager(16, BS)
    a = seq_of([5] + [pad] * 6 + [6, 7], [img("image-a")])
    bm.allocate(a)
    compute_all(bm, a)
    same = seq_of([5] + [pad] * 6 + [6, 7], [img("image-a")])
    other = seq_of([5] + [pad] * 6 + [6, 7], [img("image-b")])
    assert bm.cached_prefix_tokens(same) == 8
    assert bm.cached_prefix_tokens(other) == 0


@pytest.mark.parametrize("algorithm", ["blake3", "xxh3"])
def test_images_colliding_under_xxh3_chain_apart_unless_xxh3_is_chosen(algorithm):
    pad = 99
    pictures = colliding_bmps(128, 176, seed=5)
    assert pictures[0] != pictures[1]

    def img(data: bytes) -> ImageItem:
        key = EmbeddingKey(image_hash(data, algorithm), (1, 4, 6), "pre", "model", 0, algorithm)
        return ImageItem(offset=1, length=6, key=key)

    bm = BlockManager(16, BS, hash_algorithm=algorithm)
    first = seq_of([5] + [pad] * 6 + [6, 7], [img(pictures[0])])
    bm.allocate(first)
    compute_all(bm, first)
    second = seq_of([5] + [pad] * 6 + [6, 7], [img(pictures[1])])
    chains = [[h for h, _ in prefix_cache.extend_chain(s, 2, BS, algorithm)] for s in (first, second)]
    assert all(len(h) == (16 if algorithm == "xxh3" else 32) for h in chains[0])
    if algorithm == "xxh3":  # the opt-in's risk: the second picture's blocks are the first one's
        assert chains[0] == chains[1] and bm.cached_prefix_tokens(second) == 8
    else:
        assert chains[0][0] != chains[1][0] and chains[0][1] != chains[1][1]
        assert bm.cached_prefix_tokens(second) == 0
    bm.check_integrity([first])


def test_cache_salt_enters_the_first_block_and_separates_prefixes():
    bm = BlockManager(32, BS)
    tokens = list(range(13))
    a = seq_of(tokens, cache_salt="tenant-a")
    bm.allocate(a)
    compute_all(bm, a)
    assert bm.cached_prefix_tokens(seq_of(tokens, cache_salt="tenant-a")) == 12
    assert bm.cached_prefix_tokens(seq_of(tokens, cache_salt="tenant-b")) == 0
    assert bm.cached_prefix_tokens(seq_of(tokens)) == 0  # unsalted: not a salted request's blocks
    plain = seq_of(tokens)
    bm.allocate(plain)
    compute_all(bm, plain)
    assert bm.cached_prefix_tokens(seq_of(tokens)) == 12
    assert bm.cached_prefix_tokens(seq_of(tokens, cache_salt="tenant-b")) == 0
    keys = [k for _, k in a.block_chain]
    assert [k.salt for k in keys] == ["tenant-a", "", ""]  # later blocks carry it through their parents
    other = prefix_cache.extend_chain(seq_of(tokens, cache_salt="tenant-b"), 3, BS)
    assert all(h != g for (h, _), (g, _) in zip(a.block_chain, other))
    bm.check_integrity([a, plain])


def test_a_forked_choice_keeps_the_salt():
    parent = seq_of([1, 2, 3, 4, 5], cache_salt="tenant-a")
    assert parent.fork(1).cache_salt == "tenant-a"


def test_fork_then_copy_on_write():
    bm = BlockManager(16, BS)
    parent = seq_of([1, 2, 3, 4, 5, 6])  # one full block + a partial one
    bm.allocate(parent)
    compute_all(bm, parent)
    child = parent.fork(1)
    bm.fork(parent, child)
    assert all(bm.allocator.ref_counts[b] == 2 for b in parent.block_table)
    parent.token_ids.append(7)
    child.token_ids.append(8)
    copies = bm.ensure_slots(child, child.num_tokens)
    assert len(copies) == 1 and copies[0][0] == parent.block_table[1]
    assert child.block_table[0] == parent.block_table[0] and child.block_table[1] != parent.block_table[1]
    assert bm.ensure_slots(parent, parent.num_tokens) == []  # now sole owner: no copy
    bm.check_integrity([parent, child])


def test_check_integrity_catches_a_leak():
    bm = BlockManager(8, BS)
    a = seq_of([1, 2, 3])
    bm.allocate(a)
    a.block_table = []  # lose track of the block without freeing it
    with pytest.raises(AssertionError):
        bm.check_integrity([a])


def test_reset_prefix_cache_forgets_every_block():
    bm = BlockManager(16, BS)
    a = seq_of(list(range(13)))
    bm.allocate(a)
    compute_all(bm, a)
    bm.free(a)
    assert bm.cached_prefix_tokens(seq_of(list(range(13)))) == 12
    bm.reset_prefix_cache()
    bm.check_integrity([])
    assert len(bm.index) == 0 and bm.cached_prefix_tokens(seq_of(list(range(13)))) == 0
