"""Structured pruning: exactly the original model with the removed heads and neurons zeroed, really smaller,
and still a GPTlite that saves, loads, runs with the KV cache and trains; main_pruning.py end to end."""
import copy
import json

import pytest
import torch

import inference_utils as iu
import main_pruning
from conftest import TINY
from gptlite import GPTlite, generate
from gptlite_kvcache import GPTlite_KVCache, generate_kvcache
from main_pruning import compute_importance, logits_with_zeroed, model_config, prune, prune_linear, top_indices
from test_distillation import quick_validation_loss

D_FF = 4 * TINY["d_model"]


def fake_data(n_tokens=4000, seed=0):
    tokens = torch.randint(TINY["vocab_size"], (n_tokens,), generator=torch.Generator().manual_seed(seed))
    return iu.Data(vocab="".join(chr(32 + i) for i in range(TINY["vocab_size"])), train=tokens, val=tokens)


def importance_keeping(keep_heads, keep_neurons):
    """Importance scores under which prune keeps exactly these heads and neurons of every layer."""
    heads, neurons = torch.zeros(TINY["n_layers"], TINY["n_heads"]), torch.zeros(TINY["n_layers"], D_FF)
    for layer, (kh, kn) in enumerate(zip(keep_heads, keep_neurons)):
        heads[layer, kh], neurons[layer, kn] = 1.0, 1.0
    return heads, neurons


def tokens(batch=3, length=TINY["seqlen"]):
    return torch.randint(TINY["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(1))


def test_keeping_everything_leaves_the_logits_unchanged(tiny_models):
    base, _ = tiny_models
    heads, neurons = torch.rand(TINY["n_layers"], TINY["n_heads"]), torch.rand(TINY["n_layers"], D_FF)
    pruned = prune(copy.deepcopy(base), heads, neurons, TINY["n_heads"], D_FF)
    x = tokens()
    with torch.no_grad():
        assert torch.allclose(pruned(x), base(x), atol=1e-5, rtol=0)


def test_pruning_equals_the_original_with_those_heads_and_neurons_zeroed(tiny_models):
    base, _ = tiny_models
    keep_heads = [torch.tensor([0, 2]), torch.tensor([1, 2])]  # a different set in each layer
    g = torch.Generator().manual_seed(0)
    keep_neurons = [torch.randperm(D_FF, generator=g)[:50].sort().values for _ in range(TINY["n_layers"])]
    pruned = prune(copy.deepcopy(base), *importance_keeping(keep_heads, keep_neurons), 2, 50)
    x = tokens()
    with torch.no_grad():
        expected = logits_with_zeroed(base, keep_heads, keep_neurons, x)
        assert torch.allclose(pruned(x), expected, atol=1e-5, rtol=0)
        assert (pruned(x) - base(x)).abs().max() > 0.1  # pruning does change the model

        # the hooks zero exactly those heads and neurons: the same as zeroing the weights that read them
        zeroed = copy.deepcopy(base)
        for block, kh, kn in zip(zeroed.blocks, keep_heads, keep_neurons):
            head_of_column = torch.arange(TINY["n_heads"] * TINY["d_head"]) // TINY["d_head"]
            block.mha.out_proj.weight[:, ~torch.isin(head_of_column, kh)] = 0
            block.ffwd.net[2].weight[:, ~torch.isin(torch.arange(D_FF), kn)] = 0
        assert torch.allclose(zeroed(x), expected, atol=1e-5, rtol=0)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in base.modules())


def test_prune_keeps_the_most_important_and_really_shrinks_the_weights(tiny_models):
    base, _ = tiny_models
    heads = torch.tensor([[3.0, 1.0, 2.0], [0.5, 0.2, 0.9]])
    neurons = torch.arange(TINY["n_layers"] * D_FF, dtype=torch.float).view(TINY["n_layers"], D_FF).flip(1)
    pruned = prune(copy.deepcopy(base), heads, neurons, 2, 40)
    assert top_indices(heads[0], 2).tolist() == [0, 2] and top_indices(heads[1], 2).tolist() == [0, 2]
    mha, mlp = pruned.blocks[0].mha, pruned.blocks[0].ffwd.net
    assert mha.n_heads == 2 and mha.query_proj.weight.shape == (2 * TINY["d_head"], TINY["d_model"])
    assert mha.out_proj.weight.shape == (TINY["d_model"], 2 * TINY["d_head"])
    assert mlp[0].weight.shape == (40, TINY["d_model"]) and mlp[2].weight.shape == (TINY["d_model"], 40)
    assert torch.equal(mlp[0].weight, base.blocks[0].ffwd.net[0].weight[:40])  # neurons 0..39 scored highest
    assert torch.equal(mha.value_proj.bias[8:], base.blocks[0].mha.value_proj.bias[16:])  # head 2 is kept second

    d, hd, n, L, V, S = TINY["d_model"], 2 * TINY["d_head"], 40, TINY["n_layers"], TINY["vocab_size"], TINY["seqlen"]
    per_block = 3 * (d * hd + hd) + (hd * d + d) + (d * n + n) + (n * d + d) + 2 * 2 * d
    expected = V * d + S * d + L * per_block + 2 * d + (d * V + V)
    assert sum(p.numel() for p in pruned.parameters()) == expected
    assert model_config(pruned) == dict(TINY, n_heads=2, d_ff=40)
    assert sum(p.numel() for p in GPTlite(**model_config(pruned)).parameters()) == expected


def test_prune_linear_keeps_rows_and_columns():
    linear = torch.nn.Linear(5, 4)
    rows, cols = torch.tensor([0, 3]), torch.tensor([1, 2, 4])
    pruned = prune_linear(linear, rows=rows, columns=cols)
    assert torch.equal(pruned.weight, linear.weight[rows][:, cols]) and torch.equal(pruned.bias, linear.bias[rows])
    x = torch.randn(2, 5)
    x[:, [0, 3]] = 0  # the dropped input features carry nothing: the kept outputs are unchanged
    assert torch.allclose(pruned(x[:, cols]), linear(x)[:, rows], atol=1e-6)
    assert prune_linear(linear).weight.shape == (4, 5) and prune_linear(linear, columns=cols).bias.shape == (4,)


def test_pruned_model_saves_loads_runs_with_the_kv_cache_and_trains(tiny_models, tmp_path):
    base, _ = tiny_models
    heads, neurons = compute_importance(base, fake_data(), n_batches=2, batch_size=4, seqlen=TINY["seqlen"])
    pruned = prune(copy.deepcopy(base), heads, neurons, 1, 20)
    config, data = model_config(pruned), fake_data()
    iu.save_checkpoint(tmp_path / "pruned.pt", pruned, config, data.vocab)
    ckpt = iu.load_checkpoint(tmp_path / "pruned.pt", vocab=data.vocab)
    model = GPTlite(**ckpt["config"]).eval()
    model.load_state_dict(ckpt["state_dict"])
    cached = GPTlite_KVCache(**ckpt["config"]).eval()
    cached.load_state_dict(ckpt["state_dict"])
    x = tokens()
    with torch.no_grad():
        assert torch.equal(model(x), pruned(x))
    prompt = tokens(2, 5)
    assert torch.equal(generate_kvcache(cached, prompt, 11, TINY["seqlen"]), generate(model, prompt, 11, TINY["seqlen"]))
    before = [p.detach().clone() for p in model.parameters()]
    history = iu.train_steps(model, data, 3, 4, TINY["seqlen"], 1e-3, eval_interval=1)
    assert len(history) == 3 and all(h["val_loss"] == h["val_loss"] for h in history)  # finite, not NaN
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_importance_scores_and_hooks_are_removed(tiny_models):
    base, _ = tiny_models
    with torch.no_grad():  # head 1 of layer 0 outputs nothing; neuron 7 of layer 1 never fires
        rows = slice(TINY["d_head"], 2 * TINY["d_head"])
        base.blocks[0].mha.value_proj.weight[rows] = 0
        base.blocks[0].mha.value_proj.bias[rows] = 0
        base.blocks[1].ffwd.net[0].bias[7] = -1e4
    heads, neurons = compute_importance(base, fake_data(), n_batches=2, batch_size=4, seqlen=8)
    assert heads.shape == (TINY["n_layers"], TINY["n_heads"]) and neurons.shape == (TINY["n_layers"], D_FF)
    assert heads[0, 1] == 0 and neurons[1, 7] == 0
    assert (heads[0, [0, 2]] > 0).all() and (heads[1] > 0).all() and (neurons[0] >= 0).all() and neurons.sum() > 0
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in base.modules())
    # also when the forward pass fails part-way
    bad = iu.Data(vocab="", train=torch.full((100,), 999), val=torch.full((100,), 999))  # ids outside the vocabulary
    with pytest.raises(IndexError):
        compute_importance(base, bad, n_batches=1, batch_size=2, seqlen=8)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in base.modules())


@pytest.mark.parametrize("n_heads, n_neurons", [(0, 10), (TINY["n_heads"] + 1, 10), (1, 0), (1, D_FF + 1), (1.5, 10)])
def test_keeping_more_than_exist_or_none_is_a_clear_error(tiny_models, n_heads, n_neurons):
    base, _ = tiny_models
    heads, neurons = torch.rand(TINY["n_layers"], TINY["n_heads"]), torch.rand(TINY["n_layers"], D_FF)
    with pytest.raises(ValueError, match="must be an integer between 1 and"):
        prune(base, heads, neurons, n_heads, n_neurons)
    with pytest.raises(ValueError, match="do not fit"):
        prune(base, heads[:1], neurons, 1, 1)
    with pytest.raises(ValueError, match="seqlen"):
        compute_importance(base, fake_data(), 1, 1, TINY["seqlen"] + 1)


def test_main_pruning_end_to_end(real_data, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(iu, "validation_loss", quick_validation_loss)  # tiny settings: 2 batches of 8
    out_json, out_png, out_ckpt = tmp_path / "p.json", tmp_path / "p.png", tmp_path / "pruned.pt"
    main_pruning.main(["--untrained", "--preset", "cpu", "--device", "cpu", "--iters", "5", "--batch-size", "4", "--calib-batches", "1",
                       "--random-draws", "2", "--prompt-len", "8", "--n-tokens", "4", "--repeats", "1",
                       "--save", str(out_ckpt), "--json", str(out_json), "--plot", str(out_png)])
    printed = capsys.readouterr().out
    assert "identical logits" in printed and "meaningless" in printed
    result = json.loads(out_json.read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["original", "one-shot + distill", "random prune (mean of 2)", "iterative + distill",
                          "random init + distill"]
    assert result["max_abs_diff_vs_zeroed"] < 1e-4
    p = iu.PRESETS["cpu"]
    assert result["config"] == dict(p.model_config(), n_heads=p.n_heads // 2, d_ff=2 * p.d_model)
    small = sum(t.numel() for t in GPTlite(**result["config"]).parameters())
    assert rows["original"]["params"] == sum(t.numel() for t in GPTlite(**p.model_config()).parameters())
    for name in ("one-shot + distill", "iterative + distill", "random init + distill"):
        assert rows[name]["params"] == small and rows[name]["kv_cache_mb"] == rows["original"]["kv_cache_mb"] / 2
        assert rows[name]["val_pruned"] > 0 and rows[name]["val_loss"] > 0 and rows[name]["tpot_ms"] > 0
    curve = result["curves"]["iterative"]
    assert [c[0] for c in curve] == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5]  # 5 prune + distill steps of 1 step each
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ckpt = iu.load_checkpoint(out_ckpt, vocab=real_data.vocab)
    assert ckpt["config"] == result["config"] and ckpt["meta"]["variant"] == result["best"]


@pytest.mark.parametrize("flags", [["--keep", "0"], ["--keep", "1"], ["--step", "0"], ["--step", "0.6"],
                                   ["--iters", "4"], ["--temperature", "0"], ["--alpha", "2"], ["--calib-batches", "0"],
                                   ["--random-draws", "0"], ["--batch-size", "0"], ["--n-tokens", "1"], ["--save", "/no/such/folder/p.pt"]])
def test_bad_flags_are_clear_errors_before_any_work(flags, capsys, monkeypatch):
    monkeypatch.setattr(iu, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        main_pruning.main(["--untrained", "--device", "cpu"] + flags)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err
