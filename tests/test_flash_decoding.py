"""flash_decoding against an explicit softmax written here, for every split count of a length that most
do not divide; the cached model with flash decoding against one-token-at-a-time generation; bad input;
main_flash_decoding.py end to end."""
import copy
import json

import pytest
import torch
from conftest import TINY, renders_on_its_page

import inference_utils as iu
import main_flash_decoding as mfd
from gptlite_kvcache import generate_kvcache
from lib import harness
from main_flash_decoding import flash_decoding

ATOL = 1e-5  # float32
SEQLEN = TINY["seqlen"]


def explicit_attention(q, k, v):
    """softmax(q k^T / sqrt(D)) v for one query, written out: q [B, H, 1, D], k and v [B, H, T, D]."""
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / q.shape[-1] ** 0.5
    weights = (scores - scores.amax(-1, keepdim=True)).exp()
    weights = weights / weights.sum(-1, keepdim=True)
    return torch.einsum("bhqk,bhkd->bhqd", weights, v)


def random_qkv(T, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, 1, 8, generator=g) * scale  # peaked softmax: a wrong rescaling shows
    k, v = torch.randn(2, 2, 3, T, 8, generator=g)
    return q, k, v


@pytest.mark.parametrize("T", [1, 7, 37])
def test_flash_decoding_equals_explicit_attention_for_every_split_count(T):
    q, k, v = random_qkv(T)
    ref = explicit_attention(q, k, v)
    for n_splits in range(1, T + 1):  # 37 is prime: every count but 1 and 37 leaves chunks of unequal sizes
        out = flash_decoding(q, k, v, n_splits)
        assert out.shape == (2, 3, 1, 8)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_the_combine_rescales_each_chunk_by_its_share_of_the_softmax():
    """A chunk holding the one dominant key must dominate the output: averaging the partial outputs
    without the log-sum-exp weights would give about the mean of the chunks instead."""
    q, k, v = random_qkv(12, seed=1)
    k[:, :, 10] = q[:, :, 0] * 10  # key 10 (in the last of 3 chunks) wins the softmax
    out = flash_decoding(q, k, v, 3)
    torch.testing.assert_close(out[:, :, 0], v[:, :, 10], atol=1e-3, rtol=0)
    torch.testing.assert_close(out, explicit_attention(q, k, v), atol=ATOL, rtol=0)


@pytest.mark.parametrize("n_splits", [1, 2, 5, 16])
def test_cached_model_with_flash_decoding_gives_the_tokens_of_one_at_a_time_generation(tiny_models, n_splits):
    base, cached = tiny_models
    fd = mfd.use_flash_decoding(copy.deepcopy(cached), n_splits)
    assert all(type(b.mha) is mfd.MultiHeadAttention_FlashDecoding for b in fd.blocks)
    prompt = torch.randint(TINY["vocab_size"], (2, 3), generator=torch.Generator().manual_seed(2))
    out = generate_kvcache(fd, prompt, SEQLEN - 3, SEQLEN)  # the cache grows past n_splits
    sequence = prompt
    with torch.no_grad():
        for _ in range(SEQLEN - 3):  # the full forward pass of the whole sequence at every step
            sequence = torch.cat([sequence, base(sequence)[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert torch.equal(out, sequence)
        _, cache = cached(prompt)
        torch.testing.assert_close(fd(sequence[:, 3:4], kv_cache=cache)[0], base(sequence[:, :4])[:, -1:],
                                   atol=1e-4, rtol=0)


@pytest.mark.parametrize("n_splits", [0, -1, 8, 2.0, True])
def test_bad_n_splits_is_a_clear_error(n_splits):
    q, k, v = random_qkv(7)
    with pytest.raises(ValueError, match="n_splits must be an integer between 1 and the number of keys T=7"):
        flash_decoding(q, k, v, n_splits)


def test_bad_shapes_are_clear_errors():
    q, k, v = random_qkv(7)
    with pytest.raises(ValueError, match=r"one query per sequence and head, q of shape \[B, H, 1, D\]"):
        flash_decoding(k, k, v, 1)
    with pytest.raises(ValueError, match=r"k and v must both be \[B, H, T, D\]"):
        flash_decoding(q, k, v[:, :, :5], 1)


def test_use_flash_decoding_refuses_bad_counts_and_other_models(tiny_models):
    base, cached = tiny_models
    with pytest.raises(ValueError, match="n_splits must be a positive integer, got 0"):
        mfd.use_flash_decoding(cached, 0)
    with pytest.raises(ValueError, match="needs a GPTlite_KVCache"):
        mfd.use_flash_decoding(base, 2)


def test_main_flash_decoding_end_to_end(real_data, tmp_path, capsys):
    out_json, out_png = tmp_path / "fd.json", tmp_path / "fd.png"
    mfd.main(["--untrained", "--device", "cpu", "--contexts", "64", "300", "--splits", "1", "3", "--repeats", "1",
              "--prompt-len", "8", "--n-tokens", "4", "--batch-size", "2", "--json", str(out_json),
              "--plot", str(out_png)])
    printed = capsys.readouterr().out
    assert "meaningless" in printed and "work_units" in printed
    result = json.loads(out_json.read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["naive", "SDPA", "flash n_splits=1", "flash n_splits=3"]
    assert all(r["64 ms"] > 0 and r["300 ms"] > 0 for r in rows.values())
    assert rows["flash n_splits=3"]["same_tokens"] == "yes" and rows["flash n_splits=3"]["work_units"] == 12
    assert result["max_diff"] < ATOL and len(result["summary"]) == 3
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    renders_on_its_page("main_flash_decoding", result)


@pytest.mark.parametrize("flags", [["--splits", "0"], ["--splits", "4", "2"], ["--contexts", "64", "32"],
                                   ["--contexts", "16", "64", "--splits", "1", "32"], ["--repeats", "0"],
                                   ["--n-tokens", "1"], ["--bench-batch", "0"], ["--prompt-len", "129"],
                                   ["--plot", "out.txt"]])
def test_bad_flags_are_clear_errors_before_any_work(flags, capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        mfd.main(["--untrained", "--device", "cpu"] + flags)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


QUICK = ["--untrained", "--device", "cpu", "--contexts", "16", "32", "--splits", "1", "2", "--repeats", "1",
         "--prompt-len", "8", "--n-tokens", "3", "--batch-size", "1"]


def test_failed_checks_stop_before_anything_is_timed_or_written(real_data, tmp_path, monkeypatch):
    monkeypatch.setattr(mfd, "LOGITS_ATOL", -1.0)  # the model check cannot pass
    monkeypatch.setattr(iu, "Timer", lambda *a, **k: pytest.fail("timed before the checks"))
    out_json, out_png = tmp_path / "fd.json", tmp_path / "fd.png"
    with pytest.raises(mfd.harness.GPTliteError, match="checks failed: model with n_splits=1"):
        mfd.main(QUICK + ["--json", str(out_json), "--plot", str(out_png)])
    assert not out_json.exists() and not out_png.exists()


def test_plot_changes_nothing_in_the_json_and_the_headline_is_in_it(real_data, tmp_path):
    results = []
    for plot in ([], ["--plot", str(tmp_path / "fd.png")]):
        mfd.main(QUICK + ["--json", str(tmp_path / "fd.json")] + plot)
        results.append(json.loads((tmp_path / "fd.json").read_text()))
    assert results[0].keys() == results[1].keys()
    assert [r["variant"] for r in results[0]["rows"]] == [r["variant"] for r in results[1]["rows"]]
    assert results[0]["headline"]["technique"] == "FlashDecoding (split-KV), one query over 32 tokens, batch 1"
    assert results[0]["headline"]["figure"].startswith("time / SDPA's: n_splits=1 ")


@pytest.mark.parametrize("flag", ["--contexts", "--bench-batch", "--batch-size", "--n-tokens"])
def test_huge_sizes_are_parser_errors_naming_the_flag_before_any_work(flag, capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        mfd.main(["--untrained", "--device", "cpu", flag, "1000000000000"])
    assert e.value.code == 2
    assert f"error: {flag}: " in capsys.readouterr().err
