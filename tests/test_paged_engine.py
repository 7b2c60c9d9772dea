"""The paged engine: block manager invariants and utilization, chunked prefill, preemption, shared prefix
blocks (reference counts, LRU eviction, copy-on-write), and every request's tokens against generating
it alone."""
import pytest
import torch
from conftest import TINY
from test_batching import SEQLEN, assert_same, one_at_a_time, random_requests

from lib import paged_engine, serving
from lib.paged_engine import BlockManager, PagedEngine, Scheduler, Sequence
from lib.prefix_cache import chain_keys


def test_block_manager_allocates_on_demand_frees_and_maps_slots():
    bm = BlockManager(n_blocks=5, block_size=4)
    bm.grow("a", 5)  # 2 blocks
    bm.grow("b", 3)  # 1 block
    assert bm.block_tables == {"a": [0, 1], "b": [2]} and bm.n_free == 2
    bm.grow("a", 8)  # still fits its 2 blocks: nothing new
    assert bm.block_tables["a"] == [0, 1]
    assert not bm.can_grow("b", 13) and bm.can_grow("b", 12)
    bm.free("a")
    bm.grow("b", 12)  # the freed blocks are reused
    assert bm.block_tables["b"] == [2, 3, 4] and bm.slots("b", 3, 6) == [2 * 4 + 3, 3 * 4 + 0, 3 * 4 + 1]
    with pytest.raises(RuntimeError, match="more blocks"):
        bm.grow("c", 9)
    bm.check_invariants({"b": 12})
    bm.free("b")
    assert bm.n_free == 5 and bm.block_tables == {}


def test_utilization_matches_a_hand_count():
    bm = BlockManager(n_blocks=8, block_size=4)
    bm.grow("a", 5)
    bm.grow("b", 3)
    assert bm.utilization({"a": 5, "b": 3}) == 8 / 12  # 8 tokens in 3 blocks of 4 slots


def test_invariant_checks_catch_a_shared_lost_or_oversized_block():
    bm = BlockManager(n_blocks=4, block_size=2)
    bm.grow("a", 3)
    bm.grow("b", 1)
    bm.check_invariants({"a": 3, "b": 1})
    bm.block_tables["b"].append(bm.block_tables["a"][0])  # two owners
    with pytest.raises(RuntimeError, match="two owners"):
        bm.check_invariants()
    bm.block_tables["b"].pop()
    bm.free_blocks.pop()  # lost
    with pytest.raises(RuntimeError, match="lost"):
        bm.check_invariants()
    bm.free_blocks.append(3)
    with pytest.raises(RuntimeError, match="holds 2 blocks for 1 tokens"):
        bm.check_invariants({"a": 1})


def engine(tiny_models, n_blocks=64, block_size=4, max_seqs=3, chunk_size=None, prefix_sharing=True):
    eng = PagedEngine(tiny_models[0], n_blocks, block_size, max_seqs, chunk_size, prefix_sharing)
    eng.check_invariants = True  # the block manager is checked after every step
    return eng


@pytest.mark.parametrize("chunk_size", [1, 7, None])  # None: whole prompts
@pytest.mark.parametrize("seed", [0, 1])
def test_engine_equals_one_request_at_a_time(tiny_models, chunk_size, seed):
    requests = random_requests(10, seed)
    eng = engine(tiny_models, chunk_size=chunk_size)
    outputs, n_steps = eng.generate(requests, SEQLEN)
    assert_same(outputs, one_at_a_time(tiny_models[1], requests))
    assert eng.block_manager.n_free == eng.block_manager.n_blocks  # every block free at the end
    assert eng.stats["preemptions"] == 0


def test_chunked_prefill_keeps_the_token_budget_and_runs_decodes_every_step(tiny_models, monkeypatch):
    requests = random_requests(8, seed=3)
    eng = engine(tiny_models, chunk_size=7, max_seqs=4)
    schedule, steps = eng.scheduler.schedule, []

    def logged_schedule():
        decoding = [s for s in eng.scheduler.running if s.n_to_compute == 1]
        batch = schedule()
        steps.append((decoding, batch))
        return batch

    monkeypatch.setattr(eng.scheduler, "schedule", logged_schedule)
    outputs, _ = eng.generate(requests, SEQLEN)
    assert_same(outputs, one_at_a_time(tiny_models[1], requests))
    mixed = 0
    for decoding, batch in steps:
        prefill = [n for seq, n in batch if n > 1 or seq not in decoding]
        assert sum(prefill) <= 7
        assert {id(s) for s in decoding} <= {id(s) for s, _ in batch}  # decodes are never held back
        mixed += bool(prefill) and bool(decoding)
    assert mixed > 0  # prompt chunks ran in the same steps as decodes
    assert max(n for _, batch in steps for _, n in batch) == 7  # long prompts really were chunked


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_preemption_under_a_tiny_pool_completes_every_request_exactly(tiny_models, chunk_size):
    requests = random_requests(10, seed=4)
    need = max(-(-(len(p) + n - 1) // 2) for p, n in requests)  # blocks of 2 tokens for the longest request
    eng = engine(tiny_models, n_blocks=need, block_size=2, max_seqs=4, chunk_size=chunk_size)
    outputs, _ = eng.generate(requests, SEQLEN)
    assert eng.stats["preemptions"] > 0
    assert_same(outputs, one_at_a_time(tiny_models[1], requests))
    assert eng.block_manager.n_free == need and not eng.block_manager.block_tables


def test_preemption_frees_the_newest_and_recomputes_it(tiny_models):
    bm = BlockManager(n_blocks=4, block_size=2)
    scheduler = Scheduler(bm, max_seqs=2)
    old, new = Sequence(0, [1, 2, 3, 4], 5), Sequence(1, [5, 6, 7], 5)
    scheduler.add(old)
    scheduler.add(new)
    batch = scheduler.schedule()  # both prompts: 2 blocks each, the pool is full
    assert [(s.seq_id, n) for s, n in batch] == [(0, 4), (1, 3)] and bm.n_free == 0
    scheduler.update(batch, [8, 9])
    batch = scheduler.schedule()  # the old one's 5th token needs a 3rd block: the new one is preempted
    assert [(s.seq_id, n) for s, n in batch] == [(0, 1)]
    assert scheduler.n_preemptions == 1 and list(scheduler.waiting) == [new] and new.n_computed == 0
    assert new.n_to_compute == 4  # its prompt and its token so far are recomputed
    bm.check_invariants({0: 5})


def test_kv_utilization_of_the_engine_matches_a_hand_count(tiny_models):
    eng = engine(tiny_models, n_blocks=8, block_size=4)
    eng.generate([(torch.tensor([1, 2, 3, 4, 5]), 3)], SEQLEN)
    # steps: prefill 5 tokens, then 6 and 7 held; 2 blocks of 4 slots each time; contiguous: 16 slots
    assert eng.stats["token_steps"] == 5 + 6 + 7
    assert eng.stats["kv_util"] == 18 / 24 and eng.stats["kv_util_contiguous"] == 18 / 48


def test_requests_arrive_on_the_engine_clock(tiny_models):
    requests = random_requests(3, seed=5)
    arrivals = [0.0, 1e3, 2e3]
    clock = serving.ServingClock(arrivals, [n for _, n in requests])
    outputs, n_steps = engine(tiny_models, chunk_size=4).generate(requests, SEQLEN, clock)
    assert_same(outputs, one_at_a_time(tiny_models[1], requests))
    assert all(a < f <= last < a + 1e3 for a, f, last in zip(arrivals, clock.first, clock.last))


def test_bad_input_is_a_clear_error_before_any_work(tiny_models, monkeypatch):
    monkeypatch.setattr(paged_engine.ModelRunner, "run", lambda *a: pytest.fail("no work before the checks"))
    good = (torch.tensor([1, 2, 3]), 4)
    with pytest.raises(ValueError, match="at least 3 blocks"):
        engine(tiny_models, n_blocks=2, block_size=3).generate([good, (torch.ones(4, dtype=torch.long), 5)], SEQLEN)
    with pytest.raises(ValueError, match="longer than the window"):
        engine(tiny_models).generate([good, (torch.ones(4, dtype=torch.long), SEQLEN - 3)], SEQLEN)
    with pytest.raises(ValueError, match="empty"):
        engine(tiny_models).generate([good, (torch.tensor([], dtype=torch.long), 1)], SEQLEN)
    with pytest.raises(ValueError, match="positive integer"):
        engine(tiny_models).generate([good, (torch.tensor([1]), 0)], SEQLEN)
    for kwargs in (dict(max_seqs=0), dict(chunk_size=0), dict(n_blocks=0), dict(block_size=0)):
        with pytest.raises(ValueError):
            engine(tiny_models, **kwargs)
    assert TINY["seqlen"] == SEQLEN


# ----------------------------------------------------------------------------------------------------
# Shared prefix blocks.

def computed(bm, seq_id, tokens):
    """What the scheduler does for a sequence whose tokens are all computed: grow, then cache."""
    bm.grow(seq_id, len(tokens))
    bm.cache(seq_id, tokens, len(tokens))


def assert_all_free_or_cached(bm):
    """The end of a run: no table, every reference count back to zero, every block free or cached."""
    bm.check_invariants()
    assert not bm.block_tables and set(bm.ref_counts) == {0} and bm.n_free == bm.n_blocks
    assert sorted(list(bm.free_blocks) + list(bm.evictable)) == list(range(bm.n_blocks))
    assert set(bm.evictable) == set(bm.cached.values())


def test_full_blocks_are_shared_by_their_parent_chained_hash():
    bm = BlockManager(n_blocks=8, block_size=2)
    assert bm.admit("a", [1, 2, 3, 4, 5]) == 0  # nothing cached yet
    computed(bm, "a", [1, 2, 3, 4, 5])
    a = bm.block_tables["a"]
    assert bm.cached == dict(zip(chain_keys([1, 2, 3, 4, 5], 2), a[:2]))  # prefix_cache's keys; no partial block
    assert bm.match([1, 2, 3, 4, 9]) == a[:2] and bm.match([1, 2, 9, 4]) == a[:1] and bm.match([9, 2, 3, 4]) == []
    assert bm.match([3, 4]) == []  # the same tokens at another place are another prefix
    assert bm.admit("b", [1, 2, 3, 4, 7, 7]) == 4  # shares a's two full blocks
    bm.grow("b", 6)
    assert bm.block_tables["b"][:2] == a[:2] and bm.ref_counts[a[0]] == bm.ref_counts[a[1]] == 2
    assert bm.n_used == 4  # a's 3 blocks and b's own third one: the shared ones count once
    bm.check_invariants({"a": 5, "b": 6})
    bm.check_writable("b", 4, 6)
    with pytest.raises(RuntimeError, match="shared or cached"):  # the check can fail
        bm.check_writable("b", 3, 5)
    bm.cache("b", [1, 2, 3, 4, 7, 7], 6)
    bm.free("a")
    bm.free("b")
    assert_all_free_or_cached(bm)
    assert len(bm.cached) == 3  # a's two blocks and b's [7, 7]: kept after their sequences ended
    assert not BlockManager(8, 2, prefix_sharing=False).match([1, 2, 3, 4])


def test_a_hash_collision_is_a_miss():
    bm = BlockManager(n_blocks=4, block_size=2)
    computed(bm, "a", [1, 2, 3])
    key = chain_keys([1, 2], 2)[0]
    bm.block_hash[bm.cached[key]] = (key, None, (5, 6))  # as if [5, 6] had hashed to the same key
    assert bm.match([1, 2, 3]) == []


def test_cached_blocks_are_evicted_least_recently_used_first_continuations_before_prefixes():
    bm = BlockManager(n_blocks=4, block_size=2)
    computed(bm, "a", [1, 2, 3, 4])
    bm.free("a")
    computed(bm, "b", [5, 6, 7, 8])
    bm.free("b")
    a, b = bm.match([1, 2, 3, 4]), bm.match([5, 6, 7, 8])
    assert len(a) == len(b) == 2 and bm.n_free == 4 and not bm.free_blocks  # every block cached, evictable
    assert list(bm.evictable) == [a[1], a[0], b[1], b[0]]  # least recently used first, a block before its parent
    assert bm.admit("c", [1, 2, 9, 9]) == 2
    bm.grow("c", 4)  # needs one block: a's second one, the least recently used, is evicted
    assert bm.n_evictions == 1 and bm.match([1, 2, 3, 4]) == a[:1] and bm.match([5, 6, 7, 8]) == b
    assert bm.admit("d", [5, 6, 7, 8, 1]) is None  # b's 2 blocks and 1 more: only b's are free
    assert bm.admit("d", [5, 6, 7, 8]) == 3 and bm.n_free == 0  # shares b's blocks: out of the evictable ones
    assert bm.admit("e", [3, 3, 3]) is None and "e" not in bm.block_tables  # no room: nothing done
    bm.check_invariants({"c": 4, "d": 4})


def test_copy_on_write_when_even_the_last_token_is_cached():
    bm = BlockManager(n_blocks=6, block_size=2)
    computed(bm, "a", [1, 2, 3, 4])
    a = list(bm.block_tables["a"])
    # b's 4 tokens are all cached, but its last one is computed again for its logits and would be
    # written into a's second block, which a holds: b gets a copy of that block instead
    assert bm.admit("b", [1, 2, 3, 4]) == 3
    b = bm.block_tables["b"]
    assert b[0] == a[0] and b[1] not in a and bm.copies == [(a[1], b[1])] and bm.n_copies == 1
    assert bm.ref_counts[a[1]] == 1 and bm.ref_counts[b[1]] == 1
    bm.check_writable("b", 3, 4)
    bm.cache("b", [1, 2, 3, 4], 4)  # the copy's hash is a's block's: it stays b's own
    assert bm.match([1, 2, 3, 4]) == a
    # when no sequence holds the cached block any more, it is taken out of the cache instead of copied
    bm.free("a")
    bm.free("b")
    bm.copies.clear()
    assert bm.admit("c", [1, 2, 3, 4]) == 3 and bm.block_tables["c"] == a and not bm.copies
    assert bm.match([1, 2, 3, 4]) == a[:1]  # uncached while c rewrites it ...
    bm.check_writable("c", 3, 4)
    bm.cache("c", [1, 2, 3, 4], 4)
    assert bm.match([1, 2, 3, 4]) == a  # ... and cached again once computed
    bm.check_invariants({"c": 4})


def test_the_runner_copies_blocks_before_the_step_writes(tiny_models):
    bm = BlockManager(n_blocks=4, block_size=2)
    runner = paged_engine.ModelRunner(tiny_models[0], 4, 2)
    runner.k_pool.normal_()
    runner.v_pool.normal_()
    k, v = runner.k_pool.clone(), runner.v_pool.clone()
    bm.copies = [(1, 3), (0, 2)]
    runner.copy_blocks(bm)
    assert torch.equal(runner.k_pool[:, 6:8], k[:, 2:4]) and torch.equal(runner.v_pool[:, 4:6], v[:, 0:2])
    assert torch.equal(runner.k_pool[:, :4], k[:, :4]) and not bm.copies


def test_invariant_checks_catch_a_wrong_reference_count_or_an_uncached_evictable_block():
    bm = BlockManager(n_blocks=4, block_size=2)
    computed(bm, "a", [1, 2, 3])
    bm.admit("b", [1, 2, 5])
    bm.grow("b", 3)
    bm.check_invariants({"a": 3, "b": 3})
    bm.ref_counts[bm.block_tables["a"][0]] = 1
    with pytest.raises(RuntimeError, match="reference count"):
        bm.check_invariants()
    bm.ref_counts[bm.block_tables["a"][0]] = 2
    bm.free("a")
    bm.free("b")
    bm.evictable[bm.free_blocks.pop()] = None
    with pytest.raises(RuntimeError, match="evictable block is not cached"):
        bm.check_invariants()


def shared_prefix_requests(n, seed, prefix_len=8):
    """n requests whose prompts start with the same prefix_len tokens, then random tokens."""
    prefix = torch.randint(TINY["vocab_size"], (prefix_len,), generator=torch.Generator().manual_seed(seed))
    return [(torch.cat([prefix, p[:SEQLEN - prefix_len - 1]]), max(1, min(n_tokens, SEQLEN - prefix_len - len(p))))
            for p, n_tokens in random_requests(n, seed + 1, max_prompt=SEQLEN - prefix_len - 1)]


def record_max_refcount(eng, monkeypatch):
    """Wrap the runner so that the largest reference count seen during the run is recorded."""
    seen, run = [0], eng.runner.run

    def recording_run(batch, bm):
        seen[0] = max(seen[0], max(bm.ref_counts))
        return run(batch, bm)
    monkeypatch.setattr(eng.runner, "run", recording_run)
    return seen


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_requests_with_a_shared_prefix_compute_it_once_and_get_the_same_tokens(tiny_models, chunk_size, monkeypatch):
    requests = shared_prefix_requests(6, seed=8)
    arrivals = [0.0] + [1e3] * 5  # the first request computes the prefix; the others come after it, together
    expected = one_at_a_time(tiny_models[1], requests)
    stats = {}
    for sharing in (False, True):
        eng = engine(tiny_models, chunk_size=chunk_size, max_seqs=6, prefix_sharing=sharing)
        seen = record_max_refcount(eng, monkeypatch)
        clock = serving.ServingClock(arrivals, [n for _, n in requests])
        outputs, _ = eng.generate(requests, SEQLEN, clock)
        assert_same(outputs, expected)
        assert_all_free_or_cached(eng.block_manager)
        stats[sharing] = dict(eng.stats, max_refcount=seen[0])
    assert stats[False]["hit_rate"] == 0 and stats[False]["max_refcount"] == 1 and stats[False]["cached_tokens"] == 0
    # the 5 later requests each find the prefix's 2 blocks of 4 tokens: 8 tokens not computed again
    assert stats[True]["cached_tokens"] == 5 * 8
    assert stats[True]["hit_rate"] == 5 * 8 / sum(len(p) for p, _ in requests)
    assert stats[False]["computed_tokens"] - stats[True]["computed_tokens"] == 5 * 8
    assert stats[True]["max_refcount"] > 1  # the prefix's blocks, held by several running requests at once
    if chunk_size is None:  # whole prompts: the 5 later requests are admitted in one step, held once
        assert stats[True]["max_refcount"] == 5 and stats[True]["blocks_peak"] < stats[False]["blocks_peak"]


def test_cached_blocks_outlive_their_requests_a_later_turn_reuses_the_answer_too(tiny_models):
    eng = engine(tiny_models, block_size=2, n_blocks=16)
    first = [(torch.tensor([3, 1, 4, 1, 5]), 6)]
    (out,), _ = eng.generate(first, SEQLEN)
    assert eng.stats["hit_rate"] == 0
    second = [(torch.cat([out, torch.tensor([2, 6])]), 3)]  # the next turn: prompt, answer, new message
    outputs, _ = eng.generate(second, SEQLEN)
    assert_same(outputs, one_at_a_time(tiny_models[1], second))
    # the first call computed its 5 prompt tokens and 5 of its 6 new ones: 5 full blocks of 2; the
    # second computes the rest of its prompt, then 2 decode tokens
    assert eng.stats["cached_tokens"] == 10 and eng.stats["computed_tokens"] == (len(second[0][0]) - 10) + 2
    assert_all_free_or_cached(eng.block_manager)


def test_copy_on_write_in_the_engine_gives_the_same_tokens(tiny_models):
    prompt = torch.tensor([7, 3, 9, 1, 4, 4, 2, 8])  # two full blocks of 4
    requests = [(prompt, 6), (prompt, 5), (prompt, 3)]
    expected = one_at_a_time(tiny_models[1], requests)
    # 1e-9 s: the second arrives right after the first step, while the first is decoding (it holds the
    # blocks: a copy); 1e3 s: the third arrives when nobody holds them (the block is uncached, no copy)
    clock = serving.ServingClock([0.0, 1e-9, 1e3], [n for _, n in requests])
    eng = engine(tiny_models)
    outputs, _ = eng.generate(requests, SEQLEN, clock)
    assert_same(outputs, expected)
    assert eng.stats["cow_copies"] == 1 and eng.stats["cached_tokens"] == 7 + 7
    assert clock.first[1] < clock.last[0]  # the second really ran beside the first
    assert_all_free_or_cached(eng.block_manager)


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_preempting_sequences_that_hold_shared_blocks_completes_every_request_exactly(tiny_models, chunk_size,
                                                                                   monkeypatch):
    requests = shared_prefix_requests(10, seed=9, prefix_len=6) + random_requests(4, seed=10)
    need = max(-(-(len(p) + n - 1) // 2) for p, n in requests)
    eng = engine(tiny_models, n_blocks=need + 1, block_size=2, max_seqs=5, chunk_size=chunk_size)
    preempted_sharing, preempt = [], eng.scheduler.preempt

    def recording_preempt(seq):
        bm = eng.block_manager
        preempted_sharing.append(any(bm.ref_counts[b] > 1 for b in bm.block_tables[seq.seq_id]))
        preempt(seq)
    monkeypatch.setattr(eng.scheduler, "preempt", recording_preempt)
    outputs, _ = eng.generate(requests, SEQLEN)
    assert_same(outputs, one_at_a_time(tiny_models[1], requests))
    assert any(preempted_sharing)  # some preempted sequence held blocks that others held too
    assert eng.stats["cached_tokens"] > 0 and eng.block_manager.n_evictions > 0
    assert_all_free_or_cached(eng.block_manager)


# ----------------------------------------------------------------------------------------------------
# Statistics as an observer of the steps; the runner through the model's own cached forward pass.

def reference_loop_stats(eng, requests, clock):
    """The engine's loop with its counters written out inline, as it was before they became an observer."""
    sched, bm = eng.scheduler, eng.block_manager
    seqs = [Sequence(i, prompt.tolist(), n) for i, (prompt, n) in enumerate(requests)]
    pending = sorted(seqs, key=lambda s: clock.arrivals[s.seq_id])
    held = paged = contiguous = computed = used = peak = n_steps = 0
    while pending or sched.waiting or sched.running:
        while pending and clock.arrived(pending[0].seq_id):
            sched.add(pending.pop(0))
        if not (sched.waiting or sched.running):
            clock.wait_for(pending[0].seq_id)
            continue
        with clock.step(rows=0):
            batch = sched.schedule()
            scheduled = {seq.seq_id: n for seq, n in batch}
            held += sum(s.n_computed + scheduled.get(s.seq_id, 0) for s in sched.running)
            paged += bm.n_used * bm.block_size
            contiguous += len(sched.running) * SEQLEN
            computed += sum(scheduled.values())
            used, peak = used + bm.n_used, max(peak, bm.n_used)
            got = sched.update(batch, eng.runner.run(batch, bm).tolist())
        for seq in got:
            clock.token(seq.seq_id, len(seq.output))
        n_steps += 1
    return dict(kv_util=held / paged, kv_util_contiguous=held / contiguous, preemptions=sched.n_preemptions,
                token_steps=held, paged_slot_steps=paged, contiguous_slot_steps=contiguous, computed_tokens=computed,
                blocks_used=used / n_steps, blocks_peak=peak, hit_rate=sched.n_cached_tokens / sched.n_admitted_tokens,
                cached_tokens=sched.n_cached_tokens, evictions=bm.n_evictions, cow_copies=bm.n_copies), \
        [torch.tensor(s.tokens) for s in seqs]


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_engine_stats_observer_counts_what_the_inline_counters_counted(tiny_models, chunk_size):
    requests = shared_prefix_requests(10, seed=9, prefix_len=6) + random_requests(4, seed=10)
    need = max(-(-(len(p) + n - 1) // 2) for p, n in requests)
    arrivals = [0.0] * (len(requests) - 4) + [1e3] * 4  # shared blocks, preemption, then later arrivals
    make = lambda **kw: PagedEngine(tiny_models[0], need + 1, 2, 5, chunk_size, **kw)  # noqa: E731
    clock = lambda: serving.ServingClock(arrivals, [n for _, n in requests])  # noqa: E731
    expected, expected_outputs = reference_loop_stats(make(), requests, clock())
    eng = make()
    outputs, _ = eng.generate(requests, SEQLEN, clock())
    assert eng.stats == expected and expected["preemptions"] > 0 and expected["cached_tokens"] > 0
    assert_same(outputs, expected_outputs)
    quiet = make(stats=False)  # no observer: the same tokens, no statistics
    assert_same(quiet.generate(requests, SEQLEN, clock())[0], expected_outputs) and quiet.stats is None


def test_runner_runs_the_models_own_forward_pass_sharing_its_weights(tiny_models, monkeypatch):
    """The runner's model is the GPTlite's cached view (the same parameter tensors); its attention is
    the model's own (a swapped kernel is used); the pool holds what the dynamic cache holds."""
    base, cached = tiny_models
    eng = engine(tiny_models)
    view = eng.runner.model
    assert all(p.data_ptr() == q.data_ptr() for p, q in zip(view.parameters(), base.parameters()))
    calls = []
    attention = type(view.blocks[0].mha).attention
    monkeypatch.setattr(type(view.blocks[0].mha), "attention",
                        lambda self, *a: calls.append(len(a)) or attention(self, *a))
    prompt = torch.tensor([5, 9, 2, 7, 1])
    (out,), _ = eng.generate([(prompt, 3)], SEQLEN)
    assert calls and set(calls) == {4}  # Q, K, V and the block tables' mask, every layer of every step
    _, kv = cached(out[None, :-1])
    slots = eng.block_manager.match(out.tolist())  # the cached full blocks, in order
    for layer, (K, V) in enumerate(kv):
        for i, block in enumerate(slots):
            pool = eng.runner.k_pool[layer, block * 4:(block + 1) * 4]  # [4, H, D]
            torch.testing.assert_close(pool, K[0, :, i * 4:(i + 1) * 4].transpose(0, 1), atol=1e-5, rtol=0)
