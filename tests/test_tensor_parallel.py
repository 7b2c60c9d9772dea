"""Tensor parallelism (gptlite_tp.py, main_tensor_parallel.py) and the torch.distributed helpers
(distributed.py). The multi-process tests start 2 local gloo processes with torchrun (tests/tp_worker.py,
a tiny model, a few seconds each) and compare them with the single-process model."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import TINY, as_torchrun_rank_0, renders_on_its_page

import inference_utils as iu
import main_tensor_parallel
from gptlite_kvcache import GPTlite_KVCache
from gptlite_tp import GPTlite_TP, check_tp_size, shard_state_dict, tensor_parallel_model
from lib import distributed, harness
from lib.errors import GPTliteError

WORKER = Path(__file__).resolve().parent / "tp_worker.py"
LATE_RANK = Path(__file__).resolve().parent / "late_rank.py"  # runs a worker with one rank seconds late
SCRIPT = Path(__file__).resolve().parent.parent / "main_tensor_parallel.py"
CONFIG = dict(TINY, n_heads=4, d_head=6)  # 4 heads for 2 ranks; n_heads * d_head (24) != d_model (32)


def random_model(config):
    torch.manual_seed(0)
    model = GPTlite_KVCache(**config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model


def run_worker(mode, tmp_path, timeout_s=300):
    out = tmp_path / "out.json"
    # a dead rank: torchrun looks at its workers every 8 s, so that the survivor can report before it is ended
    result = distributed.launch(WORKER, [mode, out], nproc=2, timeout_s=timeout_s, monitor_s=8 if mode == "die" else None)
    return result, (json.loads(out.read_text()) if out.exists() else None)


# ----------------------------------------------------------------------------------------------------
# Shards, in one process.

def test_shards_cut_heads_and_neurons_and_put_back_give_the_state_dict():
    state = random_model(CONFIG).state_dict()
    shards = [shard_state_dict(state, rank, 2) for rank in range(2)]
    q = "blocks.0.mha.query_proj.weight"
    assert shards[0][q].shape == (2 * 6, 32)  # 2 of the 4 heads of 6: output rows
    assert shards[0]["blocks.0.mha.out_proj.weight"].shape == (32, 2 * 6)  # input columns
    assert shards[0]["blocks.0.ffwd.net.0.weight"].shape == (64, 32)  # half of the 128 neurons
    assert shards[0]["blocks.0.ffwd.net.2.weight"].shape == (32, 64)
    for name, full in state.items():
        dim = 1 if name.endswith(("out_proj.weight", "net.2.weight")) else 0
        if shards[0][name].shape == full.shape:  # replicated: embeddings, LayerNorms, head, row-parallel biases
            assert all(torch.equal(s[name], full) for s in shards), name
        else:
            assert torch.equal(torch.cat([s[name] for s in shards], dim=dim), full), name
    assert torch.equal(shards[1][q], state[q][12:])  # rank 1 holds heads 2 and 3


def test_one_rank_is_the_single_process_model():
    single = random_model(CONFIG)
    tp = tensor_parallel_model(single.state_dict(), CONFIG, 0, 1)  # no process group needed for one rank
    x = torch.randint(65, (2, CONFIG["seqlen"]), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(tp(x)[0], single(x)[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("n_heads, d_ff, world_size", [(3, 128, 2), (4, 6, 4), (4, 128, 0)])
def test_a_size_that_does_not_split_heads_and_neurons_is_a_clear_error(n_heads, d_ff, world_size):
    with pytest.raises(ValueError, match="divides both|positive integer"):
        check_tp_size(n_heads, d_ff, world_size)


def test_the_model_refuses_a_world_that_does_not_split_its_heads():
    with pytest.raises(ValueError, match=r"n_heads=3 .* one of \[1\]"):
        GPTlite_TP(**TINY, world_size=2)  # 3 heads


# ----------------------------------------------------------------------------------------------------
# 2 processes with torchrun (gloo on CPU).

def test_two_ranks_give_the_single_process_logits_and_greedy_tokens(tmp_path):
    result, figures = run_worker("check", tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert figures["world_size"] == 2
    assert figures["logits_max_diff"] <= 1e-5
    assert figures["tokens_equal"] and figures["static_tokens_equal"]
    assert figures["kv_heads"] == 2 and figures["kv_bytes"] * 2 == figures["single_kv_bytes"]  # its heads only
    # two all-reduces per block: 2 layers x (1 forward + 2 generations x (1 prefill + 10 decode steps))
    assert figures["all_reduce_calls"] == 2 * 2 * (1 + 2 * 11)


def test_a_rank_that_dies_stops_the_run_with_its_rank_and_exit_code(tmp_path):
    result, figures = run_worker("die", tmp_path)
    assert result.returncode != 0 and figures is None
    assert "Root Cause" in result.stderr and "exitcode  : 3" in result.stderr
    assert "rank      : 1" in result.stderr


def test_a_rank_that_stops_answering_gives_a_clear_error_after_the_timeout(tmp_path):
    result, figures = run_worker("hang", tmp_path)
    assert result.returncode != 0 and figures is None
    assert "error: rank 0: a torch.distributed call failed" in result.stderr
    assert "did not answer within 3 s" in result.stderr


def test_a_rank_that_starts_and_answers_seconds_late_does_not_fail_a_correct_run(tmp_path):
    """A busy machine starts one rank seconds after the other and delays its steps: the start-up and the
    collectives of a correct run wait for it (only the tests of a dead or silent peer use 3 s)."""
    out = tmp_path / "out.json"
    result = distributed.launch(LATE_RANK, [1, 5, WORKER, "check", out], nproc=2, timeout_s=300)
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert figures["logits_max_diff"] <= 1e-5 and figures["tokens_equal"] and figures["static_tokens_equal"]


def test_a_short_collective_timeout_still_waits_for_a_rank_that_starts_late(tmp_path):
    """The 3 s of the silent-peer test time its collective only: joining the group waits for a rank
    that starts 5 s late (distributed.STARTUP_TIMEOUT_S), then the silent rank's collective times out."""
    result = distributed.launch(LATE_RANK, [1, 5, WORKER, "hang", tmp_path / "out.json"], nproc=2, timeout_s=300)
    assert result.returncode != 0
    assert "error: rank 0: a torch.distributed call failed" in result.stderr
    assert "did not answer within 3 s" in result.stderr


@pytest.mark.parametrize("mode", ["oom", "memoryerror"])
def test_a_rank_out_of_memory_says_so_and_is_not_reported_as_a_dead_peer(tmp_path, mode):
    """Rank 0's own allocation fails (torch's CPU allocator, or a MemoryError): its error names it, says
    it is its own, and the flag to lower; rank 1 may report rank 0 as a peer that died."""
    result, figures = run_worker(mode, tmp_path)
    assert result.returncode != 0 and figures is None
    assert "error: rank 0 ran out of memory" in result.stderr
    assert "this is its own error, not a peer's: lower --batch-size" in result.stderr
    assert "rank 0: a torch.distributed call failed" not in result.stderr


def test_a_launch_past_its_timeout_is_killed_with_a_clear_error(tmp_path):
    with pytest.raises(GPTliteError, match="did not finish within 1 s and was killed"):
        run_worker("hang", tmp_path, timeout_s=1)


# ----------------------------------------------------------------------------------------------------
# Backends and the group of one.

@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_cuda_backend_on_a_machine_without_cuda_is_a_clear_error_before_any_work():
    with pytest.raises(GPTliteError, match="no CUDA device; run on CPU"):
        distributed.backend_for("cuda")
    with pytest.raises(GPTliteError, match="no CUDA device"):
        distributed.init("cuda:0")
    assert not dist.is_initialized()


def test_without_torchrun_init_makes_a_group_of_one(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert distributed.backend_for("cpu") == "gloo" and distributed.world_size() == 1 and distributed.rank() == 0
    d = distributed.init("cpu", timeout_s=5)
    try:
        assert (d.rank, d.world_size, d.backend) == (0, 1, "gloo")
        x = torch.ones(3)
        dist.all_reduce(x)
        assert torch.equal(x, torch.ones(3))
    finally:
        distributed.shutdown()
    assert not dist.is_initialized()


# ----------------------------------------------------------------------------------------------------
# collective_errors in one process: this rank's own error against a peer's.

def allocate_a_pebibyte():
    torch.empty(2**50, dtype=torch.uint8)  # more than any machine's memory: torch's CPU allocator fails


def raise_memory_error():
    raise MemoryError("could not allocate the KV cache")


@pytest.mark.parametrize("fail", [allocate_a_pebibyte, raise_memory_error])
def test_this_ranks_out_of_memory_is_its_own_error_with_the_flag_to_lower(fail):
    with pytest.raises(GPTliteError, match=r"^rank 0 ran out of memory \((RuntimeError|MemoryError).*this is its "
                                              r"own error, not a peer's: lower --batch-size$"):
        with distributed.collective_errors(5, memory_hint="lower --batch-size"):
            fail()


def test_an_error_of_this_ranks_own_code_goes_on_with_its_traceback_not_as_a_dead_peer():
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied") as e:
        with distributed.collective_errors(5):
            torch.ones(2, 3) @ torch.ones(2, 3)
    assert not isinstance(e.value, GPTliteError)
    assert "raised on rank 0 by its own code, not by a peer" in " ".join(getattr(e.value, "__notes__", []))


def test_the_scripts_own_out_of_memory_names_the_rank_and_the_flag_to_lower(real_data, monkeypatch):
    """main_tensor_parallel.main, one process: an allocation of the experiment fails."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(main_tensor_parallel, "experiment", lambda *args: allocate_a_pebibyte())
    threads = torch.get_num_threads()
    try:
        with pytest.raises(GPTliteError, match=r"rank 0 ran out of memory .*not a peer's: lower --batch-size"):
            main_tensor_parallel.main(["--untrained", "--batch-size", "2", "--prompt-len", "8", "--n-tokens", "2",
                                       "--repeats", "1"])
    finally:
        distributed.shutdown()
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------------------------------
# The script: flag errors before any work, and a smoke run on 2 ranks.

@pytest.mark.parametrize("argv, message", [
    (["--ranks", "3"], "3 ranks cannot split n_heads=4 and the MLP width d_ff=512"),
    (["--ranks", "0"], "must be at least 1"),
    (["--ranks", "2", "--device", "cuda"], "CUDA"),
    (["--prompt-len", "200"], "--prompt-len must be at most"),
    (["--ranks", "2", "--threads", str(os.cpu_count())], "CPU cores this process may use"),  # oversubscribed: 2 x cores
])
def test_bad_flags_are_clear_errors_before_any_work(argv, message, capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as e:
        main_tensor_parallel.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_ranks_that_differ_from_torchruns_world_are_an_error(capsys, monkeypatch):
    as_torchrun_rank_0(monkeypatch, 2)
    with pytest.raises(SystemExit):
        main_tensor_parallel.main(["--ranks", "4"])
    assert "--ranks 4 differs from torchrun's 2 processes" in capsys.readouterr().err


def test_the_script_on_two_ranks_checks_then_writes_its_rows(real_data, tmp_path):
    """python main_tensor_parallel.py --ranks 2: every flag checked, then the script starts torchrun itself."""
    out = tmp_path / "tp.json"
    result = subprocess.run([sys.executable, SCRIPT, "--ranks", "2", "--untrained", "--batch-size", "2",
                             "--prompt-len", "8", "--n-tokens", "2", "--repeats", "1", "--json", out],
                            capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "greedy cached tokens identical: yes" in result.stdout
    saved = json.loads(out.read_text())
    assert saved["world_size"] == 2 and saved["tokens_identical"] and saved["logits_max_diff"] <= 1e-5
    assert [r["variant"] for r in saved["rows"]] == ["1 rank x 1 thread", "1 rank x 2 threads (equal CPU)",
                                                     "2 ranks x 1 thread (TP)"]
    single, _, tp = saved["rows"]
    assert tp["weight_mb"] < single["weight_mb"] and tp["kv_mb"] * 2 == single["kv_mb"]
    # the payload per token: 2 all-reduces per block of d_model float32 values, 4 blocks in the cpu preset
    assert tp["ar_KB_per_token"] == 2 * 4 * 128 * 4 / 1024
    assert saved["headline"]["technique"] == "tensor parallelism, 2 gloo ranks of 1 thread(s)"
    assert saved["headline"]["figure"].startswith("TP against 1 rank x 1 thread: prefill ")
    assert saved["headline"]["figure"].endswith(f"max |logits diff| {saved['logits_max_diff']:.0e}, identical tokens")
    renders_on_its_page("main_tensor_parallel", saved)


@pytest.mark.parametrize("flag", ["--batch-size", "--n-tokens"])
def test_a_huge_size_flag_is_a_parser_error_before_any_work(flag, capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        main_tensor_parallel.main(["--untrained", "--device", "cpu", "--preset", "cpu", "--ranks", "2", flag,
                                   "1000000000000"])
    assert e.value.code == 2 and f"error: {flag}: " in capsys.readouterr().err
