"""DSA: the lightning indexer against a loop written here, the top-k selection against one computed here,
the sparse attention against an explicit softmax over the selected keys, GPTlite's logits at top-k of
every token, cached decoding against the full pass, the two training stages (what each trains and what
it leaves alone), the recall against a direct computation, the costs against the mask, clear errors."""
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, random_gptlite

from gptlite import GPTlite
from gptlite_kvcache import generate_kvcache
from gptlite_dsa import (DSACache, GPTlite_DSA, GPTlite_DSA_KVCache, LightningIndexer, check_dsa_args, indexer_kl,
                         select_topk)
from lib.dsa import attention_cost, dsa_from_dense, indexer_recall, keys_read, sparse_loss, sparse_uptrain, warmup_indexer

ATOL = 1e-5  # float32 outputs and logits of a few units



def random_dsa(top_k, seed=0, n_index_heads=3, d_index=4):
    """A GPTlite_DSA of random_gptlite's weights whose indexers are random too (N(0, 0.5): spread scores)."""
    model = dsa_from_dense(random_gptlite(seed), top_k, n_index_heads, d_index)
    with torch.no_grad():
        for p in model.indexer_parameters():
            p.normal_(0.0, 0.5)
    return model


def tokens(B=3, S=TINY["seqlen"], seed=1):
    return torch.randint(TINY["vocab_size"], (B, S), generator=torch.Generator().manual_seed(seed))


def reference_index_scores(indexer, x):
    """One (query, key) pair at a time: sum over index heads j of w[t, j] * ReLU(q[t, j] . k[s])."""
    B, S, _ = x.shape
    H, d = indexer.n_index_heads, indexer.d_index
    out = torch.zeros(B, S, S)
    for b in range(B):
        for t in range(S):
            q = (indexer.query_proj.weight @ x[b, t] + indexer.query_proj.bias).view(H, d)
            w = (indexer.weights_proj.weight @ x[b, t] + indexer.weights_proj.bias) / math.sqrt(H * d)
            for s in range(S):
                k = F.layer_norm(indexer.key_proj.weight @ x[b, s] + indexer.key_proj.bias, (d,),
                                 indexer.key_norm.weight, indexer.key_norm.bias)
                out[b, t, s] = sum(w[j] * torch.relu(q[j] @ k) for j in range(H))
    return out


def reference_selection(scores, top_k):
    """Per query t: the past tokens 0..t sorted by score, highest first and the earlier first among equal
    scores; the first top_k of them."""
    *lead, Tq, Tk = scores.shape
    chosen = torch.zeros(scores.shape, dtype=torch.bool)
    flat, out = scores.reshape(-1, Tq, Tk), chosen.view(-1, Tq, Tk)
    for i in range(flat.shape[0]):
        for t in range(Tq):
            past = range(Tk - Tq + t + 1)
            for s in sorted(past, key=lambda s: (-flat[i, t, s].item(), s))[:top_k]:
                out[i, t, s] = True
    return chosen


def test_the_indexer_scores_match_the_loop():
    torch.manual_seed(0)
    indexer = LightningIndexer(d_model=12, n_index_heads=3, d_index=5)
    with torch.no_grad():
        for p in indexer.parameters():
            p.normal_(0.0, 0.5)
        x = torch.randn(2, 7, 12)
        torch.testing.assert_close(indexer(x), reference_index_scores(indexer, x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("top_k", [1, 3, 6, 9, 20])
def test_the_selection_matches_one_computed_here(top_k):
    scores = torch.randn(2, 9, 9, generator=torch.Generator().manual_seed(0))
    scores[0, 6, :4] = 0.0  # ties (ReLU zeros): the earlier token wins
    chosen = select_topk(scores, top_k)
    assert torch.equal(chosen, reference_selection(scores, top_k))
    assert torch.equal(chosen.sum(-1), torch.arange(1, 10).clamp(max=top_k).expand(2, 9))  # never a future token


def test_a_decoding_row_selects_what_the_whole_sequences_row_selects():
    scores = torch.randn(2, 9, 9, generator=torch.Generator().manual_seed(1))
    scores[..., :5] = 0.0  # many ties
    for t in range(9):
        assert torch.equal(select_topk(scores[:, t:t + 1, :t + 1], 3), select_topk(scores, 3)[:, t:t + 1, :t + 1])


@pytest.mark.parametrize("top_k", [1, 4, 9])
def test_the_sparse_attention_matches_an_explicit_softmax_over_the_selected_keys(top_k):
    model = random_dsa(top_k)
    mha, D = model.blocks[0].mha, TINY["d_head"]
    x = torch.randn(2, 11, TINY["d_model"], generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        chosen = reference_selection(reference_index_scores(mha.indexer, x), top_k)  # [B, S, S]
        projections = (mha.query_proj, mha.key_proj, mha.value_proj)
        Q, K, V = (proj(x).view(2, 11, -1, D) for proj in projections)  # [B, S, H, D]
        heads = torch.zeros(2, 11, TINY["n_heads"], D)
        for b in range(2):
            for t in range(11):
                keys = chosen[b, t].nonzero()[:, 0]
                for h in range(TINY["n_heads"]):
                    weights = torch.softmax(K[b, keys, h] @ Q[b, t, h] / math.sqrt(D), dim=0)
                    heads[b, t, h] = weights @ V[b, keys, h]
        torch.testing.assert_close(mha(x), mha.out_proj(heads.flatten(2)), atol=ATOL, rtol=0)


def test_top_k_of_every_token_is_gptlite_exactly_and_fewer_differ():
    base, x = random_gptlite(), tokens()
    with torch.no_grad():
        for top_k in (TINY["seqlen"], 100):
            assert torch.equal(dsa_from_dense(base, top_k)(x), base(x))
        model = random_dsa(4)
        assert not torch.allclose(model(x), base(x), atol=1e-2)
        assert torch.equal(model.set_top_k(TINY["seqlen"])(x), base(x)) and model.config.top_k == TINY["seqlen"]
    with pytest.raises(ValueError, match="--dsa-top-k"):
        model.set_top_k(0)


def test_the_state_dict_is_gptlites_plus_the_indexers():
    base = random_gptlite()
    model = dsa_from_dense(base, 4)
    state, dense = model.state_dict(), base.state_dict()
    assert all(torch.equal(state[name], value) for name, value in dense.items())
    assert set(state) - set(dense) == {name for name in state if ".mha.indexer." in name} != set()
    assert type(model).from_config(model.config).config == model.config


@pytest.mark.parametrize("top_k", [1, 3, 16])
def test_cached_decoding_equals_the_full_pass(top_k):
    model, x = random_dsa(top_k), tokens()
    cached = GPTlite_DSA_KVCache.of(model).eval()
    with torch.no_grad():
        full = model(x)  # [B, S, vocab]
        logits, cache = cached(x[:, :5])
        steps = [logits]
        for t in range(5, TINY["seqlen"]):
            logits, cache = cached(x[:, t:t + 1], cache)
            steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=ATOL, rtol=0)
    # greedy decoding through generate_kvcache: the tokens of re-running the full pass every step
    sequence = x[:, :4]
    with torch.no_grad():
        for _ in range(TINY["seqlen"] - 4):
            sequence = torch.cat([sequence, model(sequence)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(generate_kvcache(cached, x[:, :4], TINY["seqlen"] - 4, TINY["seqlen"]), sequence)
    # a rollback drops the index keys with the keys and values
    cache.truncate(7)
    with torch.no_grad():
        torch.testing.assert_close(cached(x[:, 7:9], cache)[0], full[:, 7:9], atol=ATOL, rtol=0)


def test_a_cache_without_index_keys_is_refused():
    cached = GPTlite_DSA_KVCache.of(random_dsa(3))
    with pytest.raises(ValueError, match="DSACache"):
        cached(tokens(), kv_cache=[None] * TINY["n_layers"])
    with pytest.raises(ValueError, match="update_dsa"):
        DSACache(2, 16).update(0, torch.zeros(1, 3, 1, 8), torch.zeros(1, 3, 1, 8))


def test_the_kl_loss_is_kl_of_the_head_summed_attention_to_the_indexer_softmax():
    g = torch.Generator().manual_seed(3)
    weights = torch.softmax(torch.randn(2, 3, 5, 5, generator=g), -1) * torch.ones(5, 5).tril()
    weights = weights / weights.sum(-1, keepdim=True)  # causal rows
    scores, mask = torch.randn(2, 5, 5, generator=g), torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 5, 5)
    expected = 0.0
    for b in range(2):
        for t in range(5):
            p = weights[b, :, t, :t + 1].sum(0) / 3
            expected += F.kl_div(torch.log_softmax(scores[b, t, :t + 1], 0), p, reduction="sum") / 10
    torch.testing.assert_close(indexer_kl(weights, scores, mask), expected, atol=1e-6, rtol=0)


def test_warmup_trains_the_indexers_alone_and_lowers_their_kl(real_data):
    model = dsa_from_dense(random_gptlite(), 4)
    main = {name: p.clone() for name, p in model.named_parameters() if ".indexer." not in name}
    indexer = [p.clone() for p in model.indexer_parameters()]
    before, after, history = warmup_indexer(model, real_data, steps=8, lr=3e-2, batch_size=4, val_windows=4)
    assert after < 0.9 * before and history[-1]["val_loss"] == after
    assert all(torch.equal(p, main[name]) for name, p in model.named_parameters() if name in main)
    assert all(not torch.equal(p, q) for p, q in zip(model.indexer_parameters(), indexer))
    assert all(p.requires_grad for p in model.parameters())  # unfrozen again


def test_sparse_training_keeps_each_loss_to_its_own_parameters(real_data):
    model, x = random_dsa(4).train(), tokens()
    indexer = {id(p) for p in model.indexer_parameters()}
    with model.recording():
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()  # the language-modelling loss
    assert all(p.grad is None for p in model.indexer_parameters())  # the selection has no gradient
    model.zero_grad(set_to_none=True)
    with model.recording():
        model(x)
        model.indexer_loss().backward()  # the KL loss
    assert all(p.grad is None for p in model.parameters() if id(p) not in indexer)  # detached input and target
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.indexer_parameters())
    model.zero_grad(set_to_none=True)
    assert sparse_loss(model, x, x).item() > 0
    before = [p.clone() for p in model.parameters()]
    history = sparse_uptrain(model, real_data, steps=2, lr=1e-3, batch_size=2, val_batches=1)
    assert len(history) == 1 and all(not torch.equal(p, q) for p, q in zip(model.parameters(), before))


def reference_recall(model, x, top_k, from_position=0):
    """The dense forward pass of the GPTlite weights written out, with each layer's attention weights and
    the test's own index scores and selection: mass on the selected keys, mean over layers, heads, queries."""
    S, D = x.shape[1], TINY["d_head"]
    h = model.token_embedding(x) + model.position_embedding(torch.arange(S))
    recalls = []
    for block in model.blocks:
        a, mha = block.ln1(h), block.mha
        Q, K = (proj(a).view(*x.shape, -1, D).transpose(1, 2) for proj in (mha.query_proj, mha.key_proj))
        weights = torch.softmax((Q @ K.transpose(-2, -1) / math.sqrt(D)).masked_fill(
            torch.ones(S, S).triu(1).bool(), float("-inf")), dim=-1)  # [B, H, S, S]
        chosen = reference_selection(reference_index_scores(mha.indexer, a), top_k)  # [B, S, S]
        recalls.append((weights * chosen[:, None]).sum(-1)[..., from_position:].mean())
        V = mha.value_proj(a).view(*x.shape, -1, D).transpose(1, 2)
        h = h + mha.out_proj((weights @ V).transpose(1, 2).flatten(2))
        h = h + block.ffwd(block.ln2(h))
    return torch.stack(recalls).mean().item()


def test_indexer_recall_matches_a_direct_computation_and_is_one_at_every_token():
    model, x = random_dsa(4), tokens(B=2)
    with torch.no_grad():
        for top_k, start in ((2, 0), (5, 0), (5, 5)):
            assert indexer_recall(model, x, top_k, start) == pytest.approx(reference_recall(model, x, top_k, start),
                                                                           abs=1e-6)
    assert indexer_recall(model, x, TINY["seqlen"]) == pytest.approx(1.0, abs=1e-6)
    assert indexer_recall(model, x, 5, from_position=5) < indexer_recall(model, x, 5) < 0.95
    with pytest.raises(ValueError, match="from_position"):
        indexer_recall(model, x, 5, from_position=TINY["seqlen"])


def test_a_trained_dsa_model_saves_and_reloads_through_cached_model(tmp_path, real_data):
    import inference_utils as iu
    model, x = random_dsa(4), tokens()
    config, path = model.config.to_dict(), tmp_path / "dsa.pt"
    iu.cached_model(model, config, path, lambda m: None, real_data.vocab, "rebuild", stamp="s")
    reloaded, seconds = iu.cached_model(GPTlite_DSA(**config), config, path, None, real_data.vocab, "rebuild",
                                        stamp="s")
    with torch.no_grad():
        assert seconds is None and torch.equal(reloaded(x), model(x))


@pytest.mark.parametrize("top_k", [1, 3, 16])
def test_keys_read_and_costs_count_the_mask(top_k):
    counted = select_topk(torch.randn(2, 16, 16), top_k).sum(-1)  # [B, S]
    assert torch.equal(counted, torch.tensor([keys_read(p, top_k) for p in range(16)]).expand(2, 16))
    flops, kv = attention_cost(15, top_k, n_heads=3, d_head=8, n_layers=2, n_index_heads=4, d_index=5)
    keys = counted[0, -1].item()
    assert flops == 2 * (4 * keys * 3 * 8 + 16 * 4 * (2 * 5 + 2))
    assert kv == 2 * 4 * (2 * keys * 3 * 8 + 16 * 5)
    assert attention_cost(15, None, n_heads=3, d_head=8, n_layers=2) == (2 * 4 * 16 * 3 * 8, 2 * 4 * 2 * 16 * 3 * 8)
    assert attention_cost(15, top_k, 3, 8, 2, 4, 5, index_bytes_per_value=1)[1] == kv - 2 * 16 * 5 * 3


@pytest.mark.parametrize("kwargs, flag", [(dict(top_k=0), "--dsa-top-k"), (dict(n_index_heads=0), "--dsa-index-heads"),
                                          (dict(d_index=-1), "--dsa-index-dim"), (dict(top_k=2.5), "--dsa-top-k"),
                                          (dict(top_k=True), "--dsa-top-k")])
def test_bad_settings_are_clear_errors_naming_the_flag(kwargs, flag):
    settings = dict(top_k=4, n_index_heads=2, d_index=4) | kwargs
    with pytest.raises(ValueError, match=flag):
        check_dsa_args(**settings)
    with pytest.raises(ValueError, match=flag):
        GPTlite_DSA(**TINY, **settings)


@pytest.mark.parametrize("stage, kwargs, flag", [
    (warmup_indexer, dict(steps=0, lr=1e-3), "--dsa-warmup-steps"),
    (warmup_indexer, dict(steps=2, lr=0.0), "--dsa-lr"),
    (sparse_uptrain, dict(steps=-1, lr=1e-3), "--dsa-sparse-steps"),
    (sparse_uptrain, dict(steps=2, lr=float("nan")), "--dsa-lr")])
def test_bad_training_settings_are_clear_errors_before_any_work(stage, kwargs, flag):
    model = random_dsa(4)
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=flag):
        stage(model, None, **kwargs)  # no data needed: the error comes first
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_the_warmup_target_has_no_dropout(monkeypatch, real_data):
    """train_steps puts the model in training mode; the warm-up's loss is still that of the frozen model
    at inference (no dropout), so the same batch gives the same loss twice, whatever dropout_p."""
    import lib.dsa
    torch.manual_seed(0)
    model = dsa_from_dense(GPTlite(**TINY | dict(dropout_p=0.5)), 4)
    x = tokens()
    losses = []

    def fake_train_steps(m, data, n_steps, batch_size, seqlen, lr, loss_fn, **kwargs):
        for _ in range(2):
            m.train()
            losses.append(loss_fn(m, x, x).item())
        return []
    monkeypatch.setattr(lib.dsa.training, "train_steps", fake_train_steps)
    warmup_indexer(model, real_data, steps=1, lr=1e-3, val_windows=2)
    assert losses[0] == losses[1] > 0
