"""Continuous batching, and a small serving engine with a paged KV cache and chunked prefill, on one trace.

    python main_continuous_batching.py                     # cpu preset on CPU, gptlite on CUDA
    python main_continuous_batching.py --rate 50 --batch-size 8 --sweep-batch-sizes 2 4 8 16 --plot batching.png --json batching.json
    python main_continuous_batching.py --untrained --n-requests 8
    python main_continuous_batching.py --prefix-sharing    # a shared system prompt, multi-turn: sharing off / on

Blog section: "Continuous batching" and beyond the post. `continuous_batching` is the post's:
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

import inference_utils as iu
from gptlite import GPTlite
from lib import engines, harness, serving, training, vllm_peer
from lib.paged_engine import PagedEngine
from main_static_batching import next_tokens, static_batching


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


VARIANTS = ("static", "continuous", "paged", "chunked", "shared")  # --variants: make_variants' variants
LONG_PROMPT_CHUNKS = 4  # a median prompt of this many chunks or more: the headline of chunked prefill


def contiguous_blocks(batch_size, seqlen, block_size):
    """The paged pool's default: the memory of a contiguous cache of seqlen slots for each of batch_size sequences."""
    return batch_size * seqlen // block_size


def make_variants(base, batch_size, seqlen, block_size, chunk_size, n_blocks=None, names=VARIANTS[:4]):
    """{row name: serve(requests, clock) -> (outputs, figures)} of the variants `names`, in that order, all with
    `batch_size` slots; the paged ones with a pool of n_blocks blocks of block_size tokens (default: the memory
    of a contiguous cache, batch_size * seqlen tokens) and chunk_size prefill tokens per step when chunked."""
    n_blocks = n_blocks or contiguous_blocks(batch_size, seqlen, block_size)

    def engine(chunk, prefix_sharing=False):
        def serve(requests, clock):
            eng = PagedEngine(base, n_blocks, block_size, batch_size, chunk, prefix_sharing)
            outputs, _ = eng.generate(requests, seqlen, clock)
            return outputs, dict(kv_cache_mb=eng.runner.nbytes / 2**20, **eng.stats)
        return serve

    variants = {
        "static": ("static batching", lambda r, c: (static_batching(base, r, batch_size, seqlen, c)[0], {})),
        "continuous": ("continuous batching", lambda r, c: (continuous_batching(base, r, batch_size, seqlen, c)[0], {})),
        "paged": ("paged, whole prompts", engine(None)),
        "chunked": (f"paged, chunked prefill {chunk_size}", engine(chunk_size)),
        "shared": (f"paged, chunked prefill {chunk_size}, prefix sharing", engine(chunk_size, True)),
    }
    return dict(variants[key] for key in names)


def check_variants(variants, trace, device, label=""):
    """One untimed run of each variant on the trace (requests, arrivals, reference), also the warm-up:
    {check name: every request's tokens equal generating it alone}."""
    requests, arrivals, reference = trace
    return {f"{label}{name}: every request's tokens equal generating it alone": serving.same_outputs(
        serve(requests, serving.ServingClock(arrivals, [n for _, n in requests], device))[0], reference) == "yes"
        for name, serve in variants.items()}


def run_variants(variants, trace, repeats, device, memory=False, clock_figures=None):
    """Each checked variant on the trace, `repeats` rounds round-robin (iu.time_round_robin, each run on its
    own serving clock): {name: [(outputs, figures) per run]}; with `memory`, one more (untimed) run of each
    variant gives its peak memory, figures["peak_mem_mb"]; clock_figures(clock): more figures of a run."""
    requests, arrivals, _ = trace
    results = {name: [] for name in variants}

    def run(name, serve):
        clock = serving.ServingClock(arrivals, [n for _, n in requests], device)
        outputs, extra = serve(requests, clock)
        more = clock_figures(clock) if clock_figures else {}
        results[name].append((outputs, serving.latency_figures(clock) | extra | more))

    iu.time_round_robin({name: lambda name=name, serve=serve: run(name, serve) for name, serve in variants.items()},
                        device, warmup=0, repeats=repeats)  # the check round warmed every variant up
    for name, serve in variants.items() if memory else ():
        clock = serving.ServingClock(arrivals, [n for _, n in requests], device)
        peak = iu.peak_memory_mb(lambda: serve(requests, clock), device)  # noqa: B023  (called at once)
        for _, figures in results[name]:
            figures["peak_mem_mb"] = peak
    return results


LATENCIES = ("ttft_arrival_ms", "ttft_arrival_p99_ms", "tpot_ms", "tpot_p99_ms", "tokens_per_s")


def median_row(name, runs, reference, **columns):
    """A row of a variant's runs [(outputs, figures)]: the median of each figure over the repeats, its latencies and
    throughput, then columns[k](figures) for each extra column k; `same` only if every run matched the reference."""
    f = serving.median_figures([f for _, f in runs])
    same = [serving.same_outputs(outputs, reference) for outputs, _ in runs]
    return harness.make_row(name, **{k: f[k] for k in LATENCIES}, **{k: column(f) for k, column in columns.items()},
                            same=next((s for s in same if s != "yes"), "yes"))


def rounded(key, digits=3):
    return lambda f: None if f.get(key) is None else round(f[key], digits)


def make_rows(results, reference):
    """A row per variant of the default trace."""
    return [median_row(name, runs, reference, kv_cache_mb=lambda f: f.get("kv_cache_mb"),
                       peak_mem_mb=lambda f: f.get("peak_mem_mb"), steps=lambda f: f["steps"],
                       wasted=lambda f: f["wasted_slot_steps"], kv_util=rounded("kv_util"),
                       kv_contig=rounded("kv_util_contiguous"), preempted=lambda f: f.get("preemptions"))
            for name, runs in results.items()]


def sharing_rows(trace, results, reference):
    """A row per variant of a prefix-sharing trace."""
    return [median_row(f"{trace}, {'prefix sharing' if name.endswith('sharing') else 'no sharing'}", runs, reference,
                       steps=lambda f: f["steps"], computed=lambda f: f["computed_tokens"], hit_rate=rounded("hit_rate"),
                       kv_blocks=rounded("blocks_used", 1), kv_blocks_peak=lambda f: f["blocks_peak"],
                       evicted=lambda f: f["evictions"], cow=lambda f: f["cow_copies"],
                       preempted=lambda f: f["preemptions"])
            for name, runs in results.items()]


def prefix_sharing_experiment(base, data, args, seqlen, device):
    """The system-prompt and the multi-turn traces through the engine with chunked prefill, without and
    with prefix sharing, round-robin; every variant of every trace checked before anything is timed.
    Returns the rows, the summary lines, the traces' sizes and the experiments [(trace, (requests, arrivals,
    reference), clock_figures, variants, KV blocks of the pool)]."""
    cached = iu.kv_cache_model(base)
    system = serving.make_shared_prefix_trace(data.val, args.n_requests, args.rate, seqlen, args.system_len,
                                              args.prompt_median, args.output_median, seed=args.seed, device=device)
    *turns, previous = serving.make_multi_turn_trace(cached, data.val, args.n_requests // args.turns, args.turns,
                                                     args.rate, args.think_time, seqlen, args.output_median,
                                                     seed=args.seed, device=device)
    early = lambda clock: {"early": serving.early_turns(clock, previous)}  # noqa: E731
    roomy_blocks = previous.count(None) * seqlen // args.block_size  # a pool for every conversation
    system, turns = [(*t, serving.reference_outputs(cached, t[0], seqlen)) for t in (system, turns)]
    variants = lambda names, n_blocks=args.n_blocks: make_variants(  # noqa: E731
        base, args.batch_size, seqlen, args.block_size, args.chunk_size, n_blocks, names)
    n_blocks = args.n_blocks or contiguous_blocks(args.batch_size, seqlen, args.block_size)
    experiments = [("system prompt", system, None, variants(("chunked", "shared")), n_blocks),
                   ("multi-turn", turns, early, variants(("chunked", "shared")), n_blocks),
                   (f"multi-turn, {roomy_blocks} blocks", turns, early, variants(("shared",), roomy_blocks), roomy_blocks)]
    harness.require_checks({check: ok for trace, t, _, v, _ in experiments  # checks first
                            for check, ok in check_variants(v, t, device, f"{trace}: ").items()})
    rows, lines, early_turns, off = [], [], 0, None
    for trace, (requests, arrivals, reference), figures, v, _ in experiments:
        results = run_variants(v, (requests, arrivals, reference), args.repeats, device, clock_figures=figures)
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
    return rows, lines, dict(roomy_blocks=roomy_blocks, prompt_lens={
        "system_prompt": [len(p) for p, _ in system[0]], "multi_turn": [len(p) for p, _ in turns[0]]}), experiments


def vllm_sharing_experiments(experiments, args):
    """The prefix-sharing experiments' pairs for vllm_tables: each variant of the paged engine beside vLLM with the
    same slots, token budget a step (batch + chunk size) and KV memory, its automatic prefix caching off where the
    engine shares no blocks and on where it does."""
    def pairs(vllm, version):
        out = []
        for trace, t, figures, variants, n_blocks in experiments:
            for name, serve in variants.items():
                sharing = name.endswith("sharing")
                out.append((f"{trace}: ", t, {
                    f"{trace}, {'prefix sharing' if sharing else 'no sharing'}": serve,
                    f"{trace}, vLLM {version}, prefix caching {'on' if sharing else 'off'}": vllm(
                        batch_size=args.batch_size, token_budget=args.batch_size + args.chunk_size,
                        n_blocks=vllm_blocks(n_blocks, args.block_size), prefix_caching=sharing)}, figures))
        return out
    return pairs


def run_prefix_sharing(base, data, args, preset, device):
    """--prefix-sharing: the table of prefix sharing, checks before anything is timed or written."""
    rows, summary, extra, experiments = prefix_sharing_experiment(base, data, args, preset.seqlen, device)
    with engines.temp_dir() as folder:
        peer_results, peer_line = vllm_tables(base, args, preset.seqlen, device, folder,
                                              vllm_sharing_experiments(experiments, args))
    peer_rows = vllm_rows(peer_results, args.block_size, hit_rate=True)
    harness.require_checks({f"{r['variant']}, timed runs: the same tokens": r["same"] == "yes" for r in rows + peer_rows})
    print(f"\n{args.n_requests} requests at {args.rate:g}/s after a {args.system_len}-token system prompt; "
          f"{args.n_requests // args.turns} conversations of {args.turns} turns, {args.think_time:g} s apart. Engine: "
          f"chunked prefill {args.chunk_size}, batch size {args.batch_size}, KV blocks of {args.block_size} tokens; "
          f"median of {args.repeats} runs, round-robin. hit_rate: prompt tokens found cached / prompt tokens; "
          "kv_blocks: blocks held by sequences (a shared one once), mean over steps and peak; cow: copies on write")
    harness.report(args, "main_continuous_batching.py", preset, device, rows,
                   prefix_sharing_headline(rows, args.system_len, args.turns, extra["roomy_blocks"]),
                   summary=summary + ([peer_line] if peer_line else []),
                   tables=[harness.table("The paged engine and vLLM on the same traces, blocks shared (prefix caching) "
                                         "or not: the same slots, token budget a step and KV memory", peer_rows)]
                   if peer_rows else [],
                   batch_size=args.batch_size, block_size=args.block_size, system_len=args.system_len,
                   turns=args.turns, think_time=args.think_time, **extra)


def plot_sweep(sweep, preset, device, rate):
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
    return fig


def summary_lines(rows, chunk_size, device):
    """The ratios of the post's claims, where the variants they compare were run."""
    by_name = {r["variant"]: r for r in rows}
    lines = [iu.peak_memory_label(device)]
    if {"static batching", "continuous batching"} <= set(by_name):
        speedup = iu.ratio(by_name["continuous batching"]["tokens_per_s"], by_name["static batching"]["tokens_per_s"])
        lines.append(f"continuous / static throughput: {'-' if speedup is None else format(speedup, '.2f')}x")
    chunked = f"paged, chunked prefill {chunk_size}"
    if {"paged, whole prompts", chunked} <= set(by_name):
        lines.append(f"p99 TPOT whole prompts {by_name['paged, whole prompts']['tpot_p99_ms']:.2f} ms, "
                     f"chunked prefill {by_name[chunked]['tpot_p99_ms']:.2f} ms")
    return lines


def x(a, b, fmt="{:.1f}x"):
    """a / b as a ratio, '-' where either could not be measured."""
    value = iu.ratio(a, b)
    return "-" if value is None else fmt.format(value)


def pct(value):
    return "-" if value is None else f"{value:.0%}"


def headline(rows, requests, batch_size, chunk_size):
    """The README's one-glance row, from this run's rows. A trace whose median prompt spans LONG_PROMPT_CHUNKS
    chunks or more (main_continuous_batching_long_prompts: --prompt-median 80): chunked against whole-prompt
    prefill; otherwise continuous against static batching and the paged cache's utilization; where the run
    lacks the variants a headline compares (--variants), each variant's throughput."""
    by_name = {r["variant"]: r for r in rows}
    median = iu.median([len(p) for p, _ in requests])
    whole, chunked = by_name.get("paged, whole prompts"), by_name.get(f"paged, chunked prefill {chunk_size}")
    static, cont = by_name.get("static batching"), by_name.get("continuous batching")
    if median >= LONG_PROMPT_CHUNKS * chunk_size and whole and chunked:
        ms = lambda row, key, fmt: "-" if row[key] is None else fmt.format(row[key])  # noqa: E731
        return {"technique": f"chunked prefill, trace with long prompts (median {median:.0f} tokens)",
                "figure": f"p99 TPOT {ms(chunked, 'tpot_p99_ms', '{:.1f}')} ms chunked against "
                          f"{ms(whole, 'tpot_p99_ms', '{:.1f}')} ms whole-prompt; p50 TTFT "
                          f"{ms(chunked, 'ttft_arrival_ms', '{:.0f}')} against {ms(whole, 'ttft_arrival_ms', '{:.0f}')} ms"}
    technique = (f"continuous vs static batching, paged KV cache: {len(requests)}-request trace, batch {batch_size}")
    if static and cont and whole:
        return {"technique": technique,
                "figure": f"throughput {x(cont['tokens_per_s'], static['tokens_per_s'], '{:.2f}x')} ({cont['steps']} "
                          f"steps against {static['steps']}); the paged cache fills {pct(whole['kv_util'])} of its "
                          f"reserved slots, a contiguous max-length reservation {pct(whole['kv_contig'])}"}
    return {"technique": technique, "figure": "throughput " + ", ".join(
        f"{r['variant']} {x(r['tokens_per_s'], 1, '{:.0f}')} tok/s" for r in rows)}


def prefix_sharing_headline(rows, system_len, turns, roomy_blocks):
    """--prefix-sharing's one-glance row, from this run's rows."""
    by_name = {r["variant"]: r for r in rows}
    off, on = by_name["system prompt, no sharing"], by_name["system prompt, prefix sharing"]
    turns_off, turns_on = by_name["multi-turn, no sharing"], by_name["multi-turn, prefix sharing"]
    roomy = by_name[f"multi-turn, {roomy_blocks} blocks, prefix sharing"]
    return {"technique": f"prefix sharing in the paged engine: {system_len}-token system prompt, {turns}-turn "
                         "conversations",
            "figure": f"p50 TTFT {x(off['ttft_arrival_ms'], on['ttft_arrival_ms'])} lower with shared blocks (hit "
                      f"rate {on['hit_rate']:.0%}, peak KV blocks in use {off['kv_blocks_peak']} -> "
                      f"{on['kv_blocks_peak']}); multi-turn {x(turns_off['ttft_arrival_ms'], turns_on['ttft_arrival_ms'])}"
                      f" (hit rate {turns_on['hit_rate']:.0%}), {x(turns_off['ttft_arrival_ms'], roomy['ttft_arrival_ms'])}"
                      f" with a pool of {roomy_blocks} blocks (hit rate {roomy['hit_rate']:.0%}); identical tokens"}


def batch_size_sweep(base, trace, args, seqlen, device):
    """--sweep-batch-sizes: throughput and p99 TPOT of every variant at each batch size, every variant
    checked at every batch size before any is timed; returns the sweep and its rows."""
    sweep, rows = {"batch_sizes": sorted(args.sweep_batch_sizes), "variants": {}}, []
    variants = {b: make_variants(base, b, seqlen, args.block_size, args.chunk_size, args.n_blocks, args.variants)
                for b in sweep["batch_sizes"]}
    harness.require_checks({check: ok for b, v in variants.items()
                            for check, ok in check_variants(v, trace, device, f"sweep, batch {b}: ").items()})
    for batch_size, v in variants.items():
        for row in make_rows(run_variants(v, trace, args.repeats, device), trace[2]):
            rows.append(row)
            points = sweep["variants"].setdefault(row["variant"], {"tokens_per_s": [], "tpot_p99_ms": []})
            points["tokens_per_s"].append(row["tokens_per_s"])
            points["tpot_p99_ms"].append(row["tpot_p99_ms"])
    return sweep, rows


VLLM_BATCH_SIZES = (8, 32)  # the batch sizes at which the paged engine and vLLM run the default trace
VLLM_BLOCK = 32  # vLLM's CPU attention takes KV blocks of a multiple of 32 tokens


def vllm_serve(peer, model_dir, key, seqlen, batch_size, token_budget, n_blocks, chunked, prefix_caching):
    """Build vLLM engine `key` with these settings and return its serve(requests, clock) -> (outputs, figures): the
    run's clock filled as the paged engine fills its own, the KV blocks at their peak and the prefix cache's hit rate."""
    peer.engine(key, model_dir, seqlen, batch_size, VLLM_BLOCK, token_budget, chunked, prefix_caching, n_blocks)

    def serve(requests, clock):
        outputs, blocks, cached = peer.run(key, requests, clock)
        return outputs, dict(blocks_peak=max(blocks, default=0), block_tokens=VLLM_BLOCK,
                             hit_rate=sum(cached) / sum(len(p) for p, _ in requests))
    return serve


def vllm_blocks(n_blocks, block_size):
    """vLLM's pool for the KV memory of the paged engine's n_blocks blocks of block_size tokens: VLLM_BLOCK-token
    blocks holding as many tokens (rounded up)."""
    return -(-n_blocks * block_size // VLLM_BLOCK)


def vllm_experiments(base, trace, args, seqlen):
    """The default trace's pairs (the paged engine, vLLM) for vllm_tables: at each of VLLM_BATCH_SIZES, chunked
    prefill with the same token budget a step (batch + chunk size); on a trace of long prompts (a median of
    LONG_PROMPT_CHUNKS chunks or more), also whole prompts against vLLM without chunked prefill and chunks 4 times
    larger, at --batch-size. Both engines have the same slots and KV memory (a contiguous cache's), prefix caching off."""
    chunk, median = args.chunk_size, iu.median([len(p) for p, _ in trace[0]])

    def pairs(vllm, version):
        def pair(batch, name, chunk_size, label, **settings):
            n_blocks = contiguous_blocks(batch, seqlen, args.block_size)
            (ours, serve), = make_variants(base, batch, seqlen, args.block_size, chunk_size, n_blocks, (name,)).items()
            return ("", trace, {f"{ours} (batch {batch})": serve, f"vLLM {version}, {label} (batch {batch})": vllm(
                batch_size=batch, n_blocks=vllm_blocks(n_blocks, args.block_size), **settings)}, None)
        b, long = args.batch_size, median >= LONG_PROMPT_CHUNKS * chunk
        whole = [pair(b, "paged", chunk, "no chunked prefill", token_budget=b * seqlen, chunked=False)] if long else []
        chunked = [pair(batch, "chunked", chunk, f"budget {batch + chunk}", token_budget=batch + chunk)
                   for batch in VLLM_BATCH_SIZES]
        larger = [pair(b, "chunked", 4 * chunk, f"budget {b + 4 * chunk}", token_budget=b + 4 * chunk)] if long else []
        return whole + chunked + larger
    return pairs


def vllm_tables(base, args, seqlen, device, folder, experiments):
    """vLLM beside the paged engine: experiments(vllm, version) -> [(label, trace, {name: serve}, clock_figures)],
    the engines' variants in pairs (the paged engine's, then vLLM's), where vllm(**settings) is the serve of a vLLM
    engine with those settings (vllm_serve's; built once per settings). Every variant of every experiment is checked
    (every request's tokens equal generating it alone), then each experiment is timed round-robin. Returns
    ([(trace, results)], the line that says how vLLM ran) or ([], the one line that says why it did not)."""
    if not args.vllm:
        return [], None
    if device.type != "cpu":
        return [], f"vLLM's rows run on the CPU build here, the run is on {device}: skipped"
    try:
        python = vllm_peer.find_python(args.vllm_python)
        with vllm_peer.VLLMPeer(python, timeout=args.vllm_timeout, log=f"{folder}/vllm.log") as peer:
            model_dir, built = vllm_peer.write_model(base, f"{folder}/model"), {}

            def vllm(batch_size, token_budget, n_blocks, chunked=True, prefix_caching=False):
                key = (batch_size, token_budget, n_blocks, chunked, prefix_caching)
                if key not in built:
                    built[key] = vllm_serve(peer, model_dir, f"engine {len(built)}", seqlen, *key)
                return built[key]

            runs = experiments(vllm, peer.version)
            harness.require_checks({c: ok for label, t, v, _ in runs for c, ok in check_variants(v, t, device, label).items()})
            results = [(t, run_variants(v, t, args.repeats, device, clock_figures=figures)) for _, t, v, figures in runs]
            version = peer.version
    except vllm_peer.VLLMError as error:
        return [], str(error)
    return results, (f"vLLM {version} (CPU build, its own environment: {python}): the same weights as a GPT2LMHeadModel, "
                     f"prompts as token ids, greedy; {VLLM_BLOCK}-token KV blocks (its CPU attention's multiple) holding "
                     "as many tokens as the paged engine's pool, the same slots and token budget a step, in-process "
                     "engine; each pair round-robin; vs_vllm: the paged engine's throughput / vLLM's")


def vllm_rows(results, block_size, hit_rate=False):
    """A row per engine of each pair: latencies, throughput, steps and ms a step, the KV blocks at their peak (and the
    tokens they hold), with `hit_rate` the prefix cache's; on the paged engine's rows, vs_vllm: its throughput over
    vLLM's in the same pair."""
    rows = []
    for trace, pair in results:
        ours, theirs = (median_row(name, runs, trace[2], steps=lambda f: f["steps"], step_ms=rounded("step_ms"),
                                   **{"hit_rate": rounded("hit_rate")} if hit_rate else {},
                                   kv_blocks_peak=lambda f: f["blocks_peak"],
                                   block_tokens=lambda f: f.get("block_tokens") or block_size,
                                   kv_tokens_peak=lambda f: f["blocks_peak"] * (f.get("block_tokens") or block_size))
                        for name, runs in pair.items())
        ratio = iu.ratio(ours["tokens_per_s"], theirs["tokens_per_s"])
        rows += [dict(ours, vs_vllm=None if ratio is None else round(ratio, 2)), theirs]
    return rows


def parse_args(argv):
    """The flags, checked before any work: (args, preset, device, data)."""
    parser = harness.script_parser(__doc__)
    serving.add_trace_args(parser, n_requests=64, rate=200.0)
    at_least = harness.int_at_least
    parser.add_argument("--batch-size", type=at_least(1), default=8, help="batch slots of every variant")
    parser.add_argument("--block-size", type=at_least(1), default=8, help="tokens per KV block of the paged engine")
    parser.add_argument("--n-blocks", type=at_least(1), default=None,
                        help="KV blocks in the pool (default: batch-size * seqlen / block-size, a contiguous cache's memory)")
    parser.add_argument("--chunk-size", type=at_least(1, harness.MAX_SIZE), default=16, help="prefill tokens per step with chunked prefill")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=None,
                        help="the variants to run (default: all but shared): static and continuous batching (the "
                             "post's, no cache), the paged engine with whole prompts, with chunked prefill, with "
                             "chunked prefill and prefix sharing")
    parser.add_argument("--sweep-batch-sizes", type=at_least(1), nargs="+", default=None,
                        help="also run every variant at each of these batch sizes: the JSON's sweep, the throughput "
                             "and p99 TPOT curves that --plot draws")
    parser.add_argument("--prefix-sharing", action="store_true",
                        help="instead: a trace whose requests share a system prompt and a multi-turn trace, each "
                             "through the engine with chunked prefill, without and with prefix sharing")
    serving.add_sharing_args(parser)
    parser.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the trace through vLLM's CPU engine at batch 8 and 32, beside the paged engine "
                             "(its own environment: requirements-vllm.txt; skipped with one line when absent)")
    parser.add_argument("--vllm-python", default=None,
                        help="the vLLM environment's Python (default: $GPTLITE_VLLM_PYTHON, else .venv-vllm/bin/python)")
    parser.add_argument("--vllm-timeout", type=harness.int_at_least(1, 3600), default=600,
                        help="seconds vLLM's worker may take to answer one command before its rows are skipped")
    args = parser.parse_args(argv)
    if args.variants is not None and len(set(args.variants)) != len(args.variants):
        parser.error(f"--variants repeats a name: {args.variants}")
    if args.prefix_sharing and (args.variants is not None or args.plot or args.sweep_batch_sizes):
        parser.error("--prefix-sharing runs its own two variants and has no plot: drop --variants, --plot and "
                     "--sweep-batch-sizes")
    if args.plot and not args.sweep_batch_sizes:
        parser.error("--plot draws the batch-size sweep, which only --sweep-batch-sizes measures: add it, "
                     "e.g. --sweep-batch-sizes 2 4 8 16")
    harness.check_applies(parser, args, ["--system-len", "--turns", "--think-time"], "--prefix-sharing",
                          args.prefix_sharing)
    args.variants = args.variants or list(VARIANTS[:4])
    return (args, *harness.setup(args, parser, lambda preset: check_args(args, parser, preset)))


def check_args(args, parser, preset):
    serving.check_trace_args(parser, preset.seqlen, args.prompt_median, args.output_median, args.rate)
    if args.block_size > preset.seqlen:
        parser.error(f"--block-size must be at most seqlen={preset.seqlen}, got {args.block_size}")
    if args.n_blocks is not None and args.n_blocks * args.block_size < preset.seqlen - 1:
        need = -(-(preset.seqlen - 1) // args.block_size)
        parser.error(f"--n-blocks {args.n_blocks} of {args.block_size} tokens cannot hold one request of the "
                     f"window seqlen={preset.seqlen}: give at least {need} blocks")
    if args.prefix_sharing:
        serving.check_sharing_args(parser, preset.seqlen, args.system_len, args.turns, args.n_requests,
                                   args.prompt_median, args.output_median)
    kv_per_token = 2 * preset.n_layers * preset.n_heads * preset.d_head * 4  # a paged pool's float32 K and V
    for flag, batch in [("--batch-size", args.batch_size)] + [("--sweep-batch-sizes", b)
                                                              for b in args.sweep_batch_sizes or ()]:
        harness.check_fits(parser, flag, serving.forward_bytes(preset, batch) + batch * preset.seqlen * kv_per_token,
                           f"a batch of {batch} through the model and its KV pool")
    if args.n_blocks is not None:
        harness.check_fits(parser, "--n-blocks", args.n_blocks * args.block_size * kv_per_token,
                           f"a pool of {args.n_blocks} blocks of {args.block_size} tokens")
    copies = 2 + args.repeats * (3 if args.prefix_sharing else len(args.variants))  # the outputs of every run are kept
    harness.check_fits(parser, "--n-requests", serving.trace_bytes(preset, args.n_requests, copies),
                       f"a trace of {args.n_requests} requests, their reference and the outputs of every run")


def main(argv=None):
    args, preset, device, data = parse_args(argv)
    base = iu.load_model(GPTlite, preset, device, data, untrained=args.untrained, seed=args.seed)
    if args.prefix_sharing:
        return run_prefix_sharing(base, data, args, preset, device)
    seqlen = preset.seqlen
    requests, arrivals = serving.make_trace(data.val, args.n_requests, args.rate, seqlen, args.prompt_median,
                                            args.output_median, seed=args.seed, device=device)
    trace = (requests, arrivals, serving.reference_outputs(iu.kv_cache_model(base), requests, seqlen))
    variants = make_variants(base, args.batch_size, seqlen, args.block_size, args.chunk_size, args.n_blocks,
                             args.variants)
    harness.require_checks(check_variants(variants, trace, device))  # correctness first: nothing timed before
    val_loss = training.validation_loss(base, data)

    rows = make_rows(run_variants(variants, trace, args.repeats, device, memory=True), trace[2])
    sweep, sweep_rows = batch_size_sweep(base, trace, args, seqlen, device) if args.sweep_batch_sizes else (None, [])
    with engines.temp_dir() as folder:
        peer_results, peer_line = vllm_tables(base, args, seqlen, device, folder,
                                              vllm_experiments(base, trace, args, seqlen))
    peer_rows = vllm_rows(peer_results, args.block_size)
    harness.require_checks({f"{r['variant']}, timed runs: the same tokens": r["same"] == "yes"
                            for r in rows + sweep_rows + peer_rows})
    prompt_lens, output_lens = [len(p) for p, _ in requests], [n for _, n in requests]
    print(trace_line(args, arrivals, prompt_lens, output_lens, val_loss))
    harness.report(args, "main_continuous_batching.py", preset, device, rows,
                   headline(rows, requests, args.batch_size, args.chunk_size),
                   summary=summary_lines(rows, args.chunk_size, device) + ([peer_line] if peer_line else []),
                   tables=[harness.table("The paged engine and vLLM on the same trace: the same slots, token budget a "
                                         "step and KV memory", peer_rows)] if peer_rows else [],
                   plot=lambda: plot_sweep(sweep, preset, device, args.rate),
                   val_loss=val_loss, trace={"n_requests": len(requests), "arrivals": arrivals,
                                             "rate": args.rate if np.isfinite(args.rate) else "inf",
                                             "prompt_lens": prompt_lens, "output_lens": output_lens},
                   batch_size=args.batch_size, block_size=args.block_size, sweep=sweep)


def trace_line(args, arrivals, prompt_lens, output_lens, val_loss):
    """What the trace was, and what the columns mean: printed above the table."""
    return (f"\ntrace: {len(prompt_lens)} requests, Poisson arrivals at {args.rate:g}/s over {arrivals[-1]:.2f} s, "
            f"prompt lengths p50/p99/max {np.percentile(prompt_lens, 50):.0f}/{np.percentile(prompt_lens, 99):.0f}/"
            f"{max(prompt_lens)}, output lengths {np.percentile(output_lens, 50):.0f}/"
            f"{np.percentile(output_lens, 99):.0f}/{max(output_lens)}; batch size {args.batch_size}, KV blocks of "
            f"{args.block_size} tokens; validation loss {val_loss:.4f} (one model for every variant)\n"
            f"median of {args.repeats} runs per variant, round-robin. TTFT arrival: p50 over requests from their "
            "arrival, queueing included (then its p99); TPOT p50 and p99 over requests; tok/s: new tokens per second "
            "of steps; wasted: batch rows whose token was dropped; kv_util: tokens held / slots reserved, summed over "
            "steps (paged pool: allocated blocks); kv_contig: the same against seqlen slots per running sequence")


if __name__ == "__main__":
    harness.run(main)
