"""The KV cache (dynamic and static) against the model without a cache: logits and greedy tokens."""
import pytest
import torch
from conftest import TINY

from gptlite import generate, scaled_dot_product_attention
from gptlite_kvcache import (StaticKVCache, decode_one_token, generate_kvcache, kv_cache_length,
                             scaled_dot_product_attention_kv_cache)

ATOL = 1e-5  # float32
SEQLEN = TINY["seqlen"]


def new_cache(kind, model, batch_size):
    return None if kind == "dynamic" else StaticKVCache.for_model(model, batch_size)


def random_tokens(batch_size, length, seed=1):
    return torch.randint(TINY["vocab_size"], (batch_size, length), generator=torch.Generator().manual_seed(seed))


def test_same_parameters_and_state_dict_keys(tiny_models):
    base, cached = tiny_models
    assert list(base.state_dict()) == list(cached.state_dict())
    x = random_tokens(2, SEQLEN)
    logits, cache = cached(x)
    assert torch.allclose(logits, base(x), atol=1e-6)
    assert len(cache) == TINY["n_layers"] and cache[0][0].shape == (2, TINY["n_heads"], SEQLEN, TINY["d_head"])


def test_attention_with_cache_equals_reference_rows():
    torch.manual_seed(0)
    Q, K, V = (torch.randn(2, 3, 10, 8) for _ in range(3))
    full = scaled_dot_product_attention(Q, K, V)  # [2, 3, 10, 8]
    assert torch.allclose(scaled_dot_product_attention_kv_cache(Q, K, V), full, atol=ATOL)
    # the last 4 queries over all 10 keys: the shifted mask aligns them to the bottom-right corner
    tail = scaled_dot_product_attention_kv_cache(Q[:, :, -4:], K, V)
    assert torch.allclose(tail, full[:, :, -4:], atol=ATOL)
    # a top-left aligned mask (query i sees keys 0..i) would be wrong: make sure the test sees that
    wrong = scaled_dot_product_attention(Q[:, :, -4:], K[:, :, :4], V[:, :, :4])
    assert not torch.allclose(tail, wrong, atol=1e-3)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_prefill_then_one_token_steps_match_full_forward(tiny_models, kind):
    base, cached = tiny_models
    x = random_tokens(3, SEQLEN)
    full = base(x)  # [3, S, vocab]
    logits, cache = cached(x[:, :5], kv_cache=new_cache(kind, cached, 3))
    steps = [logits]
    for t in range(5, SEQLEN):
        logits, cache = cached(x[:, t:t + 1], kv_cache=cache)
        steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=ATOL, rtol=0)
    assert kv_cache_length(cache) == SEQLEN


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_several_tokens_on_top_of_a_cache_match_full_forward(tiny_models, kind):
    base, cached = tiny_models
    x = random_tokens(2, SEQLEN, seed=2)
    full = base(x)
    cache = new_cache(kind, cached, 2)
    chunks = []
    for start, stop in [(0, 4), (4, 9), (9, 16)]:  # a prefill, then chunks of 5 and 7 new tokens
        logits, cache = cached(x[:, start:stop], kv_cache=cache)
        chunks.append(logits)
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=ATOL, rtol=0)


def test_greedy_tokens_with_both_caches_equal_no_cache_up_to_seqlen(tiny_models):
    base, cached = tiny_models
    prompt = random_tokens(4, 5, seed=3)
    n_tokens = SEQLEN - 5 + 1  # the last token is predicted from a full window of seqlen tokens
    expected = generate(base, prompt, n_tokens, SEQLEN)
    dynamic = generate_kvcache(cached, prompt, n_tokens, SEQLEN)
    static = generate_kvcache(cached, prompt, n_tokens, SEQLEN, kv_cache=StaticKVCache.for_model(cached, 4))
    assert expected.shape == (4, 5 + n_tokens) and torch.equal(expected[:, :5], prompt)  # prompt, then new tokens
    assert torch.equal(dynamic, expected)
    assert torch.equal(static, expected)


def test_past_seqlen_generation_continues_and_the_cache_stays_bounded(tiny_models):
    base, cached = tiny_models
    prompt = random_tokens(2, 6, seed=4)
    n_tokens = 3 * SEQLEN
    dynamic = generate_kvcache(cached, prompt, n_tokens, SEQLEN)
    static_cache = StaticKVCache.for_model(cached, 2)
    static = generate_kvcache(cached, prompt, n_tokens, SEQLEN, kv_cache=static_cache)
    assert dynamic.shape == static.shape == (2, 6 + n_tokens)
    # the rolling static buffer computes exactly what the dynamic cache computes, past seqlen too
    assert torch.equal(dynamic, static)
    assert len(static_cache) == SEQLEN and static_cache.n_tokens == 6 + n_tokens - 1
    # within the window the tokens are those of generation without a cache
    fit = SEQLEN - 6 + 1
    assert torch.equal(dynamic[:, :6 + fit], generate(base, prompt, fit, SEQLEN))
    # step by step: the cache never holds more than seqlen entries
    token, cache = decode_one_token(cached, prompt, None, SEQLEN)
    for _ in range(2 * SEQLEN):
        token, cache = decode_one_token(cached, token, cache, SEQLEN)
        assert all(k.shape[2] <= SEQLEN and v.shape[2] <= SEQLEN for k, v in cache)
    assert kv_cache_length(cache) == SEQLEN


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_several_tokens_past_the_window_equal_one_at_a_time(tiny_models, kind):
    _, cached = tiny_models
    x = random_tokens(2, 10 + 12, seed=5)
    _, cache_a = cached(x[:, :10], kv_cache=new_cache(kind, cached, 2))
    _, cache_b = cached(x[:, :10], kv_cache=new_cache(kind, cached, 2))
    together, cache_a = cached(x[:, 10:], kv_cache=cache_a)  # 10 + 12 > seqlen: crosses the window
    one_by_one = []
    for t in range(10, 22):
        logits, cache_b = cached(x[:, t:t + 1], kv_cache=cache_b)
        one_by_one.append(logits)
    torch.testing.assert_close(together, torch.cat(one_by_one, dim=1), atol=ATOL, rtol=0)
    assert kv_cache_length(cache_a) == kv_cache_length(cache_b) == SEQLEN


def test_static_and_dynamic_logits_agree_past_the_window(tiny_models):
    _, cached = tiny_models
    x = random_tokens(1, 2 * SEQLEN + 3, seed=6)
    static_cache, dynamic_cache = StaticKVCache.for_model(cached, 1), None
    for t in range(x.shape[1]):
        ls, static_cache = cached(x[:, t:t + 1], kv_cache=static_cache)
        ld, dynamic_cache = cached(x[:, t:t + 1], kv_cache=dynamic_cache)
        torch.testing.assert_close(ls, ld, atol=ATOL, rtol=0)


def test_static_cache_is_written_in_place(tiny_models):
    _, cached = tiny_models
    cache = StaticKVCache.for_model(cached, 2)
    buffer = cache.keys.data_ptr()
    _, returned = cached(random_tokens(2, 7), kv_cache=cache)
    assert returned is cache and cache.keys.data_ptr() == buffer
    assert cache.keys[:, :, :, :7].abs().sum() > 0 and cache.keys[:, :, :, 7:].abs().sum() == 0


@pytest.mark.parametrize("fn", [generate, generate_kvcache])
def test_bad_generation_input_is_a_clear_error(tiny_models, fn):
    base, cached = tiny_models
    model = base if fn is generate else cached
    prompt = random_tokens(1, 4)
    with pytest.raises(ValueError, match="empty"):
        fn(model, prompt[:, :0], 5, SEQLEN)
    with pytest.raises(ValueError, match="n_tokens"):
        fn(model, prompt, 0, SEQLEN)
    with pytest.raises(ValueError, match="longer than the window"):
        fn(model, random_tokens(1, SEQLEN + 1), 5, SEQLEN)
    with pytest.raises(ValueError, match="seqlen"):
        fn(model, prompt, 5, SEQLEN + 1)
    with pytest.raises(ValueError, match="LongTensor"):
        fn(model, prompt[0], 5, SEQLEN)


def test_static_cache_of_another_batch_size_is_a_clear_error(tiny_models):
    _, cached = tiny_models
    with pytest.raises(ValueError, match="batch"):
        generate_kvcache(cached, random_tokens(3, 4), 2, SEQLEN, kv_cache=StaticKVCache.for_model(cached, 2))
    with pytest.raises(ValueError, match="max_seqlen"):
        generate_kvcache(cached, random_tokens(2, 4), 2, SEQLEN - 1, kv_cache=StaticKVCache.for_model(cached, 2))


def test_plain_model_rejects_inputs_longer_than_seqlen(tiny_models):
    base, _ = tiny_models
    with pytest.raises(ValueError, match="at most seqlen"):
        base(random_tokens(1, SEQLEN + 1))


def reference_window_decode(base, tokens, window):
    """The post's rule past the window, written out plainly, token by token: token t takes position
    min(t, window-1) and attends to the keys and values of the last `window` tokens, itself included."""
    keys, values = [[] for _ in base.blocks], [[] for _ in base.blocks]
    logits = []
    for t in range(tokens.shape[1]):
        position = torch.tensor([min(t, window - 1)])
        x = base.token_embedding(tokens[:, t:t + 1]) + base.position_embedding(position)  # [B, 1, d_model]
        for i, block in enumerate(base.blocks):
            mha, h = block.mha, block.ln1(x)
            keys[i].append(mha.split_heads(mha.key_proj(h)))
            values[i].append(mha.split_heads(mha.value_proj(h)))
            K, V = torch.cat(keys[i][-window:], dim=2), torch.cat(values[i][-window:], dim=2)  # [B, H, <=W, D]
            Q = mha.split_heads(mha.query_proj(h))
            weights = torch.softmax(Q @ K.transpose(-2, -1) / mha.d_head**0.5, dim=-1)
            x = x + mha.out_proj(mha.merge_heads(weights @ V))
            x = x + block.ffwd(block.ln2(x))
        logits.append(base.fc_out(base.ln(x)))
    return torch.cat(logits, dim=1)  # [B, T, vocab]


@pytest.mark.parametrize("kind", ["dynamic", "static"])
@pytest.mark.parametrize("window", [SEQLEN, 7])
def test_past_the_window_matches_the_posts_rule(tiny_models, kind, window):
    base, cached = tiny_models
    x = random_tokens(2, 3 * SEQLEN, seed=7)
    with torch.no_grad():
        expected = reference_window_decode(base, x, window)
        cache = None if kind == "dynamic" else StaticKVCache.for_model(cached, 2, max_seqlen=window)
        chunks = []
        for start, stop in [(0, 5), (5, 6), (6, 2 * SEQLEN), (2 * SEQLEN, 3 * SEQLEN)]:  # prefill, decode, chunks
            logits, cache = cached(x[:, start:stop], kv_cache=cache, max_seqlen=window)
            chunks.append(logits)
    torch.testing.assert_close(torch.cat(chunks, dim=1), expected, atol=ATOL, rtol=0)
    assert kv_cache_length(cache) == window


def test_token_ids_seqlen_and_caches_of_another_shape_are_clear_errors(tiny_models):
    _, cached = tiny_models
    prompt = random_tokens(2, 4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate_kvcache(cached, prompt + TINY["vocab_size"], 3, SEQLEN)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate_kvcache(cached, prompt - 100, 3, SEQLEN)
    with pytest.raises(ValueError, match="seqlen must be an integer"):
        generate_kvcache(cached, prompt, 3, 8.0)
    with pytest.raises(ValueError, match="max_seqlen must be between"):
        cached(prompt, max_seqlen=0)
    _, cache = cached(prompt)
    with pytest.raises(ValueError, match="another model, batch or dtype"):
        generate_kvcache(cached, random_tokens(3, 4), 3, SEQLEN, kv_cache=cache)  # batch 3 on a cache of 2
    other_heads = StaticKVCache(TINY["n_layers"], 2, TINY["n_heads"] + 1, TINY["d_head"], SEQLEN)
    with pytest.raises(ValueError, match="another model, batch or dtype"):
        generate_kvcache(cached, prompt, 3, SEQLEN, kv_cache=other_heads)
    float64 = StaticKVCache(TINY["n_layers"], 2, TINY["n_heads"], TINY["d_head"], SEQLEN, dtype=torch.float64)
    with pytest.raises(ValueError, match="another model, batch or dtype"):
        generate_kvcache(cached, prompt, 3, SEQLEN, kv_cache=float64)


def test_kv_cache_view_is_the_gptlites_cached_forward_pass_on_its_own_weights(tiny_models):
    from gptlite import Block
    from gptlite_kvcache import DynamicKVCache, kv_cache_view
    base, cached = tiny_models
    view = kv_cache_view(base)
    assert kv_cache_view(cached) is cached and kv_cache_view(view) is view
    assert all(p is q for p, q in zip(view.parameters(), base.parameters()))  # shared, not copied
    assert all(type(b) is Block for b in base.blocks)  # the GPTlite itself is unchanged
    x = random_tokens(2, SEQLEN, seed=8)
    logits, cache = view(x[:, :9])
    expected, expected_cache = cached(x[:, :9])
    assert torch.equal(logits, expected) and isinstance(cache, list)
    assert all(torch.equal(k, ek) for (k, _), (ek, _) in zip(cache, expected_cache))
    assert torch.equal(generate_kvcache(view, x[:, :4], 20, SEQLEN), generate_kvcache(cached, x[:, :4], 20, SEQLEN))
    with torch.no_grad():  # a later change to the GPTlite's weights is the view's too
        base.fc_out.bias.add_(1.0)
    assert torch.equal(view(x)[0], base(x))
    with pytest.raises(ValueError, match="needs a GPTlite or a GPTlite_KVCache"):
        kv_cache_view(torch.nn.Module())
    # the list given is never modified; an interface object given is returned, updated in place
    obj = DynamicKVCache(cache, max_seqlen=SEQLEN)
    _, returned = cached(x[:, 9:10], kv_cache=obj)
    assert returned is obj and len(obj) == 10 and cache[0][0].shape[2] == 9


# ----------------------------------------------------------------------------------------------------
# The one decode loop (gptlite.decode_loop) that every generation goes through.

def test_the_decode_loop_feeds_the_prompt_first_then_each_chosen_token():
    from gptlite import decode_loop
    seen = []

    def step(tokens):  # logits that make token t + 1 the argmax after token t
        seen.append(tokens.clone())
        return torch.nn.functional.one_hot(tokens[:, -1] + 1, 20).float()  # [B, vocab]
    prompt = torch.tensor([[3, 4], [7, 8]])
    new = decode_loop(step, prompt, 3)
    assert torch.equal(new, torch.tensor([[5, 6, 7], [9, 10, 11]]))
    assert torch.equal(seen[0], prompt) and [t.tolist() for t in seen[1:]] == [[[5], [9]], [[6], [10]]]
    assert decode_loop(step, prompt, 0).shape == (2, 0)
    assert torch.equal(decode_loop(step, prompt, 2, sample=lambda logits: logits.argmax(-1, keepdim=True) * 0),
                       torch.zeros(2, 2, dtype=torch.long))  # the sampler's choice is what is fed and returned


@pytest.mark.parametrize("n_tokens", [1, 5, SEQLEN + 6])  # past seqlen, the window slides
def test_generate_equals_an_explicit_loop_of_full_forward_passes(tiny_models, n_tokens):
    base, cached = tiny_models
    prompt = random_tokens(2, 5)
    tokens = prompt
    with torch.no_grad():
        for _ in range(n_tokens):  # the reference, written out: the whole window re-encoded, argmax
            tokens = torch.cat([tokens, base(tokens[:, -SEQLEN:])[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generate(base, prompt, n_tokens, SEQLEN), tokens)
    assert torch.equal(generate(cached, prompt, n_tokens, SEQLEN), tokens)  # a model returning (logits, cache)
