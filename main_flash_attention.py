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

from lib import attention_benchmark as ab
import inference_utils as iu
from gptlite import MultiHeadAttention
from gptlite_kvcache import GPTlite_KVCache, MultiHeadAttention_KVCache, generate_kvcache
from lib.errors import GPTliteError
from lib import corpus, harness, training

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


def check_args(args, parser, seqlen):
    if args.contexts != sorted(set(args.contexts)):
        parser.error(f"--contexts must be increasing without repeats, got {args.contexts}")


def model_rows(naive, sdpa, data, prompts, n_tokens, seqlen, device, repeats, val_batches):
    """One row for naive attention, one for SDPA as dispatched, one per forced backend (or why it cannot run).
    Each is checked against naive attention first: logits without a cache (is_causal) and with one and
    several new tokens (the shifted mask), greedy tokens, validation loss."""
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
        kv_mb = iu.kv_cache_bytes(naive(held)[1]) / 2**20  # the same cache for every variant
    fns, found, rows = {}, {}, {}
    for name, (model, backend) in variants.items():
        with forced(backend), warnings.catch_warnings(), torch.inference_mode():
            warnings.simplefilter("ignore")  # a forced kernel that cannot run warns why, then raises
            try:
                diff = (model(x)[0] - ref_full).abs().max().item()
                same = torch.equal(generate_kvcache(model, prompts, n_tokens, seqlen), ref_tokens)  # no mask needed
                kernel = sdpa_kernels_run(lambda: model(x))
            except RuntimeError:
                dtype = str(naive.fc_out.weight.dtype).removeprefix("torch.")  # CUDA's flash takes no float32
                rows[name] = harness.make_row(name, kernel=f"cannot run on {device.type} in {dtype}")
                continue
            try:  # some kernels take no explicit mask (CUDA's flash): generation never needs one, chunks do
                diff = max(diff, (chunked_logits(model) - ref_chunked).abs().max().item())
            except RuntimeError:
                kernel += " (no explicit mask)"
        found[name] = (diff, same, kernel)

        def fn(n, model=model, backend=backend):
            with forced(backend):
                return generate_kvcache(model, prompts, n, seqlen)
        fns[name] = fn
    timings = iu.compare_generation(fns, n_tokens, prompts.shape[0], device, warmup=1, repeats=repeats)
    for name, fn in fns.items():
        model, backend = variants[name]
        with forced(backend):
            val_loss = training.validation_loss(model, data, n_batches=val_batches)
        diff, same, kernel = found[name]
        same_loss = name == "naive" or abs(val_loss - rows["naive"]["val_loss"]) <= ATOL
        rows[name] = harness.make_row(name, **timings[name], peak_mem_mb=iu.peak_memory_mb(lambda: fn(n_tokens), device),
                                 kv_cache_mb=kv_mb, val_loss=val_loss, kernel=kernel, max_logit_diff=f"{diff:.1e}",
                                 same_tokens="yes" if same else "NO",
                                 ok="yes" if diff <= ATOL and same and same_loss else "NO")
    return [rows[name] for name in variants]


def long_context(args, n_heads, d_head, device):
    """The attention functions alone on random Q, K, V: naive, SDPA and (where it runs) FlexAttention
    with a sliding window, checked first against naive attention with the same mask."""
    variants = {"naive": ab.naive_attention, "SDPA": ab.sdpa_attention}
    flex_diff, flex_note = None, "left out (--no-flex)"
    if not args.no_flex:
        flex, flex_diff, flex_note = ab.make_flex(args.window, device)
        if flex is not None:
            variants[f"flex window {args.window}"] = flex
            print(f"FlexAttention, sliding window {args.window}, against naive attention with the same mask: "
                  f"max |diff| {flex_diff:.1e}")
    if flex_note:
        print(f"FlexAttention: {flex_note}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bench = ab.benchmark(variants, args.contexts, args.bench_batch, n_heads, d_head, device,
                             repeats=args.bench_repeats, seed=args.seed)
    print(f"\nlong-context attention alone: batch {args.bench_batch}, {n_heads} heads of {d_head}, causal "
          f"(flex: sliding-window causal), median of {args.bench_repeats} runs, peak MB above the inputs")
    print(ab.format_results(bench))
    naive_ms, naive_mb, sdpa_ms, sdpa_mb = (bench[k][f][-1] for k in ("naive", "SDPA") for f in ("ms", "peak_mb"))
    summary = (f"at n={args.contexts[-1]}: SDPA's peak attention memory is {naive_mb / max(sdpa_mb, 1e-6):.0f}x "
               f"below naive's, and SDPA is {naive_ms / sdpa_ms:.1f}x faster")
    print(summary)
    return bench, flex_diff, flex_note, summary


def main(argv=None):
    parser = harness.script_parser(__doc__)
    at_least = harness.int_at_least
    parser.add_argument("--prompt-len", type=at_least(1), default=64, help="prompt length in characters")
    parser.add_argument("--n-tokens", type=at_least(2), default=64, help="new tokens generated per prompt")
    parser.add_argument("--batch-size", type=at_least(1), default=8, help="prompts generated together")
    parser.add_argument("--repeats", type=at_least(1), default=5,
                        help="timed runs per figure, median taken (after one warm-up)")
    parser.add_argument("--val-batches", type=at_least(1), default=20,
                        help="validation batches (of 32 x seqlen) for the loss")
    parser.add_argument("--contexts", type=at_least(1), nargs="+", default=[128, 256, 512, 1024, 2048, 4096, 8192],
                        help="context lengths of the long-context attention benchmark, increasing")
    parser.add_argument("--bench-batch", type=at_least(1), default=1,
                        help="batch of the long-context benchmark (naive attention holds batch*heads*n^2 scores)")
    parser.add_argument("--bench-repeats", type=at_least(1), default=3,
                        help="timed runs per context length, median taken (naive attention at 8,192 takes seconds)")
    parser.add_argument("--window", type=at_least(1), default=256, help="FlexAttention's sliding window, in tokens")
    parser.add_argument("--no-flex", action="store_true", help="leave FlexAttention out (it compiles a kernel first)")
    args = parser.parse_args(argv)
    preset, device, data = harness.setup(args, parser, lambda preset: check_args(args, parser, preset.seqlen))

    naive = iu.load_model(GPTlite_KVCache, preset, device, data, untrained=args.untrained, seed=args.seed)
    sdpa = use_sdpa(copy.deepcopy(naive))
    prompts = corpus.sample_prompts(data, args.batch_size, args.prompt_len, seed=args.seed, device=device)
    rows = model_rows(naive, sdpa, data, prompts, args.n_tokens, preset.seqlen, device, args.repeats,
                      args.val_batches)
    print(f"\n{args.batch_size} prompts of {args.prompt_len} tokens, {args.n_tokens} new tokens each, "
          f"median of {args.repeats} runs; TTFT is the prefill of the prompts and their first token")
    harness.print_table(rows, untrained=args.untrained)
    print(iu.peak_memory_label(device))

    H, D = preset.n_heads, preset.d_head
    bench, flex_diff, flex_note, summary = long_context(args, H, D, device)
    if args.plot:
        ab.plot(bench, args.plot, f"attention, {H} heads of {D}, batch {args.bench_batch} ({device})")
    if args.json:
        harness.save_json(args.json, "main_flash_attention.py", preset, device, rows, untrained=args.untrained,
                     prompt_len=args.prompt_len, n_tokens=args.n_tokens, batch_size=args.batch_size,
                     long_context=bench, bench_batch=args.bench_batch, window=args.window,
                     flex_max_diff=flex_diff, flex_note=flex_note, summary=[iu.peak_memory_label(device), summary])
    failures = [r["variant"] for r in rows if r.get("ok") == "NO"]
    if flex_diff is not None and flex_diff > FLEX_ATOL:
        failures.append(f"flex attention (max |diff| {flex_diff:.1e} > {FLEX_ATOL})")
    if failures:
        raise GPTliteError(f"{', '.join(failures)}: outputs, tokens or loss differ from naive attention "
                              f"(logits atol {ATOL}); this is a bug")


if __name__ == "__main__":
    harness.run(main)
