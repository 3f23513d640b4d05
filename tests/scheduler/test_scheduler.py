"""Scheduler: continuous batching, chunked prefill, preemption, admission checks, abort, n > 1.

A fake engine drives the scheduler the way the real one does. Its "model" writes (token, position)
into a fake paged KV cache through the block tables, reads every sequence's whole context back
through them (so a wrongly shared, overwritten or leaked block shows up as a wrong context), and
"samples" the next token as a fixed function of that context. Every request's output is therefore
known in advance (`expected_output`), whatever the batching, chunking, caching and preemption did.
"""

import random
from collections import deque
from dataclasses import dataclass

import pytest

from tinypaged.config import EngineConfig
from tinypaged.scheduler import Scheduler, Sequence, SequenceStatus

BS = 4
VOCAB = 64
EOS = 0


@dataclass
class Params:
    max_tokens: int | None = 8


def fake_next_token(context: list[int], index: int) -> int:
    h = index + 1  # an LCG over the context: every token depends on all before it
    for t in context:
        h = (h * 6364136223846793005 + t + 1442695040888963407) % 2**64
    return (h >> 33) % VOCAB


def expected_output(prompt: list[int], max_tokens: int, index: int = 0, eos: bool = True):
    tokens = list(prompt)
    while len(tokens) - len(prompt) < max_tokens:
        tokens.append(fake_next_token(tokens, index))
        if eos and tokens[-1] == EOS:
            break
    return tokens[len(prompt) :]


def make_scheduler(num_blocks=64, **kw) -> Scheduler:
    kw.setdefault("max_model_len", 256)
    return Scheduler(EngineConfig(block_size=BS, **kw), num_blocks)


class FakeEngine:
    def __init__(self, sched: Scheduler, eos: bool = True):
        self.sched = sched
        self.eos = eos  # False: every request runs to max_tokens
        self.kv: dict[int, tuple[int, int]] = {}  # slot -> (token id, position)
        self.outputs: dict[tuple[str, int], tuple[list[int], str]] = {}
        self.num_preemptions = 0

    def add(
        self, request_id: str, prompt: list[int], max_tokens: int, n: int = 1
    ) -> list[Sequence]:
        seqs = [Sequence(request_id, prompt, Params(max_tokens), index=i) for i in range(n)]
        for seq in seqs:
            self.sched.add(seq)
        return seqs

    def slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // BS] * BS + pos % BS

    def step(self):
        sched, bm = self.sched, self.sched.block_manager
        decoding = [s for s in sched.running.values() if not s.is_prefill]
        out = sched.schedule()
        self.num_preemptions += len(out.preempted)
        assert out.num_batched_tokens == sum(i.num_new_tokens for i in out.scheduled)
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        assert len(out.scheduled) <= sched.max_num_seqs
        # Decodes are never starved (when the budget covers max_num_seqs of them).
        if sched.max_num_batched_tokens >= sched.max_num_seqs:
            in_step = {i.seq.seq_id for i in out.scheduled} | {s.seq_id for s in out.preempted}
            assert all(s.seq_id in in_step for s in decoding)
        sampled = {}
        for item in out.scheduled:
            seq, start = item.seq, item.num_computed_tokens
            end = start + item.num_new_tokens
            assert item.num_new_tokens > 0 and end == seq.num_computed_tokens  # counted at once
            assert len(seq.block_table) == bm.blocks_needed(end)
            for pos in range(start, end):  # store K/V: only ever into a block nobody shares
                assert bm.ref_counts[seq.block_table[pos // BS]] == 1
                self.kv[self.slot(seq, pos)] = (seq.token_ids[pos], pos)
            context = [self.kv[self.slot(seq, p)] for p in range(end)]  # attention reads
            assert context == [(t, p) for p, t in enumerate(seq.token_ids[:end])]
            assert item.sample == (end == len(seq.token_ids))
            if item.sample:
                sampled[seq.seq_id] = fake_next_token([t for t, _ in context], seq.index)
        self.update(out, sampled)
        return out

    def update(self, out, sampled: dict[int, int]) -> None:
        """The engine's side of a step's end: the scheduler takes the sampled tokens, then the
        stop checks (EOS, max_tokens)."""
        for seq in self.sched.update(out, sampled):
            if self.eos and seq.last_token_id == EOS:
                self.finish(seq, "stop")
            elif seq.num_output_tokens == seq.max_tokens:
                self.finish(seq, "length")
        self.sched.check_invariants()

    def finish(self, seq: Sequence, reason: str) -> None:
        self.sched.finish(seq, reason)
        self.outputs[(seq.request_id, seq.index)] = (seq.output_token_ids, reason)

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return
            self.step()
        raise AssertionError(f"not done after {max_steps} steps: {self.sched.running}")


def assert_no_leaks(sched: Scheduler) -> None:
    assert not sched.has_unfinished() and not sched.requests
    assert sched.num_free_blocks == sched.num_total_blocks and sched.kv_cache_usage == 0.0
    assert not any(sched.block_manager.ref_counts)
    sched.check_invariants()


def workload(seed: int, num_requests: int):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(5, 30))] for _ in range(3)]
    reqs = []
    for i in range(num_requests):
        prompt = rng.choice(prefixes)[: rng.randrange(3, 31)] + [
            rng.randrange(1, VOCAB) for _ in range(rng.randrange(0, 6))
        ]
        reqs.append((f"req{i}", prompt, rng.randrange(1, 16), 2 if i % 5 == 0 else 1))
    return reqs


def check_outputs(engine: FakeEngine, reqs, skip=()) -> None:
    for rid, prompt, max_tokens, n in reqs:
        if rid in skip:
            continue
        for index in range(n):
            want = expected_output(prompt, max_tokens, index, engine.eos)
            got, reason = engine.outputs[(rid, index)]
            assert got == want, (rid, index)
            assert reason == ("stop" if engine.eos and want[-1] == EOS else "length")


@pytest.mark.parametrize(
    "kw",
    [
        {"num_blocks": 256},
        {"num_blocks": 256, "enable_prefix_caching": False},
        {"num_blocks": 256, "max_num_batched_tokens": 8},  # chunked prefill everywhere
        {"num_blocks": 12, "max_num_batched_tokens": 16},  # heavy preemption
        {"num_blocks": 12, "enable_prefix_caching": False},
        {"num_blocks": 64, "max_num_seqs": 1},
    ],
)
def test_every_request_completes_with_the_right_output(kw):
    sched = make_scheduler(**kw)
    engine = FakeEngine(sched)
    reqs = workload(seed=1, num_requests=16)
    for req in reqs:
        engine.add(*req)
    engine.run()
    check_outputs(engine, reqs)
    if kw["num_blocks"] == 12:
        assert engine.num_preemptions > 0
    assert_no_leaks(sched)


def drive_random_workload(engine, sched, rng, seed: int, idle=lambda engine: True) -> None:
    """workload(seed)'s 30 requests arriving at random, a few aborted at random, until all are
    done and idle(engine) (nothing left in flight); then every request not aborted has its right
    output and no block is leaked."""
    pending = workload(seed, num_requests=30)
    reqs, aborted = list(pending), set()
    for _ in range(3000):
        while pending and rng.random() < 0.3:
            engine.add(*pending.pop(0))
        if sched.requests and rng.random() < 0.03:
            rid = rng.choice(sorted(sched.requests))
            assert all(s.finish_reason == "abort" for s in sched.abort(rid))
            aborted.add(rid)
        if not pending and not sched.has_unfinished() and idle(engine):
            break
        engine.step()
    check_outputs(engine, reqs, skip=aborted)
    assert_no_leaks(sched)


def test_randomized_arrivals_aborts_and_tiny_caches():
    for seed in range(20):
        rng = random.Random(100 + seed)
        sched = make_scheduler(
            num_blocks=rng.randrange(13, 40),  # the biggest request needs 13 blocks
            max_num_seqs=rng.randrange(1, 9),
            max_num_batched_tokens=rng.choice([8, 13, 32, 512]),
            enable_prefix_caching=rng.random() < 0.7,
            max_model_len=64,
        )
        drive_random_workload(FakeEngine(sched), sched, rng, seed)


def test_chunked_prefill_splits_a_long_prompt_while_decodes_run():
    sched = make_scheduler(max_num_batched_tokens=8)
    engine = FakeEngine(sched, eos=False)
    (a,) = engine.add("a", [5, 6, 7], max_tokens=30)
    engine.step()  # a's prefill; from now on a decodes
    (b,) = engine.add("b", list(range(1, 31)), max_tokens=3)
    chunks = []
    while b.num_output_tokens == 0:
        if len(chunks) == 2:
            # Put the prefill ahead of the decode in admission order (as a block-limited chunk
            # can leave it): the decode must still come first.
            sched.running = {b.seq_id: b, a.seq_id: a}
        out = engine.step()
        by_seq = {i.seq.seq_id: i for i in out.scheduled}
        assert by_seq[a.seq_id].num_new_tokens == 1 and by_seq[a.seq_id].sample
        item = by_seq[b.seq_id]
        chunks.append((item.num_computed_tokens, item.num_new_tokens, item.sample))
    # 30 prompt tokens in chunks of the 7 tokens left beside a's decode; sampled once, at the end.
    assert chunks == [(0, 7, False), (7, 7, False), (14, 7, False), (21, 7, False), (28, 2, True)]
    engine.run()
    check_outputs(engine, [("a", [5, 6, 7], 30, 1), ("b", list(range(1, 31)), 3, 1)])
    assert_no_leaks(sched)


def test_max_num_seqs_is_respected_and_queue_is_fifo():
    sched = make_scheduler(max_num_seqs=3)
    engine = FakeEngine(sched, eos=False)
    reqs = [(f"r{i}", [i + 1] * 5, 4, 1) for i in range(8)]
    for req in reqs:
        engine.add(*req)
    admitted = []
    while sched.has_unfinished():
        out = engine.step()
        assert sched.num_running <= 3 and len(out.scheduled) <= 3
        admitted += [i.seq.request_id for i in out.scheduled if i.num_computed_tokens == 0]
    assert admitted == [rid for rid, *_ in reqs]
    check_outputs(engine, reqs)
    assert_no_leaks(sched)


def test_preemption_takes_the_newest_and_requeues_it_first():
    sched = make_scheduler(num_blocks=6, max_num_seqs=3)
    engine = FakeEngine(sched, eos=False)
    a, b, c, d = (engine.add(r, [i + 1, 2, 3, 4], max_tokens=12)[0] for i, r in enumerate("abcd"))
    for _ in range(20):
        preempted = engine.step().preempted
        if preempted:
            break
    # All three decode at position 8 and need a 3rd block; the cache has 6: c makes way.
    assert preempted == [c] and list(sched.waiting) == [c, d] and c.status is SequenceStatus.WAITING
    assert c.block_table == [] and c.num_computed_tokens == 0 and c.num_output_tokens == 5
    assert [s.seq_id for s in sched.running.values()] == [a.seq_id, b.seq_id]
    admitted = []  # (request, tokens already computed) when a waiting sequence gets in
    while sched.has_unfinished():
        waiting = {s.seq_id for s in sched.waiting}
        out = engine.step()
        admitted += [
            (i.seq.request_id, i.num_computed_tokens)
            for i in out.scheduled
            if i.seq.seq_id in waiting
        ]
    check_outputs(engine, [(r, [i + 1, 2, 3, 4], 12, 1) for i, r in enumerate("abcd")])
    # b is preempted later at position 12 and recomputed: its two full blocks were still cached.
    assert ("b", 8) in admitted and b.num_preemptions == 1
    # num_cached_tokens reports the prefix-cache hit at first admission only.
    assert [s.num_cached_tokens for s in (a, b, c, d)] == [0, 0, 0, 0]
    assert_no_leaks(sched)


def test_admission_rejects_requests_that_can_never_run():
    sched = make_scheduler(num_blocks=4, max_model_len=20)  # the cache holds 16 tokens
    with pytest.raises(ValueError, match="max_model_len=20"):
        sched.add(Sequence("long", list(range(15)), Params(max_tokens=6)))
    with pytest.raises(ValueError, match="needs up to 5 KV-cache blocks"):
        sched.add(Sequence("big", list(range(10)), Params(max_tokens=8)))
    with pytest.raises(ValueError, match="no room to generate"):
        sched.add(Sequence("none", list(range(20)), Params(max_tokens=None)))
    with pytest.raises(ValueError, match="KV-cache blocks"):  # None = up to max_model_len
        sched.add(Sequence("none2", list(range(5)), Params(max_tokens=None)))
    with pytest.raises(ValueError, match="empty"):
        Sequence("empty", [])
    assert not sched.has_unfinished() and not sched.requests
    # Exactly at the limits: 10 + 7 tokens, the last never cached -> 16 slots = 4 blocks.
    engine = FakeEngine(sched, eos=False)
    engine.add("edge", list(range(1, 11)), max_tokens=7)
    engine.add("edge2", list(range(2, 12)), max_tokens=7)
    engine.run()
    check_outputs(engine, [("edge", list(range(1, 11)), 7, 1), ("edge2", list(range(2, 12)), 7, 1)])
    assert_no_leaks(sched)


def test_abort_waiting_and_running_frees_blocks_at_once():
    sched = make_scheduler(max_num_seqs=1)
    engine = FakeEngine(sched, eos=False)
    (a,) = engine.add("a", list(range(1, 10)), max_tokens=10)
    (b,) = engine.add("b", list(range(1, 10)), max_tokens=10)
    engine.step()
    assert a.status is SequenceStatus.RUNNING and b.status is SequenceStatus.WAITING
    assert sched.abort("b") == [b] and b.finish_reason == "abort" and sched.num_waiting == 0
    assert sched.abort("a") == [a] and a.is_finished and a.block_table == []
    assert sched.abort("a") == [] and sched.abort("never-seen") == []
    assert_no_leaks(sched)


def test_abort_between_schedule_and_update_is_skipped():
    sched = make_scheduler()
    (a,) = [Sequence("a", [1, 2, 3], Params(4))]
    (b,) = [Sequence("b", [4, 5, 6], Params(4))]
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.abort("a")
    assert sched.update(out, {a.seq_id: 9, b.seq_id: 9}) == [b]
    assert a.output_token_ids == [] and b.output_token_ids == [9]
    sched.abort("b")
    assert_no_leaks(sched)


def test_n_samples_share_the_prompt_blocks():
    sched = make_scheduler()
    engine = FakeEngine(sched, eos=False)
    prompt = list(range(1, 21))  # 5 full blocks
    s0, s1, s2 = engine.add("multi", prompt, max_tokens=6, n=3)
    (other,) = engine.add("other", [9, 9, 9], max_tokens=2)
    out = engine.step()
    # Only one sample computes the prompt; its siblings wait a step, the next request does not.
    assert [i.seq for i in out.scheduled] == [s0, other]
    out = engine.step()
    new = {i.seq.seq_id: i for i in out.scheduled}
    for s in (s1, s2):  # every prompt block but the one holding the last token is a cache hit
        assert new[s.seq_id].num_computed_tokens == 16 and s.num_cached_tokens == 16
        assert s.block_table[:4] == s0.block_table[:4]
    assert all(sched.block_manager.ref_counts[blk] == 3 for blk in s0.block_table[:4])
    assert s0.num_cached_tokens == 0
    engine.step()
    assert {s.seq_id for s in sched.abort("multi")} == {s0.seq_id, s1.seq_id, s2.seq_id}
    engine.run()
    assert_no_leaks(sched)


def test_async_schedule_runs_one_placeholder_ahead():
    """Step N+1 scheduled before step N's update: a decoding sequence gets one placeholder row
    (its token arrives later), one whose tokens in flight reach max_tokens is left out, and a
    sequence preempted with a token in flight is admitted again only once the token is in."""
    sched = make_scheduler(num_blocks=16, max_model_len=64, max_num_seqs=4)
    short = Sequence("short", [1, 2, 3], Params(1))
    long = Sequence("long", [4, 5, 6], Params(8))
    for seq in (short, long):
        sched.add(seq)
    first = sched.schedule()
    assert [(i.seq, i.sample) for i in first.scheduled] == [(short, True), (long, True)]
    assert short.num_output_placeholders == long.num_output_placeholders == 1
    second = sched.schedule()  # short's one token is in flight: nothing more to compute
    assert [(i.seq, i.num_computed_tokens, i.num_new_tokens) for i in second.scheduled] == [
        (long, 3, 1)]
    assert long.num_output_placeholders == 2 and long.num_computed_tokens == 4
    assert [s.token_ids for s in sched.update(first, {short.seq_id: 7, long.seq_id: 8})] == [
        [1, 2, 3, 7], [4, 5, 6, 8]]
    sched.finish(short, "length")
    assert long.num_output_placeholders == 1
    sched.update(second, {long.seq_id: 9})
    assert long.token_ids == [4, 5, 6, 8, 9] and long.num_output_placeholders == 0
    sched.check_invariants()

    # Preemption with a token in flight: the victim waits for its token before readmission.
    sched = make_scheduler(num_blocks=4, max_model_len=64, max_num_seqs=4)
    a, b = Sequence("a", list(range(1, 9)), Params(2)), Sequence("b", list(range(9, 16)), Params(2))
    for seq in (a, b):
        sched.add(seq)
    step = sched.schedule()  # all 4 blocks taken: a's 2 full, b's with one free slot
    assert [i.seq for i in step.scheduled] == [a, b]
    nxt = sched.schedule()  # a's placeholder needs a block: b (not scheduled yet) is preempted
    assert nxt.preempted == [b] and [i.seq for i in nxt.scheduled] == [a]
    assert b.status is SequenceStatus.WAITING and b.num_output_placeholders == 1
    assert sched.schedule().scheduled == []  # a's last token is in flight; b's token is not in
    sched.update(step, {a.seq_id: 20, b.seq_id: 21})
    assert b.token_ids[-1] == 21 and b.num_output_placeholders == 0
    sched.update(nxt, {a.seq_id: 22})
    sched.finish(a, "length")
    again = sched.schedule()  # b recomputes prompt + its token
    assert [(i.seq, i.num_new_tokens) for i in again.scheduled] == [(b, 8)]
    sched.check_invariants()


class PipelinedFakeEngine(FakeEngine):
    """Up to pipeline_parallel_size batches in flight (engine/batch_queue.py): a batch stores
    and reads its K/V when it is finished, oldest first, through the slots and block tables it
    was scheduled with, as the pipeline's stages run it after every earlier batch and before
    every later one."""

    def __init__(self, sched: Scheduler, eos: bool = True):
        super().__init__(sched, eos)
        self.batches: deque = deque()
        self.max_in_flight = 0

    def step(self):
        sched = self.sched
        while len(self.batches) < sched.max_concurrent_batches:
            out = sched.schedule()
            self.num_preemptions += len(out.preempted)
            if out.is_empty:
                break
            ids = {i.seq.seq_id for i in out.scheduled}
            assert all(ids.isdisjoint(i.seq.seq_id for i in b[0].scheduled)
                       for b in self.batches)  # no sequence in two batches in flight
            self.batches.append((out, [list(i.seq.block_table) for i in out.scheduled],
                                 [list(i.seq.token_ids) for i in out.scheduled]))
        self.max_in_flight = max(self.max_in_flight, len(self.batches))
        if not self.batches:
            return
        out, tables, tokens = self.batches.popleft()
        sampled = {}
        for item, table, toks in zip(out.scheduled, tables, tokens):
            start = item.num_computed_tokens
            end = start + item.num_new_tokens
            slots = [table[p // BS] * BS + p % BS for p in range(end)]
            for pos in range(start, end):
                self.kv[slots[pos]] = (toks[pos], pos)
            context = [self.kv[s] for s in slots]
            assert context == [(t, p) for p, t in enumerate(toks[:end])]
            assert item.sample == (end == len(toks))
            if item.sample:
                sampled[item.seq.seq_id] = fake_next_token(toks[:end], item.seq.index)
        self.update(out, sampled)


@pytest.mark.parametrize("pp", [2, 3])
def test_pipelined_batches_in_flight_with_aborts_and_preemption(pp):
    """pipeline_parallel_size batches scheduled before the oldest is updated: disjoint, every
    request's output right (block reuse after an abort or a preemption included), no leak."""
    most, preemptions = 0, 0
    for seed in range(10):
        rng = random.Random(200 + seed)
        sched = make_scheduler(
            num_blocks=rng.randrange(13, 40), max_num_seqs=rng.randrange(2, 9),
            max_num_batched_tokens=rng.choice([8, 13, 32, 512]),
            enable_prefix_caching=rng.random() < 0.7, max_model_len=64,
            pipeline_parallel_size=pp,
        )
        engine = PipelinedFakeEngine(sched)  # aborts come often while their batch is in flight
        drive_random_workload(engine, sched, rng, seed, idle=lambda e: not e.batches)
        assert not sched.in_flight and sched.num_batches_in_flight == 0
        most = max(most, engine.max_in_flight)
        preemptions += engine.num_preemptions
    assert most == pp and preemptions > 0


def test_pipelined_decodes_are_spread_over_the_free_batch_slots():
    sched = make_scheduler(max_num_batched_tokens=64, pipeline_parallel_size=2)
    seqs = [Sequence(f"r{i}", [1 + i, 2, 3], Params(8)) for i in range(5)]
    for seq in seqs:
        sched.add(seq)
    first = sched.schedule()  # all 5 prompts: they are waiting, not running
    assert [i.seq for i in first.scheduled] == seqs and sched.schedule().is_empty
    sched.update(first, {s.seq_id: 9 for s in seqs})
    a, b = sched.schedule(), sched.schedule()  # 2 slots free: 3 decodes, then the other 2
    assert [i.seq for i in a.scheduled] == seqs[:3] and [i.seq for i in b.scheduled] == seqs[3:]
    sched.update(a, {s.seq_id: 9 for s in seqs[:3]})
    assert [i.seq for i in sched.schedule().scheduled] == seqs[:3]  # 1 slot free: all it may
