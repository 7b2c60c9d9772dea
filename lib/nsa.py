"""NSA (Native Sparse Attention) for GPTlite beyond the model (gptlite_nsa.py): the conversion from a dense
model, the keys read per query and the bytes a step moves, and the decode kernel.

    from lib.nsa import nsa_from_dense
    model = nsa_from_dense(base, block_size=8, top_n=3, window=8)  # GPTlite's weights + the gates

Blog section: "Sparse attention".
"""
import torch
import torch.nn.functional as F

from gptlite_nsa import GPTlite_NSA
from lib.attention_benchmark import gather_tokens


def nsa_from_dense(base, block_size, top_n, window):
    """A GPTlite_NSA with the weights of the GPTlite `base` and fresh gates, on its device, in eval mode."""
    model = GPTlite_NSA(**base.config.to_dict(), block_size=block_size, top_n=top_n, window=window)
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    if unexpected or any(".gate_proj." not in name for name in missing):
        raise ValueError(f"not a GPTlite state dict: unexpected {unexpected}, missing {missing}")
    return model.to(next(base.parameters()).device).eval()


# ----------------------------------------------------------------------------------------------------
# Costs: the three branches are computed separately, so their keys add up.

def keys_read(position, block_size, top_n, window):
    """(selected, window, compressed) keys the query at `position` (0-based) attends to: its own block up to
    itself and min(top_n - 1, own) whole past blocks; min(position + 1, window) tokens; one summary per
    whole block up to itself."""
    own = position // block_size
    selected = position - own * block_size + 1 + min(top_n - 1, own) * block_size
    return selected, min(position + 1, window), (position + 1) // block_size


def attention_cost(position, block_size, top_n, window, n_heads, d_head, n_layers, bytes_per_value=4):
    """Attention FLOPs and KV bytes read for the token at `position` decoded with a cache, all layers: 4 FLOPs
    per key per head dimension in each branch (the compressed scores also rank the blocks: no extra
    work), K and V of every key read, the summaries' included (the compressed K and V are cached)."""
    keys = sum(keys_read(position, block_size, top_n, window))
    per_layer = n_heads * d_head
    return n_layers * per_layer * 4 * keys, n_layers * per_layer * bytes_per_value * 2 * keys


# ----------------------------------------------------------------------------------------------------
# One decode step over a long cache (the microbenchmark): gathers, not masks.

def nsa_decode(q, K, V, Kc, Vc, block_size, top_n, window):
    """NSA for one query (the last token) over a cache K, V [B, H, n, D], whose whole blocks' summaries Kc,
    Vc [B, H, nc, D] are cached beside it (updated once a block is full), gates 1/3 each. q: [B, H, 1, D]."""
    n, D = K.shape[-2], K.shape[-1]
    scores = q @ Kc.transpose(-2, -1) / D ** 0.5  # [B, H, 1, nc]: the compressed branch and the ranking
    out_cmp = F.softmax(scores, dim=-1) @ Vc
    own = (n - 1) // block_size
    rank = F.pad(scores, (0, own + 1 - scores.shape[-1]), value=float("-inf"))[..., :own + 1]  # [B, H, 1, own+1]
    rank[..., 0], rank[..., own] = torch.finfo(rank.dtype).max, float("inf")
    top = rank.topk(min(top_n, own + 1), dim=-1, sorted=False).indices[..., 0, :]  # [B, H, n_sel]
    idx = (top[..., None] * block_size + torch.arange(block_size, device=q.device)).flatten(-2)  # [B, H, n_sel*l]
    valid = idx < n  # the own block's tokens after the query: not there yet
    idx = idx.clamp(max=n - 1)
    Ks, Vs = gather_tokens(K, idx), gather_tokens(V, idx)  # [B, H, n_sel*l, D]
    out_sel = F.scaled_dot_product_attention(q, Ks, Vs, attn_mask=valid[:, :, None, :])
    out_win = F.scaled_dot_product_attention(q, K[:, :, -window:], V[:, :, -window:])
    return (out_cmp + out_sel + out_win) / 3
