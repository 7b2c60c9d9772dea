"""GPTlite with rotary position embeddings (RoPE): the same blocks, no learned position table; queries
and keys are rotated by their position in every layer.

    python gptlite_rope.py --preset cpu        # train checkpoints/cpu_rope.pt (same recipe as gptlite.py)

Blog section: "Attention sinks and streaming" (main_sparse_attention.py). GPTlite's positions are
absolute: a cached key carries the position it was computed at, so it cannot be moved. Here the cache
holds the keys *before* rotation and rotates them at attention time by their slot in the cache, so an
evicted entry lets the later ones move up a position: StreamingLLM's "positions within the cache".
The cache plugs in through gptlite_kvcache's interface: the post's list of (keys, values), or any
KVCache (kv_budget's budgets evict and select through it).
"""
import torch
import torch.nn as nn

from gptlite import GPTlite
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
    def __init__(self, d_model, n_heads, d_head, dropout_p, d_ff=None):
        super().__init__(d_model, n_heads, d_head, dropout_p, d_ff)
        self.mha = MultiHeadAttention_RoPE(d_model, n_heads, d_head, dropout_p)

    def forward(self, x, kv_cache=None, rope=None, layer=0):
        out, kv_cache = self.mha(self.ln1(x), kv_cache, rope, layer)
        x = x + out
        x = x + self.ffwd(self.ln2(x))
        return x, kv_cache


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


def rope_checkpoint(preset):
    import inference_utils as iu
    return iu.checkpoint_path(f"{iu.get_preset(preset).name}_rope")


def rebuild_command(preset):
    return f"python gptlite_rope.py --preset {preset.name}"


def train_rope(preset, data, device, iters=None, seed=0, path=None):
    """Train GPTlite_RoPE with gptlite.py's recipe (steps, batch, learning rate, seed); save it atomically."""
    import inference_utils as iu
    iters = iters or preset.iters
    torch.manual_seed(seed)
    model = GPTlite_RoPE(**preset.model_config()).to(device)
    print(f"training the rotary GPTlite ({iu.n_params(model) / 1e6:.2f}M parameters) for {iters} steps on {device}")
    history = iu.train_steps(model, data, iters, preset.batch_size, preset.seqlen, preset.lr, seed=seed,
                             desc=f"training {preset.name}_rope")
    path = path or rope_checkpoint(preset)
    iu.save_checkpoint(path, model, preset.model_config(), data.vocab, rebuild=rebuild_command(preset),
                       preset=preset.name, iters=iters, seed=seed, val_loss=history[-1]["val_loss"])
    print(f"saved {path} (validation loss {history[-1]['val_loss']:.4f})")
    return model.eval()


def load_rope(preset, device, data, untrained=False, seed=0):
    """The rotary GPTlite of checkpoints/<preset>_rope.pt, trained first when missing (random with untrained)."""
    import inference_utils as iu
    if untrained:
        torch.manual_seed(seed)
        return GPTlite_RoPE(**preset.model_config()).to(device).eval()
    path = rope_checkpoint(preset)
    if not path.exists():
        print(f"no checkpoint at {path}: training the rotary GPTlite first (once)")
        return train_rope(preset, data, device, seed=seed)
    ckpt = iu.load_checkpoint(path, config=preset.model_config(), vocab=data.vocab, rebuild=rebuild_command(preset))
    model = GPTlite_RoPE(**ckpt["config"])
    model.load_state_dict(ckpt["state_dict"])
    return model.to(device).eval()


def main():
    import argparse
    import inference_utils as iu

    parser = argparse.ArgumentParser(description="Train the rotary-position GPTlite and print a sample.")
    iu.add_model_args(parser)
    parser.add_argument("--iters", type=iu.int_at_least(1), default=None, help="training steps (default: the preset's)")
    parser.add_argument("--sample-tokens", type=iu.int_at_least(1), default=200, help="length of the printed sample")
    args = parser.parse_args()
    preset, device, data = iu.setup(args, parser)
    model = train_rope(preset, data, device, iters=args.iters, seed=args.seed)
    tokens = torch.tensor([data.encode("\n")], device=device)
    with torch.inference_mode():
        for _ in range(args.sample_tokens):  # greedy, re-encoding the last seqlen tokens
            logits, _ = model(tokens[:, -model.seqlen:])
            tokens = torch.cat([tokens, logits[:, -1:].argmax(dim=-1)], dim=1)
    print(data.decode(tokens[0, 1:].tolist()))


if __name__ == "__main__":
    import inference_utils
    inference_utils.run(main)
