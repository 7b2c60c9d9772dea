"""Sequence parallelism: the prefill of one long prompt split over P ranks by tokens, with Ring Attention
(contiguous and zigzag shards) and DeepSpeed-Ulysses, on torch.distributed.

    python main_sequence_parallel.py                           # 2 ranks: the script starts torchrun itself
    torchrun --nproc-per-node 2 main_sequence_parallel.py      # the same, launched by hand (gloo on CPU)
    python main_sequence_parallel.py --untrained --seq-lens 1024 2048 --check-len 256 --repeats 1   # smoke run

Blog section: "Scaling out: parallelism and offloading". gptlite_sp.py holds the mechanisms:
- ring: each rank keeps its contiguous shard of queries; the keys and values go around the ring (a batched
  isend/irecv per step, overlapped with the block computed), partial outputs merged by log-sum-exp, blocks
  entirely in the future skipped;
- zigzag: the same ring with rank r holding chunks r and 2P-1-r of 2P: the causal work balanced;
- ulysses: all-to-all from sequence shards to head shards, local attention, all-to-all back (P | heads).

Checks first, on every rank, at two prompt lengths: --check-len rounded up to a multiple of 2P (at least 4P),
and one token less, which P does not divide (shards one token apart):
- attention alone on random Q, K, V of the preset's heads: every method's output (and the one-process
  kernel's) = the explicit softmax attention on the whole sequence (gptlite.scaled_dot_product_attention);
- a whole model's prefill: the rotary GPTlite of the preset (gptlite_rope.py), far past its 128-token window
  (rotary positions have no table to run out of), two prompts of tiny Shakespeare: the logits = GPTlite_RoPE's
  own forward on the whole prompt, the keys and values handed to decoding (gathered from the shards) = its
  cache, and greedy decoding from them gives its tokens. Its weights are random, N(0, 0.5) (peaked attention:
  an error shows); no checkpoint is loaded or trained, so --untrained changes nothing here.
Nothing is timed or written unless they hold.

Then the benchmark: attention alone (the part that needs the other ranks; the rest is per token), one
sequence of random Q, K, V with the preset's heads (cpu: 4 heads of 32), causal, at --seq-lens: 8k, 16k and
32k tokens by default on CPU, about 4 minutes on 2 cores (the issue's 64k: --seq-lens 8192 16384 32768 65536,
about 4x the time of 32k, a quarter of an hour more there). Round-robin, a warm-up round, the median of
--repeats:
- 1 rank x P*T threads: the same fused kernel on the whole sequence (equal CPU: the base of the ratios),
  and 1 rank x T threads;
- ring, zigzag, ulysses: P ranks x T threads (T = --threads).
Per row: time (the slowest rank, from a common barrier), per-rank peak memory (the 1/P claim), bytes each rank
sends, the share of time blocked in communication, the per-rank work (blocks computed; query-key pairs and
kernel seconds, max over mean), and whether the method passed its checks.
"""
import functools
import os

import torch
import torch.distributed as dist
from tqdm import tqdm

import inference_utils as iu
from gptlite import scaled_dot_product_attention
from gptlite_kvcache import decode_n_tokens, generate_kvcache
from gptlite_rope import GPTlite_RoPE
from gptlite_sp import (Layout, Work, attend_block, check_ulysses_size, gather_sequence, ring_attention, sp_prefill,
                        ulysses_attention)
from gptlite_tp import CommStats
from lib import corpus, distributed, harness

ATOL = 1e-5  # float32 attention outputs: the same sums in blocks, merged in another order (measured: < 1e-6)
MODEL_ATOL = 1e-4  # float32 logits and cached keys/values after layers of those outputs (measured: 2e-5)
METHODS = {"ring": (ring_attention, False), "zigzag": (ring_attention, True), "ulysses": (ulysses_attention, False)}
N_DECODE = 8  # greedy tokens decoded from the gathered cache


def method(name, seq_len, rank, world, comm=None, work=None):
    """(layout, attention(q, k, v) on this rank's shards) of a method for a sequence of seq_len."""
    fn, zigzag = METHODS[name]
    layout = Layout(seq_len, world, zigzag)
    return layout, lambda q, k, v: fn(q, k, v, layout, rank, comm, work)


def rotary_model(preset, device, seed):
    """The rotary GPTlite of the preset with every weight drawn from N(0, 0.5) (`seed`): logits of ten units and
    peaked attention, so a wrong block, position or merge shows far above the tolerance (GPTlite's N(0, 0.02)
    init gives near-uniform attention, which hides them). No checkpoint: the check is of the arithmetic."""
    torch.manual_seed(seed)
    model = GPTlite_RoPE(**preset.gptlite_kwargs()).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model.to(device)


def check_lengths(check_len, world):
    """A multiple of 2P, at least 4P (even shards, zigzag too), and one token less (uneven: P does not divide
    it)."""
    even = max(-(-check_len // (2 * world)), 2) * 2 * world
    return even, even - 1


def random_qkv(seq_len, preset, device, seed):
    """One sequence of random queries, keys and values with the preset's heads: 3 x [1, H, S, D], the same on
    every rank (drawn on the CPU from a seeded generator)."""
    qkv = torch.randn(3, 1, preset.n_heads, seq_len, preset.d_head, generator=torch.Generator().manual_seed(seed))
    return qkv.to(device).unbind(0)


@torch.inference_mode()
def attention_diffs(seq_len, preset, d, seed):
    """{name: max |output - explicit attention|} on this rank's tokens, and the one-process kernel's."""
    q, k, v = random_qkv(seq_len, preset, d.device, seed)
    expected = scaled_dot_product_attention(q, k, v)  # [1, H, S, D], the whole sequence
    diffs = {"1 rank": (attend_block(q, k, v, causal=True)[0] - expected).abs().max().item()}
    for name in METHODS:
        layout, attention = method(name, seq_len, d.rank, d.world_size)
        out = attention(*(layout.shard(x, d.rank) for x in (q, k, v)))
        diffs[name] = (out - layout.shard(expected, d.rank)).abs().max().item()
    return diffs


@torch.inference_mode()
def prefill_diffs(rope, prompts, d):
    """{name: (max |logits diff|, max |cache diff|, tokens differ)} of each method's prefill of `prompts`
    [B, S] against GPTlite_RoPE's own forward (a window of S + N_DECODE, the same weights), the cache gathered
    from the shards and greedy decoding continued from it."""
    seq_len = prompts.shape[1]
    ref = GPTlite_RoPE(**dict(rope.config.to_dict(), seqlen=seq_len + N_DECODE)).to(d.device).eval()
    ref.load_state_dict(rope.state_dict())
    logits, cache = ref(prompts)  # [B, S, vocab]; per layer (keys, values) [B, H, S, D]
    tokens = generate_kvcache(ref, prompts, N_DECODE, ref.seqlen)[:, seq_len:]
    diffs = {}
    for name in METHODS:
        layout, attention = method(name, seq_len, d.rank, d.world_size)
        sp_logits, sp_cache = sp_prefill(rope, layout.shard(prompts, d.rank, dim=1), layout, d.rank, attention)
        handed = [tuple(gather_sequence(x, layout, d.rank) for x in kv) for kv in sp_cache]  # [B, H, S, D] each
        first = gather_sequence(sp_logits, layout, d.rank, dim=1)[:, -1:].argmax(dim=-1)  # [B, 1]
        rest, _ = decode_n_tokens(ref, first, handed, N_DECODE - 1, ref.seqlen)
        diffs[name] = ((sp_logits - layout.shard(logits, d.rank, dim=1)).abs().max().item(),
                       max((a - b).abs().max().item() for kv, ref_kv in zip(handed, cache) for a, b in zip(kv, ref_kv)),
                       not torch.equal(torch.cat([first, *rest], dim=1), tokens))
    return diffs


def checks(rope, data, preset, d, check_len, seed):
    """({check line: ok}, {variant: every check of it passed}), the worst figures over the ranks, on every rank."""
    results, exact = {}, {name: True for name in ("1 rank", *METHODS)}
    for seq_len in check_lengths(check_len, d.world_size):
        attn = attention_diffs(seq_len, preset, d, seed)
        model = prefill_diffs(rope, corpus.sample_prompts(data, 2, seq_len, seed=seed, device=d.device), d)
        worst = torch.tensor([attn["1 rank"]] + [x for name in METHODS for x in (attn[name], *model[name])])
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        exact["1 rank"] &= bool(worst[0] <= ATOL)
        results[f"{seq_len} tokens: 1-rank kernel = explicit attention: max |diff| {worst[0]:.1e} (atol {ATOL:g})"] = (
            worst[0] <= ATOL)
        for name, (out, logits, kv, differ) in zip(METHODS, worst[1:].view(-1, 4).tolist()):
            ok = out <= ATOL and logits <= MODEL_ATOL and kv <= MODEL_ATOL and differ == 0
            exact[name] &= ok
            results[f"{seq_len} tokens, {name}: attention max |diff| {out:.1e} (atol {ATOL:g}); rotary prefill "
                    f"logits {logits:.1e}, K/V handed to decode {kv:.1e} (atol {MODEL_ATOL:g}), greedy tokens from "
                    f"them identical: {'yes' if differ == 0 else 'NO'}"] = ok
    return results, exact


def measure(preset, d, args):
    """Round-robin at each length (iu.time_round_robin, a warm-up round first) of the one-process kernel and
    the methods, then each one's peak memory. Every rank starts each variant together (the others wait in
    a barrier). Returns the variants' names, the figures of every rank [P, variant, length, repeat, 6]
    (seconds, comm seconds, bytes sent, pairs, kernel seconds, blocks) and the peak MiB [P, variant, length]."""
    P, T = d.world_size, args.threads
    singles = [P * T, T][:1 + (P > 1)]  # one process with the ranks' threads together (equal CPU), and with one rank's
    names = [f"1 rank x {t} thread{'s' * (t > 1)}" for t in singles] + list(METHODS)
    figures = torch.zeros(len(names), len(args.seq_lens), args.repeats + 1, 6, dtype=torch.float64)
    peaks = torch.zeros(len(names), len(args.seq_lens), dtype=torch.float64)
    bar = tqdm(total=len(args.seq_lens) * len(names) * (args.repeats + 2), desc="rounds", disable=d.rank != 0,
               dynamic_ncols=True)
    for j, seq_len in enumerate(args.seq_lens):
        q, k, v = random_qkv(seq_len, preset, d.device, args.seed)
        comms, works = [CommStats() for _ in names], [Work() for _ in names]
        variants = [(1, t, (q, k, v), lambda q, k, v, w=works[i]: w.attend(q, k, v, causal=True))
                    for i, t in enumerate(singles)]
        for i, name in enumerate(METHODS, start=len(singles)):
            layout, attention = method(name, seq_len, d.rank, P, comms[i], works[i])
            variants.append((P, T, tuple(layout.shard(x, d.rank) for x in (q, k, v)), attention))
        runs = [0] * len(names)

        def run(i, ranks, threads, inputs, attention):
            dist.barrier()
            if d.rank < ranks:
                torch.set_num_threads(threads)
                comms[i].reset()
                works[i].reset()
                with iu.Timer(d.device) as t:
                    attention(*inputs)
                figures[i, j, runs[i]] = torch.tensor([t.seconds, comms[i].seconds, comms[i].nbytes, works[i].pairs,
                                                       works[i].seconds, works[i].blocks], dtype=torch.float64)
            runs[i] += 1
            bar.update()
        with torch.inference_mode():
            iu.time_round_robin({i: functools.partial(run, i, *v) for i, v in enumerate(variants)}, d.device,
                                warmup=1, repeats=args.repeats)
            for i, (ranks, threads, inputs, attention) in enumerate(variants):
                dist.barrier()
                if d.rank < ranks:  # the shards it holds, and what the call allocates above them
                    torch.set_num_threads(threads)
                    held = sum(x.nbytes for x in inputs) / 2**20
                    peaks[i, j] = held + iu.peak_memory_mb(lambda: attention(*inputs), d.device)
                bar.update()
    bar.close()
    everything = torch.cat([figures[:, :, 1:].flatten(), peaks.flatten()]).to(d.device)
    gathered = [torch.empty_like(everything) for _ in range(P)]
    dist.all_gather(gathered, everything)
    gathered = torch.stack(gathered).cpu()  # [P, ...]
    split = figures[:, :, 1:].numel()
    return names, gathered[:, :split].view(P, *figures[:, :, 1:].shape), gathered[:, split:].view(P, *peaks.shape)


def make_rows(names, figures, peaks, seq_lens, exact, threads):
    """One row per length and variant from every rank's figures (`measure`); the first variant, one process with
    every rank's threads, is the base of speedup and mem_vs_1_rank."""
    world, rows = figures.shape[0], []
    for j, seq_len in enumerate(seq_lens):
        for i, name in enumerate(names):
            split = name in METHODS
            f = figures[:world if split else 1, i, j]  # [ranks, repeats, 6]
            seconds = iu.median(f[..., 0].max(dim=0).values.tolist())  # the slowest rank of each round
            peak = peaks[:world if split else 1, i, j].max().item()
            if i == 0:  # the one process with every rank's threads
                base_seconds, base_peak = seconds, peak
            pairs, kernel = f[:, -1, 3], f[..., 4]  # pairs: the same every round
            rows.append(harness.make_row(
                name, seq_len=seq_len, ranks=world if split else 1, threads=world * threads if i == 0 else threads,
                time_ms=round(seconds * 1e3, 1), speedup=round(base_seconds / seconds, 2), peak_mem_mb=peak,
                mem_vs_1_rank=round(peak / base_peak, 2),
                sent_MB=round(f[:, -1, 2].max().item() / 2**20, 2) if split else None,
                comm_pct=round(100 * max(iu.median((r[:, 1] / r[:, 0]).tolist()) for r in f), 1) if split else None,
                blocks="/".join(str(int(b)) for b in f[:, -1, 5].tolist()) if split else None,
                work_imbalance=round((pairs.max() / pairs.mean()).item(), 2) if split else None,
                time_imbalance=round(iu.median((kernel.max(dim=0).values / kernel.mean(dim=0)).tolist()), 2)
                if split and kernel.all() else None,  # none on CUDA: Work times the kernel on CPU only
                exact="yes" if exact[name if split else "1 rank"] else "no"))
    return rows


def plot_results(rows, preset, device, backend):
    fig, (ax_time, ax_mem) = harness.new_figure(2)
    for name in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == name]
        ax_time.plot([r["seq_len"] for r in mine], [r["time_ms"] for r in mine], marker="o", label=name)
        ax_mem.plot([r["seq_len"] for r in mine], [r["peak_mem_mb"] for r in mine], marker="o", label=name)
    lens = sorted({r["seq_len"] for r in rows})
    for ax, ylabel in ((ax_time, "attention time, ms (slowest rank)"), (ax_mem, "peak memory per rank, MB")):
        ax.set(xscale="log", yscale="log", xlabel="prompt length, tokens", ylabel=ylabel)
        ax.set_xticks(lens, [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in lens])
        ax.set_xticks([], minor=True)  # the log axis' own ticks would overlap the lengths
        ax.legend(fontsize=8)
    fig.suptitle(f"sequence-parallel causal attention, {rows[-1]['ranks']} {backend} ranks, {preset.n_heads} heads "
                 f"of {preset.d_head} ({device})")
    return fig


def headline(rows, world, backend):
    technique = f"sequence parallelism (ring, zigzag, Ulysses), {world} {backend} ranks"
    if world == 1:
        return dict(technique=technique, figure="one process: launch P ranks with --ranks P to compare")
    longest = max(r["seq_len"] for r in rows)
    by = {r["variant"]: r for r in rows if r["seq_len"] == longest}
    base = rows[0]["variant"]
    ring, zigzag, ulysses = by["ring"], by["zigzag"], by["ulysses"]
    return dict(technique=technique,
                figure=f"causal attention of {longest} tokens against {base}: ring {ring['speedup']:.2f}x, zigzag "
                       f"{zigzag['speedup']:.2f}x, Ulysses {ulysses['speedup']:.2f}x (above 1: faster); per-rank peak "
                       f"memory {zigzag['mem_vs_1_rank']:.2f}x (zigzag); work max/mean: ring "
                       f"{ring['work_imbalance']:.2f}, zigzag {zigzag['work_imbalance']:.2f}; outputs = one process")


def parse_args(argv):
    """The flags, checked before any work: (args, preset, device, data); args.world: the number of ranks."""
    parser = distributed.script_parser(__doc__, 2, "main_sequence_parallel.py")
    add = parser.add_argument
    add("--seq-lens", type=harness.int_at_least(1), nargs="+", default=[8192, 16384, 32768],
        help="prompt lengths of the attention benchmark (tokens)")
    add("--check-len", type=harness.int_at_least(1), default=1000,
        help="prompt length of the checks (rounded up to a multiple of 2P, at least 4P; and one token less)")
    add("--repeats", type=harness.repeats, default=3, help="timed rounds, median taken (after a warm-up)")
    args = distributed.parse_ranks(parser, argv, 2)
    world = args.world
    args.seq_lens = sorted(set(args.seq_lens))

    def check_args(preset):
        try:
            check_ulysses_size(preset.n_heads, world)
            for seq_len in args.seq_lens:
                Layout(seq_len, world, zigzag=True)
        except ValueError as e:
            parser.error(f"--ranks {world} / --seq-lens: {e}")
        distributed.check_ranks(parser, args)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        per_token = 4 * preset.n_heads * preset.d_head * 4  # float32 Q, K, V and the output
        harness.check_fits(parser, "--seq-lens", 3 * local * per_token * max(args.seq_lens),  # inputs, shards, buffers
                           f"attention over {max(args.seq_lens)} tokens on {local} process(es)")
        n = check_lengths(args.check_len, world)[0]
        harness.check_fits(parser, "--check-len", local * 3 * 2 * preset.n_heads * n * n * 4,  # explicit [2, H, n, n]
                           f"the explicit reference attention over {n} tokens on {local} process(es)")
    return (args, *distributed.setup(args, parser, check_args))


def main(argv=None):  # every flag checked first, then torchrun starts the ranks, each running experiment
    return distributed.run_ranks(__file__, argv, parse_args, experiment, "lower --seq-lens or --check-len")


def experiment(args, preset, d, data):
    results, exact = checks(rotary_model(preset, d.device, args.seed), data, preset, d, args.check_len, args.seed)
    harness.require_checks(results)  # on every rank: nothing timed or written
    names, figures, peaks = measure(preset, d, args)
    if d.rank != 0:
        return
    rows = make_rows(names, figures, peaks, args.seq_lens, exact, args.threads)
    P = d.world_size
    print(f"\n{P} rank(s), backend {d.backend}; causal attention alone, one sequence of random Q, K, V of "
          f"{preset.n_heads} heads of {preset.d_head} (float32) at {', '.join(map(str, args.seq_lens))} tokens; median "
          f"of {args.repeats} rounds after a warm-up, round-robin")
    summary = list(results) + [
        f"benchmark: causal attention alone (what needs the other ranks; the rest of a layer is per token), random "
        f"Q, K, V of the preset's heads at {args.seq_lens[0]} to {args.seq_lens[-1]} tokens; a whole model's prefill "
        "is checked above, not timed",
        f"time_ms: from a common barrier to the slowest rank's end; speedup: against {names[0]} (equal CPU) at the "
        "same length; peak_mem_mb: a rank's Q, K, V shards plus the peak tensor memory the call allocates above them "
        "(the largest rank; " + iu.peak_memory_label(d.device).split(": ", 1)[1] + "); mem_vs_1_rank: against the one "
        "process; sent_MB: bytes a rank sends to the others (ring: P-1 key/value blocks; Ulysses: the all-to-alls' "
        "share for other ranks); comm_pct: the share of a rank's time blocked in communication (ring: waiting for the "
        "next block, the rest overlaps; Ulysses: inside the all-to-alls), the largest rank's",
        "blocks: attention blocks each rank computes (rank 0/1/...; a block of keys entirely in the future is "
        "skipped); work_imbalance: query-key pairs attended, max over mean of the ranks (1.00: balanced); "
        "time_imbalance: the same for the seconds inside the attention kernel; exact: the variant passed every check"]
    distributed.report(args, "main_sequence_parallel.py", preset, d, rows, headline(rows, P, d.backend), summary,
                       lambda: plot_results(rows, preset, d.device, d.backend),
                       checks={line: bool(ok) for line, ok in results.items()})


if __name__ == "__main__":
    harness.run(main)
