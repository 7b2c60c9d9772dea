"""SLA (Sparse-Linear Attention): exact attention on the critical tiles, linear attention on the marginal ones.

    python main_sla.py                                   # cpu preset on CPU, gptlite on CUDA
    python main_sla.py --block-size 8 --exact 0.05 0.1 0.25 0.5 --skipped 0.1 --json sla.json --plot sla.png
    python main_sla.py --untrained --exact 0.25 --fit-steps 2 --fit-sequences 4 --error-sequences 2 --val-batches 1

Blog section: "Sparse plus linear attention: SLA". The attention map of the prefill is cut into tiles of
block-size queries x block-size keys; the softmax of the mean-pooled queries against the mean-pooled keys
ranks each query block's key blocks (gptlite_sla.py: classify_blocks). The top --exact fraction of each
row is computed exactly (softmax, sparse_part), the bottom --skipped fraction is left out, and the rest
goes through linear attention (linear_part), whose output passes a zero-initialised d_head x d_head
projection before it is added: O = O_s + proj(O_l) (sla_attention). The ablation of the paper, sparse
only, has the same exact tiles and drops the marginal ones.

Both masks of the trained dense GPTlite: causal (the language model it is) and bidirectional (as in the
paper's diffusion transformers; GPTlite read without its mask is no language model, so only attention
outputs are compared there). Per exact fraction: SLA and sparse only, with the relative error of the
attention layers' outputs against dense attention on the real inputs of those layers (validation
text, run through the dense model), the validation loss of the causal model, the shares of tiles
exact / linear / skipped, and the attention FLOPs against dense. SLA's projections are fine-tuned
alone (the other weights frozen), --fit-steps Adam steps fitting each layer's output to dense
attention on training text: no loss of the whole model is defined for the bidirectional case, and
this fit leaves the sparse-only rows, which have nothing to train, comparable.

Checks first: an exact fraction of 1 gives GPTlite's logits bit for bit (causal) and dense bidirectional
attention's outputs (within 1e-6), and classify_blocks agrees with a tile-by-tile loop on real queries
and keys. Nothing is fitted or written unless they pass.
"""
import math

import torch

import inference_utils as iu
from gptlite import GPTlite
from lib import attention_summary, corpus, harness, training
from gptlite_sla import (CRITICAL, MARGINAL, SKIPPED, GPTlite_SLA, check_sla_args,  # noqa: F401 (the post's listing)
                         classify_blocks, linear_part, sla_attention, sparse_part, tile_counts)
from lib.sla import attention_flops, attention_inputs, fit_projections, relative_error, tile_fractions

DENSE_ATOL = 1e-6  # float32 attention outputs of bidirectional SLA at exact = 1 against dense attention
LENGTHS = [128, 1024, 4096, 16384, 65536]  # the FLOPs panel's sequence lengths (bidirectional, counted, not run)


def sla_from(base, block_size, exact, skipped, mask, linear, feature_map):
    return GPTlite_SLA.from_gptlite(base, block_size=block_size, critical=exact, skipped=skipped, mask=mask,
                                    linear=linear, feature_map=feature_map)


def classify_by_loop(Q, K, block_size, critical, skipped, causal):
    """The tiles' labels one row at a time: pooled means, P_c by an explicit softmax, the row's tiles
    sorted (own tile first when causal), the first ceil(critical n) critical, the last floor(skipped n)
    and every future tile skipped. The script's check of classify_blocks."""
    B, H, S, D = Q.shape
    nb = S // block_size
    labels = torch.full((B, H, nb, nb), SKIPPED, dtype=torch.int8)
    for b in range(B):
        for h in range(H):
            keys = [K[b, h, j * block_size:(j + 1) * block_size].mean(0) for j in range(nb)]
            for i in range(nb):
                q = Q[b, h, i * block_size:(i + 1) * block_size].mean(0)
                n = i + 1 if causal else nb
                p = torch.softmax(torch.stack([q @ keys[j] for j in range(n)]) / math.sqrt(D), dim=0)
                order = sorted(range(n), key=lambda j: (not (causal and j == i), -p[j].item(), j))
                n_critical, n_skipped = tile_counts(n, critical, skipped)
                for r, j in enumerate(order):
                    labels[b, h, i, j] = CRITICAL if r < n_critical else SKIPPED if r >= n - n_skipped else MARGINAL
    return labels


@torch.no_grad()
def run_checks(base, window, val_inputs, block_size, exacts, skipped, masks, feature_map):
    """{name: ok}: exact = 1 is dense attention (causal: GPTlite's logits bit for bit; bidirectional: the
    outputs within DENSE_ATOL); classify_blocks = the loop, on layer 0's real queries and keys."""
    checks = {}
    for mask in masks:
        dense = sla_from(base, block_size, 1.0, 0.0, mask, True, feature_map)  # dense: nothing skipped
        if mask == "causal":
            checks["exact = 1, causal: GPTlite's logits bit for bit"] = torch.equal(dense(window), base(window))
        else:
            err = relative_error(dense, val_inputs)
            name = f"exact = 1, bidirectional: dense attention's outputs (relative error {err:.0e})"
            checks[name] = err <= DENSE_ATOL
    mha = base.blocks[0].mha
    x = val_inputs[0][:2]
    Q, K = mha.split_heads(mha.query_proj(x)), mha.split_heads(mha.key_proj(x))  # [2, H, S, D]
    for mask in masks:
        causal = mask == "causal"
        settings = [(e, skipped) for e in exacts] + [(1.0, 0.0)]
        agree = all(torch.equal(classify_blocks(Q, K, block_size, e, s, causal),
                                classify_by_loop(Q, K, block_size, e, s, causal)) for e, s in settings)
        checks[f"classification = tile-by-tile loop ({mask})"] = agree
    return checks


def measured(model, val_inputs, block_size, d_head, causal, linear):
    """Relative error on val_inputs, and the tiles' shares and FLOPs of that same pass (all layers)."""
    error = relative_error(model, val_inputs)
    labels = torch.cat([block.mha.last_labels for block in model.blocks])  # [layers * B, H, nb, nb]
    shares = tile_fractions(labels, causal)
    flops, dense = attention_flops(labels, block_size, d_head, causal, linear)
    return dict(rel_error=error, exact=round(shares["exact"], 4), linear=round(shares["linear"], 4) if linear else 0.0,
                skipped=round(shares["skipped"] + (0.0 if linear else shares["linear"]), 4),
                flops_rel=round(flops / dense, 4))


def variant_rows(base, data, preset, args, train_inputs, val_inputs):
    """Per mask: dense (exact = 1), then per exact fraction SLA (projections fitted) and sparse only."""
    rows, fits = [], {}
    for mask in args.masks:
        causal = mask == "causal"
        for exact in [1.0] + sorted(args.exact, reverse=True):
            for linear in ([True] if exact == 1.0 else [True, False]):
                name = f"{mask} {'dense' if exact == 1.0 else ('SLA' if linear else 'sparse only')}"
                skipped = args.skipped if exact < 1.0 else 0.0  # dense: every tile exact
                model = sla_from(base, args.block_size, exact, skipped, mask, linear, args.feature_map)
                if linear and exact < 1.0:
                    fits[f"{mask} {exact:g}"] = fit_projections(model, train_inputs, args.fit_steps, args.fit_lr,
                                                                seed=args.seed, desc=f"fitting {name} {exact:g}")
                figures = measured(model, val_inputs, args.block_size, preset.d_head, causal, linear)
                val_loss = training.validation_loss(model, data, n_batches=args.val_batches) if causal else None
                rows.append(harness.make_row(name, val_loss=val_loss, mask=mask, exact_target=exact, **figures))
    return rows, fits


def spread_labels(n_blocks, critical, skipped):
    """Bidirectional labels of one head with each row's shares (ceil / floor as classify_blocks), the tiles
    rotated from row to row so that every key block is marginal for some row: [1, 1, nb, nb]."""
    n_critical, n_skipped = tile_counts(n_blocks, critical, skipped)
    rank = (torch.arange(n_blocks)[None, :] - torch.arange(n_blocks)[:, None]) % n_blocks  # [nb, nb]
    labels = torch.full((n_blocks, n_blocks), MARGINAL, dtype=torch.int8)
    labels[rank >= n_blocks - n_skipped] = SKIPPED
    labels[rank < n_critical] = CRITICAL
    return labels[None, None]


def long_context_flops(exact, skipped, settings):
    """SLA's attention FLOPs against dense at LENGTHS, bidirectional, for each (block_size, d_head) of
    `settings`: {label: [share per length]} (attention_flops of spread_labels: counted, not run)."""
    curves = {}
    for block_size, d_head in settings:
        shares = []
        for length in LENGTHS:
            flops, dense = attention_flops(spread_labels(length // block_size, exact, skipped), block_size, d_head,
                                           causal=False, linear=True)
            shares.append(round(flops / dense, 4))
        curves[f"tiles of {block_size}, d_head {d_head}"] = shares
    return curves


def plot_results(rows, args, preset, long_flops):
    """Output error and validation loss against the share of tiles computed exactly: SLA vs sparse only."""
    fig, (ax_err, ax_loss, ax_flops) = harness.new_figure(3)
    for mask, style in (("causal", "-"), ("bidirectional", "--")):
        for kind, marker in (("SLA", "o"), ("sparse only", "s")):
            picked = [r for r in rows if r["mask"] == mask and (r["variant"].endswith(kind) or r["exact_target"] == 1)]
            picked = sorted(picked, key=lambda r: r["exact"]) if len(picked) > 1 else []  # dense closes each curve
            if picked:
                ax_err.plot([r["exact"] for r in picked], [r["rel_error"] for r in picked], marker=marker,
                            linestyle=style, label=f"{kind}, {mask}")
                if mask == "causal":
                    ax_loss.plot([r["exact"] for r in picked], [r["val_loss"] for r in picked], marker=marker,
                                 label=kind)
    dense = [r for r in rows if r["variant"] == "causal dense"]
    if dense:
        ax_loss.axhline(dense[0]["val_loss"], color="gray", label="dense")
    ax_err.set(xlabel="share of tiles computed exactly", ylabel="relative error of the attention outputs",
               title=f"SLA, tiles of {args.block_size}, {args.skipped:.0%} skipped (preset {preset.name})")
    ax_err.legend()
    ax_loss.set(xlabel="share of tiles computed exactly", ylabel="validation loss (nats/char)",
                title="causal GPTlite with SLA in every layer")
    ax_loss.legend()
    for label, shares in long_flops.items():
        ax_flops.plot(LENGTHS, shares, marker="o", label=f"SLA, {label}")
    ax_flops.axhline(1.0, color="gray", label="dense")
    ax_flops.set(xscale="log", yscale="log", xlabel="sequence length (tokens, bidirectional)",
                 ylabel="attention FLOPs / dense's",
                 title=f"{min(args.exact):.0%} exact, {args.skipped:.0%} skipped: counted, not run")
    ax_flops.legend()
    return fig


def at_fraction(rows, mask, exact):
    """The SLA row and the sparse-only row of `mask` at the exact fraction `exact`."""
    return tuple(next(r for r in rows if r["mask"] == mask and r["exact_target"] == exact and r["variant"].endswith(k))
                 for k in ("SLA", "sparse only"))


def headline(rows, args):
    """The README's row: at the sparsest exact fraction, SLA's and sparse-only's output error (and the
    causal loss against dense)."""
    least = min(args.exact)
    parts = []
    for mask in args.masks:
        sla, sparse = at_fraction(rows, mask, least)
        text = f"{mask}: output error {sla['rel_error']:.3f} SLA / {sparse['rel_error']:.3f} sparse only"
        if mask == "causal":
            dense = next(r for r in rows if r["variant"] == "causal dense")
            text += (f", val loss {sla['val_loss'] - dense['val_loss']:+.4f} / "
                     f"{sparse['val_loss'] - dense['val_loss']:+.4f} against dense")
        parts.append(text + f" ({sla['flops_rel']:.0%} / {sparse['flops_rel']:.0%} of dense's FLOPs)")
    return dict(technique=f"SLA, tiles of {args.block_size}, {least:.0%} exact, {args.skipped:.0%} skipped, "
                          f"projection fitted {args.fit_steps} steps",
                figure="; ".join(parts))


def attention_methods(rows, args):
    """The summary of attention methods' rows (lib/attention_summary.py): SLA at the sparsest exact fraction,
    per mask, against dense attention and the sparse-only ablation."""
    least, methods = min(args.exact), []
    for mask in args.masks:
        sla, sparse = at_fraction(rows, mask, least)
        difference = f"attention output error {sla['rel_error']:.3f} (sparse only {sparse['rel_error']:.3f})"
        if mask == "causal":
            dense = next(r for r in rows if r["variant"] == "causal dense")
            difference += f", val loss {sla['val_loss'] - dense['val_loss']:+.4f}"
        methods.append(attention_summary.method_row(
            f"SLA, {mask}, {sla['exact']:.0%} of tiles exact", False, difference, args.fit_steps,
            f"{args.fit_steps} steps fitting the linear part's projection alone", "attention FLOPs",
            f"{sla['flops_rel']:.0%} of dense's (sparse only {sparse['flops_rel']:.0%})",
            "not timed: the explicit mask computes every tile; a block-sparse kernel and long sequences are "
            "where the FLOPs turn into time"))
    return methods


def parse_args(argv):
    """The flags, checked before any work: (args, preset, device, data)."""
    parser = harness.script_parser(__doc__)
    add = parser.add_argument
    add("--block-size", type=harness.int_at_least(1), default=8, help="tokens per query block and key block")
    add("--exact", type=harness.float_in(0, 1, low_open=True, high_open=True), nargs="+",
        default=[0.05, 0.1, 0.25, 0.5],
        help="fractions of each row's tiles computed exactly (k_h), in (0, 1), one SLA and one sparse-only row "
             "each; dense (1) is always run")
    add("--skipped", type=harness.float_in(0, 1, high_open=True), default=0.1,
        help="fraction of each row's tiles skipped (k_l), in [0, 1)")
    add("--masks", nargs="+", choices=["causal", "bidirectional"], default=["causal", "bidirectional"],
        help="attention masks to evaluate")
    add("--feature-map", choices=["softmax", "elu"], default="softmax", help="phi of the linear part")
    add("--fit-steps", type=harness.steps, default=50, help="Adam steps fitting SLA's projections")
    add("--fit-lr", type=harness.learning_rate, default=1e-2, help="learning rate of that fit")
    add("--fit-sequences", type=harness.batches, default=64,
        help="training windows whose attention inputs the fit uses (16 a step)")
    add("--error-sequences", type=harness.batches, default=8,
        help="validation windows on which the output error is measured")
    add("--val-batches", type=harness.batches, default=10, help="validation batches (of 32 x seqlen), causal")
    args = parser.parse_args(argv)

    def check_args(preset):
        if args.block_size >= preset.seqlen or preset.seqlen % args.block_size:
            parser.error(f"--block-size {args.block_size}: must divide the {preset.seqlen}-token window into at "
                         f"least two blocks, e.g. 8")
        if len(set(args.exact)) != len(args.exact):
            parser.error(f"--exact repeats a value: {args.exact}")
        if max(args.exact) + args.skipped > 1:
            parser.error(f"--exact {max(args.exact):g} + --skipped {args.skipped:g} > 1: a row's exact and skipped "
                         "tiles cannot overlap; lower one of them")
        if len(set(args.masks)) != len(args.masks):
            parser.error(f"--masks repeats a value: {args.masks}")
        for exact in args.exact:  # the library's own checks, with the flags' names
            try:
                check_sla_args(args.block_size, exact, args.skipped, seqlen=preset.seqlen)
            except ValueError as e:
                parser.error(f"--block-size/--exact/--skipped: {e}")
    return (args, *harness.setup(args, parser, check_args))


def main(argv=None):
    args, preset, device, data = parse_args(argv)
    base = iu.load_model(GPTlite, preset, device, data, untrained=args.untrained, seed=args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    window = corpus.get_batch(data.val, args.error_sequences, preset.seqlen, generator, device)[0]
    val_inputs = attention_inputs(base, window)  # the dense model's real attention inputs, [layers] of [B, S, d]
    checks = run_checks(base, window, val_inputs, args.block_size, args.exact, args.skipped, args.masks,
                        args.feature_map)  # correctness first
    harness.require_checks(checks)  # nothing fitted or written unless they pass

    train_window = corpus.get_batch(data.train, args.fit_sequences, preset.seqlen, generator, device)[0]
    train_inputs = attention_inputs(base, train_window)
    rows, fits = variant_rows(base, data, preset, args, train_inputs, val_inputs)
    nb = preset.seqlen // args.block_size
    long_flops = long_context_flops(min(args.exact), args.skipped, [(args.block_size, preset.d_head), (64, 128)])
    print(f"\ntiles of {args.block_size} x {args.block_size}: {nb} x {nb} in the {preset.seqlen}-token window; "
          f"phi = {args.feature_map}; SLA's projections fitted alone, {args.fit_steps} Adam steps at lr "
          f"{args.fit_lr:g}")
    summary = ["rel_error: |attention outputs - dense attention's| / |dense's|, all layers, on the layers' real "
               f"inputs ({args.error_sequences} validation windows through the dense model)",
               "val loss: causal only (bidirectional GPTlite is no language model)",
               "exact / linear / skipped: shares of the tiles each query block may read (causal: the past ones); "
               "sparse only counts its marginal tiles as skipped",
               f"flops_rel: attention FLOPs of a block-sparse kernel against dense (d_head {preset.d_head}; "
               "estimate, linear part and projection included)"]
    summary += [f"attention FLOPs / dense's at {', '.join(f'{n:,}' for n in LENGTHS)} tokens, bidirectional, "
                f"{min(args.exact):.0%} exact, {args.skipped:.0%} skipped, {label} (counted): "
                + ", ".join(f"{share:.3f}" for share in shares) for label, shares in long_flops.items()]
    summary += [f"fit {name}: last mean squared error {loss:.3g}" for name, loss in fits.items()]
    summary += [f"check {name}: {'ok' if ok else 'NO'}" for name, ok in checks.items()]
    harness.report(args, "main_sla.py", preset, device, rows, headline(rows, args), summary=summary,
                   plot=lambda: plot_results(rows, args, preset, long_flops), block_size=args.block_size, n_blocks=nb,
                   skipped=args.skipped, feature_map=args.feature_map, fit_steps=args.fit_steps, fit_lr=args.fit_lr,
                   checks=checks, long_context_lengths=LENGTHS, long_context_flops=long_flops,
                   attention_methods=attention_methods(rows, args))


if __name__ == "__main__":
    harness.run(main)
