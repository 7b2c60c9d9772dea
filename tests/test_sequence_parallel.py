"""Sequence parallelism (gptlite_sp.py, main_sequence_parallel.py): the layouts and the log-sum-exp merge in
one process; 3 local gloo ranks under torchrun (tests/sp_worker.py, a tiny rotary GPTlite, seconds) give
the single process's attention, logits, keys and values and tokens with ring, zigzag and Ulysses, at a
length that P does not divide too; a rank that dies or goes silent mid-ring is a clear error; bad flags
are refused before any work; the script runs on 2 ranks."""
import json
import os
import sys
from pathlib import Path

import pytest
import torch

import main_sequence_parallel as msp
from conftest import as_torchrun_rank_0, renders_on_its_page
from gptlite import scaled_dot_product_attention
from gptlite_rope import GPTlite_RoPE
from gptlite_sp import Layout, attend_block, check_ulysses_size, merge_, ring_attention, sp_prefill, ulysses_attention
from lib import distributed, harness

WORKER = Path(__file__).resolve().parent / "sp_worker.py"
SCRIPT = Path(__file__).resolve().parent.parent / "main_sequence_parallel.py"
ATOL, MODEL_ATOL = 1e-5, 1e-4  # float32 attention outputs; logits and cached keys/values after 2 layers


def qkv(seq_len, seed=0, B=2, H=4, D=8):
    return torch.randn(3, B, H, seq_len, D, generator=torch.Generator().manual_seed(seed)).unbind(0)


# ----------------------------------------------------------------------------------------------------
# One process: layouts, the merge, ring attention on one rank, the rotary prefill past its window.

@pytest.mark.parametrize("seq_len, world, zigzag", [(12, 3, False), (13, 3, False), (12, 2, True), (13, 3, True)])
def test_a_layout_gives_every_token_to_one_rank_in_chunks_one_token_apart(seq_len, world, zigzag):
    layout = Layout(seq_len, world, zigzag)
    positions = torch.cat([layout.positions(r) for r in range(world)])
    assert sorted(positions.tolist()) == list(range(seq_len))
    sizes = [e - s for r in range(world) for s, e in layout.chunks(r)]
    assert max(sizes) - min(sizes) <= 1
    x = torch.arange(seq_len).view(1, seq_len, 1)
    for r in range(world):
        assert torch.equal(layout.shard(x, r, dim=1).flatten(), layout.positions(r))
    if zigzag:  # rank r: chunks r and 2P-1-r of the 2P, in position order
        chunks = sorted(c for r in range(world) for c in layout.chunks(r))
        assert all(layout.chunks(r) == [chunks[r], chunks[2 * world - 1 - r]] for r in range(world))


@pytest.mark.parametrize("check_len, world, lengths", [(1000, 2, (1000, 999)), (1, 2, (8, 7)), (10, 3, (12, 11))])
def test_the_check_lengths_are_a_multiple_of_2p_and_one_less_both_long_enough_for_zigzag(check_len, world, lengths):
    assert msp.check_lengths(check_len, world) == lengths
    assert Layout(lengths[1], world, zigzag=True).length(0) >= 1


def test_a_sequence_shorter_than_its_chunks_is_refused():
    with pytest.raises(ValueError, match="cannot be cut into the 4 chunks of zigzag over 2"):
        Layout(3, 2, zigzag=True)


def test_merging_two_blocks_of_keys_gives_attention_over_both_and_its_log_sum_exp():
    q, k, v = qkv(20)
    out = torch.empty_like(q[:, :, 12:])
    lse = merge_(out, None, *attend_block(q[:, :, 12:], k[:, :, :12], v[:, :, :12], causal=False))
    lse = merge_(out, lse, *attend_block(q[:, :, 12:], k[:, :, 12:], v[:, :, 12:], causal=True))
    assert torch.allclose(out, scaled_dot_product_attention(q, k, v)[:, :, 12:], atol=ATOL, rtol=0)
    scores = (q @ k.transpose(-2, -1) / 8**0.5).masked_fill(~torch.ones(20, 20, dtype=torch.bool).tril(), -torch.inf)
    assert torch.allclose(lse, scores.logsumexp(-1)[:, :, 12:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("seq_len", [16, 15])
def test_one_rank_ring_and_zigzag_are_explicit_attention(seq_len):
    q, k, v = qkv(seq_len)
    for zigzag in (False, True):  # zigzag on one rank: two chunks merged
        out = ring_attention(q, k, v, Layout(seq_len, 1, zigzag), 0)
        assert (out - scaled_dot_product_attention(q, k, v)).abs().max() <= ATOL


@pytest.mark.parametrize("n_heads, world", [(4, 3), (4, 8), (6, 4)])
def test_ulysses_refuses_ranks_that_do_not_divide_the_heads(n_heads, world):
    with pytest.raises(ValueError, match=f"Ulysses splits the {n_heads} heads.*at most {n_heads} ranks"):
        check_ulysses_size(n_heads, world)
    with pytest.raises(ValueError, match="contiguous shards"):
        ulysses_attention(*qkv(8), Layout(8, 1, zigzag=True), 0)


def test_the_rotary_prefill_on_shards_runs_past_the_window_as_the_rotary_model():
    torch.manual_seed(0)
    config = dict(vocab_size=65, d_model=24, n_heads=4, d_head=4, n_layers=2, dropout_p=0.0, seqlen=16)
    model = GPTlite_RoPE(**config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    ref = GPTlite_RoPE(**dict(config, seqlen=41)).eval()
    ref.load_state_dict(model.state_dict())
    idx = torch.randint(65, (2, 41), generator=torch.Generator().manual_seed(0))
    layout = Layout(41, 1, zigzag=True)
    logits, cache = sp_prefill(model, idx, layout, 0, lambda q, k, v: ring_attention(q, k, v, layout, 0))
    expected, expected_cache = ref(idx)
    assert (logits - expected).abs().max() <= MODEL_ATOL and expected.abs().max() > 1  # not a near-zero model
    assert all((a - b).abs().max() <= MODEL_ATOL for kv, ref in zip(cache, expected_cache) for a, b in zip(kv, ref))


# ----------------------------------------------------------------------------------------------------
# 3 processes with torchrun (gloo on CPU).

@pytest.fixture(scope="module")
def worker_figures(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp") / "out.json"
    result = distributed.launch(WORKER, ["check", out], nproc=3, timeout_s=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(out.read_text())


def test_three_ranks_give_the_single_process_attention_logits_cache_and_tokens(worker_figures):
    figures = worker_figures["figures"]
    assert worker_figures["world_size"] == 3
    assert set(figures) == {f"{n}/{m}" for n in (48, 47) for m in ("ring", "zigzag", "ulysses")}
    for name, f in figures.items():
        assert f["attn_diff"] <= ATOL, name
        assert f["logits_diff"] <= MODEL_ATOL and f["kv_diff"] <= MODEL_ATOL, name
        assert f["tokens_differ"] == 0, name
        seq_len = int(name.split("/")[0])
        assert sum(f["pairs"]) == 2 * 6 * seq_len * (seq_len + 1) // 2, name  # every causal pair, once
    assert figures["47/ring"]["shard"] == [16, 16, 15] and figures["47/zigzag"]["shard"] == [15, 16, 16]  # uneven


def test_the_ring_skips_future_blocks_and_zigzag_balances_the_work(worker_figures):
    figures = worker_figures["figures"]
    for n in (48, 47):
        ring, zigzag = figures[f"{n}/ring"], figures[f"{n}/zigzag"]
        assert ring["blocks"] == [1, 2, 3] and ring["skipped"] == [2, 1, 0]  # rank r: r full blocks + its diagonal
        assert max(ring["pairs"]) / (sum(ring["pairs"]) / 3) > 1.4
        assert zigzag["blocks"] == [7, 7, 7]  # 3 on its own chunks, then 2 a step
        assert max(zigzag["pairs"]) / (sum(zigzag["pairs"]) / 3) < 1.1
    assert figures["48/zigzag"]["pairs"] == [4704] * 3  # even chunks: exactly balanced


def test_each_rank_sends_p_minus_1_blocks_around_the_ring_and_its_share_in_ulysses(worker_figures):
    figures = worker_figures["figures"]
    block = 2 * 2 * 6 * 16 * 4 * 4  # keys and values of 16 tokens: [2, B=2, H=6, 16, D=4] float32
    assert figures["48/ring"]["sent"] == [2 * block] * 3
    # Ulysses: Q, K, V of its 16 tokens for the 4 heads of the others, then the outputs of its 2 heads' other 32
    assert figures["48/ulysses"]["sent"] == [(3 * 2 * 4 * 16 * 4 + 2 * 2 * 32 * 4) * 4] * 3


def stray_processes(marker):
    """Processes whose command line holds `marker` (a test's own temp path)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.mark.parametrize("mode, cause", [("die", "a peer process died"), ("hang", "did not answer within 3 s")])
def test_a_rank_that_dies_or_goes_silent_mid_ring_is_a_clear_error_without_stray_processes(mode, cause, tmp_path):
    out = tmp_path / "out.json"
    # past 120 s: a GPTliteError, failing; a dead rank: torchrun looks every 8 s, so that rank 0 reports first
    result = distributed.launch(WORKER, [mode, out], nproc=3, timeout_s=120, monitor_s=8 if mode == "die" else None)
    assert result.returncode != 0 and not out.exists()
    assert "error: rank 0: a torch.distributed call failed" in result.stderr and cause in result.stderr
    if mode == "die":
        assert "Root Cause" in result.stderr and "exitcode  : 3" in result.stderr
    assert stray_processes(str(tmp_path)) == []


# ----------------------------------------------------------------------------------------------------
# The script: flag errors before any work, and a smoke run on 2 ranks.

@pytest.mark.parametrize("flags, message", [
    (["--ranks", "3"], "Ulysses splits the 4 heads"),
    (["--ranks", "8"], "at most 4 ranks"),
    (["--seq-lens", "3"], "3 tokens cannot be cut into the 4 chunks"),
    (["--seq-lens", "0"], "must be at least 1"),
    (["--check-len", "0"], "must be at least 1"),
    (["--threads", str(os.cpu_count())], "CPU cores this process may use"),  # 2 ranks x all cores
    (["--seq-lens", "1000000000000"], "--seq-lens: attention over"),
    (["--plot", "out.txt"], "the plot is a PNG"),
])
def test_bad_flags_are_clear_errors_before_any_work(flags, message, capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        msp.main(["--untrained", "--device", "cpu", "--preset", "cpu"] + flags)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_ranks_that_differ_from_torchruns_world_are_an_error(capsys, monkeypatch):
    as_torchrun_rank_0(monkeypatch, 4)
    with pytest.raises(SystemExit):
        msp.main(["--ranks", "3", "--device", "cpu"])
    assert "--ranks 3 differs from torchrun's 4 processes" in capsys.readouterr().err


def test_the_script_on_two_ranks_checks_then_writes_its_rows_and_plot(real_data, tmp_path):
    out_json, out_png = tmp_path / "sp.json", tmp_path / "sp.png"
    result = distributed.run_child([sys.executable, SCRIPT, "--untrained", "--preset", "cpu", "--device", "cpu",
                                    "--seq-lens", "256", "511", "--check-len", "64", "--repeats", "1", "--json",
                                    out_json, "--plot", out_png], capture=True, timeout_s=300)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = json.loads(out_json.read_text())
    assert saved["world_size"] == 2 and saved["backend"] == "gloo"
    assert len(saved["checks"]) == 2 * 4 and all(saved["checks"].values())
    assert any(line.startswith("63 tokens, zigzag:") for line in saved["checks"])  # a length 2 does not divide
    rows = saved["rows"]
    assert [(r["variant"], r["seq_len"]) for r in rows] == [
        (v, n) for n in (256, 511) for v in ("1 rank x 2 threads", "1 rank x 1 thread", "ring", "zigzag", "ulysses")]
    for row in rows:
        split = row["ranks"] == 2
        assert row["exact"] == "yes" and row["time_ms"] > 0 and row["peak_mem_mb"] > 0
        assert (row["sent_MB"] is not None) == split and (row["work_imbalance"] is not None) == split
        assert row["threads"] == (2 if row["variant"] == "1 rank x 2 threads" else 1)
    by = {(r["variant"], r["seq_len"]): r for r in rows}
    assert by["ring", 256]["blocks"] == "1/2" and by["zigzag", 256]["blocks"] == "5/5"
    assert by["ring", 256]["work_imbalance"] > 1.4 and by["zigzag", 256]["work_imbalance"] == 1.0
    assert saved["headline"]["technique"] == "sequence parallelism (ring, zigzag, Ulysses), 2 gloo ranks"
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    renders_on_its_page("main_sequence_parallel", saved)
