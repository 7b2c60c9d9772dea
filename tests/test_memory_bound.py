"""lib/memory_bound.py: decode steps over a filled cache against the full forward pass, each call from the same
context; the bytes a step reads counted from the model and the cache; the cache-size reader."""
import pytest
import torch
from conftest import TINY, randomized

from gptlite_gqa import GPTlite_GQA
from gptlite_kvcache import StaticKVCache
from lib import fast_decode, memory_bound, quantization as qz

ATOL = 1e-5  # float32, the same operations in another grouping


def full_forward_steps(model, prompt, n):
    """An independent reference: feed token 0 after the prompt, then n - 1 greedy tokens, each by a full
    forward pass of the whole sequence; the last position's logits."""
    seq = torch.cat([prompt, torch.zeros(prompt.shape[0], 1, dtype=torch.long)], dim=1)
    for _ in range(n - 1):
        logits = model(seq)[:, -1]
        seq = torch.cat([seq, logits.argmax(dim=-1, keepdim=True)], dim=1)
    return model(seq)[:, -1]


@pytest.mark.parametrize("n_groups", [3, 1])
@torch.inference_mode()
def test_decode_steps_from_a_prefilled_cache_match_the_full_forward_pass_every_call(n_groups):
    model = randomized(GPTlite_GQA(**TINY, n_groups=n_groups))
    prompt = torch.randint(TINY["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(1))
    cache = StaticKVCache.for_model(model, 2, 12)
    model.forward_cache(prompt, cache)  # the cache now holds the prompt's 6 entries
    step = memory_bound.decode_steps(model, cache, 6, 2)
    first = step(4)[:, -1]
    assert torch.equal(step(4)[:, -1], first)  # rolled back to the same 6 entries each call
    expected = full_forward_steps(lambda idx: model(idx)[0], prompt, 4)
    torch.testing.assert_close(first, expected, atol=ATOL, rtol=0)
    assert cache.n_tokens == 6 + 4


@torch.inference_mode()
def test_decode_steps_on_the_fast_path_give_the_eager_logits_on_a_random_cache():
    model = randomized(GPTlite_GQA(**TINY, n_groups=1))
    eager_cache = memory_bound.filled_cache(model, 3, 10, extra=4, seed=2)
    fast_cache = memory_bound.filled_cache(model, 3, 10, extra=4, seed=2)
    assert torch.equal(eager_cache.keys, fast_cache.keys) and eager_cache.n_tokens == 10
    assert eager_cache.keys[:, :, :, 10:].abs().sum() == 0 and eager_cache.keys[:, :, :, :10].abs().sum() > 0
    eager = memory_bound.decode_steps(model, eager_cache, 10, 3)(3)
    fast = memory_bound.decode_steps(fast_decode.native_view(model), fast_cache, 10, 3)(3)
    torch.testing.assert_close(fast, eager, atol=1e-4, rtol=0)  # fast_decode's tolerance


def test_weight_bytes_count_weights_once_and_one_embedding_row_per_sequence():
    model = GPTlite_GQA(**TINY, n_groups=1)
    d, L, D = TINY["d_model"], TINY["n_layers"], TINY["d_head"]
    per_block = (d * 3 * D + 3 * D) + (2 * d * D + 2 * D) + (3 * D * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d) + 4 * d
    head = 2 * d + d * TINY["vocab_size"] + TINY["vocab_size"]
    assert memory_bound.weight_bytes(model, 4) == 4 * (L * per_block + head) + 4 * 2 * d * 4  # float32; a token
    # and a position row per sequence


@pytest.mark.parametrize("kv_bits", [None, 4])
def test_cache_bytes_are_the_entries_of_the_context_held(kv_bits):
    model = GPTlite_GQA(**TINY | dict(seqlen=80), n_groups=1).eval()
    L, D = TINY["n_layers"], TINY["d_head"]
    cache = memory_bound.filled_cache(model, 4, 64, extra=8, kv_bits=kv_bits)
    memory_bound.decode_steps(model, cache, 64, 4)(3)  # 3 more tokens written, then rolled back
    float32 = 4 * 64 * L * 2 * D * 4
    if kv_bits is None:  # one key/value head, float32
        assert memory_bound.cache_bytes(cache, 64) == float32
    else:  # KIVI: 2 blocks of 32 quantized, 4 bits a value plus scales
        assert memory_bound.cache_bytes(cache, 64) == cache.nbytes < float32 / 3  # codes an eighth, scales at d_head 8
        assert len(cache.blocks[0]) == 2 and cache.residual[0][0].shape[2] == 0  # the 3 new tokens rolled back
    assert cache.n_tokens == 64


def test_a_kivi_caches_dequantized_copy_holds_what_its_attention_reads():
    torch.manual_seed(0)
    k, v = torch.randn(2, 3, 40, 8), torch.randn(2, 3, 40, 8)  # one block of 32 and 8 tokens of residual
    cache = qz.KIVICache(1, 4, block=32)
    cache.update(0, k, v)
    cache.n_tokens = 40
    copy = memory_bound.dequantized_copy(cache, extra=4)
    assert copy.max_seqlen == 44 and copy.n_tokens == 40
    keys, values = copy.layers[0][0][:, :, :40], copy.layers[0][1][:, :, :40]
    step = lambda x, dim: (x.amax(dim, keepdim=True) - x.amin(dim, keepdim=True)) / 15  # noqa: E731
    # the block: within half a 4-bit step of the entries (keys over the block's tokens, values over channels)
    assert ((keys[:, :, :32] - k[:, :, :32]).abs() <= step(k[:, :, :32], 2) / 2 + 1e-6).all()
    assert ((values[:, :, :32] - v[:, :, :32]).abs() <= step(v[:, :, :32], 3) / 2 + 1e-6).all()
    assert not torch.equal(keys[:, :, :32], k[:, :, :32])  # quantized, not a copy of the float entries
    assert torch.equal(keys[:, :, 32:], k[:, :, 32:]) and torch.equal(values[:, :, 32:], v[:, :, 32:])  # the residual


def test_last_level_cache_is_the_largest_cache_or_none():
    llc = memory_bound.last_level_cache_bytes()
    assert llc is None or llc >= 2**20  # sysfs sizes of a server CPU: the last level is megabytes


def test_attention_flops_scale_with_the_attended_width():
    from gptlite_mla import GPTlite_MLA
    gqa, mla = GPTlite_GQA(**TINY, n_groups=1), GPTlite_MLA(**TINY, d_latent=16)
    per_head_token = 4 * TINY["n_layers"] * TINY["n_heads"]  # scores and weighted sum, 2 FLOPs per product
    assert memory_bound.attention_flops(gqa, 2, 10) == 2 * 10 * per_head_token * TINY["d_head"]  # heads, not groups
    assert memory_bound.attention_flops(mla, 2, 10) == 2 * 10 * per_head_token * 16  # absorbed: the latent's width
    cache = memory_bound.filled_cache(mla, 2, 10)
    assert memory_bound.cache_bytes(cache, 10) == 2 * 10 * TINY["n_layers"] * 16 * 4  # only the latents cached
