"""MoBA (Mixture of Block Attention): block-sparse attention at inference only, then uptrained with it.

    python main_moba.py                                  # cpu preset on CPU, gptlite on CUDA
    python main_moba.py --block-size 16 --top-k 4 2 1 --json moba.json --plot moba.png
    python main_moba.py --untrained --uptrain-steps 2 --val-batches 2 --no-flex   # a quick smoke run

Blog section: "Sparse attention". MoBA splits the keys into blocks; each query scores every
past block by its dot product with the block's mean key and attends to its top-k blocks, its own block
always among them and causal within it (moba.py: select_blocks, moba_attention). The trained dense
GPTlite is evaluated with MoBA at each top-k (inference only), then each is uptrained with MoBA for a
short budget (about 5% of the checkpoint's steps) and evaluated again; dense attention (top-k = every
block) gets the same uptraining as the control, so that the gap left is the cost of the sparsity, not
of fewer training steps. Per top-k the table gives the attention FLOPs and KV bytes read for a token
decoded with a full window, counted from the mask itself; the plot extends them to long contexts.

Checks first: top-k = the number of blocks gives GPTlite's logits bit for bit; FlexAttention's block
mask (where the device runs it; --no-flex leaves it out) gives the explicit mask's outputs; the mask
reads the keys that the cost formula counts. Nothing is trained or written unless they pass. The
uptrained models are saved as checkpoints/<preset>_moba_b<block>_k<top-k>_s<steps>.pt and reused by
later runs with the same base checkpoint, learning rate and seed.
"""

import torch

import inference_utils as iu
from gptlite import GPTlite
from gptlite_kvcache import kv_cache_view
from lib import corpus, files, harness, training
from gptlite_moba import (GPTlite_MoBA, MoBACache,  # noqa: F401 (the post's listing: the selection and the mask)
                          moba_attention, n_blocks, select_blocks)
from lib.moba import attention_cost, cost_figures, keys_read, make_flex_check, uptrained

ATOL = 1e-4  # float32 logits (units to tens): FlexAttention's online softmax sums in another order
FLEX_ATOL = 1e-5  # float32 attention outputs on random unit inputs
CONTEXTS = [128, 512, 2048, 8192, 32768]  # the plot's long contexts, in tokens


def moba_from(base, config, block_size, top_k):
    """A GPTlite_MoBA with the weights of the GPTlite `base`, on its device, in eval mode."""
    model = GPTlite_MoBA(**config, block_size=block_size, top_k=top_k)
    model.load_state_dict(base.state_dict())
    return model.to(next(base.parameters()).device).eval()


@torch.no_grad()
def run_checks(base, config, window, block_size, top_ks, flex):
    """{name: ok}: dense MoBA is GPTlite bit for bit; flex (if any) agrees with the mask; the mask
    reads keys_read(position) keys at every position, in every layer (GPTlite's own cached forward pass
    with MoBA's selection as its cache, which records the keys each query read)."""
    nb = n_blocks(window.shape[1], block_size)
    checks = {"top-k = all blocks: GPTlite's logits": torch.equal(moba_from(base, config, block_size, nb)(window),
                                                                  base(window))}
    for k in top_ks:
        model = moba_from(base, config, block_size, k)
        if flex is not None:
            diff = (model(window) - model.use_flex(flex)(window)).abs().max().item()
            checks[f"top-{k}: flex = mask (max |diff| {diff:.1e})"] = diff <= ATOL
        cache = MoBACache(len(base.blocks), block_size, k, base.seqlen, record=True)
        kv_cache_view(base)(window, kv_cache=cache)
        expected = torch.tensor([keys_read(p, block_size, k) for p in range(window.shape[1])], device=window.device)
        checks[f"top-{k}: keys read = formula"] = all(bool((counted == expected).all()) for counted in cache.keys_read)
    return checks


def plot_results(rows, preset, block_size):
    """Validation loss against keys read per query, and KV bytes read per token against context: the figure."""
    fig, (ax_loss, ax_kv) = harness.new_figure(2)
    moba = [r for r in rows if r["top_k"] < rows[0]["top_k"]]
    keys = [r["keys_per_query"] for r in moba]
    ax_loss.plot(keys, [r["loss_inference"] for r in moba], marker="o", linestyle="--", label="MoBA at inference only")
    ax_loss.plot(keys, [r["val_loss"] for r in moba], marker="o", label="MoBA uptrained")
    ax_loss.axhline(rows[0]["loss_inference"], color="gray", linestyle="--", label="dense")
    ax_loss.axhline(rows[0]["val_loss"], color="gray", label="dense, same uptraining")
    for r in moba:
        ax_loss.annotate(f"top-{r['top_k']}", (r["keys_per_query"], r["loss_inference"]))
    ax_loss.set(xlabel=f"keys read per query, mean over a {preset.seqlen}-token window",
                ylabel="validation loss (nats/char)", title=f"MoBA, blocks of {block_size} (preset {preset.name})")
    ax_loss.legend()
    dims = (preset.n_heads, preset.d_head, preset.n_layers)
    dense_kv = [attention_cost(n - 1, None, 1, *dims)[1] / 2**10 for n in CONTEXTS]
    ax_kv.plot(CONTEXTS, dense_kv, marker="o", label="dense")
    for r in moba:
        kv = [attention_cost(n - 1, block_size, r["top_k"], *dims)[1] / 2**10 for n in CONTEXTS]
        ax_kv.plot(CONTEXTS, kv, marker="o", label=f"MoBA top-{r['top_k']}")
    ax_kv.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="KV KB read per decoded token",
              title="keys, values and mean keys read (formula checked on the mask)")
    ax_kv.legend()
    return fig


def variant_rows(base, config, data, preset, block_size, top_ks, flex, steps, lr, seed, val_batches, rebuild,
                 untrained):
    """Dense (the control) and each top-k: the loss of MoBA applied to the dense checkpoint as it is, then
    after the same uptraining (cached checkpoints, never saved when untrained), and the costs."""
    nb = n_blocks(preset.seqlen, block_size)
    base_sha = None if untrained else files.load_checkpoint(files.checkpoint_path(preset.name))["sha256"]
    meta = dict(base_sha256=base_sha, uptrain_steps=steps, lr=lr, seed=seed)
    rows = []
    for k in [nb] + top_ks:  # dense (the control) first
        name = f"dense (top-{nb} of {nb})" if k == nb else f"MoBA top-{k} of {nb}"
        model = moba_from(base, config, block_size, k).use_flex(flex)
        loss_inference = training.validation_loss(model, data, n_batches=val_batches)
        path = None if untrained else files.checkpoint_path(f"{preset.name}_moba_b{block_size}_k{k}_s{steps}")
        model = uptrained(model, name, path, meta, data, preset, steps, lr, seed, rebuild)
        val_loss = training.validation_loss(model, data, n_batches=val_batches)
        dense = rows[0] if rows else dict(loss_inference=loss_inference, val_loss=val_loss)
        rows.append(harness.make_row(name, top_k=k, **cost_figures(block_size, k, preset, nb),
                                     loss_inference=loss_inference,
                                     gap_inference=round(loss_inference - dense["loss_inference"], 4),
                                     val_loss=val_loss, gap_uptrained=round(val_loss - dense["val_loss"], 4)))
    return rows


def headline(rows, block_size, steps):
    """The README's row: each top-k's share of dense's KV bytes and its loss gap, inference only / uptrained."""
    dense, rest = rows[0], rows[1:]
    return dict(technique=f"MoBA, blocks of {block_size}, {steps} uptraining steps",
                figure="loss against dense at inference only / uptrained: " + ", ".join(
                    f"top-{row['top_k']} ({row['kv_kb_token'] / dense['kv_kb_token']:.0%} of the KV bytes) "
                    f"{row['gap_inference']:+.4f} / {row['gap_uptrained']:+.4f}" for row in rest))


def parse_args(argv):
    """The flags, checked before any work: (args, preset, device, data)."""
    parser = harness.script_parser(__doc__)
    add = parser.add_argument
    add("--block-size", type=harness.int_at_least(1), default=16, help="tokens per key block")
    add("--top-k", type=harness.int_at_least(1), nargs="+", default=[4, 2, 1],
        help="blocks read per query (its own included), one variant each; dense attention is added as the control")
    add("--uptrain-steps", type=harness.steps, default=None,
        help="MoBA training steps of every variant (default: 5%% of the preset's)")
    add("--lr", type=harness.learning_rate, default=None, help="peak learning rate of uptraining (default: preset's / 3)")
    add("--val-batches", type=harness.batches, default=20, help="validation batches (of 32 x seqlen) for the loss")
    add("--no-flex", action="store_true", help="leave FlexAttention out: the explicit mask everywhere")
    args = parser.parse_args(argv)

    def check_args(preset):
        if args.block_size >= preset.seqlen:
            parser.error(f"--block-size {args.block_size} does not fit the {preset.seqlen}-token window in more "
                         f"than one block; choose one below {preset.seqlen}")
        nb = n_blocks(preset.seqlen, args.block_size)
        if max(args.top_k) >= nb or len(set(args.top_k)) != len(args.top_k):
            parser.error(f"--top-k: distinct values below the {nb} blocks of {args.block_size} tokens in the window "
                         f"(top-k = {nb} is dense attention, which is always run), got {args.top_k}")
    return (args, *harness.setup(args, parser, check_args))


def main(argv=None):
    args, preset, device, data = parse_args(argv)
    steps, lr = training.uptrain_budget(preset, args.uptrain_steps, args.lr)
    config, nb = preset.gptlite_kwargs(), n_blocks(preset.seqlen, args.block_size)
    top_ks = sorted(args.top_k, reverse=True)

    base = iu.load_model(GPTlite, preset, device, data, untrained=args.untrained, seed=args.seed)
    flex, flex_diff, flex_note = (None, None, "left out (--no-flex)") if args.no_flex else \
        make_flex_check(args.block_size, top_ks[-1], device)
    window = corpus.get_batch(data.val, 8, preset.seqlen, torch.Generator().manual_seed(args.seed), device)[0]
    checks = run_checks(base, config, window, args.block_size, top_ks, flex)  # correctness first
    if flex_diff is not None:
        checks[f"flex = mask on random inputs (max |diff| {flex_diff:.1e})"] = flex_diff <= FLEX_ATOL
    harness.require_checks(checks)  # nothing trained or written unless they pass

    rebuild = files.rebuild_command("main_moba.py", argv, preset)
    rows = variant_rows(base, config, data, preset, args.block_size, top_ks, flex, steps, lr, args.seed,
                        args.val_batches, rebuild, args.untrained)
    attention = "FlexAttention (block mask) at evaluation" if flex is not None else "an explicit mask"
    print(f"\nblocks of {args.block_size} tokens, {nb} in the {preset.seqlen}-token window; {steps} uptraining steps "
          f"at peak lr {lr:g} for every row; attention through {attention}, uptraining on {device} "
          f"{'with the explicit mask' if device.type == 'cpu' or flex is None else 'through FlexAttention'}")
    dense, sparsest = rows[0], rows[-1]
    summary = [f"loss_inference: MoBA applied to the dense checkpoint as it is; val_loss: after {steps} steps with "
               "MoBA (dense: the same steps, the control); gap_*: against dense",
               f"kflops_token, kv_kb_token: attention FLOPs and K/V bytes (float32, {preset.n_layers} layers, "
               f"mean keys of the router included) of the token decoded at position {preset.seqlen}",
               f"top-{sparsest['top_k']} reads {sparsest['kv_kb_token'] / dense['kv_kb_token']:.0%} of dense's KV "
               f"bytes at {preset.seqlen} tokens: gap {sparsest['gap_inference']:+.4f} at inference only, "
               f"{sparsest['gap_uptrained']:+.4f} uptrained",
               f"FlexAttention: {flex_note or 'used for evaluation'}"]
    summary += [f"check {name}: {'ok' if ok else 'NO'}" for name, ok in checks.items()]
    harness.report(args, "main_moba.py", preset, device, rows, headline(rows, args.block_size, steps), summary=summary,
                   plot=lambda: plot_results(rows, preset, args.block_size), block_size=args.block_size, n_blocks=nb,
                   uptrain_steps=steps, lr=lr, checks=checks, flex_max_diff=flex_diff, flex_note=flex_note)


if __name__ == "__main__":
    harness.run(main)
