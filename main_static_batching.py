"""Static batching: a batch of requests runs until its longest request is done.

    python main_static_batching.py                         # cpu preset on CPU, gptlite on CUDA
    python main_static_batching.py --batch-sizes 1 4 8 16 --json static.json
    python main_static_batching.py --untrained --n-requests 8

Blog section: "Static batching". `next_tokens` runs one forward pass without a cache over
a right-padded batch of sequences of different lengths; each sequence reads the logits at its own
last position (the causal mask keeps the padding after it invisible). `static_batching` takes the
requests batch_size at a time in order; a request that finishes early keeps its slot (it is still
computed, its extra tokens are dropped: wasted slot-steps) until the longest one of its batch is done.

The script draws one offline trace (every request there at time 0, long-tailed prompt and output
lengths), checks that static batching returns, for every request, exactly the tokens of generating
it alone with `generate_kvcache`, and prints steps, wasted slot-steps, throughput and latency per
batch size. TTFT/TPOT come from the serving clock of serving.py (measured step times).
"""
from collections import deque

import torch
from torch.nn.utils.rnn import pad_sequence

import inference_utils as iu
from gptlite import GPTlite
from lib import harness, serving, training


@torch.inference_mode()
def next_tokens(model, sequences, seqlen):
    """The greedy next token of each sequence (a list of 1-D LongTensors): one padded forward, no cache.

    Returns a LongTensor [len(sequences)]."""
    if len(sequences) == 0:
        raise ValueError("no sequences: give a list of 1-D LongTensors of token ids")
    lengths = torch.tensor([len(s) for s in sequences], device=sequences[0].device)  # [B]
    if int(lengths.max()) > seqlen:
        raise ValueError(f"a sequence of {int(lengths.max())} tokens does not fit the window seqlen={seqlen}")
    batch = pad_sequence(sequences, batch_first=True, padding_value=0)  # [B, S], right padding
    logits = training.logits_of(model(batch))  # [B, S, vocab]
    last = logits[torch.arange(len(sequences), device=batch.device), lengths - 1]  # [B, vocab]
    return last.argmax(dim=-1)  # [B]


def static_batching(model, requests, batch_size, seqlen, clock=None):
    """Generate every request (prompt, n_tokens), batch_size requests at a time, in order.

    A batch starts when the previous one is done, with the requests that have arrived by then (`clock`:
    a serving.ServingClock; None: all there at time 0), and runs max(n_tokens) steps. Returns
    (outputs, n_steps): outputs[i] is request i's prompt followed by its n_tokens new tokens (1-D)."""
    requests = serving.check_requests(model, requests, batch_size, seqlen)
    clock = clock or serving.ServingClock.offline(requests, requests[0][0].device)
    sequences = [prompt for prompt, _ in requests]
    n_generated = [0] * len(requests)
    waiting, n_steps = deque(range(len(requests))), 0
    while waiting:
        clock.wait_for(waiting[0])  # an empty engine waits for the next request
        batch = []
        while waiting and len(batch) < batch_size and clock.arrived(waiting[0]):
            batch.append(waiting.popleft())
        for _ in range(max(requests[i][1] for i in batch)):
            with clock.step(rows=len(batch)):  # finished requests keep their slot: still computed
                tokens = next_tokens(model, [sequences[i] for i in batch], seqlen).tolist()
                kept = [i for i in batch if n_generated[i] < requests[i][1]]  # the others' tokens are dropped
                for i, token in zip(batch, tokens):
                    if i in kept:
                        sequences[i] = torch.cat([sequences[i], sequences[i].new_tensor([token])])
                        n_generated[i] += 1
            for i in kept:
                clock.token(i, n_generated[i])
            n_steps += 1
    return sequences, n_steps


def parse_args(argv):
    """The flags, checked before any work: (args, preset, device, data)."""
    parser = harness.script_parser(__doc__)
    serving.add_trace_args(parser, n_requests=64)  # offline: every request at time 0
    parser.add_argument("--batch-sizes", type=harness.int_at_least(1), nargs="+", default=[1, 8],
                        help="requests per static batch, a row each")
    args = parser.parse_args(argv)

    def check_args(preset):
        serving.check_trace_args(parser, preset.seqlen, args.prompt_median, args.output_median)
        if len(set(args.batch_sizes)) != len(args.batch_sizes):
            parser.error(f"--batch-sizes repeats a value: {args.batch_sizes}")
        batch = max(args.batch_sizes)  # a padded forward over the window, no cache
        harness.check_fits(parser, "--batch-sizes", serving.forward_bytes(preset, batch),
                           f"a batch of {batch} through the model")
        harness.check_fits(parser, "--n-requests", serving.trace_bytes(preset, args.n_requests, copies=3),
                           f"a trace of {args.n_requests} requests, their reference and outputs")

    return (args, *harness.setup(args, parser, check_args))


def serve(base, requests, batch_size, seqlen, reference, device):
    """One offline run of the trace: its latency figures and whether every request's tokens are right."""
    clock = serving.ServingClock.offline(requests, device)
    outputs, _ = static_batching(base, requests, batch_size, seqlen, clock)
    return serving.latency_figures(clock), serving.same_outputs(outputs, reference)


def headline(rows, n_requests):
    """The README's one-glance row, from this run's rows: throughput and waste per batch size."""
    return {"technique": f"static batching, {n_requests} requests at time 0, no KV cache",
            "figure": "; ".join(f"{row['variant'].removeprefix('static batching, ')}: "
                                f"{'-' if row['tokens_per_s'] is None else format(row['tokens_per_s'], '.0f')} tok/s, "
                                f"{row['wasted_slot_steps']} wasted slot-steps" for row in rows)}


def plot_waste(rows, batch_sizes, n_requests):
    fig, ax = harness.new_figure()
    ax.bar([str(b) for b in batch_sizes], [r["wasted_slot_steps"] for r in rows])
    ax.set(xlabel="batch size", ylabel="wasted slot-steps", title=f"static batching, {n_requests} requests")
    return fig


def main(argv=None):
    args, preset, device, data = parse_args(argv)
    base = iu.load_model(GPTlite, preset, device, data, untrained=args.untrained, seed=args.seed)
    seqlen = preset.seqlen
    requests, _ = serving.make_trace(data.val, args.n_requests, float("inf"), seqlen, args.prompt_median,
                                     args.output_median, seed=args.seed, device=device)
    reference = serving.reference_outputs(iu.kv_cache_model(base), requests, seqlen)
    checks = {f"static batching, batch {b}: every request's tokens equal generating it alone":  # also the warm-up
              serve(base, requests, b, seqlen, reference, device)[1] == "yes" for b in args.batch_sizes}
    harness.require_checks(checks)
    val_loss = training.validation_loss(base, data)

    runs = {batch_size: [] for batch_size in args.batch_sizes}
    iu.time_round_robin({b: lambda b=b: runs[b].append(serve(base, requests, b, seqlen, reference, device))
                         for b in args.batch_sizes}, device, warmup=0, repeats=args.repeats)  # each run: its clock
    peaks = {batch_size: iu.peak_memory_mb(lambda: static_batching(base, requests, batch_size, seqlen), device)  # noqa: B023
             for batch_size in args.batch_sizes}  # one more, untimed run each
    rows = [harness.make_row(f"static batching, batch {batch_size}", peak_mem_mb=peaks[batch_size],
                             **serving.median_figures([figures for figures, _ in batch_runs]),
                             same=next((same for _, same in batch_runs if same != "yes"), "yes"))
            for batch_size, batch_runs in runs.items()]
    harness.require_checks({f"{r['variant']}, timed runs: the same tokens": r["same"] == "yes" for r in rows})
    n_new = sum(n for _, n in requests)
    print(f"\n{len(requests)} requests at time 0, {n_new} new tokens in all, no KV cache (the post's next_tokens); "
          f"TTFT arrival: p50 (then p99) over requests, from their arrival; TPOT: p50 and p99 over requests; "
          f"tok/s: new tokens per second of steps; median of {args.repeats} runs; validation loss {val_loss:.4f}")
    harness.report(args, "main_static_batching.py", preset, device, rows, headline(rows, len(requests)),
                   summary=[iu.peak_memory_label(device)], plot=lambda: plot_waste(rows, args.batch_sizes, len(requests)),
                   val_loss=val_loss, n_requests=len(requests), n_new_tokens=n_new)


if __name__ == "__main__":
    harness.run(main)
