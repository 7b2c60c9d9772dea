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
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptlite import Block, GPTlite, MultiHeadAttention, check_generation_args, decode_loop, greedy


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


# ----------------------------------------------------------------------------------------------------
# The cache interface: the one seam between a cache and the model's own attention (gpt-fast's
# KVCache.update, nano-vllm's attention context). Every cached forward pass in this repository runs
# through it (GPTlite_KVCache and its GQA/MLA/TP kin, GPTlite_RoPE); a cache is one KVCache object:
#
#   cache.check_new_tokens(T)        once, before any work: a cache that cannot take T more tokens raises
#   cache.positions(T, device)       absolute positions of the new tokens (GPTlite's position table)
#   in every layer's attention, with the new queries, keys and values [B, H, T, D]:
#     K, V, mask = cache.update(layer, k, v)   store them; return the keys and values to attend to and
#                                              the mask (None: the shifted causal mask, i.e. every key
#                                              for one new token)
#     (GPTlite_RoPE rotates the queries and keys here, by their slot in the cache)
#     out = cache.attend(layer, attention, q, K, V, mask)
#                                    by default the model's own kernel, attention(q, K, V[, mask]); a cache
#                                    that selects by the query (Quest, MoBA), learns from the weights (H2O,
#                                    SnapKV) or packs the queries of several sequences (paged) overrides it
#   cache.advance(T)                 after the last layer
#   cache.truncate(n)                keep the first n tokens' entries (speculative decoding rolls back the
#                                    rejected draft tokens; StaticKVCache by position, DynamicKVCache by slicing)
#
# The caches: DynamicKVCache (the post's list of (keys, values) per layer, wrapped for the layers),
# StaticKVCache, kv_budget.BudgetCache (window, sinks, H2O, SnapKV, Quest), paged_engine.PagedStep
# (block tables over the engine's pool), gptlite_moba.MoBACache (MoBA's block selection). Statistics are
# opt-in objects that a cache calls when given one (kv_budget.AttentionMass).

class KVCache:
    """The interface above, with the defaults: absolute positions from n_tokens, the model's kernel."""
    max_seqlen = None  # the most entries kept (None: no window)
    n_tokens = 0  # tokens fed so far

    def __len__(self):  # entries held per layer
        raise NotImplementedError

    def check_new_tokens(self, T):
        pass

    def positions(self, T, device):
        """Token t takes position t, and seqlen-1 past the window (the post's approximation)."""
        positions = torch.arange(self.n_tokens, self.n_tokens + T, device=device)  # [T]
        return positions if self.max_seqlen is None else positions.clamp(max=self.max_seqlen - 1)

    def update(self, layer, k, v):
        raise NotImplementedError

    def attend(self, layer, attention, q, K, V, mask):
        return attention(q, K, V) if mask is None else attention(q, K, V, mask)

    def advance(self, T):
        self.n_tokens += T

    def truncate(self, n):
        raise NotImplementedError(f"a {type(self).__name__} cannot roll back")

    def check_truncate(self, n):
        """A rollback keeps tokens 0 .. n-1, all still held: none past the window was dropped."""
        if not 0 <= n <= self.n_tokens:
            raise ValueError(f"cannot keep {n} tokens of a cache that was fed {self.n_tokens}")
        if self.max_seqlen is not None and self.n_tokens > self.max_seqlen:
            raise ValueError(f"the cache was fed {self.n_tokens} tokens, past its window of {self.max_seqlen}: "
                             "the entries of the oldest are gone, so it cannot roll back")


class DynamicKVCache(KVCache):
    """The post's dynamic cache seen through the interface: `layers` is its list of (keys, values) per
    layer (None: empty), grown with torch.cat. The list given is never modified (a shared prefix cache
    stays as it was); the new one is `layers`. max_seqlen: past it the oldest entry is dropped (None:
    no window), or with evict=False more entries are an error (GPTlite_RoPE without a budget)."""

    def __init__(self, layers=None, n_layers=None, max_seqlen=None, evict=True):
        self.layers = list(layers) if layers is not None else [None] * n_layers
        self.max_seqlen, self.evict = max_seqlen, evict
        self.n_tokens = len(self)

    def __len__(self):
        first = self.layers[0]
        return 0 if first is None else first[0].shape[2]

    def check_new_tokens(self, T):
        if not self.evict and len(self) + T > self.max_seqlen:
            raise ValueError(f"{len(self)} cached + {T} new tokens exceed seqlen={self.max_seqlen}: crop the "
                             "input, or evict cache entries first (kv_budget's window or sinks)")

    def append(self, layer, *new):
        """Append the new entries of `layer` (tensors [B, H, T, ...], e.g. keys and values, or MLA's
        latents) and return them all; a full window drops its oldest."""
        old = self.layers[layer]
        entries = new if old is None else tuple(torch.cat([o, n], dim=2) for o, n in zip(old, new))  # [B, H, S+T, .]
        if self.max_seqlen is not None and entries[0].shape[2] > self.max_seqlen:
            entries = tuple(e[:, :, -self.max_seqlen:] for e in entries)
        self.layers[layer] = entries
        return entries

    def update(self, layer, k, v):
        K, V = self.append(layer, k, v)
        return K, V, None

    def truncate(self, n):
        self.check_truncate(n)
        self.layers = [None if e is None else tuple(t[:, :, :n] for t in e) for e in self.layers]
        self.n_tokens = n


def layer_cache(kv_cache, max_seqlen, layer):
    """(cache, layer) for an attention module: a KVCache as given; one layer's own cache, (keys, values)
    or None (a block used alone, e.g. in gptlite_linear's hybrid), as a one-layer DynamicKVCache."""
    if isinstance(kv_cache, KVCache):
        return kv_cache, layer
    return DynamicKVCache([kv_cache], max_seqlen=max_seqlen), 0


class StaticKVCache(KVCache):
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

    def truncate(self, n):
        """Keep tokens 0 .. n-1: the next token is written at slot n, over a rolled-back one."""
        self.check_truncate(n)
        self.n_tokens = n

    def __len__(self):  # entries held
        return min(self.n_tokens, self.max_seqlen)

    @property
    def nbytes(self):  # the whole preallocation, used or not
        return self.keys.nbytes + self.values.nbytes

    def update(self, layer, k, v):
        """Write the new keys and values [B, H, T, D] of `layer` in place, at the slots of tokens
        n_tokens .. n_tokens+T-1; return views of the slots written so far, [B, H, n, D], and no mask.

        Before the buffer wraps, slot j holds token j, so the shifted causal mask applies as is; once
        it wraps, tokens come one at a time (see GPTlite_KVCache.forward) and see every slot."""
        T = k.shape[2]
        start = self.n_tokens % self.max_seqlen
        keys, values = self.layers[layer]
        keys.narrow(2, start, T).copy_(k)
        values.narrow(2, start, T).copy_(v)
        n = min(self.n_tokens + T, self.max_seqlen)
        return keys.narrow(2, 0, n), values.narrow(2, 0, n), None


def cached_heads(mha):
    """Key/value heads an attention module caches: n_heads, or fewer where heads share them (GQA)."""
    return mha.key_proj.out_features // mha.d_head


def check_cache_shape(got, expected, got_dtype, dtype):
    if got != expected or got_dtype != dtype:
        raise ValueError(f"the KV cache was made for another model, batch or dtype (shape {got}, {got_dtype}; "
                         f"expected {expected}, {dtype}); make a new cache")


def kv_cache_length(kv_cache):
    """Entries held by a cache (None, a dynamic list of (keys, values), or a KVCache)."""
    if kv_cache is None:
        return 0
    if isinstance(kv_cache, KVCache):
        return len(kv_cache)
    return kv_cache[0][0].shape[2]


class MultiHeadAttention_KVCache(MultiHeadAttention):
    def forward(self, x, kv_cache=None, max_seqlen=None, layer=0):
        """x: [B, T, d_model] new tokens. kv_cache: the KVCache whose `layer` this is (the model's
        forward passes one), or this layer's own (keys, values) [B, H, S, D] or None, with `max_seqlen`
        its window. Returns the output [B, T, d_model] and this layer's keys and values attended to."""
        cache, layer = layer_cache(kv_cache, max_seqlen, layer)
        Q = self.split_heads(self.query_proj(x))  # [B, H, T, D]
        K = self.split_heads(self.key_proj(x))
        V = self.split_heads(self.value_proj(x))
        K, V, mask = cache.update(layer, K, V)  # [B, H, n, D]: the cached entries and the new ones
        out = cache.attend(layer, self.attention, Q, K, V, mask)  # [B, H, T, D]
        return self.dropout(self.out_proj(self.merge_heads(out))), (K, V)

    def attention(self, Q, K, V, mask=None):
        """The T new queries over the n keys and values (cached and new), the shifted causal mask, or
        `mask` (bool, True = attend) when the cache gives one; a subclass swaps the kernel here
        (main_flash_attention.py: SDPA)."""
        return scaled_dot_product_attention_kv_cache(Q, K, V, causal_mask=True if mask is None else mask,
                                                     dropout=self.dropout)


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
        # max_seqlen goes to the attention as it is (a variant's block passes its own there: RoPE's tables)
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
        elif not isinstance(kv_cache, KVCache):
            keys = kv_cache[0][0]
            got = (len(kv_cache), keys.shape[0], keys.shape[1], keys.shape[3])
            check_cache_shape(got, (L, batch_size, heads, D), keys.dtype, dtype)

    def open_cache(self, kv_cache, max_seqlen, batch_size):
        """The KVCache the layers update: the post's list (or None) in a DynamicKVCache of `max_seqlen`
        (default seqlen), any KVCache as given (with its own window: max_seqlen must be None or the same)."""
        if isinstance(kv_cache, KVCache):
            if kv_cache.max_seqlen is not None and max_seqlen not in (None, kv_cache.max_seqlen):
                raise ValueError(f"max_seqlen={max_seqlen} differs from the {type(kv_cache).__name__}'s "
                                 f"{kv_cache.max_seqlen}")
            max_seqlen = kv_cache.max_seqlen
        elif max_seqlen is None:
            max_seqlen = self.seqlen
        if max_seqlen is not None and not 1 <= max_seqlen <= self.seqlen:
            raise ValueError(f"max_seqlen must be between 1 and seqlen={self.seqlen}, got {max_seqlen}")
        if kv_cache is not None:
            self.check_cache(kv_cache, batch_size, max_seqlen)
        return kv_cache if isinstance(kv_cache, KVCache) else DynamicKVCache(kv_cache, len(self.blocks), max_seqlen)

    def forward(self, idx, kv_cache=None, max_seqlen=None):
        """idx: [B, T] new tokens after the `kv_cache` entries (None: an empty cache).

        kv_cache: a list of (keys, values) per layer, or a KVCache (a StaticKVCache, a budget, ...: updated
        in place). max_seqlen: the most entries the cache keeps (default seqlen; a KVCache's own size).
        Returns logits [B, T, vocab] and the new cache (the same KVCache object if given one)."""
        cache = self.open_cache(kv_cache, max_seqlen, idx.shape[0])
        logits = self.forward_cache(idx, cache)
        return logits, cache if isinstance(kv_cache, KVCache) else cache.layers  # [B, T, vocab]

    def forward_cache(self, idx, cache):
        """The forward pass of idx [B, T] through the KVCache `cache` (updated in place): logits [B, T, vocab]."""
        return self.fc_out(self.ln(self.hidden_states(idx, cache)))  # [B, T, vocab]

    def hidden_states(self, idx, cache):
        """forward_cache without the head: the last block's outputs [B, T, d_model], before the final
        LayerNorm (what speculative decoding's Medusa, EAGLE and MTP heads read)."""
        T = idx.shape[1]
        cache.check_new_tokens(T)
        if T > 1 and cache.max_seqlen is not None and len(cache) + T > cache.max_seqlen:
            # Past the window each token drops the oldest entry: fill the window, then go one at a time,
            # which is what decoding these tokens one by one would compute.
            n_fit = cache.max_seqlen - len(cache)
            chunks = ([idx[:, :n_fit]] if n_fit > 0 else []) + list(idx[:, max(n_fit, 0):].split(1, dim=1))
            return torch.cat([self.hidden_states(chunk, cache) for chunk in chunks], dim=1)
        x = self.token_embedding(idx) + self.position_embedding(cache.positions(T, idx.device))  # [B, T, d_model]
        for layer, block in enumerate(self.blocks):
            x, _ = block(x, cache, None, layer)
        cache.advance(T)
        return x  # [B, T, d_model]


def kv_cache_view(model):
    """`model` with a cached forward pass: itself when its blocks take a cache (GPTlite_KVCache and its
    kin, GPTlite_RoPE); a GPTlite as a GPTlite_KVCache that shares its modules and weights, nothing copied
    (shallow copies of the model, its blocks and their attention modules, with the cached classes: these
    add no parameter). Callers that take any GPTlite (kv_budget, paged_engine) run through it."""
    if isinstance(model, GPTlite_KVCache) or (isinstance(model, GPTlite)
                                              and all(isinstance(block, Block_KVCache) for block in model.blocks)):
        return model
    if type(model) is not GPTlite or any(type(b) is not Block or type(b.mha) is not MultiHeadAttention
                                         for b in model.blocks):
        raise ValueError(f"a cached forward pass needs a GPTlite or a GPTlite_KVCache, got a {type(model).__name__}")

    def view(module, cls, **children):
        new = copy.copy(module)  # the same parameters, buffers and submodules ...
        new.__dict__["_modules"] = dict(module._modules, **children)  # ... in a module list of its own
        new.__class__ = cls
        return new
    blocks = [view(b, Block_KVCache, mha=view(b.mha, MultiHeadAttention_KVCache)) for b in model.blocks]
    return view(model, GPTlite_KVCache, blocks=nn.Sequential(*blocks))


# ----------------------------------------------------------------------------------------------------
# Greedy generation with a cache, in gpt-fast's small named steps.

@torch.inference_mode()
def prefill(model, prompt, kv_cache, seqlen):
    """Encode the prompt [B, S] on top of `kv_cache`; return the first new token [B, 1] and the cache."""
    logits, kv_cache = model(prompt, kv_cache=kv_cache, max_seqlen=seqlen)
    return greedy(logits[:, -1]), kv_cache


@torch.inference_mode()
def decode_one_token(model, token, kv_cache, seqlen):
    """One step: the last token [B, 1] in, the next token [B, 1] out."""
    logits, kv_cache = model(token, kv_cache=kv_cache, max_seqlen=seqlen)
    return greedy(logits[:, -1]), kv_cache


@torch.inference_mode()
def decode_n_tokens(model, token, kv_cache, n_tokens, seqlen):
    """n_tokens calls of decode_one_token through gptlite.decode_loop (the step chooses its token, greedy: the
    sampler passes it on): the new tokens (a list of [B, 1]) and the cache."""
    def step(token):
        nonlocal kv_cache
        token, kv_cache = decode_one_token(model, token, kv_cache, seqlen)
        return token
    tokens = decode_loop(step, token, n_tokens, sample=lambda token: token)
    return list(tokens.split(1, dim=1)), kv_cache


@torch.inference_mode()
def generate_kvcache(model, prompt, n_tokens, seqlen, kv_cache=None):
    """Greedy decoding with a KV cache. prompt: [B, S] token ids after the `kv_cache` entries (None:
    start empty; a StaticKVCache is filled in place). Returns the prompt followed by the n_tokens new
    tokens, [B, S + n_tokens], as `generate` does (with a prefix cache: the request, then its tokens)."""
    check_generation_args(model, prompt, n_tokens, seqlen)
    token, kv_cache = prefill(model, prompt, kv_cache, seqlen)
    tokens, _ = decode_n_tokens(model, token, kv_cache, n_tokens - 1, seqlen)
    return torch.cat([prompt, token] + tokens, dim=1)


def kv_cache_model(model):
    """A GPTlite_KVCache with the config and weights of the GPTlite `model`, on its device, in eval mode."""
    weight = model.fc_out.weight
    cached = GPTlite_KVCache.from_config(model.config).to(weight.device, weight.dtype)
    cached.load_state_dict(model.state_dict())
    return cached.eval()
