"""GPTlite with grouped-query attention (GQA): the heads share their keys and values in groups.

Blog section: "Smaller KV caches: MQA, GQA and MLA". The n_heads query heads are split into
n_groups groups of consecutive heads (head h is in group h // (n_heads // n_groups)); each group has
one key head and one value head. n_groups == n_heads is multi-head attention (MHA), n_groups == 1 is
multi-query attention (MQA). The KV cache stores the groups' keys and values only: n_groups / n_heads
of the multi-head cache.

A trained multi-head model becomes a GQA model by mean pooling the key and value heads of each group
(`convert_mha_to_gqa`, the GQA paper's recipe), followed by a short uptraining.

`GPTlite_GQA` is a `GPTlite_KVCache`: forward(idx, kv_cache, max_seqlen) -> (logits, cache), so
`generate_kvcache`, `prefill` and `decode_one_token` of gptlite_kvcache.py work with it as they are,
with a dynamic cache or with a `StaticKVCache` of n_groups heads (`StaticKVCache.for_model` reads the
number of cached heads off `key_proj`).
"""
import dataclasses

import torch
import torch.nn as nn

from gptlite import GPTliteConfig
from gptlite_kvcache import GPTlite_KVCache, MultiHeadAttention_KVCache, scaled_dot_product_attention_kv_cache


def group_counts(n_heads):
    """Every valid n_groups, MHA (n_heads) first, MQA (1) last."""
    return [g for g in range(n_heads, 0, -1) if n_heads % g == 0]


def variant_name(n_groups, n_heads):
    return "MHA" if n_groups == n_heads else "MQA" if n_groups == 1 else f"GQA-{n_groups}"


def check_n_groups(n_heads, n_groups):
    if not isinstance(n_groups, int) or not 1 <= n_groups <= n_heads or n_heads % n_groups:
        raise ValueError(f"n_groups must divide n_heads={n_heads} (every group has as many query heads), "
                         f"got {n_groups!r}; choose one of {sorted(group_counts(n_heads))}")


def grouped_query_attention(Q, K, V, dropout=None):
    """Queries [B, H, T, D] over keys and values [B, G, n, D] shared by groups of H/G consecutive heads,
    the last T of them the new tokens (the shifted causal mask). Returns [B, H, T, D].

    Each group's H/G heads are folded into its query rows, [B, G, H/G * T, D]: one batched matmul
    against the group's keys and values, which are read once and never copied (broadcasting them over
    the heads, or repeat_interleave, copies them: 3-9x slower for a decoding step on CPU)."""
    B, H, T, D = Q.shape
    G, n = K.shape[1], K.shape[2]
    mask = False  # one new token per head sees every key
    if T > 1:  # the shifted causal mask of T queries over n keys, once per head of the group
        mask = torch.ones(T, n, dtype=torch.bool, device=Q.device).tril(diagonal=n - T).repeat(H // G, 1)
    out = scaled_dot_product_attention_kv_cache(Q.reshape(B, G, H // G * T, D), K, V, causal_mask=mask,
                                                dropout=dropout)  # [B, G, H/G * T, D]
    return out.view(B, H, T, out.shape[-1])  # heads in their original order


class MultiHeadAttention_GQA(MultiHeadAttention_KVCache):
    def __init__(self, d_model, n_heads, d_head, dropout_p, n_groups):
        check_n_groups(n_heads, n_groups)
        super().__init__(d_model, n_heads, d_head, dropout_p)
        self.n_groups = n_groups
        # the same names as MultiHeadAttention's, with n_groups heads instead of n_heads
        self.key_proj = nn.Linear(d_model, n_groups * d_head)
        self.value_proj = nn.Linear(d_model, n_groups * d_head)

    def attention(self, Q, K, V):
        """K and V are the groups' [B, G, n, D]: what the cache of MultiHeadAttention_KVCache.forward holds
        here, since key_proj and value_proj have n_groups heads."""
        return grouped_query_attention(Q, K, V, dropout=self.dropout)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GQAConfig(GPTliteConfig):
    n_groups: int  # key/value heads per block: n_heads is MHA, 1 is MQA


class GPTlite_GQA(GPTlite_KVCache):
    """GPTlite with a KV cache and n_groups key/value heads per block; state-dict keys as GPTlite's."""
    config_class = GQAConfig

    def __init__(self, vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, n_groups, d_ff=None):
        check_n_groups(n_heads, n_groups)
        super().__init__(vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, d_ff)
        self.config = GQAConfig(vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, d_ff,
                                n_groups=n_groups)
        for block in self.blocks:
            block.mha = MultiHeadAttention_GQA(d_model, n_heads, d_head, dropout_p, n_groups)
        self.apply(self._init_weights)


KV_PROJ_NAMES = tuple(f".{proj}.{p}" for proj in ("key_proj", "value_proj") for p in ("weight", "bias"))


def convert_mha_to_gqa(state_dict, n_heads, d_head, n_groups):
    """A GPTlite (or GPTlite_KVCache) state dict -> a GPTlite_GQA state dict with n_groups key/value heads.

    The key (and value) heads of each group are replaced by their mean, weights and biases; every other
    tensor is copied. n_groups == n_heads returns the same weights."""
    check_n_groups(n_heads, n_groups)
    converted = {}
    for name, tensor in state_dict.items():
        if name.endswith(KV_PROJ_NAMES):
            if tensor.shape[0] != n_heads * d_head:
                raise ValueError(f"{name} has {tensor.shape[0]} outputs, not n_heads * d_head = {n_heads} * {d_head}: "
                                 "give the multi-head model's n_heads and d_head")
            # [H*D, ...] -> [G, H/G, D, ...]: consecutive heads form a group, as in MultiHeadAttention_GQA
            grouped = tensor.view(n_groups, n_heads // n_groups, d_head, *tensor.shape[1:])
            tensor = grouped.mean(dim=1).reshape(n_groups * d_head, *tensor.shape[1:])
        converted[name] = tensor.clone()
    return converted


def gqa_from_mha(mha_state, config, n_groups):
    """A GPTlite_GQA of `config` (GPTlite's keyword arguments) holding the multi-head weights `mha_state`
    converted to n_groups key/value heads (on the CPU: move it where it runs)."""
    model = GPTlite_GQA(**config, n_groups=n_groups)
    model.load_state_dict(convert_mha_to_gqa(mha_state, config["n_heads"], config["d_head"], n_groups))
    return model
