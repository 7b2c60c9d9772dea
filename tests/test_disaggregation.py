"""Disaggregated prefill and decode (disaggregation.py, main_disaggregation.py). The hand-over in one
process against the model's own KV cache and generate_kvcache; then 2 local gloo processes started with
torchrun (tests/disagg_worker.py, a tiny model, seconds each): tokens against one process, corrupted
transfers recomputed, a dead and a silent prefill worker."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY, as_torchrun_rank_0, renders_on_its_page

import main_disaggregation
from gptlite_kvcache import generate_kvcache, prefill
from lib import distributed, files
from lib.disaggregation import LiveClock, admit_prefilled, checksum, engine_parts, kv_of, makespan_throughput
from lib.paged_engine import Sequence

WORKER = Path(__file__).resolve().parent / "disagg_worker.py"
LATE_RANK = Path(__file__).resolve().parent / "late_rank.py"  # runs a worker with one rank seconds late
SEQLEN = TINY["seqlen"]


def prefill_elsewhere(cached, prompt):
    """The prefill worker's side for one prompt: its first token and payload [2, L, P, H, D]."""
    scheduler, runner = engine_parts(cached, n_blocks=8, block_size=4, max_seqs=2)
    seq = Sequence(0, prompt.tolist(), 1)
    scheduler.add(seq)
    batch = scheduler.schedule()
    token = runner.run(batch, scheduler.block_manager).tolist()[0]
    return token, kv_of(runner, scheduler.block_manager, seq, len(prompt))


def decode_here(cached, prompt, token, payload, n_tokens):
    """The decode worker's side: admit the payload into a fresh pool and decode to n_tokens tokens."""
    scheduler, runner = engine_parts(cached, n_blocks=8, block_size=4, max_seqs=2)
    seq = Sequence(7, prompt.tolist(), n_tokens, output=[token])
    assert admit_prefilled(scheduler, runner, seq, payload)
    while not seq.done:
        batch = scheduler.schedule()
        assert batch == [(seq, 1)]  # decode steps only: the prompt is never computed here
        scheduler.update(batch, runner.run(batch, scheduler.block_manager).tolist())
    return torch.tensor(seq.tokens)


def test_the_payload_holds_the_keys_and_values_of_the_models_own_cache(tiny_models):
    _, cached = tiny_models
    prompt = torch.randint(65, (7,), generator=torch.Generator().manual_seed(3))
    token, payload = prefill_elsewhere(cached, prompt)
    assert payload.shape == (2, TINY["n_layers"], 7, TINY["n_heads"], TINY["d_head"])
    first, cache = prefill(cached, prompt[None], None, SEQLEN)
    for layer, (keys, values) in enumerate(cache):  # [1, H, P, D] per layer
        assert torch.allclose(payload[0, layer], keys[0].transpose(0, 1), atol=1e-5, rtol=0)
        assert torch.allclose(payload[1, layer], values[0].transpose(0, 1), atol=1e-5, rtol=0)
    assert token == first.item()


@pytest.mark.parametrize("prompt_len, n_tokens", [(1, 6), (5, 1 + 3), (8, 8)])  # block edges: 4-token blocks
def test_a_request_handed_over_decodes_the_tokens_of_generate_kvcache(tiny_models, prompt_len, n_tokens):
    _, cached = tiny_models
    prompt = torch.randint(65, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len))
    token, payload = prefill_elsewhere(cached, prompt)
    expected = generate_kvcache(cached, prompt[None], n_tokens, SEQLEN)[0]
    assert torch.equal(decode_here(cached, prompt, token, payload, n_tokens), expected)


def test_a_wrong_payload_changes_the_tokens_so_the_check_has_teeth(tiny_models):
    _, cached = tiny_models
    prompt = torch.randint(65, (8,), generator=torch.Generator().manual_seed(8))
    token, _ = prefill_elsewhere(cached, prompt)
    _, other = prefill_elsewhere(cached, torch.randint(65, (8,), generator=torch.Generator().manual_seed(9)))
    expected = generate_kvcache(cached, prompt[None], 8, SEQLEN)[0]
    assert not torch.equal(decode_here(cached, prompt, token, other, 8), expected)  # another prompt's keys


def test_handed_over_requests_preempted_by_a_full_pool_are_recomputed_to_the_same_tokens(tiny_models):
    _, cached = tiny_models
    scheduler, runner = engine_parts(cached, n_blocks=4, block_size=4, max_seqs=2)  # 16 slots for 2 x 15 tokens
    prompts = [torch.randint(65, (7,), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    seqs = []
    for i, prompt in enumerate(prompts):
        token, payload = prefill_elsewhere(cached, prompt)
        seqs.append(Sequence(i, prompt.tolist(), 8, output=[token]))
        assert admit_prefilled(scheduler, runner, seqs[-1], payload)
    while scheduler.running or scheduler.waiting:
        batch = scheduler.schedule()
        scheduler.update(batch, runner.run(batch, scheduler.block_manager).tolist())
    assert scheduler.n_preemptions > 0
    for seq, prompt in zip(seqs, prompts):
        assert torch.equal(torch.tensor(seq.tokens), generate_kvcache(cached, prompt[None], 8, SEQLEN)[0])


def test_admission_waits_for_a_batch_slot_and_free_blocks(tiny_models):
    _, cached = tiny_models
    scheduler, runner = engine_parts(cached, n_blocks=3, block_size=4, max_seqs=1)
    payload = torch.zeros(2, TINY["n_layers"], 9, TINY["n_heads"], TINY["d_head"])  # 9 tokens: 3 blocks
    assert admit_prefilled(scheduler, runner, Sequence(0, [1] * 9, 4, output=[2]), payload)
    assert not admit_prefilled(scheduler, runner, Sequence(1, [1], 4, output=[2]), payload[:, :, :1])  # no slot
    scheduler.max_seqs = 2
    assert not admit_prefilled(scheduler, runner, Sequence(1, [1], 4, output=[2]), payload[:, :, :1])  # no block
    scheduler.block_manager.check_invariants({0: 9})


def test_the_checksum_sees_one_changed_word():
    payload = torch.randn(2, 2, 5, 3, 8, generator=torch.Generator().manual_seed(0))
    changed = payload.clone()
    changed.view(-1)[17] = torch.nextafter(changed.view(-1)[17], torch.tensor(1e9))  # the smallest change
    assert checksum(payload) == checksum(payload.clone()) != checksum(changed)


def test_the_live_clock_admits_a_request_only_once_its_arrival_has_passed():
    clock = LiveClock([0.0, 0.05], [2, 1])
    assert clock.arrived(0) and not clock.arrived(1)
    clock.wait_for(1)
    assert clock.arrived(1) and clock.now >= 0.05
    with clock.step(rows=0):
        pass
    clock.token(0, 1), clock.token(0, 2), clock.token(1, 1)
    assert clock.last[0] == clock.last[1] == clock.now and clock.n_steps == 1
    assert makespan_throughput(clock) == 3 / clock.now


# ----------------------------------------------------------------------------------------------------
# 2 processes with torchrun (gloo on CPU).

def run_worker(mode, tmp_path, timeout_s=300):
    out = tmp_path / "out.json"
    # a dead rank: torchrun looks at its workers every 8 s, so that the survivor can report before it is ended
    result = distributed.launch(WORKER, [mode, out], nproc=2, timeout_s=timeout_s, monitor_s=8 if mode == "die" else None)
    return result, (json.loads(out.read_text()) if out.exists() else None)


def test_two_workers_give_every_request_the_tokens_of_generate_kvcache_and_recompute_corrupted_transfers(tmp_path):
    result, out = run_worker("check", tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    for run in ("clean", "corrupt"):  # the second run: requests 1 and 4 arrive with another checksum
        r = out[run]
        assert r["outputs"] == out["reference"]
        assert [len(o) - p for o, p in zip(r["outputs"], out["prompt_lens"])] == out["n_tokens"]
        assert r["failed_transfers"] == (2 if run == "corrupt" else 0)
        # header + payload of [2, L, P, H, D] float32 per request, as the prefill worker sent them
        assert r["kv_bytes"] == [2 * 2 * p * 3 * 8 * 4 for p in out["prompt_lens"]]
        assert all(f <= last for f, last in zip(r["first"], r["last"]))  # one clock: the decode worker's


def test_a_prefill_worker_that_starts_and_sends_seconds_late_does_not_fail_a_correct_run(tmp_path):
    """A busy machine starts the prefill worker seconds after the decode worker and delays its first
    transfer: the start-up and the receives of a correct run wait for it (only the tests of a dead or
    silent peer use 3 s)."""
    out = tmp_path / "out.json"
    result = distributed.launch(LATE_RANK, [0, 5, WORKER, "check", out], nproc=2, timeout_s=300)
    assert result.returncode == 0, result.stderr[-2000:]
    saved = json.loads(out.read_text())
    assert saved["clean"]["outputs"] == saved["corrupt"]["outputs"] == saved["reference"]


def test_the_script_starts_itself_on_two_processes_and_writes_a_row_per_variant(tmp_path):
    """The smoke run of its docstring (random weights, 8 requests), as `python reproduce.py --quick` runs it."""
    out = tmp_path / "disagg.json"
    done = subprocess.run([sys.executable, "main_disaggregation.py", "--untrained", "--n-requests", "8", "--repeats",
                           "1", "--device", "cpu", "--json", str(out)], cwd=files.ROOT, capture_output=True, text=True,
                          timeout=900, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["script"] == "main_disaggregation.py" and result["untrained"] and len(result["rows"]) == 4
    assert all(row["tokens_per_s"] > 0 for row in result["rows"])
    renders_on_its_page("main_disaggregation", result)


def test_a_prefill_worker_out_of_memory_says_so_and_is_not_reported_as_a_dead_peer(tmp_path):
    result, out = run_worker("oom", tmp_path)
    assert result.returncode != 0 and out is None
    assert "error: rank 0 ran out of memory" in result.stderr
    assert "this is its own error, not a peer's: lower --batch-size" in result.stderr
    assert "rank 0: a torch.distributed call failed" not in result.stderr


def test_a_prefill_worker_that_dies_stops_the_run_with_a_clear_error(tmp_path):
    result, out = run_worker("die", tmp_path)
    assert result.returncode != 0 and out is None
    assert "Root Cause" in result.stderr and "exitcode  : 3" in result.stderr and "rank      : 0" in result.stderr


def test_a_prefill_worker_that_stops_answering_gives_a_clear_error_after_the_timeout(tmp_path):
    result, out = run_worker("hang", tmp_path)
    assert result.returncode != 0 and out is None
    assert "error: rank 1: a torch.distributed call failed" in result.stderr
    assert "did not answer within 3 s" in result.stderr


# ----------------------------------------------------------------------------------------------------
# The script's flags: clear errors before any work (nothing is launched).

@pytest.mark.parametrize("argv, message", [
    (["--rate", "0"], "--rate: must be a finite number in \\(0, 1e\\+06\\], got 0"),
    (["--prompt-median", "128"], "--prompt-median must be between 1 and seqlen-1=127"),
    (["--block-size", "129"], "--block-size must be at most seqlen=128"),
    (["--batch-size", "0"], "must be an integer >= 1|at least 1"),
    (["--batch-size", "1000000000000"], "--batch-size: must be at least 1 and at most 65,536, got 1000000000000"),
    (["--n-requests", "1000000000000"], "--n-requests: must be at least 1 and at most 100,000,000, got 1000000000000"),
    (["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "tpu"], "CUDA|only cpu and cuda"),
])
def test_bad_flags_are_clear_errors_before_any_work(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(distributed, "launch", lambda *a, **k: pytest.fail("launched despite a bad flag"))
    with pytest.raises(SystemExit):
        main_disaggregation.main(argv + ["--untrained"])
    assert re.search(message, capsys.readouterr().err)


def test_the_headline_is_worded_from_the_runs_own_rows():
    names = ["colocated, whole prompts (1 thread)", "colocated, whole prompts (2 threads)",
             "colocated, chunked prefill 16 (2 threads)", "disaggregated, 1 prefill + 1 decode worker (1 thread each)"]
    rows = [dict(variant=n, tpot_p99_ms=9.0 - i, ttft_arrival_ms=20.0 + i, kv_sent_KB=None if i < 3 else 12.4,
                 send_ms=None if i < 3 else 0.123) for i, n in enumerate(names)]
    assert main_disaggregation.headline(rows) == {
        "technique": "disaggregated prefill and decode, 2 gloo workers against the colocated paged engine, equal CPU",
        "figure": "p99 TPOT 6.0 ms against 8.0 colocated (7.0 chunked); p50 TTFT 23.0 against 21.0 ms; 12 KB of KV "
                  "per request, sent in 0.12 ms; the same tokens"}


def test_a_world_of_other_than_two_processes_is_refused(capsys, monkeypatch):
    as_torchrun_rank_0(monkeypatch, 3)
    with pytest.raises(SystemExit):
        main_disaggregation.main(["--untrained"])
    assert "exactly 2 processes" in capsys.readouterr().err
