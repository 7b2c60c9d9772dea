"""GPTlite with multi-token prediction (DeepSeek-V3's MTP, depth 1): besides the next token, an MTP module
predicts the token after it from [RMSNorm(h_t), RMSNorm(embedding(x_{t+1}))], one transformer block and the
model's own head. It is trained with the model (loss = next-token loss + weight x MTP loss, the gradient of
the MTP loss reaching the main model too); at inference the main model is a plain GPTlite and the MTP module
its speculative draft (main_speculative_decoding.py, part 2 of the post).

    python main_speculative_decoding.py          # trains checkpoints/cpu_mtp.pt from cpu.pt, once

The state dict is GPTlite's plus `mtp.*`; `main_model()` is the GPTlite alone, `mtp` the draft head.
"""
import torch
import torch.nn as nn

from gptlite import GPTlite
from gptlite_kvcache import Block_KVCache, StaticKVCache


class FeatureHead(nn.Module):
    """One block over fuse([h_t, embedding(x_{t+1})]) -> the state at t+1. normed: RMSNorm on both inputs
    first (DeepSeek-V3's MTP module), else EAGLE's plain concatenation."""

    def __init__(self, d_model, n_heads, d_head, normed=False):
        super().__init__()
        self.n_heads, self.d_head = n_heads, d_head
        self.norm_h = nn.RMSNorm(d_model) if normed else nn.Identity()
        self.norm_e = nn.RMSNorm(d_model) if normed else nn.Identity()
        self.fuse = nn.Linear(2 * d_model, d_model)
        self.block = Block_KVCache(d_model, n_heads, d_head, 0.0)

    def features(self, tokens, states, embedding):
        """tokens [B, T] (x_{t+1}), states [B, T, d] (h_t) -> the block's inputs [B, T, d]."""
        return self.fuse(torch.cat([self.norm_h(states), self.norm_e(embedding(tokens))], dim=-1))

    def forward(self, tokens, states, embedding):
        """Training: every position at once, causal. Returns the predicted states [B, T, d]."""
        return self.block(self.features(tokens, states, embedding))[0]

    def new_cache(self, batch_size, max_seqlen):
        p = self.fuse.weight
        return StaticKVCache(1, batch_size, self.n_heads, self.d_head, max_seqlen, device=p.device, dtype=p.dtype)

    def step(self, tokens, states, target, cache):
        """Drafting: feed T positions on top of `cache`; returns the predicted states [B, T, d]."""
        out, _ = self.block(self.features(tokens, states, target.token_embedding), cache, None, 0)
        cache.advance(tokens.shape[1])
        return out


class GPTlite_MTP(GPTlite):
    def __init__(self, vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, d_ff=None):
        super().__init__(vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, d_ff)
        self.mtp = FeatureHead(d_model, n_heads, d_head, normed=True)
        self.mtp.apply(self._init_weights)

    def hidden(self, idx):
        """The last block's states [B, S, d_model] (GPTlite.forward before its LayerNorm and head)."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.blocks(self.token_embedding(idx) + self.position_embedding(positions))

    def forward(self, idx):
        """The main model's logits [B, S, vocab]: the next token, as GPTlite's."""
        return self.fc_out(self.ln(self.hidden(idx)))

    def main_model(self):
        """The GPTlite alone (a new module with a copy of the main weights)."""
        model = GPTlite(**self.config.to_dict()).to(self.fc_out.weight.device)
        model.load_state_dict({k: v for k, v in self.state_dict().items() if not k.startswith("mtp.")})
        return model.eval()
