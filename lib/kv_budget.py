"""KV budgets: which cached tokens a decode step attends to, without retraining.

Blog section: "Sparse attention" (main_sparse_attention.py). One interface, three
hooks that a method overrides; `BudgetCache`, a cache of gptlite_kvcache's interface, calls them in
every layer of the model's own cached forward pass (GPTlite's, or GPTlite_RoPE's):
- `select(q, k)`: the entries this decode step reads (a mask; Quest), None: all of them;
- `observe(kv, q, weights)`: bookkeeping after the step (H2O's accumulated attention, SnapKV's queries);
- `keep(kv)`: the entries kept for the next step (eviction), None: all of them.
A method keeps `budget - 1` entries after each step, so that with the next token's own entry a step
attends to at most `budget` entries per layer and head. Prefill (a prompt of T > 1 tokens) is dense, as in
the papers; the budget applies from its end on. A budget at least the context length evicts nothing and
gives exactly dense attention.

- SlidingWindow: the last `budget` tokens.
- StreamingLLM (Xiao et al. 2023): `n_sink` first tokens plus the last `budget - n_sink`.
- H2O (Zhang et al. 2023): heavy hitters by accumulated attention weight plus a recent window; evicted is gone.
- SnapKV (Li et al. 2024): the attention of the last `window` queries (the observation window), summed and
  pooled, picks the older entries kept per head, plus the window. SnapKV compresses once, at the end of the
  prompt; to hold the budget while decoding it is applied again whenever the cache overflows.
- Quest (Tang et al. 2024): keeps every entry, in pages of `page_size`; a query bounds each page's scores
  by sum_i max(q_i * kmin_i, q_i * kmax_i) and reads the top budget // page_size pages (the newest always).
"""
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gptlite_kvcache import KVCache, generate_kvcache, kv_cache_view


@dataclass
class LayerKV:
    keys: torch.Tensor       # [B, H, n, D] (a rotary model's keys before rotation)
    values: torch.Tensor     # [B, H, n, D]
    score: torch.Tensor = None    # H2O: attention each entry received so far, [B, H, n]
    queries: torch.Tensor = None  # SnapKV: the last `window` queries, [B, H, w, D]


class AttentionMass:
    """Opt-in statistic of a BudgetCache (attention sinks): the attention weight of a decode step's
    query on the first `n_first` entries, summed over decode steps per layer (mean over batch and heads),
    beside what equal weights over the entries read would give. Kept as tensors on the model's device:
    no synchronization in the decode loop; read `first_mass` when done."""

    def __init__(self, n_layers, n_first=4):
        self.n_first = n_first
        self.mass = [0.0] * n_layers  # float64 tensors once a step is seen (sums as Python floats would)
        self.first_uniform = 0.0
        self.n_steps = 0

    def observe(self, layer, weights):  # weights [B, H, 1, n] of a decode step
        self.mass[layer] = self.mass[layer] + weights[:, :, -1, :self.n_first].sum(dim=-1).mean().double()

    def step(self, n):  # a decode step over n entries
        self.n_steps += 1
        self.first_uniform += min(self.n_first, n) / n  # equal weights over the n entries held

    @property
    def first_mass(self):  # per layer, summed over decode steps
        return [float(m) for m in self.mass]


class BudgetCache(KVCache):
    """A KV cache under a budget: per-layer LayerKV (entries differ per head after eviction), and the
    tokens seen so far. `method` decides what is read and kept (default Dense); max_seqlen: the model's
    window, past which the oldest entry is dropped (set by the functions below from the model).
    n_first: collect AttentionMass over the first n_first entries in `stats` (None: no statistics).
    keep_weights: keep each layer's attention weights of the last pass in `weights` (attention_on_first)."""

    def __init__(self, n_layers, n_first=None, method=None, max_seqlen=None, keep_weights=False):
        self.layers = [None] * n_layers
        self.weights = [None] * n_layers if keep_weights else None  # the last pass's weights per layer
        self.n_tokens = 0
        self.method = method or Dense()
        self.max_seqlen = max_seqlen
        self.stats = None if n_first is None else AttentionMass(n_layers, n_first)
        self.n_read = 0  # entries the last step attended to

    def __len__(self):
        return 0 if self.layers[0] is None else self.layers[0].keys.shape[2]

    def use(self, method, model):
        """Run `method` on this cache with the window of `model`; returns the cache."""
        self.method, self.max_seqlen = method, self.max_seqlen or model.seqlen
        return self

    def check_new_tokens(self, T):
        if self.max_seqlen is None:
            raise ValueError("this BudgetCache has no window yet: run it with kv_budget's functions, or call "
                             "cache.use(method, model) first")
        if T > 1 and len(self) + T > self.max_seqlen:
            raise ValueError(f"{len(self)} cached + {T} new tokens exceed seqlen={self.max_seqlen}: feed them one "
                             "at a time")

    def update(self, layer, k, v):
        """Append the new entries (a new entry has received no attention yet); a full window drops its
        oldest (dense, Quest). The mask is the method's, chosen in attend from the query."""
        kv, T = self.layers[layer], k.shape[2]
        if kv is None:
            kv = LayerKV(k, v)
        else:
            score = None if kv.score is None else F.pad(kv.score, (0, T))
            kv = LayerKV(torch.cat([kv.keys, k], dim=2), torch.cat([kv.values, v], dim=2), score, kv.queries)
        if kv.keys.shape[2] > self.max_seqlen:
            kv = gather(kv, last_entries(kv, self.max_seqlen))
        self.layers[layer] = kv
        return kv.keys, kv.values, None

    def attend(self, layer, attention, q, K, V, mask):
        """Prefill (T > 1) is dense, with the shifted causal mask; a decode step reads the method's
        selection. Methods read the attention weights, so the attention is the explicit one (`attend`)
        whatever the model's kernel; then the method observes and evicts."""
        T, n = q.shape[2], K.shape[2]
        if T > 1:
            mask = torch.ones(T, n, dtype=torch.bool, device=q.device).tril(diagonal=n - T)
        else:
            mask = self.method.select(q, K)
        out, weights = attend(q, K, V, mask)  # [B, H, T, D], [B, H, T, n]
        if self.weights is not None:
            self.weights[layer] = weights
        if self.stats is not None and T == 1:
            self.stats.observe(layer, weights)
        kv = self.layers[layer]
        self.method.observe(kv, q, weights)
        idx_keep = self.method.keep(kv)
        self.layers[layer] = kv if idx_keep is None else gather(kv, idx_keep)
        self.n_read = n
        return out

    def advance(self, T):
        self.n_tokens += T
        if self.stats is not None and T == 1:
            self.stats.step(self.n_read)

    def __getattr__(self, name):
        """The statistics as main_sparse_attention reads them (BudgetCache(n_layers, n_first=...)): first_mass,
        first_uniform, n_steps, n_first are the stats' own."""
        if name in ("first_mass", "first_uniform", "n_steps", "n_first"):
            return getattr(self.__dict__.get("stats"), name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")


def gather(kv, idx):
    """The entries idx [B, H, m] of kv, per head (score follows its entries; queries are not entries)."""
    take = lambda x: x.gather(2, idx[..., None].expand(-1, -1, -1, x.shape[-1]))  # noqa: E731
    score = None if kv.score is None else kv.score.gather(2, idx)
    return LayerKV(take(kv.keys), take(kv.values), score, kv.queries)


def last_entries(kv, m):
    """Indices [B, H, m] of the m newest entries."""
    B, H, n, _ = kv.keys.shape
    return torch.arange(n - m, n, device=kv.keys.device).expand(B, H, m)


def check_budget(budget, least=1, what=""):
    if not isinstance(budget, int) or budget < least:
        raise ValueError(f"budget must be an integer of at least {least}{what}, got {budget!r}")


class Dense:
    """Every entry kept and read: the reference."""
    name = "dense"
    budget = None

    def select(self, q, k):  # q [B, H, 1, D], k [B, H, n, D] -> bool mask [B, H, 1, n] or None (all)
        return None

    def observe(self, kv, q, weights):  # q [B, H, T, D], weights [B, H, T, n]
        pass

    def keep(self, kv):  # -> indices [B, H, m] of the entries kept, or None (all)
        return None


class SlidingWindow(Dense):
    name = "window"

    def __init__(self, budget):
        check_budget(budget)
        self.budget = budget

    def keep(self, kv):
        n = kv.keys.shape[2]
        return None if n < self.budget else last_entries(kv, self.budget - 1)


class StreamingLLM(Dense):
    name = "sinks"

    def __init__(self, budget, n_sink=4):
        if not isinstance(n_sink, int) or n_sink < 0:
            raise ValueError(f"n_sink must be a non-negative integer, got {n_sink!r}")
        check_budget(budget, n_sink + 1, f" (n_sink={n_sink} sinks and at least the new token); "
                                         "raise the budget or lower n_sink")
        self.budget, self.n_sink = budget, n_sink

    def keep(self, kv):
        n = kv.keys.shape[2]
        if n < self.budget:
            return None
        recent = last_entries(kv, self.budget - 1 - self.n_sink)
        sinks = torch.arange(self.n_sink, device=recent.device).expand(*recent.shape[:2], self.n_sink)
        return torch.cat([sinks, recent], dim=2)


class H2O(Dense):
    name = "H2O"

    def __init__(self, budget, recent_ratio=0.5):
        check_budget(budget)
        self.budget, self.recent_ratio = budget, recent_ratio

    def observe(self, kv, q, weights):
        received = weights.sum(dim=2)  # [B, H, n]: attention each entry got from this step's queries
        kv.score = received if kv.score is None else kv.score + received

    def keep(self, kv):
        n, m = kv.keys.shape[2], self.budget - 1
        if n <= m:
            return None
        n_recent = math.ceil(m * self.recent_ratio)
        heavy = kv.score[..., :n - n_recent].topk(m - n_recent, dim=-1).indices.sort(dim=-1).values  # [B, H, m-r]
        return torch.cat([heavy, last_entries(kv, n_recent)], dim=2)


class SnapKV(Dense):
    name = "SnapKV"

    def __init__(self, budget, window=8, kernel_size=5):
        check_budget(budget)
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be a positive odd integer, got {kernel_size}")
        self.budget, self.window, self.kernel_size = budget, window, kernel_size

    def observe(self, kv, q, weights):
        queries = q if kv.queries is None else torch.cat([kv.queries, q], dim=2)
        kv.queries = queries[:, :, -self.window:]  # [B, H, <=window, D]

    def keep(self, kv):
        n, m = kv.keys.shape[2], self.budget - 1
        if n <= m:
            return None
        w = min(self.window, kv.queries.shape[2], m)  # the observation window, kept as a whole
        obs = kv.queries[:, :, kv.queries.shape[2] - w:]  # [B, H, w, D], the queries of the last w entries
        scores = obs @ kv.keys.transpose(-2, -1) / obs.shape[-1] ** 0.5  # [B, H, w, n]
        causal = torch.ones(w, n, dtype=torch.bool, device=obs.device).tril(diagonal=n - w)
        votes = F.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)[..., :n - w].sum(dim=2)  # [B, H, n-w]
        B, H, _ = votes.shape
        pooled = F.avg_pool1d(votes.reshape(B * H, 1, -1), self.kernel_size, stride=1,
                              padding=self.kernel_size // 2, count_include_pad=False).view(B, H, -1)
        picked = pooled.topk(m - w, dim=-1).indices.sort(dim=-1).values  # [B, H, m-w]
        return torch.cat([picked, last_entries(kv, w)], dim=2)


def page_bounds(q, k, page_size):
    """Quest's upper bound of q·k within each page: sum_i max(q_i kmin_i, q_i kmax_i).

    q [B, H, 1, D], k [B, H, n, D] -> [B, H, ceil(n / page_size)]; the last page may be partial."""
    B, H, n, D = k.shape
    n_pages = -(-n // page_size)
    pad = n_pages * page_size - n  # repeat the last key: a page's min and max stay its own
    pages = F.pad(k, (0, 0, 0, pad), mode="replicate").view(B, H, n_pages, page_size, D)
    kmin, kmax = pages.amin(dim=3), pages.amax(dim=3)  # [B, H, P, D]: the per-page metadata Quest stores
    return torch.maximum(q * kmin, q * kmax).sum(dim=-1)  # q [B, H, 1, D] broadcasts: [B, H, P]


class Quest(Dense):
    name = "Quest"

    def __init__(self, budget, page_size=8):
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
        check_budget(budget, page_size, f" (one page of page_size={page_size}); raise it or use smaller pages")
        self.budget, self.page_size = budget, page_size

    def select(self, q, k):
        n, top = k.shape[2], self.budget // self.page_size
        bounds = page_bounds(q, k, self.page_size)  # [B, H, P]
        if bounds.shape[-1] <= top:
            return None
        bounds[..., -1] = float("inf")  # the newest page (the current token's) is always read
        pages = torch.zeros_like(bounds, dtype=torch.bool).scatter_(-1, bounds.topk(top, dim=-1).indices, True)
        return pages.repeat_interleave(self.page_size, dim=-1)[..., None, :n]  # [B, H, 1, n]


METHODS = {"window": SlidingWindow, "sinks": StreamingLLM, "H2O": H2O, "SnapKV": SnapKV, "Quest": Quest}


def make_method(name, budget, n_sink=4, page_size=8):
    """The method `name` (dense, or one of METHODS) at `budget`; bad settings raise before any work."""
    if name == "dense":
        return Dense()
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose dense or one of {', '.join(METHODS)}")
    extra = {"sinks": dict(n_sink=n_sink), "Quest": dict(page_size=page_size)}.get(name, {})
    return METHODS[name](budget, **extra)


# ----------------------------------------------------------------------------------------------------
# The model's own cached forward pass with a BudgetCache: GPTlite (absolute positions, clamped at
# seqlen-1 past the window as in gptlite_kvcache) or GPTlite_RoPE (a key rotated by its slot in the cache).

def attend(Q, K, V, mask):
    """The explicit attention of gptlite_kvcache, returning its weights. mask: bool, True = attend."""
    scores = Q @ K.transpose(-2, -1) / Q.shape[-1] ** 0.5  # [B, H, T, n]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = F.softmax(scores, dim=-1)  # [B, H, T, n]
    return weights @ V, weights


def forward_budget(model, idx, cache, method):
    """idx [B, T] new tokens after the cache's; returns logits [B, T, vocab]; `cache` is updated in place."""
    logits, _ = kv_cache_view(model)(idx, kv_cache=cache.use(method, model))
    return logits


@torch.inference_mode()
def generate_budget(model, prompt, n_tokens, method):
    """Greedy decoding as generate_kvcache, attending within `method`'s budget. Returns [B, S + n_tokens]."""
    cache = BudgetCache(model.config.n_layers).use(method, model)
    return generate_kvcache(kv_cache_view(model), prompt, n_tokens, model.seqlen, kv_cache=cache)


@torch.inference_mode()
def teacher_forced_logits(model, tokens, method, cache=None, progress=None):
    """Feed tokens [B, S] one at a time through the budgeted cache: logits [B, S, vocab] at every position."""
    cache = (BudgetCache(model.config.n_layers) if cache is None else cache).use(method, model)
    cached = kv_cache_view(model)
    steps = range(tokens.shape[1]) if progress is None else progress(range(tokens.shape[1]))
    return torch.cat([cached(tokens[:, t:t + 1], kv_cache=cache)[0] for t in steps], dim=1)


@torch.inference_mode()
def attention_on_first(model, tokens, n_first=4, from_position=16):
    """Attention sinks in a full forward pass over tokens [B, S] (S <= the model's window): the attention
    weight that queries at positions >= from_position put on the first n_first positions, averaged over
    batch, heads and those queries per layer (`by_layer`), then over layers (`mass`); `uniform`: what equal
    weights over each query's causal past would give, min(n_first, p + 1) / (p + 1), averaged the same way."""
    S = tokens.shape[1]
    if not 0 <= from_position < S:
        raise ValueError(f"from_position must be between 0 and {S - 1} (the sequence's last position), "
                         f"got {from_position}")
    cache = BudgetCache(model.config.n_layers, keep_weights=True).use(Dense(), model)
    kv_cache_view(model)(tokens, kv_cache=cache)  # a prefill: dense, causal, the weights kept
    by_layer = [w[:, :, from_position:, :n_first].sum(dim=-1).mean().item() for w in cache.weights]  # [B, H, Q, S]
    positions = torch.arange(from_position, S, dtype=torch.float64)
    uniform = (positions + 1).clamp(max=n_first).div(positions + 1).mean().item()
    return dict(mass=sum(by_layer) / len(by_layer), by_layer=by_layer, uniform=uniform)


def kv_bytes(method, n_ctx, n_layers, n_heads, d_head, element_size=4):
    """KV bytes (keys and values, every layer and head) kept in the cache and read by one decode step,
    at a context of n_ctx tokens. Quest keeps every entry and reads its chosen pages plus every page's
    key minimum and maximum."""
    entry = 2 * n_layers * n_heads * d_head * element_size
    budget = min(method.budget or n_ctx, n_ctx)
    if isinstance(method, Quest):
        n_pages = -(-n_ctx // method.page_size)
        read = min(budget // method.page_size * method.page_size, n_ctx) * entry + n_pages * entry
        return n_ctx * entry, read
    return budget * entry, budget * entry
