"""Expert parallelism: the MoE GPTlite of main_moe.py split across N processes by experts, against splitting
every expert's neurons (tensor parallelism), on torch.distributed.

    python main_expert_parallel.py                           # 2 ranks: the script starts torchrun itself
    torchrun --nproc-per-node 2 main_expert_parallel.py      # the same, launched by hand (gloo on CPU)
    python main_expert_parallel.py --untrained --batch-sizes 2 --n-tokens 4 --repeats 1   # smoke run

Blog section: "Scaling out: parallelism and offloading". The model is main_moe.py's balanced MoE (8 experts,
top-2; `python main_moe.py` trains it). gptlite_ep.py holds the two splits:
- EP (expert parallel): rank r holds E/N experts of every layer and B/N rows of the batch (attention data-
  parallel, its own KV cache); each MoE layer dispatches the tokens to their experts' ranks with
  all_to_all_single and combines the outputs that a second one brings back. Capacity is GShard's over the
  whole batch, applied by the expert's owner.
- TP (tensor parallel experts): every rank holds every expert with d_expert / N neurons and runs the whole
  batch; one all-reduce per layer sums the partial outputs.

Checks first, on every rank: the logits of both splits equal the single-process model's (float32, atol 1e-5)
dropless and at capacity factor 1.0 (where experts drop assignments: the same ones, counted over the ranks),
and their greedy tokens with the KV cache are identical. Nothing is timed or written unless they hold.

Then, round-robin, the variants (figures of rank 0): the single process with T threads and with N*T threads
(equal CPU), EP and TP. Per variant and batch size: TPOT of greedy decoding with the KV cache (the batch is
the whole batch over all ranks), the share of each step's time spent in the collectives (all-to-all or
all-reduce, waiting for the slower rank included) and the bytes rank 0 sends per token of its own.
"""
import functools

import torch
import torch.distributed as dist

import inference_utils as iu
from gptlite_ep import check_ep_size, parallel_moe_model, split_batch
from gptlite_kvcache import decode_n_tokens, generate_kvcache, prefill
from gptlite_moe import GPTlite_MoE
from lib.variant_checkpoints import load_moe, moe_checkpoint
from lib import corpus, distributed, harness, training

ATOL = 1e-5  # float32 logits: the same terms, summed on other ranks in another order
N_EXPERTS, TOP_K = 8, 2  # main_moe.py's defaults: its checkpoint


def load_moe_model(preset, data, device, untrained, seed):
    """main_moe.py's balanced MoE of the preset (E = 8, top-2, d_expert = d_ff / 8, softmax router), or
    untrained weights of that shape."""
    config = dict(preset.gptlite_kwargs(), n_experts=N_EXPERTS, top_k=TOP_K, d_expert=4 * preset.d_model // N_EXPERTS)
    if untrained:
        torch.manual_seed(seed)
        return GPTlite_MoE(**config).to(device).eval()
    return load_moe(checkpoint(preset), data.vocab, device)


def checkpoint(preset):
    return moe_checkpoint(preset.name, N_EXPERTS, TOP_K, 4 * preset.d_model // N_EXPERTS, "softmax")


def rows_of(rank, world_size, mode):
    """The rows a rank runs: its share of the batch with expert parallelism, the whole batch otherwise."""
    return (lambda batch: split_batch(batch, rank, world_size)) if mode == "expert" else (lambda batch: batch)


@torch.inference_mode()
def compare(single, parallel, rows, window, prompts, n_tokens, seqlen):
    """Max |logits difference| on this rank's rows of `window`, the assignments dropped by this rank's layers
    (EP: its experts'; TP: every rank's routing, counted once by rank 0), and whether the greedy cached tokens
    of its rows are the single process's."""
    diff = (parallel(rows(window))[0] - rows(single(window)[0])).abs().max().item()
    dropped = sum(layer.routing.dropped for layer in parallel.moe_layers())
    same = torch.equal(generate_kvcache(parallel, rows(prompts), n_tokens, seqlen),
                       rows(generate_kvcache(single, prompts, n_tokens, seqlen)))
    return diff, dropped, same


def checks(single, splits, d, window, prompts, n_tokens, seqlen):
    """{check: ok} on every rank (the worst figures of all ranks), dropless and at capacity factor 1.0."""
    results = {}
    for factor in (None, 1.0):
        single.set_capacity_factor(factor)
        with torch.inference_mode():
            single(window)
        single_dropped = sum(layer.routing.dropped for layer in single.moe_layers())
        for mode, (model, rows) in splits.items():
            model.set_capacity_factor(factor)
            diff, dropped, same = compare(single, model, rows, window, prompts, n_tokens, seqlen)
            figures = torch.tensor([diff, 0.0 if same else 1.0, dropped if mode == "expert" or d.rank == 0 else 0])
            dist.all_reduce(figures[:2], op=dist.ReduceOp.MAX)
            dist.all_reduce(figures[2:], op=dist.ReduceOp.SUM)
            where = "dropless" if factor is None else f"capacity factor {factor:g}"
            name = (f"{mode} parallel, {where}: max |logits diff| {figures[0]:.1e} (atol {ATOL:g}), greedy tokens "
                    f"identical: {'yes' if figures[1] == 0 else 'NO'}, dropped {int(figures[2])} of the "
                    f"single process's {single_dropped}")
            results[name] = figures[0] <= ATOL and figures[1] == 0 and int(figures[2]) == single_dropped
    for model in [single] + [model for model, _ in splits.values()]:
        model.set_capacity_factor(None)
    return results


def timed_decode(model, prompts, n_tokens, seqlen, device):
    """(seconds per step, collective seconds per step, bytes sent, tokens of this rank) of n_tokens decode
    steps after an untimed prefill."""
    token, cache = prefill(model, prompts, None, seqlen)
    comm = getattr(model, "comm", None)
    if comm is not None:
        comm.reset()
    with iu.Timer(device) as t:
        decode_n_tokens(model, token, cache, n_tokens, seqlen)
    if comm is None:
        return t.seconds / n_tokens, 0.0, 0, prompts.shape[0] * n_tokens
    return t.seconds / n_tokens, comm.seconds / n_tokens, comm.nbytes, prompts.shape[0] * n_tokens


def measure(variants, rank, batches, n_tokens, seqlen, device, repeats):
    """Round-robin over {name: (model, ranks, threads, rows)} (distributed.round_robin): each variant's decode
    at every batch, on the ranks in the variant. {name: {batch: [samples]}}, the warm-up left out."""
    def decode_all(model, rows):
        return {b: timed_decode(model, rows(prompts), n_tokens, seqlen, device) for b, prompts in batches.items()}
    runs = distributed.round_robin({name: (ranks, threads, functools.partial(decode_all, model, rows))
                                    for name, (model, ranks, threads, rows) in variants.items()}, rank, device, repeats)
    return {name: {b: [r[b] for r in rs] for b in batches} for name, rs in runs.items()}


def make_rows(variants, samples):
    rows = []
    for name, (model, ranks, threads, rows_of_rank) in variants.items():
        for batch, runs in samples[name].items():
            split = ranks > 1
            seconds, comm_seconds, nbytes, tokens = zip(*runs)
            rows.append(harness.make_row(
                name, ranks=ranks, threads=threads, batch=batch, rows_per_rank=len(rows_of_rank(torch.arange(batch))),
                tpot_ms=iu.median(seconds) * 1e3,
                tokens_per_s=round(batch / iu.median(seconds)),
                comm_pct=round(100 * iu.median([c / s for c, s in zip(comm_seconds, seconds)]), 1) if split else None,
                sent_KB_per_token=round(nbytes[-1] / tokens[-1] / 1024, 3) if split else None))
    return rows


def plot_results(rows, preset, device):
    fig, ax = harness.new_figure()
    batches = sorted({r["batch"] for r in rows})
    names = list(dict.fromkeys(r["variant"] for r in rows))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        by = {r["batch"]: r for r in rows if r["variant"] == name}
        base = {b: next(r for r in rows if r["batch"] == b)["tpot_ms"] for b in batches}
        rel = [by[b]["tpot_ms"] / base[b] for b in batches]
        share = [(by[b]["comm_pct"] or 0) / 100 for b in batches]
        xs = [j + i * width for j in range(len(batches))]
        bars = ax.bar(xs, [r * (1 - s) for r, s in zip(rel, share)], width, label=name)
        if any(share):
            ax.bar(xs, [r * s for r, s in zip(rel, share)], width, bottom=[r * (1 - s) for r, s in zip(rel, share)],
                   color=bars[0].get_facecolor(), alpha=0.4, hatch="//", label=f"{name}: collectives")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(batches))], [f"batch {b}" for b in batches])
    ax.set(ylabel=f"TPOT / TPOT of {names[0]}",
           title=f"MoE decoding split over ranks, preset {preset.name} ({device})")
    ax.legend(fontsize=7)
    return fig


def headline(rows, world_size, backend):
    technique = f"expert parallelism, {world_size} {backend} ranks"
    if world_size == 1:
        return dict(technique=technique, figure="one process: launch N ranks with --ranks N to compare")
    largest = max(r["batch"] for r in rows)
    by = {r["variant"]: r for r in rows if r["batch"] == largest}
    one, ep, tp = (next(r for name, r in by.items() if key in name) for key in ("1 rank", "EP", "TP"))
    return dict(technique=technique,
                figure=f"TPOT at batch {largest}: EP {iu.ratio(one['tpot_ms'], ep['tpot_ms']):.2f}x, TP of the experts "
                       f"{iu.ratio(one['tpot_ms'], tp['tpot_ms']):.2f}x against one process (above 1: faster); "
                       f"all-to-all {ep['comm_pct']:.0f}% of an EP step, {ep['sent_KB_per_token']:.2f} KB sent per "
                       f"token; all-reduce {tp['comm_pct']:.0f}% of a TP step; logits and tokens = one process")


def parse_args(argv):
    """The flags, checked before any work: (args, preset, device, data); args.world: the number of ranks."""
    parser = distributed.script_parser(__doc__, 2, "main_expert_parallel.py")
    add = parser.add_argument
    add("--batch-sizes", type=harness.int_at_least(1), nargs="+", default=[2, 64],
        help="whole batches decoded (over all ranks: each must split evenly over them)")
    harness.add_generation_flags(parser, prompt_len=32, n_tokens=32, repeats=5)
    args = distributed.parse_ranks(parser, argv, 2)
    world = args.world
    args.batch_sizes = sorted(set(args.batch_sizes))

    def check_args(preset):
        try:
            check_ep_size(N_EXPERTS, 4 * preset.d_model // N_EXPERTS, world, "expert")
            check_ep_size(N_EXPERTS, 4 * preset.d_model // N_EXPERTS, world, "tensor")
        except ValueError as e:
            parser.error(f"--ranks (or torchrun's --nproc-per-node): {e}")
        odd = [b for b in args.batch_sizes if b % world]
        if odd:
            parser.error(f"--batch-sizes {odd}: expert parallelism splits the batch evenly over the {world} ranks; "
                         f"give multiples of {world}")
        distributed.check_ranks(parser, args)
        if not args.untrained and not checkpoint(preset).exists():
            parser.error(f"no MoE checkpoint {checkpoint(preset)}: train it once first with python main_moe.py "
                         f"--preset {preset.name} (N ranks would each train one), or use --untrained")
        harness.check_fits(parser, "--batch-sizes", 2 * world * training.activation_bytes(preset, max(args.batch_sizes)),
                           f"a batch of {max(args.batch_sizes)} prompts and its KV cache on {world} process(es)")
    return (args, *distributed.setup(args, parser, check_args))


def main(argv=None):  # every flag checked first, then torchrun starts the ranks, each running experiment
    return distributed.run_ranks(__file__, argv, parse_args, experiment, "lower --batch-sizes")


def experiment(args, preset, d, data):
    single = load_moe_model(preset, data, d.device, args.untrained, args.seed)
    N, T = d.world_size, args.threads
    splits = {mode: (parallel_moe_model(single, d.rank, N, mode), rows_of(d.rank, N, mode))
              for mode in ("expert", "tensor")}
    window = corpus.sample_prompts(data, 2 * N, preset.seqlen, seed=args.seed, device=d.device)
    results = checks(single, splits, d, window, window[:, :args.prompt_len], 16, preset.seqlen)
    harness.require_checks(results)  # on every rank: nothing timed or written

    variants = {f"1 rank x {T} thread{'s' * (T > 1)}": (single, 1, T, lambda b: b)}
    if N > 1:
        variants[f"1 rank x {N * T} threads (equal CPU)"] = (single, 1, N * T, lambda b: b)
        variants[f"{N} ranks, EP (experts split)"] = (splits["expert"][0], N, T, splits["expert"][1])
        variants[f"{N} ranks, TP (each expert split)"] = (splits["tensor"][0], N, T, splits["tensor"][1])
    batches = {b: corpus.sample_prompts(data, b, args.prompt_len, seed=args.seed, device=d.device)
               for b in args.batch_sizes}
    samples = measure(variants, d.rank, batches, args.n_tokens, preset.seqlen, d.device, args.repeats)
    if d.rank != 0:
        return
    rows = make_rows(variants, samples)
    print(f"\n{N} rank(s), backend {d.backend}; MoE of {N_EXPERTS} experts, top-{TOP_K}, dropless; TPOT: one decode "
          f"step after prompts of {args.prompt_len}, median over {args.repeats} rounds of {args.n_tokens} steps")
    summary = list(results) + [
        "batch: the whole batch (EP: rows_per_rank on each rank; TP and one rank: all of it); comm_pct: the share of a "
        "decode step spent in the collectives (EP: its 4 all-to-alls per layer, the counts, tokens, queue keys and "
        "outputs; TP: one all-reduce per layer), waiting for the slower rank included; sent_KB_per_token: bytes rank 0 "
        "sends to other ranks per token of its rows (TP: the all-reduce's payload, of which a ring sends 2(N-1)/N)"]
    distributed.report(args, "main_expert_parallel.py", preset, d, rows, headline(rows, N, d.backend), summary,
                       lambda: plot_results(rows, preset, d.device))


if __name__ == "__main__":
    harness.run(main)
