"""gptlite_moe.py: the sparse path equals the dense reference (every expert on every token, masked) and an
independent per-token loop; capacity drops exactly the assignments GShard's order drops; the balancing loss
is Switch's formula; bad settings and a non-finite router are clear errors."""
import math

import pytest
import torch
import torch.nn.functional as F

from gptlite import GPTlite
from gptlite_moe import GPTlite_MoE, GPTliteMoEConfig, MoEFeedForward, RouterError, moe_loss_fn
from lib import training

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
    torch.testing.assert_close(moe(idx), dense(idx), atol=ATOL, rtol=0)


def test_config_round_trip_and_the_training_loss():
    config = GPTliteMoEConfig(65, 16, 2, 8, 2, 0.0, 16, n_experts=4, top_k=2, capacity_factor=1.25, shared_expert=True)
    assert config.d_expert == 64 and GPTliteMoEConfig.from_dict(config.to_dict()) == config
    model = GPTlite_MoE.from_config(config)
    x = torch.randint(65, (2, 16), generator=torch.Generator().manual_seed(0))
    y = torch.randint(65, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = moe_loss_fn(aux_weight=0.1)(model, x, y)
    ce = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    assert loss.item() == pytest.approx(ce.item() + 0.1 * model.aux_loss().item(), abs=1e-5)
    loss.backward()
    assert all(layer.gate.weight.grad is not None for layer in model.moe_layers())  # the aux loss trains the gate


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
