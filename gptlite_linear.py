"""Linear attention for GPTlite: a fixed-size state per head instead of a growing KV cache.

Blog section: "Linear attention and hybrid models". Every head keeps a state S of [d_head, d_head] that maps
keys to values; the output of a query is read from it. S is stored here as [d_k, d_v] (its transpose,
the layout of flash-linear-attention), so the read is o_t = q_t^T S_t and the write is S += k_t v_t^T.
Four update rules (written in the issue's orientation, S of [d_v, d_k]):

- "linear" (Katharopoulos et al. 2020): S_t = S_{t-1} + v_t k_t^T, with the positive feature map
  elu(x) + 1 on queries and keys and the normalizer o_t = S_t q_t / (z_t . q_t), z_t = sum of the keys.
  The normalizer is the same sum with a value of 1, so it rides along as one extra value column of the
  state ([d_k, d_v + 1]): one code path computes both. Without it the output grows with t.
- "gated": S_t = a_t S_{t-1} + v_t k_t^T, a_t = exp(logsigmoid(w_a . x_t) / 16) in (0, 1), one decay
  per head and token (the scalar gate of Mamba-2 / Gated DeltaNet; GLA's 1/16 keeps a_t near 1 at the
  start of training).
- "delta" (Gated DeltaNet, Yang et al. 2024): S_t = a_t S_{t-1} - b_t (a_t S_{t-1} k_t - v_t) k_t^T,
  b_t = sigmoid(w_b . x_t): one step of gradient descent on ||S k_t - v_t||^2, which overwrites the value
  stored under k_t instead of adding to it. Keys must have unit norm for that step to be stable.
- "kda" (Kimi Delta Attention, Kimi Linear 2025): the delta rule with one decay per key channel instead of
  one per head, S_t = (S_{t-1} Diag(a_t)) (I - b_t k_t k_t^T) + b_t v_t k_t^T, a_t in (0, 1)^{d_k}:
  each channel of the keys forgets at its own rate. log a_t = -e^{A_h} softplus(W_up W_down x_t + dt), a
  low-rank projection as KDA's, with dt set so that the decays start between 0.90 and 0.999. (fla's
  naive_recurrent_kda is the same recurrence, in the [d_k, d_v] layout, with its gate g = log a_t; it
  scales q by 1 / sqrt(d_k), which the output's RMSNorm below makes irrelevant, so we use 1.)

"gated", "delta" and "kda" use L2-normalized queries and keys and normalize each head's output (RMSNorm without
weights, as GLA and Gated DeltaNet do): the state sums up to 1/(1 - a) values, an unbounded scale.

Two forms of each rule that give the same outputs and state:
- `recurrent`: one token at a time; `recurrent_step` is the decode step, the state is the whole cache;
- `chunked`: chunks of C tokens, attention-like (a [C, C] score matrix with the decay) within a chunk,
  the state carried between chunks: matrix products for training and prefill, a Python loop over
  T / C chunks only (KDA's per-channel decay: sub-chunks, see `decayed_products`). The delta
  rule's chunk solves a unit lower-triangular system (the WY / UT form
  of DeltaNet) for the values the chunk actually writes.

Positions: GPTlite_Linear has no position embedding. The recurrence is ordered and causal, and the
decay of "gated" and "delta" weights recent tokens more, so these layers need none (the plain "linear"
rule sees its past as an unordered sum, its known weakness). The softmax layers of a hybrid use no
positions either (NoPE), as Kimi Linear's full-attention (MLA) layers do: their order comes from the linear
layers below them. So no layer has a learned table of `seqlen` rows, and the models run at any context
length; `seqlen` is only the training window.
"""
import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptlite import FeedForward, GPTlite, GPTliteConfig
from gptlite_kvcache import Block_KVCache
from gptlite_mla import Block_MLA, check_d_latent

RULES = ("linear", "gated", "delta", "kda")
HYBRID_ATTENTION = ("softmax", "mla")  # what the hybrid's full-attention blocks are
GATE_NORMALIZER = 16  # GLA's: log a_t = logsigmoid(.) / 16
KDA_DECAY_INIT = (1e-3, 1e-1)  # KDA's first decays: -log a_t of each channel log-uniform in this range (Mamba's dt)


def check_config(rule, hybrid_every, chunk_size=32, hybrid_attention="softmax", d_latent=None, mla_limits=None):
    """Clear errors for a bad layer configuration, before any weights are made. mla_limits: (n_heads, d_head,
    d_model), to check d_latent against MLA's full rank."""
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}: choose one of {', '.join(RULES)}")
    if hybrid_every is not None and (not isinstance(hybrid_every, int) or hybrid_every < 1):
        raise ValueError(f"hybrid_every must be None (no softmax layers) or an integer >= 1 (every n-th block "
                         f"keeps softmax attention), got {hybrid_every!r}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    if hybrid_attention not in HYBRID_ATTENTION:
        raise ValueError(f"unknown hybrid_attention {hybrid_attention!r}: choose one of {', '.join(HYBRID_ATTENTION)}")
    if hybrid_attention == "mla":
        if hybrid_every is None:
            raise ValueError("hybrid_attention='mla' needs hybrid_every (which blocks are MLA)")
        if mla_limits is not None:
            check_d_latent(*mla_limits, d_latent)
    elif d_latent is not None:
        raise ValueError(f"d_latent is MLA's: give it only with hybrid_attention='mla', got d_latent={d_latent!r}")


# ----------------------------------------------------------------------------------------------------
# The two forms. q, k: [B, H, T, d_k], v: [B, H, T, d_v]; log_a (log of the decay, <= 0): [B, H, T] (one
# decay per head) or [B, H, T, d_k] (one per key channel, KDA), or None (no decay); beta: [B, H, T] or None
# (no delta correction); S: [B, H, d_k, d_v] or None (zeros).

def per_channel(log_a, q):
    """Whether log_a has one decay per key channel ([..., T, d_k], KDA) rather than one per head ([..., T])."""
    return log_a is not None and log_a.dim() == q.dim()


def recurrent_step(q, k, v, log_a, beta, S):
    """One token: q, k [B, H, d_k], v [B, H, d_v], log_a [B, H] or [B, H, d_k] or None, beta [B, H] or None.
    Returns o [B, H, d_v], S."""
    if log_a is not None:  # a_t S_{t-1}, or Diag(a_t) S_{t-1}: row i of S (key channel i) decays by a_t[i]
        S = S * (log_a.exp()[..., None] if per_channel(log_a, q) else log_a.exp()[..., None, None])
    if beta is not None:  # write b_t (v_t - a_t S_{t-1}^T k_t): replace what k_t read, not add to it
        v = beta[..., None] * (v - torch.einsum("bhk,bhkv->bhv", k, S))
    S = S + k[..., :, None] * v[..., None, :]  # [B, H, d_k, d_v]
    return torch.einsum("bhk,bhkv->bhv", q, S), S


def recurrent(q, k, v, log_a=None, beta=None, S=None):
    """The reference form: recurrent_step over every token. Returns o [B, H, T, d_v] and the last S."""
    B, H, T, d_k = q.shape
    S = q.new_zeros(B, H, d_k, v.shape[-1]) if S is None else S
    out = []
    for t in range(T):
        o, S = recurrent_step(q[:, :, t], k[:, :, t], v[:, :, t], None if log_a is None else log_a[:, :, t],
                              None if beta is None else beta[:, :, t], S)
        out.append(o)
    return torch.stack(out, dim=2), S


SUBCHUNK = 8  # KDA's chunks are split into sub-chunks of up to this many tokens (see decayed_products)


def decayed_products(x, y, G):
    """sum_c x_ic y_jc e^{G_ic - G_jc} for j <= i (0 above the diagonal): x, y, G [..., C, d_k] -> [..., C, C].

    Written as (x_i e^{G_i}) . (y_j e^{-G_j}) it would be one matrix product, but e^{-G_j} overflows float32
    once a channel's decay since the chunk's start passes e^{-88}; a [C, C, d_k] tensor of the pairwise
    factors is stable but C times the memory traffic of the product (10x slower training here). So, as
    flash-linear-attention's chunked kernels do, the chunk is split into sub-chunks of c tokens:
    - a query i and a key j of an earlier sub-chunk: with R the last token before i's sub-chunk,
      (x_i e^{G_i - G_R}) . (y_j e^{G_R - G_j}), one matrix product; G decreases, so j <= R <= i makes
      both exponents <= 0;
    - i and j in the same sub-chunk: the pairwise factors e^{G_i - G_j} as a [c, c, d_k] tensor.
    Every exponent is <= 0 (or -inf where masked): exact, and no overflow at any decay."""
    *batch, C, d_k = x.shape
    c = max(d for d in range(1, min(C, SUBCHUNK) + 1) if C % d == 0)  # sub-chunk size, a divisor of C
    n = C // c
    Gs = G.reshape(*batch, n, c, d_k)  # [..., n, c, d_k]
    G_ref = torch.cat([torch.zeros_like(Gs[..., :1, 0, :]), Gs[..., :-1, -1, :]], dim=-2)  # [..., n, d_k]: G_R
    x_off = x.reshape(*batch, n, c, d_k) * (Gs - G_ref[..., None, :]).exp()  # [..., n, c, d_k]
    earlier = torch.arange(C, device=x.device) < torch.arange(n, device=x.device)[:, None] * c  # [n, C]: j <= R
    to_ref = (G_ref[..., :, None, :] - G[..., None, :, :]).masked_fill(~earlier[..., None], float("-inf"))
    y_off = y[..., None, :, :] * to_ref.exp()  # [..., n, C, d_k]: zero for keys at or after the sub-chunk
    off = (x_off @ y_off.transpose(-1, -2)).reshape(*batch, C, C)  # [..., C, C], zero on the diagonal blocks
    causal = torch.ones(c, c, dtype=torch.bool, device=x.device).tril()
    pairwise = (Gs[..., :, None, :] - Gs[..., None, :, :]).masked_fill(~causal[..., None], float("-inf")).exp()
    xs, ys = x.reshape(*batch, n, c, d_k), y.reshape(*batch, n, c, d_k)
    diag = (xs[..., :, None, :] * ys[..., None, :, :] * pairwise).sum(-1)  # [..., n, c, c]
    blocks = torch.eye(n, dtype=x.dtype, device=x.device)[:, None, :, None]  # [n, 1, n, 1]
    return off + (diag[..., :, :, None, :] * blocks).reshape(*batch, C, C)


def chunked(q, k, v, log_a=None, beta=None, S=None, chunk_size=32):
    """The parallel form, chunk by chunk. Returns o [B, H, T, d_v] and the last S, as `recurrent` does.

    Within a chunk, with G_i the cumulative log decay from the chunk's start to token i, and u_j the value
    token j writes (v_j without the delta rule):
        o_i   = e^{G_i} q_i^T S_0 + sum_{j <= i} e^{G_i - G_j} (q_i . k_j) u_j
        S_end = e^{G_C} S_0 + sum_j e^{G_C - G_j} k_j u_j^T
    The delta rule's u_i = b_i (v_i - e^{G_i} S_0^T k_i - sum_{j < i} e^{G_i - G_j} (k_i . k_j) u_j) is a
    unit lower-triangular system (I + A) U = b (V - e^G K S_0), solved for all chunks at once.

    With a decay per key channel (KDA), G_i is a vector [d_k] and every e^{G} multiplies channel by channel:
    e^{G_i} q_i, e^{G_C - G_j} k_j, and (q_i . k_j) e^{G_i - G_j} becomes sum_c q_ic k_jc e^{G_ic - G_jc}:
    see `decayed_products` for how that sum stays a matrix product without overflowing."""
    B, H, T, d_k = q.shape
    d_v, C = v.shape[-1], chunk_size
    S = q.new_zeros(B, H, d_k, d_v) if S is None else S
    channels = per_channel(log_a, q)
    log_a = q.new_zeros(B, H, T) if log_a is None else log_a
    pad = -T % C  # zero keys, values and steps after the end change neither the outputs nor the state
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        log_a = F.pad(log_a, (0, 0, 0, pad) if channels else (0, pad))
        beta = None if beta is None else F.pad(beta, (0, pad))
    N = (T + pad) // C
    q, k, v = (x.reshape(B, H, N, C, -1) for x in (q, k, v))  # [B, H, N, C, D]
    G = log_a.reshape(B, H, N, C, -1).cumsum(3)  # [B, H, N, C, d_k or 1]: per channel, or one per head
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    if channels:
        products = lambda x, y: decayed_products(x, y, G)  # noqa: E731
    else:  # e^{G_i - G_j}: [B, H, N, C, C]
        decay = (G[..., :, None, 0] - G[..., None, :, 0]).masked_fill(~causal, float("-inf")).exp()
        products = lambda x, y: (x @ y.transpose(-1, -2)) * decay  # noqa: E731
    scores = products(q, k)  # [B, H, N, C, C], zero above the diagonal
    q_from_start = q * G.exp()  # e^{G_i} q_i: reads S_0
    k_to_end = k * (G[..., -1:, :] - G).exp()  # e^{G_C - G_i} k_i: writes S_end
    if beta is not None:
        beta = beta.reshape(B, H, N, C, 1)
        A = (beta * products(k, k)).tril(-1)  # [B, H, N, C, C], strictly lower
        unit_lower = A + torch.eye(C, device=q.device, dtype=q.dtype)
        U_v = torch.linalg.solve_triangular(unit_lower, beta * v, upper=False, unitriangular=True)
        W_k = torch.linalg.solve_triangular(unit_lower, beta * k * G.exp(), upper=False,
                                            unitriangular=True)  # U = U_v - W_k S_0
    out = []
    for n in range(N):  # the only sequential part: the state passes from chunk to chunk
        U = v[:, :, n] if beta is None else U_v[:, :, n] - W_k[:, :, n] @ S  # [B, H, C, d_v]
        out.append(q_from_start[:, :, n] @ S + scores[:, :, n] @ U)
        S = G[:, :, n, -1, :, None].exp() * S + k_to_end[:, :, n].transpose(-1, -2) @ U
    return torch.stack(out, dim=2).reshape(B, H, N * C, d_v)[:, :, :T], S


# ----------------------------------------------------------------------------------------------------
# The layer, its block and the model.

class LinearAttention(nn.Module):
    """Multi-head linear attention with the projections of GPTlite's MultiHeadAttention (same names),
    plus per-head gate and step projections where the rule has them. Its cache is the state S."""

    def __init__(self, d_model, n_heads, d_head, dropout_p, rule, chunk_size=32):
        super().__init__()
        check_config(rule, None, chunk_size)
        self.n_heads, self.d_head, self.rule, self.chunk_size = n_heads, d_head, rule, chunk_size
        self.query_proj = nn.Linear(d_model, n_heads * d_head)
        self.key_proj = nn.Linear(d_model, n_heads * d_head)
        self.value_proj = nn.Linear(d_model, n_heads * d_head)
        self.out_proj = nn.Linear(n_heads * d_head, d_model)
        self.dropout = nn.Dropout(dropout_p)
        if rule in ("gated", "delta"):
            self.gate_proj = nn.Linear(d_model, n_heads)  # a_t, one per head
        if rule in ("delta", "kda"):
            self.beta_proj = nn.Linear(d_model, n_heads)  # b_t, one per head
        if rule == "kda":  # a_t, one per head and key channel: log a_t = -e^{A_h} softplus(W_up W_down x + dt)
            self.gate_down = nn.Linear(d_model, d_head, bias=False)  # low rank (d_head), as KDA's
            self.gate_up = nn.Linear(d_head, n_heads * d_head, bias=False)
            self.A_log = nn.Parameter(torch.zeros(n_heads))  # e^{A_h} = 1 at the start, one rate per head
            low, high = KDA_DECAY_INIT  # softplus(dt) = -log a_t while W x is near 0: decays of 0.90 .. 0.999
            dt = torch.empty(n_heads * d_head).uniform_(math.log(low), math.log(high)).exp()
            self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus's inverse

    def split_heads(self, x):
        B, T, _ = x.shape  # [B, T, H*D]
        return x.view(B, T, -1, self.d_head).transpose(1, 2)  # [B, H, T, D]

    def state_shape(self, batch_size):
        """The cache of one sequence batch: [B, H, d_k, d_v] (d_v + 1 with the linear rule's normalizer)."""
        return (batch_size, self.n_heads, self.d_head, self.d_head + (self.rule == "linear"))

    def inputs(self, x):
        """q, k, v [B, H, T, D], log a [B, H, T] ([B, H, T, D] for KDA) and b [B, H, T] (None where the rule
        has none) of x [B, T, d_model]."""
        q, k, v = (self.split_heads(proj(x)) for proj in (self.query_proj, self.key_proj, self.value_proj))
        log_a = beta = None
        if self.rule == "linear":
            q, k = F.elu(q) + 1, F.elu(k) + 1  # positive features: a positive normalizer
            v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # the normalizer z as a value column of 1
        else:
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)  # unit-norm keys (the delta rule needs them)
        if self.rule in ("gated", "delta"):
            log_a = (F.logsigmoid(self.gate_proj(x)) / GATE_NORMALIZER).transpose(1, 2)  # [B, H, T]
        elif self.rule == "kda":
            rate = F.softplus(self.gate_up(self.gate_down(x)) + self.dt_bias)  # [B, T, H*D], > 0
            log_a = -self.A_log.exp()[:, None, None] * self.split_heads(rate)  # [B, H, T, D], < 0
        if self.rule in ("delta", "kda"):
            beta = torch.sigmoid(self.beta_proj(x)).transpose(1, 2)  # [B, H, T]
        return q, k, v, log_a, beta

    def output(self, o):
        """The heads' outputs [B, H, T, d_v(+1)] -> [B, T, d_model]."""
        if self.rule == "linear":
            o = o[..., :-1] / (o[..., -1:] + 1e-6)  # S q / (z . q)
        else:
            o = F.rms_norm(o, (self.d_head,))
        B, _, T, _ = o.shape
        return self.dropout(self.out_proj(o.transpose(1, 2).reshape(B, T, -1)))

    def forward(self, x, state=None, form=None):
        """x: [B, T, d_model] new tokens after `state` ([B, H, d_k, d_v(+1)], None: empty). form: "chunked",
        "recurrent", or None (recurrent for one token, the decode step; chunked otherwise).
        Returns the output [B, T, d_model] and the new state."""
        q, k, v, log_a, beta = self.inputs(x)
        if state is not None and tuple(state.shape) != self.state_shape(x.shape[0]):
            raise ValueError(f"the state has shape {tuple(state.shape)}, this layer and batch need "
                             f"{self.state_shape(x.shape[0])}; start with state=None")
        form = form or ("recurrent" if x.shape[1] == 1 else "chunked")
        if form == "recurrent":
            o, state = recurrent(q, k, v, log_a, beta, state)
        elif form == "chunked":
            o, state = chunked(q, k, v, log_a, beta, state, self.chunk_size)
        else:
            raise ValueError(f"form must be 'chunked' or 'recurrent', got {form!r}")
        return self.output(o), state


class LinearBlock(nn.Module):
    """GPTlite's pre-LayerNorm block with linear attention; returns the new state beside x."""

    def __init__(self, d_model, n_heads, d_head, dropout_p, rule, d_ff=None, chunk_size=32):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.mha = LinearAttention(d_model, n_heads, d_head, dropout_p, rule, chunk_size)
        self.ln2 = nn.LayerNorm(d_model)
        self.ffwd = FeedForward(d_model, dropout_p, d_ff)

    def forward(self, x, state=None, form=None):
        out, state = self.mha(self.ln1(x), state, form)
        x = x + out
        return x + self.ffwd(self.ln2(x)), state


def is_softmax_block(layer, hybrid_every):
    """Every hybrid_every-th block (the 4th, 8th, ... for 4: Kimi Linear's 3 linear to 1 softmax); its
    attention is softmax over all tokens, with a KV cache or (hybrid_attention "mla") a latent cache."""
    return hybrid_every is not None and (layer + 1) % hybrid_every == 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearConfig(GPTliteConfig):
    rule: str = "delta"       # the state's update rule, one of RULES
    hybrid_every: int | None = None  # every hybrid_every-th block keeps softmax attention; None: none does
    chunk_size: int = 32      # tokens per chunk of the chunked form
    hybrid_attention: str = "softmax"  # those blocks' attention: "softmax" (KV cache) or "mla" (latent cache)
    d_latent: int | None = None  # values of the latent an MLA block caches per token (hybrid_attention "mla")

    def to_dict(self):
        """GPTliteConfig's dict with rule and hybrid_every; chunk_size, hybrid_attention and d_latent only when
        they are not the defaults (the older checkpoints of main_linear_attention.py store none)."""
        kwargs = super().to_dict()
        for name, default in (("chunk_size", 32), ("hybrid_attention", "softmax"), ("d_latent", None)):
            if kwargs[name] == default:
                del kwargs[name]
        return kwargs


class GPTlite_Linear(GPTlite):
    """GPTlite with linear attention blocks, no position embedding (see the module docstring); with
    `hybrid_every`, every hybrid_every-th block keeps softmax attention: with its KV cache (Block_KVCache,
    without a window), or with hybrid_attention="mla" as multi-head latent attention caching d_latent values
    per token (Block_MLA; Kimi Linear's KDA + MLA). The state-dict names of the shared parts are GPTlite's."""
    config_class = LinearConfig

    def __init__(self, vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, d_ff=None,
                 rule="delta", hybrid_every=None, chunk_size=32, hybrid_attention="softmax", d_latent=None):
        check_config(rule, hybrid_every, chunk_size, hybrid_attention, d_latent, (n_heads, d_head, d_model))
        super().__init__(vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, d_ff)
        del self.position_embedding  # no positions: see the module docstring
        self.config = LinearConfig(vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, d_ff,
                                   rule=rule, hybrid_every=hybrid_every, chunk_size=chunk_size,
                                   hybrid_attention=hybrid_attention, d_latent=d_latent)

        def attention_block():
            if hybrid_attention == "mla":
                return Block_MLA(d_model, n_heads, d_head, dropout_p, d_latent, d_ff)
            return Block_KVCache(d_model, n_heads, d_head, dropout_p, d_ff)
        self.blocks = nn.Sequential(*[
            attention_block() if is_softmax_block(i, hybrid_every)
            else LinearBlock(d_model, n_heads, d_head, dropout_p, rule, d_ff, chunk_size) for i in range(n_layers)])
        self.apply(self._init_weights)

    def forward(self, idx, cache=None, form=None):
        """idx: [B, T] new tokens after `cache` (None: the start of the sequences), of any length.
        cache: per block, the state S of a linear block, the (keys, values) of a softmax block or the
        (latents,) of an MLA block.
        form: the linear layers' form (None: recurrent for one token, chunked otherwise).
        Returns logits [B, T, vocab] and the new cache."""
        if cache is not None and len(cache) != self.config.n_layers:
            raise ValueError(f"the cache has {len(cache)} layers, the model {self.config.n_layers}; "
                             "start with cache=None")
        x = self.token_embedding(idx)  # [B, T, d_model], no position embedding
        new_cache = []
        for layer, block in enumerate(self.blocks):
            layer_cache = None if cache is None else cache[layer]
            if isinstance(block, Block_KVCache):
                x, layer_cache = block(x, layer_cache)  # no max_seqlen: NoPE attention has no window
            else:
                x, layer_cache = block(x, layer_cache, form)
            new_cache.append(layer_cache)
        return self.fc_out(self.ln(x)), new_cache


def linear_config(config, rule, hybrid_every=None, hybrid_attention="softmax", d_latent=None):
    """The constructor arguments of a GPTlite_Linear from a preset's GPTlite config (hybrid_attention and
    d_latent only for an MLA hybrid, so that the other configs match the checkpoints saved without them)."""
    mla = dict(hybrid_attention=hybrid_attention, d_latent=d_latent) if hybrid_attention != "softmax" else {}
    return dict(config, rule=rule, hybrid_every=hybrid_every, **mla)
