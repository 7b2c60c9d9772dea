"""Expert parallelism (gptlite_ep.py, main_expert_parallel.py): 2 local gloo ranks under torchrun
(tests/ep_worker.py, a tiny MoE, seconds) give the single process's logits, greedy tokens and dropped
assignments, split by experts (all-to-all) and by neurons (all-reduce); bad settings are clear errors."""
import json
import sys
from pathlib import Path

import pytest
import torch

import main_expert_parallel as mep
from gptlite_ep import check_ep_size, parallel_moe_model, split_batch
from gptlite_moe import GPTlite_MoE
from lib import distributed, files, harness
from conftest import renders_on_its_page

WORKER = Path(__file__).resolve().parent / "ep_worker.py"
SCRIPT = Path(__file__).resolve().parent.parent / "main_expert_parallel.py"
ATOL = 1e-5  # float32 logits: the k experts' outputs summed on another rank, in another order


@pytest.fixture(scope="module")
def worker_figures(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep") / "out.json"
    result = distributed.launch(WORKER, [out], nproc=2, timeout_s=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(out.read_text())


def test_two_ranks_give_the_single_process_logits_tokens_and_drops(worker_figures):
    figures = worker_figures["figures"]
    assert worker_figures["world_size"] == 2
    assert set(figures) == {f"plain/{m}/{f}" for m in ("expert", "tensor") for f in ("None", "0.5", "1.0")} | {
        f"sigmoid_shared/expert/{f}" for f in ("None", "0.5", "1.0")}
    for name, f in figures.items():
        assert f["logits_max_diff"] <= ATOL, name
        assert f["tokens_equal"], name
        assert f["dropped"] == f["single_dropped"], name
        assert f["calls"] > 0, name  # the split did communicate
    # the capacity check can fail: at factor 0.5 the experts do drop, dropless none
    assert figures["plain/expert/0.5"]["single_dropped"] > 0 and figures["plain/expert/None"]["single_dropped"] == 0


def tiny(**kwargs):
    torch.manual_seed(0)
    return GPTlite_MoE(vocab_size=65, d_model=16, n_heads=2, d_head=8, n_layers=2, dropout_p=0.0, seqlen=16,
                       n_experts=4, top_k=2, d_expert=8, **kwargs).eval()


def test_the_splits_hold_their_share_and_leave_the_model_as_it_was():
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    layers = model.moe_layers()
    ep = parallel_moe_model(model, 1, 2, "expert")
    layer = ep.moe_layers()[0]
    assert layer.w_in.shape == (2, 16, 8) and torch.equal(layer.w_in, layers[0].w_in[2:])  # experts 2 and 3
    tp = parallel_moe_model(model, 1, 2, "tensor").moe_layers()[0]
    assert tp.w_in.shape == (4, 16, 4) and torch.equal(tp.w_out, layers[0].w_out[:, 4:])  # neurons 4..7
    assert not tp.b_out.any()  # rank 1 adds no second-layer bias: rank 0 does, once
    assert all(type(l).__name__ == "MoEFeedForward" for l in model.moe_layers())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert ep.token_embedding is model.token_embedding  # the rest is shared, not copied


@pytest.mark.parametrize("args, match", [((8, 64, 3, "expert"), "8 experts"), ((8, 63, 2, "tensor"), "63 neurons"),
                                         ((8, 64, 0, "expert"), "positive"), ((8, 64, 2, "data"), "mode")])
def test_bad_splits_are_clear_errors(args, match):
    with pytest.raises(ValueError, match=match):
        check_ep_size(*args)


def test_a_batch_that_does_not_split_evenly_is_refused():
    assert torch.equal(split_batch(torch.arange(6), 1, 2), torch.tensor([3, 4, 5]))
    with pytest.raises(ValueError, match="evenly"):
        split_batch(torch.arange(5), 0, 2)
    with pytest.raises(ValueError, match="shared expert"):
        parallel_moe_model(tiny(shared_expert=True), 0, 2, "tensor")


@pytest.mark.parametrize("flags, match", [(["--ranks", "3"], "divides"), (["--batch-sizes", "2", "3"], "multiples"),
                                          (["--ranks", "1", "--batch-sizes", "0"], "at least")])
def test_bad_flags_are_clear_errors_before_any_work(flags, match, capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        mep.main(["--untrained", "--device", "cpu", "--preset", "cpu"] + flags)
    assert e.value.code == 2 and match in capsys.readouterr().err


def test_a_missing_moe_checkpoint_says_how_to_train_it(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(files, "checkpoint_path", lambda name: tmp_path / f"{name}.pt")
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit):
        mep.main(["--device", "cpu", "--preset", "cpu", "--ranks", "1"])
    assert "python main_moe.py --preset cpu" in capsys.readouterr().err


def test_the_script_on_two_ranks_writes_ep_and_tp_rows(real_data, tmp_path):
    out_json, out_png = tmp_path / "ep.json", tmp_path / "ep.png"
    result = distributed.run_child([sys.executable, SCRIPT, "--untrained", "--preset", "cpu", "--device", "cpu",
                                    "--batch-sizes", "2", "4", "--n-tokens", "2", "--repeats", "1", "--json", out_json,
                                    "--plot", out_png], capture=True, timeout_s=600)
    assert result.returncode == 0, result.stderr[-3000:]
    saved = json.loads(out_json.read_text())
    assert saved["world_size"] == 2 and saved["backend"] == "gloo"
    variants = [r["variant"] for r in saved["rows"]]
    assert len(variants) == 4 * 2 and any("EP" in v for v in variants) and any("TP" in v for v in variants)
    for row in saved["rows"]:
        split = row["ranks"] == 2
        assert (row["comm_pct"] is not None) == split and (row["sent_KB_per_token"] is not None) == split
        assert row["rows_per_rank"] == (row["batch"] // 2 if "EP" in row["variant"] else row["batch"])
    checks = [line for line in saved["summary"] if "parallel," in line]
    assert len(checks) == 4 and all("identical: yes" in line for line in checks)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    renders_on_its_page("main_expert_parallel", saved)
