"""The long-context attention benchmark of main_flash_attention.py: the attention functions alone, on
random Q, K, V with GPTlite's head shape, for context lengths far beyond GPTlite's 128-token window.

Blog section: "FlashAttention". Naive attention builds the [n, n] scores matrix (and its masked and
softmaxed copies), so its memory grows with n^2; SDPA's fused kernels (FlashAttention and the like)
work on tiles of keys with an online softmax and never hold it, so theirs grows with n (the output).
FlexAttention compiles a kernel from a `mask_mod`; with a block mask it also skips the tiles that the
mask hides entirely, so a sliding-window causal mask costs O(n * window) instead of O(n^2).
"""
import warnings

import torch
import torch.nn.functional as F
from tqdm import tqdm

import inference_utils as iu
from gptlite import scaled_dot_product_attention
from gptlite_kvcache import scaled_dot_product_attention_kv_cache
from lib import harness


def naive_attention(Q, K, V):
    return scaled_dot_product_attention(Q, K, V, causal_mask=True)  # [B, H, n, D]


def sdpa_attention(Q, K, V):
    return F.scaled_dot_product_attention(Q, K, V, is_causal=True)  # [B, H, n, D]


def sliding_window_mask_mod(window):
    """FlexAttention's mask_mod: query q sees key k when k <= q and q - k < window (itself included)."""
    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)
    return mask_mod


def sliding_window_mask(n, window, device="cpu"):
    """The same mask as a boolean [n, n] tensor, True = attend."""
    idx = torch.arange(n, device=device)
    return sliding_window_mask_mod(window)(None, None, idx[:, None], idx[None, :])


def naive_sliding_window(Q, K, V, window):
    """The reference for FlexAttention: the explicit scores matrix with the sliding-window mask."""
    mask = sliding_window_mask(Q.shape[-2], window, Q.device)  # [n, n]
    return scaled_dot_product_attention_kv_cache(Q, K, V, causal_mask=mask)


class FlexSlidingWindow:
    """FlexAttention with a sliding-window causal mask. compiled=True: torch.compile'd once with dynamic
    shapes (a fused kernel that skips the masked-out blocks); False: PyTorch's eager fallback, which
    materializes the scores (for checking the mask only). Block masks are built once per length."""

    def __init__(self, window, compiled=True):
        from torch.nn.attention.flex_attention import flex_attention
        self.window, self.mask_mod = window, sliding_window_mask_mod(window)
        self.flex = torch.compile(flex_attention, dynamic=True) if compiled else flex_attention
        self.block_masks = {}

    def block_mask(self, n, device):
        from torch.nn.attention.flex_attention import create_block_mask
        key = (n, str(device))
        if key not in self.block_masks:
            self.block_masks[key] = create_block_mask(self.mask_mod, None, None, n, n, device=device)
        return self.block_masks[key]

    def __call__(self, Q, K, V):
        block_mask = self.block_mask(Q.shape[-2], Q.device)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            return self.flex(Q, K, V, block_mask=block_mask)  # [B, H, n, D]


def make_flex(window, device, compiled=True, check_len=None):
    """A FlexSlidingWindow checked against naive attention with the same mask on random inputs of
    `check_len` tokens. Returns (flex or None, max |difference|, a note saying why it did not run).
    A device or build where flex attention cannot run (no compiler, say) is reported, not fatal."""
    check_len = check_len or 2 * window + 3  # past the window, not a multiple of the block size
    Q, K, V = torch.randn(3, 1, 2, check_len, 16, device=device)
    try:
        flex = FlexSlidingWindow(window, compiled)
        with torch.inference_mode():
            diff = (flex(Q, K, V) - naive_sliding_window(Q, K, V, window)).abs().max().item()
    except Exception as e:  # torch.compile fails in many ways (no C++ compiler, no Triton, ...)
        reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        return None, None, f"flex attention does not run on {device} here: {reason}"
    return flex, diff, None


def gather_tokens(X, idx):
    """The rows idx [B, H, k] of X [B, H, n, D], per batch and head: [B, H, k, D]. One index_select on the
    flattened cache (on CPU several times faster than gather or indexing along dim 2): the sparse decode
    steps' gather (moba_decode, nsa_decode, dsa_decode)."""
    B, H, n, D = X.shape
    rows = (torch.arange(B * H, device=X.device) * n).view(B, H, 1) + idx  # [B, H, k]
    return X.reshape(B * H * n, D).index_select(0, rows.flatten()).view(B, H, -1, D)


def benchmark(variants, contexts, batch_size, n_heads, d_head, device, repeats=3, seed=0, n_queries=None,
              peak_memory=True, caches=None):
    """Time (median of `repeats` after a warm-up, the variants round-robin: iu.time_round_robin) and peak
    memory of each `variants[name](Q, K, V)` on random K, V of [batch_size, n_heads, n, d_head] for every n
    in `contexts`. Q holds `n_queries` queries per sequence and head: None, n (the causal attention of a
    prefill: main_flash_attention); 1, one decode step over a cache of n (main_flash_decoding).
    `peak_memory=False` leaves the memory out (no "peak_mb" key). `caches[name](K, V)`, for some variants:
    what a KV cache keeps beside K and V for them (block summaries, index keys), a tuple built untimed for each
    context and passed on: `variants[name](Q, K, V, *cache)` (main_trainable_sparse's decode steps).

    Returns {name: {"context": [...], "ms": [...], "peak_mb": [...]}}."""
    generator = torch.Generator(device=device).manual_seed(seed)
    results = {name: {"context": [], "ms": [], **({"peak_mb": []} if peak_memory else {})} for name in variants}

    def measure(n):  # the inputs live in this call only: freed before the next context's
        K, V = torch.randn(2, batch_size, n_heads, n, d_head, device=device, generator=generator)
        Q = torch.randn(batch_size, n_heads, n if n_queries is None else n_queries, d_head, device=device,
                        generator=generator)
        extra = {name: tuple((caches or {}).get(name, lambda K, V: ())(K, V)) for name in variants}
        fns = {name: (lambda attention=attention, extra=extra[name]: attention(Q, K, V, *extra))
               for name, attention in variants.items()}
        times = iu.time_round_robin(fns, device, warmup=1, repeats=repeats)
        for name, fn in fns.items():
            results[name]["context"].append(n)
            results[name]["ms"].append(iu.median(times[name]) * 1e3)
            if peak_memory:
                results[name]["peak_mb"].append(iu.peak_memory_mb(fn, device))

    for n in tqdm(contexts, desc="contexts", unit="context", leave=False):
        with torch.inference_mode():
            measure(n)
    return results


def benchmark_bytes(contexts, batch_size, n_heads, d_head, n_queries=None, naive=True):
    """About the bytes that benchmark() allocates at its longest context (float32): Q, K, V and the output,
    and, with naive attention among the variants, its [q, n] scores and their softmax (alive together)."""
    n = max(contexts)
    q = n if n_queries is None else n_queries
    inputs = batch_size * n_heads * (2 * n + 2 * q) * d_head * 4
    return inputs + (2 * batch_size * n_heads * q * n * 4 if naive else 0)  # scores and softmax alive together


def format_results(results, baseline="naive", fast="SDPA"):
    """One line per context length: each variant's time and peak memory, and baseline / fast ratios."""
    names = list(results)
    header = (["context"] + [f"{name} ms" for name in names] + [f"{name} MB" for name in names]
              + [f"{baseline}/{fast} time", f"{baseline}/{fast} memory"])
    lines = [header]
    for i, n in enumerate(results[baseline]["context"]):
        r = {name: (results[name]["ms"][i], results[name]["peak_mb"][i]) for name in names}
        lines.append([str(n)] + [f"{r[name][0]:.2f}" for name in names] + [f"{r[name][1]:.2f}" for name in names]
                     + [f"{r[baseline][0] / r[fast][0]:.1f}x", f"{r[baseline][1] / max(r[fast][1], 1e-6):.1f}x"])
    widths = [max(len(line[j]) for line in lines) for j in range(len(header))]
    text = ["  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in lines]
    return "\n".join(text[:1] + ["-" * len(text[0])] + text[1:])


def plot(results, title):
    """Time and peak memory against context length, one curve per variant, on log-log axes: the figure."""
    fig, (ax_time, ax_mem) = harness.new_figure(2)
    for name, r in results.items():
        ax_time.plot(r["context"], r["ms"], marker="o", label=name)
        ax_mem.plot(r["context"], [max(mb, 1e-3) for mb in r["peak_mb"]], marker="o", label=name)
    for ax, ylabel in ((ax_time, "time (ms, median)"), (ax_mem, "peak attention memory (MiB)")):
        ax.set(xscale="log", yscale="log", xlabel="context length (tokens)", ylabel=ylabel, title=title)
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    return fig


def generation_bytes(preset, batch_size, length):
    """About the bytes that generating (or scoring) `batch_size` sequences of `length` tokens with a model of
    `preset` allocates, float32, for a size flag's check (harness.check_fits): the tokens held (int64), and
    per sequence a full-window forward pass: each layer's K/V cache, activations and [heads, seqlen, seqlen]
    scores, and the logits."""
    S = preset.seqlen
    window = 4 * S * (2 * preset.n_layers * preset.n_heads * preset.d_head + 8 * preset.d_model
                      + 2 * preset.n_heads * S + preset.vocab_size)
    return batch_size * (8 * length + window)
