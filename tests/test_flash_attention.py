"""SDPA attention against the naive one (without and with a KV cache, one and several new tokens, the
model's logits and greedy tokens), the backends forced one by one, FlexAttention with a sliding-window
mask against naive attention with the same mask, the long-context benchmark's memory, and
main_flash_attention.py end to end."""
import copy
import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, renders_on_its_page
from torch.nn.attention import SDPBackend, sdpa_kernel

import inference_utils as iu
import main_flash_attention as mfa
from gptlite import MultiHeadAttention, generate, scaled_dot_product_attention
from gptlite_kvcache import StaticKVCache, generate_kvcache, scaled_dot_product_attention_kv_cache
from lib import attention_benchmark as ab
from lib import harness
from lib.errors import GPTliteError

ATOL = 1e-5  # float32
SEQLEN = TINY["seqlen"]


def random_qkv(Tk, seed=0):
    Q, K, V = torch.randn(3, 2, 3, Tk, 8, generator=torch.Generator().manual_seed(seed))  # [B, H, Tk, D] each
    return Q, K, V


def random_tokens(batch_size, length, seed=1):
    return torch.randint(TINY["vocab_size"], (batch_size, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("Tq", [1, 4, 10])
def test_sdpa_with_cache_equals_naive_for_one_and_several_new_tokens(Tq):
    Q, K, V = random_qkv(10)
    full = scaled_dot_product_attention(Q, K, V)  # [2, 3, 10, 8], the causal reference
    out = mfa.sdpa_kv_cache(Q[:, :, -Tq:], K, V)  # the last Tq queries over all 10 keys
    torch.testing.assert_close(out, scaled_dot_product_attention_kv_cache(Q[:, :, -Tq:], K, V), atol=ATOL, rtol=0)
    torch.testing.assert_close(out, full[:, :, -Tq:], atol=ATOL, rtol=0)


def test_is_causal_would_be_wrong_with_fewer_queries_than_keys():
    Q, K, V = random_qkv(10)
    tail = scaled_dot_product_attention(Q, K, V)[:, :, -4:]
    top_left = F.scaled_dot_product_attention(Q[:, :, -4:], K, V, is_causal=True)  # query i sees keys 0..i
    assert (top_left - tail).abs().max() > 0.1
    torch.testing.assert_close(mfa.sdpa_kv_cache(Q[:, :, -4:], K, V), tail, atol=ATOL, rtol=0)


def test_use_sdpa_swaps_classes_keeps_weights_and_matches_logits_and_tokens(tiny_models):
    base, _ = tiny_models
    sdpa = mfa.use_sdpa(copy.deepcopy(base))
    assert all(type(block.mha) is mfa.MultiHeadAttention_SDPA for block in sdpa.blocks)
    assert all(torch.equal(a, b) for a, b in zip(base.state_dict().values(), sdpa.state_dict().values()))
    x = random_tokens(3, SEQLEN)
    torch.testing.assert_close(sdpa(x), base(x), atol=ATOL, rtol=0)
    prompt = random_tokens(2, 5, seed=2)
    assert torch.equal(generate(sdpa, prompt, 20, SEQLEN), generate(base, prompt, 20, SEQLEN))


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_cached_sdpa_model_matches_naive_with_prefill_several_and_one_new_tokens(tiny_models, kind):
    base, cached = tiny_models
    sdpa = mfa.use_sdpa(copy.deepcopy(cached))
    assert all(type(block.mha) is mfa.MultiHeadAttention_KVCache_SDPA for block in sdpa.blocks)
    x = random_tokens(2, SEQLEN, seed=3)
    cache = None if kind == "dynamic" else StaticKVCache.for_model(sdpa, 2)
    logits = []
    for start, stop in [(0, 4), (4, 9), (9, 12), (12, 13), (13, 14), (14, 16)]:  # prefill, 5, 3, 1, 1, 2 tokens
        out, cache = sdpa(x[:, start:stop], kv_cache=cache)
        logits.append(out)
    torch.testing.assert_close(torch.cat(logits, dim=1), base(x), atol=ATOL, rtol=0)


def test_cached_sdpa_greedy_tokens_equal_naive_within_and_past_the_window(tiny_models):
    base, cached = tiny_models
    sdpa = mfa.use_sdpa(copy.deepcopy(cached))
    prompt = random_tokens(3, 5, seed=4)
    n_in_window = SEQLEN - 5 + 1
    assert torch.equal(generate_kvcache(sdpa, prompt, n_in_window, SEQLEN), generate(base, prompt, n_in_window, SEQLEN))
    for cache in (None, StaticKVCache.for_model(sdpa, 3)):  # past the window: a full cache, one token at a time
        ref = StaticKVCache.for_model(cached, 3) if cache is not None else None
        assert torch.equal(generate_kvcache(sdpa, prompt, 2 * SEQLEN, SEQLEN, kv_cache=cache),
                           generate_kvcache(cached, prompt, 2 * SEQLEN, SEQLEN, kv_cache=ref))


def test_use_sdpa_rejects_other_attention_modules_before_changing_any(tiny_models):
    base, _ = tiny_models

    class OtherAttention(MultiHeadAttention):
        pass

    model = copy.deepcopy(base)
    model.blocks[-1].mha.__class__ = OtherAttention
    with pytest.raises(ValueError, match="OtherAttention"):
        mfa.use_sdpa(model)
    assert type(model.blocks[0].mha) is MultiHeadAttention  # no half-converted model
    sdpa = mfa.use_sdpa(mfa.use_sdpa(copy.deepcopy(base)))  # twice: unchanged
    assert all(type(block.mha) is mfa.MultiHeadAttention_SDPA for block in sdpa.blocks)


def test_sdpa_dropout_only_in_training():
    torch.manual_seed(0)
    naive = MultiHeadAttention(d_model=32, n_heads=4, d_head=8, dropout_p=0.5).eval()
    sdpa = copy.deepcopy(naive)
    sdpa.__class__ = mfa.MultiHeadAttention_SDPA  # what use_sdpa does to each block
    x = torch.randn(2, 12, 32)
    torch.testing.assert_close(sdpa(x), naive(x), atol=ATOL, rtol=0)  # eval: no dropout anywhere
    assert mfa.sdpa_dropout_p(sdpa) == 0.0 and mfa.sdpa_dropout_p(sdpa.train()) == 0.5
    torch.manual_seed(1)
    first = sdpa(x)
    assert not torch.allclose(first, sdpa(x)) and not torch.allclose(first, naive(x))


def test_each_cpu_backend_forced_gives_the_same_outputs_and_is_named(tiny_models):
    _, cached = tiny_models
    sdpa = mfa.use_sdpa(copy.deepcopy(cached))
    x = random_tokens(2, SEQLEN, seed=5)
    reference = cached(x)[0]
    names = {SDPBackend.MATH: "attention_math", SDPBackend.FLASH_ATTENTION: "flash_attention_for_cpu"}
    for backend, name in names.items():
        with sdpa_kernel(backend):
            torch.testing.assert_close(sdpa(x)[0], reference, atol=ATOL, rtol=0)
            assert mfa.sdpa_kernels_run(lambda: sdpa(x)) == name
    assert mfa.sdpa_kernels_run(lambda: cached(x)) == "none"


def test_sliding_window_mask():
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(ab.sliding_window_mask(4, 2), expected)


def test_flex_sliding_window_equals_naive_with_the_same_mask():
    # Eager flex runs on CPU (unfused, materializing the scores); the compiled kernel is checked by the script's test.
    Q, K, V = random_qkv(40)
    flex = ab.FlexSlidingWindow(window=8, compiled=False)
    out = flex(Q, K, V)
    torch.testing.assert_close(out, ab.naive_sliding_window(Q, K, V, 8), atol=ATOL, rtol=0)
    assert (out - scaled_dot_product_attention(Q, K, V)).abs().max() > 0.1  # the window matters


def test_flex_that_cannot_run_is_reported_not_fatal(monkeypatch):
    def broken(self, Q, K, V):
        raise RuntimeError("no compiler")
    monkeypatch.setattr(ab.FlexSlidingWindow, "__call__", broken)
    flex, diff, note = ab.make_flex(8, "cpu", compiled=False)
    assert flex is None and diff is None and "does not run on cpu" in note and "no compiler" in note


def test_naive_memory_grows_with_n_squared_and_sdpa_stays_far_below():
    results = ab.benchmark({"naive": ab.naive_attention, "SDPA": ab.sdpa_attention}, [256, 512], batch_size=1,
                           n_heads=4, d_head=32, device="cpu", repeats=1)
    naive, sdpa = results["naive"]["peak_mb"], results["SDPA"]["peak_mb"]
    assert naive[1] / naive[0] > 3.5  # 4x the scores for 2x the tokens
    assert sdpa[1] < naive[1] / 10
    assert "naive/SDPA memory" in ab.format_results(results)


def test_main_flash_attention_end_to_end(real_data, tmp_path, capsys):
    out_json, out_png = tmp_path / "fa.json", tmp_path / "fa.png"
    mfa.main(["--untrained", "--preset", "cpu", "--device", "cpu", "--prompt-len", "8", "--n-tokens", "4",
              "--batch-size", "2", "--repeats", "1", "--val-batches", "2", "--contexts", "64", "256",
              "--bench-repeats", "1", "--window", "32", "--json", str(out_json), "--plot", str(out_png)])
    printed = capsys.readouterr().out
    assert "meaningless" in printed and "naive/SDPA memory" in printed
    result = json.loads(out_json.read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["naive", "SDPA (default dispatch)"] + [f"SDPA forced {b.name}" for b in mfa.BACKENDS]
    assert rows["naive"]["kernel"] == "none"
    assert rows["SDPA (default dispatch)"]["kernel"] == "flash_attention_for_cpu"
    assert rows["SDPA forced MATH"]["kernel"] == "attention_math"
    assert rows["SDPA forced EFFICIENT_ATTENTION"]["kernel"] == "cannot run on cpu in float32"
    ran = [r for r in rows.values() if r["ttft_ms"] is not None]
    assert len(ran) == 4 and all(r["ok"] == "yes" and r["same_tokens"] == "yes" for r in ran)
    assert all(r["val_loss"] == pytest.approx(rows["naive"]["val_loss"], abs=1e-4) for r in ran)
    assert all(r["kv_cache_mb"] == rows["naive"]["kv_cache_mb"] > 0 for r in ran)
    bench = result["long_context"]
    assert bench["naive"]["context"] == [64, 256]
    if shutil.which("g++") or shutil.which("clang++"):  # torch.compile can build the CPU kernel
        assert result["flex_note"] is None
    if result["flex_note"] is None:  # the compiled flex kernel ran, checked against naive attention
        assert list(bench) == ["naive", "SDPA", "flex window 32"] and result["flex_max_diff"] < ATOL
    else:  # no compiler: said, and left out of the benchmark
        assert "does not run" in result["flex_note"] and list(bench) == ["naive", "SDPA"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    renders_on_its_page("main_flash_attention", result)


@pytest.mark.parametrize("flags", [["--n-tokens", "1"], ["--prompt-len", "0"], ["--prompt-len", "129"],
                                   ["--batch-size", "0"], ["--repeats", "0"], ["--val-batches", "0"],
                                   ["--contexts", "256", "128"], ["--contexts", "128", "128"], ["--contexts", "0", "8"],
                                   ["--window", "0"], ["--bench-batch", "0"], ["--bench-repeats", "0"],
                                   ["--plot", "out.txt"], ["--bogus"], ["--device", "tpu"]])
def test_bad_flags_are_clear_errors_before_any_work(flags, capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        mfa.main(["--untrained", "--device", "cpu"] + flags)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


QUICK = ["--untrained", "--preset", "cpu", "--device", "cpu", "--prompt-len", "8", "--n-tokens", "4", "--batch-size", "2",
         "--repeats", "1", "--val-batches", "1", "--contexts", "32", "64", "--bench-repeats", "1", "--no-flex"]


def test_failed_checks_stop_before_anything_is_timed_or_written(real_data, tmp_path, monkeypatch):
    monkeypatch.setattr(mfa, "ATOL", -1.0)  # no variant can pass: every check fails
    monkeypatch.setattr(iu, "compare_generation", lambda *a, **k: pytest.fail("timed before the checks"))
    out_json, out_png = tmp_path / "fa.json", tmp_path / "fa.png"
    with pytest.raises(GPTliteError, match="checks failed: naive: outputs, tokens and loss equal naive"):
        mfa.main(QUICK + ["--json", str(out_json), "--plot", str(out_png)])
    assert not out_json.exists() and not out_png.exists()


def test_plot_changes_nothing_in_the_json_and_the_headline_is_in_it(real_data, tmp_path):
    results = []
    for plot in ([], ["--plot", str(tmp_path / "fa.png")]):
        mfa.main(QUICK + ["--json", str(tmp_path / "fa.json")] + plot)
        results.append(json.loads((tmp_path / "fa.json").read_text()))
    assert results[0].keys() == results[1].keys()
    assert [r["variant"] for r in results[0]["rows"]] == [r["variant"] for r in results[1]["rows"]]
    assert results[0]["headline"]["technique"] == "SDPA vs naive attention, 64 tokens"
    assert "less peak attention memory" in results[0]["headline"]["figure"]
    table = results[0]["tables"][0]
    assert table["title"].startswith("The attention functions alone") and [r["context"] for r in table["rows"]] == [32, 64]


@pytest.mark.parametrize("flag", ["--batch-size", "--n-tokens", "--contexts", "--bench-batch", "--window"])
def test_huge_sizes_are_parser_errors_naming_the_flag_before_any_work(flag, capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        mfa.main(["--untrained", "--device", "cpu", flag, "1000000000000"])
    assert e.value.code == 2
    assert f"error: {flag}: " in capsys.readouterr().err
