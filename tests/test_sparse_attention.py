"""kv_budget and main_sparse_attention on tiny models: every method at a full budget is dense attention
(tokens of generate_kvcache and generate, logits of the full forward pass), each method's choice against
one computed here, Quest's bound, the budget held, and the bad-input errors."""
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY

import main_sparse_attention as msa
from gptlite import generate
from gptlite_kvcache import generate_kvcache
from gptlite_rope import GPTlite_RoPE
from lib import harness
from lib import kv_budget as kb

ALL = ["dense", "window", "sinks", "H2O", "SnapKV", "Quest"]


def method(name, budget, n_sink=2, page_size=4):
    return kb.make_method(name, budget, n_sink=n_sink, page_size=page_size)


@pytest.fixture
def tiny_rope():
    torch.manual_seed(1)
    model = GPTlite_RoPE(**TINY).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model


@pytest.mark.parametrize("name", ALL)
def test_full_budget_gives_the_dense_tokens(tiny_models, name):
    base, cached = tiny_models
    prompt = torch.randint(65, (3, 4))
    n = TINY["seqlen"] - prompt.shape[1] + 1  # the whole window, no position clamped
    tokens = kb.generate_budget(base, prompt, n, method(name, TINY["seqlen"]))
    assert torch.equal(tokens, generate_kvcache(cached, prompt, n, TINY["seqlen"]))
    assert torch.equal(tokens, generate(base, prompt, n, TINY["seqlen"]))  # one at a time, no cache


@pytest.mark.parametrize("name", ALL)
def test_full_budget_logits_equal_the_full_forward_pass(tiny_models, tiny_rope, name):
    base, _ = tiny_models
    x = torch.randint(65, (2, TINY["seqlen"]))
    for model, full in ((base, base(x)), (tiny_rope, tiny_rope(x)[0])):
        logits = kb.teacher_forced_logits(model, x, method(name, TINY["seqlen"]))
        torch.testing.assert_close(logits, full, atol=1e-4, rtol=0)


def test_dense_past_the_window_is_the_posts_clamped_cache(tiny_models):
    base, cached = tiny_models
    prompt = torch.randint(65, (2, 5))
    assert torch.equal(kb.generate_budget(base, prompt, 30, kb.Dense()), generate_kvcache(cached, prompt, 30, 16))


@pytest.mark.parametrize("name", ["window", "sinks", "H2O", "SnapKV"])
def test_evicting_methods_hold_the_budget_and_change_the_output(tiny_models, name):
    base, _ = tiny_models
    x = torch.randint(65, (2, TINY["seqlen"]))
    cache = kb.BudgetCache(len(base.blocks))
    logits = kb.teacher_forced_logits(base, x, method(name, 6), cache)
    assert all(kv.keys.shape[2] == 5 and kv.values.shape[2] == 5 for kv in cache.layers)  # budget - 1 kept
    assert not torch.allclose(logits, base(x), atol=1e-3)


def layer_kv(n, B=2, H=3, D=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return kb.LayerKV(torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g))


def test_window_and_sinks_keep_the_right_entries():
    kv = layer_kv(10)
    assert kb.SlidingWindow(4).keep(kv)[0, 0].tolist() == [7, 8, 9]
    assert kb.StreamingLLM(6, n_sink=2).keep(kv)[1, 2].tolist() == [0, 1, 7, 8, 9]
    assert kb.StreamingLLM(11, n_sink=2).keep(kv) is None  # room for the next token: nothing evicted


def test_h2o_keeps_the_heaviest_hitters_and_the_recent_window():
    kv = layer_kv(8)
    kv.score = torch.tensor([5.0, 0.1, 3.0, 0.2, 4.0, 0.0, 0.0, 0.0]).expand(2, 3, 8).clone()
    assert kb.H2O(6, recent_ratio=0.5).keep(kv)[0, 0].tolist() == [0, 4, 5, 6, 7]  # of 5 kept: 3 recent, 2 heavy
    weights = torch.full((2, 3, 1, 8), 1 / 8)
    kb.H2O(7).observe(kv, None, weights)
    assert torch.allclose(kv.score[0, 0, 0], torch.tensor(5.125))  # accumulated


def test_snapkv_keeps_the_window_and_the_top_pooled_votes():
    kv = layer_kv(12, B=1, H=2, D=4, seed=3)
    kv.queries = torch.randn(1, 2, 3, 4, generator=torch.Generator().manual_seed(4))
    keep = kb.SnapKV(8, window=3, kernel_size=3).keep(kv)  # 7 kept: the last 3 and the 4 best of 9 older
    for h in range(2):
        q, k = kv.queries[0, h], kv.keys[0, h]  # [3, D], [12, D]
        votes = []
        for i in range(3):  # observation query i is token 9 + i: it sees keys 0 .. 9 + i
            p = torch.softmax(q[i] @ k[:10 + i].T / 2.0, dim=0)
            votes.append(F.pad(p, (0, 2 - i))[:9])
        v = torch.stack(votes).sum(0)
        pooled = torch.stack([v[max(j - 1, 0):j + 2].mean() for j in range(9)])  # window 3, borders averaged
        expected = sorted(pooled.topk(4).indices.tolist()) + [9, 10, 11]
        assert keep[0, h].tolist() == expected


def test_quest_bound_is_never_below_the_true_maximum():
    torch.manual_seed(0)
    for page_size in (1, 3, 8):
        q, k = torch.randn(4, 2, 1, 16), torch.randn(4, 2, 29, 16)  # 29: a partial last page
        bounds = kb.page_bounds(q, k, page_size)  # [4, 2, P]
        scores = (q @ k.transpose(-2, -1))[..., 0, :]  # [4, 2, 29]
        for p in range(bounds.shape[-1]):
            true_max = scores[..., p * page_size:(p + 1) * page_size].amax(dim=-1)
            assert (bounds[..., p] >= true_max - 1e-5).all()
        if page_size == 1:  # a one-key page: the bound is the score itself
            torch.testing.assert_close(bounds, scores, atol=1e-5, rtol=0)


def test_quest_reads_the_top_pages_and_the_newest():
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 22, 8)
    mask = kb.Quest(8, page_size=4).select(q, k)  # 2 pages of 4 out of 6
    assert mask.shape == (1, 2, 1, 22)
    bounds = kb.page_bounds(q, k, 4)
    for h in range(2):
        chosen = sorted(set(i // 4 for i in mask[0, h, 0].nonzero().flatten().tolist()))
        best_other = bounds[0, h, :-1].argmax().item()
        assert chosen == sorted({best_other, 5})
        assert mask[0, h, 0].sum() <= 8
    assert kb.Quest(24, page_size=4).select(q, k) is None  # every page fits the budget: dense


def test_kv_bytes():
    entry = 2 * 2 * 3 * 8 * 4  # K and V, 2 layers, 3 heads, 8 dims, float32
    assert kb.kv_bytes(kb.Dense(), 16, 2, 3, 8) == (16 * entry, 16 * entry)
    assert kb.kv_bytes(kb.SlidingWindow(4), 16, 2, 3, 8) == (4 * entry, 4 * entry)
    assert kb.kv_bytes(kb.Quest(8, page_size=4), 16, 2, 3, 8) == (16 * entry, (8 + 4) * entry)  # + 4 pages' min, max


@pytest.mark.parametrize("make, match", [
    (lambda: kb.StreamingLLM(4, n_sink=4), "at least 5"),
    (lambda: kb.StreamingLLM(0), "at least 5"),
    (lambda: kb.SlidingWindow(0), "at least 1"),
    (lambda: kb.H2O(0), "at least 1"),
    (lambda: kb.SnapKV(-3), "at least 1"),
    (lambda: kb.Quest(16, page_size=0), "page_size must be a positive integer"),
    (lambda: kb.Quest(16, page_size=-8), "page_size must be a positive integer"),
    (lambda: kb.Quest(4, page_size=8), "one page of page_size=8"),
    (lambda: kb.make_method("nope", 8), "unknown method"),
])
def test_bad_settings_are_clear_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("argv, match", [
    (["--budgets", "4", "16"], "--budgets 4 with sinks"),
    (["--budgets", "0"], "must be at least 1"),
    (["--page-size", "0"], "must be at least 1"),
    (["--budgets", "4", "--n-sink", "2"], "--budgets 4 with Quest"),
    (["--budgets", "256"], "at most the window"),
])
def test_bad_flags_stop_before_any_work(argv, match, capsys):
    with pytest.raises(SystemExit):
        msa.main(argv + ["--untrained"])
    assert match in capsys.readouterr().err


def test_a_stream_longer_than_the_validation_text_is_an_error_not_cut(real_data, capsys):
    n = len(real_data.val)
    with pytest.raises(SystemExit):
        msa.main(["--untrained", "--stream-chars", str(n)])
    assert f"--stream-chars {n}: the validation text has {n} characters, give at most {n - 1}" in capsys.readouterr().err


def test_quality_rows_and_checks(tiny_models, tiny_rope):
    base, cached = tiny_models
    windows = torch.randint(65, (3, TINY["seqlen"] + 1))
    prompts = torch.randint(65, (2, 1))
    full = [method(name, TINY["seqlen"]) for name in msa.METHODS]
    checks = msa.run_checks(base, cached, tiny_rope, windows[:, :-1], prompts, 16, full)
    assert all(checks.values()) and len(checks) == 8
    rows = msa.quality_rows(base, windows, prompts, 16, [4, 8], n_sink=2, page_size=4)
    assert [r["variant"] for r in rows[:3]] == ["dense", "window 4", "sinks 4"]
    assert rows[0]["loss_vs_dense"] == 0 and rows[0]["agree"] == 1.0 and rows[0]["first_diff"] == 16
    x, y = windows[:, :-1], windows[:, 1:]
    assert rows[0]["val_loss"] == pytest.approx(F.cross_entropy(base(x).flatten(0, 1), y.flatten()).item(), abs=1e-5)


def test_streaming_reference_and_variants(tiny_models, tiny_rope):
    base, cached = tiny_models
    stream = torch.randint(65, (61,))
    W = TINY["seqlen"]
    for model in (base, tiny_rope):  # batched windows = one dense pass per step over the last W tokens
        torch.testing.assert_close(msa.reencoding_logits(model, stream, W, batch=7)[None],
                                   msa.reencoding_stream(model, stream[None], W), atol=1e-5, rtol=0)
    variants = msa.stream_variants(base, cached, tiny_rope, W, n_sink=2)
    rows, losses = msa.stream_rows(variants, stream, segment=20, time_tokens=20, repeats=1)
    assert [len(v) for v in losses.values()] == [3] * 5
    by_name = {r["variant"]: r for r in rows}
    assert 0 < by_name["rotary: 2 sinks + cache 16"]["first_mass"] <= 1
    nll = F.cross_entropy(msa.reencoding_logits(tiny_rope, stream[:-1], W), stream[1:], reduction="none")
    assert losses["rotary: re-encode last 16"][1] == pytest.approx(nll[20:40].mean().item(), abs=1e-5)


# ----------------------------------------------------------------------------------------------------
# The budgets run through the model's own cached forward pass (gptlite_kvcache's cache interface); the
# reference is the hand-written budgeted forward pass they replaced, kept here as it was.

class ReferenceCache:
    def __init__(self, n_layers, n_first=4):
        self.layers, self.n_tokens, self.n_first = [None] * n_layers, 0, n_first
        self.first_mass, self.first_uniform, self.n_steps = [0.0] * n_layers, 0.0, 0

    def __len__(self):
        return 0 if self.layers[0] is None else self.layers[0].keys.shape[2]


def reference_forward_budget(model, idx, cache, method):
    from gptlite_rope import apply_rope
    T, seqlen = idx.shape[1], model.seqlen
    rotary = isinstance(model, GPTlite_RoPE)
    x = model.token_embedding(idx)
    if not rotary:
        x = x + model.position_embedding(torch.arange(cache.n_tokens, cache.n_tokens + T).clamp(max=seqlen - 1))
    for layer, block in enumerate(model.blocks):
        mha, h = block.mha, block.ln1(x)
        Q, K, V = (mha.split_heads(proj(h)) for proj in (mha.query_proj, mha.key_proj, mha.value_proj))
        kv = cache.layers[layer]
        if kv is None:
            kv = kb.LayerKV(K, V)
        else:
            score = None if kv.score is None else F.pad(kv.score, (0, T))
            kv = kb.LayerKV(torch.cat([kv.keys, K], dim=2), torch.cat([kv.values, V], dim=2), score, kv.queries)
        if kv.keys.shape[2] > seqlen:
            kv = kb.gather(kv, kb.last_entries(kv, seqlen))
        n, Kn = kv.keys.shape[2], kv.keys
        if rotary:
            Q = apply_rope(Q, model.rope_cos[n - T:n], model.rope_sin[n - T:n])
            Kn = apply_rope(Kn, model.rope_cos[:n], model.rope_sin[:n])
        mask = torch.ones(T, n, dtype=torch.bool).tril(diagonal=n - T) if T > 1 else method.select(Q, Kn)
        out, weights = kb.attend(Q, Kn, kv.values, mask)
        cache.first_mass[layer] += weights[:, :, -1, :cache.n_first].sum(dim=-1).mean().item() if T == 1 else 0.0
        x = x + mha.out_proj(mha.merge_heads(out))
        x = x + block.ffwd(block.ln2(x))
        method.observe(kv, Q, weights)
        idx_keep = method.keep(kv)
        cache.layers[layer] = kv if idx_keep is None else kb.gather(kv, idx_keep)
    cache.n_tokens += T
    cache.n_steps += T == 1
    if T == 1:
        cache.first_uniform += min(cache.n_first, n) / n
    return model.fc_out(model.ln(x))


@pytest.mark.parametrize("name", ALL)
def test_budgets_through_the_models_forward_equal_the_hand_written_pass(tiny_models, tiny_rope, name):
    base, _ = tiny_models
    x = torch.randint(65, (2, 2 * TINY["seqlen"] + 3), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        for model in (base, tiny_rope):
            ref_cache = ReferenceCache(len(model.blocks), n_first=2)
            ref_method, new_method = method(name, 8), method(name, 8)
            # a prompt of 5 (dense prefill), then one token at a time, past the window
            expected = torch.cat([reference_forward_budget(model, x[:, :5], ref_cache, ref_method)]
                                 + [reference_forward_budget(model, x[:, t:t + 1], ref_cache, ref_method)
                                    for t in range(5, x.shape[1])], dim=1)
            cache = kb.BudgetCache(len(model.blocks), n_first=2)
            got = torch.cat([kb.forward_budget(model, x[:, :5], cache, new_method),
                             kb.teacher_forced_logits(model, x[:, 5:], new_method, cache)], dim=1)
            assert torch.equal(got, expected)
            assert cache.first_mass == ref_cache.first_mass and cache.n_steps == ref_cache.n_steps
            assert cache.first_uniform == ref_cache.first_uniform
            for kv, ref in zip(cache.layers, ref_cache.layers):
                assert torch.equal(kv.keys, ref.keys) and torch.equal(kv.values, ref.values)
        prompt = x[:, :4]
        ref_cache, ref_method = ReferenceCache(len(base.blocks)), method(name, 8)
        token = reference_forward_budget(base, prompt, ref_cache, ref_method)[:, -1:].argmax(dim=-1)
        tokens = [prompt, token]
        for _ in range(20):
            token = reference_forward_budget(base, token, ref_cache, ref_method)[:, -1:].argmax(dim=-1)
            tokens.append(token)
        assert torch.equal(kb.generate_budget(base, prompt, 21, method(name, 8)), torch.cat(tokens, dim=1))


def test_no_statistics_means_no_device_sync_in_the_decode_loop(tiny_models, tiny_rope, monkeypatch):
    """Without n_first the budgeted decode never calls .item() (a device sync on CUDA); with it, the
    attention mass is still collected without one, and read once at the end."""
    base, _ = tiny_models
    x = torch.randint(65, (2, 20))
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail(".item() inside the decode loop"))
    kb.teacher_forced_logits(base, x, method("H2O", 6))
    kb.generate_budget(tiny_rope, x[:, :3], 10, method("sinks", 6))
    cache = kb.BudgetCache(len(base.blocks), n_first=2)
    kb.teacher_forced_logits(base, x, method("sinks", 6), cache)
    monkeypatch.undo()
    assert cache.n_steps == 20 and all(0 < m / 20 <= 1 for m in cache.first_mass)
    assert kb.BudgetCache(len(base.blocks)).stats is None


def test_a_budget_cache_without_a_window_is_a_clear_error(tiny_models):
    from gptlite_kvcache import kv_cache_view
    base, _ = tiny_models
    with pytest.raises(ValueError, match="no window yet"):
        kv_cache_view(base)(torch.randint(65, (1, 3)), kv_cache=kb.BudgetCache(len(base.blocks)))
    cache = kb.BudgetCache(len(base.blocks)).use(kb.SlidingWindow(4), base)
    kv_cache_view(base)(torch.randint(65, (1, 3)), kv_cache=cache)
    assert cache.max_seqlen == TINY["seqlen"] and len(cache) == 3


def test_plot_changes_nothing_in_the_json_and_the_headline_is_in_it(real_data, tmp_path):
    results = []
    for plot in ([], ["--plot", str(tmp_path / "sp.png")]):
        msa.main(["--untrained", "--device", "cpu", "--budgets", "16", "--n-windows", "1", "--n-prompts", "1",
                  "--n-tokens", "4", "--stream-chars", "1000", "--time-tokens", "4", "--repeats", "1",
                  "--json", str(tmp_path / "sp.json")] + plot)
        results.append(json.loads((tmp_path / "sp.json").read_text()))
    assert results[0].keys() == results[1].keys()
    assert [r["variant"] for r in results[0]["rows"]] == [r["variant"] for r in results[1]["rows"]]
    assert results[0]["headline"]["technique"].endswith("budget 16 of 128")
    assert results[0]["headline"]["figure"].startswith("loss against dense: window ")
    assert results[0]["tables"][0]["title"].startswith("streaming 1000 validation characters")


@pytest.mark.parametrize("flag", ["--n-windows", "--n-prompts", "--n-tokens", "--stream-chars"])
def test_huge_sizes_are_parser_errors_naming_the_flag_before_any_work(flag, capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        msa.main(["--untrained", "--device", "cpu", flag, "1000000000000"])
    assert e.value.code == 2
    assert f"error: {flag}: " in capsys.readouterr().err
