"""Speculative decoding: greedy tokens equal one-token-at-a-time decoding by the full forward pass for every
draft and gamma; sampled tokens follow the target's exact distribution (Pearson's chi-square against
probabilities computed here with an explicit softmax), and a wrong acceptance rule is caught; the caches roll
back; the heads and the MTP model are what they claim; bad input is a clear error before any work."""
import json
import math

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

import main_speculative_decoding as msd
from gptlite import GPTlite
from gptlite_kvcache import DynamicKVCache, GPTlite_KVCache, StaticKVCache
from gptlite_mtp import FeatureHead, GPTlite_MTP
from lib import files, harness, presets, training
from lib import speculative as sp
from lib.draft_heads import MedusaHeads, mtp_loss_fn, full_hidden, head_logits, medusa_loss
from conftest import renders_on_its_page

SMALL = dict(vocab_size=65, d_model=32, n_heads=2, d_head=16, n_layers=2, dropout_p=0.0, seqlen=32)


def random_model(cls=GPTlite, seed=0, scale=0.5, **changes):
    """Weights N(0, scale): peaked next-token distributions, unlike GPTlite's near-uniform N(0, 0.02) init."""
    torch.manual_seed(seed)
    model = cls(**dict(SMALL, **changes)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, scale)
    return model


def randomized(module, seed, scale=0.3):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, scale)
    return module.eval()


@torch.no_grad()
def one_token_at_a_time(model, prompt, n_tokens):
    """Greedy decoding by GPTlite's full forward pass over the whole sequence at every step. prompt [B, P]."""
    seq = prompt
    for _ in range(n_tokens):
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq


def all_drafters(target):
    mtp = randomized(GPTlite_MTP(**SMALL), 5)
    return {"distilled": sp.ModelDrafter(random_model(seed=1, n_layers=1, d_model=16)),
            "target itself": sp.ModelDrafter(target),
            "lookup": sp.LookupDrafter(3),
            "early exit": sp.ModelDrafter(sp.early_exit_model(target, 1)),
            "medusa": sp.MedusaDrafter(randomized(MedusaHeads(32, 8), 2), target),
            "eagle": sp.FeatureDrafter(randomized(FeatureHead(32, 2, 16), 3), target),
            "mtp": sp.FeatureDrafter(mtp.mtp, target)}


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_speculation_gives_the_targets_own_tokens_for_every_draft_and_gamma(batch):
    target = random_model()
    prompt = torch.randint(65, (batch, 5), generator=torch.Generator().manual_seed(batch))
    expected = one_token_at_a_time(target, prompt, 20)
    assert torch.equal(sp.plain_generate(target, prompt, 20), expected)
    taus = {}
    for name, drafter in all_drafters(target).items():
        for gamma in range(1, 9):
            out, stats = sp.speculative_generate(target, drafter, prompt, 20, gamma)
            assert torch.equal(out, expected), (name, gamma)
            assert stats.emitted == 19 and stats.rounds >= math.ceil(19 / (gamma + 1))
            taus[name, gamma] = stats.tau
    assert taus["target itself", 8] > 4  # the target drafting for itself: every draft token is kept ...
    assert sp.speculative_generate(target, all_drafters(target)["target itself"], prompt, 20, 4)[1].alpha == 1.0


def test_accept_draft_keeps_leading_matches_then_corrects_greedy():
    logits = torch.full((2, 4, 5), -1.0)
    best = torch.tensor([[1, 2, 3, 4], [0, 0, 0, 0]])  # the target's argmax at each position
    logits.scatter_(2, best[..., None], 1.0)
    draft = torch.tensor([[1, 2, 0], [0, 0, 0]])
    k, correction = sp.accept_draft(logits, draft, None)
    assert k.tolist() == [2, 3] and correction.tolist() == [3, 0]  # row 1: all kept, the bonus is argmax p_4


@pytest.mark.parametrize("deterministic", [False, True])
def test_one_round_of_the_rule_outputs_the_targets_distribution(deterministic):
    """Token 1 of a round (the draft token if kept, else the correction) over 200,000 rows: its frequencies
    are p, the target's, whatever q (p and q written out here, not from a model)."""
    V, B = 6, 200_000
    p_logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 0.3])
    q = torch.tensor([0.05, 0.4, 0.05, 0.3, 0.1, 0.1])
    g = torch.Generator().manual_seed(0)
    draft = (torch.full((B, 1), 3) if deterministic else torch.multinomial(q, B, replacement=True, generator=g)[:, None])
    qs = None if deterministic else q.expand(B, 1, V)
    logits = torch.stack([p_logits, torch.zeros(V)])[None].expand(B, 2, V)
    k, correction = sp.accept_draft(logits, draft, qs, temperature=1.0, generator=g)
    first = torch.where(k > 0, draft[:, 0], correction)
    freq = torch.bincount(first, minlength=V).double() / B
    p = torch.softmax(p_logits.double(), -1)
    assert (freq - p).abs().max() < 0.005  # about 4 standard errors at B = 200,000
    q_d = 1.0 if deterministic else q[3]
    kept_of_3 = (k[draft[:, 0] == 3] > 0).double().mean()
    assert kept_of_3 == pytest.approx(min(1.0, float(p[3]) / float(q_d)), abs=0.01)  # min(1, p/q)


def exact_probabilities(model, prompt, k, temperature):
    """P(t_1 .. t_k | prompt) for every continuation, by GPTlite's forward pass and an explicit softmax,
    index sum t_i V^(k-i). Written here, independently of lib/speculative.py."""
    V = model.config.vocab_size
    probs = {(): 1.0}
    with torch.no_grad():
        for _ in range(k):
            nxt = {}
            for cont, pr in probs.items():
                logits = model(torch.tensor([prompt + list(cont)]))[0, -1].double() / temperature
                e = torch.exp(logits - logits.max())
                for t, pt in enumerate((e / e.sum()).tolist()):
                    nxt[cont + (t,)] = pr * pt
            probs = nxt
    out = torch.zeros(V ** k, dtype=torch.float64)
    for cont, pr in probs.items():
        out[sum(t * V ** (k - 1 - i) for i, t in enumerate(cont))] = pr
    return out


@pytest.fixture(scope="module")
def sampling_setup():
    target = random_model(scale=0.35)
    prompt = [3, 17, 40, 8]
    exact = exact_probabilities(target, prompt, 2, temperature=0.8)
    assert torch.allclose(sp.exact_continuations(target, torch.tensor(prompt), 2, 0.8), exact, atol=1e-6)
    return target, torch.tensor(prompt), exact


@pytest.mark.parametrize("name, gamma, batch_size", [("distilled", 1, 4), ("distilled", 4, 4), ("distilled", 4, None),
                                                     ("lookup", 4, None), ("medusa", 4, None), ("eagle", 4, None),
                                                     ("plain", 1, None)])
def test_speculative_sampling_keeps_the_targets_distribution(sampling_setup, name, gamma, batch_size):
    """Batches of 4 rows: every path of the rule (kept drafts, a correction, the bonus) in each row; one batch
    of 3000 rows: the rows of a batch wait for the slowest, still with the target's distribution."""
    target, prompt, exact = sampling_setup
    drafter = None if name == "plain" else all_drafters(target)[name]
    result = sp.sampling_test(target, drafter, prompt, exact, gamma, 0.8, n_samples=3000, seed=gamma,
                              batch_size=batch_size)
    assert result["p_value"] is not None and result["dof"] >= 20
    assert result["p_value"] > 1e-3  # seeded: the same samples every run


def test_the_chi_square_test_catches_a_rule_that_keeps_every_draft_token(sampling_setup):
    target, prompt, exact = sampling_setup
    drafter = all_drafters(target)["distilled"]
    right = sp.sampling_test(target, drafter, prompt, exact, 2, 0.8, n_samples=3000, seed=0, batch_size=4)
    wrong = sp.sampling_test(target, drafter, prompt, exact, 2, 0.8, n_samples=3000, seed=0, batch_size=4,
                             accept=sp.accept_always)
    assert right["p_value"] > 1e-3 and wrong["p_value"] < 1e-6
    assert wrong["tv"] > right["tv"] + 0.1


def test_chi_square_pools_small_cells_and_agrees_with_scipy():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.04, 0.01], dtype=torch.float64)
    counts = torch.tensor([260, 140, 80, 15, 5])
    result = sp.chi_square_test(counts, probs)
    expected = probs * 500  # [250, 150, 75, 20, 5]: none below 5, so no pooling
    ref = scipy_stats.chisquare(counts.numpy(), expected.numpy())
    assert result["dof"] == 4
    assert result["statistic"] == pytest.approx(ref.statistic) and result["p_value"] == pytest.approx(ref.pvalue)
    pooled = sp.chi_square_test(torch.tensor([60, 30, 8, 2, 0]), probs)  # n = 100: the last two expected 1 and 4
    ref = scipy_stats.chisquare([60, 30, 8, 2], (np.array([50, 30, 15, 5.0])))
    assert pooled["dof"] == 3 and pooled["p_value"] == pytest.approx(ref.pvalue)
    assert sp.chi_square_test(torch.tensor([3, 1]), torch.tensor([0.5, 0.5]))["p_value"] is None  # cannot judge


@pytest.mark.parametrize("cache_kind", ["static", "dynamic"])
def test_a_rolled_back_cache_continues_as_if_the_rejected_tokens_never_came(cache_kind):
    model = GPTlite_KVCache(**SMALL).eval()
    randomized(model, 0, 0.5)
    x = torch.randint(65, (2, 12), generator=torch.Generator().manual_seed(0))
    other = torch.randint(65, (2, 4), generator=torch.Generator().manual_seed(1))
    cache = StaticKVCache.for_model(model, 2) if cache_kind == "static" else DynamicKVCache(n_layers=2, max_seqlen=32)
    model.forward_cache(x[:, :8], cache)
    model.forward_cache(other, cache)  # rejected
    cache.truncate(8)
    logits = model.forward_cache(x[:, 8:], cache)
    full = model(x)[0]
    torch.testing.assert_close(logits, full[:, 8:], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="cannot keep"):
        cache.truncate(13)


def test_a_cache_fed_past_its_window_refuses_to_roll_back():
    cache = DynamicKVCache(n_layers=1, max_seqlen=4)
    cache.n_tokens = 5
    with pytest.raises(ValueError, match="past its window"):
        cache.truncate(3)


def test_hidden_states_through_the_head_are_the_logits():
    model = randomized(GPTlite_KVCache(**SMALL), 0, 0.5)
    x = torch.randint(65, (2, 10), generator=torch.Generator().manual_seed(0))
    h = model.hidden_states(x, model.open_cache(None, None, 2))
    assert torch.equal(model.fc_out(model.ln(h)), model(x)[0])


def test_zero_initialised_medusa_heads_predict_the_next_token_and_train_on_shifted_targets():
    target = random_model()
    heads = MedusaHeads(32, 3)
    x = torch.randint(65, (2, 10), generator=torch.Generator().manual_seed(0))
    h = full_hidden(target, x)
    assert torch.allclose(heads(h[:, -1], target), target(x)[:, -1:].expand(2, 3, 65), atol=1e-5)
    y = torch.randint(65, (2, 10), generator=torch.Generator().manual_seed(1))
    loss, first = medusa_loss(heads, target, x, y)
    ce = torch.nn.functional.cross_entropy(target(x)[:, :9].flatten(0, 1), y[:, 1:].flatten())  # head 1: y shifted by 1
    assert first.item() == pytest.approx(ce.item(), abs=1e-5)


def test_lookup_proposes_what_followed_the_most_recent_match():
    drafter = sp.LookupDrafter(3)
    assert drafter.lookup([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3], 3) == [7, 8, 5]
    assert drafter.lookup([4, 5, 6, 5], 3) == [6, 5, 5]  # 1-gram 5 at index 1: then 6, 5; padded with the last
    assert drafter.lookup([1, 2, 3], 2) == [3, 3]  # no match: the last token repeated
    with pytest.raises(ValueError, match="n-gram"):
        sp.LookupDrafter(0)


def test_the_mtp_model_is_a_gptlite_plus_a_module_and_its_loss_adds_the_weighted_second_token():
    model = randomized(GPTlite_MTP(**SMALL), 0, 0.3)
    x = torch.randint(65, (2, 12), generator=torch.Generator().manual_seed(0))
    y = torch.randint(65, (2, 12), generator=torch.Generator().manual_seed(1))
    assert torch.equal(model.main_model()(x), model(x))
    h = model.hidden(x)
    pred = model.mtp(x[:, 1:], h[:, :-1], model.token_embedding)
    second = torch.nn.functional.cross_entropy(head_logits(model, pred).flatten(0, 1), y[:, 1:].flatten())
    main = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    assert mtp_loss_fn(0.3)(model, x, y).item() == pytest.approx(main.item() + 0.3 * second.item(), abs=1e-5)


def test_formulas():
    assert sp.expected_tau(0.5, 3) == pytest.approx(1.875)
    assert sp.expected_tau(1.0, 3) == 4.0
    assert sp.expected_speedup(0.5, 3, 0.75) == pytest.approx(1.875 / 1.75)


@pytest.mark.parametrize("kwargs, match", [(dict(gamma=0), "gamma"), (dict(gamma=30), "gamma=30"),
                                           (dict(temperature=0.0), "temperature"),
                                           (dict(temperature=float("nan")), "temperature"),
                                           (dict(n_tokens=40), "window")])
def test_bad_speculation_input_is_a_clear_error(kwargs, match):
    target = random_model()
    args = dict(gamma=2, n_tokens=8, temperature=None) | kwargs
    with pytest.raises(ValueError, match=match):
        sp.speculative_generate(target, sp.LookupDrafter(), torch.zeros(1, 4, dtype=torch.long), args["n_tokens"],
                                args["gamma"], args["temperature"])


def test_a_draft_of_another_vocabulary_or_a_shorter_window_is_refused():
    target = random_model()
    with pytest.raises(harness.GPTliteError, match="vocabulary"):
        msd.check_draft(target, random_model(vocab_size=50), "d")
    with pytest.raises(harness.GPTliteError, match="window"):
        msd.check_draft(target, random_model(seqlen=16), "d")


@pytest.mark.parametrize("flags", [["--gammas", "0"], ["--gammas", "120"], ["--gammas", "2", "1"],
                                   ["--temperature", "0"], ["--temperature", "nan"], ["--ngram", "0"],
                                   ["--n-tokens", "120"], ["--exit-layers", "4"], ["--medusa-heads", "2"],
                                   ["--batch-sizes", "1", "1"], ["--stat-chars", "5"], ["--stat-chars", "1"],
                                   ["--stat-samples", "10"], ["--stat-gamma", "100"]])
def test_bad_flags_are_clear_errors_before_any_work(flags, capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        msd.main(["--untrained", "--device", "cpu", "--preset", "cpu"] + flags)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


QUICK = ["--preset", "cpu", "--device", "cpu", "--gammas", "1", "2", "--batch-sizes", "1", "2", "--n-tokens", "8",
         "--prompt-len", "8", "--repeats", "1", "--stat-samples", "200", "--stat-chars", "2"]


def test_paths_fast_without_a_compiler_is_a_clear_error_before_any_work(capsys, monkeypatch):
    from lib import fast_decode
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    monkeypatch.setattr(harness.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit) as e:
        msd.main(["--untrained", "--device", "cpu", "--preset", "cpu", "--paths", "fast"])
    assert e.value.code == 2 and "--paths fast: no C++ compiler" in capsys.readouterr().err


def test_main_writes_a_row_per_draft_with_its_speedup(real_data, tmp_path, capsys):
    out_json, out_png = tmp_path / "s.json", tmp_path / "s.png"
    msd.main(["--untrained", "--draft-iters", "1", "--head-iters", "1", "--mtp-steps", "1", "--json", str(out_json),
              "--plot", str(out_png)] + QUICK)
    result = json.loads(out_json.read_text())
    names = [r["variant"] for r in result["rows"]]
    # eager and fast paths, batch 1 and 2, greedy and T
    assert names == 2 * 2 * 2 * (["plain (target)", "plain (mtp model)"] + msd.DRAFTS)
    assert [r["path"] for r in result["rows"]] == [p for p in ("eager", "fast") for _ in range(len(names) // 2)]
    for r in result["rows"]:
        assert "speedup" in r and r["batch_size"] in (1, 2)
        if r["gamma"] is not None and r["tpot_ms"] is not None and r["plain_tpot_ms"] is not None:
            # its own baseline; both TPOTs are rounded to 0.001 ms, so the ratio of the rounded values is
            # only known to within the bounds that rounding leaves (and the speedup is rounded to 0.001 too)
            p, t, h = r["plain_tpot_ms"], r["tpot_ms"], 0.0005
            assert (p - h) / (t + h) - h <= r["speedup"] <= (p + h) / (t - h) + h
    assert {r["draft"] for r in result["sweep"]} == set(msd.DRAFTS) | {"plain"}
    assert all(r.get("variant") for t in result["tables"] for r in t["rows"])  # every extra row names its draft
    assert all(ok for ok in result["checks"].values()) and len(result["checks"]) >= 2 * 2 * 9
    assert sum("fast path" in check for check in result["checks"]) == 2 * 9  # 7 drafts and 2 plain, per batch
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    renders_on_its_page("main_speculative_decoding", result)


def test_drafts_are_trained_once_then_loaded(real_data, tmp_path, monkeypatch):
    """The trained drafts go through the one cached-model helper: a second build loads what the first saved."""
    monkeypatch.setattr(files, "checkpoint_path", lambda name: tmp_path / f"{name}.pt")
    monkeypatch.setattr(training, "validation_loss", lambda model, data, **kw: 1.0)
    preset = presets.PRESETS["cpu"]
    target = random_model(GPTlite, scale=0.02, **dict(preset.gptlite_kwargs()))
    args = msd.parse_args(["--device", "cpu", "--draft-iters", "1", "--head-iters", "1", "--mtp-steps", "1"])[0]
    drafts, targets, infos = msd.build_drafts(target, preset, real_data, "cpu", args, "python main_speculative_decoding.py")
    assert [i["source"].split()[0] for i in infos] == ["trained"] * 5
    again, _, infos2 = msd.build_drafts(target, preset, real_data, "cpu", args, "python main_speculative_decoding.py")
    assert [i["source"].split()[0] for i in infos2] == ["loaded"] * 5
    for name in ("distilled", "medusa", "eagle"):
        a, b = drafts[name][1]("eager"), again[name][1]("eager")  # (target name, make(path))
        module_a = getattr(a, "model", None) or getattr(a, "heads", None) or a.head
        module_b = getattr(b, "model", None) or getattr(b, "heads", None) or b.head
        for pa, pb in zip(module_a.state_dict().values(), module_b.state_dict().values()):
            assert torch.equal(pa, pb)
    assert set(targets) == {"target", "mtp model"}
