"""SLA (Sparse-Linear Attention, Zhang et al. 2025, arXiv 2509.24006) for GPTlite's prefill.

    from gptlite_sla import GPTlite_SLA
    model = GPTlite_SLA.from_gptlite(base, block_size=8, critical=0.1, skipped=0.1, mask="causal")

Blog section: "Sparse plus linear attention: SLA". The attention map of a sequence is cut into tiles of
block_size queries x block_size keys. A cheap estimate of it, the softmax of the mean-pooled queries
against the mean-pooled keys, P_c = softmax(pool(Q) pool(K)^T / sqrt(d)), ranks the key blocks of each
query block, and each tile is classified:

- critical (the top `critical` fraction of the row): exact softmax attention over those keys (O_s);
- negligible (the bottom `skipped` fraction): skipped;
- marginal (the rest): linear attention over those keys only, phi(q) (sum_j phi(K_j)^T V_j) divided
  by phi(q) . (sum_j phi(K_j)^T 1), with phi a softmax over the head dimension (SLA's default) or
  elu + 1 (O_l).

O = O_s + proj(O_l): proj is a learned d_head x d_head linear layer (one per attention layer, shared by
the heads), initialised to zero, so that SLA starts as the sparse attention alone and fine-tuning
teaches it how much of the linear estimate to add. The sparse-only ablation drops O_l.

Causal mask (GPTlite as the language model it is): future tiles are never read, the diagonal tile is
always critical (it holds the query itself and is causal inside), so the marginal tiles are whole past
ones and the linear part needs no mask. Bidirectional (the paper's diffusion transformers): every tile.
The fractions are of the tiles each query block may read (the row's valid tiles), rounded so that the
critical count is ceil(critical * n) and the skipped one floor(skipped * n): critical = 1 is dense.

The sparse part here masks the [S, S] scores explicitly (the same numbers as a block-sparse kernel,
which would skip the tiles instead); attention_flops counts what such a kernel computes.
"""
import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptlite import GPTlite, GPTliteConfig, MultiHeadAttention


CRITICAL, MARGINAL, SKIPPED = 1, 0, -1  # the labels of a tile (the paper's M_c entries); future tiles: SKIPPED


MASKS = ("causal", "bidirectional")


FEATURE_MAPS = {"softmax": lambda x: F.softmax(x, dim=-1), "elu": lambda x: F.elu(x) + 1}


def check_sla_args(block_size, critical, skipped, mask="causal", feature_map="softmax", seqlen=None):
    """Clear errors for bad SLA settings, before any work."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer (tokens per query and key block), got {block_size!r}")
    if seqlen is not None and seqlen % block_size:
        raise ValueError(f"block_size={block_size} does not divide seqlen={seqlen}: SLA's tiles must cover the "
                         f"sequence exactly; choose a divisor of {seqlen}, e.g. {math.gcd(seqlen, 8)}")
    if isinstance(critical, bool) or not isinstance(critical, (int, float)) or not 0 < critical <= 1:
        raise ValueError(f"critical must be a fraction in (0, 1] (tiles of each row computed exactly; 1 = dense), "
                         f"got {critical!r}")
    if isinstance(skipped, bool) or not isinstance(skipped, (int, float)) or not 0 <= skipped < 1:
        raise ValueError(f"skipped must be a fraction in [0, 1) (tiles of each row left out), got {skipped!r}")
    if critical + skipped > 1:
        raise ValueError(f"critical + skipped = {critical} + {skipped} > 1: the critical and skipped tiles of a row "
                         "cannot overlap; lower one of them")
    if mask not in MASKS:
        raise ValueError(f"mask must be one of {MASKS}, got {mask!r}")
    if feature_map not in FEATURE_MAPS:
        raise ValueError(f"feature_map must be one of {tuple(FEATURE_MAPS)}, got {feature_map!r}")


def check_length(S, block_size):
    if S % block_size:
        raise ValueError(f"block_size={block_size} does not divide the sequence length {S}: SLA's tiles must cover "
                         "it exactly; give a multiple of the block size")


def valid_tiles(n_blocks, causal, device=None):
    """The tiles a query block may read: [n_blocks, n_blocks] bool (lower triangle when causal)."""
    ones = torch.ones(n_blocks, n_blocks, dtype=torch.bool, device=device)
    return ones.tril() if causal else ones


def pool(X, block_size):
    """Mean of each block of tokens: [B, H, S, D] -> [B, H, S / block_size, D]."""
    B, H, S, D = X.shape
    return X.view(B, H, S // block_size, block_size, D).mean(dim=3)


def block_estimate(Q, K, block_size, causal):
    """P_c, the cheap estimate of the attention map: softmax(pool(Q) pool(K)^T / sqrt(d)), future tiles 0."""
    # Q, K: [B, H, S, D]
    check_length(Q.shape[-2], block_size)
    scores = pool(Q, block_size) @ pool(K, block_size).transpose(-2, -1) / Q.shape[-1] ** 0.5  # [B, H, nb, nb]
    valid = valid_tiles(scores.shape[-1], causal, Q.device)
    return F.softmax(scores.masked_fill(~valid, float("-inf")), dim=-1)


def tile_counts(n_valid, critical, skipped):
    """Critical and skipped tiles of a row of n_valid tiles: ceil(critical * n), floor(skipped * n).
    Rounded to 9 decimals first so that 0.55 * 100 is 55, not 55.00000000000001."""
    return math.ceil(round(critical * n_valid, 9)), math.floor(round(skipped * n_valid, 9))


def classify_blocks(Q, K, block_size, critical, skipped, causal):
    """Each tile's label, [B, H, nb, nb] int8: CRITICAL (the row's highest P_c, the diagonal first when
    causal), SKIPPED (its lowest, and every future tile), MARGINAL (the rest)."""
    P = block_estimate(Q, K, block_size, causal)  # [B, H, nb, nb]
    nb = P.shape[-1]
    valid = valid_tiles(nb, causal, Q.device)
    rank_by = P.masked_fill(~valid, -1.0)  # future tiles below every valid one
    if causal:  # the query's own tile always: it holds the query itself (no row without an exact key)
        rank_by = rank_by.masked_fill(torch.eye(nb, dtype=torch.bool, device=Q.device), 2.0)
    order = rank_by.argsort(dim=-1, descending=True, stable=True)
    rank = order.argsort(dim=-1)  # [B, H, nb, nb]: 0 = the row's highest
    counts = [tile_counts(int(n), critical, skipped) for n in valid.sum(-1)]
    n_valid = valid.sum(-1)[:, None]  # [nb, 1]
    n_critical = torch.tensor([c for c, _ in counts], device=Q.device)[:, None]
    n_skipped = torch.tensor([s for _, s in counts], device=Q.device)[:, None]
    labels = torch.full_like(rank, MARGINAL, dtype=torch.int8)
    labels = labels.masked_fill(rank >= n_valid - n_skipped, SKIPPED)  # future tiles rank past n_valid: skipped
    return labels.masked_fill(rank < n_critical, CRITICAL)


def expand(tiles, block_size):
    """A tile mask to a token mask: [..., nb, nb] -> [..., S, S]."""
    return tiles.repeat_interleave(block_size, dim=-2).repeat_interleave(block_size, dim=-1)


def sparse_part(Q, K, V, labels, block_size, causal):
    """O_s: exact softmax attention over the keys of the critical tiles only (and causal inside them)."""
    # Q, K, V: [B, H, S, D]; labels: [B, H, nb, nb]
    S = Q.shape[-2]
    keep = expand(labels == CRITICAL, block_size)  # [B, H, S, S]
    if causal:
        keep = keep & torch.ones(S, S, dtype=torch.bool, device=Q.device).tril()
    scores = (Q @ K.transpose(-2, -1) / Q.shape[-1] ** 0.5).masked_fill(~keep, float("-inf"))
    return F.softmax(scores, dim=-1) @ V  # every row keeps a critical tile: no row is all -inf


def linear_part(Q, K, V, labels, block_size, feature_map="softmax"):
    """O_l: linear attention over the keys of the marginal tiles of each query block (whole past tiles
    when causal: no mask needed), 0 for a query block with none. Also returns which query blocks have any."""
    B, H, S, D = Q.shape
    nb, phi = S // block_size, FEATURE_MAPS[feature_map]
    phi_q = phi(Q).view(B, H, nb, block_size, D)  # [B, H, nb, b, D]
    phi_k = phi(K).view(B, H, nb, block_size, D)
    kv = phi_k.transpose(-2, -1) @ V.view(B, H, nb, block_size, D)  # [B, H, nb, D, D]: phi(K_j)^T V_j per key block
    k_sum = phi_k.sum(dim=-2)  # [B, H, nb, D]: phi(K_j)^T 1
    marginal = (labels == MARGINAL).to(Q.dtype)  # [B, H, nb(q), nb(k)]
    kv_i = torch.einsum("bhij,bhjde->bhide", marginal, kv)  # [B, H, nb, D, D]: summed over the row's marginal tiles
    k_sum_i = torch.einsum("bhij,bhjd->bhid", marginal, k_sum)  # [B, H, nb, D]
    numerator = phi_q @ kv_i  # [B, H, nb, b, D]
    denominator = (phi_q * k_sum_i[:, :, :, None, :]).sum(-1, keepdim=True)  # [B, H, nb, b, 1], > 0 if any marginal
    has = marginal.sum(-1) > 0  # [B, H, nb]
    out = torch.where(has[..., None, None], numerator / denominator.clamp_min(1e-30), torch.zeros_like(numerator))
    return out.view(B, H, S, D), has


def sla_attention(Q, K, V, block_size, critical, skipped, causal, proj=None, feature_map="softmax", labels=None):
    """O = O_s + proj(O_l), proj applied only to the query blocks that have marginal tiles (a row without
    any has no linear branch: critical = 1 is then dense attention, whatever proj learned). proj=None:
    the sparse-only ablation (the marginal tiles dropped)."""
    # Q, K, V: [B, H, S, D]
    if labels is None:
        labels = classify_blocks(Q, K, block_size, critical, skipped, causal)
    out = sparse_part(Q, K, V, labels, block_size, causal)
    if proj is not None:
        linear, has = linear_part(Q, K, V, labels, block_size, feature_map)
        has = has.repeat_interleave(block_size, dim=-1)[..., None]  # [B, H, S, 1]
        out = out + torch.where(has, proj(linear), torch.zeros_like(linear))
    return out  # [B, H, S, D]


def dense_attention(Q, K, V, causal):
    """The reference: softmax attention over every key (causal: every past key)."""
    S = Q.shape[-2]
    scores = Q @ K.transpose(-2, -1) / Q.shape[-1] ** 0.5
    if causal:
        scores = scores.masked_fill(~torch.ones(S, S, dtype=torch.bool, device=Q.device).tril(), float("-inf"))
    return F.softmax(scores, dim=-1) @ V


class MultiHeadAttention_SLA(MultiHeadAttention):
    """GPTlite's attention computed with SLA; GPTlite's weights plus proj_l, the linear part's projection.
    `linear=False` is the sparse-only ablation; `dense=True` computes dense attention with the same mask
    (the reference of the output error). No dropout on the attention weights: SLA is evaluated, and its
    projections fitted, in eval mode; dropout after out_proj is GPTlite's."""

    def __init__(self, d_model, n_heads, d_head, dropout_p, block_size, critical, skipped, mask, linear, feature_map):
        super().__init__(d_model, n_heads, d_head, dropout_p)
        self.block_size, self.critical, self.skipped = block_size, critical, skipped
        self.causal, self.linear, self.feature_map, self.dense = mask == "causal", linear, feature_map, False
        self.proj_l = nn.Linear(d_head, d_head)  # shared by the heads, as in SLA's code
        self.last_labels = None  # the tiles' labels of the last forward pass

    def forward(self, x):
        # x: [B, S, d_model]
        Q = self.split_heads(self.query_proj(x))  # [B, H, S, D]
        K = self.split_heads(self.key_proj(x))
        V = self.split_heads(self.value_proj(x))
        if self.dense:
            out = dense_attention(Q, K, V, self.causal)
        else:
            self.last_labels = classify_blocks(Q, K, self.block_size, self.critical, self.skipped, self.causal)
            out = sla_attention(Q, K, V, self.block_size, self.critical, self.skipped, self.causal,
                                proj=self.proj_l if self.linear else None, feature_map=self.feature_map,
                                labels=self.last_labels)
        return self.dropout(self.out_proj(self.merge_heads(out)))  # [B, S, d_model]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SLAConfig(GPTliteConfig):
    block_size: int    # tokens per query block and per key block
    critical: float    # fraction of each row's tiles computed exactly (k_h)
    skipped: float     # fraction of each row's tiles left out (k_l)
    mask: str          # "causal" or "bidirectional"
    linear: bool       # marginal tiles through linear attention (SLA), or dropped (sparse only)
    feature_map: str   # phi of the linear part: "softmax" or "elu"


class GPTlite_SLA(GPTlite):
    """GPTlite whose every attention layer is SLA; GPTlite's state dict plus one zero-initialised proj_l
    per layer. With mask="bidirectional" it is an encoder, not a language model: use it for attention
    outputs, not losses."""
    config_class = SLAConfig

    def __init__(self, vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, block_size, critical,
                 skipped=0.0, mask="causal", linear=True, feature_map="softmax", d_ff=None):
        check_sla_args(block_size, critical, skipped, mask, feature_map, seqlen)
        super().__init__(vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, d_ff)
        for block in self.blocks:
            block.mha = MultiHeadAttention_SLA(d_model, n_heads, d_head, dropout_p, block_size, critical, skipped,
                                               mask, linear, feature_map)
        self.apply(self._init_weights)
        for block in self.blocks:  # zero: SLA starts as its sparse part alone
            nn.init.zeros_(block.mha.proj_l.weight)
            nn.init.zeros_(block.mha.proj_l.bias)
        self.config = SLAConfig(vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, d_ff,
                                block_size=block_size, critical=critical, skipped=skipped, mask=mask, linear=linear,
                                feature_map=feature_map)

    @classmethod
    def from_gptlite(cls, base, **sla):
        """A GPTlite_SLA with the weights of the GPTlite `base` (proj_l zero), on its device, in eval mode."""
        model = cls(**base.config.to_dict(), **sla)
        missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
        if unexpected or any(not k.endswith(("proj_l.weight", "proj_l.bias")) for k in missing):
            raise ValueError(f"not a GPTlite state dict: missing {missing}, unexpected {unexpected}")
        return model.to(next(base.parameters()).device).eval()

    def projections(self):
        """The parameters SLA adds (the ones fine-tuning trains here)."""
        return [p for block in self.blocks for p in block.mha.proj_l.parameters()]
