"""Linear attention, gating, the delta rule, KDA and 3:1 hybrids, trained and measured against softmax GPTlite.

    python main_linear_attention.py                    # cpu preset: trains the missing checkpoints first
    python main_linear_attention.py --full-recipe      # every language model with the preset's 800 steps
    python main_linear_attention.py --contexts 128 512 2048 --json linear.json --plot linear.png
    python main_linear_attention.py --untrained --contexts 128 256 --recall-steps 2   # a quick smoke run
    python main_linear_attention.py --recall-full      # recall part: Zoology-like recipe (minutes per model)

Blog section: "Linear attention and hybrid models". Three parts, each with its own table:
1. Quality: GPTlite_Linear with the rules "linear", "gated", "delta" (Gated DeltaNet) and "kda" (Kimi Delta
   Attention, a decay per key channel), and two hybrids with full attention in every 4th block (Kimi
   Linear's 3:1): "hybrid" (delta rule + softmax with a KV cache) and "kda+mla" (KDA + multi-head latent
   attention, Kimi Linear's own pair). Every model, a softmax GPTlite control included, is trained from
   scratch with the preset's recipe (batch, learning rate, schedule) for the same number of steps:
   --lm-iters (default 80, so that the first run fits in 10 minutes on 2 CPU cores) or, with
   --full-recipe, the preset's own (800 for cpu; the control is then the preset's checkpoint). Files:
   checkpoints/<preset>_linear_<name>_i<steps>.pt (<preset>_linear_<name>.pt with --full-recipe).
   Validation loss against the control's: a comparison at equal training, short of converged models at
   the default budget.
2. Memory and time against context length: the cache of one sequence (the linear layers' state is
   constant, the KV cache grows with the context) and the TPOT of greedy decoding after a prompt of each
   length. The linear models have no position table and run at any length; softmax GPTlite's table has
   seqlen rows, so beyond it the softmax rows are timed with its last position row repeated: timing
   only (decoding cost does not depend on the weights' values), its text there is not meaningful.
3. Recall (Zoology's MQAR, lib/recall.py): key-value pairs, then each key queried once; one small model
   of each kind (softmax, hybrid, and every rule of gptlite_linear.RULES) trained on a mix of pair
   counts (checkpoints/mqar_<settings>_<name>.pt), the loss on the answers only; accuracy against the
   number of pairs and against the bytes of the state or KV cache. A fixed-size state must hold every
   pair; a KV cache keeps them all. The CPU default is a short recipe (RECALL_QUICK below);
   --recall-full runs a Zoology-like one (RECALL_FULL: more steps, wider models).

Checks first: every linear model's chunked form gives the logits of its recurrent form, and prefill
plus one-token decoding with the carried state gives the logits of the full pass. Nothing is written
unless they pass.
"""
import dataclasses

import torch
from tqdm import tqdm

import inference_utils as iu
from gptlite import decode_loop
from gptlite_kvcache import GPTlite_KVCache
from gptlite_linear import GPTlite_Linear, linear_config
from gptlite_mla import max_latent
from lib import attention_summary, corpus, files, harness, training
from lib import recall as mqar

# float32 logits (units to tens): the chunked form sums the same terms in another order. The "linear" rule's
# undecayed sums of up to 128 positive terms differ by up to 2e-4 on the trained model (1e-13 in float64).
ATOL = 1e-3
LM_ITERS = 80  # the default training steps of every language model (the preset's recipe: --full-recipe)
# The language models: linear_config's arguments. "hybrid": Gated DeltaNet with softmax attention in every 4th
# block; "kda+mla": Kimi Linear's layout, KDA with MLA (a latent cache, d_latent from --d-latent) every 4th.
KINDS = {"linear": dict(rule="linear"), "gated": dict(rule="gated"), "delta": dict(rule="delta"),
         "hybrid": dict(rule="delta", hybrid_every=4), "kda": dict(rule="kda"),
         "kda+mla": dict(rule="kda", hybrid_every=4, hybrid_attention="mla")}
METHODS = {"linear": "linear attention (elu + 1)", "gated": "gated linear attention (scalar decay)",
           "delta": "Gated DeltaNet", "hybrid": "Gated DeltaNet + softmax, 3:1", "kda": "Kimi Delta Attention (KDA)",
           "kda+mla": "KDA + MLA, 3:1 (Kimi Linear)"}  # the summary table's names
# The recall recipes (lib/recall.py; the flags override them). The CPU default: sequences of 16 tokens, 8 keys,
# 600 steps of 256 sequences of 1 to 4 pairs a model (a pair alone is answered by position, so the table starts
# at 2). Batches of 256 at lr 1e-3: softmax GPTlite solved the task for every seed tried; batches of 64 (2,000
# steps) or lr 3e-3 left it on the plateau for some seeds. The full one is Zoology-like (its smallest task, 64
# tokens and up to 16 pairs): far longer, not run on CPU here.
RECALL_QUICK = dict(pairs=[2, 3, 4], keys=8, seqlen=16, steps=600, lr=1e-3, batch_size=256, d_model=None)
RECALL_FULL = dict(pairs=[2, 4, 8, 12, 16], keys=32, seqlen=64, steps=4000, lr=1e-3, batch_size=256, d_model=None)


def train_language_models(preset, data, device, untrained, seed, rebuild, iters, d_latent):
    """Softmax GPTlite (the control) and every kind of KINDS, all trained with the preset's recipe (batch,
    learning rate, schedule) for the same `iters` steps, each cached as checkpoints/<preset>_linear_<name>_i<iters>.pt.
    At the preset's own step count (--full-recipe) the control is the preset's checkpoint (the same recipe) and
    the files are checkpoints/<preset>_linear_<name>.pt, as before the step count was a flag."""
    recipe = iu.preset_recipe(preset, iters=iters, seed=seed)
    seconds = {}
    if iters == preset.iters:
        models = {"softmax": iu.load_model(GPTlite_KVCache, preset, device, data, untrained=untrained, seed=seed)}
        kinds = dict(KINDS)
    else:
        models, kinds = {}, {"softmax": None, **KINDS}
    for name, kind in kinds.items():
        config = preset.gptlite_kwargs() if kind is None else linear_config(
            preset.gptlite_kwargs(), **kind, **({"d_latent": d_latent} if kind.get("hybrid_attention") else {}))
        model_class = GPTlite_KVCache if kind is None else GPTlite_Linear
        torch.manual_seed(seed)
        train = lambda m, name=name: iu.train_recipe(m, data, recipe, f"training {name}")  # noqa: E731
        suffix = "" if iters == preset.iters else f"_i{iters}"
        path = files.checkpoint_path(f"{preset.name}_linear_{name.replace('+', '_')}{suffix}")
        models[name], seconds[name] = iu.cached_model(model_class(**config).to(device), config, path, train,
                                                      data.vocab, rebuild, stamp=recipe, untrained=untrained)
    return models, seconds


@torch.inference_mode()
def forms_agree(model, window):
    """Chunked against recurrent form, and prefill + decode with the carried state against the full pass."""
    chunked, _ = model(window, form="chunked")
    recurrent, _ = model(window, form="recurrent")
    return (chunked - recurrent).abs().max().item() <= ATOL and training.cached_matches_full(model, window, ATOL)


def long_softmax(model, context):
    """Softmax GPTlite with a position table of `context` rows: the trained rows, then the last one repeated
    (timing only beyond the trained window)."""
    if context <= model.seqlen:
        return model
    state = dict(model.state_dict())
    table = state["position_embedding.weight"]
    state["position_embedding.weight"] = torch.cat([table, table[-1:].expand(context - len(table), -1)])
    long = GPTlite_KVCache.from_config(dataclasses.replace(model.config, seqlen=context)).to(table.device).eval()
    long.load_state_dict(state)
    return long


@torch.inference_mode()
def decode_steps(model, cache, token, n_tokens, max_seqlen=None):
    """n_tokens greedy steps on `cache` (left as it was: every step returns a new cache)."""
    kwargs = {} if max_seqlen is None else dict(max_seqlen=max_seqlen)

    def step(token):
        nonlocal cache
        logits, cache = model(token, cache, **kwargs)
        return logits[:, -1]  # [B, vocab]
    return decode_loop(step, token, n_tokens)[:, -1:] if n_tokens else token


@torch.inference_mode()
def context_rows(models, data, contexts, batch_size, n_tokens, repeats, device, seed):
    """Per context: each model's cache bytes per sequence after the prompt, and its TPOT (median of
    `repeats` decodes of n_tokens on the prefilled cache, the models round-robin)."""
    rows = []
    for context in tqdm(contexts, desc="contexts", dynamic_ncols=True):
        prompts = corpus.sample_prompts(data, batch_size, context, seed=seed, device=device)
        runs, cache_bytes = {}, {}
        for name, model in models.items():
            long = long_softmax(model, context + n_tokens) if name == "softmax" else model
            max_seqlen = long.seqlen if name == "softmax" else None
            logits, cache = long(prompts, **({} if max_seqlen is None else dict(max_seqlen=max_seqlen)))
            cache_bytes[name] = iu.kv_cache_bytes(cache) / batch_size
            token = logits[:, -1].argmax(-1, keepdim=True)
            runs[name] = lambda long=long, cache=cache, token=token, m=max_seqlen: decode_steps(long, cache, token,
                                                                                               n_tokens, m)
        times = iu.time_round_robin(runs, device, warmup=1, repeats=repeats)
        for name in models:
            rows.append(harness.make_row(name, context=context, cache_kb=round(cache_bytes[name] / 1024, 1),
                                         tpot_ms=iu.median(times[name]) / n_tokens * 1e3))
    return rows


def quality_rows(models, data, window, val_batches, checks, seconds):
    """Per language model: parameters, validation loss (and against softmax's), cache of one window, checks."""
    softmax_loss = training.validation_loss(models["softmax"], data, val_batches)
    quality = []
    for name, model in models.items():
        loss = softmax_loss if name == "softmax" else training.validation_loss(model, data, val_batches)
        with torch.inference_mode():
            cache_kb = iu.kv_cache_bytes(model(window[:1])[1]) / 1024
        quality.append(harness.make_row(name, params=iu.n_params(model), val_loss=loss,
                                        loss_vs_softmax=round(loss - softmax_loss, 4),
                                        cache_kb_at_seqlen=round(cache_kb, 1),
                                        forms_agree="-" if name == "softmax" else ("yes" if checks[name] else "NO"),
                                        train_s=None if seconds.get(name) is None else round(seconds[name])))
    return quality


def attention_methods(quality, context, iters):
    """The summary of attention methods' rows (lib/attention_summary.py), one per linear model and hybrid: the
    validation loss against the softmax control trained as many steps, the cache against softmax's KV cache at
    the longest context, and from which context its TPOT is below softmax's."""
    contexts = sorted({row["context"] for row in context})
    longest = contexts[-1]
    at = {(row["variant"], row["context"]): row for row in context}
    softmax = at["softmax", longest]["cache_kb"]
    rows = []
    for row in quality:
        name = row["variant"]
        if name == "softmax":
            continue
        cache = at[name, longest]["cache_kb"]
        rows.append(attention_summary.method_row(
            METHODS[name], False, f"val loss {row['loss_vs_softmax']:+.3f} against softmax trained the same {iters} "
            "steps", iters, f"trained from scratch, {iters} steps", "KV cache",
            f"{softmax / cache:.1f}x smaller at {longest:,} tokens ({cache:,.1f} against {softmax:,.1f} KiB per "
            "sequence)", attention_summary.pays_from(contexts, [at[name, c]["tpot_ms"] for c in contexts],
                                                     [at["softmax", c]["tpot_ms"] for c in contexts], "TPOT")))
    return rows


def headline(quality, context, recall, pairs, iters):
    """The README's row: the losses against softmax, cache and TPOT at the longest context, recall at the most pairs."""
    longest = max(row["context"] for row in context)
    at = {row["variant"]: row for row in context if row["context"] == longest}
    most = max(pairs)
    ms = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    return dict(technique=f"linear attention, gated, Gated DeltaNet, KDA and 3:1 hybrids, trained {iters} steps",
                figure="val loss against softmax: " + ", ".join(f"{row['variant']} {row['loss_vs_softmax']:+.3f}"
                                                                for row in quality if row["variant"] != "softmax")
                + f"; at {longest} tokens cache {at['delta']['cache_kb']:.0f} against {at['softmax']['cache_kb']:.0f} KiB, "
                f"TPOT {ms(at['delta']['tpot_ms'])} against {ms(at['softmax']['tpot_ms'])} ms; recall at {most} pairs: "
                + ", ".join(f"{row['variant']} {row[f'acc_{most}']:.2f}" for row in recall))


def plot_results(quality, context, recall, pairs, recall_seqlen, preset, device):
    """Cache per sequence and TPOT against context, recall accuracy against key-value pairs and against the
    state bytes: the figure."""
    fig, (ax_mem, ax_time, ax_recall, ax_state) = harness.new_figure(4)
    for name in dict.fromkeys(r["variant"] for r in context):
        rows = [r for r in context if r["variant"] == name]
        ax_mem.plot([r["context"] for r in rows], [r["cache_kb"] for r in rows], marker="o", label=name)
        ax_time.plot([r["context"] for r in rows], [r["tpot_ms"] for r in rows], marker="o", label=name)
    ax_mem.set(xlabel="context (tokens)", ylabel="cache per sequence (KiB)", xscale="log", yscale="log",
               title=f"state against KV cache (preset {preset.name})")
    ax_time.set(xlabel="context (tokens)", ylabel="TPOT (ms)", xscale="log", ylim=(0, None),
                title=f"greedy decoding after a prompt ({device})")
    mqar.plot_recall(ax_recall, ax_state, recall, pairs, recall_seqlen)
    for ax in (ax_mem, ax_time):
        ax.legend()
    return fig


def parse_args(argv):
    """The flags, checked before any work: (args, preset, device, data)."""
    parser = harness.script_parser(__doc__)
    add = parser.add_argument
    add("--contexts", type=harness.int_at_least(1), nargs="+", default=[128, 256, 512, 1024],
        help="prompt lengths of the memory and time part (tokens)")
    harness.add_generation_flags(parser, batch_size=4, n_tokens=16, repeats=3, least_tokens=1)
    add("--val-batches", type=harness.batches, default=20, help="validation batches of 32 windows per loss")
    add("--lm-iters", type=harness.steps, default=None,
        help=f"training steps of every language model, the softmax control included (default {LM_ITERS})")
    add("--full-recipe", action="store_true",
        help="train every language model with the preset's full recipe (its own step count, e.g. 800 for cpu)")
    add("--d-latent", type=harness.int_at_least(1), default=None,
        help="values per token of the kda+mla hybrid's latent cache (default: a quarter of MLA's full rank)")
    add("--pairs", type=harness.int_at_least(1), nargs="+",
        help="numbers of key-value pairs of the recall evaluation; training draws 1 to the largest (default: the recipe's)")
    add("--recall-full", action="store_true",
        help=f"the Zoology-like recall recipe {RECALL_FULL} instead of the CPU default {RECALL_QUICK}")
    add("--recall-steps", type=harness.steps, help="training steps of each recall model (default: the recipe's)")
    add("--recall-lr", type=harness.learning_rate, help="peak learning rate of the recall models (default: the recipe's)")
    add("--recall-batch", type=harness.int_at_least(1), help="sequences per recall training step (default: the recipe's)")
    add("--recall-keys", type=harness.int_at_least(2),
        help="distinct keys (and as many values) of the recall task (default: the recipe's)")
    add("--recall-seqlen", type=harness.int_at_least(4),
        help="length of a recall sequence, at least 4 x the most --pairs (default: the recipe's)")
    args = parser.parse_args(argv)
    recipe = RECALL_FULL if args.recall_full else RECALL_QUICK
    args.contexts, args.pairs = sorted(set(args.contexts)), sorted(set(args.pairs or recipe["pairs"]))
    args.recall_keys = args.recall_keys or recipe["keys"]
    args.recall_seqlen = args.recall_seqlen or recipe["seqlen"]
    args.recall_steps = args.recall_steps or recipe["steps"]
    args.recall_lr = args.recall_lr or recipe["lr"]
    args.recall_batch = args.recall_batch or recipe["batch_size"]
    args.recall_d_model = recipe["d_model"]

    def check_args(preset):
        if args.full_recipe and args.lm_iters is not None:
            parser.error(f"--lm-iters: give --lm-iters or --full-recipe (the preset's {preset.iters} steps), not both")
        args.lm_iters = preset.iters if args.full_recipe else args.lm_iters or LM_ITERS
        full = max_latent(preset.n_heads, preset.d_head, preset.d_model)
        if args.d_latent is not None and args.d_latent > full:
            parser.error(f"--d-latent: at most MLA's full rank min(2 * n_heads * d_head, d_model) = {full} for "
                         f"preset {preset.name}, got {args.d_latent}")
        args.d_latent = args.d_latent or max(1, full // 4)
        if (error := mqar.task_error(max(args.pairs), args.recall_seqlen, args.recall_keys)) is not None:
            parser.error(f"--pairs (with --recall-keys {args.recall_keys} and --recall-seqlen "
                         f"{args.recall_seqlen}): {error}")
        longest = max(args.contexts) + args.n_tokens  # softmax: a cache and [heads, n, n] scores of the longest
        harness.check_fits(parser, "--contexts", context_bytes(preset, 1, max(args.contexts)), "the longest prompt")
        harness.check_fits(parser, "--batch-size", context_bytes(preset, args.batch_size, max(args.contexts)),
                           "the batch of the longest prompt")
        harness.check_fits(parser, "--n-tokens", context_bytes(preset, args.batch_size, longest),
                           "the softmax model's position table and cache after the decoding steps")
        recall = mqar.model_config(args.recall_keys, args.recall_seqlen, d_model=args.recall_d_model)
        harness.check_fits(parser, "--recall-keys", recall_bytes(dict(recall, seqlen=4), mqar.EVAL_SEQUENCES),
                           "the recall models' vocabulary")
        harness.check_fits(parser, "--recall-seqlen", recall_bytes(recall, mqar.EVAL_SEQUENCES),
                           "the recall evaluation's sequences")
        harness.check_fits(parser, "--recall-batch", 3 * recall_bytes(recall, args.recall_batch),
                           "a recall training step (forward and backward)")
    preset, device, data = harness.setup(args, parser, check_args)
    if max(args.contexts) >= len(data.val):
        parser.error(f"--contexts: at most {len(data.val) - 1} tokens (the validation split)")
    return args, preset, device, data


def context_bytes(preset, batch_size, n):
    """About the bytes of a softmax GPTlite's prefill of `batch_size` prompts of n tokens (float32): its KV cache
    and position table, a layer's activations and [heads, n, n] scores and softmax, the logits."""
    per_token = 2 * preset.n_layers * preset.n_heads * preset.d_head + 8 * preset.d_model + preset.vocab_size
    return 4 * (batch_size * n * (per_token + 2 * preset.n_heads * n) + n * preset.d_model)


def recall_bytes(config, n_sequences):
    """About the bytes of a recall model's forward over `n_sequences` sequences (float32): the activations,
    the [heads, seqlen, seqlen] scores and softmax, and the logits over the vocabulary."""
    S, d = config["seqlen"], config["d_model"]
    per_sequence = S * (8 * d * config["n_layers"] + 2 * config["n_heads"] * S + config["vocab_size"])
    return 4 * n_sequences * per_sequence + 4 * config["vocab_size"] * d * 2


def main(argv=None):
    args, preset, device, data = parse_args(argv)
    rebuild = files.rebuild_command("main_linear_attention.py", argv, preset)
    models, seconds = train_language_models(preset, data, device, args.untrained, args.seed, rebuild, args.lm_iters,
                                            args.d_latent)
    window = corpus.sample_prompts(data, 2, preset.seqlen, seed=args.seed, device=device)
    checks = {name: forms_agree(model, window) for name, model in models.items() if name != "softmax"}
    harness.require_checks({f"{name}: chunked, recurrent and cached decoding agree": ok for name, ok in checks.items()})

    quality = quality_rows(models, data, window, args.val_batches, checks, seconds)
    context = context_rows(models, data, args.contexts, args.batch_size, args.n_tokens, args.repeats, device,
                           args.seed)
    recall = mqar.recall_rows(args.pairs, args.recall_steps, args.recall_lr, args.recall_keys, args.recall_seqlen,
                              args.seed, args.recall_batch, args.recall_d_model, device,
                              f"mqar_k{args.recall_keys}_s{args.recall_seqlen}", rebuild, args.untrained)
    print(f"\n1. quality: {args.lm_iters} steps each, the softmax control too (batch {preset.batch_size}, lr "
          f"{preset.lr:g}); cache of one sequence of {preset.seqlen} tokens; kda+mla latents of {args.d_latent}")
    recall_config = mqar.model_config(args.recall_keys, args.recall_seqlen, d_model=args.recall_d_model)
    tables = [harness.table("Cache per sequence and TPOT after a prompt of each length:", context),
              harness.table("Associative recall (MQAR): accuracy of the answers at each number of key-value pairs "
                            f"(acc_<pairs>), state or KV cache of one sequence of {args.recall_seqlen} tokens:", recall)]
    summary = ["checks: chunked = recurrent form and prefill + decoding with the carried state = full pass "
               f"(atol {ATOL:g}) for " + ", ".join(checks),
               f"softmax rows beyond {preset.seqlen} tokens: position table extended by its last row, timing only",
               f"cache per sequence and TPOT: batch {args.batch_size}, {args.n_tokens} decoding steps, median of "
               f"{args.repeats}",
               f"recall (MQAR, {'full' if args.recall_full else 'quick'} recipe): {args.recall_keys} keys, sequences of "
               f"{args.recall_seqlen}, models of {recall_config['n_layers']} layers x {recall_config['n_heads']} heads "
               f"of {recall_config['d_head']} (d_model {recall_config['d_model']}), {args.recall_steps} steps of "
               f"{args.recall_batch} sequences of 1 to {max(args.pairs)} pairs, peak lr {args.recall_lr:g}; accuracy "
               f"of the answers on {mqar.EVAL_SEQUENCES} sequences per pair count"]
    harness.report(args, "main_linear_attention.py", preset, device, quality,
                   headline(quality, context, recall, args.pairs, args.lm_iters), summary=summary, tables=tables,
                   plot=lambda: plot_results(quality, context, recall, args.pairs, args.recall_seqlen, preset, device),
                   context_rows=context, context_columns=harness.table_columns(context), recall_rows=recall,
                   recall_columns=harness.table_columns(recall), recall_pairs=args.pairs, checks=checks,
                   lm_iters=args.lm_iters, d_latent=args.d_latent,
                   attention_methods=attention_methods(quality, context, args.lm_iters))


if __name__ == "__main__":
    harness.run(main)
