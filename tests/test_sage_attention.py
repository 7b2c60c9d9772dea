"""sage_attention against an explicit softmax and against a per-block quantization written here; the
smoothing invariance; the INT8 product against int64; the model with SageAttention in every layer; bad
input; main_sage_attention.py end to end."""
import copy
import json

import pytest
import torch
from conftest import TINY, renders_on_its_page

import inference_utils as iu
import main_sage_attention as msa
from lib import harness
from main_sage_attention import sage_attention

ATOL = 1e-5  # float32


def explicit_attention(q, k, v, causal=False):
    """softmax(q k^T / sqrt(D)) v, written out in float64; causal: bottom-right aligned (a cache's mask)."""
    q, k, v = q.double(), k.double(), v.double()
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / q.shape[-1] ** 0.5
    if causal:
        Tq, Tk = q.shape[-2], k.shape[-2]
        hidden = torch.arange(Tk)[None, :] > torch.arange(Tq)[:, None] + (Tk - Tq)  # key after the query
        scores = scores.masked_fill(hidden, float("-inf"))
    weights = (scores - scores.amax(-1, keepdim=True)).exp()
    return torch.einsum("bhqk,bhkd->bhqd", weights / weights.sum(-1, keepdim=True), v).float()


def quantized_reference(x, block, qmax):
    """Each block of `block` tokens rounded to integers in [-qmax, qmax] with scale max|x| / qmax, then
    scaled back (dequantized): a loop over the blocks, float64."""
    out = torch.empty_like(x, dtype=torch.float64)
    for start in range(0, x.shape[-2], block):
        chunk = x[..., start:start + block, :].double()
        scale = chunk.abs().amax(dim=(-2, -1), keepdim=True) / qmax
        out[..., start:start + block, :] = (chunk / scale).round().clamp(-qmax, qmax) * scale
    return out


def random_qkv(Tq, Tk, offset=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, Tq, 16, generator=g)
    k, v = torch.randn(2, 2, 3, Tk, 16, generator=g)
    return q, k + offset * torch.randn(1, 3, 1, 16, generator=g), v


def rel_l1(out, ref):
    return ((out - ref).abs().sum() / ref.abs().sum()).item()


@pytest.mark.parametrize("bits, smooth_k, smooth_q", [(8, True, False), (8, False, False), (4, True, True)])
def test_sage_attention_is_exact_attention_of_the_quantized_q_and_k(monkeypatch, bits, smooth_k, smooth_q):
    """With P.V in float32, the output is exactly softmax of the dequantized scores: the quantization,
    the scales, the smoothing and the INT32 product are all checked against the loop written here."""
    monkeypatch.setattr(msa, "pv_dtype", lambda device: torch.float32)
    q, k, v = random_qkv(37, 37, offset=4.0)
    qmax = 2 ** (bits - 1) - 1
    k_ref = k - k.mean(-2, keepdim=True) if smooth_k else k
    q_mean = torch.zeros_like(q)
    if smooth_q:  # the mean of each block of 16 queries; the last block (5 queries) counts 11 padding zeros
        for start in range(0, 37, 16):
            q_mean[..., start:start + 16, :] = q[..., start:start + 16, :].sum(-2, keepdim=True) / 16
    scores = quantized_reference(q - q_mean, 16, qmax) @ quantized_reference(k_ref, 8, qmax).transpose(-2, -1)
    scores = (scores + q_mean.double() @ k_ref.double().transpose(-2, -1)) / 4.0  # sqrt(16)
    expected = torch.softmax(scores, dim=-1) @ v.double()
    out = sage_attention(q, k, v, smooth_k=smooth_k, block_q=16, block_k=8, bits=bits, smooth_q=smooth_q)
    torch.testing.assert_close(out, expected.float(), atol=ATOL, rtol=0)


def test_smoothing_k_leaves_exact_attention_unchanged():
    q, k, v = random_qkv(20, 20, offset=8.0)
    smoothed = k - k.mean(-2, keepdim=True)
    torch.testing.assert_close(explicit_attention(q, smoothed, v), explicit_attention(q, k, v), atol=ATOL, rtol=0)
    torch.testing.assert_close(explicit_attention(q, smoothed, v, causal=True),
                               explicit_attention(q, k, v, causal=True), atol=ATOL, rtol=0)


def test_smoothing_k_cuts_the_int8_error_of_a_per_channel_offset():
    q, k, v = random_qkv(64, 64, offset=8.0, seed=1)
    ref = explicit_attention(q, k, v)
    plain = rel_l1(sage_attention(q, k, v, smooth_k=False), ref)
    smooth = rel_l1(sage_attention(q, k, v, smooth_k=True, block_q=128, block_k=64), ref)
    assert smooth < plain / 2
    assert smooth < 0.02  # INT8 scores and bfloat16 P.V: about 1% (bfloat16 keeps 8 bits of mantissa)


@pytest.mark.parametrize("Tq, Tk", [(1, 23), (5, 23), (23, 23)])
def test_causal_sage_attention_follows_the_shifted_mask(Tq, Tk, monkeypatch):
    monkeypatch.setattr(msa, "pv_dtype", lambda device: torch.float32)
    q, k, v = random_qkv(Tq, Tk, seed=2)
    out = sage_attention(q, k, v, block_q=4, block_k=4, causal=True)
    ref = explicit_attention(q, k, v, causal=True)
    assert rel_l1(out, ref) < 0.01  # INT8 scores only
    if Tq > 1:  # the mask matters: without it the error is far larger
        assert rel_l1(sage_attention(q, k, v, block_q=4, block_k=4), ref) > 0.1


@pytest.mark.parametrize("M, N, D", [(1, 5, 16), (7, 9, 3), (33, 17, 32)])
def test_int_matmul_equals_the_int64_product(M, N, D):
    g = torch.Generator().manual_seed(3)
    a = torch.randint(-127, 128, (2, 3, M, D), generator=g, dtype=torch.int8)
    b = torch.randint(-127, 128, (2, 3, N, D), generator=g, dtype=torch.int8)
    out = msa.int_matmul(a, b)
    assert out.dtype == torch.int32 and torch.equal(out.long(), a.long() @ b.long().transpose(-2, -1))


def test_quantize_per_block_uses_each_blocks_full_range():
    x = torch.randn(1, 2, 21, 4, generator=torch.Generator().manual_seed(4))
    values, scale = msa.quantize_per_block(x, 8, 8)  # blocks of 8, 8 and 5 tokens
    assert values.dtype == torch.int8 and scale.shape == (1, 2, 21)
    for start in (0, 8, 16):
        block = values[..., start:start + 8, :]
        assert block.abs().amax(dim=(-2, -1)).eq(127).all()
        torch.testing.assert_close(scale[..., start], x[..., start:start + 8, :].abs().amax(dim=(-2, -1)) / 127)
    torch.testing.assert_close(values * scale[..., None], quantized_reference(x, 8, 127).float(), atol=1e-6, rtol=0)


def test_model_with_sage_attention_stays_close_to_float32(tiny_models):
    _, cached = tiny_models
    sage = msa.use_sage_attention(copy.deepcopy(cached), smooth_k=True, block_q=128, block_k=64)
    assert all(type(b.mha) is msa.MultiHeadAttention_Sage for b in sage.blocks)
    x = torch.randint(TINY["vocab_size"], (4, TINY["seqlen"]), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref, out = cached(x)[0], sage(x)[0]
        _, cache = cached(x[:, :9])  # a decode step and a chunk of 6 over a cache
        one, cache = sage(x[:, 9:10], kv_cache=cache)
        step = torch.cat([one, sage(x[:, 10:], kv_cache=cache)[0]], dim=1)
    assert 0 < (out - ref).abs().max() < 0.1  # quantized: not bitwise equal, but close (logits of a few units)
    assert (step - ref[:, 9:]).abs().max() < 0.1
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.95


@pytest.mark.parametrize("kwargs, message", [(dict(block_q=0), "block_q must be a positive integer"),
                                             (dict(block_k=-1), "block_k must be a positive integer"),
                                             (dict(block_k=2.5), "block_k must be a positive integer"),
                                             (dict(bits=3), "bits must be 8 .* or 4")])
def test_bad_arguments_are_clear_errors(kwargs, message):
    q, k, v = random_qkv(4, 4)
    with pytest.raises(ValueError, match=message):
        sage_attention(q, k, v, **kwargs)


def test_bad_shapes_are_clear_errors(tiny_models):
    q, k, v = random_qkv(4, 6)
    with pytest.raises(ValueError, match=r"q must be \[B, H, Tq, D\] and k, v both \[B, H, Tk, D\]"):
        sage_attention(q, k, v[..., :5, :])
    with pytest.raises(ValueError, match="needs a GPTlite_KVCache"):
        msa.use_sage_attention(tiny_models[0])


def test_main_sage_attention_end_to_end(real_data, tmp_path, capsys):
    out_json, out_png = tmp_path / "sa.json", tmp_path / "sa.png"
    msa.main(["--untrained", "--device", "cpu", "--val-batches", "1", "--prompt-len", "8", "--n-tokens", "4",
              "--batch-size", "2", "--bench-len", "64", "--repeats", "1", "--json", str(out_json),
              "--plot", str(out_png)])
    assert "meaningless" in capsys.readouterr().out
    result = json.loads(out_json.read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == list(msa.VARIANTS)
    assert rows["exact (float32)"]["cos_random"] is None and rows["exact (float32)"]["token_agreement"] == 1.0
    int8 = rows["INT8 + smooth K (SageAttention)"]
    assert float(int8["cos_random"]) > 0.999 and int8["qk_bytes"] < rows["exact (float32)"]["qk_bytes"] / 3
    assert all(r["attn_ms"] > 0 and r["val_loss"] > 0 for r in rows.values())
    assert result["smooth_diff"] < ATOL and len(result["summary"]) == 4
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    renders_on_its_page("main_sage_attention", result)


@pytest.mark.parametrize("flags", [["--val-batches", "0"], ["--n-tokens", "0"], ["--offset", "-1"],
                                   ["--offset", "nan"], ["--bench-len", "0"], ["--repeats", "0"],
                                   ["--prompt-len", "129"], ["--plot", "out.txt"]])
def test_bad_flags_are_clear_errors_before_any_work(flags, capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        msa.main(["--untrained", "--device", "cpu"] + flags)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_plot_changes_nothing_in_the_json_and_the_headline_is_in_it(real_data, tmp_path):
    results = []
    for plot in ([], ["--plot", str(tmp_path / "sa.png")]):
        msa.main(["--untrained", "--device", "cpu", "--val-batches", "1", "--prompt-len", "8", "--n-tokens", "2",
                  "--batch-size", "1", "--bench-len", "32", "--repeats", "1", "--json", str(tmp_path / "sa.json")] + plot)
        results.append(json.loads((tmp_path / "sa.json").read_text()))
    assert results[0].keys() == results[1].keys()
    assert [r["variant"] for r in results[0]["rows"]] == [r["variant"] for r in results[1]["rows"]]
    assert results[0]["headline"]["technique"].startswith("SageAttention: INT8 Q and K per block")
    assert "(INT8)" in results[0]["headline"]["figure"] and all(results[0]["checks"].values())


@pytest.mark.parametrize("flag", ["--batch-size", "--n-tokens", "--bench-len"])
def test_huge_sizes_are_parser_errors_naming_the_flag_before_any_work(flag, capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        msa.main(["--untrained", "--device", "cpu", flag, "1000000000000"])
    assert e.value.code == 2
    assert f"error: {flag}: " in capsys.readouterr().err
