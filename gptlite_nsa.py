"""NSA (Native Sparse Attention, Yuan et al. 2025, arXiv 2502.11089) for GPTlite.

The model (its conversion from a dense GPTlite, costs and decode kernel: lib/nsa.py).

Blog section: "Sparse attention". Every query attends through three branches, with the same Q, K, V
(GPTlite's projections), and mixes their outputs with learned gates:
- compressed: the keys and values are cut into blocks of `block_size` tokens and each block is pooled
  into one summary key and value (mean pooling: no parameters, so the dense checkpoint is a sensible
  start; the paper uses a small MLP with position encodings). A query attends to the summaries of the
  blocks that lie entirely in its past (itself included); one with no whole block yet gets zeros.
- selected: the query's compressed-attention scores rank the past blocks (selection blocks = compression
  blocks, l' = l = d in the paper's notation: no stride, no overlap); it reads the tokens of its top_n
  blocks, its own (partial) block and the first block always among them as in the paper (top_n = 1: its
  own block only), exact causal attention over them. The ranking is per head: GPTlite has one key head
  per query head, so NSA's sum over the heads of a GQA group is a sum over one head.
- window: exact attention over its last `window` tokens, itself included.
The output of head h is g_cmp * compressed + g_sel * selected + g_win * window with g = sigmoid(a linear
map of the query token's hidden state, 3 gates per head). The gates start at (0.018, 0.5, 0.5) (bias
-4, 0, 0, zero weights): the start is the mean of the selected and window branches, two exact
attentions over the most useful keys. `fix_gates((0, 1, 0))` replaces the gates by constants: at
top_n >= the number of blocks it is GPTlite itself. The selection has no gradient (as in the paper);
training adapts the queries, keys and gates to it.
"""
import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptlite import GPTlite, GPTliteConfig, MultiHeadAttention


GATE_BIAS = (-4.0, 0.0, 0.0)  # compressed, selected, window at the start of uptraining: sigmoid = 0.018, 0.5, 0.5


def check_nsa_args(block_size, top_n, window):
    """Clear errors for bad NSA settings, each naming its script flag."""
    for value, flag, what in ((block_size, "--nsa-block", "tokens per compression and selection block"),
                              (top_n, "--nsa-top-n", "blocks selected per query, its own and the first included"),
                              (window, "--nsa-window", "tokens of the sliding window, the query included")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag} must be a positive integer ({what}), got {value!r}")


def n_blocks(length, block_size):
    return math.ceil(length / block_size)


def compress(X, block_size):
    """Mean pooling of each whole block: [B, H, S, D] -> [B, H, S // block_size, D] (a partial last block has
    no summary yet: no query may read it)."""
    B, H, S, D = X.shape
    nc = S // block_size
    return X[:, :, :nc * block_size].reshape(B, H, nc, block_size, D).mean(dim=3)


def compressed_scores(Q, K, block_size):
    """Scaled scores of the Tq last queries against the summary keys, -inf for a block not entirely in the
    query's past: [B, H, Tq, n_compressed]."""
    Tq, Tk = Q.shape[-2], K.shape[-2]
    Kc = compress(K, block_size)  # [B, H, nc, D]
    scores = Q @ Kc.transpose(-2, -1) / Q.shape[-1] ** 0.5  # [B, H, Tq, nc]
    last = torch.arange(1, Kc.shape[-2] + 1, device=Q.device) * block_size - 1  # [nc]: each block's last token
    positions = torch.arange(Tk - Tq, Tk, device=Q.device)[:, None]  # [Tq, 1]
    return scores.masked_fill(last > positions, float("-inf"))


def compressed_attention(Q, K, V, block_size):
    """The compressed branch: softmax over the whole past blocks' summaries; zeros where there are none."""
    scores = compressed_scores(Q, K, block_size)  # [B, H, Tq, nc]
    if scores.shape[-1] == 0:
        return torch.zeros_like(Q)
    weights = torch.nan_to_num(F.softmax(scores, dim=-1), nan=0.0)  # a row of -inf only: no block, zeros
    return weights @ compress(V, block_size)  # [B, H, Tq, D]


def select_blocks(Q, K, block_size, top_n):
    """The selection blocks each query reads: [B, H, Tq, n_blocks] bool. Its own block first, then the first
    block, then the whole past blocks of highest compressed score (ties: the earlier block)."""
    Tq, Tk = Q.shape[-2], K.shape[-2]
    nb = n_blocks(Tk, block_size)
    scores = compressed_scores(Q, K, block_size)  # [B, H, Tq, nc]: nc = nb or nb - 1 (partial last block)
    rank = F.pad(scores, (0, nb - scores.shape[-1]), value=float("-inf"))  # [B, H, Tq, nb]
    own = (torch.arange(Tk - Tq, Tk, device=Q.device) // block_size)[:, None]  # [Tq, 1]
    blocks = torch.arange(nb, device=Q.device)  # [nb]
    rank = rank.masked_fill(blocks == 0, torch.finfo(rank.dtype).max)  # the first block: always (after its own)
    rank = rank.masked_fill(blocks == own, float("inf"))  # its own block: always, first
    rank = rank.masked_fill(blocks > own, float("-inf"))
    top = rank.topk(min(top_n, nb), dim=-1, sorted=False).indices  # [B, H, Tq, n]
    chosen = torch.zeros_like(rank, dtype=torch.bool).scatter_(-1, top, True)
    return chosen & (blocks <= own)  # a future block taken only because fewer than top_n exist: dropped


def selected_mask(chosen, block_size, Tk):
    """The selected blocks' tokens, causal: [B, H, Tq, n_blocks] -> [B, H, Tq, Tk] bool, True = attend."""
    Tq = chosen.shape[-2]
    keys = chosen.repeat_interleave(block_size, dim=-1)[..., :Tk]
    causal = torch.ones(Tq, Tk, dtype=torch.bool, device=chosen.device).tril(diagonal=Tk - Tq)
    return keys & causal


def window_mask(Tq, Tk, window, device=None):
    """Key s for the query at position t (the Tq last of Tk): t - window < s <= t. [Tq, Tk] bool."""
    t = torch.arange(Tk - Tq, Tk, device=device)[:, None]
    s = torch.arange(Tk, device=device)
    return (s <= t) & (s > t - window)


def masked_attention(Q, K, V, mask, dropout=None):
    """Exact softmax attention over the keys of `mask` (every row keeps at least the query itself)."""
    scores = (Q @ K.transpose(-2, -1) / Q.shape[-1] ** 0.5).masked_fill(~mask, float("-inf"))
    weights = F.softmax(scores, dim=-1)
    if dropout is not None:
        weights = dropout(weights)
    return weights @ V  # [B, H, Tq, D]


def selected_attention(Q, K, V, block_size, top_n, dropout=None):
    mask = selected_mask(select_blocks(Q, K, block_size, top_n), block_size, K.shape[-2])  # [B, H, Tq, Tk]
    return masked_attention(Q, K, V, mask, dropout)


def window_attention(Q, K, V, window, dropout=None):
    return masked_attention(Q, K, V, window_mask(Q.shape[-2], K.shape[-2], window, Q.device), dropout)


class MultiHeadAttention_NSA(MultiHeadAttention):
    """GPTlite's attention (its weights) as NSA's three branches, mixed per head by sigmoid gates of the
    hidden state (`gate_proj`, the only new parameters). `fixed_gates`: None, or three constants."""

    def __init__(self, d_model, n_heads, d_head, dropout_p, block_size, top_n, window):
        super().__init__(d_model, n_heads, d_head, dropout_p)
        self.block_size, self.top_n, self.window, self.fixed_gates = block_size, top_n, window, None
        self.gate_proj = nn.Linear(d_model, 3 * n_heads)

    def reset_gates(self):
        nn.init.zeros_(self.gate_proj.weight)
        with torch.no_grad():
            self.gate_proj.bias.copy_(torch.tensor(GATE_BIAS).repeat_interleave(self.n_heads))

    def gates(self, x):
        """[B, S, d_model] -> [3, B, H, S, 1]: compressed, selected, window."""
        B, S, _ = x.shape
        if self.fixed_gates is not None:
            return torch.tensor(self.fixed_gates, dtype=x.dtype, device=x.device).view(3, 1, 1, 1, 1)
        g = torch.sigmoid(self.gate_proj(x))  # [B, S, 3H]
        return g.view(B, S, 3, self.n_heads).permute(2, 0, 3, 1)[..., None]

    def forward(self, x):
        # x: [B, S, d_model]
        Q = self.split_heads(self.query_proj(x))  # [B, H, S, D]
        K = self.split_heads(self.key_proj(x))
        V = self.split_heads(self.value_proj(x))
        g_cmp, g_sel, g_win = self.gates(x)  # each [B, H, S, 1] (or a constant)
        out = g_sel * selected_attention(Q, K, V, self.block_size, self.top_n, self.dropout)
        if self.fixed_gates is None or self.fixed_gates[0] != 0:  # a constant 0 gate: the branch is not computed
            out = out + g_cmp * compressed_attention(Q, K, V, self.block_size)
        if self.fixed_gates is None or self.fixed_gates[2] != 0:
            out = out + g_win * window_attention(Q, K, V, self.window, self.dropout)
        return self.dropout(self.out_proj(self.merge_heads(out)))  # [B, S, d_model]


@dataclasses.dataclass(frozen=True, kw_only=True)
class NSAConfig(GPTliteConfig):
    block_size: int  # tokens per compression and selection block
    top_n: int       # selection blocks per query, its own and the first included
    window: int      # sliding-window tokens, the query included


class GPTlite_NSA(GPTlite):
    """GPTlite whose every block attends with NSA; GPTlite's state dict plus each block's gate_proj."""
    config_class = NSAConfig

    def __init__(self, vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, block_size, top_n, window,
                 d_ff=None):
        check_nsa_args(block_size, top_n, window)
        super().__init__(vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, d_ff)
        for block in self.blocks:
            block.mha = MultiHeadAttention_NSA(d_model, n_heads, d_head, dropout_p, block_size, top_n, window)
        self.apply(self._init_weights)
        for block in self.blocks:
            block.mha.reset_gates()
        self.config = NSAConfig(vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, d_ff,
                                block_size=block_size, top_n=top_n, window=window)

    def fix_gates(self, gates):
        """Replace the learned gates by the constants (compressed, selected, window); None: learned again."""
        for block in self.blocks:
            block.mha.fixed_gates = None if gates is None else tuple(float(g) for g in gates)
        return self
