"""Linear attention, gating, the delta rule, KDA and 3:1 hybrids, trained and measured against softmax GPTlite.

    python main_linear_attention.py                    # cpu preset: trains the missing checkpoints first
    python main_linear_attention.py --full-recipe      # every language model with the preset's 800 steps
    python main_linear_attention.py --contexts 128 512 2048 --json linear.json --plot linear.png
    python main_linear_attention.py --untrained --contexts 128 256 --recall-steps 2   # a quick smoke run

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
3. Recall (Zoology's MQAR): key-value pairs, then queries of the keys; small models of each kind
   trained on it (checkpoints/<preset>_recall_<name>.pt); accuracy of the answers against the number
   of pairs. A fixed-size state must hold every pair; a KV cache keeps them all.

Checks first: every linear model's chunked form gives the logits of its recurrent form, and prefill
plus one-token decoding with the carried state gives the logits of the full pass. Nothing is written
unless they pass.
"""
import dataclasses
import math

import torch
import torch.nn.functional as F
from tqdm import tqdm

import inference_utils as iu
from gptlite import GPTlite
from gptlite_kvcache import GPTlite_KVCache
from gptlite_linear import GPTlite_Linear, linear_config
from gptlite_mla import max_latent
from lib import attention_summary, corpus, files, harness, training

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
RECALL = dict(d_model=64, n_heads=2, d_head=16, n_layers=2, dropout_p=0.0)  # small: the state is 16 x 16 a head
RECALL_KINDS = {"linear": ("linear", None), "gated": ("gated", None), "delta": ("delta", None),
                "hybrid": ("delta", 2)}  # 2 layers: the hybrid's second block is softmax


def mqar_batch(batch_size, n_pairs, seqlen, n_keys, generator=None):
    """Multi-query associative recall: n_pairs (key, value) pairs, then (key, value) queries of those keys
    until seqlen. Keys are tokens 0..n_keys-1, values n_keys..2*n_keys-1, a random map per sequence.
    Returns inputs x [B, seqlen] and targets y [B, seqlen]: a query's value at its key's position, -100
    (ignored) elsewhere."""
    if not 1 <= n_pairs <= n_keys or 2 * n_pairs + 2 > seqlen:
        raise ValueError(f"n_pairs must be between 1 and n_keys={n_keys}, with room for a query in seqlen={seqlen} "
                         f"(2 * n_pairs + 2 <= seqlen), got {n_pairs}")
    keys = torch.rand(batch_size, n_keys, generator=generator).argsort(-1)[:, :n_pairs]  # distinct keys [B, P]
    values = n_keys + torch.randint(n_keys, (batch_size, n_pairs), generator=generator)  # [B, P]
    n_queries = (seqlen - 2 * n_pairs) // 2
    pick = torch.randint(n_pairs, (batch_size, n_queries), generator=generator)  # [B, Q]
    pairs = torch.stack([keys, values], -1).flatten(1)  # [B, 2P]: k v k v ...
    queries = torch.stack([keys.gather(1, pick), values.gather(1, pick)], -1).flatten(1)  # [B, 2Q]
    x = torch.cat([pairs, queries], 1)
    x = F.pad(x, (0, seqlen - x.shape[1]))  # an odd remainder: one padding token, never a target
    y = torch.full_like(x, -100)
    answer = torch.arange(2 * n_pairs, 2 * n_pairs + 2 * n_queries, 2)  # the query keys' positions
    y[:, answer] = x[:, answer + 1]
    return x, y


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
    for _ in range(n_tokens):
        logits, cache = model(token, cache, **kwargs)
        token = logits[:, -1].argmax(-1, keepdim=True)
    return token


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


def train_recall(model, steps, lr, n_pairs_max, seqlen, n_keys, batch_size, seed, desc, device="cpu"):
    """AdamW with warm-up and cosine decay on MQAR batches of 1..n_pairs_max pairs; loss on the answers."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.1)
    model.train()
    for step in (bar := tqdm(range(steps), desc=desc, dynamic_ncols=True, mininterval=0.5)):
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / steps))
        n_pairs = int(torch.randint(1, n_pairs_max + 1, (1,), generator=generator))
        x, y = (t.to(device) for t in mqar_batch(batch_size, n_pairs, seqlen, n_keys, generator))
        loss = F.cross_entropy(training.logits_of(model(x)).flatten(0, 1), y.flatten(), ignore_index=-100)
        training.check_finite(loss.item(), step + 1, steps, lr, "recall training loss")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()


@torch.inference_mode()
def recall_accuracy(model, n_pairs, seqlen, n_keys, n_sequences=256, seed=4321):
    """Fraction of the query answers that the model's argmax gets right, on fixed-seed MQAR sequences."""
    x, y = mqar_batch(n_sequences, n_pairs, seqlen, n_keys, torch.Generator().manual_seed(seed + n_pairs))
    device = next(model.parameters(), x).device  # the model's (x's for a model without parameters)
    predicted = training.logits_of(model(x.to(device))).argmax(-1).cpu()
    answers = y != -100
    return (predicted[answers] == y[answers]).float().mean().item()


def recall_rows(pairs, steps, lr, n_keys, seqlen, seed, preset, device, rebuild, untrained):
    """Train (or load) one small model of each kind on MQAR, then accuracy against the number of pairs."""
    base = dict(RECALL, vocab_size=2 * n_keys, seqlen=seqlen)
    kinds = {"softmax": (GPTlite, base), **{name: (GPTlite_Linear, linear_config(base, rule, every))
                                            for name, (rule, every) in RECALL_KINDS.items()}}
    rows = []
    for name, (model_class, config) in kinds.items():
        def train(model):
            train_recall(model, steps, lr, max(pairs), seqlen, n_keys, 64, seed, f"recall {name}", device)
        path = files.checkpoint_path(f"{preset.name}_recall_{name}_s{steps}")
        stamp = dict(steps=steps, lr=lr, pairs=max(pairs), seed=seed)
        torch.manual_seed(seed)
        model, _ = iu.cached_model(model_class(**config).to(device), config, path, train, f"mqar{n_keys}", rebuild,
                                   stamp=stamp, untrained=untrained)
        rows.append(harness.make_row(name, **{f"acc_{p}_pairs": round(recall_accuracy(model, p, seqlen, n_keys), 3)
                                              for p in pairs}))
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
                + ", ".join(f"{row['variant']} {row[f'acc_{most}_pairs']:.2f}" for row in recall))


def plot_results(quality, context, recall, pairs, preset, device):
    """Cache per sequence and TPOT against context, recall accuracy against key-value pairs: the figure."""
    fig, (ax_mem, ax_time, ax_recall) = harness.new_figure(3)
    for name in dict.fromkeys(r["variant"] for r in context):
        rows = [r for r in context if r["variant"] == name]
        ax_mem.plot([r["context"] for r in rows], [r["cache_kb"] for r in rows], marker="o", label=name)
        ax_time.plot([r["context"] for r in rows], [r["tpot_ms"] for r in rows], marker="o", label=name)
    ax_mem.set(xlabel="context (tokens)", ylabel="cache per sequence (KiB)", xscale="log", yscale="log",
               title=f"state against KV cache (preset {preset.name})")
    ax_time.set(xlabel="context (tokens)", ylabel="TPOT (ms)", xscale="log", ylim=(0, None),
                title=f"greedy decoding after a prompt ({device})")
    for r in recall:
        ax_recall.plot(pairs, [r[f"acc_{p}_pairs"] for p in pairs], marker="o", label=r["variant"])
    ax_recall.set(xlabel="key-value pairs in the context", ylabel="recall accuracy", ylim=(0, 1.02),
                  title="associative recall (MQAR), small models")
    for ax in (ax_mem, ax_time, ax_recall):
        ax.legend()
    return fig


def parse_args(argv):
    """The flags, checked before any work: (args, preset, device, data)."""
    parser = harness.script_parser(__doc__)
    add = parser.add_argument
    add("--contexts", type=harness.int_at_least(1), nargs="+", default=[128, 256, 512, 1024],
        help="prompt lengths of the memory and time part (tokens)")
    harness.add_generation_flags(parser, batch_size=4, n_tokens=16, repeats=3, least_tokens=1)
    add("--val-batches", type=harness.int_at_least(1), default=20, help="validation batches of 32 windows per loss")
    add("--lm-iters", type=harness.int_at_least(1), default=None,
        help=f"training steps of every language model, the softmax control included (default {LM_ITERS})")
    add("--full-recipe", action="store_true",
        help="train every language model with the preset's full recipe (its own step count, e.g. 800 for cpu)")
    add("--d-latent", type=harness.int_at_least(1), default=None,
        help="values per token of the kda+mla hybrid's latent cache (default: a quarter of MLA's full rank)")
    add("--pairs", type=harness.int_at_least(1), nargs="+", default=[2, 4, 8, 12, 16, 24],
        help="numbers of key-value pairs of the recall evaluation (the largest is also the training maximum)")
    add("--recall-steps", type=harness.int_at_least(1), default=1000, help="training steps of each recall model")
    add("--recall-lr", type=harness.positive_float, default=3e-3, help="peak learning rate of the recall models")
    add("--recall-keys", type=harness.int_at_least(2), default=32, help="distinct keys (and values) of the recall task")
    add("--recall-seqlen", type=harness.int_at_least(4), default=64, help="length of a recall sequence")
    args = parser.parse_args(argv)
    args.contexts, args.pairs = sorted(set(args.contexts)), sorted(set(args.pairs))

    def check_args(preset):
        if args.full_recipe and args.lm_iters is not None:
            parser.error(f"--lm-iters: give --lm-iters or --full-recipe (the preset's {preset.iters} steps), not both")
        args.lm_iters = preset.iters if args.full_recipe else args.lm_iters or LM_ITERS
        full = max_latent(preset.n_heads, preset.d_head, preset.d_model)
        if args.d_latent is not None and args.d_latent > full:
            parser.error(f"--d-latent: at most MLA's full rank min(2 * n_heads * d_head, d_model) = {full} for "
                         f"preset {preset.name}, got {args.d_latent}")
        args.d_latent = args.d_latent or max(1, full // 4)
        if max(args.pairs) > args.recall_keys or 2 * max(args.pairs) + 2 > args.recall_seqlen:
            parser.error(f"--pairs: at most --recall-keys={args.recall_keys} pairs, and 2 * pairs + 2 <= "
                         f"--recall-seqlen={args.recall_seqlen}; got {max(args.pairs)}")
        longest = max(args.contexts) + args.n_tokens  # softmax: a cache and [heads, n, n] scores of the longest
        harness.check_fits(parser, "--contexts", context_bytes(preset, 1, max(args.contexts)), "the longest prompt")
        harness.check_fits(parser, "--batch-size", context_bytes(preset, args.batch_size, max(args.contexts)),
                           "the batch of the longest prompt")
        harness.check_fits(parser, "--n-tokens", context_bytes(preset, args.batch_size, longest),
                           "the softmax model's position table and cache after the decoding steps")
        recall = dict(RECALL, vocab_size=2 * args.recall_keys, seqlen=args.recall_seqlen)
        harness.check_fits(parser, "--recall-keys", recall_bytes(dict(recall, seqlen=4), 256),
                           "the recall models' vocabulary")
        harness.check_fits(parser, "--recall-seqlen", recall_bytes(recall, 256), "the recall evaluation's sequences")
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
    the [heads, seqlen, seqlen] scores and softmax, and the logits over the 2 * keys tokens."""
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
    recall = recall_rows(args.pairs, args.recall_steps, args.recall_lr, args.recall_keys, args.recall_seqlen,
                         args.seed, preset, device, rebuild, args.untrained)
    print(f"\n1. quality: {args.lm_iters} steps each, the softmax control too (batch {preset.batch_size}, lr "
          f"{preset.lr:g}); cache of one sequence of {preset.seqlen} tokens; kda+mla latents of {args.d_latent}")
    tables = [harness.table("Cache per sequence and TPOT after a prompt of each length:", context),
              harness.table("Associative recall (MQAR): accuracy of the answers against the number of key-value pairs:",
                            recall)]
    summary = ["checks: chunked = recurrent form and prefill + decoding with the carried state = full pass "
               f"(atol {ATOL:g}) for " + ", ".join(checks),
               f"softmax rows beyond {preset.seqlen} tokens: position table extended by its last row, timing only",
               f"cache per sequence and TPOT: batch {args.batch_size}, {args.n_tokens} decoding steps, median of "
               f"{args.repeats}",
               f"recall (MQAR): {args.recall_keys} keys, sequences of {args.recall_seqlen}, models {RECALL['n_layers']} "
               f"layers x {RECALL['n_heads']} heads of {RECALL['d_head']}, {args.recall_steps} steps each; accuracy "
               "of the answers on 256 sequences per pair count"]
    harness.report(args, "main_linear_attention.py", preset, device, quality,
                   headline(quality, context, recall, args.pairs, args.lm_iters), summary=summary, tables=tables,
                   plot=lambda: plot_results(quality, context, recall, args.pairs, preset, device),
                   context_rows=context, context_columns=harness.table_columns(context), recall_rows=recall,
                   recall_columns=harness.table_columns(recall), recall_pairs=args.pairs, checks=checks,
                   lm_iters=args.lm_iters, d_latent=args.d_latent,
                   attention_methods=attention_methods(quality, context, args.lm_iters))


if __name__ == "__main__":
    harness.run(main)
