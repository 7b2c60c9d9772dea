"""SLA for GPTlite beyond the model (gptlite_sla.py): the attention inputs of a model, the relative error of its
outputs, the fitting of the linear branch's projections, tile fractions and attention FLOPs.

Blog section: "Sparse plus linear attention: SLA".
"""
import math

import torch
import torch.nn.functional as F
from tqdm import tqdm

from gptlite_sla import CRITICAL, MARGINAL, SKIPPED, valid_tiles


@torch.no_grad()
def attention_inputs(model, idx):
    """The input of every attention layer (ln1 of the residual stream) of `model` on tokens idx:
    [n_layers] of [B, S, d_model]."""
    inputs = []
    hooks = [block.mha.register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
             for block in model.blocks]
    try:
        model(idx)
    finally:
        for hook in hooks:
            hook.remove()
    return inputs


def relative_error(model, inputs):
    """sqrt(sum over layers of |SLA - dense|^2 / sum of |dense|^2): the attention layers' outputs (after
    out_proj) of `model` against dense attention with the same weights and mask, on the same inputs."""
    err = ref = 0.0
    with torch.no_grad():
        for block, x in zip(model.blocks, inputs):
            block.mha.dense = True
            dense = block.mha(x)
            block.mha.dense = False
            err += (block.mha(x) - dense).pow(2).sum().item()
            ref += dense.pow(2).sum().item()
    return math.sqrt(err / ref)


def fit_projections(model, inputs, steps, lr, batch_size=16, seed=0, desc="fitting proj_l"):
    """Fine-tune proj_l alone (Adam, `steps` steps): minimise the mean squared error of each attention
    layer's output against dense attention with the same weights, on its real inputs `inputs`
    ([n_layers] of [N, S, d_model], the dense model's). Returns the last loss."""
    for p in model.parameters():
        p.requires_grad_(False)
    params = model.projections()
    for p in params:
        p.requires_grad_(True)
    with torch.no_grad():  # the targets: dense attention of the same layers
        targets = []
        for block, x in zip(model.blocks, inputs):
            block.mha.dense = True
            targets.append(block.mha(x))
            block.mha.dense = False
    optimizer = torch.optim.Adam(params, lr=lr)
    generator = torch.Generator().manual_seed(seed)
    loss = None
    for _ in tqdm(range(steps), desc=desc, dynamic_ncols=True, mininterval=0.5):
        pick = torch.randint(inputs[0].shape[0], (batch_size,), generator=generator)
        loss = sum(F.mse_loss(block.mha(x[pick]), t[pick]) for block, x, t in zip(model.blocks, inputs, targets))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    for p in model.parameters():
        p.requires_grad_(True)
    return None if loss is None else loss.item()


def tile_fractions(labels, causal):
    """Shares of the valid tiles (over batch, heads and layers given) that are critical, marginal, skipped."""
    valid = valid_tiles(labels.shape[-1], causal, labels.device).expand_as(labels)
    n = valid.sum().item()
    return {name: ((labels == code) & valid).sum().item() / n
            for name, code in (("exact", CRITICAL), ("linear", MARGINAL), ("skipped", SKIPPED))}


def attention_flops(labels, block_size, d_head, causal, linear):
    """Attention FLOPs of one head on one sequence (mean over the labels' batch and heads), as a
    block-sparse kernel computes them, multiply-adds counted as 2, softmax and feature maps not counted:
    exact tiles 4 b^2 d each (scores and weighted values, diagonal tiles whole); the estimate: pooling
    Q and K (2 S d) and the pooled scores (2 nb^2 d); the linear part: phi(K_j)^T V_j and its sum
    (2 b d^2 + b d) per key block marginal for some row, adding them up per marginal tile (d^2 + d),
    and per query block with any: phi(Q) times them with the denominator (2 b d^2 + 2 b d) and proj
    (2 b d^2 + b d). With every tile exact nothing is estimated: dense attention. Returns (flops, dense
    flops): dense is 4 b^2 d per valid tile."""
    b, d = block_size, d_head
    nb = labels.shape[-1]
    n_heads = labels.shape[0] * labels.shape[1]
    valid = valid_tiles(nb, causal, labels.device)
    dense = 4 * b * b * d * valid.sum().item()
    critical = (labels == CRITICAL) & valid
    flops = 4 * b * b * d * critical.sum().item() / n_heads
    if not bool(critical.sum(dim=(-2, -1)).eq(valid.sum()).all()):  # every tile exact: dense, no estimate needed
        flops += 2 * nb * b * d + 2 * nb * nb * d
    if linear:
        marginal = (labels == MARGINAL) & valid
        key_blocks = marginal.any(dim=-2).sum().item() / n_heads
        query_blocks = marginal.any(dim=-1).sum().item() / n_heads
        flops += (key_blocks * (2 * b * d * d + b * d) + marginal.sum().item() / n_heads * (d * d + d)
                  + query_blocks * (4 * b * d * d + 3 * b * d))
    return flops, dense
