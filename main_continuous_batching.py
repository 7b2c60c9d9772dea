"""Continuous batching, and a small serving engine with a paged KV cache and chunked prefill, on one trace.

    python main_continuous_batching.py                     # cpu preset on CPU, gptlite on CUDA
    python main_continuous_batching.py --rate 50 --batch-size 8 --plot batching.png --json batching.json
    python main_continuous_batching.py --untrained --n-requests 8
    python main_continuous_batching.py --prefix-sharing    # a shared system prompt, multi-turn: sharing off / on

Blog section: "Batching / continuous batching" and beyond the post. `continuous_batching` is the post's:
a request leaves its slot as soon as it is done and a waiting one takes it; the padded batch (no
cache, `next_tokens`) is rebuilt every step. paged_engine.py is what serving engines do: a paged KV
cache (blocks on demand, attention through block tables), chunked prefill mixed with decodes
(Sarathi-Serve), admission by free blocks, and preemption with recompute.

One trace (Poisson arrivals at --rate with a seed, log-normal prompt and output lengths) runs through
static batching, the post's continuous batching, and the paged engine with whole-prompt and with
chunked prefill, all with the same batch size (batch slots). Arrivals are simulated against each
engine's own clock (serving.py): the clock advances by each step's measured wall time and jumps to
the next arrival when the engine is idle; TTFT and TPOT are measured from each request's arrival,
throughput is new tokens per second of steps. Every request's tokens must equal generating it alone
with `generate_kvcache`. KV utilization = tokens held / slots reserved, summed over steps, for the
paged pool (allocated blocks) and for a contiguous cache that reserves seqlen slots per sequence.

--prefix-sharing runs two other traces through the engine with chunked prefill, without and with
prefix sharing (vLLM's automatic prefix caching: full KV blocks shared by their chained hash):
requests after one system prompt, and conversations whose every turn resends the conversation so far.
"""
import argparse
from collections import deque

import numpy as np
import torch
from tqdm import tqdm

import inference_utils as iu
from lib import serving
from gptlite import GPTlite
from main_static_batching import next_tokens, static_batching
from lib.paged_engine import PagedEngine
from lib.errors import GPTliteError
from lib import harness, training


def continuous_batching(model, requests, batch_size, seqlen, clock=None):
    """Generate every request (prompt, n_tokens) with at most batch_size in the batch; a finished
    request leaves at once and the next arrived one (`clock`, None: all at time 0) takes its slot.
    Returns (outputs, n_steps): outputs[i] is request i's prompt followed by its n_tokens new tokens (1-D)."""
    requests = serving.check_requests(model, requests, batch_size, seqlen)
    clock = clock or serving.ServingClock.offline(requests, requests[0][0].device)
    sequences = [prompt for prompt, _ in requests]
    n_generated = [0] * len(requests)
    waiting, running, n_steps = deque(range(len(requests))), [], 0
    while waiting or running:
        while waiting and len(running) < batch_size and clock.arrived(waiting[0]):
            running.append(waiting.popleft())  # a free slot takes the next request
        if not running:
            clock.wait_for(waiting[0])
            continue
        with clock.step(rows=len(running)):
            tokens = next_tokens(model, [sequences[i] for i in running], seqlen).tolist()  # a new padded batch
            for i, token in zip(running, tokens):
                sequences[i] = torch.cat([sequences[i], sequences[i].new_tensor([token])])
                n_generated[i] += 1
        for i in running:
            clock.token(i, n_generated[i])
        running = [i for i in running if n_generated[i] < requests[i][1]]  # finished requests leave
        n_steps += 1
    return sequences, n_steps


VARIANTS = ("static", "continuous", "paged", "chunked", "shared")  # --variants: run_variants' variants


def run_variants(base, requests, arrivals, batch_size, args, seqlen, device, memory=False, names=None,
                 clock_figures=None):
    """Each variant on the trace (`names`, default --variants): {name: [(outputs, figures) per run]};
    with `memory`, one more (untimed) run of each variant gives its peak memory, figures["peak_mem_mb"];
    clock_figures(clock): more figures of a run from its clock."""
    n_blocks = args.n_blocks or batch_size * seqlen // args.block_size  # the memory of a contiguous cache

    def engine(chunk_size, prefix_sharing=False):
        def serve(requests, clock):
            eng = PagedEngine(base, n_blocks, args.block_size, batch_size, chunk_size, prefix_sharing)
            outputs, _ = eng.generate(requests, seqlen, clock)
            return outputs, dict(kv_cache_mb=eng.runner.nbytes / 2**20, **eng.stats)
        return serve

    variants = {
        "static": ("static batching", lambda r, c: (static_batching(base, r, batch_size, seqlen, c)[0], {})),
        "continuous": ("continuous batching", lambda r, c: (continuous_batching(base, r, batch_size, seqlen, c)[0], {})),
        "paged": ("paged, whole prompts", engine(None)),
        "chunked": (f"paged, chunked prefill {args.chunk_size}", engine(args.chunk_size)),
        "shared": (f"paged, chunked prefill {args.chunk_size}, prefix sharing", engine(args.chunk_size, True)),
    }
    variants = dict(variants[key] for key in names or args.variants)  # the subset asked for, in this order
    for serve in variants.values():
        serve(requests[:2], serving.ServingClock.offline(requests[:2], device))  # warm-up
    results = {name: [] for name in variants}
    bar = tqdm(total=args.repeats * len(variants), desc=f"trace runs, batch {batch_size}", dynamic_ncols=True)
    for _ in range(args.repeats):  # round-robin: a slow moment of the machine falls on every variant alike
        for name, serve in variants.items():
            bar.set_postfix_str(name)
            clock = serving.ServingClock(arrivals, [n for _, n in requests], device)
            outputs, extra = serve(requests, clock)
            more = clock_figures(clock) if clock_figures else {}
            results[name].append((outputs, serving.latency_figures(clock) | extra | more))
            bar.update()
    bar.close()
    for name, serve in variants.items() if memory else ():
        clock = serving.ServingClock(arrivals, [n for _, n in requests], device)
        peak = iu.peak_memory_mb(lambda: serve(requests, clock), device)  # noqa: B023  (called at once)
        for _, figures in results[name]:
            figures["peak_mem_mb"] = peak
    return results


def make_rows(results, reference):
    """A row per variant: the median of each figure over the repeats; `same` only if every run matched."""
    rows = []
    for name, runs in results.items():
        figures = serving.median_figures([f for _, f in runs])
        same = [serving.same_outputs(outputs, reference) for outputs, _ in runs]
        kv_util, contiguous = figures.get("kv_util"), figures.get("kv_util_contiguous")
        rows.append(harness.make_row(name, kv_cache_mb=figures.get("kv_cache_mb"), peak_mem_mb=figures.get("peak_mem_mb"),
                                **{k: figures[k] for k in ("ttft_arrival_ms", "ttft_arrival_p99_ms", "tpot_ms",
                                                           "tpot_p99_ms", "tokens_per_s")},
                                steps=figures["steps"], wasted=figures["wasted_slot_steps"],
                                kv_util=None if kv_util is None else round(kv_util, 3),
                                kv_contig=None if contiguous is None else round(contiguous, 3),
                                preempted=figures.get("preemptions"),
                                same=next((s for s in same if s != "yes"), "yes")))
    return rows


def sharing_rows(trace, results, reference):
    """A row per variant of a prefix-sharing trace: the median of each figure over the repeats."""
    rows = []
    for name, runs in results.items():
        f = serving.median_figures([f for _, f in runs])
        same = [serving.same_outputs(outputs, reference) for outputs, _ in runs]
        rows.append(harness.make_row(f"{trace}, {'prefix sharing' if name.endswith('sharing') else 'no sharing'}",
                                **{k: f[k] for k in ("ttft_arrival_ms", "ttft_arrival_p99_ms", "tpot_ms",
                                                     "tpot_p99_ms", "tokens_per_s")},
                                steps=f["steps"], computed=f["computed_tokens"], hit_rate=round(f["hit_rate"], 3),
                                kv_blocks=round(f["blocks_used"], 1), kv_blocks_peak=f["blocks_peak"],
                                evicted=f["evictions"], cow=f["cow_copies"], preempted=f["preemptions"],
                                same=next((s for s in same if s != "yes"), "yes")))
    return rows


def prefix_sharing_experiment(base, data, args, seqlen, device):
    """The system-prompt and the multi-turn traces through the engine with chunked prefill, without and
    with prefix sharing, round-robin. Returns the rows, the summary lines and the traces' sizes."""
    cached = iu.kv_cache_model(base)
    system = serving.make_shared_prefix_trace(data.val, args.n_requests, args.rate, seqlen, args.system_len,
                                              args.prompt_median, args.output_median, seed=args.seed, device=device)
    *turns, previous = serving.make_multi_turn_trace(cached, data.val, args.n_requests // args.turns, args.turns,
                                                     args.rate, args.think_time, seqlen, args.output_median,
                                                     seed=args.seed, device=device)
    early = lambda clock: {"early": serving.early_turns(clock, previous)}  # noqa: E731
    roomy = argparse.Namespace(**vars(args) | {"n_blocks": previous.count(None) * seqlen // args.block_size})
    system, turns = [(*t, serving.reference_outputs(cached, t[0], seqlen)) for t in (system, turns)]  # checks first
    rows, lines, early_turns, off = [], [], 0, None
    for trace, (requests, arrivals, reference), figures, pool, names in (  # roomy: a pool for every conversation
            ("system prompt", system, None, args, ("chunked", "shared")),
            ("multi-turn", turns, early, args, ("chunked", "shared")),
            (f"multi-turn, {roomy.n_blocks} blocks", turns, early, roomy, ("shared",))):
        results = run_variants(base, requests, arrivals, args.batch_size, pool, seqlen, device, names=names,
                               clock_figures=figures)
        early_turns = max([early_turns] + [f.get("early", 0) for runs in results.values() for _, f in runs])
        *maybe_off, on = sharing_rows(trace, results, reference)
        off = maybe_off[0] if maybe_off else off  # the roomy pool is compared with the default one
        rows += maybe_off + [on]
        gain = lambda key, a, b: "-" if iu.ratio(a[key], b[key]) is None else f"{iu.ratio(a[key], b[key]):.2f}x"  # noqa
        lines.append(f"{trace}, without / with prefix sharing: p50 TTFT {gain('ttft_arrival_ms', off, on)}, p99 TTFT "
                     f"{gain('ttft_arrival_p99_ms', off, on)}; with / without: throughput "
                     f"{gain('tokens_per_s', on, off)}; peak KV blocks in use {off['kv_blocks_peak']} without, "
                     f"{on['kv_blocks_peak']} with; hit rate {on['hit_rate']:.0%}")
    lines.append(f"multi-turn: {early_turns} of {len(previous) - previous.count(None)} later turns arrived before the "
                 f"previous turn's answer ended (think time {args.think_time:g} s; most in any run)")
    return rows, lines, dict(roomy_blocks=roomy.n_blocks, prompt_lens={
        "system_prompt": [len(p) for p, _ in system[0]], "multi_turn": [len(p) for p, _ in turns[0]]})


def run_prefix_sharing(base, data, args, preset, device):
    """--prefix-sharing: the table of prefix sharing, checks before anything is written."""
    rows, summary, extra = prefix_sharing_experiment(base, data, args, preset.seqlen, device)
    print(f"\n{args.n_requests} requests at {args.rate:g}/s after a {args.system_len}-token system prompt; "
          f"{args.n_requests // args.turns} conversations of {args.turns} turns, {args.think_time:g} s apart. Engine: "
          f"chunked prefill {args.chunk_size}, batch size {args.batch_size}, KV blocks of {args.block_size} tokens; "
          f"median of {args.repeats} runs, round-robin. hit_rate: prompt tokens found cached / prompt tokens; "
          "kv_blocks: blocks held by sequences (a shared one once), mean over steps and peak; cow: copies on write")
    harness.print_table(rows, untrained=args.untrained)
    print("\n".join(summary))
    failures = [r["variant"] for r in rows if r["same"] != "yes"]
    if failures:
        raise GPTliteError(f"{', '.join(failures)}: tokens differ from generating each request alone; this is a bug")
    if args.json:
        harness.save_json(args.json, "main_continuous_batching.py", preset, device, rows, untrained=args.untrained,
                     summary=summary, batch_size=args.batch_size, block_size=args.block_size,
                     system_len=args.system_len, turns=args.turns, think_time=args.think_time, **extra)


def plot_sweep(sweep, path, preset, device, rate):
    fig, (ax_tput, ax_tpot) = harness.new_figure(2)
    for name, points in sweep["variants"].items():
        ax_tput.plot(sweep["batch_sizes"], points["tokens_per_s"], marker="o", label=name)
        ax_tpot.plot(sweep["batch_sizes"], points["tpot_p99_ms"], marker="o", label=name)
    for ax in (ax_tput, ax_tpot):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sweep["batch_sizes"], labels=[str(b) for b in sweep["batch_sizes"]])
        ax.set(xlabel="batch size", ylim=(0, None))
    ax_tput.set(ylabel="throughput (new tokens / s of steps)", title=f"preset {preset.name}, {device}, rate {rate:g}/s")
    ax_tpot.set(ylabel="p99 TPOT (ms)", title="p99 TPOT, from arrival")
    ax_tput.legend()
    harness.save_plot(fig, path)


def summary_lines(rows, args, device):
    """The ratios of the post's claims, where the variants they compare were run."""
    by_name = {r["variant"]: r for r in rows}
    lines = [iu.peak_memory_label(device)]
    if {"static batching", "continuous batching"} <= set(by_name):
        speedup = iu.ratio(by_name["continuous batching"]["tokens_per_s"], by_name["static batching"]["tokens_per_s"])
        lines.append(f"continuous / static throughput: {speedup:.2f}x")
    chunked = f"paged, chunked prefill {args.chunk_size}"
    if {"paged, whole prompts", chunked} <= set(by_name):
        lines.append(f"p99 TPOT whole prompts {by_name['paged, whole prompts']['tpot_p99_ms']:.2f} ms, "
                     f"chunked prefill {by_name[chunked]['tpot_p99_ms']:.2f} ms")
    return lines


def batch_size_sweep(base, requests, arrivals, reference, args, seqlen, device):
    """Throughput and p99 TPOT of every variant at each --plot-batch-sizes; returns the sweep and its rows."""
    sweep, rows = {"batch_sizes": sorted(args.plot_batch_sizes), "variants": {}}, []
    for batch_size in sweep["batch_sizes"]:
        for row in make_rows(run_variants(base, requests, arrivals, batch_size, args, seqlen, device), reference):
            rows.append(row)
            points = sweep["variants"].setdefault(row["variant"], {"tokens_per_s": [], "tpot_p99_ms": []})
            points["tokens_per_s"].append(row["tokens_per_s"])
            points["tpot_p99_ms"].append(row["tpot_p99_ms"])
    return sweep, rows


def parse_args(argv):
    parser = harness.script_parser(__doc__)
    serving.add_trace_args(parser, n_requests=64, rate=200.0)
    at_least = harness.int_at_least
    parser.add_argument("--batch-size", type=at_least(1), default=8, help="batch slots of every variant")
    parser.add_argument("--block-size", type=at_least(1), default=8, help="tokens per KV block of the paged engine")
    parser.add_argument("--n-blocks", type=at_least(1), default=None,
                        help="KV blocks in the pool (default: batch-size * seqlen / block-size, a contiguous cache's memory)")
    parser.add_argument("--chunk-size", type=at_least(1), default=16, help="prefill tokens per step with chunked prefill")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=None,
                        help="the variants to run (default: all but shared): static and continuous batching (the "
                             "post's, no cache), the paged engine with whole prompts, with chunked prefill, with "
                             "chunked prefill and prefix sharing")
    parser.add_argument("--plot-batch-sizes", type=at_least(1), nargs="+", default=[2, 4, 8, 16],
                        help="batch sizes of the --plot sweep")
    parser.add_argument("--prefix-sharing", action="store_true",
                        help="instead: a trace whose requests share a system prompt and a multi-turn trace, each "
                             "through the engine with chunked prefill, without and with prefix sharing")
    serving.add_sharing_args(parser)
    args = parser.parse_args(argv)
    if args.variants is not None and len(set(args.variants)) != len(args.variants):
        parser.error(f"--variants repeats a name: {args.variants}")
    if args.prefix_sharing and (args.variants is not None or args.plot):
        parser.error("--prefix-sharing runs its own two variants and has no plot: drop --variants and --plot")
    args.variants = args.variants or list(VARIANTS[:4])
    return parser, args


def main(argv=None):
    parser, args = parse_args(argv)

    def check_args(preset):
        serving.check_trace_args(args, parser, preset.seqlen)
        if args.block_size > preset.seqlen:
            parser.error(f"--block-size must be at most seqlen={preset.seqlen}, got {args.block_size}")
        if args.n_blocks is not None and args.n_blocks * args.block_size < preset.seqlen - 1:
            need = -(-(preset.seqlen - 1) // args.block_size)
            parser.error(f"--n-blocks {args.n_blocks} of {args.block_size} tokens cannot hold one request of the "
                         f"window seqlen={preset.seqlen}: give at least {need} blocks")
        if args.prefix_sharing:
            serving.check_sharing_args(args, parser, preset.seqlen)

    preset, device, data = harness.setup(args, parser, check_args)
    base = iu.load_model(GPTlite, preset, device, data, untrained=args.untrained, seed=args.seed)
    if args.prefix_sharing:
        return run_prefix_sharing(base, data, args, preset, device)
    seqlen = preset.seqlen
    requests, arrivals = serving.make_trace(data.val, args.n_requests, args.rate, seqlen, args.prompt_median,
                                            args.output_median, seed=args.seed, device=device)
    reference = serving.reference_outputs(iu.kv_cache_model(base), requests, seqlen)  # correctness first
    val_loss = training.validation_loss(base, data)

    results = run_variants(base, requests, arrivals, args.batch_size, args, seqlen, device, memory=True)
    rows = make_rows(results, reference)
    prompt_lens, output_lens = [len(p) for p, _ in requests], [n for _, n in requests]
    print(f"\ntrace: {len(requests)} requests, Poisson arrivals at {args.rate:g}/s over {arrivals[-1]:.2f} s, "
          f"prompt lengths p50/p99/max {np.percentile(prompt_lens, 50):.0f}/{np.percentile(prompt_lens, 99):.0f}/"
          f"{max(prompt_lens)}, output lengths {np.percentile(output_lens, 50):.0f}/{np.percentile(output_lens, 99):.0f}/"
          f"{max(output_lens)}; batch size {args.batch_size}, KV blocks of {args.block_size} tokens; "
          f"validation loss {val_loss:.4f} (one model for every variant)")
    print(f"median of {args.repeats} runs per variant, round-robin. TTFT arrival: p50 over requests from their "
          "arrival, queueing included (then its p99); TPOT p50 and p99 over requests; tok/s: new tokens per second "
          "of steps; wasted: batch rows whose token was dropped; kv_util: tokens held / slots reserved, summed over "
          "steps (paged pool: allocated blocks); kv_contig: the same against seqlen slots per running sequence")
    harness.print_table(rows, untrained=args.untrained)
    summary = summary_lines(rows, args, device)
    print("\n".join(summary))

    sweep, sweep_rows = None, []
    if args.plot:
        sweep, sweep_rows = batch_size_sweep(base, requests, arrivals, reference, args, seqlen, device)
        plot_sweep(sweep, args.plot, preset, device, args.rate)
    if args.json:
        harness.save_json(args.json, "main_continuous_batching.py", preset, device, rows, untrained=args.untrained,
                     val_loss=val_loss, summary=summary,
                     trace={"n_requests": len(requests), "rate": args.rate if np.isfinite(args.rate) else "inf",
                            "arrivals": arrivals, "prompt_lens": prompt_lens, "output_lens": output_lens},
                     batch_size=args.batch_size, block_size=args.block_size, sweep=sweep)
    failures = sorted({r["variant"] for r in rows + sweep_rows if r["same"] != "yes"})
    if failures:
        raise GPTliteError(f"{', '.join(failures)}: tokens differ from generating each request alone; this is a bug")


if __name__ == "__main__":
    harness.run(main)
