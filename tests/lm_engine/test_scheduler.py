"""The scheduler on its own: sequences and a block manager built directly, no model and no engine."""

from __future__ import annotations

import pytest

from cache import EmbeddingKey
from lm_engine.block_manager import BlockManager
from lm_engine.sampling_params import SamplingParams
from lm_engine.scheduler import Scheduler
from lm_engine.sequence import ImageItem, Sequence, SequenceStatus
from lm_engine.step_budget import fair_shares

BS = 4


def make_scheduler(budget: int, num_blocks: int = 256, max_num_seqs: int = 16) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS, enable_prefix_caching=True), budget, max_num_seqs)


def make_seq(
    n: int, client: str = "", first: int = 0, images: list[ImageItem] | None = None, **kw
) -> Sequence:
    tokens = list(range(first, first + n))
    status = SequenceStatus.WAITING_FOR_IMAGES if kw.pop("pending", False) else SequenceStatus.WAITING
    return Sequence(
        f"r{first}", tokens, n, SamplingParams(), images=images or [], client_key=client, status=status
    )


def add(sched: Scheduler, *seqs: Sequence) -> None:
    for seq in seqs:
        sched.add(seq)


def run(sched: Scheduler) -> dict[str, int]:
    """One step, applied as the engine would: chunks computed, a token sampled for each completed one."""
    out = sched.schedule()
    done = {}
    for chunk in out.chunks:
        completes = chunk.completes
        chunk.seq.num_computed_tokens += chunk.num_tokens
        sched.bm.commit(chunk.seq)
        if completes:
            chunk.seq.token_ids.append(0)
        done[chunk.seq.request_id] = done.get(chunk.seq.request_id, 0) + chunk.num_tokens
    sched.bm.check_integrity(sched.running)
    return done


def decoding(sched: Scheduler, count: int) -> list[Sequence]:
    """``count`` running sequences whose prompts are computed (one token each to decode)."""
    seqs = [make_seq(6, "streams", first=1000 + 10 * i) for i in range(count)]
    add(sched, *seqs)
    while any(s.num_uncomputed > 1 or s.status is not SequenceStatus.RUNNING for s in seqs):
        run(sched)
    return seqs


def test_decodes_go_first_and_prefill_gets_the_rest():
    sched = make_scheduler(budget=8)
    streams = decoding(sched, 3)
    add(sched, make_seq(40, "new", first=0))
    step = run(sched)
    assert all(step[s.request_id] == 1 for s in streams)
    assert step["r0"] == 8 - 3  # the prompt gets what the decodes left
    # A budget no larger than the decodes leaves prefill nothing.
    sched.max_num_batched_tokens = 3
    step = run(sched)
    assert set(step) == {s.request_id for s in streams}


def test_each_client_gets_an_equal_share_and_unused_share_goes_to_others():
    sched = make_scheduler(budget=64)
    add(sched, make_seq(200, "a", first=0), make_seq(200, "b", first=1000), make_seq(10, "c", first=2000))
    step = run(sched)
    # c wants 10: it gets them all, a and b split the other 54 evenly.
    assert step == {"r2000": 10, "r0": 27, "r1000": 27}
    assert sum(step.values()) == 64
    # One client alone gets the whole budget, whatever its share was.
    sched = make_scheduler(budget=64)
    add(sched, make_seq(200, "a", first=0), make_seq(200, "a", first=1000))
    assert sum(run(sched).values()) == 64


def test_least_served_client_goes_first():
    sched = make_scheduler(budget=16, num_blocks=256)
    add(sched, make_seq(200, "hog", first=0))
    for _ in range(3):
        run(sched)  # the hog has been served for three steps
    add(sched, make_seq(200, "new", first=1000))
    assert run(sched) == {"r1000": 8, "r0": 8}
    assert [s.client_key for s in sched._prefill_candidates()] == ["new", "hog"]


@pytest.mark.parametrize(
    "demand,total,floor,expected",
    [
        ({"a": 100, "b": 100}, 64, 4, {"a": 32, "b": 32}),
        ({"a": 5, "b": 100, "c": 100}, 65, 4, {"a": 5, "b": 30, "c": 30}),
        ({"a": 100, "b": 100, "c": 100}, 6, 4, {"a": 4, "b": 4, "c": 4}),  # no one cut below a block
        ({"a": 3}, 64, 4, {"a": 3}),
    ],
)
def test_fair_shares(demand, total, floor, expected):
    assert fair_shares(demand, total, floor) == expected


def test_prefill_beside_decodes_is_capped():
    sched = make_scheduler(budget=64)
    decoding(sched, 2)
    add(sched, make_seq(100, "new", first=0))
    sched.prefill_cap = 12
    assert run(sched)["r0"] == 12
    # With nothing decoding, the cap does not apply.
    sched = make_scheduler(budget=64)
    sched.prefill_cap = 12
    add(sched, make_seq(100, "new", first=0))
    assert run(sched)["r0"] == 64


def _image(offset: int, length: int, name: str) -> ImageItem:
    return ImageItem(offset, length, EmbeddingKey(name, (1, 4, 4 * length), "pre", "model"))


def test_chunks_cut_through_an_image_span():
    sched = make_scheduler(budget=16)
    seq = make_seq(60, images=[_image(10, 30, "img")])  # placeholders 10..40
    add(sched, seq)
    chunks = []
    while seq.num_uncomputed > 1 or not chunks:
        start = seq.num_computed_tokens
        n = run(sched)[seq.request_id]
        chunks.append((start, start + n))
    assert chunks == [(0, 16), (16, 32), (32, 48), (48, 60)]  # two cuts inside the image


def test_sequences_waiting_for_images_are_skipped():
    sched = make_scheduler(budget=64)
    pending = make_seq(20, "a", first=0, images=[_image(2, 8, "slow")], pending=True)
    ready = make_seq(20, "b", first=1000)
    add(sched, pending, ready)
    assert run(sched) == {"r1000": 20}  # the later arrival goes first
    assert pending.status is SequenceStatus.WAITING_FOR_IMAGES and pending in sched.waiting
    pending.status = SequenceStatus.WAITING  # what the engine does once the encoder delivered
    assert run(sched)["r0"] == 20


def test_a_shrunk_prefix_sends_a_sequence_back_to_wait_for_its_images():
    """Its images were made ready for a cached prefix that is gone by admission: it must not run without
    their rows."""
    sched = make_scheduler(budget=64)
    seq = make_seq(20, "a", images=[_image(2, 8, "img")])
    seq.images_ready_after = 12  # the engine saw 12 tokens cached, so it did not encode the image
    add(sched, seq)
    assert run(sched) == {}
    assert seq.status is SequenceStatus.WAITING_FOR_IMAGES and not seq.block_table


def test_preemption_takes_the_latest_admitted_first():
    # 12 blocks of 4: three prompts of 12 tokens fill 9; growing them runs out.
    sched = make_scheduler(budget=64, num_blocks=12)
    seqs = [make_seq(12, f"c{i}", first=100 * i) for i in range(3)]
    add(sched, *seqs)
    run(sched)
    assert all(s.status is SequenceStatus.RUNNING for s in seqs)
    preempted = []
    for _ in range(12):
        out = sched.schedule()
        preempted += [s.request_id for s in out.preempted]
        for chunk in out.chunks:
            chunk.seq.num_computed_tokens += chunk.num_tokens
            chunk.seq.token_ids.append(0)
        sched.bm.check_integrity(sched.running)
        if preempted:
            break
    assert preempted and preempted[0] == "r200"  # the last admitted goes first
    assert seqs[2] in sched.waiting and seqs[2].num_computed_tokens == 0 and not seqs[2].block_table
    assert seqs[0].status is SequenceStatus.RUNNING


def test_max_num_seqs_bounds_admission():
    sched = make_scheduler(budget=256, max_num_seqs=2)
    add(sched, *[make_seq(8, f"c{i}", first=100 * i) for i in range(4)])
    run(sched)
    assert len(sched.running) == 2 and len(sched.waiting) == 2


def test_a_prefix_being_computed_is_waited_for_not_computed_twice():
    """Two questions about one page at once: the second waits while the first computes the shared blocks,
    then takes them from the prefix cache."""
    sched = make_scheduler(budget=16)
    page = list(range(40))
    first = Sequence("q1", page + [900, 901], 42, SamplingParams(), client_key="a")
    second = Sequence("q2", page + [950, 951, 952], 43, SamplingParams(), client_key="b")
    add(sched, first, second)
    steps = []
    while second.status is not SequenceStatus.RUNNING:
        steps.append(run(sched))
    # The first computed the shared page alone (from its second step on with the whole budget: in the first,
    # both arrived together and the second's share went unused); then the second took it from the cache.
    assert [set(s) for s in steps[:-1]] == [{"q1"}] * (len(steps) - 1) and len(steps) >= 3
    assert sum(steps[1].values()) == 16
    assert second.num_cached_tokens == 40  # all ten shared blocks came from the cache
    # Without prefix caching there is nothing to wait for: both run at once.
    sched = Scheduler(BlockManager(256, BS, enable_prefix_caching=False), 16, 16)
    add(sched, make_seq(42, "a", first=0), make_seq(43, "b", first=0))
    assert set(run(sched)) == {"r0"} and len(sched.running) == 2
