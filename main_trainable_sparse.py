"""Trainable sparse attention: MoBA, NSA and DSA on the dense checkpoint, at inference only and uptrained.

    python main_trainable_sparse.py                       # cpu preset on CPU, gptlite on CUDA
    python main_trainable_sparse.py --uptrain-steps 80 --json tsparse.json --plot tsparse.png
    python main_trainable_sparse.py --untrained --uptrain-steps 1 --dsa-warmup-steps 1 --val-batches 1 \\
        --bench-contexts 256 512 --bench-repeats 1            # a quick smoke run

Blog section: "Sparse attention". Three ways to let each query read a few of the past keys, chosen by
something trained (or trainable) with the model:
- MoBA (gptlite_moba.py): blocks of keys ranked by the query's dot product with each block's mean key; top-k
  blocks, its own among them.
- NSA (gptlite_nsa.py): a compressed branch over block summaries, whose scores also rank the blocks for an
  exact selected branch (top-n blocks, the first and its own among them), and a sliding window; learned
  sigmoid gates mix the three.
- DSA (gptlite_dsa.py, its training lib/dsa.py): a small "lightning indexer" scores every past token; the top-k tokens are attended.
Each is applied to the trained dense GPTlite (its Q, K, V weights) and evaluated as it is (inference only),
then uptrained for the same short budget; dense attention gets the same uptraining as the control, so the
gap left is the cost of the sparsity. DSA's indexer is new, so as in DeepSeek-V3.2 it is first warmed up
(dense model frozen, the indexer fitted by a KL loss to the dense attention) BEFORE its inference-only loss
is measured, and its uptraining is DSA's sparse stage (cross-entropy plus the indexer's KL loss over the
selected keys); the second table gives its indexer's recall after each stage. MoBA and NSA start from the
dense checkpoint with nothing to warm up (MoBA's router has no parameters; NSA's gates start at 0.018 for
the compressed branch, 0.5 for the selected and window branches) and are uptrained with cross-entropy.

The defaults read a similar number of keys per query at the full 128-token window: MoBA 3 blocks of 16
(48 keys), NSA 3 selected blocks of 8 + a window of 8 + 16 block summaries (48), DSA top-48 (48 keys plus
the indexer's scoring of every past token, in the FLOPs column). The keys per query in the table are
counted from the selections the models make on validation text and checked against each method's formula.

The third part times ONE decode query over a random cache of 4k to 32k tokens (batch 1, the preset's heads),
dense SDPA against each method's decode step with its selection included (MoBA: scores against the cached
mean keys, top-k, a gather; NSA: the compressed scores, top-n, a gather, the window; DSA: the indexer over
every cached token, top-k, a gather). At those lengths the methods keep the papers' fixed budgets, not the
128-token window's: MoBA blocks of 512, top-4; NSA blocks of 64, top-16, a window of 512 (NSA's paper: 64-token
selection blocks, 16 of them, a 512-token window); DSA top-2048 (DeepSeek-V3.2's): 2,048 keys each at 32k.

Checks first: MoBA with every block, NSA with its gates fixed to the selected branch and every block, and
DSA with top-k >= the window each give GPTlite's logits; the keys counted equal the formulas. Nothing is
trained or written unless they pass. Uptrained models are saved as
checkpoints/<preset>_tsparse_<method and settings>_s<steps>.pt and reused by later runs with the same base
checkpoint, learning rate and seed.
"""
import torch
import torch.nn.functional as F

import gptlite_dsa
import gptlite_moba
import gptlite_nsa
import inference_utils as iu
from gptlite import GPTlite
from lib import attention_benchmark, attention_summary, corpus, dsa, files, harness, moba, nsa, training

ATOL = 1e-5  # float32 logits (units to tens) of the dense-equivalent settings against GPTlite's
BENCH_MOBA = (512, 4)        # block size, top-k: the microbenchmark's MoBA at 4k-32k tokens
BENCH_NSA = (64, 16, 512)    # block size, top-n, window
BENCH_DSA = 2048             # top-k


# ----------------------------------------------------------------------------------------------------
# The models: the dense checkpoint's weights in each method.

def dense_copy(base):
    model = GPTlite(**base.config.to_dict())
    model.load_state_dict(base.state_dict())
    return model.to(next(base.parameters()).device).eval()


def moba_from_dense(base, block_size, top_k):
    model = gptlite_moba.GPTlite_MoBA(**base.config.to_dict(), block_size=block_size, top_k=top_k)
    model.load_state_dict(base.state_dict())  # the router has no weights: GPTlite's state dict exactly
    return model.to(next(base.parameters()).device).eval()


def mha_inputs(model, windows):
    """The input of every layer's attention (ln1's output) on windows [B, S]: a list of [B, S, d_model]."""
    inputs, hooks = [], [block.mha.register_forward_pre_hook(lambda m, a: inputs.append(a[0]))
                         for block in model.blocks]
    try:
        with torch.no_grad():
            model(windows)
    finally:
        for hook in hooks:
            hook.remove()
    return inputs


def counted_keys(model, method, windows):
    """The keys each query attends to, counted from the method's own selection in every layer: a list of
    [B, H, S] (DSA's selection is shared by the heads: [B, 1, S])."""
    counts = []
    for block, x in zip(model.blocks, mha_inputs(model, windows)):
        mha, S = block.mha, x.shape[1]
        with torch.no_grad():
            Q, K = mha.split_heads(mha.query_proj(x)), mha.split_heads(mha.key_proj(x))  # [B, H, S, D]
            if method == "MoBA":
                counts.append(gptlite_moba.moba_mask(gptlite_moba.select_blocks(Q, K, mha.block_size, mha.top_k), mha.block_size,
                                             S).sum(-1))
            elif method == "NSA":
                selected = gptlite_nsa.selected_mask(gptlite_nsa.select_blocks(Q, K, mha.block_size, mha.top_n), mha.block_size, S)
                compressed = gptlite_nsa.compressed_scores(Q, K, mha.block_size) > float("-inf")  # [B, H, S, nc]
                counts.append(selected.sum(-1) + gptlite_nsa.window_mask(S, S, mha.window, x.device).sum(-1)
                              + compressed.sum(-1))
            else:
                counts.append(gptlite_dsa.select_topk(mha.indexer(x), mha.top_k).sum(-1)[:, None])  # [B, 1, S]
    return counts


def keys_formula(method, settings, position):
    if method == "MoBA":
        return moba.keys_read(position, *settings)
    if method == "NSA":
        return sum(nsa.keys_read(position, *settings))
    if method == "DSA":
        return dsa.keys_read(position, settings[0])
    return position + 1


def cost(method, settings, preset):
    """Attention FLOPs and KV bytes read by the token decoded at the full window, all layers."""
    S, dims = preset.seqlen, (preset.n_heads, preset.d_head, preset.n_layers)
    if method == "MoBA":
        return moba.attention_cost(S - 1, *settings, *dims)
    if method == "NSA":
        return nsa.attention_cost(S - 1, *settings, *dims)
    if method == "DSA":
        return dsa.attention_cost(S - 1, settings[0], *dims, n_index_heads=settings[1], d_index=settings[2])
    return moba.attention_cost(S - 1, None, 1, *dims)  # dense: every key, no router


@torch.no_grad()
def run_checks(base, window, preset, methods):
    """{name: ok}: each method in its dense-equivalent setting gives GPTlite's logits; the keys counted from
    each method's selection equal its formula at every position, in every layer, head and window."""
    S, reference = preset.seqlen, base(window)
    nb = gptlite_moba.n_blocks(S, methods["MoBA"][0])
    diffs = {"MoBA, every block": (moba_from_dense(base, methods["MoBA"][0], nb)(window) - reference),
             "NSA, gates (0, 1, 0), every block": (nsa.nsa_from_dense(
                 base, methods["NSA"][0], gptlite_nsa.n_blocks(S, methods["NSA"][0]), methods["NSA"][2]).fix_gates(
                 (0, 1, 0))(window) - reference),
             f"DSA, top-{S}": dsa.dsa_from_dense(base, S, *methods["DSA"][1:])(window) - reference}
    checks = {}
    for name, diff in diffs.items():
        diff = diff.abs().max().item()
        checks[f"{name}: GPTlite's logits (max |diff| {diff:.1e})"] = diff <= ATOL
    for method, model in build_sparse(base, methods).items():
        expected = torch.tensor([keys_formula(method, methods[method], p) for p in range(S)], device=window.device)
        checks[f"{method}: keys counted = formula"] = all(bool((c == expected).all())
                                                          for c in counted_keys(model, method, window))
    return checks


def build_sparse(base, methods):
    """Each method on the dense checkpoint as it is (DSA with its new, untrained indexers)."""
    return {"MoBA": moba_from_dense(base, *methods["MoBA"]), "NSA": nsa.nsa_from_dense(base, *methods["NSA"]),
            "DSA": dsa.dsa_from_dense(base, *methods["DSA"])}


# ----------------------------------------------------------------------------------------------------
# Uptraining, one budget for every row.

def method_rows(base, data, preset, methods, steps, lr, warmup_steps, warmup_lr, seed, val_batches, rebuild,
                untrained):
    """Dense (the control), MoBA, NSA and DSA: the loss as applied to the dense checkpoint (DSA: after its
    indexer warm-up), then after `steps` of uptraining (cached checkpoints, never saved when untrained), the
    keys per query and the costs; and DSA's stages (indexer recall, KL) as a second list of rows."""
    base_sha = None if untrained else files.load_checkpoint(files.checkpoint_path(preset.name))["sha256"]
    meta = dict(base_sha256=base_sha, uptrain_steps=steps, lr=lr, seed=seed)
    S, device = preset.seqlen, next(base.parameters()).device
    windows = dsa.validation_windows(data, 8, S, seed + 2, device)
    def path(tag, n):
        return None if untrained else files.checkpoint_path(f"{preset.name}_tsparse_{tag}_s{n}")
    models = {"dense": dense_copy(base), **build_sparse(base, methods)}
    tags = dict(dense="dense", MoBA="moba_b{}_k{}".format(*methods["MoBA"]),
                NSA="nsa_b{}_n{}_w{}".format(*methods["NSA"]), DSA="dsa_k{}_h{}_d{}".format(*methods["DSA"]))
    labels = dict(dense="dense", MoBA="MoBA (blocks of {}, top-{})".format(*methods["MoBA"]),
                  NSA="NSA (blocks of {}, top-{}, window {})".format(*methods["NSA"]),
                  DSA="DSA (top-{}, indexer {} x {})".format(*methods["DSA"]))
    top_k = methods["DSA"][0]
    recall_from = min(top_k, S - 1)  # the first top_k queries read every key: a recall of 1 by construction
    stages = [dict(stage="untrained indexer", indexer_recall=dsa.indexer_recall(models["DSA"], windows,
                                                                                from_position=recall_from),
                   indexer_kl=dsa.kl_on_windows(models["DSA"], windows, dense=True))]
    warm_meta = dict(meta, uptrain_steps=warmup_steps, lr=warmup_lr)
    models["DSA"] = moba.uptrained(
        models["DSA"], "DSA warm-up", path(tags["DSA"] + "_warmup", warmup_steps), warm_meta, data, preset,
        warmup_steps, warmup_lr, seed, rebuild,
        train=lambda m: dsa.warmup_indexer(m, data, warmup_steps, warmup_lr, preset.batch_size, seed=seed))
    stages.append(dict(stage=f"after the warm-up ({warmup_steps} steps, dense, indexer only)",
                       indexer_recall=dsa.indexer_recall(models["DSA"], windows, from_position=recall_from),
                       indexer_kl=dsa.kl_on_windows(models["DSA"], windows, dense=True)))
    rows = []
    for method, model in models.items():
        settings = methods.get(method)
        loss_inference = training.validation_loss(model, data, n_batches=val_batches)
        train = None
        if method == "DSA":
            train = lambda m: dsa.sparse_uptrain(m, data, steps, lr, preset.batch_size, seed=seed)  # noqa: E731
        model = moba.uptrained(model, method, path(tags[method], steps), meta, data, preset, steps, lr, seed, rebuild,
                               train=train)
        val_loss = training.validation_loss(model, data, n_batches=val_batches)
        if method == "DSA":
            stages.append(dict(stage=f"after sparse training ({steps} steps)",
                               indexer_recall=dsa.indexer_recall(model, windows, from_position=recall_from),
                               indexer_kl=dsa.kl_on_windows(model, windows, dense=True), val_loss=val_loss))
            stages[1]["val_loss"] = loss_inference
        dense = rows[0] if rows else dict(loss_inference=loss_inference, val_loss=val_loss)
        flops, kv_bytes = cost(method, settings, preset)
        rows.append(harness.make_row(
            labels[method],
            keys_per_query=round(sum(keys_formula(method, settings, p) for p in range(S)) / S, 2),
            keys_last=keys_formula(method, settings, S - 1), kflops_token=round(flops / 1e3, 1),
            kv_kb_token=round(kv_bytes / 2**10, 1), loss_inference=loss_inference,
            gap_inference=round(loss_inference - dense["loss_inference"], 4), val_loss=val_loss,
            gap_uptrained=round(val_loss - dense["val_loss"], 4)))
    stages[0]["val_loss"] = None
    return rows, stages


# ----------------------------------------------------------------------------------------------------
# The decode microbenchmark on random tensors.

def dense_decode(q, K, V):
    return F.scaled_dot_product_attention(q, K, V)  # [B, H, 1, D]: one query sees the whole cache


def decode_variants(d_index, n_index_heads, seed):
    """{name: decode step} and {name: what its cache keeps beside K and V}, the microbenchmark's settings."""
    generator = torch.Generator().manual_seed(seed)

    def dsa_cache(K, V):  # the index keys of the cache and the query token's index query and weights
        B, n = K.shape[0], K.shape[2]
        keys, q = torch.randn(B, n, d_index, generator=generator), torch.randn(B, n_index_heads, d_index,
                                                                                generator=generator)
        return keys.to(K.device), q.to(K.device), torch.rand(B, n_index_heads, generator=generator).to(K.device)
    variants = {"dense (SDPA)": dense_decode,
                "MoBA": lambda q, K, V, means: moba.moba_decode(q, K, V, means, *BENCH_MOBA),
                "NSA": lambda q, K, V, Kc, Vc: nsa.nsa_decode(q, K, V, Kc, Vc, *BENCH_NSA),
                "DSA": lambda q, K, V, keys, iq, iw: dsa.dsa_decode(q, K, V, iq, iw, keys, BENCH_DSA)}
    caches = {"MoBA": lambda K, V: (gptlite_moba.block_mean_keys(K, BENCH_MOBA[0]),),
              "NSA": lambda K, V: (gptlite_nsa.compress(K, BENCH_NSA[0]), gptlite_nsa.compress(V, BENCH_NSA[0])),
              "DSA": dsa_cache}
    return variants, caches


def bench_keys(n):
    """Keys (and summaries) each decode step reads at a cache of n tokens."""
    return {"MoBA": moba.keys_read(n - 1, *BENCH_MOBA), "NSA": sum(nsa.keys_read(n - 1, *BENCH_NSA)),
            "DSA": dsa.keys_read(n - 1, BENCH_DSA)}


def bench_rows(results, contexts):
    rows = []
    for i, n in enumerate(contexts):
        ms = {name: r["ms"][i] for name, r in results.items()}
        dense = ms["dense (SDPA)"]
        row = dict(context=n, dense_ms=round(dense, 3))
        for method, keys in bench_keys(n).items():
            row.update({f"{method.lower()}_keys": keys, f"{method.lower()}_ms": round(ms[method], 3),
                        f"{method.lower()}_speedup": round(dense / ms[method], 2)})
        rows.append(row)
    return rows


BENCH_COLUMNS = [("context", "context", "{}"), ("dense_ms", "dense ms", "{:.3f}")] + [
    c for m, name in (("moba", "MoBA"), ("nsa", "NSA"), ("dsa", "DSA"))
    for c in ((f"{m}_keys", f"{name} keys", "{}"), (f"{m}_ms", f"{name} ms", "{:.3f}"),
              (f"{m}_speedup", f"{name} vs dense", "{:.2f}x"))]
STAGE_COLUMNS = [("stage", "DSA stage", "{}"), ("indexer_recall", "indexer recall", "{:.3f}"),
                 ("indexer_kl", "indexer KL", "{:.4f}"), ("val_loss", "val loss", "{:.4f}")]


# ----------------------------------------------------------------------------------------------------
# Report.

def plot_results(rows, bench, preset):
    fig, (ax_loss, ax_time) = harness.new_figure(2)
    for r in rows[1:]:
        line, = ax_loss.plot([r["keys_per_query"]] * 2, [r["loss_inference"], r["val_loss"]], linestyle=":")
        ax_loss.scatter([r["keys_per_query"]], [r["loss_inference"]], marker="x", color=line.get_color())
        ax_loss.scatter([r["keys_per_query"]], [r["val_loss"]], marker="o", color=line.get_color(), label=r["variant"])
    ax_loss.axhline(rows[0]["loss_inference"], color="gray", linestyle="--", label="dense")
    ax_loss.axhline(rows[0]["val_loss"], color="gray", label="dense, same uptraining")
    ax_loss.set(xlabel=f"keys read per query, mean over a {preset.seqlen}-token window",
                ylabel="validation loss (nats/char)", title="x: inference only, o: uptrained")
    ax_loss.legend(fontsize=8)
    contexts = [r["context"] for r in bench]
    ax_time.plot(contexts, [r["dense_ms"] for r in bench], marker="o", label="dense (SDPA)")
    for m, label in (("moba", "MoBA"), ("nsa", "NSA"), ("dsa", "DSA")):
        ax_time.plot(contexts, [r[f"{m}_ms"] for r in bench], marker="o", label=f"{label}, selection included")
    ax_time.set(xscale="log", yscale="log", xlabel="cached tokens", ylabel="ms per decode query (median)",
                title=f"one decode query, batch 1, {preset.n_heads} heads of {preset.d_head}")
    ax_time.set_xscale("log", base=2)
    ax_time.legend(fontsize=8)
    return fig


def summary_rows(rows, bench, steps, warmup_steps, preset):
    """The post's summary table: one row per sparse method."""
    dense, contexts = rows[0], [r["context"] for r in bench]
    out = []
    for r, m in zip(rows[1:], ("moba", "nsa", "dsa")):
        trained = steps + (warmup_steps if m == "dsa" else 0)
        training_text = (f"{warmup_steps} indexer warm-up + {steps} sparse steps" if m == "dsa"
                         else f"{steps} uptraining steps")
        out.append(attention_summary.method_row(
            r["variant"], False, f"val loss {r['gap_uptrained']:+.4f} against dense after uptraining "
            f"({r['gap_inference']:+.4f} at inference only)", trained, training_text,
            "attention FLOPs and KV bytes read per token",
            f"{dense['kflops_token'] / r['kflops_token']:.1f}x fewer FLOPs, "
            f"{dense['kv_kb_token'] / r['kv_kb_token']:.1f}x "
            f"fewer KV bytes at {preset.seqlen} tokens ({r['keys_last']} of {preset.seqlen} keys); decode attention "
            f"{bench[-1][f'{m}_ms']:.3f} ms against SDPA's {bench[-1]['dense_ms']:.3f} at {contexts[-1]:,} tokens",
            attention_summary.pays_from(contexts, [b[f"{m}_ms"] for b in bench], [b["dense_ms"] for b in bench])))
    return out


def parse_args(argv):
    """The flags, checked before any work: (args, preset, device, data)."""
    parser = harness.script_parser(__doc__)
    add = parser.add_argument
    add("--moba-block", type=harness.int_at_least(1), default=16, help="MoBA: tokens per key block")
    add("--moba-top-k", type=harness.int_at_least(1), default=3, help="MoBA: blocks per query, its own included")
    add("--nsa-block", type=harness.int_at_least(1), default=8, help="NSA: tokens per compression/selection block")
    add("--nsa-top-n", type=harness.int_at_least(1), default=3,
        help="NSA: selected blocks per query, its own and the first included")
    add("--nsa-window", type=harness.int_at_least(1), default=8, help="NSA: sliding-window tokens, the query included")
    add("--dsa-top-k", type=harness.int_at_least(1), default=48, help="DSA: tokens per query")
    add("--dsa-index-heads", type=harness.int_at_least(1, 1024), default=4, help="DSA: indexer heads")
    add("--dsa-d-index", type=harness.int_at_least(1, harness.MAX_SIZE), default=16, help="DSA: indexer dimensions")
    add("--dsa-warmup-steps", type=harness.steps, default=40, help="DSA: dense indexer warm-up steps")
    add("--dsa-warmup-lr", type=harness.learning_rate, default=1e-3, help="DSA: warm-up learning rate")
    add("--uptrain-steps", type=harness.steps, default=40, help="uptraining steps of every row")
    add("--lr", type=harness.learning_rate, default=None,
        help="peak learning rate of uptraining (default: preset's / 3)")
    add("--val-batches", type=harness.batches, default=10,
        help="validation batches (of 32 x seqlen) for the loss")
    add("--bench-contexts", type=harness.int_at_least(2), nargs="+", default=[4096, 8192, 16384, 32768],
        help="cache lengths of the decode microbenchmark")
    add("--bench-repeats", type=harness.repeats, default=15, help="timed rounds per context (median)")
    args = parser.parse_args(argv)

    def check_args(preset):
        S = preset.seqlen
        for flag, block in (("--moba-block", args.moba_block), ("--nsa-block", args.nsa_block)):
            if block >= S:
                parser.error(f"{flag} {block} does not fit the {S}-token window in more than one block; "
                             f"choose one below {S}")
        for flag, value, blocks in (("--moba-top-k", args.moba_top_k, gptlite_moba.n_blocks(S, args.moba_block)),
                                    ("--nsa-top-n", args.nsa_top_n, gptlite_nsa.n_blocks(S, args.nsa_block))):
            if value >= blocks:
                parser.error(f"{flag} {value} reads every one of the {blocks} blocks: dense attention, which is "
                             f"the control row; choose fewer")
        if args.nsa_window >= S:
            parser.error(f"--nsa-window {args.nsa_window} covers the whole {S}-token window: choose one below {S}")
        if args.dsa_top_k >= S:
            parser.error(f"--dsa-top-k {args.dsa_top_k} reads every key of the {S}-token window: choose one below {S}")
        if sorted(set(args.bench_contexts)) != args.bench_contexts:
            parser.error(f"--bench-contexts: distinct lengths in increasing order, got {args.bench_contexts}")
    return (args, *harness.setup(args, parser, check_args))


def headline(rows, steps, seqlen):
    """The README's row: each method's loss gap to dense, at inference only and uptrained."""
    return dict(technique=f"Trainable sparse attention (MoBA, NSA, DSA), {steps} uptraining steps",
                figure=f"loss against dense at inference only / uptrained, at about {rows[1]['keys_last']} of {seqlen} "
                       "keys: " + ", ".join(f"{r['variant'].split(' ')[0]} {r['gap_inference']:+.4f} / "
                                            f"{r['gap_uptrained']:+.4f}" for r in rows[1:]))


def main(argv=None):
    args, preset, device, data = parse_args(argv)
    steps, lr = training.uptrain_budget(preset, args.uptrain_steps, args.lr)
    methods = {"MoBA": (args.moba_block, args.moba_top_k), "NSA": (args.nsa_block, args.nsa_top_n, args.nsa_window),
               "DSA": (args.dsa_top_k, args.dsa_index_heads, args.dsa_d_index)}

    base = iu.load_model(GPTlite, preset, device, data, untrained=args.untrained, seed=args.seed)
    window = corpus.get_batch(data.val, 8, preset.seqlen, torch.Generator().manual_seed(args.seed), device)[0]
    checks = run_checks(base, window, preset, methods)  # correctness first
    harness.require_checks(checks)  # nothing trained or written unless they pass

    rebuild = files.rebuild_command("main_trainable_sparse.py", argv, preset)
    rows, stages = method_rows(base, data, preset, methods, steps, lr, args.dsa_warmup_steps, args.dsa_warmup_lr,
                               args.seed, args.val_batches, rebuild, args.untrained)
    variants, caches = decode_variants(args.dsa_d_index, args.dsa_index_heads, args.seed)
    results = attention_benchmark.benchmark(variants, args.bench_contexts, 1, preset.n_heads, preset.d_head, device,
                                            repeats=args.bench_repeats, seed=args.seed, n_queries=1,
                                            peak_memory=False, caches=caches)
    bench = bench_rows(results, args.bench_contexts)
    tables = [harness.table("DSA's indexer after each stage (recall: the dense attention's mass on its top-k keys, "
                            f"queries from position {min(args.dsa_top_k, preset.seqlen - 1)} on)", stages,
                            STAGE_COLUMNS),
              harness.table(f"one decode query over a random cache (batch 1, {preset.n_heads} heads of "
                            f"{preset.d_head}, "
                            f"median of {args.bench_repeats}, selection included; MoBA blocks of {BENCH_MOBA[0]} "
                            f"top-{BENCH_MOBA[1]}, NSA blocks of {BENCH_NSA[0]} top-{BENCH_NSA[1]} window "
                            f"{BENCH_NSA[2]}, DSA top-{BENCH_DSA})", bench, BENCH_COLUMNS)]
    last = bench[-1]
    summary = [f"loss_inference: each method applied to the dense checkpoint as it is (DSA: after its "
               f"{args.dsa_warmup_steps}-step indexer warm-up); val_loss: after {steps} uptraining steps at peak lr "
               f"{lr:g} (dense: the same steps, the control; DSA: its sparse stage); gap_*: against dense",
               f"keys_per_query: mean over the {preset.seqlen} positions of a window (counted from the selections, "
               f"= the formulas); keys_last, kflops_token, kv_kb_token: the token decoded at position {preset.seqlen} "
               f"(float32, {preset.n_layers} layers; MoBA's mean keys, NSA's summaries, DSA's indexer included)",
               f"decode at {last['context']:,} tokens: dense {last['dense_ms']:.3f} ms, MoBA {last['moba_ms']:.3f}, "
               f"NSA {last['nsa_ms']:.3f}, DSA {last['dsa_ms']:.3f} ms"]
    summary += [f"check {name}: {'ok' if ok else 'NO'}" for name, ok in checks.items()]
    harness.report(args, "main_trainable_sparse.py", preset, device, rows, headline(rows, steps, preset.seqlen),
                   summary=summary, tables=tables,
                   plot=lambda: plot_results(rows, bench, preset), methods={k: list(v) for k, v in methods.items()},
                   uptrain_steps=steps, lr=lr, dsa_warmup_steps=args.dsa_warmup_steps, checks=checks,
                   bench_settings=dict(moba=list(BENCH_MOBA), nsa=list(BENCH_NSA), dsa=BENCH_DSA),
                   attention_methods=summary_rows(rows, bench, steps, args.dsa_warmup_steps, preset))


if __name__ == "__main__":
    harness.run(main)
