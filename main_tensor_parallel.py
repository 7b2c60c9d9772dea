"""Tensor parallelism: GPTlite split across N processes, Megatron-style, on torch.distributed.

    python main_tensor_parallel.py                          # N = 1: one process (it says how to launch more)
    torchrun --nproc-per-node 2 main_tensor_parallel.py     # N = 2 processes on this machine (gloo on CPU)
    python main_tensor_parallel.py --ranks 2                # the same: the script starts torchrun itself
    python main_tensor_parallel.py --ranks 2 --untrained --batch-size 4 --n-tokens 4 --repeats 1   # smoke run

Across machines, torchrun's rendezvous flags (--nnodes, --node-rank, --rdzv-backend c10d,
--rdzv-endpoint): see docs/distributed.md.

Blog section: "Scaling out: parallelism and offloading". Every rank cuts its shard from the same trained checkpoint
(gptlite_tp.shard_state_dict): the query, key and value projections split by heads and the MLP's first
layer by neurons (column-parallel), the attention's output projection and the MLP's second layer split
the other way (row-parallel), two all-reduces per block; embeddings, LayerNorms and the head replicated.
Each rank's KV cache holds its heads only. Backend by device: gloo on CPU, NCCL on CUDA.

Checks first, on every rank: the N-rank logits equal the single-process model's (float32, atol 1e-5)
and its greedy tokens with the KV cache are identical. Nothing is timed or written unless both hold.

Then, round-robin, the variants (figures of rank 0; ranks not in a variant wait in a barrier, which
does not spin):
- 1 rank x T threads: the single-process model (T = --threads, 1 by default, as every rank has);
- 1 rank x N*T threads: the same model with the threads of all N ranks together: equal CPU;
- N ranks x T threads: the tensor-parallel model.
Per variant: weights and KV cache (full window, the large batch) per rank, the prefill time of a batch
of prompts, TPOT at batch 1 and at the large batch, and the all-reduce share of each (wall time inside
dist.all_reduce, waiting for the slower rank included, over the step's time) with its bytes per token.
"""
import functools

import torch
import torch.distributed as dist

import inference_utils as iu
from gptlite_kvcache import GPTlite_KVCache, StaticKVCache, decode_n_tokens, generate_kvcache, prefill
from gptlite_tp import (RowParallelLinear, check_tp_size, shard_state_dict,  # noqa: F401 (the post's listing)
                        tensor_parallel_model)
from lib import corpus, distributed, files, harness, training

ATOL = 1e-5  # float32 logits: the N partial sums are added in another order
WORKLOADS = ("prefill", "b1", "bB")  # a batch of prompts; one decode step at batch 1; at the large batch


@torch.inference_mode()
def tp_matches_single(tp, single, window, prompts, n_tokens, seqlen):
    """Max |logits difference| on `window` [B, S] and whether the greedy cached tokens are identical."""
    diff = (tp(window)[0] - single(window)[0]).abs().max().item()
    same = torch.equal(generate_kvcache(tp, prompts, n_tokens, seqlen),
                       generate_kvcache(single, prompts, n_tokens, seqlen))
    return diff, same


def agree(diff, same, device):
    """The worst figures over the ranks, so that every rank stops if any failed."""
    worst = torch.tensor([diff, 0.0 if same else 1.0], device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst[0].item(), worst[1].item() == 0.0


def timed(fn, model, device):
    """Wall time of fn(), and the all-reduce seconds and bytes it spent (0 for the single-process model)."""
    counts = getattr(model, "all_reduce", None)
    if counts is not None:
        counts.reset()
    with iu.Timer(device) as t:
        fn()
    return (t.seconds, counts.seconds, counts.nbytes) if counts is not None else (t.seconds, 0.0, 0)


@torch.inference_mode()
def run_workloads(model, prompts, n_tokens, seqlen, device):
    """{workload: (seconds, all-reduce seconds, all-reduce bytes, tokens)}: the prefill of `prompts`
    [B, S], and n_tokens decode steps (after an untimed prefill) at batch 1 and at batch B, per step."""
    out = {"prefill": timed(lambda: prefill(model, prompts, None, seqlen), model, device) + (prompts.numel(),)}
    for workload, batch in (("b1", prompts[:1]), ("bB", prompts)):
        token, cache = prefill(model, batch, None, seqlen)
        seconds, ar_seconds, nbytes = timed(lambda: decode_n_tokens(model, token, cache, n_tokens, seqlen),
                                            model, device)
        out[workload] = (seconds / n_tokens, ar_seconds / n_tokens, nbytes, batch.shape[0] * n_tokens)
    return out


def measure_variants(variants, rank, prompts, n_tokens, seqlen, device, repeats):
    """Round-robin over {name: (model, ranks, threads)} (distributed.round_robin): a rank in the variant runs
    the workloads, timed inside (run_workloads). Returns {name: [samples of this rank]}, the warm-up left out."""
    return distributed.round_robin(
        {name: (ranks, threads, functools.partial(run_workloads, model, prompts, n_tokens, seqlen, device))
         for name, (model, ranks, threads) in variants.items()}, rank, device, repeats)


def figures(samples):
    """Medians of one variant's samples: time (ms), all-reduce share (%), all-reduce KB per token."""
    row = {}
    for workload in WORKLOADS:
        runs = [s[workload] for s in samples]
        row[workload] = iu.median([s[0] for s in runs]) * 1e3
        row[f"ar_{workload}"] = iu.median([s[1] / s[0] for s in runs]) * 100
    _, _, nbytes, tokens = samples[-1]["bB"]
    row["ar_kb"] = nbytes / tokens / 1024  # the same for every workload: 2 outputs of d_model floats per block
    return row


def make_rows(variants, samples, batch_size):
    rows = []
    for name, (model, ranks, threads) in variants.items():
        f = figures(samples[name])
        kv_mb = StaticKVCache.for_model(model, batch_size).nbytes / 2**20  # a full window of seqlen tokens
        tp = ranks > 1
        rows.append(harness.make_row(
            name, ranks=ranks, threads=threads, batch=batch_size, weight_mb=round(iu.model_size_mb(model), 3),
            kv_mb=round(kv_mb, 3), prefill_ms=round(f["prefill"], 2), tpot_b1_ms=round(f["b1"], 3),
            tpot_bB_ms=round(f["bB"], 3), ar_prefill=round(f["ar_prefill"], 1) if tp else None,
            ar_b1=round(f["ar_b1"], 1) if tp else None, ar_bB=round(f["ar_bB"], 1) if tp else None,
            ar_KB_per_token=round(f["ar_kb"], 2) if tp else None))
    return rows


def speedups(rows):
    """The tensor-parallel row against each single-process row: time of the single / time of the TP."""
    tp = rows[-1]
    return [f"{tp['variant']} against {r['variant']}: prefill {iu.ratio(r['prefill_ms'], tp['prefill_ms']):.2f}x, "
            f"TPOT batch 1 {iu.ratio(r['tpot_b1_ms'], tp['tpot_b1_ms']):.2f}x, TPOT batch {r['batch']} "
            f"{iu.ratio(r['tpot_bB_ms'], tp['tpot_bB_ms']):.2f}x (above 1: the split is faster)" for r in rows[:-1]]


def plot_results(rows, preset, device):
    fig, ax = harness.new_figure()
    labels = ["prefill", "TPOT batch 1", f"TPOT batch {rows[0]['batch']}"]
    keys = [("prefill_ms", "ar_prefill"), ("tpot_b1_ms", "ar_b1"), ("tpot_bB_ms", "ar_bB")]
    width = 0.8 / len(rows)
    for i, row in enumerate(rows):
        rel = [row[t] / rows[0][t] for t, _ in keys]  # relative to the first row (1 rank, T threads)
        share = [(row[a] or 0) / 100 for _, a in keys]
        xs = [j + i * width for j in range(len(keys))]
        bars = ax.bar(xs, [r * (1 - s) for r, s in zip(rel, share)], width, label=row["variant"])
        if any(share):
            ax.bar(xs, [r * s for r, s in zip(rel, share)], width, bottom=[r * (1 - s) for r, s in zip(rel, share)],
                   color=bars[0].get_facecolor(), alpha=0.4, hatch="//", label=f"{row['variant']}: all-reduce")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))], labels)
    ax.set(ylabel=f"time / time of {rows[0]['variant']}",
           title=f"tensor parallelism, preset {preset.name} ({device}, {'gloo' if device.type == 'cpu' else 'NCCL'})")
    ax.legend(fontsize=8)
    return fig


def parse_args(argv):
    """The flags, checked before any work: (args, preset, device, data); args.world: the number of ranks."""
    parser = distributed.script_parser(__doc__, 1, "main_tensor_parallel.py")
    harness.add_generation_flags(parser, batch_size=64, prompt_len=64, n_tokens=32, repeats=5, least_tokens=1)
    args = distributed.parse_ranks(parser, argv, 1)
    world = args.world

    def check_args(preset):
        try:
            check_tp_size(preset.n_heads, 4 * preset.d_model, world)
        except ValueError as e:
            parser.error(f"--ranks (or torchrun's --nproc-per-node): {e}")
        distributed.check_ranks(parser, args)
        if world > 1 and not args.untrained and not files.checkpoint_path(preset.name).exists():
            parser.error(f"no checkpoint {files.checkpoint_path(preset.name)}: train it once first with "
                         f"{files.gptlite_command(preset.name)} (N ranks would each train one)")
        check_sizes(parser, preset, args.batch_size, args.prompt_len, args.n_tokens, world)
    return (args, *distributed.setup(args, parser, check_args))

def check_sizes(parser, preset, batch_size, prompt_len, n_tokens, world):
    """The large batch through the model and its KV cache (a full window) on each of the `world` processes of
    this machine, and the tokens each decodes."""
    harness.check_fits(parser, "--batch-size", world * training.activation_bytes(preset, batch_size),
                       f"a batch of {batch_size} prompts and its KV cache on {world} process(es)")
    harness.check_fits(parser, "--n-tokens", world * 3 * batch_size * (prompt_len + n_tokens) * 8,
                       f"{n_tokens} decoded tokens for each of {batch_size} prompts on {world} process(es)")


def headline(rows, world, backend, threads, diff):
    """The README's one-glance row, from this run's rows (the first: one rank of --threads threads)."""
    one, tp = rows[0], rows[-1]
    ratio = lambda key: "-" if iu.ratio(one[key], tp[key]) is None else f"{iu.ratio(one[key], tp[key]):.2f}x"  # noqa
    technique = f"tensor parallelism, {world} {backend} ranks of {threads} thread(s)"
    if world == 1:
        return dict(technique=technique, figure="one process: launch N ranks with --ranks N to compare")
    share = "-" if tp["ar_b1"] is None else f"{tp['ar_b1']:.0f}"
    return dict(technique=technique,
                figure=f"TP against {one['variant']}: prefill {ratio('prefill_ms')}, TPOT at batch 1 {ratio('tpot_b1_ms')}, "
                       f"at batch {tp['batch']} {ratio('tpot_bB_ms')} (above 1: faster); all-reduce {share}% of a "
                       f"batch-1 step; max |logits diff| {diff:.0e}, identical tokens")


def main(argv=None):  # every flag checked first, then torchrun starts the ranks, each running experiment
    return distributed.run_ranks(__file__, argv, parse_args, experiment,
                                 "lower --batch-size (its KV cache and prompts), or run fewer ranks per machine")


def experiment(args, preset, d, data):
    single = iu.load_model(GPTlite_KVCache, preset, d.device, data, untrained=args.untrained, seed=args.seed)
    tp = tensor_parallel_model(single.state_dict(), single.config.to_dict(), d.rank, d.world_size)
    window = corpus.sample_prompts(data, 8, preset.seqlen, seed=args.seed, device=d.device)  # full windows
    prompts = corpus.sample_prompts(data, args.batch_size, args.prompt_len, seed=args.seed, device=d.device)
    diff, same = agree(*tp_matches_single(tp, single, window, window[:, :args.prompt_len], args.n_tokens,
                                          preset.seqlen), d.device)
    check = (f"{d.world_size} rank(s) against the single-process model: max |logits diff| {diff:.1e} "
             f"(atol {ATOL:g}, float32); greedy cached tokens identical: {'yes' if same else 'NO'}")
    harness.require_checks({check: diff <= ATOL and same})  # on every rank: nothing timed or written

    T, N = args.threads, d.world_size
    variants = {f"1 rank x {T} thread{'s' * (T > 1)}": (single, 1, T)}
    if N > 1:
        variants[f"1 rank x {N * T} threads (equal CPU)"] = (single, 1, N * T)
        variants[f"{N} ranks x {T} thread{'s' * (T > 1)} (TP)"] = (tp, N, T)
    samples = measure_variants(variants, d.rank, prompts, args.n_tokens, preset.seqlen, d.device, args.repeats)
    if d.rank != 0:
        return
    rows = make_rows(variants, samples, args.batch_size)
    print(f"\n{N} rank(s), backend {d.backend}; prefill: {args.batch_size} prompts of {args.prompt_len}; TPOT: one "
          f"decode step, median over {args.repeats} rounds of {args.n_tokens} steps, at batch 1 and at batch "
          f"{args.batch_size} (bB); weights and KV cache per rank (the KV cache at a full window of {preset.seqlen})")
    summary = [check,
               "figures of rank 0. ar_*: the share (%) of each step's time spent in dist.all_reduce (waiting for the "
               "slower rank included); ar_KB_per_token: the all-reduce payload per token (2 per block, d_model floats each)"]
    summary += speedups(rows) if N > 1 else [
        "one process: launch N ranks with `torchrun --nproc-per-node N main_tensor_parallel.py` (or --ranks N)"]
    distributed.report(args, "main_tensor_parallel.py", preset, d, rows, headline(rows, N, d.backend, T, diff), summary,
                       lambda: plot_results(rows, preset, d.device), logits_max_diff=diff, tokens_identical=same)


if __name__ == "__main__":
    harness.run(main)
