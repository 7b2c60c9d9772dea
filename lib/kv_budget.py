"""KV budgets: which cached tokens a decode step attends to, without retraining.

Blog section: "Sparse attention and KV-cache budgets" (main_sparse_attention.py). One interface, three
hooks that a method overrides; the cached forward pass below calls them in every layer:
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

from gptlite import check_generation_args


@dataclass
class LayerKV:
    keys: torch.Tensor       # [B, H, n, D] (a rotary model's keys before rotation)
    values: torch.Tensor     # [B, H, n, D]
    score: torch.Tensor = None    # H2O: attention each entry received so far, [B, H, n]
    queries: torch.Tensor = None  # SnapKV: the last `window` queries, [B, H, w, D]


class BudgetCache:
    """Per-layer LayerKV (entries differ per head after eviction), and the tokens seen so far."""

    def __init__(self, n_layers, n_first=4):
        self.layers = [None] * n_layers
        self.n_tokens = 0
        self.n_first = n_first  # attention sinks' statistic: the weight of the first n_first entries
        self.first_mass = [0.0] * n_layers  # summed over heads' mean and decode steps, per layer
        self.first_uniform = 0.0  # the same sum had every entry read got equal weight
        self.n_steps = 0

    def __len__(self):
        return 0 if self.layers[0] is None else self.layers[0].keys.shape[2]


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
# GPTlite's cached forward pass with a method: GPTlite (absolute positions, clamped at seqlen-1 past
# the window as in gptlite_kvcache) or GPTlite_RoPE (a key rotated by its slot in the cache).

def attend(Q, K, V, mask):
    """The explicit attention of gptlite_kvcache, returning its weights. mask: bool, True = attend."""
    scores = Q @ K.transpose(-2, -1) / Q.shape[-1] ** 0.5  # [B, H, T, n]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = F.softmax(scores, dim=-1)  # [B, H, T, n]
    return weights @ V, weights


def forward_budget(model, idx, cache, method):
    """idx [B, T] new tokens after the cache's; returns logits [B, T, vocab]; `cache` is updated in place."""
    from gptlite_rope import apply_rope
    T, seqlen = idx.shape[1], model.seqlen
    rotary = hasattr(model, "rope_cos")
    if T > 1 and len(cache) + T > seqlen:
        raise ValueError(f"{len(cache)} cached + {T} new tokens exceed seqlen={seqlen}: feed them one at a time")
    x = model.token_embedding(idx)  # [B, T, d_model]
    if not rotary:  # absolute positions, clamped at seqlen-1 (the post's cache)
        x = x + model.position_embedding(torch.arange(cache.n_tokens, cache.n_tokens + T, device=idx.device)
                                         .clamp(max=seqlen - 1))
    for layer, block in enumerate(model.blocks):
        mha = block.mha
        h = block.ln1(x)
        Q, K, V = (mha.split_heads(proj(h)) for proj in (mha.query_proj, mha.key_proj, mha.value_proj))
        kv = cache.layers[layer]
        if kv is None:
            kv = LayerKV(K, V)
        else:  # append; a new entry has received no attention yet
            score = None if kv.score is None else F.pad(kv.score, (0, T))
            kv = LayerKV(torch.cat([kv.keys, K], dim=2), torch.cat([kv.values, V], dim=2), score, kv.queries)
        if kv.keys.shape[2] > seqlen:  # a full window drops its oldest entry (dense, Quest)
            kv = gather(kv, last_entries(kv, seqlen))
        n = kv.keys.shape[2]
        Kn = kv.keys
        if rotary:  # positions are the slots of the cache
            Q = apply_rope(Q, model.rope_cos[n - T:n], model.rope_sin[n - T:n])
            Kn = apply_rope(Kn, model.rope_cos[:n], model.rope_sin[:n])
        if T > 1:  # prefill: dense, the shifted causal mask
            mask = torch.ones(T, n, dtype=torch.bool, device=idx.device).tril(diagonal=n - T)
        else:
            mask = method.select(Q, Kn)
        out, weights = attend(Q, Kn, kv.values, mask)  # [B, H, T, D], [B, H, T, n]
        cache.first_mass[layer] += weights[:, :, -1, :cache.n_first].sum(dim=-1).mean().item() if T == 1 else 0.0
        x = x + mha.out_proj(mha.merge_heads(out))
        x = x + block.ffwd(block.ln2(x))
        method.observe(kv, Q, weights)
        idx_keep = method.keep(kv)
        cache.layers[layer] = kv if idx_keep is None else gather(kv, idx_keep)
    cache.n_tokens += T
    cache.n_steps += T == 1
    if T == 1:
        cache.first_uniform += min(cache.n_first, n) / n  # equal weights over the n entries held
    return model.fc_out(model.ln(x))  # [B, T, vocab]


@torch.inference_mode()
def generate_budget(model, prompt, n_tokens, method):
    """Greedy decoding as generate_kvcache, attending within `method`'s budget. Returns [B, S + n_tokens]."""
    check_generation_args(model, prompt, n_tokens, model.seqlen)
    cache = BudgetCache(model.config.n_layers)
    token = forward_budget(model, prompt, cache, method)[:, -1:].argmax(dim=-1)  # [B, 1]
    tokens = [token]
    for _ in range(n_tokens - 1):
        token = forward_budget(model, token, cache, method)[:, -1:].argmax(dim=-1)
        tokens.append(token)
    return torch.cat([prompt] + tokens, dim=1)


@torch.inference_mode()
def teacher_forced_logits(model, tokens, method, cache=None, progress=None):
    """Feed tokens [B, S] one at a time through the budgeted cache: logits [B, S, vocab] at every position."""
    cache = BudgetCache(model.config.n_layers) if cache is None else cache
    steps = range(tokens.shape[1]) if progress is None else progress(range(tokens.shape[1]))
    return torch.cat([forward_budget(model, tokens[:, t:t + 1], cache, method) for t in steps], dim=1)


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
