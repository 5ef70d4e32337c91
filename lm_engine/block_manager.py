"""KV block allocation: reference counts, lazy LRU eviction, prefix-cache hits and copy-on-write."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from lm_engine.prefix_cache import PrefixIndex, extend_chain, hash_block
from lm_engine.sequence import Sequence
from preprocess.hashing import DEFAULT_HASH, check_algorithm


class BlockAllocator:
    """Reference-counted blocks. Freed blocks wait in LRU order and keep their prefix hash until reused."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.hashes: list[bytes | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def pop_free(self) -> tuple[int, bytes | None]:
        """Take the least recently freed block; returns it with the hash it held (now to be evicted)."""
        block_id, _ = self.free.popitem(last=False)
        old_hash, self.hashes[block_id] = self.hashes[block_id], None
        self.ref_counts[block_id] = 1
        return block_id, old_hash

    def incref(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self.free[block_id]
        self.ref_counts[block_id] += 1

    def decref(self, block_id: int) -> None:
        assert self.ref_counts[block_id] > 0, f"double free of block {block_id}"
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self.free[block_id] = None


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
        hash_algorithm: str = DEFAULT_HASH,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_algorithm = check_algorithm(hash_algorithm)  # what block hashes are digests of
        self.allocator = BlockAllocator(num_blocks)
        self.index = PrefixIndex()
        self.watermark_blocks = max(1, int(watermark * num_blocks)) if num_blocks > 8 else 0
        self.prefix_queries = 0  # tokens looked up / hit, for the hit-rate metric
        self.prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def usage(self) -> float:
        return 1.0 - self.allocator.num_free / max(1, self.num_blocks)

    def _blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # -- prefix matching -------------------------------------------------------------------------------
    def lookup(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of ``seq``'s full blocks (confirmed by exact keys)."""
        if not self.enable_prefix_caching:
            return []
        # NOTE: at least the last token is computed, so a sampler has logits for it.
        n_full = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash, key in self._chain(seq, n_full)[:n_full]:
            block_id = self.index.lookup(block_hash, key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _chain(self, seq: Sequence, num_blocks: int):
        return extend_chain(seq, num_blocks, self.block_size, self.hash_algorithm)

    def next_block_hash(self, seq: Sequence, index: int) -> bytes | None:
        """The hash of ``seq``'s full block ``index`` (None past its full blocks, or without prefix caching)."""
        n_full = seq.num_tokens // self.block_size
        if not self.enable_prefix_caching or index >= n_full:
            return None
        return self._chain(seq, index + 1)[index][0]

    def blocks_in_flight(self, seqs: Iterable[Sequence]) -> set[bytes]:
        """Hashes of the full blocks ``seqs`` hold but have not computed yet (empty without prefix caching)."""
        if not self.enable_prefix_caching:
            return set()
        out = set()
        for seq in seqs:
            n_full = seq.num_tokens // self.block_size
            chain = self._chain(seq, n_full)
            out.update(h for h, _ in chain[seq.num_committed_blocks : n_full])
        return out

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens of ``seq`` the prefix cache would serve if it were admitted now."""
        return len(self.lookup(seq)) * self.block_size

    def can_allocate(self, seq: Sequence, hits: list[int], keep_watermark: bool = True) -> bool:
        """Whether ``seq`` fits now, given its prefix ``hits``; the watermark keeps room for running ones to grow."""
        reusable_free = sum(1 for b in hits if self.allocator.ref_counts[b] == 0)
        needed = self._blocks_for(seq.num_tokens) - len(hits)
        reserve = self.watermark_blocks if keep_watermark else 0
        return self.allocator.num_free - reusable_free - needed >= reserve

    def fits_at_all(self, num_tokens: int) -> bool:
        return self._blocks_for(num_tokens) <= self.num_blocks

    def allocate(self, seq: Sequence, hits: list[int] | None = None) -> None:
        """Give ``seq`` blocks for all its tokens, reusing its cached prefix ``hits`` (looked up if not given);
        sets its computed count."""
        assert not seq.block_table
        hits = self.lookup(seq) if hits is None else hits
        for b in hits:
            self.allocator.incref(b)
        table = list(hits)
        for _ in range(self._blocks_for(seq.num_tokens) - len(hits)):
            table.append(self._take_free())
        seq.block_table = table
        seq.num_committed_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += seq.num_computed_tokens

    def _take_free(self) -> int:
        block_id, old_hash = self.allocator.pop_free()
        if old_hash is not None:
            self.index.evict(block_id, old_hash)
        return block_id

    # -- growth during decode --------------------------------------------------------------------------
    def slots_needed(self, seq: Sequence, end: int) -> int:
        """Blocks ``seq`` must take to compute tokens up to ``end`` (a copy-on-write counts as one)."""
        need = max(0, self._blocks_for(end) - len(seq.block_table))
        idx = seq.num_computed_tokens // self.block_size
        if idx < len(seq.block_table) and self.allocator.ref_counts[seq.block_table[idx]] > 1:
            need += 1
        return need

    def ensure_slots(self, seq: Sequence, end: int) -> list[tuple[int, int]] | None:
        """Make blocks for tokens [computed, end) writable; returns KV copies (src, dst) or None if out."""
        if self.slots_needed(seq, end) > self.allocator.num_free:
            return None
        copies = []
        idx = seq.num_computed_tokens // self.block_size
        if idx < len(seq.block_table) and self.allocator.ref_counts[seq.block_table[idx]] > 1:
            # NOTE: a partial block shared by n > 1 siblings: copy before the first divergent write.
            src = seq.block_table[idx]
            dst = self._take_free()
            self.allocator.decref(src)
            seq.block_table[idx] = dst
            copies.append((src, dst))
        while len(seq.block_table) < self._blocks_for(end):
            seq.block_table.append(self._take_free())
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        for b in parent.block_table:
            self.allocator.incref(b)
        child.block_table = list(parent.block_table)
        child.num_committed_blocks = parent.num_committed_blocks

    def commit(self, seq: Sequence) -> None:
        """Index the blocks of ``seq`` that became full and computed, so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        n_full = seq.num_computed_tokens // self.block_size
        chain = self._chain(seq, n_full)
        for i in range(seq.num_committed_blocks, n_full):
            block_hash, key = chain[i]
            block_id = seq.block_table[i]
            if self.allocator.hashes[block_id] is None and self.index.insert(block_hash, key, block_id):
                self.allocator.hashes[block_id] = block_hash
        seq.num_committed_blocks = max(seq.num_committed_blocks, n_full)

    def free(self, seq: Sequence) -> None:
        # Reverse order: a sequence's tail blocks are the least likely to be shared, so evict them first.
        for b in reversed(seq.block_table):
            self.allocator.decref(b)
        seq.block_table = []
        seq.num_committed_blocks = 0

    def reset_prefix_cache(self) -> None:
        for h, block_id in list(self.index.items()):
            self.allocator.hashes[block_id] = None
            self.index.evict(block_id, h)

    # -- invariants ------------------------------------------------------------------------------------
    def check_integrity(self, live: Iterable[Sequence]) -> None:
        """Raise AssertionError unless ref counts, the free list and the prefix index agree."""
        counts = [0] * self.num_blocks
        for seq in live:
            assert len(seq.block_table) == len(set(seq.block_table)), f"seq {seq.seq_id} repeats a block"
            assert len(seq.block_table) >= self._blocks_for(seq.num_computed_tokens)
            for b in seq.block_table:
                counts[b] += 1
        alloc = self.allocator
        for b in range(self.num_blocks):
            assert counts[b] == alloc.ref_counts[b], (
                f"block {b}: ref {alloc.ref_counts[b]} != holders {counts[b]}"
            )
            assert (alloc.ref_counts[b] == 0) == (b in alloc.free), (
                f"block {b}: free list disagrees with refs"
            )
        for h, b in self.index.items():
            assert alloc.hashes[b] == h, f"index maps {h.hex()} to block {b} which holds {alloc.hashes[b]}"
            key = self.index.key_of(b)
            assert key is not None and hash_block(key, self.hash_algorithm) == h
        indexed = sum(1 for h in alloc.hashes if h is not None)
        assert indexed == len(self.index), "a block holds a hash the index does not know"
