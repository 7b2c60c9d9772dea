"""FlashAttention through PyTorch's scaled_dot_product_attention (SDPA), against the naive attention.

    python main_flash_attention.py                      # cpu preset on CPU, gptlite on CUDA
    python main_flash_attention.py --contexts 128 1024 8192 16384 --json flash.json --plot flash.png
    python main_flash_attention.py --untrained --contexts 128 512 --no-flex   # a quick smoke run

Blog section: "FlashAttention". `use_sdpa(model)` swaps the class of every block's attention module
for one whose forward calls F.scaled_dot_product_attention, keeping the weights. SDPA dispatches to a
fused kernel (FlashAttention, memory-efficient, cuDNN, or the CPU flash kernel) or to the math one;
the script forces each with torch.nn.attention.sdpa_kernel and names the kernel that ran.

With a KV cache and several new tokens, SDPA's is_causal=True would align the causal mask to the
top-left corner (query i sees keys 0..i), which is wrong when the queries are the last Tq of Tk keys:
there an explicit shifted boolean mask is passed instead (and no mask for one new token).

GPTlite's window is 128 tokens, so the long-context benchmark (attention_benchmark.py) runs the
attention functions alone on random Q, K, V with GPTlite's head shape, up to 8,192 tokens and more.
"""
import copy
import warnings
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import inference_utils as iu
from gptlite import MultiHeadAttention
from gptlite_kvcache import GPTlite_KVCache, MultiHeadAttention_KVCache, generate_kvcache
from lib import attention_benchmark as ab
from lib import attention_summary, corpus, harness, training

ATOL = 1e-4  # float32 logits of a trained model (units to tens), summed in another order by the fused kernels
FLEX_ATOL = 1e-5  # float32 attention outputs on random unit inputs
BACKENDS = [SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]


def sdpa_dropout_p(module):
    return module.dropout.p if module.training else 0.0  # SDPA applies dropout_p whenever it is > 0


class MultiHeadAttention_SDPA(MultiHeadAttention):
    def forward(self, x):
        # x: [B, S, d_model]
        Q = self.split_heads(self.query_proj(x))  # [B, H, S, D]
        K = self.split_heads(self.key_proj(x))
        V = self.split_heads(self.value_proj(x))
        out = F.scaled_dot_product_attention(Q, K, V, dropout_p=sdpa_dropout_p(self), is_causal=True)
        return self.dropout(self.out_proj(self.merge_heads(out)))  # [B, S, d_model]


def sdpa_kv_cache(Q, K, V, dropout_p=0.0):
    """SDPA of Tq new queries over Tk >= Tq keys, the last Tq of which are the new tokens."""
    # Q: [B, H, Tq, D], K and V: [B, H, Tk, D]
    Tq, Tk = Q.shape[-2], K.shape[-2]
    if Tq == Tk:  # a prefill on an empty cache: top-left and bottom-right alignments agree
        return F.scaled_dot_product_attention(Q, K, V, dropout_p=dropout_p, is_causal=True)
    # is_causal=True would let query i see keys 0..i only; the new query i sees keys 0..Tk-Tq+i
    mask = None if Tq == 1 else torch.ones(Tq, Tk, dtype=torch.bool, device=Q.device).tril(diagonal=Tk - Tq)
    return F.scaled_dot_product_attention(Q, K, V, attn_mask=mask, dropout_p=dropout_p)  # [B, H, Tq, D]


class MultiHeadAttention_KVCache_SDPA(MultiHeadAttention_KVCache):
    def attention(self, Q, K, V):  # the cache update of MultiHeadAttention_KVCache.forward, then SDPA
        return sdpa_kv_cache(Q, K, V, dropout_p=sdpa_dropout_p(self))


SDPA_CLASSES = {MultiHeadAttention: MultiHeadAttention_SDPA,
                MultiHeadAttention_KVCache: MultiHeadAttention_KVCache_SDPA}


def use_sdpa(model):
    """Make every block's attention module of a GPTlite or GPTlite_KVCache compute with SDPA, in place:
    its class is swapped for the SDPA subclass, so that weights, device and state dict stay. Returns model."""
    modules = [block.mha for block in model.blocks]
    for mha in modules:  # check all before changing any
        if type(mha) not in SDPA_CLASSES and type(mha) not in SDPA_CLASSES.values():
            raise ValueError(f"use_sdpa swaps {', '.join(c.__name__ for c in SDPA_CLASSES)} only, "
                             f"not {type(mha).__name__}")
    for mha in modules:
        mha.__class__ = SDPA_CLASSES.get(type(mha), type(mha))  # already SDPA: unchanged
    return model


def forced(backend):
    return nullcontext() if backend is None else sdpa_kernel(backend)


def sdpa_kernels_run(fn):
    """The SDPA kernels that `fn()` ran, e.g. 'flash_attention_for_cpu', read from the profiler's op list."""
    from torch.profiler import ProfilerActivity, profile
    with iu.stderr_silenced(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    prefix = "aten::_scaled_dot_product_"
    return ", ".join(sorted({e.name[len(prefix):] for e in prof.events() if e.name.startswith(prefix)})) or "none"


def check_variants(naive, sdpa, data, prompts, n_tokens, seqlen, device, val_batches):
    """Every variant against naive attention, before anything is timed: logits without a cache (is_causal)
    and with one and several new tokens (the shifted mask), greedy tokens, validation loss. Variants:
    naive attention, SDPA as dispatched, one per forced backend (or why it cannot run).
    Returns {name: (model, backend)} of the variants that run, {name: row of its check figures} (every
    variant, in order) and the KV cache's MB (the same for every variant)."""
    variants = {"naive": (naive, None), "SDPA (default dispatch)": (sdpa, None)}
    variants.update({f"SDPA forced {b.name}": (sdpa, b) for b in BACKENDS})
    x = corpus.get_batch(data.val, prompts.shape[0], seqlen, torch.Generator().manual_seed(1), device)[0]  # [B, seqlen]
    cut = seqlen // 2
    chunks = (x[:, :cut], x[:, cut:cut + 5], x[:, cut + 5:])  # a prefill, 5 new tokens, then the rest

    def chunked_logits(model):
        cache, logits = None, []
        for chunk in chunks:
            out, cache = model(chunk, kv_cache=cache)
            logits.append(out)
        return torch.cat(logits, dim=1)  # [B, seqlen, vocab]

    with torch.inference_mode():
        ref_full, ref_chunked = naive(x)[0], chunked_logits(naive)
        ref_tokens = generate_kvcache(naive, prompts, n_tokens, seqlen)
        held = ref_tokens[:, :-1][:, -seqlen:]  # prompt + new tokens but the last: what the cache holds at the end
        kv_mb = iu.kv_cache_bytes(naive(held)[1]) / 2**20
    runs, found = {}, {}
    for name, (model, backend) in variants.items():
        with forced(backend), warnings.catch_warnings(), torch.inference_mode():
            warnings.simplefilter("ignore")  # a forced kernel that cannot run warns why, then raises
            try:
                diff = (model(x)[0] - ref_full).abs().max().item()
                same = torch.equal(generate_kvcache(model, prompts, n_tokens, seqlen), ref_tokens)  # no mask needed
                kernel = sdpa_kernels_run(lambda: model(x))
            except RuntimeError:
                dtype = str(naive.fc_out.weight.dtype).removeprefix("torch.")  # CUDA's flash takes no float32
                found[name] = dict(kernel=f"cannot run on {device.type} in {dtype}")
                continue
            try:  # some kernels take no explicit mask (CUDA's flash): generation never needs one, chunks do
                diff = max(diff, (chunked_logits(model) - ref_chunked).abs().max().item())
            except RuntimeError:
                kernel += " (no explicit mask)"
        with forced(backend):
            val_loss = training.validation_loss(model, data, n_batches=val_batches)
        same_loss = name == "naive" or abs(val_loss - found["naive"]["val_loss"]) <= ATOL
        found[name] = dict(kv_cache_mb=kv_mb, val_loss=val_loss, kernel=kernel, max_logit_diff=f"{diff:.1e}",
                           same_tokens="yes" if same else "NO", ok="yes" if diff <= ATOL and same and same_loss else "NO")
        runs[name] = (model, backend)
    return runs, found


def model_rows(runs, found, prompts, n_tokens, seqlen, device, repeats):
    """TTFT, TPOT, throughput and peak memory of generation with each variant that runs (round-robin), with
    its check figures; the variants that cannot run keep the reason."""
    def generation(model, backend):
        def fn(n):
            with forced(backend):
                return generate_kvcache(model, prompts, n, seqlen)
        return fn
    fns = {name: generation(*run) for name, run in runs.items()}
    timings = iu.compare_generation(fns, n_tokens, prompts.shape[0], device, warmup=1, repeats=repeats)
    return [harness.make_row(name, **timings[name], peak_mem_mb=iu.peak_memory_mb(lambda: fns[name](n_tokens), device),
                             **figures) if name in fns else harness.make_row(name, **figures)
            for name, figures in found.items()]


def long_context(variants, contexts, bench_batch, n_heads, d_head, device, repeats, seed):
    """The attention functions alone on random Q, K, V: naive, SDPA and (where it runs, checked already)
    FlexAttention with a sliding window. Returns benchmark()'s results and the summary line."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bench = ab.benchmark(variants, contexts, bench_batch, n_heads, d_head, device, repeats=repeats, seed=seed)
    naive_ms, naive_mb, sdpa_ms, sdpa_mb = (bench[k][f][-1] for k in ("naive", "SDPA") for f in ("ms", "peak_mb"))
    summary = (f"at n={contexts[-1]}: SDPA's peak attention memory is {naive_mb / max(sdpa_mb, 1e-6):.0f}x "
               f"below naive's, and SDPA is {naive_ms / sdpa_ms:.1f}x faster")
    return bench, summary


def long_context_table(bench):
    """The benchmark as rows of the report's extra table: each variant's time and peak memory per context,
    and naive / SDPA ratios."""
    names = list(bench)
    columns = ([("context", "context", "{:,}")] + [(f"{n} ms", f"{n} ms", "{:.2f}") for n in names]
               + [(f"{n} MB", f"{n} MB", "{:.2f}") for n in names]
               + [("time", "naive/SDPA time", "{:.1f}x"), ("memory", "naive/SDPA memory", "{:.1f}x")])
    rows = []
    for i, n in enumerate(bench["naive"]["context"]):
        row = {"context": n, **{f"{k} ms": bench[k]["ms"][i] for k in names},
               **{f"{k} MB": bench[k]["peak_mb"][i] for k in names}}
        row.update(time=iu.ratio(row["naive ms"], row["SDPA ms"]), memory=iu.ratio(row["naive MB"], row["SDPA MB"]))
        rows.append(row)
    return harness.table("The attention functions alone on random inputs (peak MB above the inputs):", rows, columns)


def times(a, b, fmt="{:.1f}x"):
    """a / b as a ratio, '-' where either could not be measured."""
    r = iu.ratio(a, b)
    return "-" if r is None else fmt.format(r)


def headline(rows, bench):
    """The README's row: SDPA against naive attention at the longest context, and on the model."""
    naive, sdpa = bench["naive"], bench["SDPA"]
    by_name = {r["variant"]: r for r in rows}
    on_model = ["-" if by_name[v]["ttft_ms"] is None else f"{by_name[v]['ttft_ms']:.1f}"
                for v in ("SDPA (default dispatch)", "naive")]
    return dict(technique=f"SDPA vs naive attention, {naive['context'][-1]:,} tokens",
                figure=f"{times(naive['peak_mb'][-1], sdpa['peak_mb'][-1], '{:.0f}x')} less peak attention memory, "
                       f"{times(naive['ms'][-1], sdpa['ms'][-1])} faster; on the model TTFT {on_model[0]} against "
                       f"{on_model[1]} ms, the same tokens")


def attention_methods(rows, bench):
    """The summary of attention methods' row (lib/attention_summary.py): SDPA against naive attention."""
    naive, sdpa = bench["naive"], bench["SDPA"]
    diff = next(r["max_logit_diff"] for r in rows if r["variant"] == "SDPA (default dispatch)")
    return [attention_summary.method_row(
        "FlashAttention (SDPA)", True, f"max |logit diff| {diff} (float32 sums in another order)", 0, "none",
        "attention memory and time", f"peak {times(naive['peak_mb'][-1], sdpa['peak_mb'][-1], '{:.0f}x')} and time "
        f"{times(naive['ms'][-1], sdpa['ms'][-1])} below naive's at {naive['context'][-1]:,} tokens",
        attention_summary.pays_from(naive["context"], sdpa["ms"], naive["ms"]))]


def parse_args(argv):
    """The flags, checked before any work: (args, preset, device, data)."""
    parser = harness.script_parser(__doc__)
    at_least = harness.int_at_least
    harness.add_generation_flags(parser, batch_size=8, prompt_len=64, n_tokens=64, repeats=5)
    parser.add_argument("--val-batches", type=harness.batches, default=20,
                        help="validation batches (of 32 x seqlen) for the loss")
    parser.add_argument("--contexts", type=at_least(1), nargs="+", default=[128, 256, 512, 1024, 2048, 4096, 8192],
                        help="context lengths of the long-context attention benchmark, increasing")
    parser.add_argument("--bench-batch", type=at_least(1), default=1,
                        help="batch of the long-context benchmark (naive attention holds batch*heads*n^2 scores)")
    parser.add_argument("--bench-repeats", type=harness.repeats, default=3,
                        help="timed runs per context length, median taken (naive attention at 8,192 takes seconds)")
    parser.add_argument("--window", type=at_least(1), default=256, help="FlexAttention's sliding window, in tokens")
    parser.add_argument("--no-flex", action="store_true", help="leave FlexAttention out (it compiles a kernel first)")
    args = parser.parse_args(argv)

    def check_args(preset):
        if args.contexts != sorted(set(args.contexts)):
            parser.error(f"--contexts must be increasing without repeats, got {args.contexts}")
        H, D, length = preset.n_heads, preset.d_head, args.prompt_len + args.n_tokens
        harness.check_fits(parser, "--batch-size", ab.generation_bytes(preset, max(args.batch_size, 32), preset.seqlen),
                           "the model checks and generation of the prompts")  # the loss runs batches of 32
        harness.check_fits(parser, "--n-tokens", ab.generation_bytes(preset, args.batch_size, length),
                           "the generated tokens")
        harness.check_fits(parser, "--contexts", ab.benchmark_bytes(args.contexts, 1, H, D),
                           "naive attention at the longest context")
        harness.check_fits(parser, "--bench-batch", ab.benchmark_bytes(args.contexts, args.bench_batch, H, D),
                           "naive attention on the benchmark's batch")
        if not args.no_flex:
            harness.check_fits(parser, "--window", ab.benchmark_bytes([2 * args.window + 3], 1, 2, 16),
                               "checking FlexAttention against naive attention over two windows")
    return (args, *harness.setup(args, parser, check_args))


def main(argv=None):
    args, preset, device, data = parse_args(argv)
    naive = iu.load_model(GPTlite_KVCache, preset, device, data, untrained=args.untrained, seed=args.seed)
    sdpa = use_sdpa(copy.deepcopy(naive))
    prompts = corpus.sample_prompts(data, args.batch_size, args.prompt_len, seed=args.seed, device=device)
    runs, found = check_variants(naive, sdpa, data, prompts, args.n_tokens, preset.seqlen, device, args.val_batches)
    variants = {"naive": ab.naive_attention, "SDPA": ab.sdpa_attention}
    flex, flex_diff, flex_note = (None, None, "left out (--no-flex)") if args.no_flex else ab.make_flex(args.window, device)
    if flex is not None:
        variants[f"flex window {args.window}"] = flex
    checks = {f"{name}: outputs, tokens and loss equal naive attention's (logits atol {ATOL})": f.get("ok") != "NO"
              for name, f in found.items()}
    if flex_diff is not None:
        checks[f"flex attention (max |diff| {flex_diff:.1e}, atol {FLEX_ATOL})"] = flex_diff <= FLEX_ATOL
    harness.require_checks(checks)

    rows = model_rows(runs, found, prompts, args.n_tokens, preset.seqlen, device, args.repeats)
    H, D = preset.n_heads, preset.d_head
    bench, bench_line = long_context(variants, args.contexts, args.bench_batch, H, D, device, args.bench_repeats,
                                     args.seed)
    flex_line = (f"FlexAttention: {flex_note}" if flex_note else f"FlexAttention, sliding window {args.window}, "
                 f"against naive attention with the same mask: max |diff| {flex_diff:.1e}")
    summary = [f"{args.batch_size} prompts of {args.prompt_len} tokens, {args.n_tokens} new tokens each, median of "
               f"{args.repeats} runs; TTFT is the prefill of the prompts and their first token",
               iu.peak_memory_label(device),
               f"long-context attention alone: batch {args.bench_batch}, {H} heads of {D}, causal (flex: "
               f"sliding-window causal), median of {args.bench_repeats} runs, peak MB above the inputs",
               flex_line, bench_line]
    title = f"attention, {H} heads of {D}, batch {args.bench_batch} ({device})"
    harness.report(args, "main_flash_attention.py", preset, device, rows, headline(rows, bench), summary=summary,
                   attention_methods=attention_methods(rows, bench),
                   tables=[long_context_table(bench)], plot=lambda: ab.plot(bench, title),
                   prompt_len=args.prompt_len, n_tokens=args.n_tokens, batch_size=args.batch_size, long_context=bench,
                   bench_batch=args.bench_batch, window=args.window, flex_max_diff=flex_diff, flex_note=flex_note,
                   checks=checks)


if __name__ == "__main__":
    harness.run(main)
