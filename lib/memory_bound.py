"""Decoding where the bytes bind: the machine's read bandwidth and last-level cache, decode steps over a
full KV cache, and the plot of TPOT against the bytes a step reads.

Blog: "Smaller KV caches: MQA, GQA and MLA" and the part-2 quantization section: a decode step reads every
weight and every cached key and value once, so where those bytes do not fit the cache its time is about
bytes / bandwidth. At the post's gptlite shape (70 MB of float32 weights) with batch 32 and 1024 tokens of
context, the multi-head float32 cache is 604 MB a step, ten times the weights.

    bandwidth = read_bandwidth()                       # GB/s: a 400 MB float32 tensor summed in order
    cache = filled_cache(model, 32, 1024)             # a StaticKVCache holding 1024 random entries
    step = decode_steps(model, cache, 1024, 32)       # step(n): n greedy steps from the same full context
    iu.compare_generation({"MHA": step}, 8, 32)       # TPOT at that context

Random weights and random cache entries: only time means anything there (the tables say so).
"""
import glob

import torch

import inference_utils as iu
from gptlite import decode_loop
from gptlite_kvcache import DynamicKVCache, StaticKVCache, cached_heads
from gptlite_mla import GPTlite_MLA
from lib import fast_decode, harness
from lib.quantization import KIVICache
from lib.presets import PRESETS

SHAPE = "gptlite"  # the memory-bound shape: the post's model, 70 MB of float32 weights


def add_shape_flags(parser, batch_size=32, context=1024, n_tokens=16):
    """The flags of a script's rows at the shape: --shape-batch (0: none), --shape-context, --shape-tokens."""
    add = parser.add_argument
    add("--shape-batch", type=harness.int_at_least(0, 1024), default=batch_size,
        help=f"batch of the {SHAPE}-shape rows (random weights, time only; 0: no such rows)")
    add("--shape-context", type=harness.int_at_least(1, 8192), default=context,
        help=f"cached tokens per sequence in the {SHAPE}-shape rows")
    add("--shape-tokens", type=harness.int_at_least(2, 1024), default=n_tokens,
        help=f"decoding steps timed per call in the {SHAPE}-shape rows")


def shape_config(context, n_tokens):
    """GPTlite's keyword arguments at the shape, with a window of context + n_tokens + 1 so that every timed
    token has its own position."""
    return PRESETS[SHAPE].gptlite_kwargs() | dict(seqlen=context + n_tokens + 1)


def shape_title(batch_size, context, reference):
    return (f"Decoding at the {SHAPE} shape (random weights and cache: time only), batch {batch_size}, {context} cached "
            f"tokens; tpot_vs_{reference.lower()}: this TPOT / {reference}'s on the same path; at_bandwidth_ms: "
            "bytes_per_step at the measured read bandwidth")


def last_level_cache_bytes():
    """The largest CPU cache (Linux sysfs), or None when it cannot be read."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        text = open(path).read().strip()
        sizes.append(int(text[:-1]) * {"K": 2**10, "M": 2**20}.get(text[-1], 1) if text[-1] in "KM" else int(text))
    return max(sizes) if sizes else None


def read_bandwidth(nbytes=400 * 2**20, repeats=5):
    """The machine's read bandwidth in GB/s: the median time of summing a float32 tensor of `nbytes` (larger
    than the last-level cache) with lib/fast_decode.read_sum, every thread reading its share once in order;
    None where the extension cannot be built (no C++ compiler)."""
    if harness.compiler_problem():
        return None
    x = torch.randn(nbytes // 4)
    seconds = iu.time_fn(lambda: fast_decode.read_sum(x), warmup=1, repeats=repeats)
    return nbytes / seconds / 1e9


def filled_cache(model, batch_size, context, extra=64, seed=0, kv_bits=None, kv_block=32):
    """A cache for `model` holding `context` random entries per sequence, as if a prompt of that length had
    been encoded: a StaticKVCache of context + extra slots (its cached heads: GQA's groups); with kv_bits, a
    KIVICache of that many bits (blocks of kv_block tokens quantized, the rest float32); for a GPTlite_MLA its
    dynamic cache of random latents (grown by torch.cat, as its decoding does)."""
    torch.manual_seed(seed)
    c = model.config
    if isinstance(model, GPTlite_MLA):
        return DynamicKVCache([(torch.randn(batch_size, 1, context, c.d_latent),) for _ in range(c.n_layers)])
    if kv_bits is not None:
        cache = KIVICache(c.n_layers, kv_bits, kv_block)
        shape = (batch_size, cached_heads(model.blocks[0].mha), context, c.d_head)  # GQA: its groups
        for layer in range(c.n_layers):
            cache.update(layer, torch.randn(shape), torch.randn(shape))
        cache.n_tokens = context
        return cache
    cache = StaticKVCache.for_model(model, batch_size, context + extra)
    cache.keys[:, :, :, :context].normal_()
    cache.values[:, :, :, :context].normal_()
    cache.n_tokens = context
    return cache


def dequantized_copy(cache, extra=64):
    """A StaticKVCache (extra slots to spare) holding a KIVICache's entries as its attention reads them: the
    reference that decoding steps over the KIVICache must equal."""
    layers = [cache.dequantized(layer) for layer in range(len(cache.blocks))]  # [(keys, values) [B, H, n, D]]
    B, H, n, D = layers[0][0].shape
    static = StaticKVCache(len(layers), B, H, D, n + extra)
    for layer, (k, v) in enumerate(layers):
        static.update(layer, k, v)
    static.n_tokens = n
    return static


def cache_bytes(cache, context):
    """Bytes of the entries of `context` tokens that a step reads from `cache` (rolled back to them): a
    StaticKVCache's written slots, a dynamic cache's tensors, a KIVICache's codes, scales and residual."""
    cache.truncate(context)
    if isinstance(cache, StaticKVCache):
        return 2 * cache.keys[:, :, :, :context].nbytes
    return iu.kv_cache_bytes(cache.layers if isinstance(cache, DynamicKVCache) else cache)


def decode_steps(model, cache, context, batch_size):
    """step(n): n greedy decoding steps of `model` (eager, or a fast_decode native view) over `cache`
    (of `batch_size` sequences) from the same `context` entries every call (rolled back first); the last logits."""

    @torch.inference_mode()
    def step(n):
        cache.truncate(context)
        logits = None

        def forward(token):  # gptlite.decode_loop's step, the last logits kept
            nonlocal logits
            logits = model.forward_cache(token, cache)  # [B, 1, vocab]
            return logits[:, -1]
        decode_loop(forward, torch.zeros(batch_size, 1, dtype=torch.long), n)
        return logits
    return step


def weight_bytes(model, batch_size):
    """Bytes of weights one decoding step of `model` reads: every linear weight, LayerNorm and bias, and one
    row of each embedding table per sequence of the batch."""
    embedding_rows = batch_size * 2 * model.config.d_model * 4
    return sum(p.nbytes for name, p in model.named_parameters() if "embedding" not in name) + embedding_rows


def attention_flops(model, batch_size, context):
    """FLOPs of one step's attention over `context` cached tokens: every query head's scores and weighted sum,
    2 * 2 * width per cached token; the width is d_head, or d_latent for MLA's absorbed attention (the
    queries moved into the latent space: fewer bytes, more FLOPs)."""
    c = model.config
    width = c.d_latent if isinstance(model, GPTlite_MLA) else c.d_head
    return batch_size * context * c.n_layers * c.n_heads * 4 * width


def step_rows(views, models, caches, batch_size, context, n_tokens, repeats, bandwidth, llc, reference):
    """Decoding at the shape from full caches: views {(variant, path): model on that path}, models {variant: model},
    caches {variant: its filled cache} (or {(variant, path): ...} where a path reads its own form of the cache:
    KIVI's packed one on the fast path), all timed round-robin. Each row: TPOT, tpot_vs_<reference> (this TPOT /
    the reference variant's on the same path), the bytes a step reads (weights + cache), its attention's FLOPs,
    and the time the bytes take
    at the measured `bandwidth` (GB/s; None: not measured), and whether they fit the last-level cache."""
    cache_of = lambda key: caches[key] if key in caches else caches[key[0]]  # noqa: E731
    timing = iu.compare_generation({key: decode_steps(view, cache_of(key), context, batch_size)
                                    for key, view in views.items()},
                                   n_tokens, batch_size, repeats=repeats)
    vs = f"tpot_vs_{reference.lower()}"
    rows = []
    for (name, path), t in timing.items():
        weights, kv_bytes = weight_bytes(models[name], batch_size), cache_bytes(cache_of((name, path)), context)
        total = weights + kv_bytes
        ratio = iu.ratio(t["tpot_ms"], timing.get((reference, path), {}).get("tpot_ms"))
        rows.append(harness.make_row(
            name, shape=SHAPE, path=path, batch_size=batch_size, context=context, tpot_ms=t["tpot_ms"],
            **{vs: None if ratio is None else round(ratio, 2)}, bytes_per_step=total,
            weight_mb=round(weights / 2**20, 1), kv_mb=round(kv_bytes / 2**20, 1),
            attention_mflop=round(attention_flops(models[name], batch_size, context) / 1e6), at_bandwidth_ms=None if bandwidth is None else round(total / bandwidth / 1e6, 2),
            in_cache="yes" if llc is not None and total <= llc else "no"))
    return rows


def plot_step_rows(ax, rows, bandwidth, llc):
    """plot_bytes of step_rows' rows: TPOT against MiB read per step, one point per variant and path."""
    plot_bytes(ax, [(f"{r['variant']} {r['path']}", r["bytes_per_step"], r["tpot_ms"]) for r in rows], bandwidth, llc,
               "MiB read per step (weights + KV cache)", "TPOT (ms)",
               f"{SHAPE} shape, batch {rows[0]['batch_size']}, context {rows[0]['context']}" if rows else "")


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
    times = [ms for _, _, ms in points]
    log = max(times) > 10 * min(times)  # a slow eager row would flatten the others: a log scale then
    xs = [top * i / 50 for i in range(1, 51)]
    ax.plot(xs, [x * 2**20 / bandwidth / 1e6 for x in xs], color="gray", linestyle="--",
            label=f"bytes / measured bandwidth ({bandwidth:.0f} GB/s)")
    if llc is not None:
        ax.axvline(llc / 2**20, color="tab:red", linewidth=0.8, label=f"last-level cache ({llc / 2**20:.0f} MiB)")
    ax.set(xlabel=xlabel, ylabel=ylabel + (", log scale" if log else ""), title=title, xlim=(0, top))
    if log:
        ax.set_yscale("log")
    else:
        ax.set_ylim(0, None)
    ax.legend(fontsize=7)
