"""lib/memory_bound.py: decode steps over a filled cache against the full forward pass, each call from the same
context; the bytes a step reads counted from the model and the cache; the cache-size reader."""
import pytest
import torch
from conftest import TINY, randomized

from gptlite_gqa import GPTlite_GQA
from gptlite_kvcache import StaticKVCache
from lib import fast_decode, memory_bound

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
    step = memory_bound.decode_steps(model, cache, 6)
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
    eager = memory_bound.decode_steps(model, eager_cache, 10)(3)
    fast = memory_bound.decode_steps(fast_decode.native_view(model), fast_cache, 10)(3)
    torch.testing.assert_close(fast, eager, atol=1e-4, rtol=0)  # fast_decode's tolerance


def test_step_bytes_counts_weights_once_one_embedding_row_and_the_grouped_cache():
    model = GPTlite_GQA(**TINY, n_groups=1)
    d, L, D = TINY["d_model"], TINY["n_layers"], TINY["d_head"]
    weights, kv = memory_bound.step_bytes(model, 4, 10)
    assert kv == 4 * 10 * L * 2 * 1 * D * 4  # one key/value head
    per_block = (d * 3 * D + 3 * D) + (2 * d * D + 2 * D) + (3 * D * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d) + 4 * d
    head = 2 * d + d * TINY["vocab_size"] + TINY["vocab_size"]
    assert weights == 4 * (L * per_block + head) + 4 * 2 * d * 4  # float32; a token and a position row per sequence
    cache = memory_bound.filled_cache(model, 4, 10)
    assert kv == cache.keys[:, :, :, :10].nbytes + cache.values[:, :, :, :10].nbytes


def test_last_level_cache_is_the_largest_cache_or_none():
    llc = memory_bound.last_level_cache_bytes()
    assert llc is None or llc >= 2**20  # sysfs sizes of a server CPU: the last level is megabytes


def test_attention_flops_scale_with_the_attended_width():
    from gptlite_mla import GPTlite_MLA
    gqa, mla = GPTlite_GQA(**TINY, n_groups=1), GPTlite_MLA(**TINY, d_latent=16)
    per_head_token = 4 * TINY["n_layers"] * TINY["n_heads"]  # scores and weighted sum, 2 FLOPs per product
    assert memory_bound.attention_flops(gqa, 2, 10) == 2 * 10 * per_head_token * TINY["d_head"]  # heads, not groups
    assert memory_bound.attention_flops(mla, 2, 10) == 2 * 10 * per_head_token * 16  # absorbed: the latent's width
    assert memory_bound.step_bytes(mla, 2, 10)[1] == 2 * 10 * TINY["n_layers"] * 16 * 4  # only the latents cached
