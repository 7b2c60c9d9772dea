"""gptlite_moe.py: the sparse path equals the dense reference (every expert on every token, masked) and an
independent per-token loop; capacity drops exactly the assignments GShard's order drops; the balancing loss
is Switch's formula; bad settings and a non-finite router are clear errors."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

from gptlite import GPTlite
import inference_utils as iu
import main_moe
from gptlite_moe import GPTlite_MoE, GPTliteMoEConfig, MoEFeedForward, RouterError, within_capacity
from lib.training import moe_loss_fn
from lib import files, harness, training
from conftest import renders_on_its_page

ATOL = 1e-5  # float32 sums of a few experts in another order


def layer(seed=0, **kwargs):
    torch.manual_seed(seed)
    moe = MoEFeedForward(16, 24, **kwargs).eval()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.5)  # peaked routing and outputs far above the tolerance
    return moe


def x_of(n=40, seed=1):
    return torch.randn(2, n // 2, 16, generator=torch.Generator().manual_seed(seed))


def per_token_loop(moe, x):
    """Each token on its own: its router scores, its top-k (renormalised), its experts' outputs, written
    out; capacity applied by walking the assignments in GShard's order (all first choices, then second)."""
    flat = x.reshape(-1, x.shape[-1])
    N, E, k = flat.shape[0], moe.n_experts, moe.top_k
    logits = flat @ moe.gate.weight.t()
    if moe.router == "softmax":
        scores = torch.exp(logits - logits.max(-1, keepdim=True).values)
        scores = scores / scores.sum(-1, keepdim=True)
        choose = scores
    else:
        scores = 1 / (1 + torch.exp(-logits))
        choose = scores + moe.selection_bias
    picks = [sorted(range(E), key=lambda e: -float(choose[n, e]))[:k] for n in range(N)]
    cap = N if moe.capacity_factor is None else math.ceil(moe.capacity_factor * N * k / E)
    taken, keep = [0] * E, {}
    for j in range(k):
        for n in range(N):
            e = picks[n][j]
            keep[n, j] = taken[e] < cap
            taken[e] += 1
    out = torch.zeros_like(flat)
    for n in range(N):
        total = sum(float(scores[n, e]) for e in picks[n])
        for j, e in enumerate(picks[n]):
            if keep[n, j]:
                h = torch.relu(flat[n] @ moe.w_in[e] + moe.b_in[e]) @ moe.w_out[e] + moe.b_out[e]
                out[n] += float(scores[n, e]) / total * h
    if moe.shared is not None:
        out = out + moe.shared(flat)
    return out.reshape(x.shape), sum(not v for v in keep.values()), taken


@pytest.mark.parametrize("kwargs", [dict(), dict(top_k=1), dict(top_k=8), dict(capacity_factor=1.0),
                                    dict(capacity_factor=0.5, top_k=2), dict(router="sigmoid"),
                                    dict(router="sigmoid", capacity_factor=1.25), dict(shared_expert=True)])
def test_sparse_path_equals_the_dense_reference_and_a_per_token_loop(kwargs):
    moe, x = layer(**kwargs), x_of()
    if kwargs.get("router") == "sigmoid":
        moe.selection_bias.copy_(torch.linspace(-0.3, 0.3, 8))  # a bias that changes the choices
    with torch.no_grad():
        sparse = moe(x)
        sparse_drops = moe.routing.dropped
        dense = moe.dense_forward(x)
        loop, drops, taken = per_token_loop(moe, x)
    torch.testing.assert_close(sparse, dense, atol=ATOL, rtol=0)
    torch.testing.assert_close(sparse, loop, atol=ATOL, rtol=0)
    assert sparse_drops == drops
    cap = moe.capacity(40)
    assert moe.routing.load.tolist() == [min(t, cap) for t in taken]


@pytest.mark.parametrize("kwargs", [dict(), dict(top_k=1), dict(capacity_factor=1.0), dict(router="sigmoid"),
                                    dict(shared_expert=True)])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_the_decode_path_gathers_each_tokens_experts_and_equals_the_loop(kwargs, n):
    """n tokens x k assignments <= E: the gathered path (gpt-fast's decode) runs; same result as the loop."""
    moe, x = layer(**kwargs), torch.randn(1, n, 16, generator=torch.Generator().manual_seed(n))
    assert n * moe.top_k <= moe.n_experts
    with torch.no_grad():
        loop, drops, _ = per_token_loop(moe, x)
        torch.testing.assert_close(moe(x), loop, atol=ATOL, rtol=0)
        torch.testing.assert_close(moe(x), moe.dense_forward(x), atol=ATOL, rtol=0)
    assert moe.routing.dropped == drops


def test_capacity_bounds_every_experts_load_and_counts_what_it_drops():
    """The order of the drops (first choices before second ones) is checked against the loop above."""
    moe = layer(capacity_factor=0.25, top_k=2)  # capacity ceil(0.25 * 40 * 2 / 8) = 3 per expert
    with torch.no_grad():
        moe(x_of())
    assert moe.capacity(40) == 3 and moe.routing.load.max() <= 3
    assert moe.routing.dropped == 80 - int(moe.routing.load.sum()) > 0
    roomy = layer(capacity_factor=100.0)  # a capacity above N * k: nothing dropped
    with torch.no_grad():
        roomy(x_of())
    assert roomy.routing.dropped == 0 and int(roomy.routing.load.sum()) == 80


def test_the_balancing_loss_is_switchs_formula():
    moe, x = layer(), x_of()
    moe(x)
    flat = x.reshape(-1, 16)
    probs = F.softmax(flat @ moe.gate.weight.t(), dim=-1)
    chosen = probs.topk(2, dim=-1).indices
    share = torch.stack([(chosen == e).float().sum() for e in range(8)]) / (40 * 2)
    expected = 8 * (share * probs.mean(0)).sum()
    assert moe.routing.aux_loss.item() == pytest.approx(expected.item(), abs=1e-6)
    uniform = layer()
    with torch.no_grad():
        uniform.gate.weight.zero_()  # equal scores: the loss's minimum, 1
    uniform(x)
    assert uniform.routing.aux_loss.item() == pytest.approx(1.0, abs=1e-6)


def test_selection_bias_moves_towards_the_underloaded_experts():
    moe, x = layer(router="sigmoid"), x_of()
    moe(x)
    load = moe.routing.load.float()
    moe.update_selection_bias(0.1)
    assert torch.equal(moe.selection_bias, 0.1 * torch.sign(load.mean() - load))


def test_one_expert_of_one_is_gptlites_mlp():
    torch.manual_seed(0)
    dense = GPTlite(vocab_size=65, d_model=16, n_heads=2, d_head=8, n_layers=2, dropout_p=0.0, seqlen=16).eval()
    moe = GPTlite_MoE(**dense.config.to_dict(), n_experts=1, top_k=1).eval()
    state = dense.state_dict()
    for i in range(2):
        net = f"blocks.{i}.ffwd.net"
        state[f"blocks.{i}.ffwd.w_in"] = state.pop(f"{net}.0.weight").t()[None]
        state[f"blocks.{i}.ffwd.b_in"] = state.pop(f"{net}.0.bias")[None]
        state[f"blocks.{i}.ffwd.w_out"] = state.pop(f"{net}.2.weight").t()[None]
        state[f"blocks.{i}.ffwd.b_out"] = state.pop(f"{net}.2.bias")[None]
        state[f"blocks.{i}.ffwd.gate.weight"] = torch.randn(1, 16)
        state[f"blocks.{i}.ffwd.selection_bias"] = torch.zeros(1)
    moe.load_state_dict(state)
    idx = torch.randint(65, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(moe(idx)[0], dense(idx), atol=ATOL, rtol=0)


def test_config_round_trip_and_the_training_loss():
    config = GPTliteMoEConfig(65, 16, 2, 8, 2, 0.0, 16, n_experts=4, top_k=2, capacity_factor=1.25, shared_expert=True)
    assert config.d_expert == 64 and GPTliteMoEConfig.from_dict(config.to_dict()) == config
    model = GPTlite_MoE.from_config(config)
    x = torch.randint(65, (2, 16), generator=torch.Generator().manual_seed(0))
    y = torch.randint(65, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = moe_loss_fn(aux_weight=0.1)(model, x, y)
    ce = F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten())
    assert loss.item() == pytest.approx(ce.item() + 0.1 * model.aux_loss().item(), abs=1e-5)
    loss.backward()
    assert all(layer.gate.weight.grad is not None for layer in model.moe_layers())  # the aux loss trains the gate


def small_moe(**kwargs):
    torch.manual_seed(0)
    return GPTlite_MoE(vocab_size=65, d_model=16, n_heads=2, d_head=8, n_layers=2, dropout_p=0.0, seqlen=16,
                       n_experts=4, top_k=2, d_expert=8, **kwargs).eval()


@pytest.mark.parametrize("kwargs", [dict(), dict(router="sigmoid", shared_expert=True)])
def test_the_cached_model_decodes_as_the_full_pass_and_the_reference(kwargs):
    """GPTlite_MoE is a GPTlite_KVCache: prefill half, decode the rest one token at a time (the gathered
    path) = the full pass (the grouped path) = the dense reference; greedy cached tokens = no cache."""
    from gptlite_kvcache import StaticKVCache, generate_kvcache
    model, window = small_moe(**kwargs), torch.randint(65, (3, 16), generator=torch.Generator().manual_seed(2))
    assert training.cached_matches_full(model, window, atol=ATOL)
    with torch.no_grad():
        sparse = model(window)[0]
        reference = model.dense_reference()(window)[0]
        model.dense_reference(False)
    torch.testing.assert_close(sparse, reference, atol=ATOL, rtol=0)
    assert not any(layer.dense for layer in model.moe_layers())
    prompt = window[:, :4]
    tokens = generate_kvcache(model, prompt, 12, 16, StaticKVCache.for_model(model, 3))
    uncached = prompt
    with torch.no_grad():
        for _ in range(12):
            uncached = torch.cat([uncached, model(uncached)[0][:, -1:].argmax(-1)], dim=1)
    assert torch.equal(tokens, uncached)


def test_set_capacity_factor_checks_and_updates_the_config():
    model = small_moe()
    model.set_capacity_factor(1.25)
    assert model.config.capacity_factor == 1.25 and all(l.capacity_factor == 1.25 for l in model.moe_layers())
    with pytest.raises(ValueError, match="capacity"):
        model.set_capacity_factor(0)
    assert model.config.capacity_factor == 1.25


@pytest.mark.parametrize("kwargs, match", [(dict(top_k=9), "top_k"), (dict(top_k=0), "top_k"),
                                           (dict(capacity_factor=0.0), "capacity"),
                                           (dict(capacity_factor=float("inf")), "capacity"),
                                           (dict(router="relu"), "router"), (dict(n_experts=0), "n_experts")])
def test_bad_settings_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoEFeedForward(16, 24, **kwargs)


def test_a_router_with_non_finite_scores_is_a_clear_error():
    moe = layer()
    with torch.no_grad():
        moe.gate.weight[0, 0] = float("nan")
    with pytest.raises(RouterError, match="non-finite"):
        moe(x_of())
    assert issubclass(RouterError, training.GPTliteError)


def test_within_capacity_keeps_each_experts_first_keys():
    g = torch.Generator().manual_seed(3)
    experts, keys = torch.randint(5, (60,), generator=g), torch.randperm(60, generator=g) * 7 + 2
    kept = within_capacity(experts, keys, 5, 4)
    for e in range(5):
        mine = sorted(int(k) for k in keys[experts == e])
        assert {int(k) for k in keys[kept & (experts == e)]} == set(mine[:4])


# ----------------------------------------------------------------------------------------------------
# main_moe.py

QUICK = ["--preset", "cpu", "--device", "cpu", "--repeats", "1", "--n-tokens", "4", "--prompt-len", "8",
         "--val-batches", "1"]


@pytest.mark.parametrize("flags, match", [(["--top-k", "9"], "--top-k 9 exceeds"), (["--capacity-factors", "0"], "0"),
                                          (["--capacity-factors", "-1"], "-1"), (["--n-experts", "3"], "divide"),
                                          (["--aux-weight", "nan"], "finite"), (["--router", "relu"], "relu")])
def test_bad_moe_flags_are_clear_errors_before_any_work(flags, match, capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        main_moe.main(["--untrained"] + QUICK + flags)
    assert e.value.code == 2 and match in capsys.readouterr().err


def test_a_router_that_goes_non_finite_in_training_stops_and_saves_nothing(real_data, tmp_path):
    model = small_moe()
    with torch.no_grad():
        model.moe_layers()[1].gate.weight[0, 0] = float("inf")
    recipe = dict(iters=3, batch_size=2, seqlen=16, lr=1e-3, seed=0)
    path = tmp_path / "moe.pt"
    with pytest.raises(RouterError, match="Nothing was saved"):
        iu.cached_model(model, model.config.to_dict(), path, main_moe.trainer(real_data, recipe, moe_loss_fn(), "t"),
                        real_data.vocab, "python main_moe.py")
    assert list(tmp_path.iterdir()) == []


def test_main_moe_writes_dense_and_moe_rows_with_their_checks(real_data, tmp_path):
    out_json, out_png = tmp_path / "m.json", tmp_path / "m.png"
    main_moe.main(["--untrained", "--json", str(out_json), "--plot", str(out_png)] + QUICK)
    result = json.loads(out_json.read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert [v.split(",")[0] for v in rows] == ["dense", "dense", "moe", "moe"]
    for name, row in rows.items():
        assert row["cached_eq_full"] == "yes" and row["sparse_eq_reference"] == ("yes" if name.startswith("moe") else "-")
        assert row["tpot_b1_ms"] is None or row["tpot_b1_ms"] > 0
    moe = rows["moe, balanced"]
    # per layer: the router (128 x 8) and the second layer's bias of every expert (dense: one bias of 128)
    assert moe["params"] == rows["dense, same total (d_ff=512)"]["params"] + 4 * (128 * 8 + 7 * 128)
    assert moe["active_params"] == rows["dense, same active (d_ff=128)"]["params"] + 4 * (128 * 8 + 1 * 128)
    loads, capacity = (t["rows"] for t in result["tables"])
    assert len(loads) == 2 * 4 and all(sum(r[f"e{e}_%"] for e in range(8)) == pytest.approx(100, abs=0.5) for r in loads)
    drops = {(r["variant"], r["capacity_factor"]): r["dropped_pct"] for r in capacity}
    assert drops["moe, balanced", "none"] == 0 and drops["moe, balanced", 1.0] >= drops["moe, balanced", 2.0]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    renders_on_its_page("main_moe", result)


def test_main_moe_trains_each_model_once_then_loads_it(real_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(files, "checkpoint_path", lambda name: tmp_path / f"{name}.pt")
    flags = ["--iters", "2", "--json", str(tmp_path / "a.json")] + QUICK
    main_moe.main(flags)
    assert len(list(tmp_path.glob("*.pt"))) == 4
    first = json.loads((tmp_path / "a.json").read_text())["rows"]
    main_moe.main(flags)
    second = json.loads((tmp_path / "a.json").read_text())["rows"]
    assert all(r["train_s"] is not None for r in first) and all(r["train_s"] is None for r in second)
    assert [r["val_loss"] for r in first] == [r["val_loss"] for r in second]
