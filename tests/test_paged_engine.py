"""The paged engine: block manager invariants and utilization, chunked prefill, preemption, and every
request's tokens against generating it alone."""
import pytest
import torch

import paged_engine
import serving
from conftest import TINY
from paged_engine import BlockManager, PagedEngine, Scheduler, Sequence
from test_batching import SEQLEN, assert_same, one_at_a_time, random_requests


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


def engine(tiny_models, n_blocks=64, block_size=4, max_seqs=3, chunk_size=None):
    eng = PagedEngine(tiny_models[0], n_blocks, block_size, max_seqs, chunk_size)
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
