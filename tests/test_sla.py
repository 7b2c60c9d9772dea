"""SLA: the tile classification, the sparse part and the linear part against references written here
(explicit loops and softmaxes), dense at exact = 1, no future leakage with the causal mask, clear
errors; main_sla.py end to end."""
import json
import math

import pytest
import torch
from conftest import TINY, random_gptlite, renders_on_its_page

import main_sla
from gptlite import GPTlite
from lib import harness
from gptlite_sla import (CRITICAL, MARGINAL, SKIPPED, GPTlite_SLA, check_sla_args, classify_blocks, dense_attention,
                         linear_part, sla_attention, sparse_part, tile_counts)
from lib.sla import attention_flops

ATOL = 1e-6  # float32 attention outputs on random unit inputs


def random_qkv(S=32, B=2, H=2, D=8, seed=0):
    return torch.randn(3, B, H, S, D, generator=torch.Generator().manual_seed(seed))


def reference_labels(Q, K, b, critical, skipped, causal):
    """Row by row: mean-pooled q and k, P_c by an explicit softmax, sort (own tile first when causal),
    ceil(critical n) critical, floor(skipped n) skipped at the bottom, future tiles skipped."""
    B, H, S, D = Q.shape
    nb = S // b
    labels = torch.full((B, H, nb, nb), SKIPPED, dtype=torch.int8)
    for bi in range(B):
        for h in range(H):
            for i in range(nb):
                n = i + 1 if causal else nb
                q = Q[bi, h, i * b:(i + 1) * b].mean(0)
                s = [float(q @ K[bi, h, j * b:(j + 1) * b].mean(0)) / math.sqrt(D) for j in range(n)]
                p = [math.exp(v - max(s)) / sum(math.exp(w - max(s)) for w in s) for v in s]
                order = sorted(range(n), key=lambda j: (0 if causal and j == i else 1, -p[j], j))
                n_crit, n_skip = math.ceil(round(critical * n, 9)), math.floor(round(skipped * n, 9))
                for r, j in enumerate(order):
                    labels[bi, h, i, j] = CRITICAL if r < n_crit else (SKIPPED if r >= n - n_skip else MARGINAL)
    return labels


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("b, critical, skipped", [(4, 0.25, 0.25), (4, 0.1, 0.0), (8, 0.5, 0.25), (2, 0.05, 0.3),
                                                  (4, 1.0, 0.0)])
def test_classification_matches_the_row_by_row_reference(causal, b, critical, skipped):
    Q, K, _ = random_qkv(S=32)
    labels = classify_blocks(Q, K, b, critical, skipped, causal)
    assert torch.equal(labels, reference_labels(Q, K, b, critical, skipped, causal))
    nb = 32 // b
    if causal:
        assert (labels.diagonal(dim1=-2, dim2=-1) == CRITICAL).all()  # the own tile always exact
        assert (labels[..., torch.ones(nb, nb, dtype=torch.bool).triu(1)] == SKIPPED).all()  # never a future tile
    else:
        assert ((labels == CRITICAL).sum(-1) == math.ceil(round(critical * nb, 9))).all()
        assert ((labels == SKIPPED).sum(-1) == math.floor(round(skipped * nb, 9))).all()


@pytest.mark.parametrize("n, critical, skipped, counts", [(100, 0.55, 0.0, (55, 0)), (90, 0.2, 0.7, (18, 63)),
                                                          (10, 0.7, 0.3, (7, 3)), (16, 0.05, 0.1, (1, 1)),
                                                          (20, 0.05, 0.1, (1, 2)), (3, 0.1, 0.0, (1, 0)),
                                                          (8, 1.0, 0.0, (8, 0)), (1, 0.05, 0.9, (1, 0))])
def test_tile_counts_round_the_critical_up_and_the_skipped_down_without_float_noise(n, critical, skipped, counts):
    assert tile_counts(n, critical, skipped) == counts  # 0.55 * 100 is 55.00000000000001 in floats: still 55


def reference_sparse(Q, K, V, labels, b, causal):
    """One query at a time: an explicit softmax over the keys of its block's critical tiles (up to itself)."""
    B, H, S, D = Q.shape
    out = torch.zeros_like(Q)
    for bi in range(B):
        for h in range(H):
            for t in range(S):
                keys = [s for s in range(S) if labels[bi, h, t // b, s // b] == CRITICAL and (not causal or s <= t)]
                w = torch.softmax(torch.stack([Q[bi, h, t] @ K[bi, h, s] for s in keys]) / math.sqrt(D), dim=0)
                out[bi, h, t] = sum(w[n] * V[bi, h, s] for n, s in enumerate(keys))
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_sparse_part_is_a_softmax_over_the_critical_tiles(causal):
    Q, K, V = random_qkv(S=24)
    labels = classify_blocks(Q, K, 4, 0.34, 0.2, causal)
    assert (labels == MARGINAL).any() and (labels == SKIPPED).any()  # all three kinds present: the test can fail
    assert torch.allclose(sparse_part(Q, K, V, labels, 4, causal), reference_sparse(Q, K, V, labels, 4, causal),
                          atol=ATOL)


@pytest.mark.parametrize("feature_map, phi", [("softmax", lambda x: torch.softmax(x, -1)),
                                              ("elu", lambda x: torch.nn.functional.elu(x) + 1)])
def test_linear_part_is_linear_attention_over_the_marginal_tiles(feature_map, phi):
    """Per query: sum over the keys of its block's marginal tiles of (phi(q).phi(k)) v, over the sum of
    phi(q).phi(k); 0 where the block has no marginal tile."""
    Q, K, V = random_qkv(S=24)
    b = 4
    labels = classify_blocks(Q, K, b, 0.34, 0.2, causal=True)
    labels[0, 0, 3] = torch.where(labels[0, 0, 3] == MARGINAL, SKIPPED, labels[0, 0, 3])  # a block with none
    out, has = linear_part(Q, K, V, labels, b, feature_map)
    B, H, S, D = Q.shape
    for bi in range(B):
        for h in range(H):
            for t in range(S):
                keys = [s for s in range(S) if labels[bi, h, t // b, s // b] == MARGINAL]
                assert bool(has[bi, h, t // b]) == bool(keys)
                if not keys:
                    assert (out[bi, h, t] == 0).all()
                    continue
                a = torch.stack([phi(Q[bi, h, t]) @ phi(K[bi, h, s]) for s in keys])  # [n]
                expected = (a[:, None] * V[bi, h, keys]).sum(0) / a.sum()
                assert torch.allclose(out[bi, h, t], expected, atol=ATOL)
    assert not has[0, 0, 3] and has.any()


def test_sla_adds_the_projected_linear_part_only_where_there_are_marginal_tiles():
    Q, K, V = random_qkv(S=24)
    proj = torch.nn.Linear(8, 8)
    torch.nn.init.normal_(proj.weight), torch.nn.init.normal_(proj.bias)
    labels = classify_blocks(Q, K, 4, 0.34, 0.2, causal=True)
    linear, has = linear_part(Q, K, V, labels, 4)
    expected = sparse_part(Q, K, V, labels, 4, True) + has.repeat_interleave(4, -1)[..., None] * proj(linear)
    with torch.no_grad():
        assert torch.allclose(sla_attention(Q, K, V, 4, 0.34, 0.2, True, proj=proj), expected, atol=ATOL)
        zero = torch.nn.Linear(8, 8)
        torch.nn.init.zeros_(zero.weight), torch.nn.init.zeros_(zero.bias)
        assert torch.equal(sla_attention(Q, K, V, 4, 0.34, 0.2, True, proj=zero),
                           sla_attention(Q, K, V, 4, 0.34, 0.2, True, proj=None))  # zero init: sparse only


@pytest.mark.parametrize("causal", [True, False])
def test_every_tile_exact_is_dense_attention_whatever_the_projection(causal):
    Q, K, V = random_qkv(S=32)
    proj = torch.nn.Linear(8, 8)
    torch.nn.init.normal_(proj.weight), torch.nn.init.normal_(proj.bias)
    S = 32
    scores = Q @ K.transpose(-2, -1) / math.sqrt(8)
    if causal:
        scores = scores.masked_fill(torch.ones(S, S).triu(1).bool(), float("-inf"))
    reference = torch.softmax(scores, -1) @ V
    with torch.no_grad():
        assert torch.allclose(sla_attention(Q, K, V, 4, 1.0, 0.0, causal, proj=proj), reference, atol=ATOL)
        assert not torch.allclose(sla_attention(Q, K, V, 4, 0.25, 0.0, causal, proj=proj), reference, atol=1e-3)



def test_gptlite_sla_of_every_tile_gives_gptlite_logits_and_loads_its_weights():
    base = random_gptlite()
    x = torch.randint(TINY["vocab_size"], (3, TINY["seqlen"]), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(GPTlite_SLA.from_gptlite(base, block_size=4, critical=1.0)(x), base(x))
        sla = GPTlite_SLA.from_gptlite(base, block_size=4, critical=0.25)
        assert not torch.allclose(sla(x), base(x), atol=1e-3)
    assert all((p == 0).all() for p in sla.projections()) and len(sla.projections()) == 2 * TINY["n_layers"]


@pytest.mark.parametrize("linear", [True, False])
def test_causal_sla_never_reads_the_future(linear):
    """Changing the last token (and one in the middle) changes no output before it, also with a trained-like
    nonzero projection: every layer's classification and linear part read past tiles only."""
    base = random_gptlite()
    model = GPTlite_SLA.from_gptlite(base, block_size=4, critical=0.25, skipped=0.25, linear=linear)
    with torch.no_grad():
        for p in model.projections():
            p.normal_(0.0, 0.5)
    x = torch.randint(TINY["vocab_size"], (2, TINY["seqlen"]), generator=torch.Generator().manual_seed(2))
    for t in (TINY["seqlen"] - 1, 9):
        y = x.clone()
        y[:, t] = (y[:, t] + 1) % TINY["vocab_size"]
        with torch.no_grad():
            a, c = model(x), model(y)
        assert torch.equal(a[:, :t], c[:, :t])
        assert not torch.allclose(a[:, t:], c[:, t:])
    bidirectional = GPTlite_SLA.from_gptlite(base, block_size=4, critical=0.25, mask="bidirectional")
    y = x.clone()
    y[:, -1] = (y[:, -1] + 1) % TINY["vocab_size"]
    with torch.no_grad():  # the same check catches leakage: the bidirectional model has it
        assert not torch.allclose(bidirectional(x)[:, :-1], bidirectional(y)[:, :-1])


def test_fitting_the_projections_lowers_the_output_error_and_trains_nothing_else():
    from lib.sla import attention_inputs, fit_projections, relative_error
    base = random_gptlite()
    x = torch.randint(TINY["vocab_size"], (16, TINY["seqlen"]), generator=torch.Generator().manual_seed(3))
    inputs = attention_inputs(base, x)
    model = GPTlite_SLA.from_gptlite(base, block_size=4, critical=0.25, mask="bidirectional")
    before, weights = relative_error(model, inputs), {k: v.clone() for k, v in model.state_dict().items()}
    fit_projections(model, inputs, steps=30, lr=1e-2, batch_size=8)
    assert relative_error(model, inputs) < before
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, weights[k])}
    assert changed and all("proj_l" in k for k in changed)


def test_flops_count_the_tiles():
    labels = torch.tensor([[[[CRITICAL, MARGINAL, SKIPPED, MARGINAL], [CRITICAL] * 4,
                             [MARGINAL, SKIPPED, CRITICAL, SKIPPED], [SKIPPED, SKIPPED, CRITICAL, CRITICAL]]]])
    b, d, nb = 4, 8, 4
    flops, dense = attention_flops(labels, b, d, causal=False, linear=True)
    assert dense == 4 * b * b * d * 16
    exact = 4 * b * b * d * 8 + 2 * nb * b * d + 2 * nb * nb * d
    # marginal tiles (0,1), (0,3), (2,0): key blocks 0, 1, 3; query blocks 0, 2
    linear = 3 * (2 * b * d * d + b * d) + 3 * (d * d + d) + 2 * (4 * b * d * d + 3 * b * d)
    assert flops == exact + linear
    assert attention_flops(labels, b, d, causal=False, linear=False)[0] == exact
    assert attention_flops(torch.full((1, 1, 4, 4), CRITICAL), b, d, False, True) == (dense, dense)


def test_gptlite_sla_is_rebuilt_from_its_config():
    model = GPTlite_SLA(**TINY, block_size=4, critical=0.25, skipped=0.5, mask="bidirectional", linear=False,
                        feature_map="elu")
    rebuilt = GPTlite_SLA.from_config(model.config)
    assert rebuilt.config == model.config and rebuilt.config.to_dict()["mask"] == "bidirectional"
    mha = rebuilt.blocks[0].mha
    assert (mha.block_size, mha.critical, mha.skipped, mha.causal, mha.linear, mha.feature_map) == (
        4, 0.25, 0.5, False, False, "elu")
    with pytest.raises(ValueError, match="not a GPTlite state dict"):
        GPTlite_SLA.from_gptlite(_WithExtraKey(), block_size=4, critical=0.5)


class _WithExtraKey(GPTlite):
    """A GPTlite with one parameter GPTlite_SLA does not have."""

    def __init__(self):
        super().__init__(**TINY)
        self.extra = torch.nn.Parameter(torch.zeros(1))


def test_the_long_context_flops_use_rows_of_the_given_shares_and_fall_with_length():
    labels = main_sla.spread_labels(20, 0.1, 0.25)
    assert ((labels == CRITICAL).sum(-1) == 2).all() and ((labels == SKIPPED).sum(-1) == 5).all()
    assert ((labels == MARGINAL).sum(-2) > 0).all()  # every key block is marginal for some row
    curves = main_sla.long_context_flops(0.05, 0.1, [(8, 32), (64, 128)])
    for shares in curves.values():
        assert len(shares) == len(main_sla.LENGTHS) and all(a > b for a, b in zip(shares, shares[1:]))
    assert curves["tiles of 64, d_head 128"][-1] < 0.1


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=0), "block_size must be a positive integer"), (dict(block_size=5), "does not divide seqlen=16"),
    (dict(critical=0.0), "critical must be a fraction in \\(0, 1\\]"), (dict(critical=1.5), "critical must be"),
    (dict(skipped=-0.1), "skipped must be a fraction"), (dict(skipped=1.0), "skipped must be a fraction"),
    (dict(critical=0.6, skipped=0.5), "critical \\+ skipped"), (dict(mask="diagonal"), "mask must be one of"),
    (dict(feature_map="relu"), "feature_map must be one of")])
def test_bad_sla_settings_are_clear_errors(kwargs, message):
    settings = dict(block_size=4, critical=0.25, skipped=0.1, mask="causal", feature_map="softmax") | kwargs
    with pytest.raises(ValueError, match=message):
        check_sla_args(**settings, seqlen=16)
    with pytest.raises(ValueError, match=message):
        GPTlite_SLA(**TINY, **settings)


def test_a_length_the_blocks_do_not_divide_is_a_clear_error():
    Q, K, V = random_qkv(S=30)
    with pytest.raises(ValueError, match="block_size=4 does not divide the sequence length 30"):
        sla_attention(Q, K, V, 4, 0.5, 0.0, True)
    reference = torch.softmax(Q @ K.transpose(-2, -1) / math.sqrt(8), -1) @ V
    assert torch.allclose(dense_attention(Q, K, V, False), reference, atol=ATOL)


def test_the_script_checks_catch_a_wrong_classification(monkeypatch):
    base = random_gptlite()
    window = torch.randint(TINY["vocab_size"], (2, TINY["seqlen"]), generator=torch.Generator().manual_seed(4))
    from lib.sla import attention_inputs
    inputs = attention_inputs(base, window)
    checks = main_sla.run_checks(base, window, inputs, 4, [0.25, 0.5], 0.25, ["causal", "bidirectional"], "softmax")
    assert len(checks) == 4 and all(checks.values())
    monkeypatch.setattr(main_sla, "classify_blocks",  # a wrong estimate: the keys' sign flipped
                        lambda Q, K, b, c, s, causal: classify_blocks(Q, -K, b, c, s, causal))
    checks = main_sla.run_checks(base, window, inputs, 4, [0.25], 0.25, ["bidirectional"], "softmax")
    assert not checks["classification = tile-by-tile loop (bidirectional)"]



QUICK = ["--untrained", "--preset", "cpu", "--device", "cpu", "--exact", "0.25", "0.1", "--fit-steps", "2",
         "--fit-sequences", "4", "--error-sequences", "2", "--val-batches", "1"]


def test_main_sla_runs_checks_and_writes_json_and_plot(real_data, tmp_path, capsys, one_batch_validation):
    out_json, out_png = tmp_path / "sla.json", tmp_path / "sla.png"
    main_sla.main(QUICK + ["--json", str(out_json), "--plot", str(out_png)])
    assert "meaningless" in capsys.readouterr().out
    result = json.loads(out_json.read_text())
    assert result["script"] == "main_sla.py" and result["untrained"] and all(result["checks"].values())
    assert result["n_blocks"] == 16 and result["fit_steps"] == 2
    rows = result["rows"]
    assert [r["variant"] for r in rows] == [f"{m} {v}" for m in ("causal", "bidirectional") for v in
                                            ("dense", "SLA", "sparse only", "SLA", "sparse only")]
    for r in rows:
        assert r["exact"] + r["linear"] + r["skipped"] == pytest.approx(1, abs=1e-3)
        assert (r["val_loss"] is None) == (r["mask"] == "bidirectional")
        if r["variant"].endswith("dense"):
            assert r["rel_error"] == 0 and r["exact"] == 1 and r["flops_rel"] == 1
        else:
            assert 0 < r["rel_error"] and r["exact"] < 1
    bidirectional = {(r["variant"], r["exact_target"]): r for r in rows if r["mask"] == "bidirectional"}
    assert bidirectional[("bidirectional SLA", 0.25)]["exact"] == 0.25  # 4 of 16 tiles in every row
    assert bidirectional[("bidirectional sparse only", 0.1)]["skipped"] == 0.875  # 2 of 16 exact
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["headline"]["technique"].startswith("SLA, tiles of 8, 10% exact")
    methods = result["attention_methods"]
    assert [m["method"] for m in methods] == ["SLA, causal, 16% of tiles exact",
                                              "SLA, bidirectional, 12% of tiles exact"]
    assert all(not m["exact"] and m["training_steps"] == 2 for m in methods)
    renders_on_its_page("main_sla", result)


@pytest.mark.parametrize("flags", [["--exact", "0"], ["--exact", "1"], ["--exact", "1.5"], ["--exact", "0.2", "0.2"],
                                   ["--skipped", "-0.1"], ["--skipped", "1"], ["--exact", "0.5", "--skipped", "0.6"],
                                   ["--block-size", "0"], ["--block-size", "5"], ["--block-size", "128"],
                                   ["--masks", "diagonal"], ["--masks", "causal", "causal"], ["--fit-steps", "0"],
                                   ["--fit-lr", "0"], ["--feature-map", "relu"], ["--plot", "s.txt"], ["--bogus"]])
def test_main_sla_bad_flags_are_clear_errors_before_any_work(flags, capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        main_sla.main(["--untrained", "--device", "cpu"] + flags)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and (flags[0] in err or "unrecognized" in err)
