"""GPTlite with mixture-of-experts feed-forward layers (part 2 of the post: architectures built for fast
inference). Each block's MLP becomes E experts of the same shape and a router that sends every token to
k of them, so a token runs k experts' weights while the model holds E.

- Router: softmax over the experts, top-k, the k weights renormalised (Mixtral's); or DeepSeek-V3's
  sigmoid scores, where a selection-only bias (no gradient, nudged towards balance after each training
  step: `update_selection_bias`) picks the experts and the unbiased scores weigh them.
- Capacity (GShard, fairscale's top2gate): with a capacity factor f, expert e takes at most
  ceil(f * N * k / E) of the N tokens' k assignments, first choices before second choices, earlier tokens
  first; an assignment past it is dropped (its weight 0, counted in `routing.dropped`).
- Load-balancing loss (Switch Transformer): E * sum_e f_e P_e, f_e the share of assignments routed to
  expert e and P_e its mean router probability.
- An optional shared expert that every token runs (DeepSeek-MoE).
- `dense_forward`: every expert on every token, combined with a [N, E] weight matrix that is zero where a
  token was not routed: the reference the sparse path must equal.

The sparse path has two forms with the same result: at decode (few assignments, N * k <= E) each token
gathers its k experts' weights (gpt-fast's Mixtral); otherwise the assignments are sorted by expert and each
expert runs once on its tokens (fairscale's and MegaBlocks' grouping).

GPTlite_MoE is a GPTlite_KVCache (forward(idx, kv_cache, max_seqlen) -> (logits, cache)): the KV cache,
prefill, decode_n_tokens and StaticKVCache work with it unchanged. A capacity applies to the tokens of one
forward pass, so with a capacity factor a decode step (N = batch) routes differently from a full pass; the
timed model is dropless (capacity None), as Mixtral and DeepSeek-V3 serve.

The last forward pass's routing (loads, dropped assignments, the auxiliary loss) is kept on each layer as
`routing`, for the training loss and the script's load histograms.
"""
import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptlite import FeedForward, GPTliteConfig
from gptlite_kvcache import GPTlite_KVCache
from lib.errors import GPTliteError

ROUTERS = ("softmax", "sigmoid")


class RouterError(GPTliteError):
    """The router produced non-finite scores: training diverged in the gate."""


@dataclasses.dataclass
class Routing:
    load: torch.Tensor       # [E] assignments each expert received (after capacity)
    dropped: int             # assignments past an expert's capacity
    aux_loss: torch.Tensor   # the load-balancing loss of this pass (a scalar with gradient; None without grad)


def check_moe_args(n_experts, top_k, capacity_factor, router):
    if not isinstance(n_experts, int) or n_experts < 1:
        raise ValueError(f"n_experts must be a positive integer, got {n_experts!r}")
    if not isinstance(top_k, int) or not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k must be between 1 and n_experts={n_experts}, got {top_k!r}")
    if capacity_factor is not None and not (isinstance(capacity_factor, (int, float)) and 0 < capacity_factor < math.inf):
        raise ValueError(f"the capacity factor must be a finite number > 0 (None: no capacity), got {capacity_factor!r}")
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")


def within_capacity(experts, keys, n_experts, capacity):
    """Which assignments an expert takes: those among the first `capacity` of its queue, the queue ordered by
    `keys` (distinct integers). experts, keys: [A] -> kept [A] (bool). The one capacity rule of the single
    process and of an expert-parallel rank (which sees the assignments of every rank, with global keys)."""
    order = torch.argsort(experts * (int(keys.max()) + 1) + keys) if len(keys) else keys  # by expert, then key
    counts = torch.bincount(experts, minlength=n_experts)
    first = torch.cumsum(counts, 0) - counts  # where each expert's queue starts in `order`
    position = torch.empty_like(order)
    position[order] = torch.arange(len(order), device=order.device) - first[experts[order]]
    return position < capacity


class MoEFeedForward(nn.Module):
    def __init__(self, d_model, d_expert, n_experts=8, top_k=2, capacity_factor=None, router="softmax",
                 shared_expert=False, dropout_p=0.0):
        super().__init__()
        check_moe_args(n_experts, top_k, capacity_factor, router)
        self.n_experts, self.top_k, self.capacity_factor, self.router = n_experts, top_k, capacity_factor, router
        self.gate = nn.Linear(d_model, n_experts, bias=False)
        self.register_buffer("selection_bias", torch.zeros(n_experts))  # sigmoid router: selection only
        self.w_in = nn.Parameter(torch.randn(n_experts, d_model, d_expert) * 0.02)  # [E, d, h]
        self.b_in = nn.Parameter(torch.zeros(n_experts, d_expert))
        self.w_out = nn.Parameter(torch.randn(n_experts, d_expert, d_model) * 0.02)  # [E, h, d]
        self.b_out = nn.Parameter(torch.zeros(n_experts, d_model))
        self.shared = FeedForward(d_model, dropout_p, d_expert) if shared_expert else None
        self.dropout = nn.Dropout(dropout_p)
        self.routing = None
        self.dense = False  # True: forward runs dense_forward (the reference)

    def capacity(self, n_tokens):
        if self.capacity_factor is None:
            return n_tokens  # an expert can take every token once
        return math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts)

    def select(self, x):
        """The router without capacity: x [N, d] -> experts [N, k], their weights [N, k] (renormalised over the
        k) and the router probabilities [N, E] (of the balancing loss)."""
        logits = self.gate(x)  # [N, E]
        if not torch.isfinite(logits).all():
            raise RouterError("the router produced non-finite scores (training diverged in the gate); lower the "
                              "learning rate or the auxiliary loss weight. Nothing was saved.")
        if self.router == "softmax":
            probs = F.softmax(logits, dim=-1)
            weights, experts = probs.topk(self.top_k, dim=-1)
        else:  # DeepSeek-V3: sigmoid affinities, the bias only chooses
            scores = torch.sigmoid(logits)
            experts = (scores + self.selection_bias).topk(self.top_k, dim=-1).indices
            weights = scores.gather(1, experts)
            probs = scores / scores.sum(dim=-1, keepdim=True)
        return experts, weights / weights.sum(dim=-1, keepdim=True), probs

    def route(self, x):
        """x [N, d] -> experts [N, k], weights [N, k] (0 for a dropped assignment); sets self.routing."""
        experts, weights, probs = self.select(x)
        N, E = x.shape[0], self.n_experts
        if self.capacity_factor is None:  # dropless: every assignment kept (inference's common case)
            load, dropped = torch.bincount(experts.reshape(-1), minlength=E), 0
        else:
            # GShard's queue order: every token's first choice, then every second choice, ...: key j * N + t
            key = torch.arange(self.top_k * N, device=x.device).reshape(self.top_k, N).t()  # [N, k]
            kept = within_capacity(experts.reshape(-1), key.reshape(-1), E, self.capacity(N)).reshape(N, self.top_k)
            weights = weights * kept
            load, dropped = torch.bincount(experts[kept], minlength=E), int((~kept).sum())
        aux_loss = None
        if torch.is_grad_enabled():  # training: Switch's balancing loss, E * sum_e f_e P_e
            share = torch.bincount(experts.reshape(-1), minlength=E).to(probs.dtype) / (N * self.top_k)  # f_e
            aux_loss = E * (share * probs.mean(dim=0)).sum()
        self.routing = Routing(load=load.detach(), dropped=dropped, aux_loss=aux_loss)
        return experts, weights

    def expert(self, e, x):
        """Expert e on tokens x [n, d]: ReLU MLP, as GPTlite's FeedForward."""
        return F.relu(x @ self.w_in[e] + self.b_in[e]) @ self.w_out[e] + self.b_out[e]

    def forward(self, x):
        """x [B, S, d] -> [B, S, d]: each token through its k experts only."""
        if self.dense:
            return self.dense_forward(x)
        flat = x.reshape(-1, x.shape[-1])  # [N, d]
        experts, weights = self.route(flat)
        return self.finish(self.combine(flat, experts, weights), flat, x.shape)

    def combine(self, flat, experts, weights):
        """sum_j weights[:, j] * expert_{experts[:, j]}(flat): [N, d]."""
        if experts.numel() <= self.n_experts:  # decode: fewer assignments than experts
            return self.gathered(flat, experts, weights)
        return self.grouped(flat, experts.reshape(-1), weights.reshape(-1))

    def gathered(self, flat, experts, weights):
        """Each token with its own k experts' weights, gathered: [N, k, d, h] (gpt-fast's decode path)."""
        hidden = F.relu(torch.einsum("nd,nkdh->nkh", flat, self.w_in[experts]) + self.b_in[experts])  # [N, k, h]
        outputs = torch.einsum("nkh,nkhd->nkd", hidden, self.w_out[experts]) + self.b_out[experts]  # [N, k, d]
        return (outputs * weights[..., None]).sum(dim=1)  # a dropped assignment has weight 0

    def grouped(self, flat, experts, weights):
        """The N*k assignments (experts, weights [N*k], token-major), the dropped ones (weight 0) left out."""
        kept = torch.nonzero(weights > 0)[:, 0]
        token = kept // self.top_k
        out = torch.zeros_like(flat)
        return out.index_add_(0, token, self.expert_outputs(flat[token], experts[kept]) * weights[kept, None])

    def expert_outputs(self, x, experts):
        """Row i of x [A, d] through this layer's expert experts[i]: [A, d]. The rows are sorted by expert and
        each expert runs once on its own (fairscale's and MegaBlocks' grouping)."""
        order = experts.argsort(stable=True)
        counts = torch.bincount(experts, minlength=len(self.w_in)).tolist()
        out = torch.empty_like(x)
        for e, rows in enumerate(torch.split(order, counts)):
            if len(rows):
                out[rows] = self.expert(e, x[rows])
        return out

    def dense_forward(self, x):
        """The reference: every expert on every token, [E, N, d], combined by a [N, E] matrix of the routing
        weights (zero where a token was not sent, or was dropped)."""
        flat = x.reshape(-1, x.shape[-1])
        experts, weights = self.route(flat)
        combine = torch.zeros(flat.shape[0], self.n_experts, dtype=flat.dtype, device=flat.device)
        combine.scatter_add_(1, experts, weights)  # [N, E]
        hidden = F.relu(torch.einsum("nd,edh->enh", flat, self.w_in) + self.b_in[:, None])  # [E, N, h]
        outputs = torch.einsum("enh,ehd->end", hidden, self.w_out) + self.b_out[:, None]  # [E, N, d]
        return self.finish(torch.einsum("ne,end->nd", combine, outputs), flat, x.shape)

    def finish(self, out, flat, shape):
        if self.shared is not None:
            out = out + self.shared(flat)
        return self.dropout(out).reshape(shape)

    @torch.no_grad()
    def update_selection_bias(self, rate):
        """DeepSeek-V3's auxiliary-loss-free balancing, after a training step: raise the bias of the experts
        that received fewer assignments than the mean, lower the others', by `rate`."""
        load = self.routing.load.to(self.selection_bias.dtype)
        self.selection_bias += rate * torch.sign(load.mean() - load)


@dataclasses.dataclass(frozen=True)
class GPTliteMoEConfig(GPTliteConfig):
    n_experts: int = 8
    top_k: int = 2
    d_expert: int | None = None  # each expert's hidden width; None: d_ff (4 * d_model), an expert = GPTlite's MLP
    capacity_factor: float | None = None
    router: str = "softmax"
    shared_expert: bool = False

    def __post_init__(self):
        super().__post_init__()
        check_moe_args(self.n_experts, self.top_k, self.capacity_factor, self.router)
        if self.d_expert is None:
            object.__setattr__(self, "d_expert", self.d_ff)


class GPTlite_MoE(GPTlite_KVCache):
    """GPTlite_KVCache whose blocks' `ffwd` are MoEFeedForward layers; everything else is GPTlite's."""
    config_class = GPTliteMoEConfig

    def __init__(self, vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, d_ff=None, n_experts=8,
                 top_k=2, d_expert=None, capacity_factor=None, router="softmax", shared_expert=False):
        super().__init__(vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, d_ff)
        self.config = GPTliteMoEConfig(vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, d_ff,
                                       n_experts, top_k, d_expert, capacity_factor, router, shared_expert)
        for block in self.blocks:
            block.ffwd = MoEFeedForward(d_model, self.config.d_expert, n_experts, top_k, capacity_factor, router,
                                        shared_expert, dropout_p)
        self.apply(self._init_weights)  # the gate and the shared expert like GPTlite's linears

    def moe_layers(self):
        return [block.ffwd for block in self.blocks]

    def dense_reference(self, dense=True):
        """Every MoE layer runs its dense reference (every expert on every token, masked) until called with
        dense=False. Returns the model."""
        for layer in self.moe_layers():
            layer.dense = dense
        return self

    def set_capacity_factor(self, capacity_factor):
        """Every layer's capacity factor (None: dropless), checked; the config says the same."""
        check_moe_args(self.config.n_experts, self.config.top_k, capacity_factor, self.config.router)
        for layer in self.moe_layers():
            layer.capacity_factor = capacity_factor
        self.config = dataclasses.replace(self.config, capacity_factor=capacity_factor)
        return self

    def aux_loss(self):
        """The load-balancing loss of the last forward pass, summed over layers."""
        return sum(layer.routing.aux_loss for layer in self.moe_layers())
