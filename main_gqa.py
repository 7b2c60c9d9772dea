"""GQA and MQA: convert the trained multi-head model to fewer key/value heads, uptrain, measure.

    python main_gqa.py                                      # cpu preset on CPU, gptlite on CUDA
    python main_gqa.py --uptrain-steps 100 --batch-size 128 --json gqa.json --plot gqa.png
    python main_gqa.py --untrained --uptrain-steps 2        # random weights, a quick smoke run

Blog section: "Grouped-query and multi-query attention". For every group count that divides the
number of heads (n_heads groups: MHA, 1 group: MQA, GQA in between) the script converts the trained
multi-head checkpoint by mean pooling the key and value heads of each group, measures the validation
loss, uptrains the converted model with the same short budget (about 5% of the checkpoint's training
steps; MHA gets it too, as the control), and measures again. It then times greedy generation with the
KV cache at a large batch, where the cache's reads dominate a decoding step.

Checks first: the conversion with n_groups == n_heads gives exactly the multi-head model's logits and
tokens, and every variant's cached decoding gives the logits of its full forward pass. The uptrained
GQA model is saved (config with n_groups) for later scripts: load it with gptlite_gqa.load_gqa.
"""
import argparse
from pathlib import Path

import torch

import inference_utils as iu
from gptlite import GPTlite, generate
from gptlite_gqa import GPTlite_GQA, convert_mha_to_gqa
from gptlite_kvcache import generate_kvcache

CACHED_ATOL = 1e-4  # float32: cached decoding against the full forward pass


def group_counts(n_heads):
    return [g for g in range(n_heads, 0, -1) if n_heads % g == 0]  # MHA first, MQA last


def variant_name(n_groups, n_heads):
    return "MHA" if n_groups == n_heads else "MQA" if n_groups == 1 else f"GQA-{n_groups}"


def uptrain_settings(args, preset):
    """Steps (default: 5% of the checkpoint's training) and peak learning rate of the uptraining."""
    return args.uptrain_steps or max(1, round(0.05 * preset.iters)), args.lr or preset.lr / 3


def gqa_model(base_state, preset, n_groups, device):
    """The multi-head weights converted to n_groups key/value heads, as a GPTlite_GQA."""
    model = GPTlite_GQA(**preset.model_config(), n_groups=n_groups)
    model.load_state_dict(convert_mha_to_gqa(base_state, preset.n_heads, preset.d_head, n_groups))
    return model.to(device).eval()


def uptrain(model, data, preset, steps, lr, seed, name):
    """Validation loss before and after `steps` of training (train_steps' own 10-batch figure is not used:
    both figures come from the same iu.validation_loss batches as every other script's)."""
    before = iu.validation_loss(model, data)
    iu.train_steps(model, data, steps, preset.batch_size, preset.seqlen, lr, seed=seed, eval_interval=steps,
                   desc=f"uptraining {name}")
    return before, iu.validation_loss(model, data)


@torch.inference_mode()
def cached_matches_full(model, window):
    """Prefill half of `window` [B, S], decode the rest one token at a time: the logits of the full pass?"""
    full, _ = model(window)
    half = window.shape[1] // 2
    logits, cache = model(window[:, :half])
    steps = [logits]
    for t in range(half, window.shape[1]):
        logits, cache = model(window[:, t:t + 1], cache)
        steps.append(logits)
    return (torch.cat(steps, dim=1) - full).abs().max().item() <= CACHED_ATOL


@torch.inference_mode()
def mha_conversion_is_exact(base, mha, window, prompts, n_tokens, seqlen):
    """n_groups == n_heads: the same logits and greedy tokens as the multi-head model, bit for bit."""
    same_logits = torch.equal(mha(window)[0], base(window))
    n_fit = min(n_tokens, seqlen - prompts.shape[1] + 1)  # tokens without a cache are exact within the window
    same_tokens = torch.equal(generate_kvcache(mha, prompts, n_fit, seqlen), generate(base, prompts, n_fit, seqlen))
    return same_logits and same_tokens


def plot_results(rows, path, preset, device):
    fig, (ax_loss, ax_time) = iu.new_figure(2)
    kv = [r["kv_cache_mb"] for r in rows]
    ax_loss.plot(kv, [r["loss_converted"] for r in rows], marker="o", linestyle="--", label="converted")
    ax_loss.plot(kv, [r["val_loss"] for r in rows], marker="o", label="uptrained")
    ax_time.plot(kv, [r["tpot_ms"] for r in rows], marker="o")
    for r in rows:
        ax_loss.annotate(r["variant"], (r["kv_cache_mb"], r["val_loss"]))
        ax_time.annotate(r["variant"], (r["kv_cache_mb"], r["tpot_ms"]))
    ax_loss.set(xlabel="KV cache at a full window (MB)", ylabel="validation loss (nats/char)",
                title=f"GQA conversion (preset {preset.name})")
    ax_loss.legend()
    ax_time.set(xlabel="KV cache at a full window (MB)", ylabel="TPOT (ms)", ylim=(0, None),
                title=f"greedy decoding, batch {rows[0]['batch_size']} ({device})")
    iu.save_plot(fig, path)


def add_experiment_args(parser):
    """Flags of the uptraining and of the timing, shared with main_mla.py."""
    iu.add_common_args(parser)
    parser.add_argument("--uptrain-steps", type=int, default=None,
                        help="training steps after conversion, for every variant (default: 5%% of the preset's)")
    parser.add_argument("--lr", type=float, default=None,
                        help="peak learning rate of uptraining (default: the preset's / 3)")
    parser.add_argument("--batch-size", type=int, default=64, help="prompts generated together when timing")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt length in characters")
    parser.add_argument("--n-tokens", type=int, default=64, help="new tokens generated per prompt (at least 2)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure (median, after a warm-up)")


def check_experiment_args(args, parser, preset):
    if not 1 <= args.prompt_len <= preset.seqlen:
        parser.error(f"--prompt-len must be between 1 and the model's seqlen={preset.seqlen}, got {args.prompt_len}")
    for flag, value, low in [("--uptrain-steps", args.uptrain_steps, 1), ("--batch-size", args.batch_size, 1),
                             ("--n-tokens", args.n_tokens, 2), ("--repeats", args.repeats, 1)]:
        if value is not None and value < low:
            parser.error(f"{flag} must be at least {low}, got {value}")
    if args.lr is not None and not args.lr > 0:
        parser.error(f"--lr must be positive, got {args.lr}")


def check_args(args, parser, preset):
    check_experiment_args(args, parser, preset)
    if args.save_groups is not None and args.save_groups not in group_counts(preset.n_heads):
        parser.error(f"--save-groups must divide n_heads={preset.n_heads}: one of {group_counts(preset.n_heads)}")
    if args.save is not None and (Path(args.save).is_dir() or not Path(args.save).resolve().parent.is_dir()):
        parser.error(f"--save {args.save}: give a file path in a folder that exists")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_experiment_args(parser)
    parser.add_argument("--save", default=None, metavar="PATH",
                        help="where to save the uptrained GQA model (default: checkpoints/<preset>_gqa.pt; "
                             "with --untrained nothing is saved unless given)")
    parser.add_argument("--save-groups", type=int, default=None,
                        help="group count of the saved model (default: the smallest above 1 that is not MHA)")
    args = parser.parse_args(argv)
    preset, device, data = iu.setup(args, parser, lambda preset: check_args(args, parser, preset))
    steps, lr = uptrain_settings(args, preset)
    counts = group_counts(preset.n_heads)
    save_groups = args.save_groups or next((g for g in reversed(counts) if 1 < g < preset.n_heads), 1)
    save_path = args.save or (None if args.untrained else iu.checkpoint_path(f"{preset.name}_gqa"))

    base = iu.load_model(GPTlite, preset, device, data, untrained=args.untrained, seed=args.seed)
    base_state = base.state_dict()
    seqlen = preset.seqlen
    window = iu.sample_prompts(data, args.batch_size, seqlen, seed=args.seed, device=device)  # full windows
    prompts = window[:, :args.prompt_len]

    models, rows, checks = {}, [], {}
    for n_groups in counts:
        name = variant_name(n_groups, preset.n_heads)
        model = models[name] = gqa_model(base_state, preset, n_groups, device)
        checks[name] = cached_matches_full(model, window[:8])  # correctness first
        if n_groups == preset.n_heads:
            checks["MHA conversion exact"] = mha_conversion_is_exact(base, model, window[:8], prompts[:8],
                                                                     args.n_tokens, seqlen)
        with torch.inference_mode():
            kv_bytes = iu.kv_cache_bytes(model(window)[1])
        before, after = uptrain(model, data, preset, steps, lr, args.seed, name)
        rows.append(iu.make_row(name, n_groups=n_groups, batch_size=args.batch_size,
                                kv_cache_mb=kv_bytes / 2**20, val_loss=after, loss_converted=round(before, 4)))

    fns = {name: (lambda n, m=model: generate_kvcache(m, prompts, n, seqlen)) for name, model in models.items()}
    timings = iu.compare_generation(fns, args.n_tokens, args.batch_size, device, warmup=1, repeats=args.repeats)
    mha = rows[0]
    for row in rows:
        fn = fns[row["variant"]]
        row.update(timings[row["variant"]], peak_mem_mb=iu.peak_memory_mb(lambda: fn(args.n_tokens), device))
        row.update(kv_vs_mha=f"{row['kv_cache_mb'] / mha['kv_cache_mb']:.3f}",
                   loss_vs_mha=f"{row['val_loss'] - mha['val_loss']:+.4f}",
                   cached_ok="yes" if checks[row["variant"]] else "NO")

    print(f"\n{steps} uptraining steps per variant (lr {lr:g}, batch {preset.batch_size}); generation: batch "
          f"{args.batch_size}, prompts of {args.prompt_len}, {args.n_tokens} new tokens, median of {args.repeats} "
          f"runs; KV cache at a full window of {seqlen} tokens")
    iu.print_table(rows, untrained=args.untrained)
    print("val loss: after uptraining; loss_converted: right after conversion. " + iu.peak_memory_label(device))
    print(f"MHA conversion (n_groups = n_heads) equals the multi-head model: "
          f"{'yes, logits and tokens' if checks['MHA conversion exact'] else 'NO'}")

    if args.plot:
        plot_results(rows, args.plot, preset, device)
    if args.json:
        iu.save_json(args.json, "main_gqa.py", preset, device, rows, untrained=args.untrained,
                     uptrain_steps=steps, lr=lr, checks=checks,
                     saved=str(save_path) if save_path else None)
    failures = [name for name, ok in checks.items() if not ok]
    if failures:
        raise iu.GPTliteError(f"checks failed: {', '.join(failures)}; this is a bug (nothing saved)")
    if save_path is not None:
        saved = models[variant_name(save_groups, preset.n_heads)]
        row = next(r for r in rows if r["n_groups"] == save_groups)
        iu.save_checkpoint(save_path, saved, {**preset.model_config(), "n_groups": save_groups}, data.vocab,
                           preset=preset.name, converted_from="mha", uptrain_steps=steps,
                           val_loss=row["val_loss"], untrained=args.untrained)
        print(f"saved {save_path} ({row['variant']}, uptrained)")


if __name__ == "__main__":
    iu.run(main)
