"""MLA: convert the trained multi-head model to multi-head latent attention, with and without absorption.

    python main_mla.py                                      # cpu preset on CPU, gptlite on CUDA
    python main_mla.py --latents 16 32 64 128 --json mla.json --plot mla.png
    python main_mla.py --untrained --uptrain-steps 1        # random weights, a quick smoke run

Blog section: "Multi-head latent attention". Every block's [W_k; W_v] is factored by a truncated SVD
into a down-projection to a latent of d_latent values per token (the only thing cached) and the two
up-projections. For each latent size of the sweep the script measures the cache, the decoding speed
with absorbed projections (attention over the latents) and with recomputed keys and values, and the
validation loss right after conversion and after a short uptraining (the same budget as main_gqa.py;
MHA gets it too, as the control).

Checks first: absorbed attention equals recomputed keys and values; the full-rank latent
min(2 * n_heads * d_head, d_model) reproduces the multi-head model's logits; cached decoding equals
the full forward pass. With --plot the GQA/MQA points of the loss-against-cache chart are made here,
by main_gqa.py's conversion and the same uptraining budget, so that both curves share one run.
"""
import argparse

import torch

import inference_utils as iu
from gptlite import GPTlite
from gptlite_kvcache import generate_kvcache
from gptlite_mla import GPTlite_MLA, convert_mha_to_mla, max_latent
from main_gqa import (add_experiment_args, cached_matches_full, check_experiment_args, gqa_model, group_counts,
                      uptrain, uptrain_settings, variant_name)

FULL_RANK_ATOL = 1e-4  # float32 logits of the full-rank conversion against the multi-head model (SVD in float64)
ABSORB_ATOL = 1e-4  # float32 logits, absorbed against recomputed keys and values


def default_latents(full):
    return sorted({max(1, full // 4), max(1, full // 2), full})


def mla_model(base_state, preset, d_latent, device):
    model = GPTlite_MLA(**preset.model_config(), d_latent=d_latent)
    model.load_state_dict(convert_mha_to_mla(base_state, preset.n_heads, preset.d_head, d_latent))
    return model.to(device).eval()


@torch.inference_mode()
def max_logit_diff(model_a, model_b, window):
    return (iu.logits_of(model_a(window)) - iu.logits_of(model_b(window))).abs().max().item()


@torch.inference_mode()
def absorbed_against_recomputed(model, window):
    """Max |logit difference| of the same weights attending both ways."""
    absorbed = model.set_absorb(True)(window)[0]
    return (absorbed - model.set_absorb(False)(window)[0]).abs().max().item()


def plot_loss_against_cache(rows, gqa_points, path, preset, device):
    fig, ax = iu.new_figure()
    mha = rows[0]
    mla = [r for r in rows if r.get("absorb") == "yes"]
    series = {"MLA (latent sizes)": [(r["cache_per_token"], r["val_loss"], r["loss_converted"], r["variant"])
                                     for r in mla + [mha]],
              "GQA / MQA (group counts)": [(p["cache_per_token"], p["val_loss"], p["loss_converted"], p["variant"])
                                           for p in gqa_points + [mha]]}
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
    iu.save_plot(fig, path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_experiment_args(parser)
    parser.add_argument("--latents", type=int, nargs="+", default=None,
                        help="latent sizes d_latent of the sweep (default: the full rank, 1/2 and 1/4 of it)")

    def check_args(preset):
        check_experiment_args(args, parser, preset)
        full = max_latent(preset.n_heads, preset.d_head, preset.d_model)
        if args.latents is not None and not all(1 <= d <= full for d in args.latents):
            parser.error(f"--latents must lie between 1 and the full rank min(2 * n_heads * d_head, d_model) = {full}")
        if args.latents is not None and len(set(args.latents)) != len(args.latents):
            parser.error(f"--latents repeats a value: {args.latents}")

    args = parser.parse_args(argv)
    preset, device, data = iu.setup(args, parser, check_args)
    steps, lr = uptrain_settings(args, preset)
    full = max_latent(preset.n_heads, preset.d_head, preset.d_model)
    latents = sorted(args.latents or default_latents(full), reverse=True)

    base = iu.load_model(GPTlite, preset, device, data, untrained=args.untrained, seed=args.seed)
    base_state = base.state_dict()
    seqlen, n_layers = preset.seqlen, preset.n_layers
    window = iu.sample_prompts(data, args.batch_size, seqlen, seed=args.seed, device=device)  # full windows
    prompts = window[:, :args.prompt_len]
    checks, rows, fns = {}, [], {}

    def kv_figures(model):  # the cache at a full window, in MB and in values per token and layer
        with torch.inference_mode():
            kv_bytes = iu.kv_cache_bytes(model(window)[1])
        per_token = kv_bytes // (window.numel() * n_layers * base.fc_out.weight.element_size())
        return dict(kv_cache_mb=kv_bytes / 2**20, cache_per_token=per_token)

    mha = gqa_model(base_state, preset, preset.n_heads, device)  # MHA, as a model with a cache
    checks["MHA cached = full"] = cached_matches_full(mha, window[:8])
    figures = kv_figures(mha)
    before, after = uptrain(mha, data, preset, steps, lr, args.seed, "MHA")
    rows.append(iu.make_row("MHA", d_latent=None, absorb=None, batch_size=args.batch_size, **figures,
                            val_loss=after, loss_converted=round(before, 4)))
    fns["MHA"] = lambda n, m=mha: generate_kvcache(m, prompts, n, seqlen)

    diff = max_logit_diff(mla_model(base_state, preset, full, device), base, window[:8])  # swept or not
    checks[f"MLA-{full} (full rank) = MHA, max |logit diff| {diff:.1e}"] = diff <= FULL_RANK_ATOL
    for d_latent in latents:
        model = mla_model(base_state, preset, d_latent, device)
        diff = absorbed_against_recomputed(model, window[:8])
        checks[f"MLA-{d_latent} absorbed = recomputed, max |logit diff| {diff:.1e}"] = diff <= ABSORB_ATOL
        checks[f"MLA-{d_latent} cached = full"] = cached_matches_full(model.set_absorb(True), window[:8])
        figures = kv_figures(model)
        model.set_absorb(False)  # train with explicit keys and values (exact with dropout, cheaper for long inputs)
        before, after = uptrain(model, data, preset, steps, lr, args.seed, f"MLA-{d_latent}")
        for absorb in (True, False):
            name = f"MLA-{d_latent} {'absorbed' if absorb else 'recomputed'}"
            fns[name] = lambda n, m=model, a=absorb: generate_kvcache(m.set_absorb(a), prompts, n, seqlen)
            rows.append(iu.make_row(name, d_latent=d_latent, absorb="yes" if absorb else "no",
                                    batch_size=args.batch_size, **figures, val_loss=after,
                                    loss_converted=round(before, 4)))

    timings = iu.compare_generation(fns, args.n_tokens, args.batch_size, device, warmup=1, repeats=args.repeats)
    for row in rows:
        fn = fns[row["variant"]]
        row.update(timings[row["variant"]], peak_mem_mb=iu.peak_memory_mb(lambda: fn(args.n_tokens), device))
        row.update(kv_vs_mha=f"{row['kv_cache_mb'] / rows[0]['kv_cache_mb']:.3f}",
                   loss_vs_mha=f"{row['val_loss'] - rows[0]['val_loss']:+.4f}")

    print(f"\n{steps} uptraining steps per variant (lr {lr:g}, batch {preset.batch_size}); generation: batch "
          f"{args.batch_size}, prompts of {args.prompt_len}, {args.n_tokens} new tokens, median of {args.repeats} "
          f"runs; cache at a full window of {seqlen} tokens; full rank = {full}")
    iu.print_table(rows, untrained=args.untrained)
    print("val loss: after uptraining; loss_converted: right after conversion; cache_per_token: float values per "
          "token and layer. " + iu.peak_memory_label(device))
    for name, ok in checks.items():
        print(f"check {name}: {'yes' if ok else 'NO'}")

    gqa_points = []
    if args.plot:
        for n_groups in group_counts(preset.n_heads)[1:]:  # GQA and MQA; MHA is rows[0]
            name = variant_name(n_groups, preset.n_heads)
            model = gqa_model(base_state, preset, n_groups, device)
            figures = kv_figures(model)
            before, after = uptrain(model, data, preset, steps, lr, args.seed, name)
            gqa_points.append(dict(variant=name, n_groups=n_groups, **figures, val_loss=after, loss_converted=before))
        plot_loss_against_cache(rows, gqa_points, args.plot, preset, device)
    if args.json:
        iu.save_json(args.json, "main_mla.py", preset, device, rows, untrained=args.untrained, uptrain_steps=steps,
                     lr=lr, full_rank=full, checks=checks, gqa_points=gqa_points)
    failures = [name for name, ok in checks.items() if not ok]
    if failures:
        raise iu.GPTliteError(f"checks failed: {'; '.join(failures)}; this is a bug")


if __name__ == "__main__":
    iu.run(main)
