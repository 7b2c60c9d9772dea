"""GPTlite with a KV cache: keep every layer's keys and values so that each new token costs one
token's forward pass instead of re-encoding the whole window.

Blog section: "KV cache". Two caches with the same outputs:
- dynamic (the post's): a list of (keys, values) per layer, grown with torch.cat;
- static (gpt-fast's): `StaticKVCache`, buffers preallocated for the maximum length and written in
  place; past the maximum it is a rolling buffer (Mistral's): token t lives in slot t % max_seqlen.

Positions are absolute in GPTlite. Past `seqlen` the cache keeps the last `seqlen` entries and every
new token takes position seqlen-1, as the post describes; this is an approximation of re-encoding the
sliding window (the cached keys keep the positions and context they were computed with), so tokens
match generation without a cache only for the first `seqlen` positions.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from gptlite import Block, GPTlite, MultiHeadAttention, check_generation_args


def scaled_dot_product_attention_kv_cache(Q, K, V, causal_mask=True, dropout=None):
    """Attention of Tq new queries over Tk >= Tq keys, the last Tq of which are the new tokens.

    causal_mask=True: the shifted causal mask (query i sees every cached key and the new keys up to
    itself); a boolean tensor [Tq, Tk] (True = attend) is used as given; False: no mask."""
    # Q: [B, H, Tq, D], K and V: [B, H, Tk, D]
    Tq, Tk, d_head = Q.shape[-2], K.shape[-2], Q.shape[-1]
    scores = Q @ K.transpose(-2, -1) / d_head**0.5  # [B, H, Tq, Tk]
    if causal_mask is True and Tq == 1:
        causal_mask = False  # one new query sees every key: no mask to build (the common decode step)
    elif causal_mask is True:
        causal_mask = torch.ones(Tq, Tk, dtype=torch.bool, device=Q.device).tril(diagonal=Tk - Tq)
    if causal_mask is not False:
        scores = scores.masked_fill(~causal_mask, float("-inf"))
    weights = F.softmax(scores, dim=-1)  # [B, H, Tq, Tk]
    if dropout is not None:
        weights = dropout(weights)
    return weights @ V  # [B, H, Tq, D]


class StaticKVCache:
    """Per-layer key and value buffers [B, H, max_seqlen, D], preallocated and written in place."""

    def __init__(self, n_layers, batch_size, n_heads, d_head, max_seqlen, device=None, dtype=torch.float32):
        shape = (n_layers, batch_size, n_heads, max_seqlen, d_head)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)  # [L, B, H, max_seqlen, D]
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.max_seqlen = max_seqlen
        self.n_tokens = 0  # tokens written so far; token t is in slot t % max_seqlen
        self.layers = [(self.keys[i], self.values[i]) for i in range(n_layers)]  # views [B, H, L, D]

    @classmethod
    def for_model(cls, model, batch_size, max_seqlen=None):
        config, p = model.config, model.fc_out.weight
        return cls(config.n_layers, batch_size, cached_heads(model.blocks[0].mha), config.d_head,
                   max_seqlen or model.seqlen, device=p.device, dtype=p.dtype)

    def reset(self):
        """Start a new sequence; stale entries are never read (attention reads the written slots only)."""
        self.n_tokens = 0

    def __len__(self):  # entries held
        return min(self.n_tokens, self.max_seqlen)

    @property
    def nbytes(self):  # the whole preallocation, used or not
        return self.keys.nbytes + self.values.nbytes

    def update(self, layer, k, v):
        """Write the new keys and values [B, H, T, D] of `layer` in place, at the slots of tokens
        n_tokens .. n_tokens+T-1; return views of the slots written so far, [B, H, n, D].

        Before the buffer wraps, slot j holds token j, so the shifted causal mask applies as is; once
        it wraps, tokens come one at a time (see GPTlite_KVCache.forward) and see every slot."""
        T = k.shape[2]
        start = self.n_tokens % self.max_seqlen
        keys, values = self.layers[layer]
        keys.narrow(2, start, T).copy_(k)
        values.narrow(2, start, T).copy_(v)
        n = min(self.n_tokens + T, self.max_seqlen)
        return keys.narrow(2, 0, n), values.narrow(2, 0, n)


def cached_heads(mha):
    """Key/value heads an attention module caches: n_heads, or fewer where heads share them (GQA)."""
    return mha.key_proj.out_features // mha.d_head


def check_cache_shape(got, expected, got_dtype, dtype):
    if got != expected or got_dtype != dtype:
        raise ValueError(f"the KV cache was made for another model, batch or dtype (shape {got}, {got_dtype}; "
                         f"expected {expected}, {dtype}); make a new cache")


def kv_cache_length(kv_cache):
    """Entries held by a cache (None, a dynamic list of (keys, values), or a StaticKVCache)."""
    if kv_cache is None:
        return 0
    if isinstance(kv_cache, StaticKVCache):
        return len(kv_cache)
    return kv_cache[0][0].shape[2]


class MultiHeadAttention_KVCache(MultiHeadAttention):
    def forward(self, x, kv_cache=None, max_seqlen=None, layer=0):
        """x: [B, T, d_model] new tokens. kv_cache: this layer's (keys, values) [B, H, S, D], None, or
        the StaticKVCache whose buffers of `layer` are written in place.
        Returns the output [B, T, d_model] and this layer's keys and values after the update."""
        Q = self.split_heads(self.query_proj(x))  # [B, H, T, D]
        K = self.split_heads(self.key_proj(x))
        V = self.split_heads(self.value_proj(x))
        if isinstance(kv_cache, StaticKVCache):
            K, V = kv_cache.update(layer, K, V)  # [B, H, n, D], views of the preallocated buffers
        else:
            if kv_cache is not None:
                K = torch.cat([kv_cache[0], K], dim=2)  # [B, H, S+T, D]
                V = torch.cat([kv_cache[1], V], dim=2)
            if max_seqlen is not None and K.shape[2] > max_seqlen:  # a full window drops its oldest entry
                K, V = K[:, :, -max_seqlen:], V[:, :, -max_seqlen:]
        out = self.attention(Q, K, V)  # [B, H, T, D]
        return self.dropout(self.out_proj(self.merge_heads(out))), (K, V)

    def attention(self, Q, K, V):
        """The T new queries over the n keys and values (cached and new), the shifted causal mask;
        a subclass swaps the kernel here (main_flash_attention.py: SDPA)."""
        return scaled_dot_product_attention_kv_cache(Q, K, V, causal_mask=True, dropout=self.dropout)


def swap_attention(model, attention_class, **attrs):
    """Make every block's attention of a GPTlite_KVCache an `attention_class` (a subclass of
    MultiHeadAttention_KVCache that overrides `attention`), with `attrs` set, in place: weights, device
    and state dict stay. Every block is checked before any is changed. Returns model."""
    for block in model.blocks:
        if not isinstance(block.mha, MultiHeadAttention_KVCache):
            raise ValueError(f"{attention_class.__name__} needs a GPTlite_KVCache, got a {type(block.mha).__name__}")
    for block in model.blocks:
        block.mha.__class__ = attention_class
        for name, value in attrs.items():
            setattr(block.mha, name, value)
    return model


class Block_KVCache(Block):
    def __init__(self, d_model, n_heads, d_head, dropout_p, d_ff=None):
        super().__init__(d_model, n_heads, d_head, dropout_p, d_ff)
        self.mha = MultiHeadAttention_KVCache(d_model, n_heads, d_head, dropout_p)

    def forward(self, x, kv_cache=None, max_seqlen=None, layer=0):
        out, kv_cache = self.mha(self.ln1(x), kv_cache, max_seqlen, layer)
        x = x + out
        x = x + self.ffwd(self.ln2(x))
        return x, kv_cache


class GPTlite_KVCache(GPTlite):
    """GPTlite with the same parameters and state-dict keys, whose forward takes and returns a cache."""

    def __init__(self, vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, d_ff=None):
        super().__init__(vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, d_ff)
        self.blocks = nn.Sequential(*[Block_KVCache(d_model, n_heads, d_head, dropout_p, d_ff)
                                      for _ in range(n_layers)])
        self.apply(self._init_weights)

    def check_cache(self, kv_cache, batch_size, max_seqlen):
        """A cache made for another batch, model or dtype is a clear error, not a shape mismatch deep in torch."""
        L, D, dtype = self.config.n_layers, self.config.d_head, self.fc_out.weight.dtype
        heads = cached_heads(self.blocks[0].mha)
        if isinstance(kv_cache, StaticKVCache):
            expected = (L, batch_size, heads, max_seqlen, D)
            check_cache_shape(tuple(kv_cache.keys.shape), expected, kv_cache.keys.dtype, dtype)
        else:
            keys = kv_cache[0][0]
            got = (len(kv_cache), keys.shape[0], keys.shape[1], keys.shape[3])
            check_cache_shape(got, (L, batch_size, heads, D), keys.dtype, dtype)

    def forward(self, idx, kv_cache=None, max_seqlen=None):
        """idx: [B, T] new tokens after the `kv_cache` entries (None: an empty cache).

        kv_cache: a list of (keys, values) per layer, or a StaticKVCache (updated in place).
        max_seqlen: the most entries the cache keeps (default seqlen; a StaticKVCache's own size).
        Returns logits [B, T, vocab] and the new cache (the same StaticKVCache object if given)."""
        static = isinstance(kv_cache, StaticKVCache)
        if static:
            if max_seqlen not in (None, kv_cache.max_seqlen):
                raise ValueError(f"max_seqlen={max_seqlen} differs from the StaticKVCache's {kv_cache.max_seqlen}")
            max_seqlen = kv_cache.max_seqlen
        if max_seqlen is None:
            max_seqlen = self.seqlen
        if not 1 <= max_seqlen <= self.seqlen:
            raise ValueError(f"max_seqlen must be between 1 and seqlen={self.seqlen}, got {max_seqlen}")
        B, T = idx.shape
        if kv_cache is not None:
            self.check_cache(kv_cache, B, max_seqlen)
        n_cached = kv_cache_length(kv_cache)
        if T > 1 and n_cached + T > max_seqlen:
            # Past the window each token drops the oldest entry: fill the window, then go one at a time,
            # which is what decoding these tokens one by one would compute.
            n_fit = max_seqlen - n_cached
            chunks = ([idx[:, :n_fit]] if n_fit > 0 else []) + list(idx[:, max(n_fit, 0):].split(1, dim=1))
            logits = []
            for chunk in chunks:
                out, kv_cache = self(chunk, kv_cache, max_seqlen)
                logits.append(out)
            return torch.cat(logits, dim=1), kv_cache

        start = kv_cache.n_tokens if static else n_cached  # index of the first new token
        positions = torch.arange(start, start + T, device=idx.device).clamp(max=max_seqlen - 1)  # [T]
        x = self.token_embedding(idx) + self.position_embedding(positions)  # [B, T, d_model]
        new_cache = []
        for layer, block in enumerate(self.blocks):
            layer_cache = kv_cache if static or kv_cache is None else kv_cache[layer]
            x, layer_cache = block(x, layer_cache, max_seqlen, layer)
            new_cache.append(layer_cache)
        if static:
            kv_cache.n_tokens += T
            new_cache = kv_cache
        return self.fc_out(self.ln(x)), new_cache  # [B, T, vocab]


# ----------------------------------------------------------------------------------------------------
# Greedy generation with a cache, in gpt-fast's small named steps.

@torch.inference_mode()
def prefill(model, prompt, kv_cache, seqlen):
    """Encode the prompt [B, S] on top of `kv_cache`; return the first new token [B, 1] and the cache."""
    logits, kv_cache = model(prompt, kv_cache=kv_cache, max_seqlen=seqlen)
    return logits[:, -1].argmax(dim=-1, keepdim=True), kv_cache


@torch.inference_mode()
def decode_one_token(model, token, kv_cache, seqlen):
    """One step: the last token [B, 1] in, the next token [B, 1] out."""
    logits, kv_cache = model(token, kv_cache=kv_cache, max_seqlen=seqlen)
    return logits[:, -1].argmax(dim=-1, keepdim=True), kv_cache


@torch.inference_mode()
def decode_n_tokens(model, token, kv_cache, n_tokens, seqlen):
    tokens = []
    for _ in range(n_tokens):
        token, kv_cache = decode_one_token(model, token, kv_cache, seqlen)
        tokens.append(token)
    return tokens, kv_cache


@torch.inference_mode()
def generate_kvcache(model, prompt, n_tokens, seqlen, kv_cache=None):
    """Greedy decoding with a KV cache. prompt: [B, S] token ids after the `kv_cache` entries (None:
    start empty; a StaticKVCache is filled in place). Returns the prompt followed by the n_tokens new
    tokens, [B, S + n_tokens], as `generate` does (with a prefix cache: the request, then its tokens)."""
    check_generation_args(model, prompt, n_tokens, seqlen)
    token, kv_cache = prefill(model, prompt, kv_cache, seqlen)
    tokens, _ = decode_n_tokens(model, token, kv_cache, n_tokens - 1, seqlen)
    return torch.cat([prompt, token] + tokens, dim=1)
