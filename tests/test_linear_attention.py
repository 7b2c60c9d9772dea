"""Linear attention: the chunked form against the recurrent form, both against a recurrence written here
(the issue's orientation, S of [d_v, d_k]) and against flash-linear-attention's naive references; the
model's decoding with a carried state against its full pass; the hybrid's softmax blocks against
GPTlite_KVCache; MQAR batches; clear errors; main_linear_attention.py end to end on random weights."""
import json
import os

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, renders_on_its_page

import inference_utils as iu
import main_linear_attention as mla
from gptlite_kvcache import GPTlite_KVCache
from gptlite_linear import (RULES, GPTlite_Linear, LinearAttention, chunked, decayed_products, recurrent,
                            recurrent_step)
from lib import harness, training
from lib.errors import CheckpointError

ATOL = 1e-5  # float32, unit-scale inputs
B, H, D = 2, 3, 8


def random_inputs(rule, T, seed=0, d_v=D):
    """q, k, v [B, H, T, D], log a [B, H, T] ([B, H, T, D] for "kda") and b [B, H, T] as the layer makes them
    for `rule`."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, B, H, T, D, generator=g).unbind(0)
    v = torch.randn(B, H, T, d_v, generator=g)
    if rule == "linear":
        return F.elu(q) + 1, F.elu(k) + 1, v, None, None
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    # decays of 0.3 .. 0.9: far from 1, a wrong one shows; KDA's differ from channel to channel
    log_a = F.logsigmoid(torch.randn(B, H, T, *([D] if rule == "kda" else []), generator=g))
    beta = torch.rand(B, H, T, generator=g) if rule in ("delta", "kda") else None
    return q, k, v, log_a, beta


def reference(q, k, v, log_a, beta, S=None):
    """The issue's equations, token by token, with S of [d_v, d_k] and o_t = S_t q_t. A decay per key channel
    (KDA): S_{t-1} Diag(a_t), column c of S (key channel c) times a_t[c]."""
    out = []
    S = q.new_zeros(B, H, v.shape[-1], q.shape[-1]) if S is None else S.transpose(-1, -2)
    for t in range(q.shape[2]):
        q_t, k_t, v_t = q[:, :, t, :, None], k[:, :, t, :, None], v[:, :, t, :, None]  # columns
        if log_a is None:
            a = 1.0
        elif log_a.dim() == 4:  # [B, H, T, d_k]
            a = log_a[:, :, t, None, :].exp()  # multiplies S [d_v, d_k] column by column: S Diag(a_t)
        else:
            a = log_a[:, :, t, None, None].exp()
        if beta is None:
            S = a * S + v_t @ k_t.transpose(-1, -2)
        else:
            b = beta[:, :, t, None, None]
            S = a * S - b * (a * S @ k_t - v_t) @ k_t.transpose(-1, -2)
        out.append((S @ q_t)[..., 0])
    return torch.stack(out, dim=2), S.transpose(-1, -2)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("T,chunk_size", [(32, 16), (37, 16), (5, 16), (24, 1)])
def test_chunked_equals_recurrent_equals_reference(rule, T, chunk_size):
    q, k, v, log_a, beta = random_inputs(rule, T)
    S0 = torch.randn(B, H, D, D, generator=torch.Generator().manual_seed(9)) * 0.1  # a carried state
    o_ref, S_ref = reference(q, k, v, log_a, beta, S0)
    o_rec, S_rec = recurrent(q, k, v, log_a, beta, S0)
    o_chk, S_chk = chunked(q, k, v, log_a, beta, S0, chunk_size)
    torch.testing.assert_close(o_rec, o_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(o_chk, o_ref, atol=ATOL * (10 if rule == "linear" else 1), rtol=1e-5)
    torch.testing.assert_close(S_chk, S_rec, atol=ATOL * (10 if rule == "linear" else 1), rtol=1e-5)


def test_the_rules_differ():
    """The three recurrences are different maps (a test that cannot fail on a shared bug would be void)."""
    q, k, v, log_a, beta = random_inputs("delta", 20)
    plain = recurrent(q, k, v)[0]
    gated = recurrent(q, k, v, log_a)[0]
    delta = recurrent(q, k, v, log_a, beta)[0]
    assert (plain - gated).abs().max() > 0.1 and (gated - delta).abs().max() > 0.1


def test_kda_with_a_decay_equal_across_channels_is_the_delta_rule():
    """A per-channel decay with the same value in every channel is the per-head decay: the recurrent form
    exactly (the same float products), the chunked form to ATOL (its per-channel sums are ordered otherwise)."""
    q, k, v, log_a, beta = random_inputs("delta", 37)
    per_channel = log_a[..., None].expand(B, H, 37, D)
    o_delta, S_delta = recurrent(q, k, v, log_a, beta)
    o_kda, S_kda = recurrent(q, k, v, per_channel, beta)
    assert torch.equal(o_kda, o_delta) and torch.equal(S_kda, S_delta)
    o_chk, S_chk = chunked(q, k, v, per_channel, beta, chunk_size=16)
    torch.testing.assert_close(o_chk, o_delta, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(S_chk, S_delta, atol=ATOL, rtol=1e-5)
    assert (recurrent(q, k, v, F.logsigmoid(torch.randn(B, H, 37, D)), beta)[0] - o_delta).abs().max() > 0.1


@pytest.mark.parametrize("chunk_size", [16, 12, 5])  # sub-chunks of 8, 6 and 5 tokens
def test_kda_chunked_is_stable_when_decays_underflow(chunk_size):
    """Decays of e^-20 .. e^-1 per token: a chunk's cumulative log decay reaches about -300, where e^{-G}
    overflows float32; the sub-chunks (decayed_products) keep the chunked form finite and equal to the recurrent."""
    q, k, v, _, beta = random_inputs("kda", 40)
    log_a = -torch.empty(B, H, 40, D).uniform_(1, 20, generator=torch.Generator().manual_seed(3))
    o_rec, S_rec = recurrent(q, k, v, log_a, beta)
    o_chk, S_chk = chunked(q, k, v, log_a, beta, chunk_size=chunk_size)
    assert torch.isfinite(o_chk).all() and torch.isfinite(S_chk).all()
    torch.testing.assert_close(o_chk, o_rec, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(S_chk, S_rec, atol=ATOL, rtol=1e-5)


def test_kda_decays_start_near_one():
    """A new KDA layer (GPTlite's init) forgets slowly: every channel's decay between 0.9 and 0.999 (+- the
    small projection's share), one decay per head and channel."""
    torch.manual_seed(0)
    model = GPTlite_Linear(**TINY, rule="kda")
    x = model.blocks[0].ln1(model.token_embedding(torch.randint(TINY["vocab_size"], (2, 10))))
    _, _, _, log_a, beta = model.blocks[0].mha.inputs(x)
    assert log_a.shape == (2, TINY["n_heads"], 10, TINY["d_head"]) and beta.shape == (2, TINY["n_heads"], 10)
    assert 0.89 < log_a.exp().min() and log_a.exp().max() < 0.9995
    assert log_a.exp().std(-1).min() > 0  # per channel, not one per head


@pytest.mark.parametrize("C", [32, 12, 7])
def test_decayed_products_against_pairwise_factors(C):
    """decayed_products against the sum written out: sum_c x_ic y_jc e^{G_ic - G_jc} for j <= i, 0 above."""
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(2, 2, C, D, generator=g, dtype=torch.float64).unbind(0)
    G = (-torch.rand(2, C, D, generator=g, dtype=torch.float64)).cumsum(-2)
    expected = torch.zeros(2, C, C, dtype=torch.float64)
    for i in range(C):
        for j in range(i + 1):
            expected[:, i, j] = (x[:, i] * y[:, j] * (G[:, i] - G[:, j]).exp()).sum(-1)
    torch.testing.assert_close(decayed_products(x, y, G), expected, atol=1e-12, rtol=0)


def to_fla(x):
    return x.transpose(1, 2).contiguous()  # [B, H, T, ...] -> fla's [B, T, H, ...]


@pytest.mark.parametrize("rule", RULES)
def test_against_fla_naive_references(rule):
    """flash-linear-attention's naive PyTorch references (CPU): scale 1 (our queries are feature-mapped or
    unit-norm, no 1/sqrt(d)), gates as log decays, [B, T, H, D] layout, state [B, H, d_k, d_v] as ours."""
    pytest.importorskip("fla")
    q, k, v, log_a, beta = random_inputs(rule, 40)
    if rule == "linear":
        from fla.ops.linear_attn.naive import naive_recurrent_linear_attn
        o, S = naive_recurrent_linear_attn(*map(to_fla, (q, k, v)), scale=1.0, output_final_state=True)
    elif rule == "gated":
        from fla.ops.simple_gla.naive import naive_recurrent_simple_gla
        o, S = naive_recurrent_simple_gla(*map(to_fla, (q, k, v, log_a)), scale=1.0, output_final_state=True)
    elif rule == "kda":  # fla's g: the log decay per channel, [B, T, H, d_k]
        from fla.ops.kda.naive import naive_recurrent_kda
        o, S = naive_recurrent_kda(*map(to_fla, (q, k, v, log_a, beta)), scale=1.0, output_final_state=True)
    else:
        from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
        o, S = naive_recurrent_gated_delta_rule(*map(to_fla, (q, k, v)), beta=to_fla(beta), g=to_fla(log_a),
                                                scale=1.0, output_final_state=True)
    o_chk, S_chk = chunked(q, k, v, log_a, beta, chunk_size=16)
    torch.testing.assert_close(o_chk, o.transpose(1, 2), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(S_chk, S, atol=1e-4, rtol=1e-5)


def test_kda_recurrent_form_against_fla_with_a_starting_state_and_a_scale():
    """KDA's recurrent form itself (not only the chunked) against naive_recurrent_kda, from a nonzero state
    and with fla's query scale (ours: the scale folded into q)."""
    pytest.importorskip("fla")
    from fla.ops.kda.naive import naive_recurrent_kda
    q, k, v, log_a, beta = random_inputs("kda", 23)
    S0 = 0.3 * torch.randn(q.shape[0], q.shape[1], q.shape[-1], v.shape[-1], generator=torch.Generator().manual_seed(5))
    o, S = naive_recurrent_kda(*map(to_fla, (q, k, v, log_a, beta)), scale=0.5, initial_state=S0.clone(),
                               output_final_state=True)
    o_ref, S_ref = recurrent(0.5 * q, k, v, log_a, beta, S0)
    torch.testing.assert_close(o_ref, o.transpose(1, 2), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(S_ref, S, atol=1e-5, rtol=1e-5)


def random_model(rule, hybrid_every=None, chunk_size=4, seed=0, **config):
    """TINY GPTlite_Linear with every parameter from N(0, 0.5), as conftest's tiny_models."""
    torch.manual_seed(seed)
    model = GPTlite_Linear(**dict(TINY, **config), rule=rule, hybrid_every=hybrid_every, chunk_size=chunk_size)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model.eval()


KINDS = [("linear", None, {}), ("gated", None, {}), ("delta", None, {}), ("delta", 2, {}), ("gated", 2, {}),
         ("kda", None, {}), ("kda", 2, dict(hybrid_attention="mla", d_latent=5))]


@pytest.mark.parametrize("rule,hybrid_every,mla_config", KINDS)
@pytest.mark.parametrize("chunk_size,T", [(4, 16), (5, 16), (32, 16)])
@torch.inference_mode()
def test_model_decoding_with_state_equals_full_pass(rule, hybrid_every, mla_config, chunk_size, T):
    model = random_model(rule, hybrid_every, chunk_size, **mla_config)
    x = torch.randint(TINY["vocab_size"], (2, T), generator=torch.Generator().manual_seed(1))
    full, _ = model(x)
    recurrent_form, _ = model(x, form="recurrent")
    logits, cache = model(x[:, :7])  # prefill a length no chunk size divides, then one token at a time
    steps = [logits]
    for t in range(7, T):
        logits, cache = model(x[:, t:t + 1], cache)
        steps.append(logits)
    torch.testing.assert_close(recurrent_form, full, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-4, rtol=1e-5)
    assert training.cached_matches_full(model, x)


@torch.inference_mode()
def test_state_is_constant_and_kv_cache_grows():
    model = random_model("delta", hybrid_every=2)  # block 0 linear, block 1 softmax
    x = torch.randint(TINY["vocab_size"], (1, 40))
    _, short = model(x[:, :10])
    _, long = model(x)
    assert short[0].shape == long[0].shape == (1, TINY["n_heads"], TINY["d_head"], TINY["d_head"])
    assert short[1][0].shape[2] == 10 and long[1][0].shape[2] == 40  # (keys, values) [B, H, T, D]
    assert len(x[0]) > TINY["seqlen"]  # no position table: longer than the training window runs


@torch.inference_mode()
def test_hybrid_softmax_blocks_are_cached_like_gptlite_kvcache():
    """hybrid_every=1: every block softmax, no positions; GPTlite_KVCache with the same weights and a zero
    position table gives the same logits and the same per-layer (keys, values), prefill and decode."""
    model = random_model("delta", hybrid_every=1)
    reference = GPTlite_KVCache(**TINY).eval()
    state = dict(model.state_dict(), **{"position_embedding.weight": torch.zeros(TINY["seqlen"], TINY["d_model"])})
    reference.load_state_dict(state)
    x = torch.randint(TINY["vocab_size"], (2, TINY["seqlen"]), generator=torch.Generator().manual_seed(2))
    ours, ours_cache = model(x[:, :10])
    theirs, theirs_cache = reference(x[:, :10])
    for t in range(10, x.shape[1]):
        step, ours_cache = model(x[:, t:t + 1], ours_cache)
        ref_step, theirs_cache = reference(x[:, t:t + 1], theirs_cache)
        ours, theirs = torch.cat([ours, step], 1), torch.cat([theirs, ref_step], 1)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    for (k, v), (k_ref, v_ref) in zip(ours_cache, theirs_cache):
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_hybrid_layout_every_fourth_block():
    model = random_model("delta", hybrid_every=4, n_layers=8)
    kinds = [type(b).__name__ for b in model.blocks]
    assert kinds == ["LinearBlock"] * 3 + ["Block_KVCache"] + ["LinearBlock"] * 3 + ["Block_KVCache"]


@torch.inference_mode()
def test_mla_hybrid_cache_is_the_linear_states_and_the_latents():
    """KDA + MLA, 3:1 (blocks 0-2 KDA, block 3 MLA): the cache of a batch after T tokens, counted by hand:
    3 states of H x d_k x d_v floats, constant, and T latents of d_latent floats, growing, per sequence."""
    model = random_model("kda", 4, n_layers=4, hybrid_attention="mla", d_latent=5)
    assert [type(b).__name__ for b in model.blocks] == ["LinearBlock"] * 3 + ["Block_MLA"]
    assert model.blocks[3].mha.d_latent == 5
    x = torch.randint(TINY["vocab_size"], (2, 30))
    for T in (7, 30):
        _, cache = model(x[:, :T])
        assert cache[3][0].shape == (2, 1, T, 5)
        by_hand = 2 * 4 * (3 * TINY["n_heads"] * TINY["d_head"] * TINY["d_head"] + T * 5)  # float32, 2 sequences
        assert iu.kv_cache_bytes(cache) == by_hand


def test_model_trains():
    """A few AdamW steps lower the loss of each rule (the chunked form has gradients)."""
    torch.manual_seed(0)
    x = torch.randint(TINY["vocab_size"], (4, TINY["seqlen"]))
    for rule in RULES:
        model = GPTlite_Linear(**TINY, rule=rule, chunk_size=4).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(5):
            loss = training.cross_entropy_loss(model, x[:, :-1], x[:, 1:])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0], rule


def test_bad_configuration_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown rule 'mamba'"):
        GPTlite_Linear(**TINY, rule="mamba")
    with pytest.raises(ValueError, match="hybrid_every must be"):
        GPTlite_Linear(**TINY, rule="delta", hybrid_every=0)
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        GPTlite_Linear(**TINY, rule="delta", chunk_size=0)
    layer = LinearAttention(32, 3, 8, 0.0, "gated")
    with pytest.raises(ValueError, match="start with state=None"):
        layer(torch.zeros(2, 3, 32), torch.zeros(1, 3, 8, 8))
    with pytest.raises(ValueError, match="form must be"):
        layer(torch.zeros(2, 3, 32), form="parallel")
    with pytest.raises(ValueError, match="unknown hybrid_attention 'flash'"):
        GPTlite_Linear(**TINY, rule="kda", hybrid_every=2, hybrid_attention="flash")
    with pytest.raises(ValueError, match="d_latent is MLA's"):
        GPTlite_Linear(**TINY, rule="kda", hybrid_every=2, d_latent=4)
    with pytest.raises(ValueError, match="needs hybrid_every"):
        GPTlite_Linear(**TINY, rule="kda", hybrid_attention="mla", d_latent=4)
    with pytest.raises(ValueError, match="d_latent must be an integer between 1 and the full rank"):
        GPTlite_Linear(**TINY, rule="kda", hybrid_every=2, hybrid_attention="mla", d_latent=33)
    model = random_model("delta")
    with pytest.raises(ValueError, match="the cache has 1 layers"):
        model(torch.zeros(1, 1, dtype=torch.long), [None])


@pytest.mark.parametrize("rule", ["delta", "kda"])
def test_recurrent_step_is_one_token_of_recurrent(rule):
    q, k, v, log_a, beta = random_inputs(rule, 1)
    o, S = recurrent_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], log_a[:, :, 0], beta[:, :, 0], q.new_zeros(B, H, D, D))
    o_ref, S_ref = reference(q, k, v, log_a, beta)
    torch.testing.assert_close(o, o_ref[:, :, 0], atol=ATOL, rtol=0)
    torch.testing.assert_close(S, S_ref, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------------------------------
# main_linear_attention.py

def test_cached_model_saves_then_reuses(tmp_path):
    config = dict(TINY, rule="gated", hybrid_every=None)
    path = tmp_path / "tiny_linear.pt"
    trained = []

    def train(model):
        trained.append(True)
        with torch.no_grad():
            model.fc_out.bias.fill_(0.25)
    model, seconds = iu.cached_model(GPTlite_Linear(**config), config, path, train, "vocab", "python rebuild")
    again, seconds_again = iu.cached_model(GPTlite_Linear(**config), config, path, train, "vocab", "python rebuild")
    assert trained == [True] and seconds is not None and seconds_again is None
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    with pytest.raises(CheckpointError, match="another configuration"):
        iu.cached_model(GPTlite_Linear(**dict(config, rule="delta")), dict(config, rule="delta"), path, train, "vocab", "x")


@pytest.mark.parametrize("flags,message", [
    (["--pairs", "40"], "the pairs need distinct keys"),
    (["--contexts", "0"], "must be at least 1"),
    (["--recall-steps", "0"], "must be at least 1"),
    (["--recall-lr", "nan"], "finite number"),
    (["--plot", "out.txt"], "ending in .png"),
    (["--lm-iters", "0"], "must be at least 1"),
    (["--lm-iters", "5", "--full-recipe"], "--lm-iters: give --lm-iters or --full-recipe"),
    (["--d-latent", "0"], "must be at least 1"),
    (["--d-latent", "129"], "--d-latent: at most MLA's full rank"),  # cpu: min(2 * 4 * 32, 128) = 128
])
def test_bad_flags_are_clear_errors(flags, message, capsys, real_data, monkeypatch):
    monkeypatch.setattr(mla, "train_language_models", lambda *a: pytest.fail("flags must be checked before any work"))
    with pytest.raises(SystemExit) as e:
        mla.main(flags + ["--untrained", "--data", real_data_path()])
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("flags,iters,own_control", [([], mla.LM_ITERS, True), (["--lm-iters", "7"], 7, True),
                                                     (["--full-recipe"], 800, False)])
def test_every_language_model_is_trained_the_same_steps(flags, iters, own_control, monkeypatch, real_data):
    """The softmax control and every linear model get one recipe of `iters` steps (the cpu preset's 800 with
    --full-recipe, the control then being the preset's checkpoint), each with a checkpoint of its own."""
    seen, loaded = {}, []

    def cached_model(model, config, path, train, vocab, rebuild, stamp=None, untrained=False):
        seen[path.name] = (stamp["iters"], type(model).__name__, config.get("d_latent"))
        return model.eval(), None
    monkeypatch.setattr(iu, "cached_model", cached_model)
    monkeypatch.setattr(iu, "load_model", lambda cls, *a, **k: loaded.append(cls.__name__) or cls(**TINY).eval())
    args, preset, _, data = mla.parse_args(flags + ["--data", real_data_path()])
    models, _ = mla.train_language_models(preset, data, "cpu", False, 0, "rebuild", args.lm_iters, args.d_latent)
    assert list(models) == ["softmax", *mla.KINDS]
    assert {stamp for stamp, _, _ in seen.values()} == {iters}
    suffix = f"_i{iters}" if own_control else ""  # the preset's recipe: the files' names of before
    names = {f"cpu_linear_{name}{suffix}.pt" for name in ["linear", "gated", "delta", "hybrid", "kda", "kda_mla"]}
    assert set(seen) == names | ({f"cpu_linear_softmax{suffix}.pt"} if own_control else set())
    assert loaded == ([] if own_control else ["GPTlite_KVCache"])
    assert seen[f"cpu_linear_kda_mla{suffix}.pt"] == (iters, "GPTlite_Linear", 32)  # a quarter of the full 128


def by_context_kb(result, name, context):
    return next(r["cache_kb"] for r in result["context_rows"] if r["variant"] == name and r["context"] == context)


def by_context_ratio(result, name, context):
    return f"{by_context_kb(result, 'softmax', context) / by_context_kb(result, name, context):.1f}x smaller"


def real_data_path():
    return os.environ["GPTLITE_DATA"]  # set: the real_data fixture skips the test otherwise


def test_main_end_to_end_untrained(tmp_path, real_data):
    out = tmp_path / "linear.json"
    mla.main(["--untrained", "--data", real_data_path(), "--contexts", "8", "200", "--batch-size", "1",
              "--n-tokens", "2", "--repeats", "1", "--val-batches", "1", "--pairs", "1", "2", "--recall-steps", "1",
              "--recall-seqlen", "8", "--recall-keys", "4", "--json", str(out), "--plot", str(tmp_path / "linear.png")])
    result = json.loads(out.read_text())
    assert [r["variant"] for r in result["rows"]] == ["softmax", "linear", "gated", "delta", "hybrid", "kda", "kda+mla"]
    assert all(result["checks"].values()) and len(result["checks"]) == 6
    methods = result["attention_methods"]
    assert [m["method"] for m in methods] == [mla.METHODS[name] for name in mla.KINDS]
    assert all(not m["exact"] and m["training_steps"] == mla.LM_ITERS for m in methods)
    assert by_context_ratio(result, "kda", 200) in methods[4]["reduction"]  # the measured cache ratio at 200
    assert methods[0]["pays"].startswith(("from ", "not up to 200 tokens"))
    # the MLA hybrid's cache: 3 KDA states [4 heads, 32, 32] and 200 latents of 32 (cpu preset), float32
    assert by_context_kb(result, "kda+mla", 200) == round((3 * 4 * 32 * 32 + 200 * 32) * 4 / 1024, 1)
    by_context = {(r["variant"], r["context"]): r["cache_kb"] for r in result["context_rows"]}
    assert by_context[("delta", 8)] == by_context[("delta", 200)]  # constant state
    assert by_context[("softmax", 200)] == pytest.approx(25 * by_context[("softmax", 8)])  # KV cache: linear
    assert by_context[("hybrid", 8)] < by_context[("hybrid", 200)]
    assert len(result["recall_rows"]) == 6 and (tmp_path / "linear.png").stat().st_size > 0
    renders_on_its_page("main_linear_attention", result)


QUICK = ["--untrained", "--contexts", "8", "16", "--batch-size", "1", "--n-tokens", "2", "--repeats", "1",
         "--val-batches", "1", "--pairs", "1", "2", "--recall-steps", "1", "--recall-seqlen", "8", "--recall-keys", "4"]


def test_plot_changes_nothing_in_the_json_and_the_headline_and_tables_are_in_it(tmp_path, real_data):
    results = []
    for plot in ([], ["--plot", str(tmp_path / "linear.png")]):
        mla.main(QUICK + ["--data", real_data_path(), "--json", str(tmp_path / "linear.json")] + plot)
        results.append(json.loads((tmp_path / "linear.json").read_text()))
    assert results[0].keys() == results[1].keys()
    assert [r["variant"] for r in results[0]["rows"]] == [r["variant"] for r in results[1]["rows"]]
    assert results[0]["headline"]["technique"].startswith("linear attention, gated, Gated DeltaNet, KDA and 3:1 hybrids, "
                                                         f"trained {mla.LM_ITERS} steps")
    assert "; at 16 tokens cache " in results[0]["headline"]["figure"]
    assert "recall at 2 pairs: softmax " in results[0]["headline"]["figure"]
    titles = [t["title"] for t in results[0]["tables"]]
    assert titles[0].startswith("Cache per sequence and TPOT") and titles[1].startswith("Associative recall (MQAR)")


@pytest.mark.parametrize("flag", ["--contexts", "--batch-size", "--n-tokens", "--recall-seqlen", "--recall-keys"])
def test_huge_sizes_are_parser_errors_naming_the_flag_before_any_work(flag, capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        mla.main(["--untrained", "--device", "cpu", flag, "1000000000000"])
    assert e.value.code == 2
    assert f"error: {flag}: " in capsys.readouterr().err
