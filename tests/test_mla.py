"""MLA: the full-rank conversion against the multi-head model, absorbed against recomputed keys and
values, cached against uncached, the latent cache, clear errors; main_mla.py end to end on random weights."""
import json

import pytest
import torch
from conftest import TINY, renders_on_its_page
from test_gqa import (diverging_loss, greedy_without_cache, positive_or_none,  # noqa: F401
                      prefill_then_steps, random_tokens)

import inference_utils as iu
import main_mla
from gptlite_kvcache import StaticKVCache, generate_kvcache
from gptlite_mla import GPTlite_MLA, convert_mha_to_mla, max_latent
from lib import harness, presets
from lib.errors import GPTliteError

ATOL = 1e-5  # float32, the same weights computed two ways
FULL_RANK_ATOL = 1e-4  # float32 logits of the full-rank conversion (an SVD in float64, cast back) against MHA
SEQLEN, H, D = TINY["seqlen"], TINY["n_heads"], TINY["d_head"]
FULL = max_latent(H, D, TINY["d_model"])  # min(2 * 3 * 8, 32) = 32


def converted(base, d_latent, absorb=True):
    model = GPTlite_MLA(**TINY, d_latent=d_latent, absorb=absorb).eval()
    model.load_state_dict(convert_mha_to_mla(base.state_dict(), H, D, d_latent))
    return model


@pytest.mark.parametrize("absorb", [True, False])
def test_full_rank_conversion_reproduces_the_multi_head_model(tiny_models, absorb):
    base, cached = tiny_models
    mla = converted(base, FULL, absorb)
    x = random_tokens(3, SEQLEN)
    with torch.inference_mode():
        reference = base(x)
        torch.testing.assert_close(mla(x)[0], reference, atol=FULL_RANK_ATOL, rtol=0)
        # a latent below the rank is a different model: the test can tell them apart
        assert not torch.allclose(converted(base, FULL - 8, absorb)(x)[0], reference, atol=1e-2)
        # past the window too, with the cache: the multi-head cached model's logits
        long = random_tokens(2, 3 * SEQLEN, seed=4)
        torch.testing.assert_close(prefill_then_steps(mla, long, 5)[0], prefill_then_steps(cached, long, 5)[0],
                                   atol=FULL_RANK_ATOL, rtol=0)


def test_conversion_is_the_best_low_rank_factorization_and_keeps_the_biases(tiny_models):
    base, _ = tiny_models
    state = base.state_dict()
    W = torch.cat([state["blocks.0.mha.key_proj.weight"], state["blocks.0.mha.value_proj.weight"]]).double()
    singular = torch.linalg.svdvals(W)
    for d_latent in (4, 16, FULL):
        mla = convert_mha_to_mla(state, H, D, d_latent)
        up = torch.cat([mla["blocks.0.mha.key_up.weight"], mla["blocks.0.mha.value_up.weight"]]).double()
        error = (up @ mla["blocks.0.mha.kv_down.weight"].double() - W).norm()
        assert error == pytest.approx(singular[d_latent:].norm().item(), abs=1e-4)  # Eckart-Young
        assert mla["blocks.0.mha.kv_down.weight"].shape == (d_latent, TINY["d_model"])
        for kind in ("key", "value"):
            assert torch.equal(mla[f"blocks.1.mha.{kind}_up.bias"], state[f"blocks.1.mha.{kind}_proj.bias"])
        assert not any("key_proj" in name or "value_proj" in name for name in mla)


@pytest.mark.parametrize("d_latent", [1, 12, FULL])
def test_absorbed_equals_recomputed_keys_and_values(tiny_models, d_latent):
    base, _ = tiny_models
    absorbed, recomputed = converted(base, d_latent, absorb=True), converted(base, d_latent, absorb=False)
    assert base.state_dict()["blocks.0.mha.key_proj.bias"].abs().min() > 0  # the key bias drops out only exactly
    x = random_tokens(3, SEQLEN, seed=2)
    with torch.inference_mode():
        torch.testing.assert_close(absorbed(x)[0], recomputed(x)[0], atol=ATOL, rtol=0)
        steps_absorbed, cache_absorbed = prefill_then_steps(absorbed, x, 6)
        steps_recomputed, cache_recomputed = prefill_then_steps(recomputed, x, 6)
    torch.testing.assert_close(steps_absorbed, steps_recomputed, atol=ATOL, rtol=0)
    torch.testing.assert_close(cache_absorbed[0][0], cache_recomputed[0][0], atol=0, rtol=0)  # the same latents
    assert absorbed.set_absorb(False) is absorbed and not absorbed.blocks[1].mha.absorb


@pytest.mark.parametrize("absorb", [True, False])
def test_cached_equals_uncached(tiny_models, absorb):
    mla = converted(tiny_models[0], 12, absorb)
    x = random_tokens(3, SEQLEN, seed=3)
    with torch.inference_mode():
        full = mla(x)[0]
    torch.testing.assert_close(prefill_then_steps(mla, x, 5)[0], full, atol=ATOL, rtol=0)
    chunks, cache = [], None  # several new tokens on top of a cache
    for start, stop in [(0, 4), (4, 9), (9, SEQLEN)]:
        logits, cache = mla(x[:, start:stop], kv_cache=cache)
        chunks.append(logits)
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=ATOL, rtol=0)
    prompt, n_tokens = x[:, :5], SEQLEN - 5 + 1
    assert torch.equal(generate_kvcache(mla, prompt, n_tokens, SEQLEN), greedy_without_cache(mla, prompt, n_tokens))


def test_the_cache_is_one_latent_per_token(tiny_models):
    base, cached = tiny_models
    x = random_tokens(2, 10)
    with torch.inference_mode():
        _, cache = converted(base, 12)(x)
        _, mha_cache = cached(x)
        _, full_window = converted(base, 12)(random_tokens(2, 3 * SEQLEN))  # past the window: the last seqlen
    assert len(cache) == TINY["n_layers"] and all(len(layer) == 1 for layer in cache)
    assert all(layer[0].shape == (2, 1, 10, 12) for layer in cache)  # [B, 1, S, d_latent]
    assert full_window[0][0].shape == (2, 1, SEQLEN, 12)
    assert iu.kv_cache_bytes(cache) * 2 * H * D == iu.kv_cache_bytes(mha_cache) * 12
    # at full rank: d_model = 32 values per token against 2 * 3 * 8 = 48 for the multi-head cache
    with torch.inference_mode():
        _, full_rank_cache = converted(base, FULL)(x)
    assert iu.kv_cache_bytes(full_rank_cache) * 48 == iu.kv_cache_bytes(mha_cache) * 32


def test_bad_latent_sizes_and_caches_are_clear_errors(tiny_models):
    base, cached = tiny_models
    for d_latent in (0, -1, FULL + 1, 2.5):
        with pytest.raises(ValueError, match=r"d_latent must be an integer between 1 and the full rank.* = 32"):
            convert_mha_to_mla(base.state_dict(), H, D, d_latent)
        with pytest.raises(ValueError, match="d_latent must be"):
            GPTlite_MLA(**TINY, d_latent=d_latent)
    with pytest.raises(ValueError, match="not n_heads \\* d_head"):
        convert_mha_to_mla(base.state_dict(), 4, D, 8)
    mla, prompt = converted(base, 12), random_tokens(2, 4)
    with pytest.raises(ValueError, match="not a StaticKVCache"):
        generate_kvcache(mla, prompt, 3, SEQLEN, kv_cache=StaticKVCache.for_model(cached, 2))
    _, mha_cache = cached(prompt)
    with pytest.raises(ValueError, match="another model, batch or dtype"):
        generate_kvcache(mla, prompt, 3, SEQLEN, kv_cache=mha_cache)
    _, other_latent = converted(base, 8)(prompt)
    with pytest.raises(ValueError, match="another model, batch or dtype"):
        generate_kvcache(mla, prompt, 3, SEQLEN, kv_cache=other_latent)


def test_main_mla_runs_checks_saves_json_and_plot(real_data, tmp_path, capsys, one_batch_validation,
                                                  unmeasurable_tpot):
    unmeasurable_tpot("MLA-32 absorbed")
    out_json, out_png = tmp_path / "mla.json", tmp_path / "mla.png"
    main_mla.main(["--untrained", "--preset", "cpu", "--device", "cpu", "--uptrain-steps", "1", "--batch-size", "2",
                   "--n-tokens", "4", "--repeats", "1", "--latents", "32", "64", "--json", str(out_json),
                   "--plot", str(out_png), "--shape-batch", "2", "--shape-context", "16", "--shape-tokens", "3"])
    printed = capsys.readouterr().out
    assert "meaningless" in printed and "NO" not in printed
    result = json.loads(out_json.read_text())
    assert result["script"] == "main_mla.py" and result["full_rank"] == 128 and all(result["checks"].values())
    assert any("(full rank) = MHA" in name for name in result["checks"])
    assert any("MLA-32 absorbed = recomputed" in name for name in result["checks"])
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["MHA", "MLA-64 absorbed", "MLA-64 recomputed", "MLA-32 absorbed", "MLA-32 recomputed"]
    p = presets.PRESETS["cpu"]
    assert rows["MHA"]["cache_per_token"] == 2 * p.n_heads * p.d_head == 256
    assert rows["MLA-64 absorbed"]["cache_per_token"] == 64 and rows["MLA-32 recomputed"]["kv_vs_mha"] == 0.125
    for r in rows.values():
        assert r["ttft_ms"] > 0 and positive_or_none(r["tpot_ms"]) and r["tokens_per_s"] > 0 and r["peak_mem_mb"] > 0
        assert r["val_loss"] > 0 and r["loss_converted"] > 0
        assert r["loss_vs_mha"] == pytest.approx(r["val_loss"] - rows["MHA"]["val_loss"], abs=1e-4)
    assert [(g["variant"], g["cache_per_token"]) for g in result["gqa_points"]] == [("GQA-2", 128), ("MQA", 64)]
    summary = {m["method"]: m for m in result["attention_methods"]}  # the summary's rows, a TPOT unmeasured
    assert list(summary) == ["MLA (latent 64)", "MLA (latent 32)"] and not any(m["exact"] for m in summary.values())
    assert "TPOT at batch 2 - against MHA's" in summary["MLA (latent 32)"]["reduction"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    shape = result["tables"][1]  # at the gptlite shape: MHA's keys and values against the latents
    assert "Decoding at the gptlite shape" in shape["title"] and result["bandwidth_GB_per_s"] > 0
    gptlite = presets.PRESETS["gptlite"]
    per_token = {"MHA": 2 * gptlite.n_heads * gptlite.d_head, "MLA-64 absorbed": 64, "MLA-32 absorbed": 32}
    assert [(r["variant"], r["path"], r["batch_size"], r["context"]) for r in shape["rows"]] == [
        (v, "eager", 2, 16) for v in per_token]
    for r in shape["rows"]:
        assert r["kv_mb"] == round(2 * 16 * gptlite.n_layers * per_token[r["variant"]] * 4 / 2**20, 1)
        width = gptlite.d_head if r["variant"] == "MHA" else per_token[r["variant"]]
        assert r["attention_mflop"] == round(2 * 16 * gptlite.n_layers * gptlite.n_heads * 4 * width / 1e6)
        assert positive_or_none(r["tpot_ms"]) and positive_or_none(r["tpot_vs_mha"])
    renders_on_its_page("main_mla", result)


def test_a_diverging_run_is_an_error_and_writes_nothing(real_data, tmp_path, one_batch_validation, diverging_loss):
    with pytest.raises(GPTliteError):
        main_mla.main(["--untrained", "--preset", "cpu", "--device", "cpu", "--uptrain-steps", "1", "--batch-size", "2",
                       "--n-tokens", "2", "--repeats", "1", "--latents", "32", "--json", str(tmp_path / "mla.json"),
                       "--plot", str(tmp_path / "mla.png"), "--shape-batch", "0"])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flags", [["--latents", "0"], ["--latents", "129"], ["--latents", "8", "8"],
                                   ["--uptrain-steps", "0"], ["--n-tokens", "1"], ["--lr", "inf"], ["--lr", "-1"],
                                   ["--prompt-len", "129"], ["--plot", "m.txt"], ["--bogus"],
                                   ["--shape-batch", "-1"], ["--shape-tokens", "1"], ["--shape-context", "0"]])
def test_main_mla_bad_flags_are_clear_errors_before_any_work(flags, capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        main_mla.main(["--untrained", "--device", "cpu"] + flags)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--batch-size", "--n-tokens"])
def test_main_mla_a_huge_size_flag_is_a_parser_error_before_any_work(flag, capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        main_mla.main(["--untrained", "--device", "cpu", "--preset", "cpu", flag, "1000000000000"])
    assert e.value.code == 2 and f"error: {flag}: " in capsys.readouterr().err


def test_main_mla_json_is_the_same_with_and_without_plot(real_data, tmp_path, one_batch_validation):
    """--plot only draws: the GQA points, the tables and the headline come from every run."""
    flags = ["--untrained", "--preset", "cpu", "--device", "cpu", "--uptrain-steps", "1", "--batch-size", "2",
             "--n-tokens", "2", "--repeats", "1", "--latents", "32", "--shape-batch", "0"]
    main_mla.main(flags + ["--json", str(tmp_path / "a.json")])
    main_mla.main(flags + ["--json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png")])
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "ab")
    assert set(a) == set(b) and a["gqa_points"] == b["gqa_points"] and a["checks"] == b["checks"]
    assert [g["variant"] for g in a["gqa_points"]] == ["GQA-2", "MQA"]
    untimed = lambda rows: [{k: v for k, v in r.items() if k not in TIMED} for r in rows]  # noqa: E731
    assert untimed(a["rows"]) == untimed(b["rows"])
    assert a["tables"][0]["rows"] == a["gqa_points"] and a["headline"]["technique"] == b["headline"]["technique"]
    assert "GQA-2" in a["headline"]["figure"] and "MQA" in a["headline"]["figure"]


TIMED = ("ttft_ms", "tpot_ms", "tokens_per_s", "peak_mem_mb")
