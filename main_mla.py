"""MLA: convert the trained multi-head model to multi-head latent attention, with and without absorption.

    python main_mla.py                                      # cpu preset on CPU, gptlite on CUDA
    python main_mla.py --latents 16 32 64 128 --json mla.json --plot mla.png
    python main_mla.py --untrained --uptrain-steps 1        # random weights, a quick smoke run

Blog section: "Smaller KV caches: MQA, GQA and MLA". Every block's [W_k; W_v] is factored by a truncated SVD
into a down-projection to a latent of d_latent values per token (the only thing cached) and the two
up-projections. For each latent size of the sweep the script measures the cache, the decoding speed
with absorbed projections (attention over the latents) and with recomputed keys and values, and the
validation loss right after conversion and after a short uptraining (the same budget as main_gqa.py;
MHA gets it too, as the control).

Checks first: absorbed attention equals recomputed keys and values; the full-rank latent
min(2 * n_heads * d_head, d_model) reproduces the multi-head model's logits; cached decoding equals
the full forward pass. The GQA/MQA points of the loss-against-cache chart (and of the JSON's gqa_points) are
made here in every run, by the GQA conversion and the same uptraining budget, so that both curves share one
run and --plot only draws.

A second table decodes at the post's gptlite shape (random weights and caches of --shape-context entries:
time only) at --shape-batch: MHA's keys and values against the latents of each size of the sweep (absorbed;
recomputing the keys and values of 1024 cached tokens at every step is a hundred times the FLOPs), TPOT
against the bytes a step reads, beside the machine's read bandwidth. Eager path only: the fast decode path
does not compute MLA.
"""

import torch

import inference_utils as iu
from gptlite import GPTlite
from gptlite_gqa import gqa_from_mha, group_counts, variant_name
from gptlite_kvcache import generate_kvcache
from gptlite_mla import (MultiHeadAttention_MLA,  # noqa: F401 (the post's listings, importable here)
                         convert_mha_to_mla, max_latent, mla_from_mha)
from lib import attention_summary, corpus, harness, memory_bound, training

FULL_RANK_ATOL = 1e-4  # float32 logits of the full-rank conversion against the multi-head model (SVD in float64)
ABSORB_ATOL = 1e-4  # float32 logits, absorbed against recomputed keys and values


def default_latents(full):
    return sorted({max(1, full // 4), max(1, full // 2), full})


@torch.inference_mode()
def max_logit_diff(model_a, model_b, window):
    return (training.logits_of(model_a(window)) - training.logits_of(model_b(window))).abs().max().item()


@torch.inference_mode()
def absorbed_against_recomputed(model, window):
    """Max |logit difference| of the same weights attending both ways."""
    absorbed = model.set_absorb(True)(window)[0]
    return (absorbed - model.set_absorb(False)(window)[0]).abs().max().item()


@torch.inference_mode()
def cache_figures(model, window):
    """The cache at a full window [B, S]: in MB, and in float values per token and layer."""
    kv_bytes = iu.kv_cache_bytes(model(window)[1])
    per_token = kv_bytes // (window.numel() * model.config.n_layers * model.fc_out.weight.element_size())
    return dict(kv_cache_mb=kv_bytes / 2**20, cache_per_token=per_token)


def convert_and_uptrain(base, data, preset, latents, window, prompts, steps, lr, seed, device):
    """MHA (the control), then every latent size: convert, check, uptrain. Returns the rows, the generation
    calls {name: fn(n)} (MLA twice: absorbed and recomputed) and the checks."""
    state, config, seqlen = base.state_dict(), base.config.to_dict(), preset.seqlen
    full = max_latent(preset.n_heads, preset.d_head, preset.d_model)
    checks, rows, fns = {}, [], {}
    mha = gqa_from_mha(state, config, preset.n_heads).to(device).eval()  # MHA, as a model with a cache
    checks["MHA cached = full"] = training.cached_matches_full(mha, window[:8])
    figures = cache_figures(mha, window)
    before, after = training.uptrain(mha, data, preset, steps, lr, seed, "MHA")
    rows.append(harness.make_row("MHA", d_latent=None, absorb=None, batch_size=prompts.shape[0], **figures,
                            val_loss=after, loss_converted=round(before, 4), kv_vs_mha=1.0, loss_vs_mha=0.0))
    fns["MHA"] = lambda n: generate_kvcache(mha, prompts, n, seqlen)

    diff = max_logit_diff(mla_from_mha(state, config, full).to(device).eval(), base, window[:8])  # swept or not
    checks[f"MLA-{full} (full rank) = MHA, max |logit diff| {diff:.1e}"] = diff <= FULL_RANK_ATOL
    for d_latent in latents:
        model = mla_from_mha(state, config, d_latent).to(device).eval()
        diff = absorbed_against_recomputed(model, window[:8])
        checks[f"MLA-{d_latent} absorbed = recomputed, max |logit diff| {diff:.1e}"] = diff <= ABSORB_ATOL
        checks[f"MLA-{d_latent} cached = full"] = training.cached_matches_full(model.set_absorb(True), window[:8])
        figures = cache_figures(model, window)
        model.set_absorb(False)  # train with explicit keys and values (exact with dropout, cheaper for long inputs)
        before, after = training.uptrain(model, data, preset, steps, lr, seed, f"MLA-{d_latent}")
        for absorb in (True, False):
            name = f"MLA-{d_latent} {'absorbed' if absorb else 'recomputed'}"
            fns[name] = lambda n, m=model, a=absorb: generate_kvcache(m.set_absorb(a), prompts, n, seqlen)
            rows.append(harness.make_row(name, d_latent=d_latent, absorb="yes" if absorb else "no",
                                    batch_size=prompts.shape[0], **figures, val_loss=after,
                                    loss_converted=round(before, 4),
                                    kv_vs_mha=round(figures["kv_cache_mb"] / rows[0]["kv_cache_mb"], 4),
                                    loss_vs_mha=round(after - rows[0]["val_loss"], 4)))
    return rows, fns, checks


def gqa_points(base, data, preset, window, steps, lr, seed, device):
    """The GQA and MQA points of the plot: converted and uptrained as main_gqa.py does, with the same budget."""
    points = []
    for n_groups in group_counts(preset.n_heads)[1:]:  # GQA and MQA; MHA is a row already
        name = variant_name(n_groups, preset.n_heads)
        model = gqa_from_mha(base.state_dict(), base.config.to_dict(), n_groups).to(device).eval()
        figures = cache_figures(model, window)
        before, after = training.uptrain(model, data, preset, steps, lr, seed, name)
        points.append(dict(variant=name, n_groups=n_groups, **figures, val_loss=after, loss_converted=before))
    return points


def plot_results(rows, gqa, shape_table, bandwidth, llc, preset, device):
    """Loss against cache size; beside it, with the gptlite-shape rows, TPOT against bytes read per step."""
    fig, (ax, ax_bytes) = harness.new_figure(2) if shape_table else (None, (None, None))
    if fig is None:
        fig, ax = harness.new_figure()
    else:
        memory_bound.plot_step_rows(ax_bytes, shape_table, bandwidth, llc)
    plot_loss_against_cache(ax, rows, gqa, preset, device)
    return fig


def plot_loss_against_cache(ax, rows, gqa, preset, device):
    mha = rows[0]
    mla = [r for r in rows if r.get("absorb") == "yes"]
    series = {"MLA (latent sizes)": [(r["cache_per_token"], r["val_loss"], r["loss_converted"], r["variant"])
                                     for r in mla + [mha]],
              "GQA / MQA (group counts)": [(p["cache_per_token"], p["val_loss"], p["loss_converted"], p["variant"])
                                           for p in gqa + [mha]]}
    for (label, points), color in zip(series.items(), ("C0", "C1")):
        points.sort()
        x = [p[0] for p in points]
        ax.plot(x, [p[1] for p in points], marker="o", color=color, label=f"{label}, uptrained")
        ax.plot(x, [p[2] for p in points], marker="x", linestyle="--", color=color, label=f"{label}, converted")
        for p in points[:-1]:  # the last point is MHA, in both series
            ax.annotate(p[3].replace(" absorbed", ""), (p[0], p[1]), fontsize=8)
    ax.annotate("MHA", (mha["cache_per_token"], mha["val_loss"]), fontsize=8)
    ticks = sorted({p[0] for points in series.values() for p in points})
    ax.set_xscale("log")
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set(xlabel="cache per token and layer (float values)", ylabel="validation loss (nats/char)",
           title=f"loss against cache size (preset {preset.name}, {device})")
    ax.legend(fontsize=8)


def parse_args(argv):
    """The flags, checked before any work: (args, preset, device, data)."""
    parser = harness.script_parser(__doc__)
    parser.add_argument("--latents", type=harness.int_at_least(1), nargs="+", default=None,
                        help="latent sizes d_latent of the sweep (default: the full rank, 1/2 and 1/4 of it)")
    add = parser.add_argument
    add("--uptrain-steps", type=harness.steps, default=None,
        help="training steps after conversion, for every variant (default: 5%% of the preset's)")
    add("--lr", type=harness.learning_rate, default=None, help="peak learning rate of uptraining (default: preset's / 3)")
    harness.add_generation_flags(parser, batch_size=64, prompt_len=32, n_tokens=64, repeats=3)
    memory_bound.add_shape_flags(parser)
    args = parser.parse_args(argv)

    def check_args(preset):
        full = max_latent(preset.n_heads, preset.d_head, preset.d_model)
        if args.latents is not None and max(args.latents) > full:
            parser.error(f"--latents must lie between 1 and the full rank min(2 * n_heads * d_head, d_model) = {full}")
        if args.latents is not None and len(set(args.latents)) != len(args.latents):
            parser.error(f"--latents repeats a value: {args.latents}")
        harness.check_generation_sizes(parser, preset, args.batch_size, args.prompt_len, args.n_tokens)
        shape = memory_bound.shape_config(args.shape_context, args.shape_tokens)
        full_at_shape = max_latent(shape["n_heads"], shape["d_head"], shape["d_model"])
        if args.shape_batch and args.latents is not None and max(args.latents) > full_at_shape:
            parser.error(f"--latents: the {memory_bound.SHAPE}-shape rows need latents of at most its full rank "
                         f"{full_at_shape}, or --shape-batch 0")
        values = 2 * shape["n_heads"] * shape["d_head"] + sum(args.latents or default_latents(full_at_shape))
        harness.check_fits(parser, "--shape-batch", 3 * args.shape_batch * (args.shape_context + args.shape_tokens)
                           * shape["n_layers"] * values * 4, f"the {memory_bound.SHAPE}-shape caches of "
                           f"{args.shape_batch} x {args.shape_context} tokens")
    return (args, *harness.setup(args, parser, check_args))


def shape_models(latents, context, n_tokens, seed):
    """{variant: model}: a random multi-head GPTlite of the shape with a cache (MHA), and its SVD conversions to
    each latent size (absorbed), as the trained model is converted."""
    torch.manual_seed(seed)
    config = memory_bound.shape_config(context, n_tokens)
    state = GPTlite(**config).state_dict()
    models = {"MHA": gqa_from_mha(state, config, config["n_heads"]).eval()}
    full = max_latent(config["n_heads"], config["d_head"], config["d_model"])
    return models | {f"MLA-{d} absorbed": mla_from_mha(state, config, d).set_absorb(True).eval()
                     for d in sorted(latents or default_latents(full), reverse=True)}


def headline(rows, gqa, steps):
    """The README's one-glance row, from this run's rows and GQA points."""
    mha, absorbed = rows[0], {r["d_latent"]: r for r in rows if r["absorb"] == "yes"}
    recomputed = {r["d_latent"]: r for r in rows if r["absorb"] == "no"}
    speed = [iu.ratio(recomputed[d]["tpot_ms"], r["tpot_ms"]) for d, r in absorbed.items()]
    speed = [s for s in speed if s is not None]
    figures = [f"MLA-{d} {r['loss_vs_mha']:+.4f} (cache {r['kv_vs_mha']})" for d, r in absorbed.items()]
    figures += [f"{p['variant']} {p['val_loss'] - mha['val_loss']:+.4f} ({p['cache_per_token']} values)" for p in gqa]
    return dict(technique=f"MLA, converted by SVD, {steps} uptraining steps",
                figure="loss against MHA: " + ", ".join(figures)
                       + (f"; TPOT recomputed / absorbed: {min(speed):.1f}x to {max(speed):.1f}x" if speed else ""))


GQA_COLUMNS = [("variant", "variant", "{}"), ("cache_per_token", "cache_per_token", "{}"),
               ("kv_cache_mb", "KV MB", "{:.3f}"), ("loss_converted", "loss_converted", "{:.4f}"),
               ("val_loss", "val loss", "{:.4f}")]


def attention_methods(rows, steps, full, seqlen):
    """The summary of attention methods' rows (lib/attention_summary.py): MLA absorbed, below full rank."""
    mha = rows[0]
    return [attention_summary.method_row(
        f"MLA (latent {r['d_latent']})", False, f"val loss {r['loss_vs_mha']:+.4f} after uptraining", steps,
        f"SVD conversion, {steps} uptraining steps", "KV cache",
        f"{1 / r['kv_vs_mha']:.0f}x smaller; TPOT at batch {r['batch_size']} {attention_summary.ms(r['tpot_ms'])} "
        f"against MHA's {attention_summary.ms(mha['tpot_ms'])} (absorbed)", f"any context (the cache shrinks at every length; measured at {seqlen} tokens)")
        for r in rows if r["absorb"] == "yes" and r["d_latent"] < full]


def main(argv=None):
    args, preset, device, data = parse_args(argv)
    steps, lr = training.uptrain_budget(preset, args.uptrain_steps, args.lr)
    full = max_latent(preset.n_heads, preset.d_head, preset.d_model)
    latents = sorted(args.latents or default_latents(full), reverse=True)

    base = iu.load_model(GPTlite, preset, device, data, untrained=args.untrained, seed=args.seed)
    window = corpus.sample_prompts(data, args.batch_size, preset.seqlen, seed=args.seed, device=device)  # full windows
    prompts = window[:, :args.prompt_len]
    rows, fns, checks = convert_and_uptrain(base, data, preset, latents, window, prompts, steps, lr, args.seed, device)
    harness.require_checks(checks)  # before anything is timed or written
    gqa = gqa_points(base, data, preset, window, steps, lr, args.seed, device)  # the plot's other curve, every run
    timings = iu.generation_figures(fns, args.n_tokens, args.batch_size, device, args.repeats)
    rows = [{**row, **timings[row["variant"]]} for row in rows]
    shape_table, bandwidth, llc = [], None, memory_bound.last_level_cache_bytes()
    if args.shape_batch:  # the memory-bound shape: random weights and caches, time only
        shape = shape_models(args.latents, args.shape_context, args.shape_tokens, args.seed)
        caches = {name: memory_bound.filled_cache(m, args.shape_batch, args.shape_context, args.shape_tokens + 1,
                                                  args.seed) for name, m in shape.items()}
        bandwidth = memory_bound.read_bandwidth()
        shape_table = memory_bound.step_rows({(name, "eager"): m for name, m in shape.items()}, shape, caches,
                                             args.shape_batch, args.shape_context, args.shape_tokens, args.repeats, bandwidth, llc,
                                             reference="MHA")

    print(f"\n{steps} uptraining steps per variant (lr {lr:g}, batch {preset.batch_size}); generation: batch "
          f"{args.batch_size}, prompts of {args.prompt_len}, {args.n_tokens} new tokens, median of {args.repeats} "
          f"runs; cache at a full window of {preset.seqlen} tokens; full rank = {full}")
    summary = ["val loss: after uptraining; loss_converted: right after conversion; cache_per_token: float values "
               "per token and layer. " + iu.peak_memory_label(device)]
    summary += [f"check {name}: {'yes' if ok else 'NO'}" for name, ok in checks.items()]
    tables = [harness.table("The plot's GQA and MQA points (same run, same uptraining):", gqa, GQA_COLUMNS)]
    if shape_table:
        tables.append(harness.table(memory_bound.shape_title(args.shape_batch, args.shape_context, "MHA"), shape_table))
    harness.report(args, "main_mla.py", preset, device, rows, headline(rows, gqa, steps), summary=summary,
                   attention_methods=attention_methods(rows, steps, full, preset.seqlen),
                   tables=tables, plot=lambda: plot_results(rows, gqa, shape_table, bandwidth, llc, preset, device),
                   uptrain_steps=steps, lr=lr, full_rank=full, checks=checks, gqa_points=gqa,
                   bandwidth_GB_per_s=bandwidth and round(bandwidth, 1), last_level_cache_bytes=llc)


if __name__ == "__main__":
    harness.run(main)
