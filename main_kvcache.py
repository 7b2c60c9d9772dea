"""KV cache: greedy generation without a cache, with the post's dynamic cache, and with a static cache.

    python main_kvcache.py                                  # cpu preset on CPU, gptlite on CUDA
    python main_kvcache.py --prompt-len 32 --n-tokens 128 --json kv.json --sweep --plot kv.png
    python main_kvcache.py --untrained                      # random weights, a quick smoke run

Blog section: "KV cache". Without a cache every new token re-encodes the last `seqlen` tokens; with
one, each step encodes only the new token and attends to the stored keys and values. The dynamic
cache grows with torch.cat; the static one is preallocated and written in place (gpt-fast).

Each variant runs on the decode paths of --paths, side by side: `eager` (PyTorch operators) and `fast`
(lib/fast_decode.py, the whole step as one C++ call, CPU only), where no cache and the static cache are
timed again: eager's per-operator overhead hides part of what a cache saves, the fast path shows it.

The script checks that both caches produce exactly the tokens of generation without a cache while
the sequence fits the window (the first seqlen - prompt_len + 1 new tokens); past it the post's cache
keeps the last seqlen entries (positions frozen at seqlen-1), an approximation of the sliding window,
so later tokens may differ and are only counted.
"""

import numpy as np
import torch

import inference_utils as iu
from gptlite import GPTlite, generate
from gptlite_kvcache import StaticKVCache, generate_kvcache
from lib import corpus, fast_decode, harness, serving, training


def parse_args(argv):
    """The flags, checked before any work: (args, preset, device, data)."""
    parser = harness.script_parser(__doc__)
    harness.add_generation_flags(parser, prompt_len=32, n_tokens=128, repeats=5)
    harness.add_sweep_flags(parser, "numbers of prompts generated together, a row group each",
                            "also time TPOT against the number of generated tokens (8 to 2 x --n-tokens) at each "
                            "batch size: the JSON's tpot_sweep, the curves that --plot draws")
    harness.add_paths_flag(parser)
    args = parser.parse_args(argv)
    return (args, *harness.setup(args, parser, lambda preset: check_args(args, parser, preset)))


def check_args(args, parser, preset):
    harness.check_sweep_flags(parser, args, "the TPOT sweep")
    batch = max(args.batch_sizes)  # no cache: a forward over the window; a cache: the window's keys and values
    harness.check_fits(parser, "--batch-sizes", 2 * serving.forward_bytes(preset, batch),
                       f"a batch of {batch} through the model")
    length = args.prompt_len + (2 if args.sweep else 1) * args.n_tokens  # the tokens of 4 sets of outputs
    harness.check_fits(parser, "--n-tokens", 2 * serving.forward_bytes(preset, batch) + 4 * batch * length * 8,
                       f"{batch} sequences of {length} tokens")


def make_variants(base, cached, prompts, seqlen, paths):
    """The variants as functions of the number of new tokens, on the same prompts: {(name, path): fn}."""
    static_cache = StaticKVCache.for_model(cached, prompts.shape[0], seqlen)  # allocated once, reused

    def static(n, new_cache=False):  # new_cache: allocate inside the call, so that memory counts it
        cache = StaticKVCache.for_model(cached, prompts.shape[0], seqlen) if new_cache else static_cache
        cache.reset()
        return generate_kvcache(cached, prompts, n, seqlen, kv_cache=cache)

    fns = {("no cache", "eager"): lambda n: generate(base, prompts, n, seqlen),
           ("dynamic KV cache", "eager"): lambda n: generate_kvcache(cached, prompts, n, seqlen),
           ("static KV cache", "eager"): static}
    if "fast" in paths:  # the C++ pass: no cache re-encodes the window, the static cache is written in place
        native = fast_decode.native_view(cached)  # the weights packed once, outside the timed calls
        fns[("no cache", "fast")] = lambda n: fast_decode.generate_no_cache(native, prompts, n, seqlen)
        fns[("static KV cache", "fast")] = lambda n, new_cache=False: fast_decode.generate_fast(native, prompts, n, seqlen)
    return {key: fn for key, fn in fns.items() if key[1] in paths}, static_cache


def check_batch(fns, reference, prompts, n_tokens, seqlen):
    """Correctness first: each variant's tokens [B, P + n_tokens] on the batch, the fraction of the tokens
    past the window that equal the reference's (eager generation without a cache), and {check name: the
    in-window tokens equal the reference's}."""
    tokens = {key: fn(n_tokens) for key, fn in fns.items()}
    in_window = prompts.shape[1] + min(seqlen - prompts.shape[1] + 1, n_tokens)  # prompt + new tokens that fit
    checks, after = {}, {}
    for name in fns:
        checks[f"{name[0]}, {name[1]} path (batch {prompts.shape[0]}): tokens equal generation without a cache "
               "within the window"] = torch.equal(tokens[name][:, :in_window], reference[:, :in_window])
        after[name] = (f"{(tokens[name][:, in_window:] == reference[:, in_window:]).float().mean().item():.0%}"
                       if tokens[name].shape[1] > in_window else "-")
    return tokens, after, checks


def measure_batch(base, cached, batch, n_tokens, seqlen, device, repeats, val_losses):
    """One row per variant for a batch of prompts whose tokens were checked (check_batch)."""
    prompts, fns, static_cache, tokens, after = batch
    timings = iu.compare_generation(fns, n_tokens, prompts.shape[0], device, warmup=1, repeats=repeats)
    rows = []
    for (name, path), fn in fns.items():
        memory_run = lambda: fn(n_tokens)  # noqa: E731
        if name == "no cache":
            kv_bytes = None
        elif name == "static KV cache":
            kv_bytes = iu.kv_cache_bytes(static_cache)  # preallocated for seqlen (the fast path's too)
            memory_run = lambda: fn(n_tokens, new_cache=True)  # noqa: E731  (so that its buffers count)
        else:  # the dynamic cache at the end of generation holds the last min(length, seqlen) tokens
            full = tokens[name, path][:, :-1]  # every token but the last has its keys and values cached
            with torch.inference_mode():
                kv_bytes = iu.kv_cache_bytes(cached(full[:, -seqlen:])[1])
        rows.append(harness.make_row(
            name, path=path, batch_size=prompts.shape[0], **timings[name, path],
            peak_mem_mb=iu.peak_memory_mb(memory_run, device),
            kv_cache_mb=kv_bytes / 2**20 if kv_bytes is not None else None,
            val_loss=val_losses[name], same_in_window="yes", same_after_window=after[name, path]))
    return rows


def tpot_sweep(fns_by_batch, n_tokens, device, repeats):
    """--sweep: TPOT of every variant against the number of generated tokens, at each batch size."""
    counts = sorted({n for n in (8, 16, 32, 64, 128, 256, 512) if n <= 2 * n_tokens} | {n_tokens})
    sweep = {}
    for batch_size, fns in fns_by_batch.items():
        by_count = [iu.compare_generation(fns, n, batch_size, device, repeats=repeats) for n in counts]
        sweep[batch_size] = {f"{name}, {path}": {"n_tokens": counts, "tpot_ms": [r[name, path]["tpot_ms"]
                                                                                  for r in by_count]}
                             for name, path in fns}
    return sweep


def ratio_lines(rows, batch_sizes):
    """Per path and batch size: TPOT of no cache / the fastest cache, and static / dynamic where both ran."""
    tpot = {(r["variant"], r["path"], r["batch_size"]): r["tpot_ms"] for r in rows}
    lines = []
    for path in dict.fromkeys(r["path"] for r in rows):
        for batch_size in batch_sizes:
            caches = [c for c in ("dynamic KV cache", "static KV cache") if (c, path, batch_size) in tpot]
            figures = [tpot["no cache", path, batch_size]] + [tpot[c, path, batch_size] for c in caches]
            if any(f is None for f in figures):  # a difference of two medians that noise swallowed
                lines.append(f"{path} path, batch {batch_size}: TPOT too small to measure against timing noise; "
                             "raise --n-tokens or --repeats")
                continue
            best = min(caches, key=lambda c: tpot[c, path, batch_size])
            line = (f"{path} path, batch {batch_size}: TPOT no cache / {best} = "
                    f"{figures[0] / tpot[best, path, batch_size]:.2f}x")
            if len(caches) == 2:
                line += f", static / dynamic = {figures[2] / figures[1]:.2f}"
            lines.append(line)
    return lines


def headline(rows):
    """The README's one-glance row, from this run's rows: no cache / static cache per path and batch size."""
    tpot = {(r["variant"], r["path"], r["batch_size"]): r["tpot_ms"] for r in rows}
    batches = sorted({r["batch_size"] for r in rows}, reverse=True)

    def x(path, b):  # '-' where either could not be measured
        value = iu.ratio(tpot["no cache", path, b], tpot["static KV cache", path, b])
        return "-" if value is None else f"{value:.1f}x"

    return {"technique": "KV cache, dynamic and static",
            "figure": "TPOT no cache / static cache: " + "; ".join(
                f"{path} " + ", ".join(f"{x(path, b)} at batch {b}" for b in batches)
                for path in dict.fromkeys(r["path"] for r in rows)) + "; the same tokens within the window"}


def plot_tpot_sweep(sweep, preset, device):
    fig, axes = harness.new_figure(len(sweep))
    for ax, (batch_size, by_variant) in zip(np.atleast_1d(axes), sweep.items()):
        for variant, points in by_variant.items():
            tpot = [np.nan if t is None else t for t in points["tpot_ms"]]  # unmeasurable: a gap
            ax.plot(points["n_tokens"], tpot, marker="o", label=variant)
        ax.set(xscale="log", ylim=(0, None), xlabel="generated tokens", ylabel="TPOT (ms)",
               title=f"batch {batch_size} (preset {preset.name}, {device})")
        ax.legend()
    return fig


def main(argv=None):
    args, preset, device, data = parse_args(argv)
    base = iu.load_model(GPTlite, preset, device, data, untrained=args.untrained, seed=args.seed)
    cached = iu.kv_cache_model(base)  # the same weights, trained or not
    seqlen = preset.seqlen
    batches, checks = {}, {}
    for batch_size in args.batch_sizes:  # correctness first, every batch, before anything is timed
        prompts = corpus.sample_prompts(data, batch_size, args.prompt_len, seed=args.seed, device=device)
        fns, static_cache = make_variants(base, cached, prompts, seqlen, args.paths)
        reference = generate(base, prompts, args.n_tokens, seqlen)  # eager, no cache: the reference
        tokens, after, batch_checks = check_batch(fns, reference, prompts, args.n_tokens, seqlen)
        batches[batch_size], checks = (prompts, fns, static_cache, tokens, after), checks | batch_checks
    harness.require_checks(checks)

    val_losses = {"no cache": training.validation_loss(base, data)}
    val_losses["dynamic KV cache"] = val_losses["static KV cache"] = training.validation_loss(cached, data)
    rows = [row for batch in batches.values()
            for row in measure_batch(base, cached, batch, args.n_tokens, seqlen, device, args.repeats, val_losses)]
    sweep = tpot_sweep({b: batch[1] for b, batch in batches.items()}, args.n_tokens, device,
                       args.repeats) if args.sweep else None

    in_window = min(seqlen - args.prompt_len + 1, args.n_tokens)
    print(f"\nprompts of {args.prompt_len} tokens, {args.n_tokens} new tokens each, window seqlen={seqlen} "
          f"(the first {in_window} new tokens must match no cache), median of {args.repeats} runs")
    summary = [iu.peak_memory_label(device)] + ratio_lines(rows, args.batch_sizes)
    harness.report(args, "main_kvcache.py", preset, device, rows, headline(rows), summary=summary,
                   plot=lambda: plot_tpot_sweep(sweep, preset, device), prompt_len=args.prompt_len,
                   n_tokens=args.n_tokens, tokens_in_window=in_window, tpot_sweep=sweep)


if __name__ == "__main__":
    harness.run(main)
