"""DSA (DeepSeek Sparse Attention) for GPTlite: the conversion from a dense model, the two-stage training of
DeepSeek-V3.2, the indexer's recall, the costs and the decode kernel. The model is gptlite_dsa.py.

    from lib.dsa import dsa_from_dense, warmup_indexer, sparse_uptrain, indexer_recall
    model = dsa_from_dense(base, top_k=32, n_index_heads=4, d_index=16)  # GPTlite's weights + new indexers
    warmup_indexer(model, data, steps=40, lr=1e-3)      # stage 1: dense, only the indexers learn
    sparse_uptrain(model, data, steps=40, lr=1e-3)      # stage 2: top-k sparse, everything learns

Blog section: "Sparse attention".
"""
import math

import torch
import torch.nn.functional as F

from gptlite_dsa import GPTlite_DSA, check_positive_int, select_topk
from lib import training
from lib.attention_benchmark import gather_tokens
from lib.corpus import get_batch


def check_training_args(steps, lr, steps_flag, lr_flag="--dsa-lr"):
    check_positive_int(steps, steps_flag, "training steps")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"{lr_flag} must be a positive learning rate, got {lr!r}")


def dsa_from_dense(base, top_k, n_index_heads=4, d_index=16, seed=0):
    """A GPTlite_DSA with the weights of the GPTlite `base` and new indexers (N(0, 0.02) from `seed`), on
    its device, in eval mode. The plug-in for scripts: build from the dense base."""
    torch.manual_seed(seed)
    model = GPTlite_DSA(**base.config.to_dict(), top_k=top_k, n_index_heads=n_index_heads, d_index=d_index)
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    if unexpected or any(".indexer." not in name for name in missing):
        raise ValueError(f"not a GPTlite state dict: unexpected {unexpected}, missing {missing}")
    return model.to(next(base.parameters()).device).eval()


# ----------------------------------------------------------------------------------------------------
# Training, as DeepSeek-V3.2: a dense warm-up of the indexers alone, then sparse training of everything.

def kl_on_windows(model, windows, dense):
    """The indexers' KL loss (sum over layers) on `windows` [B, S], without gradient."""
    was_training = model.training
    model.eval()
    with torch.no_grad(), model.recording(dense=dense):
        model(windows)
        loss = model.indexer_loss().item()
    model.train(was_training)
    return loss


def validation_windows(data, n_windows, seqlen, seed, device):
    return get_batch(data.val, n_windows, seqlen, torch.Generator().manual_seed(seed), device)[0]


def warmup_indexer(model, data, steps, lr, batch_size=32, seqlen=None, seed=0, val_windows=8):
    """Stage 1, the dense warm-up: the main model frozen and dense, only the indexers trained, towards each
    layer's main attention (summed over heads, L1-normalised) by the KL loss over every past key.
    Returns (KL before, KL after) on `val_windows` fixed validation windows, and train_steps' history."""
    check_training_args(steps, lr, "--dsa-warmup-steps")
    seqlen = seqlen or model.seqlen
    windows = validation_windows(data, val_windows, seqlen, seed + 1, next(model.parameters()).device)
    before = kl_on_windows(model, windows, dense=True)
    indexer = {id(p) for p in model.indexer_parameters()}
    frozen = [p for p in model.parameters() if id(p) not in indexer and p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)  # no gradient: AdamW skips them, weight decay included (bit-identical);
        # the KL loss alone gives them none already (detached input and target), this also spares autograd

    def loss_fn(m, x, y):
        m.eval()  # the frozen model as at inference: no dropout in the target (the indexer has none to lose)
        with m.recording(dense=True):
            m(x)
            return m.indexer_loss()
    try:
        history = training.train_steps(model, data, steps, batch_size, seqlen, lr, seed=seed, eval_interval=steps,
                                       loss_fn=loss_fn, desc="DSA indexer warm-up", evaluate=lambda m: kl_on_windows(
                                           m, windows, dense=True))
    finally:
        for p in frozen:
            p.requires_grad_(True)
    return before, kl_on_windows(model, windows, dense=True), history


def sparse_loss(model, x, y):
    """Stage 2's loss: the language-modelling loss with top-k attention plus the indexers' KL loss over the
    selected keys; the indexers' input is detached, so each loss trains its own parameters only."""
    with model.recording(dense=False):
        logits = model(x)  # [B, S, vocab]
        return F.cross_entropy(logits.flatten(0, 1), y.flatten()) + model.indexer_loss()


def sparse_uptrain(model, data, steps, lr, batch_size=32, seqlen=None, seed=0, val_batches=10):
    """Stage 2, sparse training: every parameter trained with top-k attention on sparse_loss.
    Returns train_steps' history (the validation loss after the last step, on `val_batches` batches)."""
    check_training_args(steps, lr, "--dsa-sparse-steps")
    return training.train_steps(model, data, steps, batch_size, seqlen or model.seqlen, lr, seed=seed,
                                eval_interval=steps, loss_fn=sparse_loss, desc="DSA sparse training",
                                evaluate=lambda m: training.validation_loss(m, data, n_batches=val_batches))


@torch.no_grad()
def indexer_recall(model, windows, top_k=None, from_position=0):
    """The fraction of the dense attention's mass on the indexer's top_k keys (default: the model's),
    mean over queries, heads and layers. The model runs dense (its true attention) on windows [B, S].
    from_position: the queries at that position and after only (top_k: those that have a choice; the
    first top_k queries read every key, a recall of 1 by construction)."""
    top_k = top_k or model.config.top_k
    if not 0 <= from_position < windows.shape[1]:
        raise ValueError(f"from_position must be a position of the {windows.shape[1]}-token windows, "
                         f"got {from_position}")
    was_training = model.training
    model.eval()
    with model.recording(dense=True):
        model(windows)
        recalls = [(weights * select_topk(scores, top_k)[:, None]).sum(dim=-1)[..., from_position:].mean()
                   for weights, scores, _ in (mha.recorded for mha in model.attentions())]  # [B, H, S] -> mean
    model.train(was_training)
    return torch.stack(recalls).mean().item()


# ----------------------------------------------------------------------------------------------------
# Decoding with a KV cache: the index keys are cached beside the keys and values.


# ----------------------------------------------------------------------------------------------------
# Costs.

def keys_read(position, top_k):
    """Keys the main attention of the query at `position` (0-based) reads: top_k, or all while fewer exist."""
    return min(position + 1, top_k)


def attention_cost(position, top_k, n_heads, d_head, n_layers, n_index_heads=None, d_index=None,
                   bytes_per_value=4, index_bytes_per_value=None):
    """Attention FLOPs and bytes read for the token at `position` (decoding it with a cache of the tokens
    before it), all layers, the indexer's own included. Main attention: 4 FLOPs per key read per head
    dimension (scores and weighted values), K and V of each key read. Indexer: for every cached token
    (itself included) one dot product per index head (2 FLOPs a dimension) and its weighting (2 FLOPs a
    head), and its index key read (d_index values of index_bytes_per_value, default bytes_per_value;
    DeepSeek keeps them in FP8). Dense attention: top_k None (every key, no indexer)."""
    n = position + 1
    keys = n if top_k is None else keys_read(position, top_k)
    flops = 4 * keys * n_heads * d_head
    kv_bytes = 2 * keys * n_heads * d_head * bytes_per_value
    if top_k is not None:
        flops += n * n_index_heads * (2 * d_index + 2)
        kv_bytes += n * d_index * (index_bytes_per_value or bytes_per_value)
    return n_layers * flops, n_layers * kv_bytes


def dsa_decode(q, K, V, index_q, index_w, index_keys, top_k):
    """DSA for one query (the last token) over a cache K, V [B, H, n, D] and its index keys [B, n, d_index]:
    the indexer's scores over every cached token (index_q [B, n_index_heads, d_index] and index_w
    [B, n_index_heads], the query token's, scale folded in), top-k, a gather of those tokens' keys and values
    (the same for every head), attention over them. q: [B, H, 1, D]. Ties among the scores go to any of the
    tied tokens (select_topk gives them to the earlier one; random scores have none)."""
    n = K.shape[-2]
    scores = (index_w[:, None] @ F.relu(index_q @ index_keys.transpose(1, 2)))[:, 0]  # [B, n]: sum_j w_j ReLU(q_j . k)
    top = scores.topk(min(top_k, n), dim=-1, sorted=False).indices  # [B, k]: attention needs no order
    idx = top[:, None].expand(-1, K.shape[1], -1)  # [B, H, k]: one selection for every head
    return F.scaled_dot_product_attention(q, gather_tokens(K, idx), gather_tokens(V, idx))
