"""MoBA for GPTlite beyond the model (gptlite_moba.py): FlexAttention checked against the explicit mask, the
keys read and the bytes a decode step moves, the uptrained checkpoint, and the decode kernel.

Blog section: "Sparse attention".
"""
import torch
import torch.nn.functional as F

import inference_utils as iu
from gptlite_moba import moba_attention, moba_flex_attention
from lib import training
from lib.attention_benchmark import gather_tokens


def make_flex_check(block_size, top_k, device, compiled=True, n=None, d_head=16):
    """A compiled (or eager) flex_attention, checked against moba_attention on random inputs of `n`
    tokens (default: three blocks and a bit, a partial last block). Returns (flex or None, max |diff|,
    a note saying why it did not run): a device or build where it cannot run is reported, not fatal."""
    from torch.nn.attention.flex_attention import flex_attention
    n = n or 3 * block_size + 5
    generator = torch.Generator().manual_seed(0)
    Q, K, V = torch.randn(3, 2, 2, n, d_head, generator=generator).to(device)
    try:
        flex = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
        with torch.no_grad():
            diff = (moba_flex_attention(Q, K, V, block_size, top_k, flex)
                    - moba_attention(Q, K, V, block_size, top_k)).abs().max().item()
    except Exception as e:  # torch.compile fails in many ways (no C++ compiler, no Triton, ...)
        reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        return None, None, f"flex attention does not run on {device} here: {reason}"
    return flex, diff, None


def keys_read(position, block_size, top_k):
    """Keys the query at `position` (0-based) reads: its own block up to itself, and up to top_k - 1
    whole past blocks."""
    own = position // block_size
    return position - own * block_size + 1 + min(top_k - 1, own) * block_size


def attention_cost(position, block_size, top_k, n_heads, d_head, n_layers, bytes_per_value=4):
    """Attention FLOPs and KV bytes read for the token at `position` (decoding it with a cache of the
    tokens before it), all layers. Scores and weighted values: 2 multiply-adds per key per head
    dimension (4 FLOPs); the router: one dot product with each past block's mean key (2 FLOPs a
    dimension), whose mean keys are read too. Dense attention: top_k at least the number of blocks and
    no router (block_size=None)."""
    per_layer = n_heads * d_head
    if block_size is None:
        keys, means = position + 1, 0
    else:
        keys, means = keys_read(position, block_size, top_k), position // block_size
    flops = n_layers * per_layer * (4 * keys + 2 * means)
    kv_bytes = n_layers * per_layer * bytes_per_value * (2 * keys + means)  # K and V of each key, one mean key
    return flops, kv_bytes


def cost_figures(block_size, top_k, preset, n_dense_blocks):
    """Keys per query over a full window, its sparsity, and the FLOPs and KV bytes of its last token."""
    S, dims = preset.seqlen, (preset.n_heads, preset.d_head, preset.n_layers)
    dense = top_k >= n_dense_blocks
    keys = sum(keys_read(p, block_size, top_k) for p in range(S)) / S
    flops, kv_bytes = attention_cost(S - 1, None if dense else block_size, top_k, *dims)
    return dict(keys_per_query=round(keys, 2), sparsity=round(1 - keys / ((S + 1) / 2), 4),
                kflops_token=round(flops / 1e3, 1), kv_kb_token=round(kv_bytes / 2**10, 1))


# ----------------------------------------------------------------------------------------------------
# Uptraining a sparse model converted from the dense checkpoint (MoBA here; main_trainable_sparse's NSA
# and DSA too).

def uptrained(model, name, path, meta, data, preset, steps, lr, seed, rebuild, train=None):
    """`model` uptrained: the checkpoint at `path` when it was made from the same base checkpoint with the
    same budget (`meta`, its stamp), else trained now and saved there (None: never saved). `train(model)`:
    default `steps` of training.train_steps with the cross-entropy loss (the model's own attention)."""
    config = model.config.to_dict()  # GPTlite's and the variant's fields
    train = train or (lambda m: training.train_steps(m, data, steps, preset.batch_size, preset.seqlen, lr, seed=seed,
                                                     eval_interval=steps, desc=f"uptraining {name}"))
    return iu.cached_model(model, config, path, train, data.vocab, rebuild, stamp=meta)[0]


def moba_decode(q, K, V, mean_keys, block_size, top_k):
    """MoBA for one query (the last token) over a cache K, V [B, H, n, D] with the mean key of each whole
    block cached beside it, mean_keys [B, H, n // block_size, D] (updated once a block is full): the router's
    scores, top-k, a gather of the chosen blocks' keys and values, attention over them. q: [B, H, 1, D]."""
    n = K.shape[-2]
    own = (n - 1) // block_size
    gate = F.pad(q @ mean_keys[..., :own, :].transpose(-2, -1), (0, 1), value=float("inf"))  # [B, H, 1, own + 1]
    top = gate.topk(min(top_k, own + 1), dim=-1, sorted=False).indices[..., 0, :]  # [B, H, k]
    idx = (top[..., None] * block_size + torch.arange(block_size, device=q.device)).flatten(-2)  # [B, H, k * l]
    valid = idx < n  # the own block's slots after the query: not there yet
    idx = idx.clamp(max=n - 1)
    return F.scaled_dot_product_attention(q, gather_tokens(K, idx), gather_tokens(V, idx),
                                          attn_mask=valid[:, :, None, :])
