"""Offloading (ZeRO-Inference): the weights in a slow tier, streamed block by block, the next block prefetched.

    python main_offloading.py                               # cpu preset: the blocks streamed from a file on disk
    python main_offloading.py --batch-sizes 1 64 --json offload.json --plot offload.png
    python main_offloading.py --untrained --batch-sizes 1 4 --n-tokens 8 --repeats 1   # a quick smoke run

Blog section: "Scaling out: parallelism and offloading". When the weights do not fit in fast memory,
ZeRO-Inference keeps them in a slower tier (CPU memory for a GPU, or NVMe) and brings each layer in just
before it runs, the next layer's transfer overlapping this layer's compute (double buffering). Every
decoding step then reads every weight once, whatever the batch: slow at batch 1, where a step is mostly
transfer, but the same bytes serve every sequence of the batch, so throughput catches up as it grows.

The slow tier (lib/offload.py): on CUDA, pinned CPU memory, copied on a side stream; on CPU, a
memory-mapped safetensors file (checkpoints/<preset>_offload.safetensors, or --offload-file), each
block's pages dropped from the page cache once read, so that every step reads the disk (with
--keep-page-cache they stay, and reads come from memory). The embeddings and the head stay resident.
Variants: resident (every weight in memory); offload (2 buffers: block i+1 read while block i computes);
offload, no prefetch (1 buffer: read, then compute).

Checks first: the offload file is verified (size, header, config, the sha256 of its bytes, and that it
holds the loaded model's weights) before any decoding, and both offloaded variants' greedy tokens (KV
cache) equal the resident model's at every batch size. Nothing is timed or written unless they hold.
"""
import os
from pathlib import Path

import numpy as np
import torch

import inference_utils as iu
from gptlite_kvcache import GPTlite_KVCache, generate_kvcache
from lib import corpus, files, harness, offload, serving
from lib.errors import CheckpointError

VARIANTS = {"offload": True, "offload, no prefetch": False}  # name: prefetch


def parse_args(argv):
    """The flags, checked before any work: (args, preset, device, data)."""
    parser = harness.script_parser(__doc__)
    add = parser.add_argument
    add("--batch-sizes", type=harness.int_at_least(1), nargs="+", default=[1, 4, 16, 64],
        help="numbers of prompts decoded together, a row group each")
    harness.add_generation_flags(parser, prompt_len=32, n_tokens=32, repeats=5)
    add("--offload-file", default=None, metavar="PATH",
        help="the slow tier's safetensors file (default: checkpoints/<preset>_offload.safetensors); written "
             "from the model's weights when missing, refused when it holds anything else")
    add("--keep-page-cache", action="store_true",
        help="do not drop the file's pages after each block: reads then come from memory, not the disk")
    args = parser.parse_args(argv)

    def check_args(preset):
        if len(set(args.batch_sizes)) != len(args.batch_sizes):
            parser.error(f"--batch-sizes repeats a value: {args.batch_sizes}")
        # the default's folder (checkpoints/) is created with the file; a named path must have one
        out = Path(args.offload_file or default_offload_file(preset))
        if out.is_dir() or (args.offload_file and not out.resolve().parent.is_dir()):
            parser.error(f"--offload-file {out}: give a file path in a folder that exists")
        batch = max(args.batch_sizes)  # three models' caches and activations at the largest batch
        harness.check_fits(parser, "--batch-sizes", 3 * serving.forward_bytes(preset, batch),
                           f"a batch of {batch} through three models")
    return (args, *harness.setup(args, parser, check_args))


def default_offload_file(preset):
    return files.CHECKPOINT_DIR / f"{preset.name}_offload.safetensors"


def prepare_offload_file(resident, path, named):
    """Write the model's weights to `path` when no file is there; returns the sha256 of the weights the file
    must hold. A damaged file or one of another config is refused (OffloadFile); one that holds other
    weights is refused when --offload-file named it, and written again when it is the script's own
    default (the checkpoint was retrained, or --untrained / --seed changed the weights)."""
    sha = offload.weights_sha256(resident)
    hint = ("give a file this script wrote for this model, or a new path" if named else
            f"delete it (rm {path}) and run again: it is written from the model's weights")
    if path.exists():
        held = offload.OffloadFile(path, resident.config.to_dict(), hint=hint)
        other = held.sha256 != sha
        held.close()
        if not other:
            return sha, hint
        if named:
            raise CheckpointError(f"{path} holds the weights of another model than the one loaded; {hint}")
        print(f"{path} holds other weights than the loaded model's: writing it again")
    else:
        print(f"no offload file at {path}: writing the model's weights there (once)")
    offload.write_offload_file(resident, path)
    return sha, hint


def make_variants(resident, offloaded, prompts, seqlen):
    """{name: fn(n) -> tokens [B, P + n]}: greedy decoding with the KV cache, resident and offloaded."""
    def streamed(model, streamer):
        def run(n):
            tokens = generate_kvcache(model, prompts, n, seqlen)
            streamer.drain()  # the prefetch of the next pass's first block ends inside this call's time
            return tokens
        return run
    return {"resident": lambda n: generate_kvcache(resident, prompts, n, seqlen),
            **{name: streamed(model, streamer) for name, (model, streamer) in offloaded.items()}}


def check_tokens(fns, n_tokens, batch_size):
    """Correctness first: {check name: the variant's greedy tokens equal the resident model's}."""
    tokens = {name: fn(n_tokens) for name, fn in fns.items()}
    return {f"{name} (batch {batch_size}): greedy tokens equal the resident model's":
            torch.equal(tokens[name], tokens["resident"]) for name in fns if name != "resident"}


def stream_figures(streamer, fn, n_tokens, batch_size, repeats):
    """Untimed runs of fn(n_tokens) with the streamer's counters: the bytes streamed per generated token
    (every sequence counted), the median share of transfer time the compute did not wait for, and the
    median MB/s the slow tier delivered during the reads."""
    runs = []
    for _ in range(repeats):
        streamer.reset_stats()
        fn(n_tokens)
        runs.append(streamer.stats())
    hidden = [r["hidden"] for r in runs if r["hidden"] is not None]
    return dict(streamed_KB_per_token=round(runs[0]["streamed_bytes"] / (batch_size * n_tokens) / 2**10, 1),
                hidden_pct=round(100 * iu.median(hidden), 1) if hidden else None,
                tier_MB_s=round(iu.median([r["streamed_bytes"] / max(r["transfer_s"], 1e-9) / 2**20 for r in runs])))


def file_rss_mb(model, streamer, prompts, seqlen):
    """Peak of the mapped file's pages resident in this process while decoding (CPU; sampled after each
    block's read, before its pages are dropped): 2 tokens, untimed. None on CUDA."""
    if not isinstance(streamer, offload.DiskStreamer):
        return None
    streamer.measure_rss, streamer.peak_file_rss = True, 0
    generate_kvcache(model, prompts, 2, seqlen)
    streamer.drain()
    streamer.measure_rss = False
    return streamer.peak_file_rss / 2**20


def measure_batch(batch_size, fns, offloaded, resident_mb, rss_mb, n_tokens, device, repeats):
    """One row per variant for a batch whose tokens were checked (check_tokens)."""
    timings = iu.compare_generation(fns, n_tokens, batch_size, device, warmup=1, repeats=repeats)
    rows = [harness.make_row("resident", batch_size=batch_size, **timings["resident"],
                             peak_weight_mb=round(resident_mb, 3),
                             file_rss_mb=None, streamed_KB_per_token=0.0, hidden_pct=None, tier_MB_s=None,
                             same_tokens="reference")]
    for name, (_, streamer) in offloaded.items():
        rows.append(harness.make_row(
            name, batch_size=batch_size, **timings[name],
            peak_weight_mb=round(streamer.weight_bytes() / 2**20 + (rss_mb[name] or 0.0), 3),
            file_rss_mb=None if rss_mb[name] is None else round(rss_mb[name], 3),
            **stream_figures(streamer, fns[name], n_tokens, batch_size, repeats), same_tokens="yes"))
    return rows


def cold_read_mb_s(path, repeats):
    """What the disk delivers reading the whole file in 1 MiB chunks after its pages are dropped (median)."""
    seconds = []
    with open(path, "rb", buffering=0) as f:
        for _ in range(repeats):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            f.seek(0)
            with iu.Timer() as reading:
                while f.read(2**20):
                    pass
            seconds.append(reading.seconds)
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return os.path.getsize(path) / iu.median(seconds) / 2**20


def headline(rows, tier):
    by = {(r["variant"], r["batch_size"]): r for r in rows}
    batches = sorted({r["batch_size"] for r in rows})
    ends = batches[:1] if len(batches) == 1 else [batches[0], batches[-1]]  # one batch size: named once

    def x(key):  # offload / resident at the smallest and largest batch, '-' where unmeasurable
        ratios = [(iu.ratio(by["offload", b][key], by["resident", b][key]), b) for b in ends]
        return ", ".join(f"{'-' if value is None else f'{value:.2f}x'} at batch {b}" for value, b in ratios)
    hidden = by["offload", ends[0]]["hidden_pct"]
    unmeasured = any(by[v, b]["tpot_ms"] is None for v in ("offload", "resident") for b in ends)
    why = ("; TPOT '-': the decode time was within the timing noise, raise --n-tokens or --repeats"
           if unmeasured else "")
    return dict(technique=f"offloading (ZeRO-Inference), blocks streamed from {tier}, next block prefetched",
                figure=f"TPOT offload / resident: {x('tpot_ms')}; throughput: {x('tokens_per_s')}; the prefetch "
                       f"hides {'-' if hidden is None else f'{hidden:.0f}%'} of the transfer at batch {ends[0]}; "
                       f"the same tokens{why}")


def plot_results(rows, preset, device, tier):
    fig, (ax_tpot, ax_tput) = harness.new_figure(2)
    resident = {r["batch_size"]: r["tokens_per_s"] for r in rows if r["variant"] == "resident"}
    for name in ["resident", *VARIANTS]:
        mine = [r for r in rows if r["variant"] == name]
        batches = [r["batch_size"] for r in mine]
        ax_tpot.plot(batches, [np.nan if r["tpot_ms"] is None else r["tpot_ms"] for r in mine], marker="o", label=name)
        ax_tput.plot(batches, [r["tokens_per_s"] for r in mine], marker="o", label=name)
        if name == "offload":  # how far behind the resident model: the post's "catching up"
            for r in mine:
                ax_tput.annotate(f"{r['tokens_per_s'] / resident[r['batch_size']]:.2f}x",
                                 (r["batch_size"], r["tokens_per_s"]), textcoords="offset points", xytext=(4, -12))
    ax_tpot.set(ylim=(0, None), ylabel="TPOT (ms)", title=f"latency per step (preset {preset.name}, {device})")
    ax_tput.set(yscale="log", ylabel="tokens/s (every sequence); offload / resident marked",
                title=f"throughput, the blocks streamed from {tier}")
    for ax in (ax_tpot, ax_tput):
        ax.set(xscale="log", xlabel="batch size", xticks=sorted(resident), xticklabels=sorted(resident))
        ax.legend()
    return fig


def main(argv=None):
    args, preset, device, data = parse_args(argv)
    resident = iu.load_model(GPTlite_KVCache, preset, device, data, untrained=args.untrained, seed=args.seed)
    path = Path(args.offload_file or default_offload_file(preset))
    sha, hint = prepare_offload_file(resident, path, named=args.offload_file is not None)
    offloaded = {name: offload.offloaded_model(path, resident.config.to_dict(), device, prefetch, sha256=sha,
                                               drop_page_cache=not args.keep_page_cache, hint=hint)
                 for name, prefetch in VARIANTS.items()}
    try:
        batches, checks = {}, {}
        for batch_size in args.batch_sizes:  # correctness first, every batch, before anything is timed
            prompts = corpus.sample_prompts(data, batch_size, args.prompt_len, seed=args.seed, device=device)
            batches[batch_size] = make_variants(resident, offloaded, prompts, preset.seqlen)
            checks |= check_tokens(batches[batch_size], args.n_tokens, batch_size)
        harness.require_checks(checks)

        rss = {name: file_rss_mb(*offloaded[name], prompts, preset.seqlen) for name in offloaded}
        rows = [row for batch_size, fns in batches.items() for row in measure_batch(
            batch_size, fns, offloaded, iu.model_size_mb(resident), rss, args.n_tokens, device, args.repeats)]
    finally:
        for _, streamer in offloaded.values():
            streamer.close()
    tier = "pinned CPU memory" if device.type == "cuda" else "a file on disk" + (
        " (page cache kept)" if args.keep_page_cache else "")
    disk = cold_read_mb_s(path, args.repeats)
    block_mb = offloaded["offload"][1].block_bytes / 2**20
    print(f"\nprompts of {args.prompt_len} tokens, {args.n_tokens} new tokens, median of {args.repeats} runs; "
          f"{path} ({os.path.getsize(path) / 2**20:.2f} MB), {preset.n_layers} blocks of {block_mb:.2f} MB")
    summary = [f"streamed: every forward pass reads the {preset.n_layers} blocks' weights "
               f"({preset.n_layers * block_mb:.2f} MB) once; the embeddings and head stay resident",
               "peak_weight_mb: weight tensors held (offload: resident part + buffers) + file_rss_mb, the peak of "
               "the mapped file's pages resident in the process",
               "hidden_pct: 1 - (time the compute waited for its block) / (time the reads took); tier_MB_s: "
               "bytes streamed / read time",
               f"the disk: a cold read of the whole file (page cache dropped) delivers {disk:.0f} MB/s"]
    harness.report(args, "main_offloading.py", preset, device, rows, headline(rows, tier), summary=summary,
                   plot=lambda: plot_results(rows, preset, device, tier), offload_file=str(path),
                   block_mb=block_mb, cold_read_MB_s=disk, tier=tier, checks=checks)


if __name__ == "__main__":
    harness.run(main)
