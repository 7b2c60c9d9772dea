"""kv_budget and main_sparse_attention on tiny models: every method at a full budget is dense attention
(tokens of generate_kvcache and generate, logits of the full forward pass), each method's choice against
one computed here, Quest's bound, the budget held, and the bad-input errors."""
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, renders_on_its_page

import main_sparse_attention as msa
from gptlite import generate
from gptlite_kvcache import generate_kvcache
from gptlite_rope import GPTlite_RoPE
from lib import corpus, harness
from lib import kv_budget as kb

ALL = ["dense", "window", "sinks", "H2O", "SnapKV", "Quest"]


def method(name, budget, n_sink=2, page_size=4):
    return kb.make_method(name, budget, n_sink=n_sink, page_size=page_size)


def tiny_start():
    """A tiny rotary model with the start token (id 65): one more vocabulary entry, weights N(0, 0.5)."""
    torch.manual_seed(2)
    model = GPTlite_RoPE(**dict(TINY, vocab_size=66)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model


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
    (["--budgets", "4", "16"], "--n-sink 4 must be below every budget"),
    (["--budgets", "8", "16", "--n-sink", "8"], "--n-sink 8 must be below every budget"),
    (["--budgets", "16", "--n-sink", "16", "--page-size", "4"], "--n-sink 16 must be below every budget"),
    (["--mass-from", "128"], "--mass-from must be below the window seqlen=128"),
    (["--start-steps", "0"], "--start-steps: must be at least 1"),
    (["--stream-chars", "128"], "--stream-chars must be more than the window seqlen=128"),
    (["--budgets", "0"], "must be at least 1"),
    (["--page-size", "0"], "must be at least 1"),
    (["--budgets", "4", "--n-sink", "2"], "--budgets 4 with Quest"),
    (["--budgets", "256"], "at most the window"),
])
def test_bad_flags_stop_before_any_work(argv, match, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        msa.main(argv + ["--untrained", "--json", str(tmp_path / "sp.json")])
    assert e.value.code == 2 and match in capsys.readouterr().err
    assert not (tmp_path / "sp.json").exists()


def test_a_stream_longer_than_the_validation_text_is_an_error_not_cut(real_data, capsys):
    n = len(real_data.val) - int(corpus.document_starts(real_data.val, real_data.vocab.index("\n"))[0])
    with pytest.raises(SystemExit):
        msa.main(["--untrained", "--stream-chars", str(n)])
    assert (f"--stream-chars {n}: the validation text has {n} characters from its first document on, give at most "
            f"{n - 1}") in capsys.readouterr().err


def test_quality_rows_and_checks(tiny_models, tiny_rope):
    base, cached = tiny_models
    windows = torch.randint(65, (3, TINY["seqlen"] + 1))
    prompts = torch.randint(65, (2, 1))
    full = [method(name, TINY["seqlen"]) for name in msa.METHODS]
    documents = torch.cat([torch.full((3, 1), 65), windows[:, 1:-1]], dim=1)  # the start token, then text
    checks = msa.run_checks(base, cached, tiny_rope, tiny_start(), windows[:, :-1], documents, prompts, 16, full, 2)
    assert all(checks.values()) and len(checks) == 11
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
    start, start_stream = tiny_start(), torch.cat([torch.tensor([65]), stream[:-1]])
    torch.testing.assert_close(msa.reencoding_logits(start, start_stream, W, batch=7, keep_first=True)[None],
                               msa.reencoding_stream(start, start_stream[None], W, keep_first=True), atol=1e-5, rtol=0)
    variants = msa.stream_variants(base, cached, tiny_rope, start, W, 2, stream, start_stream)
    rows, losses = msa.stream_rows(variants, segment=20, time_tokens=20, repeats=1)
    assert [len(v) for v in losses.values()] == [3] * 8
    by_name = {r["variant"]: r for r in rows}
    assert 0 < by_name["rotary: 2 sinks + cache 16"]["first_mass"] <= 1
    assert msa.stream_row(rows, "start-token: sinks")["variant"] == "start-token: 2 sinks + cache 16"
    assert msa.stream_row(rows, "start-token: window")["variant"] == "start-token: window cache 16"
    nll = F.cross_entropy(msa.reencoding_logits(tiny_rope, stream[:-1], W), stream[1:], reduction="none")
    assert losses["rotary: re-encode last 16"][1] == pytest.approx(nll[20:40].mean().item(), abs=1e-5)
    # the start-token reference by hand: past the window, the start token and the last W - 1 tokens
    t = 40
    context = torch.cat([start_stream[:1], start_stream[t - W + 2:t + 1]])[None]
    ref = F.cross_entropy(start(context)[0][:, -1], start_stream[t + 1:t + 2])
    nll = F.cross_entropy(msa.reencoding_logits(start, start_stream[:-1], W, keep_first=True), start_stream[1:],
                          reduction="none")
    assert nll[t].item() == pytest.approx(ref.item(), abs=1e-5)


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
                  "--n-tokens", "4", "--stream-chars", "200", "--segment", "100", "--time-tokens", "4",
                  "--repeats", "1",
                  "--json", str(tmp_path / "sp.json")] + plot)
        results.append(json.loads((tmp_path / "sp.json").read_text()))
    assert results[0].keys() == results[1].keys()
    assert [r["variant"] for r in results[0]["rows"]] == [r["variant"] for r in results[1]["rows"]]
    assert results[0]["headline"]["technique"].endswith("budget 16 of 128")
    assert results[0]["headline"]["figure"].startswith("loss against dense: window ")
    tables = results[0]["tables"]
    assert tables[0]["title"].startswith("attention sinks: mean attention weight on the first 4 positions")
    assert [r["model"] for r in tables[0]["rows"]] == ["rotary, random windows",
                                                       "rotary, documents from their start (no start token)",
                                                       "start-token, start token + documents"]
    assert [c[0] for c in tables[1]["columns"]] == ["chars", "rotary: window cache 128", "rotary: 4 sinks + cache 128",
                                                    "start-token: window cache 128", "start-token: 4 sinks + cache 128"]
    assert len(tables[1]["rows"]) == 2  # 200 characters, segments of 100
    assert tables[2]["title"].startswith("streaming 200 validation characters")
    methods = results[0]["attention_methods"]
    assert [m["method"] for m in methods] == [f"{m} (KV budget 16)" for m in msa.METHODS]
    assert all(not m["exact"] and m["training_steps"] == 0 for m in methods)
    assert methods[0]["reduction"] == "8.0x / 8.0x smaller (64 / 64 KB against 512 at 128 tokens)"  # 4 KB a token
    assert methods[-1]["reduction"] == "1.0x / 4.0x smaller (512 / 128 KB against 512 at 128 tokens)"  # + page bounds
    renders_on_its_page("main_sparse_attention", results[0])


@pytest.mark.parametrize("flag", ["--n-windows", "--n-prompts", "--n-tokens", "--stream-chars"])
def test_huge_sizes_are_parser_errors_naming_the_flag_before_any_work(flag, capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        msa.main(["--untrained", "--device", "cpu", flag, "1000000000000"])
    assert e.value.code == 2
    assert f"error: {flag}: " in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------
# Attention sinks: the attention mass on the first positions, and the start-token model.

@torch.no_grad()
def explicit_first_mass(model, idx, n_first, from_position):
    """Per layer, the mean softmax weight of queries >= from_position on the first n_first keys, computed here:
    each block's queries and keys by hand (rotated by position), an explicit causal softmax."""
    from gptlite_rope import apply_rope
    S = idx.shape[1]
    cos, sin = model.rope_cos[:S], model.rope_sin[:S]
    x, masses = model.token_embedding(idx), []
    for block in model.blocks:
        h, mha = block.ln1(x), block.mha
        q = apply_rope(mha.split_heads(mha.query_proj(h)), cos, sin)  # [B, H, S, D]
        k = apply_rope(mha.split_heads(mha.key_proj(h)), cos, sin)
        scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(torch.ones(S, S).triu(1).bool(), float("-inf"))
        weights = torch.softmax(scores, dim=-1)  # [B, H, S, S]
        masses.append(weights[:, :, from_position:, :n_first].sum(dim=-1).mean().item())
        x, _ = block(x, None, (model.rope_cos, model.rope_sin))
    return masses


@pytest.mark.parametrize("n_first, from_position", [(4, 8), (2, 0), (1, 15)])
def test_attention_on_the_first_positions_is_the_explicit_softmax(tiny_rope, n_first, from_position):
    idx = torch.randint(65, (3, TINY["seqlen"]))
    got = kb.attention_on_first(tiny_rope, idx, n_first, from_position)
    ref = explicit_first_mass(tiny_rope, idx, n_first, from_position)
    assert got["by_layer"] == pytest.approx(ref, abs=1e-5)
    assert got["mass"] == pytest.approx(sum(ref) / len(ref), abs=1e-5)
    uniform = [min(n_first, p + 1) / (p + 1) for p in range(from_position, TINY["seqlen"])]
    assert got["uniform"] == pytest.approx(sum(uniform) / len(uniform), abs=1e-12)
    assert len(set(round(m, 3) for m in ref)) > 1 or abs(ref[0] - got["uniform"]) > 1e-3  # peaked, not uniform


def test_attention_on_the_first_positions_bad_from_position(tiny_rope):
    with pytest.raises(ValueError, match="from_position must be between 0 and 15"):
        kb.attention_on_first(tiny_rope, torch.randint(65, (1, 16)), 4, 16)


def test_the_start_token_models_cached_decode_is_its_full_pass():
    model = tiny_start()
    x = torch.cat([torch.full((2, 1), 65), torch.randint(65, (2, TINY["seqlen"] - 1))], dim=1)
    full, _ = model(x)
    cache, steps = None, []
    for t in range(x.shape[1]):  # one token at a time through the post's list of (keys, values)
        out, cache = model(x[:, t:t + 1], cache)
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-4, rtol=0)
    assert full.shape[-1] == 66  # the start token has its own logit (never a target in training)


@pytest.mark.parametrize("n_sink", [1, 4])
def test_sinks_and_window_at_a_full_budget_is_dense_on_the_start_token_model(n_sink):
    model = tiny_start()
    x = torch.cat([torch.full((2, 1), 65), torch.randint(65, (2, TINY["seqlen"] - 1))], dim=1)
    logits = kb.teacher_forced_logits(model, x, kb.StreamingLLM(TINY["seqlen"], n_sink))
    torch.testing.assert_close(logits, model(x)[0], atol=1e-4, rtol=0)
    # and past the window the sinks are kept: the start token's entry stays at slot 0
    stream = torch.cat([torch.tensor([[65]]), torch.randint(65, (1, 40))], dim=1)
    cache = kb.BudgetCache(TINY["n_layers"])
    kb.teacher_forced_logits(model, stream, kb.StreamingLLM(TINY["seqlen"], n_sink), cache)
    first_key = model.blocks[0].mha.split_heads(model.blocks[0].mha.key_proj(
        model.blocks[0].ln1(model.token_embedding(torch.tensor([[65]])))))[:, :, 0]  # [1, H, D]
    torch.testing.assert_close(cache.layers[0].keys[:, :, 0], first_key, atol=1e-6, rtol=0)
