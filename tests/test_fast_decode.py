"""lib/fast_decode.py: the C++ cached forward pass against the eager model.

References: the full forward pass without a cache (GPTlite.forward over the whole sequence) for every
position inside the window, and the eager cached pass (GPTlite_KVCache.forward_cache on a StaticKVCache)
past it, where a sliding window has no full-forward equivalent. Logits agree within atol 1e-4 (float32
sums in another order; the logits are a few units, see conftest.random_gptlite); greedy tokens are equal.
The extension is built once per machine (about a minute) and reused by every test here.
"""
import pytest
import torch

from conftest import TINY, random_gptlite, randomized
from gptlite import GPTlite
from gptlite_gqa import GPTlite_GQA
from gptlite_kvcache import DynamicKVCache, StaticKVCache, generate_kvcache, kv_cache_view
import torch.nn.functional as F

from lib import fast_decode, harness
from lib import quantization as qz
from lib.errors import GPTliteError
from lib.speculative import ModelDrafter, plain_generate, speculative_generate

ATOL = 1e-4


def gqa_model(n_groups=1, **shape):
    return randomized(GPTlite_GQA(**dict(TINY, n_heads=4, n_groups=n_groups, **shape)))


MODELS = {
    "mha": lambda: random_gptlite(),
    "odd shapes": lambda: randomized(GPTlite(**dict(TINY, d_model=20, n_heads=3, d_head=7, d_ff=70))),
    "gqa 2 groups": lambda: gqa_model(n_groups=2),
    "mqa": lambda: gqa_model(n_groups=1, d_head=5),
    # int8 per channel (RTN): the reference dequantizes and runs F.linear (kernel=False), the kernel reads the codes
    "int8 mha": lambda: qz.quantize_model(random_gptlite(), method="rtn", bits=8, kernel=False),
    "int8 gqa": lambda: qz.quantize_model(gqa_model(n_groups=2), method="rtn", bits=8, kernel=False),
    "int4 g8 mha": lambda: qz.quantize_model(random_gptlite(), method="rtn", bits=4, group_size=8, kernel=False),
}


@pytest.fixture(scope="module", autouse=True)
def built():
    """The extension, built once for the module; the tests skip with the reason where it cannot be."""
    try:
        fast_decode.extension()
    except GPTliteError as error:
        pytest.skip(str(error))


def tokens(B, T, seed=1):
    return torch.randint(0, TINY["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", MODELS)
def test_prefill_and_steps_match_the_full_forward_pass(name):
    """Prefill of 5 tokens, then one token at a time to the end of the window: the logits of every
    position equal the full forward pass's over the whole sequence (a wrong mask, position, group or
    cache slot shows far above atol), and the cache holds the eager model's keys and values."""
    model = MODELS[name]()
    B, P, S = 3, 5, TINY["seqlen"]
    idx = tokens(B, S)
    with torch.no_grad():
        reference = model(idx)  # [B, S, V]: no cache, causal mask over the whole sequence
    reference = reference[0] if isinstance(reference, tuple) else reference  # the cached classes: (logits, cache)
    native, cache = fast_decode.native_view(model), StaticKVCache.for_model(model, B)
    logits = [native.forward_cache(idx[:, :P], cache)]
    logits += [native.forward_cache(idx[:, t:t + 1], cache) for t in range(P, S)]
    torch.testing.assert_close(torch.cat(logits, dim=1), reference, atol=ATOL, rtol=0)
    eager_cache = StaticKVCache.for_model(model, B)
    kv_cache_view(model).forward_cache(idx, eager_cache)
    torch.testing.assert_close(cache.keys, eager_cache.keys, atol=ATOL, rtol=0)
    torch.testing.assert_close(cache.values, eager_cache.values, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["mha", "gqa 2 groups"])
def test_past_the_window_matches_the_eager_sliding_cache(name):
    """A window of 6 slots, 7 prompt tokens after a prefill of 4 (3 fit, then one at a time, wrapped),
    then 6 steps: logits and hidden states as the eager cached pass on its own StaticKVCache."""
    model = MODELS[name]()
    eager, native = kv_cache_view(model), fast_decode.native_view(model)
    idx = tokens(2, 17, seed=3)
    caches = [StaticKVCache.for_model(model, 2, max_seqlen=6) for _ in range(2)]
    for chunk in (idx[:, :4], idx[:, 4:11], *idx[:, 11:].split(1, dim=1)):
        with torch.no_grad():
            expected = eager.forward_cache(chunk, caches[0])
        torch.testing.assert_close(native.forward_cache(chunk, caches[1]), expected, atol=ATOL, rtol=0)
    assert caches[0].n_tokens == caches[1].n_tokens == 17
    with torch.no_grad():
        expected = eager.hidden_states(idx[:, :3], caches[0])
    torch.testing.assert_close(native.hidden_states(idx[:, :3], caches[1]), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("seqlen", [TINY["seqlen"], 6])
def test_generate_fast_equals_generate_kvcache(name, seqlen):
    """The C++ token loop: the same greedy tokens as the eager one, within and past the window."""
    model = MODELS[name]()
    prompt = tokens(3, 4, seed=5)
    expected = generate_kvcache(kv_cache_view(model), prompt, 30, seqlen)
    assert torch.equal(fast_decode.generate_fast(model, prompt, 30, seqlen), expected)


def test_hidden_states_before_the_final_layer_norm():
    model = random_gptlite()
    idx = tokens(2, 9)
    with torch.no_grad():
        expected = kv_cache_view(model).hidden_states(idx, StaticKVCache.for_model(model, 2))
    native = fast_decode.native_view(model)
    torch.testing.assert_close(native.hidden_states(idx, StaticKVCache.for_model(model, 2)), expected,
                               atol=ATOL, rtol=0)


def test_speculative_decoding_on_the_fast_path_keeps_the_greedy_tokens():
    """Target and draft both on the C++ pass, rolled back by StaticKVCache.truncate: the tokens are the
    target's plain greedy ones (the draft, another model, is wrong often enough to roll back)."""
    target, draft = random_gptlite(seed=0), random_gptlite(seed=1)
    prompt = tokens(2, 3, seed=7)
    expected = plain_generate(target, prompt, 12)
    native_target = fast_decode.native_view(target)
    got, stats = speculative_generate(native_target, ModelDrafter(fast_decode.native_view(draft)), prompt, 12, 3)
    assert torch.equal(got, expected)
    assert stats.accepted < stats.judged  # rejections happened: the rollback was exercised
    assert torch.equal(plain_generate(native_target, prompt, 12), expected)


def test_a_new_view_computes_changed_weights():
    """native_view reads the weights when it is made (linear weights transposed): a new view, new weights."""
    model = random_gptlite()
    idx = tokens(1, 4)
    before = fast_decode.native_view(model).forward_cache(idx, StaticKVCache.for_model(model, 1))
    with torch.no_grad():
        model.fc_out.weight.mul_(2.0)
        model.fc_out.bias += 1.0
    after = fast_decode.native_view(model).forward_cache(idx, StaticKVCache.for_model(model, 1))
    with torch.no_grad():
        expected = model(idx)
    torch.testing.assert_close(after, expected, atol=ATOL, rtol=0)
    assert (after - before).abs().max() > 0.5


def test_unsupported_models_and_caches_are_refused():
    with pytest.raises(ValueError, match="float32 on the CPU"):
        fast_decode.native_view(random_gptlite().double())
    with pytest.raises(ValueError, match="float32 on the CPU"):
        fast_decode.generate_fast(random_gptlite().to(torch.bfloat16), tokens(1, 2), 3, 8)

    class Subclass(GPTlite):  # a subclass may change the math: refused, not computed wrongly
        pass
    with pytest.raises(ValueError, match="use its eager path"):
        fast_decode.native_view(Subclass(**TINY))
    native, model = fast_decode.native_view(random_gptlite()), random_gptlite()
    with pytest.raises(ValueError, match="StaticKVCache"):
        native.forward_cache(tokens(1, 2), DynamicKVCache([None] * TINY["n_layers"]))
    with pytest.raises(ValueError, match="seqlen"):
        fast_decode.generate_fast(model, tokens(1, 2), 3, TINY["seqlen"] + 1)


def test_blocks_of_different_shapes_are_refused():
    """The kernel reads the shapes of block 0: a model whose blocks differ is an error, not an overrun."""
    model = random_gptlite()
    model.blocks[1].ffwd = type(model.blocks[1].ffwd)(TINY["d_model"], 0.0, d_ff=40)
    with pytest.raises(ValueError, match="every block of one shape"):
        fast_decode.native_view(model)


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 9])  # every register tile (4, 3, 2, 1 rows) and mixes of them
@pytest.mark.parametrize("N", [32, 45])  # one full panel; a padded last panel
def test_linear_equals_f_linear_in_float32_and_int8(M, N):
    """The kernel of every linear layer: F.linear on the float weight, and on the dequantized int8 one
    (q * scale per output row, ATen's _weight_int8pack_mm as a second reference)."""
    g = torch.Generator().manual_seed(M * N)
    x, w, b = (torch.randn(*shape, generator=g) for shape in ((M, 70), (N, 70), (N,)))
    torch.testing.assert_close(fast_decode.linear(x, fast_decode.packed(w), None, b), F.linear(x, w, b), atol=ATOL, rtol=0)
    q, scale = qz.quantize_int8(w)
    y = fast_decode.linear(x, fast_decode.packed(q), scale, b)
    torch.testing.assert_close(y, F.linear(x, qz.dequantize(q, scale), b), atol=ATOL, rtol=0)
    torch.testing.assert_close(y, torch.ops.aten._weight_int8pack_mm(x, q, scale) + b, atol=ATOL, rtol=0)
    assert (y - F.linear(x, w, b)).abs().max() > 1e-3  # the int8 codes were read, not the float weight


@pytest.mark.parametrize("bits, dtype", [(8, torch.int8), (4, torch.uint8)])
def test_a_quantized_view_reads_the_codes(bits, dtype):
    model = qz.quantize_model(random_gptlite(), method="rtn", bits=bits, group_size=8, kernel=bits == 8)
    native = fast_decode.native_view(model)  # int8: ATen's kernel form holds the same codes
    codes = [t for t in native.weights if t.dtype == dtype]
    assert len(codes) == 6 * TINY["n_layers"] and all(s.numel() for s, t in zip(native.scales, native.weights)
                                                        if t.dtype == dtype)
    prompt = tokens(2, 4)
    assert torch.equal(fast_decode.generate_fast(native, prompt, 10, TINY["seqlen"]),
                       generate_kvcache(kv_cache_view(model), prompt, 10, TINY["seqlen"]))


@pytest.mark.parametrize("M", [1, 3, 5])
def test_linear_in_bfloat16_is_f_linear_on_the_rounded_weight(M):
    g = torch.Generator().manual_seed(M)
    x, w, b = (torch.randn(*shape, generator=g) for shape in ((M, 70), (45, 70), (45,)))
    y = fast_decode.linear(x, fast_decode.packed(w.bfloat16()), None, b)
    torch.testing.assert_close(y, F.linear(x, w.bfloat16().float(), b), atol=ATOL, rtol=0)
    assert (y - F.linear(x, w, b)).abs().max() > 1e-3  # the bfloat16 weight was read, not the float32 one


def test_a_bfloat16_view_is_the_float32_path_on_rounded_weights():
    """bfloat16 to float32 is exact, so the bfloat16 view computes the float32 kernel's sums on the rounded
    weights bit for bit, and the eager rounded model's logits within atol; its linear weights take half the bytes."""
    model = random_gptlite()
    bf16, rounded = fast_decode.native_view(model, torch.bfloat16), fast_decode.rounded_to(model, torch.bfloat16)
    idx = tokens(2, 9)
    got = bf16.forward_cache(idx, StaticKVCache.for_model(model, 2))
    assert torch.equal(got, fast_decode.native_view(rounded).forward_cache(idx, StaticKVCache.for_model(model, 2)))
    with torch.no_grad():
        torch.testing.assert_close(got, rounded(idx), atol=ATOL, rtol=0)  # GPTlite: logits [B, T, V]
        assert (got - model(idx)).abs().max() > 1e-4  # the rounding shows: the weights were rounded, not read as float32
    halves = [t for t in bf16.weights if t.dtype == torch.bfloat16]
    assert len(halves) == 6 * TINY["n_layers"]
    prompt = tokens(2, 4)
    assert torch.equal(fast_decode.generate_fast(bf16, prompt, 10, TINY["seqlen"]),
                       generate_kvcache(kv_cache_view(rounded), prompt, 10, TINY["seqlen"]))
    with pytest.raises(ValueError, match="stores float weights in"):
        fast_decode.native_view(model, torch.float16)


@pytest.mark.parametrize("n", [1, 63, 64 * 4096 * 3 + 17])  # a tail only; one step short; threads' shares and a tail
def test_read_sum_is_the_sum(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    assert fast_decode.read_sum(x) == pytest.approx(x.double().sum().item(), abs=1e-5 * n ** 0.5)


@pytest.mark.parametrize("M", [1, 2, 3, 5])  # int4 tiles: two rows, then one
@pytest.mark.parametrize("N, G", [(32, 8), (45, 32), (45, 64)])  # a padded last panel; one group per row
def test_linear_equals_f_linear_in_int4(M, N, G):
    """int4 per group (W = (q - 8) * scale + zero): F.linear on the dequantized weight."""
    g = torch.Generator().manual_seed(M * N + G)
    x, w, b = (torch.randn(*shape, generator=g) for shape in ((M, 64), (N, 64), (N,)))
    q, scale, zero = qz.quantize_int4(w, G)
    y = fast_decode.linear(x, *fast_decode.packed_int4(q, scale, zero), b)
    torch.testing.assert_close(y, F.linear(x, qz.dequantize(q, scale, zero, G), b), atol=ATOL, rtol=0)
    assert (y - F.linear(x, w, b)).abs().max() > 1e-2  # the 4-bit codes were read


def test_int4_groups_of_other_than_a_multiple_of_8_rows_are_refused():
    q, scale, zero = qz.quantize_int4(torch.randn(32, 64), 4)
    with pytest.raises(ValueError, match="multiple of 8"):
        fast_decode.packed_int4(q, scale, zero)


@pytest.mark.parametrize("kwargs, what", [(dict(method="rtn", bits=4, group_size=16), "of 4 bits"),  # ATen's packing
                                          (dict(method="w8a8", alpha=None), "W8A8Linear"),
                                          (dict(method="fp8"), "FP8Linear")])
def test_other_quantized_layers_are_refused(kwargs, what):
    calibration = tokens(2, TINY["seqlen"])
    model = randomized(GPTlite(**dict(TINY, n_heads=2, d_head=16)))  # widths of 32: ATen's int4 packing needs 16 | N
    model = qz.quantize_model(model, calibration=calibration, **kwargs)
    with pytest.raises(ValueError, match=what):
        fast_decode.native_view(model)


def test_an_awq_layer_is_refused():
    """AWQ divides its input by a scale first: the kernel does not, so such a layer is an error."""
    model = qz.quantize_model(random_gptlite(), method="rtn", bits=8)
    layer = model.blocks[0].mha.query_proj
    layer.input_scale = torch.ones(layer.in_features)
    with pytest.raises(ValueError, match="QuantLinear of 8 bits"):
        fast_decode.native_view(model)


def test_no_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(harness.shutil, "which", lambda name: None)
    with pytest.raises(GPTliteError, match="no C\\+\\+ compiler"):
        fast_decode.check_compiler()
    monkeypatch.setattr(harness.shutil, "which", lambda name: None if name == "ninja" else f"/usr/bin/{name}")
    with pytest.raises(GPTliteError, match="ninja"):
        fast_decode.check_compiler()


@pytest.mark.parametrize("name", ["mha", "gqa 2 groups"])
def test_generate_no_cache_equals_generate_within_and_past_the_window(name):
    """The baseline of a cache on the fast path: every step a fresh pass over the last seqlen tokens, as
    gptlite.generate (past the window both re-encode the last seqlen tokens from position 0)."""
    from gptlite import generate
    model = MODELS[name]()
    prompt = tokens(2, 5, seed=9)
    with torch.no_grad():
        expected = generate(model, prompt, 20, 8) if type(model) is GPTlite else None
    if expected is None:  # a GQA model: its full forward pass, window by window
        seq = prompt
        for _ in range(20):
            with torch.no_grad():
                logits = model(seq[:, -8:])[0]
            seq = torch.cat([seq, logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
        expected = seq
    assert torch.equal(fast_decode.generate_no_cache(model, prompt, 20, 8), expected)


# KIVI on the fast path: lib/fast_decode.cpp's KiviKV against the eager lib/quantization.KIVICache, the
# reference that dequantizes its blocks and runs the model's attention. Heads of 32 (the kernel's groups of
# 32 codes), blocks of 32 tokens; a prompt of 45 seals one block inside the prefill, 40 steps seal another.
KIVI_SHAPE = dict(d_model=64, n_heads=2, d_head=32, seqlen=128)


def kivi_model(n_groups=None):
    if n_groups:  # 4 query heads, 2 key/value heads
        return randomized(GPTlite_GQA(**dict(TINY, **KIVI_SHAPE) | dict(n_heads=4, d_model=128), n_groups=n_groups))
    return randomized(GPTlite(**dict(TINY, **KIVI_SHAPE)))


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("n_groups", [None, 2])
def test_kivi_on_the_fast_path_matches_the_eager_kivi_cache_step_by_step(bits, n_groups):
    model = kv_cache_view(kivi_model(n_groups))
    native, prompt = fast_decode.native_view(model), tokens(3, 45)
    eager_cache, fast_cache = qz.KIVICache(2, bits, 32), fast_decode.PackedKIVICache.for_model(model, 3, bits)
    float_cache = StaticKVCache.for_model(model, 3)
    with torch.inference_mode():
        want, got = model.forward_cache(prompt, eager_cache), native.forward_cache(prompt, fast_cache)
        unquantized = model.forward_cache(prompt, float_cache)
        assert (got - want).abs().max() < ATOL
        assert (unquantized - want).abs().max() > 100 * ATOL  # a block was quantized: the reference is not float32's
        token = want[:, -1:].argmax(dim=-1)
        for _ in range(40):
            want, got = model.forward_cache(token, eager_cache), native.forward_cache(token, fast_cache)
            assert (got - want).abs().max() < ATOL
            assert torch.equal(got[:, -1].argmax(dim=-1), want[:, -1].argmax(dim=-1))
            token = want[:, -1:].argmax(dim=-1)
    assert fast_cache.n_tokens == eager_cache.n_tokens == 85 and fast_cache.nbytes == eager_cache.nbytes


@pytest.mark.parametrize("bits", [4, 2])
def test_a_kivi_cache_relaid_for_the_fast_path_gives_its_logits_and_rolls_back_as_it_does(bits):
    model = kv_cache_view(kivi_model())
    native, eager_cache = fast_decode.native_view(model), qz.KIVICache(2, bits, 32)
    with torch.inference_mode():
        model.forward_cache(tokens(2, 70), eager_cache)  # two blocks quantized, 6 tokens of residual
        fast_cache = fast_decode.PackedKIVICache.from_kivi(eager_cache, 128)
        for n in (70, 66, 64, 32):  # into the residual, to block boundaries
            eager_cache.truncate(n)
            fast_cache.truncate(n)
            step = tokens(2, 1)
            assert (native.forward_cache(step, fast_cache) - model.forward_cache(step, eager_cache)).abs().max() < ATOL
            eager_cache.truncate(n)
            fast_cache.truncate(n)
            assert fast_cache.nbytes == eager_cache.nbytes
    with pytest.raises(ValueError, match="inside a block already quantized"):
        fast_cache.truncate(20)


def test_lanes_put_code_p_in_byte_p_mod_the_lanes():
    codes = torch.arange(32) % 16
    assert fast_decode.lanes(codes, 4).tolist() == [j | ((j + 16) % 16) << 4 for j in range(16)]
    codes = torch.arange(32) % 4
    assert fast_decode.lanes(codes, 2).tolist() == [sum((j + 8 * i) % 4 << 2 * i for i in range(4)) for j in range(8)]


def test_kivi_shapes_the_kernel_does_not_read_are_refused():
    model = kv_cache_view(kivi_model())
    with pytest.raises(ValueError, match="eager KIVICache"):
        fast_decode.PackedKIVICache.for_model(model, 1, 4, block=16)
    with pytest.raises(ValueError, match="eager KIVICache"):
        fast_decode.PackedKIVICache.for_model(kv_cache_view(random_gptlite()), 1, 4)  # d_head 8
    cache = fast_decode.PackedKIVICache.for_model(model, 1, 4, max_seqlen=256)
    with pytest.raises(ValueError, match="positions"):
        fast_decode.native_view(model).forward_cache(tokens(1, 129), cache)
