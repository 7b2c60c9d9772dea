"""lib/quantization.py and main_quantization.py: round to nearest against its formulas, the packed kernels
against dequantize-then-matmul, GPTQ against the OBQ update written out (the inverse Hessian recomputed
after every column), AWQ and SmoothQuant against their own invariants, W8A8 against an integer emulation,
KIVI against per-channel and per-token quantization written here; bad settings are clear errors."""
import importlib.util
import json
import sys

import pytest
import torch
import torch.nn as nn

import inference_utils as iu
import main_quantization as mq
from gptlite_kvcache import GPTlite_KVCache
from lib import harness
from lib.presets import PRESETS
from lib import quantization as qz
from conftest import renders_on_its_page


def linear(n_in, n_out, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(n_in, n_out)


@pytest.mark.parametrize("n_in, n_out", [(128, 128), (128, 512), (512, 128)])
def test_round_to_nearest_follows_its_formulas_and_the_kernels_equal_dequantize(n_in, n_out):
    layer, x = linear(n_in, n_out), torch.randn(5, n_in)
    w = layer.weight.detach()
    q8 = qz.rtn(layer, 8, 32, kernel=False)
    scale = w.abs().amax(1) / 127  # symmetric per output channel
    assert torch.equal(q8.q, torch.round(w / scale[:, None]).to(torch.int8))
    q4 = qz.rtn(layer, 4, 32, kernel=False)
    groups = w.reshape(n_out, -1, 32)
    lo, hi = groups.amin(-1), groups.amax(-1)
    assert ((q4.weight() - w).abs().reshape(n_out, -1, 32) <= ((hi - lo) / 15 / 2 + 1e-6)[..., None]).all()
    for bits in (8, 4):
        plain = qz.rtn(layer, bits, 32, kernel=False)
        torch.testing.assert_close(qz.rtn(layer, bits, 32)(x), plain(x), atol=1e-5, rtol=0)
        torch.testing.assert_close(plain.kernel_form()(x), plain(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_and_unpack_round_trip(bits):
    q = torch.randint(0, 2**bits, (3, 5, 32), dtype=torch.uint8)
    packed = qz.pack(q, bits)
    assert packed.shape == (3, 5, 32 * bits // 8) and torch.equal(qz.unpack(packed, bits), q)


def obq_reference(W, X, scale):
    """int8 per-channel GPTQ written as OBQ: after each column, the inverse Hessian of the remaining columns
    recomputed (here by removing the column's row and column, the Gaussian elimination step)."""
    W = W.clone().double()
    H = 2 * X.double().t() @ X.double()
    H += 0.01 * torch.diag(H).mean() * torch.eye(H.shape[0], dtype=H.dtype)
    Hinv = torch.linalg.inv(H)
    Q = torch.zeros_like(W)
    for i in range(W.shape[1]):
        Q[:, i] = torch.round(W[:, i] / scale).clamp(-127, 127) * scale
        err = (W[:, i] - Q[:, i]) / Hinv[i, i]
        W[:, i:] -= err[:, None] * Hinv[i, i:][None, :]
        Hinv -= Hinv[:, i:i + 1] @ Hinv[i:i + 1, :] / Hinv[i, i]  # column i is fixed from now on
    return Q


def test_gptq_is_the_obq_update_and_beats_round_to_nearest_on_its_calibration():
    layer, X = linear(64, 48), torch.randn(256, 64) * torch.linspace(0.1, 3, 64)  # unequal input channels
    w = layer.weight.detach()
    g = qz.gptq(layer, X, 8, None)
    reference = obq_reference(w, X, w.abs().amax(1).double() / 127)
    torch.testing.assert_close(g.weight().double(), reference, atol=1e-5, rtol=0)
    for bits in (8, 4):
        error = lambda q: ((X @ q.weight().t() - X @ w.t()) ** 2).mean()  # noqa: E731
        assert error(qz.gptq(layer, X, bits, 32, kernel=False)) < error(qz.rtn(layer, bits, 32, kernel=False))


def test_awq_never_does_worse_than_round_to_nearest_and_scales_the_input():
    layer = linear(128, 64)
    X = torch.randn(512, 128) * (1 + 20 * (torch.arange(128) % 17 == 0))  # a few outlier channels, as in LLMs
    a, r = qz.awq(layer, X, 4, 32, kernel=False), qz.rtn(layer, 4, 32, kernel=False)
    err = lambda q: ((q(X) - layer(X)) ** 2).mean()  # noqa: E731
    assert err(a) <= err(r) and a.input_scale is not None  # alpha = 0 (s = 1, plain RTN) is on the grid
    assert (a.input_scale[torch.arange(128) % 17 == 0].mean() > a.input_scale.mean())  # outliers scaled up


def test_smoothing_keeps_the_function_and_w8a8_is_integer_arithmetic():
    torch.manual_seed(0)
    model = GPTlite_KVCache(vocab_size=65, d_model=32, n_heads=2, d_head=16, n_layers=2, dropout_p=0.0, seqlen=16).eval()
    idx = torch.randint(65, (2, 16))
    with torch.no_grad():
        before = model(idx)[0]
        block = model.blocks[0]
        qz.smooth(block.ln1, [block.mha.query_proj, block.mha.key_proj, block.mha.value_proj], torch.rand(32) * 5 + 0.1)
        torch.testing.assert_close(model(idx)[0], before, atol=1e-5, rtol=0)
    layer, x = linear(64, 32), torch.randn(7, 64)
    w8a8 = qz.W8A8Linear(layer)
    xq, xs = qz.quantize_per_token(x)
    wq, ws = qz.quantize_int8(layer.weight.detach())
    emulated = (xq.double() @ wq.double().t()) * xs.double() * ws.double() + layer.bias.double()
    torch.testing.assert_close(w8a8(x).double(), emulated, atol=1e-5, rtol=0)


def test_fp8_rounds_to_e4m3_with_its_relative_error():
    x = torch.randn(4, 64)
    y = qz.fake_fp8(x)
    scale = x.abs().amax(-1, keepdim=True) / 448
    assert torch.equal((y / scale).to(torch.float8_e4m3fn).float() * scale, y)  # already on the e4m3 grid
    big = x.abs() > scale * 2**-6  # normal e4m3 numbers: 3 mantissa bits, a relative error of at most 2^-4
    assert ((y - x).abs()[big] <= x.abs()[big] * 2**-4 + 1e-7).all()


def test_kivi_quantizes_keys_per_channel_and_values_per_token_and_is_float32_before_a_block_fills():
    torch.manual_seed(0)
    cache = qz.KIVICache(n_layers=1, bits=4, block=4)
    k, v = torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 8)  # 6 tokens: one block of 4, a residual of 2
    K, V, _ = cache.update(0, k, v)
    blk_k, blk_v = k[:, :, :4], v[:, :, :4]
    lo_k, hi_k = blk_k.amin(2, keepdim=True), blk_k.amax(2, keepdim=True)  # per channel, over the tokens
    sk = (hi_k - lo_k) / 15
    torch.testing.assert_close(K[:, :, :4], torch.round((blk_k - lo_k) / sk) * sk + lo_k, atol=1e-5, rtol=0)
    lo_v, hi_v = blk_v.amin(3, keepdim=True), blk_v.amax(3, keepdim=True)  # per token, over the channels
    sv = (hi_v - lo_v) / 15
    torch.testing.assert_close(V[:, :, :4], torch.round((blk_v - lo_v) / sv) * sv + lo_v, atol=1e-5, rtol=0)
    assert torch.equal(K[:, :, 4:], k[:, :, 4:]) and torch.equal(V[:, :, 4:], v[:, :, 4:])  # float32 residual
    codes = 2 * 2 * 3 * 4 * 8 * 4 // 8
    params = 2 * 3 * 8 * 4 * 2 + 2 * 3 * 4 * 4 * 2  # keys: scale and min per channel; values: per token
    assert cache.nbytes == codes + params + 2 * k[:, :, 4:].nbytes
    torch.manual_seed(1)
    model = GPTlite_KVCache(vocab_size=65, d_model=32, n_heads=2, d_head=16, n_layers=2, dropout_p=0.0, seqlen=16).eval()
    idx = torch.randint(65, (2, 7))
    with torch.no_grad():  # 7 tokens, a block of 8: nothing quantized yet (atol: a copied layout's summation order)
        torch.testing.assert_close(model(idx, qz.KIVICache(2, 2, 8, 16))[0], model(idx)[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("keep", [10, 9, 8, 4, 0])
def test_kivi_rolls_back_to_what_a_cache_fed_only_those_tokens_holds(keep):
    torch.manual_seed(0)
    k, v, new_k, new_v = torch.randn(2, 3, 10, 8), torch.randn(2, 3, 10, 8), torch.randn(2, 3, 3, 8), torch.randn(2, 3, 3, 8)
    rolled, fresh = qz.KIVICache(n_layers=1, bits=4, block=4), qz.KIVICache(n_layers=1, bits=4, block=4)
    rolled.update(0, k, v)  # two blocks of 4 quantized, a residual of 2
    rolled.n_tokens = 10
    rolled.truncate(keep)
    if keep:
        fresh.update(0, k[:, :, :keep], v[:, :, :keep])
    assert rolled.n_tokens == keep and len(rolled.blocks[0]) == keep // 4
    for got, want in zip(rolled.update(0, new_k, new_v)[:2], fresh.update(0, new_k, new_v)[:2]):
        assert torch.equal(got, want)
    assert rolled.nbytes == fresh.nbytes


def test_kivi_cannot_roll_back_into_a_quantized_block():
    cache = qz.KIVICache(n_layers=1, bits=4, block=4)
    cache.update(0, torch.randn(1, 1, 10, 8), torch.randn(1, 1, 10, 8))
    cache.n_tokens = 10
    with pytest.raises(ValueError, match="inside a block already quantized"):
        cache.truncate(6)
    with pytest.raises(ValueError, match="cannot keep 11 tokens"):
        cache.truncate(11)


@pytest.mark.parametrize("kwargs, match", [(dict(method="rtn", bits=4, group_size=48), "does not divide"),
                                           (dict(method="rtn", bits=3), "3 bits"), (dict(method="gptq"), "calibration"),
                                           (dict(method="int2"), "unknown method")])
def test_bad_quantization_settings_are_clear_errors(kwargs, match):
    torch.manual_seed(0)
    model = GPTlite_KVCache(vocab_size=65, d_model=32, n_heads=2, d_head=16, n_layers=1, dropout_p=0.0, seqlen=16)
    with pytest.raises(ValueError, match=match):
        qz.quantize_model(model, **kwargs)
    with pytest.raises(ValueError, match="3 bits"):
        qz.KIVICache(1, 3)


QUICK = ["--preset", "cpu", "--device", "cpu", "--n-tokens", "4", "--prompt-len", "8", "--repeats", "1",
         "--val-batches", "1", "--calib-windows", "2", "--bench-size", "256", "--shape-batch", "2", "--shape-context",
         "64", "--shape-tokens", "2"]


@pytest.mark.parametrize("flags, match", [(["--group-size", "48"], "--group-size"),
                                          (["--group-size", "4"], "multiple of 8"), (["--kv-bits", "3"], "--kv-bits"),
                                          (["--kv-block", "48"], "--kv-block"), (["--alpha", "1.5"], "--alpha")])
def test_bad_flags_are_clear_errors_before_any_work(flags, match, capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        mq.main(["--untrained"] + QUICK + flags)
    assert e.value.code == 2 and match in capsys.readouterr().err


def test_main_writes_a_row_per_variant_with_its_checks(real_data, tmp_path):
    out_json, out_png = tmp_path / "q.json", tmp_path / "q.png"
    mq.main(["--untrained", "--json", str(out_json), "--plot", str(out_png), "--no-llamacpp"] + QUICK)
    result = json.loads(out_json.read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert {"float32", "int8 per channel, RTN", "int4 g32, GPTQ", "int4 g32, AWQ", "KIVI 2-bit KV cache"} <= set(rows)
    assert rows["float32"]["token_agreement"] == 1.0 and rows["float32"]["loss_change"] == 0
    assert all(r["kernel_eq_dequant"] == "yes" for n, r in rows.items() if n.startswith(("int8", "int4")))
    assert rows["int4 g32, RTN"]["bits_per_weight"] < rows["int8 per channel, RTN"]["bits_per_weight"] < 12
    assert rows["KIVI 2-bit KV cache"]["kv_bytes_per_token"] < rows["KIVI 4-bit KV cache"]["kv_bytes_per_token"] < 4096
    paths, bench, shape, kv = (t["rows"] for t in result["tables"])
    assert [(r["variant"], r["path"]) for r in paths] == [(v, p) for p in ("eager", "fast") for v in mq.fast_variants(32)]
    assert all(r["vs_float32_b1"] in (1.0, None) for r in paths if r["variant"] == "float32")  # None: TPOT in the noise
    assert [r["variant"] for r in bench][4:] == [f"{mq.INDUCTOR_INT8} (float32 x)", f"{mq.INDUCTOR_INT8} (bfloat16 x)",
                                                 "torchao int8 weight-only", "float32 fast path kernel",
                                                 "int8 fast path kernel", "int4 g32 fast path kernel", mq.MEMORY_READ]
    assert [r["weight_mb"] for r in bench][4:] == [0.1] * 3 + [0.3, 0.1, 0.0, 0.2]  # 256 x 256: float32 (and a
    # zero bias), int8, int4
    assert any(c.startswith(f"benchmark: {mq.INDUCTOR_INT8} (float32 x) = int8 dequantize") for c in result["checks"])
    assert any(line.startswith("benchmark, compile time") for line in result["summary"])
    assert bench[-1]["share_of_bandwidth"] == 1.0 and result["bandwidth_GB_per_s"] == bench[-1]["weight_GB_per_s"] > 0
    assert sum("fast path" in check for check in result["checks"]) == 4 + 3 + 4 + 1 + 2 and all(result["checks"].values())
    # the gptlite shape: four weight forms on the fast path and eager float32, the bytes each step reads
    assert [(r["variant"], r["path"]) for r in shape] == [(v, "fast") for v in ("float32", "bfloat16",
                                                          "int8 per channel, RTN", "int4 g32, RTN")] + [("float32", "eager")]
    assert all(r["shape"] == "gptlite" for r in shape) and shape[0]["tpot_vs_float32"] in (1.0, None)
    weights = [r["weight_mb"] for r in shape[:4]]
    assert weights[0] > 64 and weights[0] / 1.9 > weights[1] > weights[0] / 2 and weights[1] > 2 * weights[3]  # the head stays float32
    assert [r["in_cache"] for r in shape] == ["no" if w > result["last_level_cache_bytes"] / 2**20 else "yes"
                                              for w in [r["weight_mb"] for r in shape]]
    # the KV cache at the shape: float32 on each path, KIVI on eager, each checked before timing
    assert [(r["variant"], r["path"]) for r in kv] == [(v, p) for p in ("eager", "fast") for v in
                                                       ("float32", "KIVI 4-bit KV cache", "KIVI 2-bit KV cache")]
    assert [r["kv_mb"] for r in kv[:3]] == [r["kv_mb"] for r in kv[3:]]  # the same entries, packed for the fast path
    assert all(r["shape"] == "gptlite" and r["batch_size"] == 2 and r["context"] == 64 for r in kv)
    assert kv[0]["kv_mb"] == round(2 * 6 * 2 * 6 * 64 * 64 * 4 / 2**20, 1) == kv[3]["kv_mb"]  # 2 x L x B x H x ctx x D
    assert kv[0]["kv_mb"] / 4 > kv[1]["kv_mb"] > kv[2]["kv_mb"] and kv[0]["tpot_vs_float32"] in (1.0, None)
    assert sum("dequantized entries" in c for c in result["checks"]) == 2
    figure = result["headline"]["figure"]  # the one-glance row: quality, then the gptlite shape's ratios
    assert figure.startswith("int4 g32, ") and "bits per weight" in figure
    assert all(f"{r['variant'].split(' ')[0]} {r['tpot_vs_float32']:.2f}x" in figure for r in shape[1:4]
               if r["tpot_vs_float32"] is not None)  # None: a TPOT within the timer's noise
    assert all(f"{r['variant'].split(' KV')[0]} {r['tpot_vs_float32']:.2f}x" in figure for r in kv[4:]
               if r["tpot_vs_float32"] is not None)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    renders_on_its_page("main_quantization", result)


def test_without_llama_cpp_its_rows_are_skipped_with_one_line(real_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # find_spec then says it is not installed
    out_json = tmp_path / "q.json"
    mq.main(["--untrained", "--paths", "eager", "--kv-bits", "4", "--no-candidates", "--json", str(out_json)] + QUICK)
    result = json.loads(out_json.read_text())
    line = "llama_cpp is not installed (pip install -r requirements-llamacpp.txt): its rows are skipped"
    assert capsys.readouterr().out.count(line) == 1 and line in result["summary"]
    assert not any("llama.cpp" in r["variant"] for t in result["tables"] for r in t["rows"])


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python is not installed (pip install -r requirements-llamacpp.txt)")
def test_llama_cpp_rows_beside_ours_at_the_gptlite_shape(real_data, tmp_path, monkeypatch):
    real_probe = mq.llamacpp.probe
    monkeypatch.setattr(mq.llamacpp, "probe", lambda path, *a: "llama.cpp failed to decode it (killed by SIGSEGV)"
                        if path.endswith("gptlite-q4_0.gguf") else real_probe(path, *a))  # a crash: the row skipped
    out_json = tmp_path / "q.json"
    mq.main(["--untrained", "--kv-bits", "4", "--no-candidates", "--shape-batch", "0", "--json", str(out_json)]
            + QUICK[:-6])
    result = json.loads(out_json.read_text())
    shape = result["tables"][2]["rows"]
    peers = {r["variant"]: r for r in shape if r["path"] == "llama.cpp"}
    assert list(peers) == ["llama.cpp f32", "llama.cpp q8_0"]
    # llama.cpp reads a model of 8 heads of 64 (the 6 and two zero heads), no head bias, one row of each embedding
    padded = GPTlite_KVCache(**{**PRESETS["gptlite"].gptlite_kwargs(), "n_heads": 8})
    n = iu.n_params(padded) - padded.token_embedding.weight.numel() - padded.position_embedding.weight.numel() \
        - padded.fc_out.bias.numel() + 2 * 512
    assert peers["llama.cpp f32"]["weight_mb"] == round(4 * n / 2**20, 2)
    assert peers["llama.cpp q8_0"]["weight_mb"] < peers["llama.cpp f32"]["weight_mb"] / 3.5
    assert all(r["tpot_vs_float32"] is None or r["tpot_vs_float32"] > 0 for r in peers.values())
    checks = [c for c in result["checks"] if "llama.cpp f32: greedy tokens = ours" in c]
    assert len(checks) == 2 and all(result["checks"][c] for c in checks)  # the trained preset's and the shape's
    assert any("llama.cpp q4_0: llama.cpp failed to decode it" in line for line in result["summary"])


def test_the_eager_path_alone_has_no_fast_rows(real_data, tmp_path):
    out_json = tmp_path / "q.json"
    mq.main(["--untrained", "--paths", "eager", "--kv-bits", "4", "--no-candidates", "--json", str(out_json)] + QUICK)
    result = json.loads(out_json.read_text())
    paths, bench, kv = (t["rows"] for t in result["tables"])  # no weights' shape table: it is timed on the fast path
    assert {r["path"] for r in paths} == {"eager"} and len(bench) == 4 and result["bandwidth_GB_per_s"] is None
    assert [(r["variant"], r["path"]) for r in kv] == [("float32", "eager"), ("KIVI 4-bit KV cache", "eager")]
    assert kv[0]["at_bandwidth_ms"] is None  # the bandwidth is measured with the fast path's extension


def test_paths_fast_without_a_compiler_is_a_clear_error_before_any_work(capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    monkeypatch.setattr(harness.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit) as e:
        mq.main(["--untrained"] + QUICK + ["--paths", "fast"])
    assert e.value.code == 2 and "--paths fast: no C++ compiler" in capsys.readouterr().err
