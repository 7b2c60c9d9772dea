"""Pipeline parallelism: GPTlite's blocks split into P stages on P processes, micro-batches flowing through them.

    python main_pipeline_parallel.py                          # 2 ranks: the script starts torchrun itself
    torchrun --nproc-per-node 2 main_pipeline_parallel.py     # the same, launched by hand (gloo on CPU)
    python main_pipeline_parallel.py --untrained --batch-size 4 --micro-batches 1 2 --n-tokens 4 --repeats 1

Blog section: "Scaling out: parallelism and offloading". Its claims are the rows to show: pipeline
parallelism raises the throughput of a batch (with micro-batches every stage works at once) and does not
lower the latency of a single request (its token still passes every layer, one stage after the other).
gptlite_pp.py holds the stages and the generation loop (point-to-point isend and recv; its docstring says
why not torch.distributed.pipelining).

For P = 1, 2, ... up to the number of ranks (dividing it) and each number of micro-batches m: a batch of
prompts generated greedily with the KV cache (each stage holds its layers' cache of every micro-batch);
prefill time, TPOT and throughput; each stage's measured bubble (the share of the phase's wall time its
compute was idle) against GPipe's (P-1)/(m+P-1) for the prefill and 1 - m/max(m, P) for steady decoding;
weights and KV cache per rank; bytes sent per generated token. Then one request (batch 1, m = 1) for each P,
and one process with the threads of all ranks (equal CPU).

Checks first, on every rank: the tokens of every P and of 1 and the most micro-batches are identical to one
process's generate_kvcache. Nothing is timed or written unless they hold.
"""
import functools

import torch
import torch.distributed as dist

import inference_utils as iu
from gptlite_kvcache import GPTlite_KVCache, generate_kvcache
from gptlite_pp import check_pp_size, pipeline_generate, pipeline_stage
from gptlite_tp import CommStats
from lib import corpus, distributed, files, harness, training


def stage_counts(world_size):
    """Every P that divides the number of ranks: 1, ..., world_size."""
    return [p for p in range(1, world_size + 1) if world_size % p == 0]


def run(stages, groups, rank, P, prompts, m, n_tokens, device):
    """One generation of `prompts` through P stages in m micro-batches on ranks < P (the others skip).
    Returns (tokens [B, n_tokens] on the last stage, timeline, bytes this rank sent) or None."""
    if rank >= P:
        return None
    comm = CommStats()
    tokens, timeline = pipeline_generate(stages[P], list(prompts.tensor_split(m)), n_tokens, comm, groups[P],
                                         sync=lambda: iu.synchronize(device))
    return (None if tokens is None else torch.cat(tokens)), timeline, comm.nbytes


def checks(model, stages, groups, rank, Ps, prompts, ms, n_tokens, device):
    """{check: ok} on every rank: the pipeline's tokens = one process's, for every P, with 1 and the most
    micro-batches."""
    expected = generate_kvcache(model, prompts, n_tokens, model.seqlen)[:, prompts.shape[1]:]
    results = {}
    for P in Ps:
        for m in sorted({1, max(ms)}):
            out = run(stages, groups, rank, P, prompts, m, n_tokens, device)
            bad = torch.tensor(float(rank == P - 1 and not torch.equal(out[0], expected)))
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            results[f"pipeline P={P}, m={m}: tokens identical to one process: {'yes' if bad == 0 else 'NO'}"] = bad == 0
    return results


def measure(variants, stages, groups, rank, n_tokens, device, repeats):
    """Round-robin over {name: (P, m, prompts, threads)} (distributed.round_robin), every rank in every variant
    (a rank past the stages gets None). {name: [this rank's (timeline, bytes) per repeat]}."""
    def one(P, m, prompts):
        out = run(stages, groups, rank, P, prompts, m, n_tokens, device)
        return None if out is None else out[1:]
    return distributed.round_robin({name: (dist.get_world_size(), threads, functools.partial(one, P, m, prompts))
                                    for name, (P, m, prompts, threads) in variants.items()}, rank, device, repeats)


def make_rows(variants, samples, stages, n_tokens):
    """Rank 0's rows from every rank's samples ({rank: {name: [(timeline, bytes)]}})."""
    rows = []
    for name, (P, m, prompts, threads) in variants.items():
        B = prompts.shape[0]
        per_rank = [samples[r][name] for r in range(P)]  # [rank][repeat]
        wall = {ph: iu.median([s[0].wall[ph] for s in per_rank[0]]) for ph in ("prefill", "decode")}
        bubble = {ph: 100 * sum(1 - iu.median([s[0].busy[ph] / s[0].wall[ph] for s in runs]) for runs in per_rank) / P
                  for ph in ("prefill", "decode")}
        sent = sum(runs[-1][1] for runs in per_rank)
        weights = max(sum(p.numel() * p.element_size() for p in stages[P][r].parameters()) for r in range(P))
        kv = sum(stages[P][0].new_cache(len(mb)).nbytes for mb in prompts.tensor_split(m))
        rows.append(harness.make_row(
            name, stages=P, micro_batches=m, threads=threads, batch=B, prefill_ms=round(wall["prefill"] * 1e3, 2),
            tpot_ms=wall["decode"] / (n_tokens - 1) * 1e3, tokens_per_s=B * (n_tokens - 1) / wall["decode"],
            bubble_prefill_pct=round(bubble["prefill"], 1), theory_prefill_pct=round(100 * (P - 1) / (m + P - 1), 1),
            bubble_decode_pct=round(bubble["decode"], 1), theory_decode_pct=round(100 * (1 - m / max(m, P)), 1),
            weight_mb_per_rank=round(weights / 2**20, 3), kv_mb_per_rank=round(kv / 2**20, 3),
            sent_KB_per_token=round(sent / (B * n_tokens) / 1024, 3)))
    return rows


def plot_results(rows, preset, device):
    fig, (ax_tput, ax_bubble) = harness.new_figure(2)
    batch = max(r["batch"] for r in rows)
    for P in sorted({r["stages"] for r in rows}):
        mine = [r for r in rows if r["stages"] == P and r["batch"] == batch and r["threads"] == 1]
        ms = [r["micro_batches"] for r in mine]
        ax_tput.plot(ms, [r["tokens_per_s"] for r in mine], marker="o", label=f"P={P}")
        if P > 1:
            ax_bubble.plot(ms, [r["bubble_prefill_pct"] for r in mine], marker="o", label=f"P={P} prefill, measured")
            ax_bubble.plot(ms, [r["theory_prefill_pct"] for r in mine], linestyle="--", label=f"P={P} (P-1)/(m+P-1)")
            ax_bubble.plot(ms, [r["bubble_decode_pct"] for r in mine], marker="s", label=f"P={P} decode, measured")
    equal = [r for r in rows if r["threads"] > 1]
    if equal:
        ax_tput.axhline(equal[0]["tokens_per_s"], color="gray", linestyle=":", label=equal[0]["variant"])
    for ax in (ax_tput, ax_bubble):
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
    ax_tput.set(xlabel="micro-batches m", ylabel="decode tokens/s", ylim=(0, None),
                title=f"pipeline, batch {batch}, preset {preset.name} ({device})")
    ax_bubble.set(xlabel="micro-batches m", ylabel="bubble (% of the phase)", ylim=(0, 100),
                  title="idle share of each stage, mean over stages")
    return fig


def headline(rows, world_size, backend):
    technique = f"pipeline parallelism, {world_size} {backend} ranks"
    one = {r["stages"]: r for r in rows if r["batch"] == 1}
    big = [r for r in rows if r["batch"] > 1 and r["threads"] == 1]
    if world_size == 1:
        return dict(technique=technique, figure="one process: launch N ranks with --ranks N to compare")
    P = max(one)
    best = max((r for r in big if r["stages"] == P), key=lambda r: r["tokens_per_s"])  # its best micro-batching
    single = next(r for r in big if r["stages"] == 1 and r["micro_batches"] == 1)
    return dict(technique=technique,
                figure=f"batch {best['batch']}: P={P} at its best (m={best['micro_batches']}) decodes "
                       f"{best['tokens_per_s']:.0f} tok/s against "
                       f"{single['tokens_per_s']:.0f} for one process ({best['tokens_per_s'] / single['tokens_per_s']:.2f}x); "
                       f"one request: TPOT {one[P]['tpot_ms']:.2f} ms on {P} stages against {one[1]['tpot_ms']:.2f} ms; "
                       "tokens identical to one process")


def parse_args(argv):
    """The flags, checked before any work: (args, preset, device, data); args.world: the number of ranks."""
    parser = distributed.script_parser(__doc__, 2, "main_pipeline_parallel.py")
    add = parser.add_argument
    add("--micro-batches", type=harness.int_at_least(1), nargs="+", default=[1, 2, 4, 8],
        help="numbers of micro-batches m the batch is cut into")
    harness.add_generation_flags(parser, batch_size=32, prompt_len=32, n_tokens=32, repeats=5)
    args = distributed.parse_ranks(parser, argv, 2)
    world = args.world
    args.micro_batches = sorted(set(args.micro_batches))

    def check_args(preset):
        try:
            check_pp_size(preset.n_layers, world)
        except ValueError as e:
            parser.error(f"--ranks (or torchrun's --nproc-per-node): {e}")
        if max(args.micro_batches) > args.batch_size:
            parser.error(f"--micro-batches {max(args.micro_batches)}: more micro-batches than the {args.batch_size} "
                         "requests of the batch (--batch-size); a micro-batch holds at least one")
        if args.prompt_len + args.n_tokens - 1 > preset.seqlen:
            parser.error(f"--prompt-len {args.prompt_len} + --n-tokens {args.n_tokens} exceed the window of "
                         f"{preset.seqlen} tokens: every token must fit each stage's KV cache")
        distributed.check_ranks(parser, args)
        if world > 1 and not args.untrained and not files.checkpoint_path(preset.name).exists():
            parser.error(f"no checkpoint {files.checkpoint_path(preset.name)}: train it once first with "
                         f"{files.gptlite_command(preset.name)} (N ranks would each train one)")
        harness.check_fits(parser, "--batch-size", 2 * world * training.activation_bytes(preset, args.batch_size),
                           f"a batch of {args.batch_size} prompts and its KV cache on {world} process(es)")
    return (args, *distributed.setup(args, parser, check_args))


def main(argv=None):  # every flag checked first, then torchrun starts the ranks, each running experiment
    return distributed.run_ranks(__file__, argv, parse_args, experiment, "lower --batch-size")


def experiment(args, preset, d, data):
    model = iu.load_model(GPTlite_KVCache, preset, d.device, data, untrained=args.untrained, seed=args.seed)
    Ps, N, T = stage_counts(d.world_size), d.world_size, args.threads
    groups = {P: distributed.new_group(range(P), args.timeout) for P in Ps}  # every rank makes every group, in one order
    stages = {P: [pipeline_stage(model, r, P) for r in range(P)] for P in Ps}
    mine = {P: stages[P][d.rank] if d.rank < P else None for P in Ps}
    prompts = corpus.sample_prompts(data, args.batch_size, args.prompt_len, seed=args.seed, device=d.device)
    results = checks(model, mine, groups, d.rank, Ps, prompts, args.micro_batches, args.n_tokens, d.device)
    harness.require_checks(results)  # on every rank: nothing timed or written

    variants = {f"pipeline P={P}, m={m}": (P, m, prompts, T) for P in Ps for m in args.micro_batches}
    variants.update({f"pipeline P={P}, one request": (P, 1, prompts[:1], T) for P in Ps})
    if N > 1:
        variants[f"pipeline P=1 x {N * T} threads (equal CPU)"] = (1, 1, prompts, N * T)
    samples = measure(variants, mine, groups, d.rank, args.n_tokens, d.device, args.repeats)
    gathered = [None] * N
    dist.all_gather_object(gathered, samples)
    if d.rank != 0:
        return
    rows = make_rows(variants, dict(enumerate(gathered)), stages, args.n_tokens)
    print(f"\n{N} rank(s), backend {d.backend}; {args.batch_size} prompts of {args.prompt_len}, {args.n_tokens} greedy "
          f"tokens each with the KV cache; medians of {args.repeats} rounds")
    summary = list(results) + [
        "bubble_*_pct: the share of the phase's wall time (the same for every stage: it ends when the last one is done) "
        "that a stage's compute was idle, mean over the stages; theory: GPipe's (P-1)/(m+P-1) for one pass (the "
        "prefill), 1 - m/max(m, P) for steady decoding (fewer micro-batches than stages leave stages idle)",
        "sent_KB_per_token: every stage's sends (activations forward, the token back to stage 0) per generated token"]
    distributed.report(args, "main_pipeline_parallel.py", preset, d, rows, headline(rows, N, d.backend), summary,
                       lambda: plot_results(rows, preset, d.device))


if __name__ == "__main__":
    harness.run(main)
