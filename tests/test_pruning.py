"""Structured pruning: exactly the original model with the removed heads and neurons zeroed, really smaller,
and still a GPTlite that saves, loads, runs with the KV cache and trains; main_pruning.py end to end."""
import copy
import json

import pytest
import torch
from conftest import TINY, renders_on_its_page
from test_distillation import quick_validation_loss
from test_gqa import diverging_loss, positive_or_none, rebuild_of  # noqa: F401

import inference_utils as iu
import main_pruning
from gptlite import GPTlite, generate
from gptlite_kvcache import GPTlite_KVCache, generate_kvcache
from inference_utils import kv_cache_model
from lib import corpus, files, harness, presets, training
from lib.errors import GPTliteError
from main_pruning import compute_importance, logits_with_zeroed, prune, prune_linear, top_indices

D_FF = 4 * TINY["d_model"]


def fake_data(n_tokens=4000, seed=0):
    tokens = torch.randint(TINY["vocab_size"], (n_tokens,), generator=torch.Generator().manual_seed(seed))
    return corpus.Data(vocab="".join(chr(32 + i) for i in range(TINY["vocab_size"])), train=tokens, val=tokens)


def importance_keeping(keep_heads, keep_neurons):
    """Importance scores (one tensor per block) under which prune keeps exactly these heads and neurons."""
    heads, neurons = [torch.zeros(TINY["n_heads"]) for _ in keep_heads], [torch.zeros(D_FF) for _ in keep_neurons]
    for h, n, kh, kn in zip(heads, neurons, keep_heads, keep_neurons):
        h[kh], n[kn] = 1.0, 1.0
    return heads, neurons


@torch.no_grad()
def logits_with_hooks_zeroing(model, keep_heads, keep_neurons, x):
    """An independent reference for logits_with_zeroed: forward hooks zero the outputs of the other heads (at
    the input of out_proj) and the activations of the other neurons (at the ReLU); the weights are untouched."""
    def zero_heads(keep, mha):
        def hook(module, args):
            mask = torch.zeros(mha.n_heads, 1)
            mask[keep] = 1
            return (args[0] * mask.repeat_interleave(mha.d_head, dim=0).flatten(),)  # [B, S, H*D]
        return hook

    def zero_neurons(keep):
        def hook(module, args, out):
            mask = torch.zeros(out.shape[-1])
            mask[keep] = 1
            return out * mask  # [B, S, d_ff]
        return hook

    handles = []
    for block, kh, kn in zip(model.blocks, keep_heads, keep_neurons):
        handles.append(block.mha.out_proj.register_forward_pre_hook(zero_heads(kh, block.mha)))
        handles.append(block.ffwd.net[1].register_forward_hook(zero_neurons(kn)))
    try:
        return model.eval()(x)
    finally:
        for handle in handles:
            handle.remove()


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
    before = copy.deepcopy(base.state_dict())
    with torch.no_grad():
        expected = logits_with_hooks_zeroing(base, keep_heads, keep_neurons, x)
        assert torch.allclose(pruned(x), expected, atol=1e-5, rtol=0)
        assert (pruned(x) - base(x)).abs().max() > 0.1  # pruning does change the model
        # the script's check (zeroing the weights that read those heads and neurons, on a copy) is the same
        assert torch.allclose(logits_with_zeroed(base, keep_heads, keep_neurons, x), expected, atol=1e-5, rtol=0)
    assert all(torch.equal(before[k], v) for k, v in base.state_dict().items())  # the model itself is untouched
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
    assert pruned.config.to_dict() == dict(TINY, n_heads=2, d_ff=40) and base.config.to_dict() == TINY
    assert sum(p.numel() for p in GPTlite(**pruned.config.to_dict()).parameters()) == expected
    # the stacked [n_layers, n_heads] / [n_layers, d_ff] scores prune the same
    stacked = prune(copy.deepcopy(base), torch.stack(list(heads)), torch.stack(list(neurons)), 2, 40)
    assert all(torch.equal(a, b) for a, b in zip(stacked.state_dict().values(), pruned.state_dict().values()))


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
    config, data = pruned.config.to_dict(), fake_data()
    files.save_checkpoint(tmp_path / "pruned.pt", pruned, config, data.vocab)
    ckpt = files.load_checkpoint(tmp_path / "pruned.pt", vocab=data.vocab)
    model = GPTlite(**ckpt["config"]).eval()
    model.load_state_dict(ckpt["state_dict"])
    cached = GPTlite_KVCache(**ckpt["config"]).eval()
    cached.load_state_dict(ckpt["state_dict"])
    x = tokens()
    with torch.no_grad():
        assert torch.equal(model(x), pruned(x))
        assert torch.equal(kv_cache_model(pruned)(x)[0], pruned(x))  # the KV-cache twin, built from the modules
    assert isinstance(kv_cache_model(pruned), GPTlite_KVCache) and not kv_cache_model(pruned).training
    prompt = tokens(2, 5)
    assert torch.equal(generate_kvcache(cached, prompt, 11, TINY["seqlen"]), generate(model, prompt, 11, TINY["seqlen"]))
    before = [p.detach().clone() for p in model.parameters()]
    history = training.train_steps(model, data, 3, 4, TINY["seqlen"], 1e-3, eval_interval=1)
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
    assert isinstance(heads, list) and isinstance(neurons, list)  # one tensor per block, as the post's listing
    assert [h.shape for h in heads] == [(TINY["n_heads"],)] * TINY["n_layers"]
    assert [n.shape for n in neurons] == [(D_FF,)] * TINY["n_layers"]
    assert heads[0][1] == 0 and neurons[1][7] == 0
    assert (heads[0][[0, 2]] > 0).all() and (heads[1] > 0).all() and (neurons[0] >= 0).all() and neurons[1].sum() > 0
    # head 0 of layer 0 by hand: the norm of its output at the input of out_proj, summed over every token
    g = torch.Generator().manual_seed(0)
    captured = []
    handle = base.blocks[0].mha.out_proj.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    with torch.no_grad():
        for _ in range(2):
            base(corpus.get_batch(fake_data().train, 4, 8, g)[0])
    handle.remove()
    expected = sum(c[..., :TINY["d_head"]].norm(dim=-1).sum() for c in captured)
    assert heads[0][0].item() == pytest.approx(expected.item(), rel=1e-5)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in base.modules())
    # also when the forward pass fails part-way
    bad = corpus.Data(vocab="", train=torch.full((100,), 999), val=torch.full((100,), 999))  # ids outside the vocabulary
    with pytest.raises(IndexError):
        compute_importance(base, bad, n_batches=1, batch_size=2, seqlen=8)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in base.modules())


@pytest.mark.parametrize("n_heads, n_neurons", [(0, 10), (TINY["n_heads"] + 1, 10), (1, 0), (1, D_FF + 1), (1.5, 10)])
def test_keeping_more_than_exist_or_none_is_a_clear_error(tiny_models, n_heads, n_neurons):
    base, _ = tiny_models
    heads, neurons = [torch.rand(TINY["n_heads"]) for _ in range(2)], [torch.rand(D_FF) for _ in range(2)]
    with pytest.raises(ValueError, match="must be an integer between 1 and"):
        prune(base, heads, neurons, n_heads, n_neurons)
    with pytest.raises(ValueError, match="do not fit"):
        prune(base, heads[:1], neurons, 1, 1)
    with pytest.raises(ValueError, match="do not fit"):
        prune(base, heads, [n[:-1] for n in neurons], 1, 1)
    with pytest.raises(ValueError, match="seqlen"):
        compute_importance(base, fake_data(), 1, 1, TINY["seqlen"] + 1)


def test_main_pruning_end_to_end(real_data, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(training, "validation_loss", quick_validation_loss)  # tiny settings: 2 batches of 8
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
    p = presets.PRESETS["cpu"]
    assert result["config"] == dict(p.gptlite_kwargs(), n_heads=p.n_heads // 2, d_ff=2 * p.d_model)
    small = sum(t.numel() for t in GPTlite(**result["config"]).parameters())
    assert rows["original"]["params"] == sum(t.numel() for t in GPTlite(**p.gptlite_kwargs()).parameters())
    assert rows["random prune (mean of 2)"]["val_pruned"] == pytest.approx(sum(result["random_prune_losses"]) / 2)
    for name in ("one-shot + distill", "iterative + distill", "random init + distill"):
        assert rows[name]["params"] == small and rows[name]["kv_cache_mb"] == rows["original"]["kv_cache_mb"] / 2
        assert rows[name]["val_pruned"] > 0 and rows[name]["val_loss"] > 0 and positive_or_none(rows[name]["tpot_ms"])
    assert result["headline"]["technique"] == f"pruning to {p.n_heads // 2} heads and {2 * p.d_model} neurons a block, 5 distillation steps"
    assert result["headline"]["figure"].startswith(f"val loss one-shot {rows['one-shot + distill']['val_loss']:.3f}, ")
    assert f"{rows['random prune (mean of 2)']['val_pruned']:.2f} at random" in result["headline"]["figure"]
    curve = result["curves"]["iterative"]
    assert [c[0] for c in curve] == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5]  # 5 prune + distill steps of 1 step each
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ckpt = files.load_checkpoint(out_ckpt, vocab=real_data.vocab)
    assert ckpt["config"] == result["config"] and ckpt["meta"]["variant"] == result["best"]
    assert rebuild_of(ckpt).startswith("python main_pruning.py --untrained --preset cpu")
    renders_on_its_page("main_pruning", result)


def test_a_diverging_run_is_an_error_and_writes_nothing(real_data, tmp_path, monkeypatch, diverging_loss):
    monkeypatch.setattr(training, "validation_loss", quick_validation_loss)
    with pytest.raises(GPTliteError):
        main_pruning.main(["--untrained", "--preset", "cpu", "--device", "cpu", "--iters", "5", "--batch-size", "2",
                           "--calib-batches", "1", "--random-draws", "1", "--prompt-len", "8", "--n-tokens", "2",
                           "--repeats", "1", "--save", str(tmp_path / "p.pt"), "--json", str(tmp_path / "p.json"),
                           "--plot", str(tmp_path / "p.png")])
    assert list(tmp_path.iterdir()) == []  # no file, not even a temporary one


def test_save_and_reload_replaces_nothing_when_the_reloaded_model_differs(tiny_models, tmp_path, monkeypatch):
    base, _ = tiny_models
    path = tmp_path / "model.pt"
    path.write_bytes(b"the previous file")
    load_checkpoint = files.load_checkpoint

    def corrupted(*args, **kwargs):  # a reload that loses a weight
        ckpt = load_checkpoint(*args, **kwargs)
        ckpt["state_dict"]["fc_out.bias"] += 1
        return ckpt
    monkeypatch.setattr(training, "load_checkpoint", corrupted)  # save_and_reload lives in lib/training.py
    with pytest.raises(GPTliteError, match="other logits"):
        training.save_and_reload(path, base, TINY, "abc", "python main_pruning.py --save model.pt")
    assert path.read_bytes() == b"the previous file" and list(tmp_path.iterdir()) == [path]
    monkeypatch.setattr(training, "load_checkpoint", load_checkpoint)
    training.save_and_reload(path, base, TINY, "abc", "python main_pruning.py --save model.pt")
    assert torch.equal(files.load_checkpoint(path)["state_dict"]["fc_out.bias"], base.fc_out.bias)


@pytest.mark.parametrize("flags", [["--keep", "0"], ["--keep", "1"], ["--keep", "nan"], ["--step", "0"], ["--step", "0.6"],
                                   ["--iters", "4"], ["--temperature", "0"], ["--temperature", "inf"], ["--alpha", "2"],
                                   ["--lr", "-1"], ["--lr", "0"], ["--lr", "inf"], ["--calib-batches", "0"],
                                   ["--random-draws", "0"], ["--batch-size", "0"], ["--n-tokens", "1"],
                                   ["--prompt-len", "129"], ["--save", "/no/such/folder/p.pt"]])
def test_bad_flags_are_clear_errors_before_any_work(flags, capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        main_pruning.main(["--untrained", "--device", "cpu"] + flags)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--keep", "0.9", "--step", "0.1"], ["--keep", "0.7", "--step", "0.3"],
                                   ["--alpha", "0"], ["--alpha", "1"], ["--lr", "1e-3"]])
def test_good_flags_at_the_edges_pass_the_checks(flags, monkeypatch):
    class DataLoaded(Exception):
        pass

    def load_data(path=None):
        raise DataLoaded
    monkeypatch.setattr(harness, "load_data", load_data)
    with pytest.raises(DataLoaded):  # the flags passed: the script went on to load the data
        main_pruning.main(["--untrained", "--device", "cpu", "--preset", "cpu"] + flags)


@pytest.mark.parametrize("flag", ["--batch-size", "--n-tokens"])
def test_a_huge_size_flag_is_a_parser_error_before_any_work(flag, capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        main_pruning.main(["--untrained", "--device", "cpu", "--preset", "cpu", flag, "1000000000000"])
    assert e.value.code == 2 and f"error: {flag}: " in capsys.readouterr().err
