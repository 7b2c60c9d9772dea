"""GPTlite with rotary position embeddings (RoPE): the same blocks, no learned position table; queries
and keys are rotated by their position in every layer.

    python gptlite_rope.py --preset cpu        # train checkpoints/cpu_rope.pt (same recipe as gptlite.py)

Blog section: "Sparse attention" (main_sparse_attention.py). GPTlite's positions are
absolute: a cached key carries the position it was computed at, so it cannot be moved. Here the cache
holds the keys *before* rotation and rotates them at attention time by their slot in the cache, so an
evicted entry lets the later ones move up a position: StreamingLLM's "positions within the cache".
The cache plugs in through gptlite_kvcache's interface: the post's list of (keys, values), or any
KVCache (kv_budget's budgets evict and select through it). Its checkpoints, and the start-token model
(the same model trained on documents after a start token, the condition for attention sinks), are
trained and loaded by lib/variant_checkpoints.py.
"""
import torch
import torch.nn as nn

from gptlite import GPTlite, generate
from gptlite_kvcache import Block_KVCache, DynamicKVCache, KVCache, MultiHeadAttention_KVCache, layer_cache


def rope_tables(n_positions, d_head, base=10000.0):
    """cos and sin of the rotation angles, [n_positions, d_head / 2] each (RoFormer's frequencies)."""
    inv_freq = 1.0 / base ** (torch.arange(0, d_head, 2, dtype=torch.float32) / d_head)  # [D/2]
    angles = torch.arange(n_positions, dtype=torch.float32)[:, None] * inv_freq  # [P, D/2]
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate the pairs (x_i, x_{i+D/2}) of x [B, H, T, D] by the angles of its T positions, cos/sin [T, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)  # GPT-NeoX's half split
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class MultiHeadAttention_RoPE(MultiHeadAttention_KVCache):
    def forward(self, x, kv_cache=None, rope=None, layer=0):
        """x: [B, T, d_model] new tokens after the n - T cached ones; kv_cache: the KVCache whose `layer` this
        is, or this layer's (keys, values) [B, H, S, D] or None; keys unrotated. Entry j of the cache
        takes position j. Returns the output and this layer's keys (unrotated) and values."""
        cache, layer = layer_cache(kv_cache, None, layer)
        Q = self.split_heads(self.query_proj(x))  # [B, H, T, D]
        K = self.split_heads(self.key_proj(x))
        V = self.split_heads(self.value_proj(x))
        K, V, mask = cache.update(layer, K, V)  # [B, H, n, D], unrotated
        cos, sin = rope
        T, n = Q.shape[2], K.shape[2]
        Qr = apply_rope(Q, cos[n - T:n], sin[n - T:n])  # the new tokens are the last T positions
        Kr = apply_rope(K, cos[:n], sin[:n])  # every key at its slot in the cache
        out = cache.attend(layer, self.attention, Qr, Kr, V, mask)
        return self.dropout(self.out_proj(self.merge_heads(out))), (K, V)


class Block_RoPE(Block_KVCache):
    """Block_KVCache with the rotary attention; its forward is Block_KVCache's, called as block(x, cache, rope,
    layer): the third argument reaches the attention as it is, here the rotary tables."""

    def __init__(self, d_model, n_heads, d_head, dropout_p, d_ff=None):
        super().__init__(d_model, n_heads, d_head, dropout_p, d_ff)
        self.mha = MultiHeadAttention_RoPE(d_model, n_heads, d_head, dropout_p)


class GPTlite_RoPE(GPTlite):
    """GPTlite's parameters without the position table; forward takes and returns a KV cache."""

    def __init__(self, vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, d_ff=None):
        super().__init__(vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, d_ff)
        del self.position_embedding  # positions enter by rotation only
        self.blocks = nn.Sequential(*[Block_RoPE(d_model, n_heads, d_head, dropout_p, d_ff) for _ in range(n_layers)])
        self.apply(self._init_weights)
        cos, sin = rope_tables(seqlen, d_head)
        self.register_buffer("rope_cos", cos, persistent=False)  # [seqlen, D/2], not in the state dict
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, idx, kv_cache=None, max_seqlen=None):
        """idx: [B, T] new tokens after the `kv_cache` entries: a list of (keys, values) per layer, keys
        unrotated (None: empty), which holds at most max_seqlen (default seqlen) entries; or a KVCache
        with its own rule (kv_budget's budgets evict). Returns logits [B, T, vocab] and the new cache
        (the same KVCache object if given one)."""
        if isinstance(kv_cache, KVCache):
            cache = kv_cache
        else:
            max_seqlen = self.seqlen if max_seqlen is None else max_seqlen
            if not 1 <= max_seqlen <= self.seqlen:
                raise ValueError(f"max_seqlen must be between 1 and seqlen={self.seqlen}, got {max_seqlen}")
            cache = DynamicKVCache(kv_cache, len(self.blocks), max_seqlen, evict=False)
        cache.check_new_tokens(idx.shape[1])
        x = self.token_embedding(idx)  # [B, T, d_model]
        rope = (self.rope_cos, self.rope_sin)
        for layer, block in enumerate(self.blocks):
            x, _ = block(x, cache, rope, layer)
        cache.advance(idx.shape[1])
        return self.fc_out(self.ln(x)), cache if isinstance(kv_cache, KVCache) else cache.layers  # [B, T, vocab]


if __name__ == "__main__":  # the command line is the CLI module's; the training, lib/variant_checkpoints.py's
    from lib import harness, variant_checkpoints
    harness.run(lambda: harness.training_cli("Train the rotary-position GPTlite and print a sample.",
                                             variant_checkpoints.train_rope,
                                             lambda m, p, n: generate(m, p, n, m.seqlen), 200))
