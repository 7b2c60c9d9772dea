"""Pipeline parallelism (gptlite_pp.py, main_pipeline_parallel.py): 2 gloo ranks under torchrun
(tests/pp_worker.py, a tiny model, seconds) generate the single process's tokens in 1, 2 and 3 micro-batches;
a dead or silent stage is a clear error within the timeout; bad flags are clear errors before any work."""
import json
import sys
from pathlib import Path

import pytest
import torch

import main_pipeline_parallel as mpp
from gptlite_kvcache import GPTlite_KVCache
from gptlite_pp import check_pp_size, pipeline_stage
from lib import distributed, harness
from conftest import renders_on_its_page

WORKER = Path(__file__).resolve().parent / "pp_worker.py"
SCRIPT = Path(__file__).resolve().parent.parent / "main_pipeline_parallel.py"


def run_worker(mode, tmp_path):
    out = tmp_path / "out.json"
    # a dead rank: torchrun looks at its workers every 8 s, not every fraction of one, so that it does not end
    # rank 0 before rank 0, on a loaded machine, has said that its peer died
    result = distributed.launch(WORKER, [mode, out], nproc=2, timeout_s=300, monitor_s=8 if mode == "die" else None)
    return result, (json.loads(out.read_text()) if out.exists() else None)


def test_two_stages_generate_one_processs_tokens_in_any_number_of_micro_batches(tmp_path):
    result, figures = run_worker("check", tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert figures["world_size"] == 2
    for m, f in figures["figures"].items():
        assert f["tokens_equal"], m
        # activations [b, T, 32] floats forward (6 prompt tokens, then 7 steps of 1), tokens back (7 steps)
        assert f["sent_bytes"] == 5 * (6 + 7) * 32 * 4 + 5 * 7 * 8, m
        assert all(0 <= f["busy"][ph] <= f["wall"][ph] for ph in ("prefill", "decode")), m


@pytest.mark.parametrize("mode, says", [("die", "a peer process died"), ("hang", "did not answer within 3 s")])
def test_a_dead_or_silent_stage_is_a_clear_error_within_the_timeout(tmp_path, mode, says):
    # hang: rank 1 sleeps an hour, so the run ends only if rank 0 itself gives up after 3 s (its barrier's group
    # waits as long as the default group, not torch's 30 minutes); else the launch's 300 s limit fails the test
    result, figures = run_worker(mode, tmp_path)
    assert result.returncode != 0 and figures is None
    assert "error: rank 0: a torch.distributed call failed" in result.stderr
    if mode == "hang":
        assert "error: rank 0: a torch.distributed call failed: a peer process " + says in result.stderr


def test_a_stage_holds_its_blocks_and_shares_the_models_weights():
    torch.manual_seed(0)
    model = GPTlite_KVCache(vocab_size=65, d_model=16, n_heads=2, d_head=8, n_layers=4, dropout_p=0.0, seqlen=16)
    first, last = pipeline_stage(model, 0, 2), pipeline_stage(model, 1, 2)
    assert first.blocks[0] is model.blocks[0] and last.blocks[1] is model.blocks[3]
    assert first.first and not first.last and last.last and not hasattr(first, "fc_out")
    assert first.new_cache(3).keys.shape == (2, 3, 2, 16, 8)  # its 2 layers only
    with pytest.raises(ValueError, match="3 stages cannot split the 4 layers"):
        check_pp_size(4, 3)


@pytest.mark.parametrize("flags, match", [(["--ranks", "3"], "cannot split the 4 layers"),
                                          (["--micro-batches", "8", "--batch-size", "4"], "more micro-batches"),
                                          (["--n-tokens", "120"], "exceed the window"),
                                          (["--micro-batches", "0"], "at least 1")])
def test_bad_flags_are_clear_errors_before_any_work(flags, match, capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        mpp.main(["--untrained", "--device", "cpu", "--preset", "cpu"] + flags)
    assert e.value.code == 2 and match in capsys.readouterr().err


def test_the_script_on_two_ranks_writes_a_row_per_stage_count_and_micro_batches(real_data, tmp_path):
    out_json, out_png = tmp_path / "pp.json", tmp_path / "pp.png"
    result = distributed.run_child([sys.executable, SCRIPT, "--untrained", "--preset", "cpu", "--device", "cpu",
                                    "--batch-size", "4", "--micro-batches", "1", "2", "--n-tokens", "3", "--repeats",
                                    "1", "--json", out_json, "--plot", out_png], capture=True, timeout_s=600)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = json.loads(out_json.read_text())
    names = [r["variant"] for r in saved["rows"]]
    assert names == ["pipeline P=1, m=1", "pipeline P=1, m=2", "pipeline P=2, m=1", "pipeline P=2, m=2",
                     "pipeline P=1, one request", "pipeline P=2, one request", "pipeline P=1 x 2 threads (equal CPU)"]
    for row in saved["rows"]:
        P, m = row["stages"], row["micro_batches"]
        assert row["theory_prefill_pct"] == round(100 * (P - 1) / (m + P - 1), 1)
        assert (row["sent_KB_per_token"] > 0) == (P > 1) and 0 <= row["bubble_decode_pct"] <= 100
    assert all("identical to one process: yes" in line for line in saved["summary"][:4])
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    renders_on_its_page("main_pipeline_parallel", saved)
