"""MoBA (Mixture of Block Attention, Lu et al. 2025, arXiv 2502.13189) for GPTlite.

    from gptlite_moba import GPTlite_MoBA
    model = GPTlite_MoBA(**gptlite.config.to_dict(), block_size=16, top_k=2)  # loads gptlite's state dict

Blog section: "Sparse attention". The keys are split into blocks of `block_size` tokens.
Every query scores each past block by its dot product with the block's mean key (a router with no
parameters of its own) and attends to its `top_k` best blocks, its own block always among them and
causal within it, as in the paper and its reference code: top_k = 1 is attention within the block
only, and top_k = the number of blocks is exactly dense causal attention. The selection itself has no
gradient; training adapts the keys and queries to it through the attention of the selected blocks.

Two ways to compute it with the same selection: an explicit boolean mask over the [S, S] scores (any
device, and the training path on CPU), and FlexAttention with a block mask built from a `mask_mod` that
reads the selection (compiled where the device runs it; lib/moba.make_flex_check checks it). With a KV cache, the
selection is a cache of gptlite_kvcache's interface (`MoBACache`): the model's own cached forward pass
then computes MoBA for a prompt and for each decoded token alike.
"""
import dataclasses
import math
import warnings

import torch
import torch.nn.functional as F

from gptlite import GPTlite, GPTliteConfig, MultiHeadAttention
from gptlite_kvcache import DynamicKVCache


def check_moba_args(block_size, top_k, seqlen=None):
    """Clear errors for bad MoBA settings, before any work: both positive integers, and a block that
    fits the window (a block of seqlen or more tokens leaves nothing to choose)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer (tokens per key block), got {block_size!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be an integer of at least 1 (blocks read per query, its own block "
                         f"included), got {top_k!r}")
    if seqlen is not None and block_size >= seqlen:
        raise ValueError(f"block_size={block_size} does not fit the window of seqlen={seqlen} tokens in more than "
                         f"one block; choose a block size below {seqlen}, e.g. {max(seqlen // 8, 1)}")


def n_blocks(length, block_size):
    return math.ceil(length / block_size)


def block_mean_keys(K, block_size):
    """The mean key of each block (the last one may be partial): [B, H, S, D] -> [B, H, n_blocks, D]."""
    B, H, S, D = K.shape
    nb = n_blocks(S, block_size)
    padded = F.pad(K, (0, 0, 0, nb * block_size - S))  # zero keys after the end add nothing to the sums
    sums = padded.view(B, H, nb, block_size, D).sum(dim=3)  # [B, H, nb, D]
    counts = (S - torch.arange(nb, device=K.device) * block_size).clamp(max=block_size)  # [nb]
    return sums / counts[:, None].to(K.dtype)


def select_blocks(Q, K, block_size, top_k):
    """The blocks each query reads: [B, H, Tq, n_blocks] bool. The Tq queries are the last Tq of the Tk
    keys' tokens (Tq = Tk for a whole sequence, Tq = 1 for a decoding step)."""
    # Q: [B, H, Tq, D], K: [B, H, Tk, D]
    Tq, Tk = Q.shape[-2], K.shape[-2]
    gate = Q @ block_mean_keys(K, block_size).transpose(-2, -1)  # [B, H, Tq, nb]: query . mean key
    own = (torch.arange(Tk - Tq, Tk, device=Q.device) // block_size)[:, None]  # [Tq, 1]: each query's block
    blocks = torch.arange(gate.shape[-1], device=Q.device)  # [nb]
    gate = gate.masked_fill(blocks > own, float("-inf"))  # future blocks: never
    gate = gate.masked_fill(blocks == own, float("inf"))  # its own block: always
    top = gate.topk(min(top_k, gate.shape[-1]), dim=-1).indices  # [B, H, Tq, k]
    chosen = torch.zeros_like(gate, dtype=torch.bool).scatter_(-1, top, True)
    return chosen & (blocks <= own)  # a future block taken only because fewer than top_k exist: dropped


def moba_mask(chosen, block_size, Tk):
    """The selected blocks as a key mask, causal: [B, H, Tq, n_blocks] -> [B, H, Tq, Tk] bool, True = attend."""
    Tq = chosen.shape[-2]
    keys = chosen.repeat_interleave(block_size, dim=-1)[..., :Tk]  # block j -> its keys
    causal = torch.ones(Tq, Tk, dtype=torch.bool, device=chosen.device).tril(diagonal=Tk - Tq)
    return keys & causal


def moba_attention(Q, K, V, block_size, top_k, dropout=None):
    """MoBA with an explicit mask over the scores matrix: any device, any length."""
    # Q: [B, H, Tq, D], K and V: [B, H, Tk, D]
    mask = moba_mask(select_blocks(Q, K, block_size, top_k), block_size, K.shape[-2])  # [B, H, Tq, Tk]
    scores = (Q @ K.transpose(-2, -1) / Q.shape[-1] ** 0.5).masked_fill(~mask, float("-inf"))
    weights = F.softmax(scores, dim=-1)  # every query keeps at least itself: no row is all -inf
    if dropout is not None:
        weights = dropout(weights)
    return weights @ V  # [B, H, Tq, D]


def moba_block_mask(chosen, block_size, S):
    """FlexAttention's BlockMask of the selection of a whole sequence (Tq = Tk = S): the mask_mod reads
    `chosen`; the block mask records which (query tile, key tile) pairs hold any selected key."""
    from torch.nn.attention.flex_attention import create_block_mask
    B, H = chosen.shape[:2]

    def mask_mod(b, h, q_idx, kv_idx):
        return chosen[b, h, q_idx, kv_idx // block_size] & (kv_idx <= q_idx)
    return create_block_mask(mask_mod, B, H, S, S, device=chosen.device)


def moba_flex_attention(Q, K, V, block_size, top_k, flex=None):
    """MoBA through FlexAttention (Tq = Tk): the same selection as moba_attention, then `flex`
    (flex_attention, or a torch.compile'd one) with the block mask."""
    from torch.nn.attention.flex_attention import flex_attention
    S = Q.shape[-2]
    block_mask = moba_block_mask(select_blocks(Q, K, block_size, top_k), block_size, S)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return (flex or flex_attention)(Q, K, V, block_mask=block_mask)  # [B, H, S, D]


class MoBACache(DynamicKVCache):
    """MoBA's block selection as a KV cache (gptlite_kvcache's interface): the keys and values of up to
    max_seqlen tokens (more is an error: the blocks are the cache's slots), and each query reads the
    top_k blocks select_blocks chooses, through the model's own attention kernel. With a GPTlite's
    weights (gptlite_kvcache.kv_cache_view) it computes GPTlite_MoBA. record=True keeps, per layer, the
    keys each query of the last forward pass read, [B, H, T] (`keys_read`)."""

    def __init__(self, n_layers, block_size, top_k, max_seqlen, record=False):
        check_moba_args(block_size, top_k, max_seqlen)
        super().__init__(None, n_layers, max_seqlen, evict=False)
        self.block_size, self.top_k = block_size, top_k
        self.keys_read = [None] * n_layers if record else None

    def attend(self, layer, attention, q, K, V, mask):
        mask = moba_mask(select_blocks(q, K, self.block_size, self.top_k), self.block_size, K.shape[-2])  # [B, H, T, n]
        if self.keys_read is not None:
            self.keys_read[layer] = mask.sum(dim=-1)
        return attention(q, K, V, mask)


class MultiHeadAttention_MoBA(MultiHeadAttention):
    """GPTlite's attention with MoBA's block selection; the weights are GPTlite's. `flex`: None for the
    explicit mask, else the flex_attention function to call."""

    def __init__(self, d_model, n_heads, d_head, dropout_p, block_size, top_k):
        super().__init__(d_model, n_heads, d_head, dropout_p)
        self.block_size, self.top_k, self.flex = block_size, top_k, None

    def forward(self, x):
        # x: [B, S, d_model]
        Q = self.split_heads(self.query_proj(x))  # [B, H, S, D]
        K = self.split_heads(self.key_proj(x))
        V = self.split_heads(self.value_proj(x))
        # FlexAttention has no attention dropout, and no backward on CPU: such training takes the mask
        if self.flex is not None and not (self.training and (self.dropout.p > 0 or x.device.type == "cpu")):
            out = moba_flex_attention(Q, K, V, self.block_size, self.top_k, self.flex)
        else:
            out = moba_attention(Q, K, V, self.block_size, self.top_k, dropout=self.dropout)
        return self.dropout(self.out_proj(self.merge_heads(out)))  # [B, S, d_model]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoBAConfig(GPTliteConfig):
    block_size: int  # tokens per key block
    top_k: int       # blocks each query reads, its own included


class GPTlite_MoBA(GPTlite):
    """GPTlite whose every block attends with MoBA; its state dict is GPTlite's (the router has no weights)."""
    config_class = MoBAConfig

    def __init__(self, vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, block_size, top_k,
                 d_ff=None):
        check_moba_args(block_size, top_k, seqlen)
        super().__init__(vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, d_ff)
        for block in self.blocks:
            block.mha = MultiHeadAttention_MoBA(d_model, n_heads, d_head, dropout_p, block_size, top_k)
        self.apply(self._init_weights)
        self.config = MoBAConfig(vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, d_ff,
                                 block_size=block_size, top_k=top_k)

    def use_flex(self, flex):
        """Compute attention with `flex` (a flex_attention function) from now on; None: the explicit mask."""
        for block in self.blocks:
            block.mha.flex = flex
        return self
