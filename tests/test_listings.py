"""The reader's contract: every listing of the post, called exactly as the post calls it, from the file the
post names, on a tiny random model, against a reference written here (the full forward pass, one token
at a time, an explicit softmax, the original model with heads and neurons masked)."""
import numpy as np
import pytest
import torch
from conftest import TINY

import inference_utils as iu
from lib import corpus, training

SEQLEN = TINY["seqlen"]  # 16
ATOL = 1e-5  # float32 logits of the tiny model, summed in another order


def tokens(*shape, seed=0):
    return torch.randint(TINY["vocab_size"], shape, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def one_token_at_a_time(model, prompt, n_tokens):
    """Greedy decoding by the full forward pass of the whole sequence at every step (no cache, no window:
    the tests stay within seqlen). prompt: 1-D. Returns the prompt followed by the new tokens, 1-D."""
    sequence = prompt
    for _ in range(n_tokens):
        logits = training.logits_of(model(sequence[None]))[0, -1]  # [vocab]
        sequence = torch.cat([sequence, logits.argmax()[None]])
    return sequence


def explicit_attention(Q, K, V):
    """softmax(Q K^T / sqrt(D) + causal mask) V, written out: Q, K, V [B, H, S, D]."""
    S, D = Q.shape[-2], Q.shape[-1]
    scores = torch.einsum("bhqd,bhkd->bhqk", Q, K) / np.sqrt(D)
    scores = scores + torch.full((S, S), float("-inf")).triu(1)  # key j > query i is masked
    weights = scores.exp() / scores.exp().sum(-1, keepdim=True)
    return torch.einsum("bhqk,bhkd->bhqd", weights, V)


# ----------------------------------------------------------------------------------------------------
# KV cache: main_kvcache.generate and generate_kvcache return the prompt followed by the new tokens.

def test_generate_and_generate_kvcache_return_the_whole_sequence(tiny_models):
    from main_kvcache import generate, generate_kvcache
    model, model_kv = tiny_models
    prompt = tokens(3, 5)
    out = generate(model, prompt, 8, SEQLEN)
    out_kv = generate_kvcache(model_kv, prompt, 8, SEQLEN)
    assert out.shape == out_kv.shape == (3, 5 + 8)
    assert torch.equal(out, out_kv)
    for row, p in zip(out, prompt):
        assert torch.equal(row, one_token_at_a_time(model, p, 8))


def test_generate_kvcache_with_a_prefix_cache_returns_the_request_then_its_tokens(tiny_models):
    from main_kvcache import generate_kvcache
    model, model_kv = tiny_models
    prefix, request = tokens(1, 6, seed=1), tokens(4, seed=2)
    _, prefix_cache = model_kv(prefix)
    out = generate_kvcache(model_kv, request[None], 5, SEQLEN, kv_cache=prefix_cache)
    assert out.shape == (1, 4 + 5) and torch.equal(out[0, :4], request)
    assert torch.equal(out[0], one_token_at_a_time(model, torch.cat([prefix[0], request]), 5)[6:])


# ----------------------------------------------------------------------------------------------------
# Prefix caching: the post's experiment, in main_prefix_cache.py.

def test_prefix_caching_as_the_post_calls_it(tiny_models):
    from main_prefix_cache import generate_kvcache
    model, model_kv = tiny_models
    prefix, n_tokens, seqlen = tokens(1, 7, seed=3), 4, SEQLEN
    requests = [tokens(3, seed=4), tokens(5, seed=5)]
    _, prefix_cache = model_kv(prefix)
    for request in requests:
        cached = generate_kvcache(model_kv, request[None], n_tokens, seqlen, kv_cache=prefix_cache)
        plain = generate_kvcache(model_kv, torch.cat([prefix, request[None]], dim=1), n_tokens, seqlen)
        assert torch.equal(cached, plain[:, prefix.shape[1]:])
        assert torch.equal(plain[0], one_token_at_a_time(model, torch.cat([prefix[0], request]), n_tokens))


# ----------------------------------------------------------------------------------------------------
# Batching: outputs[i] is request i's prompt followed by its n_tokens tokens.

@pytest.mark.parametrize("module", ["main_static_batching", "main_continuous_batching"])
def test_batching_returns_each_prompt_and_its_tokens_and_the_steps(tiny_models, module):
    import importlib
    batching = importlib.import_module(module)
    fn = batching.static_batching if module == "main_static_batching" else batching.continuous_batching
    model, _ = tiny_models
    requests = [(tokens(3, seed=6), 5), (tokens(7, seed=7), 2), (tokens(1, seed=8), 9)]
    outputs, n_steps = fn(model, requests, 2, SEQLEN)
    for (prompt, n_tokens), out in zip(requests, outputs):
        assert out.dim() == 1 and len(out) == len(prompt) + n_tokens
        assert torch.equal(out, one_token_at_a_time(model, prompt, n_tokens))
    # static: batches {0, 1} then {2} run 5 + 9 steps; continuous: request 2 joins when 1 leaves
    assert n_steps == (5 + 9 if module == "main_static_batching" else 2 + 9)


def test_next_tokens_as_the_post_calls_it(tiny_models):
    from main_static_batching import next_tokens
    model, _ = tiny_models
    sequences = [tokens(4, seed=9), tokens(9, seed=10)]
    expected = torch.stack([one_token_at_a_time(model, s, 1)[-1] for s in sequences])
    assert torch.equal(next_tokens(model, sequences, SEQLEN), expected)


# ----------------------------------------------------------------------------------------------------
# Semantic caching: the post's usage, with a tiny deterministic encoder.

def test_semantic_cache_as_the_post_calls_it():
    from main_semantic_cache import SemanticCache
    vectors = {"How do I sort a list?": [1.0, 0.0, 0.0], "How can I sort a list?": [0.96, 0.28, 0.0],
               "What is the capital of France?": [0.0, 0.0, 1.0]}
    embed = lambda text: np.asarray(vectors[text], dtype=np.float32)  # noqa: E731  (unit vectors)
    calls = []

    def generate_fn(query):
        calls.append(query)
        return f"answer to {query}"

    cache = SemanticCache(embed, threshold=0.85)
    answer, similarity, hit = cache("How do I sort a list?", generate_fn)
    assert (answer, hit) == ("answer to How do I sort a list?", False)
    answer, similarity, hit = cache("How can I sort a list?", generate_fn)  # cosine 0.96 >= 0.85: served
    assert hit and answer == "answer to How do I sort a list?"
    assert similarity == pytest.approx(float(np.dot(vectors["How do I sort a list?"], vectors["How can I sort a list?"])),
                                       abs=1e-6)
    answer, similarity, hit = cache("What is the capital of France?", generate_fn)  # cosine 0 < 0.85: a miss
    assert not hit and answer == "answer to What is the capital of France?"
    assert calls == ["How do I sort a list?", "What is the capital of France?"]


def test_sentence_transformer_embedder_is_importable_with_the_posts_signature():
    import inspect

    from main_semantic_cache import sentence_transformer_embedder
    assert "model_name" in inspect.signature(sentence_transformer_embedder).parameters


# ----------------------------------------------------------------------------------------------------
# FlashAttention: use_sdpa and MultiHeadAttention_SDPA.

def test_use_sdpa_gives_the_models_logits(tiny_models):
    import copy

    from main_flash_attention import MultiHeadAttention_SDPA, use_sdpa
    model, _ = tiny_models
    x = tokens(2, SEQLEN, seed=11)
    sdpa = use_sdpa(copy.deepcopy(model))
    assert all(isinstance(block.mha, MultiHeadAttention_SDPA) for block in sdpa.blocks)
    with torch.no_grad():
        torch.testing.assert_close(sdpa(x), model(x), atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------------------------------
# GQA and MLA: the post's conversions.

def test_convert_mha_to_gqa_as_the_post_calls_it(tiny_models):
    from gptlite_gqa import GPTlite_GQA, MultiHeadAttention_GQA
    from main_gqa import convert_mha_to_gqa
    model, _ = tiny_models
    n_heads, d_head = TINY["n_heads"], TINY["d_head"]
    gqa = GPTlite_GQA(**TINY, n_groups=1).eval()
    gqa.load_state_dict(convert_mha_to_gqa(model.state_dict(), n_heads, d_head, 1))  # MQA
    mha, mqa = model.blocks[0].mha, gqa.blocks[0].mha
    assert isinstance(mqa, MultiHeadAttention_GQA) and mqa.key_proj.out_features == d_head
    # the reference: multi-head attention whose key and value heads are each replaced by their mean
    x = torch.randn(2, 9, TINY["d_model"], generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        Q = mha.split_heads(mha.query_proj(x))  # [B, H, S, D]
        K = mha.split_heads(mha.key_proj(x)).mean(dim=1, keepdim=True).expand_as(Q)
        V = mha.split_heads(mha.value_proj(x)).mean(dim=1, keepdim=True).expand_as(Q)
        expected = mha.out_proj(mha.merge_heads(explicit_attention(Q, K, V)))
        torch.testing.assert_close(mqa(x)[0], expected, atol=ATOL, rtol=0)


def test_mla_as_the_post_calls_it(tiny_models):
    from gptlite_mla import GPTlite_MLA
    from main_mla import MultiHeadAttention_MLA, convert_mha_to_mla
    model, _ = tiny_models
    d_model, n_heads, d_head = TINY["d_model"], TINY["n_heads"], TINY["d_head"]
    layer = MultiHeadAttention_MLA(d_model, n_heads, d_head, 0.0, 8)
    assert layer.kv_down.out_features == 8
    full = min(2 * n_heads * d_head, d_model)  # full rank: the same function as multi-head attention
    mla = GPTlite_MLA(**TINY, d_latent=full).eval()
    mla.load_state_dict(convert_mha_to_mla(model.state_dict(), n_heads, d_head, full))
    x = tokens(2, SEQLEN, seed=13)
    with torch.no_grad():
        torch.testing.assert_close(mla(x)[0], model(x), atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------------------------------
# Smaller models: distillation_loss, compute_importance, prune, prune_linear.

def test_distillation_loss_as_the_post_calls_it():
    from main_distillation import distillation_loss
    g = torch.Generator().manual_seed(14)
    logits_student, logits_teacher, T = torch.randn(2, 5, 7, generator=g), torch.randn(2, 5, 7, generator=g), 2.0
    loss = distillation_loss(logits_student, logits_teacher, T)
    p_teacher = (logits_teacher / T).exp() / (logits_teacher / T).exp().sum(-1, keepdim=True)
    p_student = (logits_student / T).exp() / (logits_student / T).exp().sum(-1, keepdim=True)
    kl = (p_teacher * (p_teacher.log() - p_student.log())).sum(-1).mean()  # per position, averaged
    torch.testing.assert_close(loss, kl * T**2, atol=1e-6, rtol=0)


def test_compute_importance_and_prune_as_the_post_calls_them(tiny_models):
    import copy

    from main_pruning import compute_importance, prune, prune_linear
    model, _ = tiny_models
    vocab = "".join(chr(32 + i) for i in range(TINY["vocab_size"]))
    data = corpus.Data(vocab=vocab, train=tokens(2000, seed=15), val=tokens(500, seed=16))
    heads, neurons = compute_importance(model, data, 2, 4, SEQLEN)
    n_layers, d_ff = TINY["n_layers"], 4 * TINY["d_model"]
    assert isinstance(heads, list) and isinstance(neurons, list) and len(heads) == len(neurons) == n_layers
    assert all(h.shape == (TINY["n_heads"],) for h in heads) and all(n.shape == (d_ff,) for n in neurons)

    pruned = prune(copy.deepcopy(model), heads, neurons, 2, 40)
    assert pruned.blocks[0].mha.n_heads == 2 and pruned.blocks[0].ffwd.net[0].out_features == 40
    # the reference: the original model with every other head's output and neuron's activation zeroed
    keep_heads = [h.topk(2).indices for h in heads]
    keep_neurons = [n.topk(40).indices for n in neurons]
    handles = []
    for block, kh, kn in zip(model.blocks, keep_heads, keep_neurons):
        head_mask = torch.zeros(TINY["n_heads"], TINY["d_head"])
        head_mask[kh] = 1
        neuron_mask = torch.zeros(d_ff)
        neuron_mask[kn] = 1
        handles.append(block.mha.out_proj.register_forward_pre_hook(
            lambda m, args, mask=head_mask.flatten(): (args[0] * mask,)))
        handles.append(block.ffwd.net[1].register_forward_hook(lambda m, args, out, mask=neuron_mask: out * mask))
    x = tokens(2, SEQLEN, seed=17)
    with torch.no_grad():
        expected = model(x)
    for handle in handles:
        handle.remove()
    with torch.no_grad():
        torch.testing.assert_close(pruned(x), expected, atol=ATOL, rtol=0)

    linear = torch.nn.Linear(6, 4)
    small = prune_linear(linear, rows=torch.tensor([0, 3]), columns=torch.tensor([1, 2, 5]))
    assert torch.equal(small.weight, linear.weight[[0, 3]][:, [1, 2, 5]]) and torch.equal(small.bias, linear.bias[[0, 3]])
