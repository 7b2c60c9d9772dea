"""Split-KV decoding (FlashDecoding): one query over a long cache, the keys and values cut into chunks
whose partial outputs are combined with the online-softmax rescaling.

    python main_flash_decoding.py                     # cpu preset on CPU, gptlite on CUDA
    python main_flash_decoding.py --contexts 1024 8192 65536 --splits 1 8 64 --json fd.json --plot fd.png
    python main_flash_decoding.py --untrained --contexts 256 1024 --splits 1 4 --repeats 1   # a quick smoke run

Blog section: "FlashDecoding". At decode time there is one
query per sequence and head, so FlashAttention has B * H units of work (thread blocks) to spread over the
GPU: at batch 1 with 6 heads, 6 of an H100's 132 SMs work and the rest idle while the cache streams in.
FlashDecoding also splits the cache along its length: B * H * n_splits units, each reducing its chunk to a
partial output and a log-sum-exp, then a small reduction combines them. The result is exact (the same
softmax, summed in another order); the Flash-Decoding post reports up to 8x faster long-context
generation on GPU. A CPU has a few cores that the B * H units (and the matrix products inside each) keep
busy already, so splitting only adds work there: the script measures it and says so.

Checks before any timing: flash_decoding against the reference attention for every split count of the
benchmark (random inputs, float32, atol 1e-5), and a cached GPTlite whose decode steps use it gives the
same tokens (and logits within 1e-4) as the reference model.
"""
import copy

import torch
import torch.nn.functional as F

import inference_utils as iu
from gptlite_kvcache import GPTlite_KVCache, MultiHeadAttention_KVCache, generate_kvcache
from gptlite_kvcache import scaled_dot_product_attention_kv_cache as reference_attention
from gptlite_kvcache import swap_attention
from lib import attention_benchmark as ab
from lib import attention_summary, corpus, harness

ATOL = 1e-5  # float32 attention outputs on random unit inputs
LOGITS_ATOL = 1e-4  # float32 logits of a trained model (units to tens)
H100_SMS = 132  # streaming multiprocessors of an H100 SXM: the units of work a decode step can fill


def flash_decoding(q, k, v, n_splits):
    """q: [B, H, 1, D], k and v: [B, H, T, D]. Attention of the one query over the T keys, computed in
    n_splits chunks of keys (sizes differ by at most one) and combined exactly."""
    check_flash_decoding_args(q, k, v, n_splits)
    outs, lses = [], []
    for k_chunk, v_chunk in zip(k.tensor_split(n_splits, dim=2), v.tensor_split(n_splits, dim=2)):
        scores = q @ k_chunk.transpose(-2, -1) / q.shape[-1] ** 0.5  # [B, H, 1, Tc]
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # [B, H, 1, 1]: the chunk's softmax denominator
        outs.append(torch.exp(scores - lse) @ v_chunk)  # [B, H, 1, D]: the chunk's own softmax average
        lses.append(lse)
    # online-softmax combine: chunk i weighs exp(lse_i - lse_all), i.e. its share of the whole denominator
    weights = torch.softmax(torch.cat(lses, dim=-1), dim=-1)  # [B, H, 1, n_splits]
    return (torch.stack(outs, dim=-1) * weights.unsqueeze(-2)).sum(-1)  # [B, H, 1, D]


def check_flash_decoding_args(q, k, v, n_splits):
    if q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"flash_decoding takes one query per sequence and head, q of shape [B, H, 1, D]; got "
                         f"{tuple(q.shape)} (for several queries use the reference attention)")
    if k.shape != v.shape or k.dim() != 4 or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"k and v must both be [B, H, T, D] with q's B, H and D; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if isinstance(n_splits, bool) or not isinstance(n_splits, int) or not 1 <= n_splits <= k.shape[2]:
        raise ValueError(f"n_splits must be an integer between 1 and the number of keys T={k.shape[2]}, "
                         f"got {n_splits!r}")


class MultiHeadAttention_FlashDecoding(MultiHeadAttention_KVCache):
    """The cached attention of GPTlite_KVCache; decode steps (one new token) use flash_decoding."""
    n_splits = 1

    def attention(self, Q, K, V):
        if Q.shape[2] != 1:  # a prefill or several new tokens: the reference, with the shifted causal mask
            return super().attention(Q, K, V)
        return flash_decoding(Q, K, V, min(self.n_splits, K.shape[2]))  # a short cache: one key per chunk


def use_flash_decoding(model, n_splits):
    """Make the decode steps of a GPTlite_KVCache use flash_decoding with n_splits, in place (the class of
    each attention module is swapped, weights stay). Returns model."""
    if isinstance(n_splits, bool) or not isinstance(n_splits, int) or n_splits < 1:
        raise ValueError(f"n_splits must be a positive integer, got {n_splits!r}")
    return swap_attention(model, MultiHeadAttention_FlashDecoding, n_splits=n_splits)


def sdpa_decode(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)  # one query: no mask


def check_exactness(splits, n_heads, d_head, device, seed):
    """Max |flash_decoding - reference| over random inputs whose length no split count divides evenly."""
    T = max(211, 2 * max(splits) + 1)  # 211 = 2*3*5*7 + 1: no small split count divides it
    q, k, v = torch.randn(3, 2, n_heads, T, d_head, device=device, generator=torch.Generator(device).manual_seed(seed))
    ref = reference_attention(q[:, :, :1], k, v)
    return max((flash_decoding(q[:, :, :1], k, v, n) - ref).abs().max().item() for n in splits), T


def check_model(model, splits, prompts, n_tokens, seqlen):
    """Greedy tokens and decode-step logits of the model with flash decoding, against the reference model."""
    ref_tokens = generate_kvcache(model, prompts, n_tokens, seqlen)
    found = {}
    with torch.inference_mode():
        _, cache = model(prompts)
        ref_logits, _ = model(ref_tokens[:, prompts.shape[1]:prompts.shape[1] + 1], kv_cache=cache)
    for n in splits:
        fd = use_flash_decoding(copy.deepcopy(model), n)
        with torch.inference_mode():
            logits, _ = fd(ref_tokens[:, prompts.shape[1]:prompts.shape[1] + 1], kv_cache=cache)
        same = torch.equal(generate_kvcache(fd, prompts, n_tokens, seqlen), ref_tokens)
        found[n] = ((logits - ref_logits).abs().max().item(), same, fd)
    return found


def context_label(n):
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def plot(bench, contexts, splits, title):
    """Decode attention time against context length, and each n_splits' time over SDPA's: the figure."""
    fig, (ax_ctx, ax_split) = harness.new_figure(2)
    for name, ms in bench.items():
        ax_ctx.plot(contexts, ms, marker="o", label=name, linestyle="--" if name in ("naive", "SDPA") else "-")
    ax_ctx.set(xscale="log", yscale="log", xlabel="context length (tokens)", ylabel="decode attention ms (median)",
               title=title)
    ax_ctx.set_xscale("log", base=2)
    for i, n in enumerate(contexts):
        ax_split.plot(splits, [bench[f"flash n_splits={s}"][i] / bench["SDPA"][i] for s in splits], marker="o",
                      label=f"context {context_label(n)}")
    ax_split.axhline(1.0, color="gray", linestyle=":")
    ax_split.set(xscale="log", xlabel="n_splits", ylabel="time / SDPA's", title="flash decoding against SDPA")
    ax_split.set_xscale("log", base=2)
    for ax in (ax_ctx, ax_split):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    return fig


def check_args(args, parser, preset):
    for flag in ("contexts", "splits"):
        values = getattr(args, flag)
        if values != sorted(set(values)):
            parser.error(f"--{flag} must be increasing without repeats, got {values}")
    if args.splits[-1] > args.contexts[0]:
        parser.error(f"--splits: {args.splits[-1]} chunks do not fit the shortest context {args.contexts[0]}; "
                     "give split counts at most the first --contexts value")
    H, D = preset.n_heads, preset.d_head
    harness.check_fits(parser, "--contexts", ab.benchmark_bytes(args.contexts, 1, H, D, n_queries=1),
                       "a cache of the longest context")
    harness.check_fits(parser, "--bench-batch", ab.benchmark_bytes(args.contexts, args.bench_batch, H, D, n_queries=1),
                       "the benchmark's caches")
    harness.check_fits(parser, "--splits", ab.benchmark_bytes([max(211, 2 * args.splits[-1] + 1)], 2, H, D, n_queries=1),
                       "the exactness check's inputs")
    harness.check_fits(parser, "--batch-size", ab.generation_bytes(preset, args.batch_size, preset.seqlen),
                       "the model check's prompts")
    harness.check_fits(parser, "--n-tokens", ab.generation_bytes(preset, args.batch_size, args.prompt_len + args.n_tokens),
                       "the model check's generated tokens")


def parse_args(argv):
    """The flags, checked before any work: (args, preset, device, data)."""
    parser = harness.script_parser(__doc__)
    at_least = harness.int_at_least
    parser.add_argument("--contexts", type=at_least(1), nargs="+", default=[1024, 4096, 16384, 65536],
                        help="cache lengths of the decode-attention benchmark, increasing")
    parser.add_argument("--splits", type=at_least(1), nargs="+", default=[1, 4, 16, 64],
                        help="n_splits values of flash_decoding, increasing, at most the shortest context")
    parser.add_argument("--bench-batch", type=at_least(1), default=1,
                        help="sequences of the benchmark (FlashDecoding is for small batches)")
    harness.add_generation_flags(parser, batch_size=4, prompt_len=64, n_tokens=64, repeats=20)
    args = parser.parse_args(argv)
    return (args, *harness.setup(args, parser, lambda preset: check_args(args, parser, preset)))


def benchmark_rows(bench, contexts, bench_batch, n_heads, found):
    """One row per variant: its median ms at each context, and (flash decoding) its split count, units of work
    and model check."""
    rows = []
    for name, ms in bench.items():
        n = int(name.split("=")[1]) if name.startswith("flash") else None
        row = harness.make_row(name, n_splits=n, work_units=bench_batch * n_heads * (n or 1))
        row.update({f"{context_label(c)} ms": t for c, t in zip(contexts, ms)})
        if n is not None:
            d, same, _ = found[n]
            row.update(max_logit_diff=f"{d:.1e}", same_tokens="yes" if same else "NO")
        rows.append(row)
    return rows


def summary_lines(rows, diff, last, device, bench_batch, n_heads):
    flash = [r for r in rows if r["n_splits"]]
    best = min(flash, key=lambda r: r[f"{last} ms"])
    sdpa, one = rows[1][f"{last} ms"], flash[0][f"{last} ms"]
    summary = [f"exact: max |diff| {diff:.1e} against the reference on random inputs; the model's tokens are "
               "the same for every n_splits",
               f"at {last} tokens on {device.type}: SDPA {sdpa:.3f} ms, naive {rows[0][f'{last} ms']:.3f} ms, "
               f"{flash[0]['variant']} {one:.3f} ms, best {best['variant']} {best[f'{last} ms']:.3f} ms "
               f"({best[f'{last} ms'] / sdpa:.2f}x SDPA's time)"]
    if device.type == "cpu":
        gain = "no gain" if best is flash[0] else f"{one / best[f'{last} ms']:.2f}x against n_splits=1"
        summary.append(f"splitting on CPU: {gain}; {bench_batch * n_heads} (batch x heads) units and the products "
                       f"inside them already feed {torch.get_num_threads()} thread(s); the Flash-Decoding gain "
                       "(up to 8x) is a GPU effect: SMs idle at small batch")
    return summary


def headline(rows, diff, last, bench_batch, device):
    """The README's row: each end of the split counts against SDPA at the longest context."""
    flash = [row for row in rows if row["n_splits"]]
    best = min(flash, key=lambda row: row[f"{last} ms"])
    sdpa = next(row for row in rows if row["variant"] == "SDPA")[f"{last} ms"]
    ratio = lambda row: "-" if iu.ratio(row[f"{last} ms"], sdpa) is None else f"{iu.ratio(row[f'{last} ms'], sdpa):.2f}x"  # noqa: E731
    return dict(technique=f"FlashDecoding (split-KV), one query over {last} tokens, batch {bench_batch}",
                figure="time / SDPA's: " + ", ".join(f"n_splits={row['n_splits']} {ratio(row)}" for row in (flash[0], flash[-1]))
                + f" (best n_splits={best['n_splits']}) on {device}; exact (max |diff| {diff:.0e}), the same tokens "
                "for every n_splits")


def attention_methods(bench, contexts, diff):
    """The summary of attention methods' row (lib/attention_summary.py): the best split count against SDPA."""
    flash = {name: ms for name, ms in bench.items() if name.startswith("flash")}
    best = min(flash, key=lambda name: flash[name][-1])
    return [attention_summary.method_row(
        "FlashDecoding (split-KV)", True, f"max |diff| {diff:.0e} on random inputs", 0, "none",
        "idle compute units at small batch (a GPU effect)",
        f"{best}: {bench['SDPA'][-1] / flash[best][-1]:.2f}x SDPA's speed at {contexts[-1]:,} tokens",
        attention_summary.pays_from(contexts, flash[best], bench["SDPA"]))]


def main(argv=None):
    args, preset, device, data = parse_args(argv)
    H, D = preset.n_heads, preset.d_head
    diff, n_keys = check_exactness(args.splits, H, D, device, args.seed)
    model = iu.load_model(GPTlite_KVCache, preset, device, data, untrained=args.untrained, seed=args.seed)
    prompts = corpus.sample_prompts(data, args.batch_size, args.prompt_len, seed=args.seed, device=device)
    found = check_model(model, args.splits, prompts, args.n_tokens, preset.seqlen)
    print(f"flash_decoding against the reference attention, n_splits {args.splits}, {n_keys} keys: "
          f"max |diff| {diff:.1e}")
    checks = {f"flash_decoding against the reference attention (max |diff| {diff:.1e}, atol {ATOL})": diff <= ATOL}
    checks.update({f"model with n_splits={n}: the reference's tokens and logits (max |diff| {d:.1e}, atol "
                   f"{LOGITS_ATOL})": d <= LOGITS_ATOL and same for n, (d, same, _) in found.items()})
    harness.require_checks(checks)

    variants = {"naive": reference_attention, "SDPA": sdpa_decode}
    variants.update({f"flash n_splits={n}": (lambda q, k, v, n=n: flash_decoding(q, k, v, n)) for n in args.splits})
    bench = ab.benchmark(variants, args.contexts, args.bench_batch, H, D, device, args.repeats, args.seed, n_queries=1,
                         peak_memory=False)
    bench = {name: r["ms"] for name, r in bench.items()}
    rows = benchmark_rows(bench, args.contexts, args.bench_batch, H, found)
    last = context_label(args.contexts[-1])
    print(f"\ndecode attention alone: one query over a cache of n tokens, batch {args.bench_batch}, {H} heads of {D}, "
          f"median of {args.repeats}; work_units = batch x heads x n_splits (an H100 has {H100_SMS} SMs); "
          f"model check: {args.batch_size} prompts of {args.prompt_len}, {args.n_tokens} greedy tokens")
    summary = summary_lines(rows, diff, last, device, args.bench_batch, H)
    title = f"decode attention, batch {args.bench_batch}, {H} heads of {D} ({device.type})"
    harness.report(args, "main_flash_decoding.py", preset, device, rows,
                   headline(rows, diff, last, args.bench_batch, device), summary=summary,
                   attention_methods=attention_methods(bench, args.contexts, diff),
                   plot=lambda: plot(bench, args.contexts, args.splits, title), contexts=args.contexts,
                   splits=args.splits, bench_batch=args.bench_batch, max_diff=diff, threads=torch.get_num_threads(),
                   checks=checks)


if __name__ == "__main__":
    harness.run(main)
