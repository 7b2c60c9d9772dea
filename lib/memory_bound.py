"""Decoding where the bytes bind: the machine's read bandwidth and last-level cache, decode steps over a
full KV cache, and the plot of TPOT against the bytes a step reads.

Blog: "Smaller KV caches: MQA, GQA and MLA" and the part-2 quantization section: a decode step reads every
weight and every cached key and value once, so where those bytes do not fit the cache its time is about
bytes / bandwidth. At the post's gptlite shape (70 MB of float32 weights) with batch 32 and 1024 tokens of
context, the multi-head float32 cache is 604 MB a step, ten times the weights.

    bandwidth = read_bandwidth()                       # GB/s: a 400 MB float32 tensor summed in order
    cache = filled_cache(model, 32, 1024)             # a StaticKVCache holding 1024 random entries
    step = decode_steps(model, cache, 1024)           # step(n): n greedy steps from the same full context
    iu.compare_generation({"MHA": step}, 8, 32)       # TPOT at that context

Random weights and random cache entries: only time means anything there (the tables say so).
"""
import glob

import torch

import inference_utils as iu
from gptlite_kvcache import StaticKVCache, cached_heads
from lib import fast_decode


def last_level_cache_bytes():
    """The largest CPU cache (Linux sysfs), or None when it cannot be read."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        text = open(path).read().strip()
        sizes.append(int(text[:-1]) * {"K": 2**10, "M": 2**20}.get(text[-1], 1) if text[-1] in "KM" else int(text))
    return max(sizes) if sizes else None


def read_bandwidth(nbytes=400 * 2**20, repeats=5):
    """The machine's read bandwidth in GB/s: the median time of summing a float32 tensor of `nbytes` (larger
    than the last-level cache) with lib/fast_decode.read_sum, every thread reading its share once in order."""
    x = torch.randn(nbytes // 4)
    seconds = iu.time_fn(lambda: fast_decode.read_sum(x), warmup=1, repeats=repeats)
    return nbytes / seconds / 1e9


def filled_cache(model, batch_size, context, extra=64, seed=0):
    """A StaticKVCache for `model` (its cached heads: GQA's groups) of context + extra slots, the first
    `context` filled with random keys and values, as if a prompt of that length had been encoded."""
    torch.manual_seed(seed)
    cache = StaticKVCache.for_model(model, batch_size, context + extra)
    cache.keys[:, :, :, :context].normal_()
    cache.values[:, :, :, :context].normal_()
    cache.n_tokens = context
    return cache


def decode_steps(model, cache, context):
    """step(n): n greedy decoding steps of `model` (eager, or a fast_decode native view) at batch
    cache's, from the same `context` entries every call (the cache rolled back first); the last logits."""
    batch_size = cache.keys.shape[1]

    @torch.inference_mode()
    def step(n):
        cache.truncate(context)
        token = torch.zeros(batch_size, 1, dtype=torch.long)
        for _ in range(n):
            logits = model.forward_cache(token, cache)  # [B, 1, vocab]
            token = logits[:, -1].argmax(dim=-1, keepdim=True)
        return logits
    return step


def step_bytes(model, batch_size, context):
    """Bytes one decoding step of `model` reads at `context`: (weights, KV cache). Weights: every linear
    weight, LayerNorm and bias, and one row of each embedding table (per sequence of the batch); KV: the
    cached keys and values of every layer, [B, heads cached, context, D] twice, float32."""
    c = model.config
    embedding_rows = batch_size * 2 * c.d_model * 4
    weights = sum(p.nbytes for name, p in model.named_parameters() if "embedding" not in name) + embedding_rows
    kv = batch_size * context * c.n_layers * 2 * cached_heads(model.blocks[0].mha) * c.d_head * 4
    return weights, kv


def plot_bytes(ax, points, bandwidth, llc, xlabel, ylabel, title):
    """TPOT against the bytes read per step: points [(label, bytes, ms)], the time those bytes take at the
    measured `bandwidth` (GB/s, a dashed line) and the last-level cache's size (`llc` bytes, a red line):
    decode is memory-bound where the points meet the line."""
    points = [(label, b, ms) for label, b, ms in points if ms is not None]
    if not points or bandwidth is None:
        ax.set_axis_off()
        return
    for label, b, ms in points:
        ax.scatter(b / 2**20, ms)
        ax.annotate(label, (b / 2**20, ms), fontsize=7)
    top = 1.1 * max(b for _, b, _ in points) / 2**20
    ax.plot([0, top], [0, top * 2**20 / bandwidth / 1e6], color="gray", linestyle="--",
            label=f"bytes / measured bandwidth ({bandwidth:.0f} GB/s)")
    if llc is not None:
        ax.axvline(llc / 2**20, color="tab:red", linewidth=0.8, label=f"last-level cache ({llc / 2**20:.0f} MiB)")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title, xlim=(0, top), ylim=(0, None))
    ax.legend(fontsize=7)
