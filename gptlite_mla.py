"""GPTlite with multi-head latent attention (MLA, DeepSeek-V2): the cache holds one latent vector per token.

Blog section: "Smaller KV caches: MQA, GQA and MLA". The keys and values of every head are low-rank
functions of one latent vector per token, c = W_down x (d_latent values):

    K = W_uk c + b_k,    V = W_uv c + b_v        (W_uk, W_uv: [n_heads * d_head, d_latent])

Only c is cached: [B, 1, S, d_latent] per layer, against [B, H, S, D] twice for multi-head attention.
Two ways to attend, with the same result:
- absorb=False: recompute every cached token's keys and values from the latents at each step;
- absorb=True: move the queries into the latent space instead (q~ = W_uk,h^T q per head), attend over
  the latents themselves, and apply W_uv after the weighted sum. The keys and values are never formed.

A trained multi-head model becomes an MLA model by a truncated SVD of its stacked [W_k; W_v]
(`convert_mha_to_mla`); with the full rank min(2 * n_heads * d_head, d_model) it computes the same
function, with a smaller cache whenever d_model < 2 * n_heads * d_head.

`GPTlite_MLA` is a `GPTlite_KVCache`: forward(idx, kv_cache, max_seqlen) -> (logits, cache), so
`generate_kvcache` works with it. Its cache is a list of one-element tuples (latents,) per layer.
"""
import dataclasses

import torch
import torch.nn as nn

from gptlite import GPTliteConfig, MultiHeadAttention
from gptlite_gqa import grouped_query_attention
from gptlite_kvcache import (Block_KVCache, GPTlite_KVCache, KVCache, check_cache_shape, layer_cache,
                             scaled_dot_product_attention_kv_cache)


def max_latent(n_heads, d_head, d_model):
    """The rank of [W_k; W_v] is at most min(2 * n_heads * d_head, d_model): a larger latent holds nothing more."""
    return min(2 * n_heads * d_head, d_model)


def check_d_latent(n_heads, d_head, d_model, d_latent):
    full = max_latent(n_heads, d_head, d_model)
    if not isinstance(d_latent, int) or not 1 <= d_latent <= full:
        raise ValueError(f"d_latent must be an integer between 1 and the full rank min(2 * n_heads * d_head, "
                         f"d_model) = min(2 * {n_heads} * {d_head}, {d_model}) = {full}, got {d_latent!r}")


class MultiHeadAttention_MLA(MultiHeadAttention):
    def __init__(self, d_model, n_heads, d_head, dropout_p, d_latent, absorb=True):
        check_d_latent(n_heads, d_head, d_model, d_latent)
        super().__init__(d_model, n_heads, d_head, dropout_p)
        del self.key_proj, self.value_proj  # replaced by the low-rank factors below
        self.d_latent, self.absorb = d_latent, absorb
        self.kv_down = nn.Linear(d_model, d_latent, bias=False)  # x -> c, the only thing cached
        self.key_up = nn.Linear(d_latent, n_heads * d_head)  # c -> keys; its bias is the MHA key bias
        self.value_up = nn.Linear(d_latent, n_heads * d_head)  # c -> values; its bias is the MHA value bias

    def forward(self, x, kv_cache=None, max_seqlen=None, layer=0):
        """x: [B, T, d_model] new tokens; kv_cache: the model's DynamicKVCache of latents, or None or this
        layer's (latents,) [B, 1, S, d_latent] (with `max_seqlen` its window).
        Returns the output [B, T, d_model] and this layer's (latents,) after the update."""
        cache, layer = layer_cache(kv_cache, max_seqlen, layer)
        Q = self.split_heads(self.query_proj(x))  # [B, H, T, D]
        C = self.kv_down(x).unsqueeze(1)  # [B, 1, T, d_latent]: one latent per token, shared by every head
        C, = cache.append(layer, C)  # [B, 1, n, d_latent]: the cached latents and the new ones (a full window
        # drops its oldest)
        out = self.absorbed_attention(Q, C) if self.absorb else self.recomputed_attention(Q, C)  # [B, H, T, D]
        return self.dropout(self.out_proj(self.merge_heads(out))), (C,)

    def recomputed_attention(self, Q, C):
        """Recompute the keys and values [B, H, n, D] of every cached token from its latent."""
        K = self.split_heads(self.key_up(C[:, 0]))  # [B, H, n, D]
        V = self.split_heads(self.value_up(C[:, 0]))
        return scaled_dot_product_attention_kv_cache(Q, K, V, causal_mask=True, dropout=self.dropout)

    def absorbed_attention(self, Q, C):
        """Attend over the latents C [B, 1, n, L] with queries moved into the latent space."""
        H, D, L = self.n_heads, self.d_head, self.d_latent
        W_uk = self.key_up.weight.view(H, D, L)  # head h's keys are W_uk[h] @ c + b_k[h]
        W_uv = self.value_up.weight.view(H, D, L)
        # q . (W_uk c + b_k) = (W_uk^T q) . c + q . b_k; the second term is the same for every key of a
        # query, and softmax ignores a constant added to a row: the key bias drops out.
        Q_latent = torch.einsum("bhtd,hdl->bhtl", Q, W_uk)  # [B, H, T, L]
        # Every head attends over the same latents: multi-query attention in the latent space, with C as
        # both keys and values. The scores must be divided by sqrt(D); the attention divides by sqrt(L).
        out = grouped_query_attention(Q_latent * (L / D) ** 0.5, C, C, dropout=self.dropout)  # [B, H, T, L]
        # sum_j w_j (W_uv c_j + b_v) = W_uv (sum_j w_j c_j) + b_v, since the weights sum to 1 (without dropout:
        # train with absorb=False)
        return torch.einsum("bhtl,hdl->bhtd", out, W_uv) + self.value_up.bias.view(H, 1, D)  # [B, H, T, D]


class Block_MLA(Block_KVCache):
    """GPTlite's block with MLA: forward(x, cache) -> (x, (latents,)), as Block_KVCache's with (keys, values)."""

    def __init__(self, d_model, n_heads, d_head, dropout_p, d_latent, d_ff=None, absorb=True):
        super().__init__(d_model, n_heads, d_head, dropout_p, d_ff)
        self.mha = MultiHeadAttention_MLA(d_model, n_heads, d_head, dropout_p, d_latent, absorb)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLAConfig(GPTliteConfig):
    d_latent: int         # values of the one latent vector cached per token
    absorb: bool = True   # attend with absorbed projections (True) or recomputed keys and values


class GPTlite_MLA(GPTlite_KVCache):
    """GPTlite with a latent cache; state-dict keys as GPTlite's but for kv_down, key_up, value_up."""
    config_class = MLAConfig

    def __init__(self, vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, d_latent, d_ff=None,
                 absorb=True):
        check_d_latent(n_heads, d_head, d_model, d_latent)
        super().__init__(vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, d_ff)
        self.config = MLAConfig(vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, d_ff,
                                d_latent=d_latent, absorb=absorb)
        for block in self.blocks:
            block.mha = MultiHeadAttention_MLA(d_model, n_heads, d_head, dropout_p, d_latent, absorb)
        self.apply(self._init_weights)

    def set_absorb(self, absorb):
        """Attend with absorbed projections (True) or with recomputed keys and values (False); same weights."""
        for block in self.blocks:
            block.mha.absorb = absorb
        self.config = dataclasses.replace(self.config, absorb=absorb)
        return self

    def check_cache(self, kv_cache, batch_size, max_seqlen):
        if isinstance(kv_cache, KVCache):  # its layers store keys and values (or select by them)
            raise ValueError("GPTlite_MLA caches latents, not keys and values: give kv_cache=None (a new dynamic "
                             f"latent cache) or the cache a GPTlite_MLA returned, not a {type(kv_cache).__name__}")
        C = kv_cache[0][0]
        got = (len(kv_cache), len(kv_cache[0]), C.shape[0], C.shape[1], C.shape[3])
        expected = (self.config.n_layers, 1, batch_size, 1, self.config.d_latent)
        check_cache_shape(got, expected, C.dtype, self.fc_out.weight.dtype)


def convert_mha_to_mla(state_dict, n_heads, d_head, d_latent):
    """A GPTlite (or GPTlite_KVCache) state dict -> a GPTlite_MLA state dict with latents of d_latent values.

    Per block: [W_k; W_v] = U S V^T (SVD, in float64), truncated to the d_latent largest singular values:
    kv_down = sqrt(S) V^T, [key_up; value_up] = U sqrt(S), the best rank-d_latent approximation of the
    stacked projections. The key and value biases are kept exactly as the up-projections' biases."""
    converted = {}
    for name, tensor in state_dict.items():
        if name.endswith((".key_proj.bias", ".value_proj.weight", ".value_proj.bias")):
            continue  # handled with the key weight of the block
        if not name.endswith(".key_proj.weight"):
            converted[name] = tensor.clone()
            continue
        prefix = name[:-len("key_proj.weight")]
        W_k, W_v = tensor, state_dict[prefix + "value_proj.weight"]  # [H*D, d_model] each
        if W_k.shape[0] != n_heads * d_head or W_v.shape != W_k.shape:
            raise ValueError(f"{name} has {W_k.shape[0]} outputs, not n_heads * d_head = {n_heads} * {d_head}: "
                             "give the multi-head model's n_heads and d_head")
        check_d_latent(n_heads, d_head, W_k.shape[1], d_latent)
        U, S, Vh = torch.linalg.svd(torch.cat([W_k, W_v]).double(), full_matrices=False)  # [2HD, r], [r], [r, d_model]
        root = S[:d_latent].sqrt()
        up = U[:, :d_latent] * root  # [2HD, L]
        converted[prefix + "kv_down.weight"] = (root[:, None] * Vh[:d_latent]).to(W_k.dtype)  # [L, d_model]
        converted[prefix + "key_up.weight"] = up[:n_heads * d_head].to(W_k.dtype).contiguous()
        converted[prefix + "value_up.weight"] = up[n_heads * d_head:].to(W_k.dtype).contiguous()
        converted[prefix + "key_up.bias"] = state_dict[prefix + "key_proj.bias"].clone()
        converted[prefix + "value_up.bias"] = state_dict[prefix + "value_proj.bias"].clone()
    return converted


def mla_from_mha(mha_state, config, d_latent):
    """A GPTlite_MLA of `config` (GPTlite's keyword arguments) holding the multi-head weights `mha_state`
    converted to latents of d_latent values (on the CPU: move it where it runs)."""
    model = GPTlite_MLA(**config, d_latent=d_latent)
    model.load_state_dict(convert_mha_to_mla(mha_state, config["n_heads"], config["d_head"], d_latent))
    return model
