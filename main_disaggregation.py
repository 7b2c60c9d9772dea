"""Disaggregated serving: prefill and decode on separate workers that hand the KV cache over, against
the colocated paged engine, on one Poisson trace with long prompts.

    python main_disaggregation.py                            # starts itself on 2 local processes (torchrun)
    torchrun --nproc-per-node 2 main_disaggregation.py       # the same, launched by hand
    python main_disaggregation.py --untrained --n-requests 8 --repeats 1   # smoke run
    python main_disaggregation.py --plot disagg.png --json disagg.json

Across machines (rank 0, the prefill worker, on the first): on each machine
    torchrun --nnodes 2 --node-rank R --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:29500 main_disaggregation.py

Blog section: "Prefill-decode disaggregation" (beyond the post; DistServe, Splitwise).
In the colocated engine (paged_engine.py) a step that prefills a long prompt also carries every running
request's decode token, so the decodes wait for the prefill: TPOT's tail is made of prefills. Chunked
prefill (Sarathi-Serve) bounds that wait; disaggregation removes it: rank 0 only prefills, rank 1
only decodes, and each request's keys and values go from one to the other with torch.distributed
point-to-point calls (gloo on CPU, NCCL on CUDA), inserted into the decode worker's block pool
(disaggregation.py: the paged engine's own Scheduler, BlockManager and ModelRunner on both sides).

Equal CPU: the colocated engine runs on rank 0 with 2 torch threads while rank 1 waits in a barrier;
each worker of the disaggregated pair runs on 1 thread. The colocated engine on 1 thread is there as
well: if it is not slower than on 2, a second thread does not pay on this machine (a busy machine, or
steps too small to split), and the comparison at equal CPU says more about threads than about prefill
interference. One trace (serving.make_trace: Poisson arrivals,
log-normal lengths), replayed on the wall clock (disaggregation.LiveClock) by every variant, round-robin,
after a check round whose tokens must equal generating each request alone with generate_kvcache.
TTFT and TPOT from arrival (serving.latency_figures), throughput over the makespan, the KV bytes sent
per request and the time the sends took, failed transfers (recomputed, never lost).
"""
import contextlib
import io
import os

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import inference_utils as iu
from gptlite_kvcache import GPTlite_KVCache
from lib import distributed, files, harness, serving
from lib.disaggregation import PREFILL_RANK, LiveClock, makespan_throughput, serve_disaggregated
from lib.errors import GPTliteError
from lib.paged_engine import PagedEngine

COLOCATED_THREADS = 2  # the colocated engine gets the two workers' threads together


def serve_colocated(model, requests, arrivals, n_blocks, args, chunk_size, threads=COLOCATED_THREADS):
    """The paged engine alone on rank 0 with `threads` threads; the other rank waits in a barrier."""
    dist.barrier()
    result = None
    if dist.get_rank() == PREFILL_RANK:
        torch.set_num_threads(threads)
        engine = PagedEngine(model, n_blocks, args.block_size, args.batch_size, chunk_size)
        clock = LiveClock(arrivals, [n for _, n in requests], requests[0][0].device)
        outputs, _ = engine.generate(requests, model.seqlen, clock)
        result = (outputs, clock, {"preemptions": engine.stats["preemptions"]})
    dist.barrier()
    return result


def serve_split(model, requests, arrivals, n_blocks, args):
    torch.set_num_threads(1)
    return serve_disaggregated(model, requests, arrivals, n_blocks, args.block_size, args.batch_size, args.timeout)


def figures(clock, stats):
    """Latency figures of one run, throughput over the makespan, and the transfers of the split."""
    out = serving.latency_figures(clock) | {"tokens_per_s": makespan_throughput(clock)}
    out["preemptions"] = stats["preemptions"]
    if "kv_bytes" in stats:
        out |= dict(kv_kb=np.mean(stats["kv_bytes"]) / 1024, send_ms=np.percentile(stats["send_s"], 50) * 1e3,
                    send_p99_ms=np.percentile(stats["send_s"], 99) * 1e3, failed=stats["failed_transfers"])
    return out


def run_variants(model, requests, arrivals, reference, args, rank):
    """Round 0 checks every variant's tokens (nothing is timed if one differs); then --repeats timed
    rounds, round-robin. Returns {name: [figures per round]} and {name: [clock per round]} (rank 0)."""
    n_blocks = args.batch_size * model.seqlen // args.block_size  # a contiguous cache's memory, both sides
    variants = {  # the first: half the CPU, to tell a gain of the split from a machine that 2 threads do not speed up
        "colocated, whole prompts (1 thread)": lambda: serve_colocated(model, requests, arrivals, n_blocks, args,
                                                                      None, threads=1),
        f"colocated, whole prompts ({COLOCATED_THREADS} threads)": lambda: serve_colocated(
            model, requests, arrivals, n_blocks, args, None),
        f"colocated, chunked prefill {args.chunk_size} ({COLOCATED_THREADS} threads)": lambda: serve_colocated(
            model, requests, arrivals, n_blocks, args, args.chunk_size),
        "disaggregated, 1 prefill + 1 decode worker (1 thread each)": lambda: serve_split(
            model, requests, arrivals, n_blocks, args),
    }
    results, clocks = {name: [] for name in variants}, {name: [] for name in variants}
    bar = tqdm(total=(args.repeats + 1) * len(variants), desc="trace runs (round 0: check)", disable=rank != 0,
               dynamic_ncols=True)
    for i in range(args.repeats + 1):
        for name, serve in variants.items():
            bar.set_postfix_str(name.split(",")[0])
            result = serve()
            bar.update()
            if rank != 0:
                continue
            outputs, clock, stats = result
            same = serving.same_outputs(outputs, reference)
            if same != "yes":
                raise GPTliteError(f"{name}: tokens differ from generating each request alone ({same}); "
                                      "this is a bug (nothing timed or written)")
            if i > 0:
                results[name].append(figures(clock, stats))
                clocks[name].append(clock)
    bar.close()
    return results, clocks


def make_rows(results):
    rows = []
    for name, runs in results.items():
        f = serving.median_figures(runs)
        rows.append(harness.make_row(name, **{k: f[k] for k in ("ttft_arrival_ms", "ttft_arrival_p99_ms", "tpot_ms",
                                                            "tpot_p99_ms", "tokens_per_s")},
                                kv_sent_KB=None if "kv_kb" not in f else round(float(f["kv_kb"]), 1),
                                send_ms=None if "send_ms" not in f else round(float(f["send_ms"]), 3),
                                send_p99_ms=None if "send_ms" not in f else round(float(f["send_p99_ms"]), 3),
                                failed=f.get("failed"), preempted=f["preemptions"], same="yes"))
    return rows


def summary_lines(rows):
    """DistServe's argument in figures: does p99 TPOT drop, and what does TTFT pay for it."""
    _, whole, chunked, split = rows
    lines = [f"p99 TPOT: colocated {whole['tpot_p99_ms']:.2f} ms, chunked prefill {chunked['tpot_p99_ms']:.2f} ms, "
             f"disaggregated {split['tpot_p99_ms']:.2f} ms (colocated / disaggregated: "
             f"{iu.ratio(whole['tpot_p99_ms'], split['tpot_p99_ms']):.2f}x)",
             f"p50 TTFT from arrival: colocated {whole['ttft_arrival_ms']:.1f} ms, chunked {chunked['ttft_arrival_ms']:.1f} "
             f"ms, disaggregated {split['ttft_arrival_ms']:.1f} ms (p99 {whole['ttft_arrival_p99_ms']:.1f}, "
             f"{chunked['ttft_arrival_p99_ms']:.1f}, {split['ttft_arrival_p99_ms']:.1f} ms)",
             f"KV handed over: {split['kv_sent_KB']:.1f} KB per request on average, sent in {split['send_ms']:.3f} ms "
             f"(p50; p99 {split['send_p99_ms']:.3f} ms); throughput {split['tokens_per_s']:.0f} against "
             f"{whole['tokens_per_s']:.0f} tok/s colocated",
             f"colocated on 1 thread: p99 TPOT {rows[0]['tpot_p99_ms']:.2f} ms, p50 TTFT {rows[0]['ttft_arrival_ms']:.1f} "
             f"ms, {rows[0]['tokens_per_s']:.0f} tok/s "
             f"({iu.ratio(rows[0]['tokens_per_s'], whole['tokens_per_s']):.2f}x the 2 threads' throughput: above 1, "
             "a second thread does not pay on this machine)"]
    return lines


def headline(rows):
    """The README's one-glance row, from this run's rows: p99 TPOT and p50 TTFT of the split against colocated."""
    _, whole, chunked, split = rows
    ms = lambda row, key: "-" if row[key] is None else f"{row[key]:.1f}"  # noqa: E731
    kv = "-" if split["kv_sent_KB"] is None else f"{split['kv_sent_KB']:.0f}"
    send = "-" if split["send_ms"] is None else f"{split['send_ms']:.2f}"
    return {"technique": "disaggregated prefill and decode, 2 gloo workers against the colocated paged engine, "
                         "equal CPU",
            "figure": f"p99 TPOT {ms(split, 'tpot_p99_ms')} ms against {ms(whole, 'tpot_p99_ms')} colocated "
                      f"({ms(chunked, 'tpot_p99_ms')} chunked); p50 TTFT {ms(split, 'ttft_arrival_ms')} against "
                      f"{ms(whole, 'ttft_arrival_ms')} ms; {kv} KB of KV per request, sent in {send} ms; the same tokens"}


def per_request(clock):
    ttft = [(f - a) * 1e3 for f, a in zip(clock.first, clock.arrivals)]
    tpot = [(l - f) * 1e3 / (n - 1) for f, l, n in zip(clock.first, clock.last, clock.n_tokens) if n > 1]
    return ttft, tpot


def plot_cdfs(clocks, preset, device):
    """The distribution of TTFT and TPOT over the requests of every timed round, per variant."""
    fig, (ax_ttft, ax_tpot) = harness.new_figure(2)
    for name, runs in clocks.items():
        ttft, tpot = (sum(values, []) for values in zip(*(per_request(clock) for clock in runs)))
        for ax, values in ((ax_ttft, ttft), (ax_tpot, tpot)):
            ax.plot(np.sort(values), np.linspace(0, 1, len(values)), label=name)
    ax_ttft.set(xlabel="TTFT from arrival (ms, log)", ylabel="fraction of requests",
                title=f"preset {preset.name}, {device}: every timed round")
    ax_tpot.set(xlabel="TPOT (ms, log)", title="TPOT per request")
    for ax in (ax_ttft, ax_tpot):
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter("")  # decades only: the minor labels overlap
    ax_ttft.legend(fontsize=7)
    return fig


def parse_args(argv):
    parser = harness.script_parser(__doc__)
    serving.add_trace_args(parser, n_requests=64, rate=40.0)
    parser.set_defaults(prompt_median=80, output_median=24)  # long prompts: prefills interfere with decodes
    add = parser.add_argument
    add("--batch-size", type=harness.int_at_least(1, harness.MAX_SIZE), default=8, help="batch slots of the decode side (and of prefill)")
    add("--block-size", type=harness.int_at_least(1, harness.MAX_SIZE), default=8, help="tokens per KV block of the paged pools")
    add("--chunk-size", type=harness.int_at_least(1, harness.MAX_SIZE), default=16, help="prefill tokens per step of the chunked colocated engine")
    add("--timeout", type=harness.int_at_least(1, 3600), default=300,
        help="seconds a rank waits for its peer (a transfer, or the barrier while the other runs the colocated "
             "engine) before it stops with an error; a peer that dies is reported at once")
    args = parser.parse_args(argv)
    distributed.check_environment(parser)
    if distributed.launched() and distributed.world_size() != 2:
        parser.error(f"disaggregation runs on exactly 2 processes (a prefill and a decode worker), torchrun "
                     f"started {distributed.world_size()}: use --nproc-per-node 2 (or --nnodes 2 with 1 each)")

    def check_args(preset):
        serving.check_trace_args(parser, preset.seqlen, args.prompt_median, args.output_median, args.rate)
        if args.block_size > preset.seqlen:
            parser.error(f"--block-size must be at most seqlen={preset.seqlen}, got {args.block_size}")
        device, local = harness.get_device(args.device), int(os.environ.get("LOCAL_WORLD_SIZE", 2))
        if device.type == "cuda" and local > torch.cuda.device_count():
            parser.error(f"{local} processes on this machine need {local} CUDA devices (NCCL: one GPU per rank); "
                         f"it has {torch.cuda.device_count()}")
        harness.check_fits(parser, "--batch-size", 2 * serving.forward_bytes(preset, args.batch_size),
                           f"a batch of {args.batch_size} and its KV pool, on each worker")
        copies = 2 + args.repeats * 4  # the reference, and the outputs and clocks of every run of the 4 variants
        harness.check_fits(parser, "--n-requests", serving.trace_bytes(preset, args.n_requests, copies),
                           f"a trace of {args.n_requests} requests, their reference and the outputs of every run")
        if not args.untrained and not files.checkpoint_path(preset.name).exists():
            parser.error(f"no checkpoint {files.checkpoint_path(preset.name)}: train it once first with "
                         f"{files.gptlite_command(preset.name)} (both workers would each train one)")
    return parser, args, check_args


def main(argv=None):
    parser, args, check_args = parse_args(argv)
    if not distributed.launched():  # every flag checked here, then torchrun starts the 2 workers
        with contextlib.redirect_stdout(io.StringIO()):  # rank 0 says it again
            harness.setup(args, parser, check_args)
        return distributed.relaunch(__file__, argv, 2)
    with distributed.rank0_speaks():
        preset, device, data = harness.setup(args, parser, check_args)
    hint = "lower --batch-size (it sizes both workers' KV block pools)"
    with distributed.rank_group(device, args.timeout, memory_hint=hint) as d:
        experiment(args, preset, d, data)


def experiment(args, preset, d, data):
    model = iu.load_model(GPTlite_KVCache, preset, d.device, data, untrained=args.untrained, seed=args.seed)
    requests, arrivals = serving.make_trace(data.val, args.n_requests, args.rate, preset.seqlen, args.prompt_median,
                                            args.output_median, seed=args.seed, device=d.device)
    torch.set_num_threads(1)
    mine = serving.reference_outputs(model, requests[d.rank::2], preset.seqlen)  # each rank half of them
    halves = [None, None]
    dist.all_gather_object(halves, [r.cpu() for r in mine])
    reference = [halves[i % 2][i // 2].to(d.device) for i in range(len(requests))]
    results, clocks = run_variants(model, requests, arrivals, reference, args, d.rank)
    if d.rank != 0:
        return
    rows = make_rows(results)
    prompt_lens, output_lens = [len(p) for p, _ in requests], [n for _, n in requests]
    print(f"\ntrace: {len(requests)} requests, Poisson arrivals at {args.rate:g}/s over {arrivals[-1]:.2f} s, prompt "
          f"lengths p50/max {iu.median(prompt_lens):.0f}/{max(prompt_lens)}, output lengths p50/max "
          f"{iu.median(output_lens):.0f}/{max(output_lens)}; batch size {args.batch_size}, KV blocks of "
          f"{args.block_size}; backend {d.backend}. Every request's tokens equal generate_kvcache alone (checked).")
    print(f"median of {args.repeats} runs per variant, round-robin, on the wall clock. TTFT from arrival (the "
          "disaggregated first token counts when the decode worker has it), TPOT p50/p99 over requests, tok/s: new "
          "tokens over the makespan; kv_sent_KB: the keys and values sent per request; send_ms: time of its "
          "dist.send calls; failed: transfers whose checksum failed (recomputed); preempted: by the decode pool")
    harness.report(args, "main_disaggregation.py", preset, d.device, rows, headline(rows), summary=summary_lines(rows),
                   plot=lambda: plot_cdfs(clocks, preset, d.device), backend=d.backend, batch_size=args.batch_size,
                   block_size=args.block_size,
                   trace={"n_requests": len(requests), "rate": args.rate if np.isfinite(args.rate) else "inf",
                          "arrivals": arrivals, "prompt_lens": prompt_lens, "output_lens": output_lens})


if __name__ == "__main__":
    harness.run(main)
