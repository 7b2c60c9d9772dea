"""GQA and MQA: convert the trained multi-head model to fewer key/value heads, uptrain, measure.

    python main_gqa.py                                      # cpu preset on CPU, gptlite on CUDA
    python main_gqa.py --uptrain-steps 100 --batch-size 128 --json gqa.json --plot gqa.png
    python main_gqa.py --untrained --uptrain-steps 2        # random weights, a quick smoke run

Blog section: "Smaller KV caches: MQA, GQA and MLA". For every group count that divides the
number of heads (n_heads groups: MHA, 1 group: MQA, GQA in between) the script converts the trained
multi-head checkpoint by mean pooling the key and value heads of each group, measures the validation
loss, uptrains the converted model with the same short budget (about 5% of the checkpoint's training
steps; MHA gets it too, as the control), and measures again. It then times greedy generation with the
KV cache at a large batch, where the cache's reads dominate a decoding step, on each decode path of
--paths: `eager` (PyTorch operators) and `fast` (lib/fast_decode.py, one C++ call per step, CPU only),
where the step's time is the bytes and FLOPs that fewer key/value heads save, not operator overhead.
A second table decodes at the post's gptlite shape (random weights and a random cache of --shape-context
entries: time only) at --shape-batch, where the multi-head cache is ten times the weights and larger than
the last-level cache: TPOT against the bytes a step reads, beside the machine's read bandwidth.

Checks first: the conversion with n_groups == n_heads gives exactly the multi-head model's logits and
tokens, and every variant's cached decoding gives the logits of its full forward pass. Nothing is
written unless every check passes. With --save PATH the uptrained GQA model (config with n_groups) is
kept: load it with lib.variant_checkpoints.load_gqa(PATH).
"""
import math

import torch

import inference_utils as iu
from gptlite import GPTlite, generate
from gptlite_gqa import convert_mha_to_gqa  # noqa: F401 (the post's listing: main_gqa.convert_mha_to_gqa)
from gptlite_gqa import gqa_from_mha, group_counts, variant_name
from gptlite_kvcache import generate_kvcache
from lib import attention_summary, corpus, fast_decode, files, harness, memory_bound, training
from lib.presets import PRESETS


@torch.inference_mode()
def mha_conversion_is_exact(base, mha, window, prompts, n_tokens, seqlen):
    """n_groups == n_heads: the same logits and greedy tokens as the multi-head model, bit for bit."""
    same_logits = torch.equal(mha(window)[0], base(window))
    n_fit = min(n_tokens, seqlen - prompts.shape[1] + 1)  # tokens without a cache are exact within the window
    same_tokens = torch.equal(generate_kvcache(mha, prompts, n_fit, seqlen), generate(base, prompts, n_fit, seqlen))
    return same_logits and same_tokens


def convert_and_uptrain(base, data, preset, window, prompts, n_tokens, steps, lr, seed, device):
    """Every group count, MHA first: convert, check, uptrain. Returns {name: model}, the rows, the checks."""
    models, rows, checks = {}, [], {}
    for n_groups in group_counts(preset.n_heads):
        name = variant_name(n_groups, preset.n_heads)
        model = models[name] = gqa_from_mha(base.state_dict(), base.config.to_dict(), n_groups).to(device).eval()
        checks[name] = training.cached_matches_full(model, window[:8])  # correctness first
        if n_groups == preset.n_heads:
            checks["MHA conversion exact"] = mha_conversion_is_exact(base, model, window[:8], prompts[:8],
                                                                     n_tokens, preset.seqlen)
        with torch.inference_mode():
            kv_mb = iu.kv_cache_bytes(model(window)[1]) / 2**20
        before, after = training.uptrain(model, data, preset, steps, lr, seed, name)
        mha = rows[0] if rows else dict(kv_cache_mb=kv_mb, val_loss=after)  # MHA comes first: the reference
        rows.append(harness.make_row(name, n_groups=n_groups, batch_size=window.shape[0], kv_cache_mb=kv_mb,
                                val_loss=after, loss_converted=round(before, 4),
                                kv_vs_mha=round(kv_mb / mha["kv_cache_mb"], 4),
                                loss_vs_mha=round(after - mha["val_loss"], 4),
                                cached_ok="yes" if checks[name] else "NO"))
    return models, rows, checks


def on_first_path(rows):
    """The rows of the first decode path: one per variant (the loss columns are the same on every path)."""
    return [r for r in rows if r["path"] == rows[0]["path"]]


def plot_results(rows, shape_table, bandwidth, llc, preset, device):
    fig, (ax_loss, ax_time, ax_bytes) = harness.new_figure(3)
    memory_bound.plot_step_rows(ax_bytes, shape_table, bandwidth, llc)
    first = on_first_path(rows)
    kv = [r["kv_cache_mb"] for r in first]
    ax_loss.plot(kv, [r["loss_converted"] for r in first], marker="o", linestyle="--", label="converted")
    ax_loss.plot(kv, [r["val_loss"] for r in first], marker="o", label="uptrained")
    for r in first:
        ax_loss.annotate(r["variant"], (r["kv_cache_mb"], r["val_loss"]))
    for path in dict.fromkeys(r["path"] for r in rows):
        mine = [r for r in rows if r["path"] == path]
        ax_time.plot(kv, [math.nan if r["tpot_ms"] is None else r["tpot_ms"] for r in mine], marker="o",
                     label=f"{path} path")
        for r in mine:
            if r["tpot_ms"] is not None:  # None: timing noise left no time per token to show
                ax_time.annotate(r["variant"], (r["kv_cache_mb"], r["tpot_ms"]))
    ax_time.legend()
    ax_loss.set(xlabel="KV cache at a full window (MB)", ylabel="validation loss (nats/char)",
                title=f"GQA conversion (preset {preset.name})")
    ax_loss.legend()
    ax_time.set(xlabel="KV cache at a full window (MB)", ylabel="TPOT (ms)", ylim=(0, None),
                title=f"greedy decoding, batch {rows[0]['batch_size']} ({device})")
    return fig


def parse_args(argv):
    """The flags, checked before any work: (args, preset, device, data)."""
    parser = harness.script_parser(__doc__)
    add = parser.add_argument
    add("--uptrain-steps", type=harness.steps, default=None,
        help="training steps after conversion, for every variant (default: 5%% of the preset's)")
    add("--lr", type=harness.learning_rate, default=None, help="peak learning rate of uptraining (default: preset's / 3)")
    harness.add_generation_flags(parser, batch_size=64, prompt_len=32, n_tokens=64, repeats=3)
    add("--save", default=None, metavar="PATH",
        help="also save the uptrained GQA model there (default: not saved); load it with lib.variant_checkpoints.load_gqa")
    add("--save-groups", type=harness.int_at_least(1), default=None,
        help="group count of the saved model (default: the smallest above 1 that is not MHA)")
    harness.add_paths_flag(parser)
    memory_bound.add_shape_flags(parser)
    args = parser.parse_args(argv)

    def check_args(preset):
        if args.save_groups is not None and args.save_groups not in group_counts(preset.n_heads):
            parser.error(f"--save-groups must divide n_heads={preset.n_heads}: one of {group_counts(preset.n_heads)}")
        harness.check_generation_sizes(parser, preset, args.batch_size, args.prompt_len, args.n_tokens)
        if args.shape_batch:
            harness.check_fits(parser, "--shape-batch", 2 * shape_cache_bytes(args.shape_batch, args.shape_context
                                                                              + args.shape_tokens),
                               f"the {SHAPE}-shape caches of {args.shape_batch} x {args.shape_context} tokens")
    return (args, *harness.setup(args, parser, check_args))


SHAPE = memory_bound.SHAPE  # the memory-bound shape: the post's model, 70 MB of float32 weights
SHAPE_ATOL = 1e-4  # fast path against eager logits at the shape (float32 sums in another order)


def shape_cache_bytes(batch_size, n_slots):
    """The float32 caches of every group count at the shape: keys and values of each layer."""
    c = PRESETS[SHAPE]
    return sum(batch_size * n_slots * c.n_layers * 2 * g * c.d_head * 4 for g in group_counts(c.n_heads))


def shape_models(context, n_tokens, seed):
    """{variant: model}: a random multi-head GPTlite of the shape converted to every group count, as the trained
    model is."""
    torch.manual_seed(seed)
    config = memory_bound.shape_config(context, n_tokens)
    mha = GPTlite(**config).eval()
    return {variant_name(g, config["n_heads"]): gqa_from_mha(mha.state_dict(), config, g).eval()
            for g in group_counts(config["n_heads"])}


def shape_setup(batch_size, context, n_tokens, seed):
    """The shape's models and their filled caches ({}, {} with batch_size 0: no such rows)."""
    if not batch_size:
        return {}, {}
    models = shape_models(context, n_tokens, seed)
    return models, {name: memory_bound.filled_cache(m, batch_size, context, n_tokens + 1, seed)
                    for name, m in models.items()}


def shape_measure(models, caches, batch_size, context, n_tokens, paths, repeats):
    """(rows, bandwidth GB/s, last-level cache bytes): every variant at the shape on each path, round-robin."""
    llc = memory_bound.last_level_cache_bytes()
    if not models:
        return [], None, llc
    bandwidth = memory_bound.read_bandwidth() if "fast" in paths else None
    views = {(name, path): fast_decode.on_path(m, path) for path in paths for name, m in models.items()}
    return memory_bound.step_rows(views, models, caches, batch_size, context, n_tokens, repeats, bandwidth, llc,
                                  reference="MHA"), bandwidth, llc


def shape_checks(models, caches, batch_size, context, paths):
    """{check: ok}: on each variant's full random cache, one step of the fast path gives eager's logits."""
    if "fast" not in paths:
        return {}
    checks = {}
    for name, model in models.items():
        eager = memory_bound.decode_steps(model, caches[name], context, batch_size)(1)
        fast = memory_bound.decode_steps(fast_decode.native_view(model), caches[name], context, batch_size)(1)
        diff = (fast - eager).abs().max().item()
        checks[f"{SHAPE} shape, {name}: fast path logits = eager's at context {context} (max |diff| {diff:.1e}, "
               f"atol {SHAPE_ATOL:g})"] = diff <= SHAPE_ATOL
    return checks


def decode_fns(models, prompts, seqlen, paths):
    """{(variant, path): generate(n)}: greedy decoding with the KV cache on each decode path."""
    generate_on = {"eager": generate_kvcache, "fast": fast_decode.generate_fast}
    return {(name, path): (lambda n, m=fast_decode.on_path(model, path), g=generate_on[path]: g(m, prompts, n, seqlen))
            for path in paths for name, model in models.items()}  # on_path: the weights packed once, here


def headline(rows, steps):
    """The README's one-glance row, from this run's rows."""
    first = on_first_path(rows)
    mha, others = first[0], first[1:]
    listed = lambda key, rows, fmt="{}": ", ".join(  # noqa: E731
        f"{r['variant']} {'-' if r[key] is None else fmt.format(r[key])}" for r in rows)
    tpot = "; ".join(f"{path} {listed('tpot_ms', [r for r in rows if r['path'] == path], '{:.2f}')} ms"
                     for path in dict.fromkeys(r["path"] for r in rows))
    return dict(technique=f"GQA and MQA, converted from MHA, {steps} uptraining steps",
                figure=f"KV cache / MHA's: {listed('kv_vs_mha', others)}; TPOT at batch {mha['batch_size']}: "
                       f"{tpot}; loss against MHA: {listed('loss_vs_mha', others, '{:+.4f}')}")


def attention_methods(rows, steps, seqlen):
    """The summary of attention methods' rows (lib/attention_summary.py): each grouped variant against MHA,
    timed on the first decode path."""
    rows = on_first_path(rows)
    mha = rows[0]
    return [attention_summary.method_row(
        r["variant"], False, f"val loss {r['loss_vs_mha']:+.4f} after uptraining ({r['loss_converted'] - mha['loss_converted']:+.4f} "
        "converted)", steps, f"{steps} uptraining steps after conversion", "KV cache",
        f"{1 / r['kv_vs_mha']:.0f}x smaller; TPOT at batch {r['batch_size']} {attention_summary.ms(r['tpot_ms'])} "
        f"against MHA's {attention_summary.ms(mha['tpot_ms'])}", f"any context (the cache shrinks at every length; measured at {seqlen} tokens)")
        for r in rows[1:]]


def main(argv=None):
    args, preset, device, data = parse_args(argv)
    steps, lr = training.uptrain_budget(preset, args.uptrain_steps, args.lr)
    counts = group_counts(preset.n_heads)
    save_groups = args.save_groups or next((g for g in reversed(counts) if 1 < g < preset.n_heads), 1)

    base = iu.load_model(GPTlite, preset, device, data, untrained=args.untrained, seed=args.seed)
    window = corpus.sample_prompts(data, args.batch_size, preset.seqlen, seed=args.seed, device=device)  # full windows
    prompts = window[:, :args.prompt_len]
    models, rows, checks = convert_and_uptrain(base, data, preset, window, prompts, args.n_tokens, steps, lr,
                                               args.seed, device)
    summary = ["val loss: after uptraining; loss_converted: right after conversion. " + iu.peak_memory_label(device),
               f"MHA conversion (n_groups = n_heads) equals the multi-head model: "
               f"{'yes, logits and tokens' if checks['MHA conversion exact'] else 'NO'}",
               "cached decoding equals the full forward pass for " + ", ".join(
                   f"{name}: {'yes' if ok else 'NO'}" for name, ok in checks.items() if name != "MHA conversion exact")]
    if "fast" in args.paths:  # the uptrained models on the C++ path: eager's tokens
        checks |= {f"{name}: fast path tokens = eager's": torch.equal(
            fast_decode.generate_fast(m, prompts[:8], args.n_tokens, preset.seqlen),
            generate_kvcache(m, prompts[:8], args.n_tokens, preset.seqlen)) for name, m in models.items()}
    shape, caches = shape_setup(args.shape_batch, args.shape_context, args.shape_tokens, args.seed)
    checks |= shape_checks(shape, caches, args.shape_batch, args.shape_context, args.paths)
    harness.require_checks(checks)  # before anything is timed or written

    timings = iu.generation_figures(decode_fns(models, prompts, preset.seqlen, args.paths), args.n_tokens,
                                    args.batch_size, device, args.repeats)
    rows = [{**row, "path": path, **timings[row["variant"], path]} for path in args.paths for row in rows]
    shape_table, bandwidth, llc = shape_measure(shape, caches, args.shape_batch, args.shape_context, args.shape_tokens,
                                                args.paths, args.repeats)
    print(f"\n{steps} uptraining steps per variant (lr {lr:g}, batch {preset.batch_size}); generation: batch "
          f"{args.batch_size}, prompts of {args.prompt_len}, {args.n_tokens} new tokens, median of {args.repeats} "
          f"runs; KV cache at a full window of {preset.seqlen} tokens")
    if args.save is not None:
        row = next(r for r in rows if r["n_groups"] == save_groups)
        training.save_and_reload(args.save, models[row["variant"]], models[row["variant"]].config.to_dict(),
                                 data.vocab, files.rebuild_command("main_gqa.py", argv, preset), preset=preset.name,
                                 converted_from="mha", uptrain_steps=steps, val_loss=row["val_loss"],
                                 untrained=args.untrained)
    harness.report(args, "main_gqa.py", preset, device, rows, headline(rows, steps), summary=summary,
                   attention_methods=attention_methods(rows, steps, preset.seqlen),
                   tables=[harness.table(memory_bound.shape_title(args.shape_batch, args.shape_context, "MHA"), shape_table)]
                   if shape_table else [],
                   plot=lambda: plot_results(rows, shape_table, bandwidth, llc, preset, device), uptrain_steps=steps,
                   lr=lr, checks=checks, saved=args.save, bandwidth_GB_per_s=bandwidth and round(bandwidth, 1),
                   last_level_cache_bytes=llc)


if __name__ == "__main__":
    harness.run(main)
