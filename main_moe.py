"""Mixture of experts: a GPTlite whose MLPs are 8 experts with top-2 routing, trained beside two dense GPTlites.

    python main_moe.py                                     # cpu preset: trains the four models first (once)
    python main_moe.py --router sigmoid --json moe.json --plot moe.png
    python main_moe.py --untrained --iters 2 --repeats 1   # a quick smoke run

Blog section: part 2 (architectures built for fast inference). Four models, each trained with the same
recipe (--iters steps of the preset's batch and learning rate) as checkpoints/<preset>_moe_*.pt:
- dense, same active: GPTlite with d_ff = k x d_expert, the parameters one token runs in the MoE;
- dense, same total: GPTlite with d_ff = E x d_expert, the parameters the MoE holds (with the cpu preset's
  E = 8 experts of d_expert = d_ff / 8 = 64 neurons, exactly the preset's own GPTlite);
- moe, balanced: gptlite_moe's router (softmax top-k, or with --router sigmoid DeepSeek-V3's sigmoid scores
  and selection bias) and its balancing: Switch's auxiliary loss (softmax), the bias nudged after each step
  (sigmoid, auxiliary-loss-free);
- moe, unbalanced: the same without any balancing.
Tables: validation loss, total and active parameters, and TPOT of greedy decoding with the KV cache at
batch 1 and 64; the experts' load on the validation windows per layer (shares, coefficient of variation);
the assignments dropped at capacity factors 1.0, 1.25 and 2.0 (GShard's capacity over the 4,096 tokens
of a validation batch) and the loss they cost. The timed MoEs are dropless (no capacity).

Checks first: each MoE's sparse path gives the logits of its dense reference (every expert on every token,
masked) without capacity and at every capacity factor; prefill plus one-token decoding with the KV cache
gives the full pass's logits, and its greedy tokens are those of full passes one token at a time. Nothing
is written unless they pass.
"""
import contextlib
import statistics

import torch

import inference_utils as iu
from gptlite import generate
from gptlite_kvcache import GPTlite_KVCache, generate_kvcache
from gptlite_moe import GPTlite_MoE
from lib.training import moe_loss_fn
from lib.variant_checkpoints import moe_checkpoint
from lib import corpus, files, harness, training

ATOL = 1e-4  # float32 logits: k experts summed against E masked experts, in another order
TPOT_BATCHES = (1, 64)


def model_configs(preset, n_experts, top_k, d_expert, router):
    """{name: (model class, constructor kwargs, checkpoint path)}: the two dense GPTlites and the two MoEs."""
    base = preset.gptlite_kwargs()
    moe_config = dict(base, n_experts=n_experts, top_k=top_k, d_expert=d_expert, router=router)

    def dense(d_ff):
        return GPTlite_KVCache, dict(base, d_ff=d_ff), files.checkpoint_path(f"{preset.name}_moe_dense_ff{d_ff}")

    def moe(balanced):
        return GPTlite_MoE, moe_config, moe_checkpoint(preset.name, n_experts, top_k, d_expert, router, balanced)
    return {f"dense, same active (d_ff={top_k * d_expert})": dense(top_k * d_expert),
            f"dense, same total (d_ff={n_experts * d_expert})": dense(n_experts * d_expert),
            "moe, balanced": moe(True), "moe, unbalanced": moe(False)}


def train_models(configs, data, recipe, aux_weight, bias_rate, device, untrained, rebuild):
    """Load or train each model (iu.cached_model; the stamp: the recipe and the balancing). {name: model},
    {name: training seconds or None when loaded}. A router that goes non-finite stops with RouterError."""
    models, seconds = {}, {}
    for name, (cls, config, checkpoint) in configs.items():
        balanced = name == "moe, balanced"
        loss_fn = training.cross_entropy_loss if cls is not GPTlite_MoE else balancing_loss(
            config["router"], aux_weight if balanced else 0.0, bias_rate if balanced else 0.0)
        stamp = dict(recipe, aux_weight=aux_weight, bias_rate=bias_rate) if balanced else recipe
        torch.manual_seed(recipe["seed"])
        models[name], seconds[name] = iu.cached_model(
            cls(**config).to(device), config, checkpoint,
            trainer(data, recipe, loss_fn, f"training {name}"), data.vocab, rebuild, stamp=stamp, untrained=untrained)
    return models, seconds


def balancing_loss(router, aux_weight, bias_rate):
    """The MoE's training loss: softmax balances with Switch's auxiliary loss, sigmoid with the selection bias."""
    return moe_loss_fn(aux_weight, 0.0) if router == "softmax" else moe_loss_fn(0.0, bias_rate)


def trainer(data, recipe, loss_fn, desc):
    """cached_model's train(model): the recipe's AdamW steps with `loss_fn`."""
    return lambda model: iu.train_recipe(model, data, recipe, desc, loss_fn=loss_fn)


def active_params(model):
    """Parameters one token runs: all of them, less the E - k experts it is not routed to (per layer)."""
    if not isinstance(model, GPTlite_MoE):
        return iu.n_params(model)
    c, layer = model.config, model.moe_layers()[0]
    per_expert = sum(p[0].numel() for p in (layer.w_in, layer.b_in, layer.w_out, layer.b_out))
    return iu.n_params(model) - c.n_layers * (c.n_experts - c.top_k) * per_expert


@contextlib.contextmanager
def routing_counts(model):
    """While open: every forward pass of `model`'s MoE layers adds its loads to counts["load"] ([L, E]) and
    its dropped and routed assignments to counts["dropped"] and counts["assignments"]."""
    layers = model.moe_layers()
    counts = dict(load=torch.zeros(len(layers), layers[0].n_experts, dtype=torch.long), dropped=0, assignments=0)

    def hook(i):
        def record(layer, inputs, output):
            counts["load"][i] += layer.routing.load.cpu()
            counts["dropped"] += layer.routing.dropped
            counts["assignments"] += int(layer.routing.load.sum()) + layer.routing.dropped
        return record
    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()


def cv(load):
    """Coefficient of variation of one layer's load over its experts: population std / mean."""
    values = load.double()
    return (values.std(unbiased=False) / values.mean()).item()


@torch.inference_mode()
def sparse_matches_reference(model, window):
    """Max |logits difference| of the sparse path against the dense reference on `window` [B, S]."""
    sparse = model(window)[0]
    reference = model.dense_reference()(window)[0]
    model.dense_reference(False)
    return (sparse - reference).abs().max().item()


@torch.inference_mode()
def cached_greedy_matches(model, prompts, n_tokens):
    """Greedy tokens with the KV cache = full passes over the growing sequence, one token at a time."""
    return torch.equal(generate_kvcache(model, prompts, n_tokens, model.seqlen),
                       generate(model, prompts, n_tokens, model.seqlen))


def run_checks(models, window, prompts, n_tokens, capacity_factors):
    """Correctness first: {check name: ok} and {name: max |sparse - reference|} over every capacity."""
    checks, diffs = {}, {}
    for name, model in models.items():
        checks[f"{name}: cached decoding = full pass"] = (training.cached_matches_full(model, window[:4], ATOL)
                                                          and cached_greedy_matches(model, prompts, n_tokens))
        if isinstance(model, GPTlite_MoE):
            diffs[name] = 0.0
            for factor in (None, *capacity_factors):
                diffs[name] = max(diffs[name], sparse_matches_reference(model.set_capacity_factor(factor), window))
            model.set_capacity_factor(None)
            checks[f"{name}: sparse path = dense reference at every capacity (max |diff| {diffs[name]:.1e}, "
                   f"atol {ATOL:g})"] = diffs[name] <= ATOL
    return checks, diffs


def routing_figures(models, data, capacity_factors, val_batches):
    """Per MoE: validation loss and routing counts without capacity and at each factor."""
    figures = {}
    for name, model in models.items():
        if isinstance(model, GPTlite_MoE):
            for factor in (None, *capacity_factors):
                with routing_counts(model.set_capacity_factor(factor)) as counts:
                    loss = training.validation_loss(model, data, val_batches)
                figures[name, factor] = dict(counts, val_loss=loss)
            model.set_capacity_factor(None)
    return figures


def tpot_figures(models, data, prompt_len, n_tokens, repeats, seed, device):
    """{(name, batch): compare_generation's figures}: greedy decoding with the KV cache, round-robin per batch."""
    out = {}
    for batch in TPOT_BATCHES:
        prompts = corpus.sample_prompts(data, batch, prompt_len, seed=seed, device=device)
        fns = {name: (lambda n, m=m: generate_kvcache(m, prompts, n, m.seqlen)) for name, m in models.items()}
        for name, figures in iu.compare_generation(fns, n_tokens, batch, device, repeats=repeats).items():
            out[name, batch] = figures
    return out


def make_rows(models, seconds, routing, timing, diffs, checks, val_batches, data):
    rows = []
    for name, model in models.items():
        loss = routing[name, None]["val_loss"] if (name, None) in routing else training.validation_loss(
            model, data, val_batches)
        cached = all(ok for check, ok in checks.items() if check.startswith(f"{name}: cached"))
        rows.append(harness.make_row(
            name, val_loss=loss, params=iu.n_params(model), active_params=active_params(model),
            tpot_b1_ms=round_or_none(timing[name, 1]["tpot_ms"], 3),
            tpot_b64_ms=round_or_none(timing[name, 64]["tpot_ms"], 3),
            tok_s_b64=round(timing[name, 64]["tokens_per_s"]),
            train_s=None if seconds[name] is None else round(seconds[name]),
            sparse_eq_reference="-" if name not in diffs else "yes" if diffs[name] <= ATOL else "NO",
            cached_eq_full="yes" if cached else "NO"))
    return rows


def round_or_none(value, digits):
    return None if value is None else round(value, digits)


def load_rows(routing):
    """The load histogram: per MoE and layer, each expert's share (%) of the assignments, and the CV."""
    rows = []
    for (name, factor), figures in routing.items():
        if factor is None:
            for layer, load in enumerate(figures["load"]):
                shares = (100 * load / load.sum()).tolist()
                rows.append(dict(variant=name, layer=layer, **{f"e{e}_%": round(s, 1) for e, s in enumerate(shares)},
                                 cv=round(cv(load), 3), max_over_mean=round((load.max() / load.float().mean()).item(), 2)))
    return rows


def capacity_rows(routing):
    rows = []
    for (name, factor), figures in routing.items():
        rows.append(dict(variant=name, capacity_factor="none" if factor is None else factor,
                         dropped_pct=round(100 * figures["dropped"] / figures["assignments"], 2),
                         val_loss=figures["val_loss"],
                         loss_vs_dropless=round(figures["val_loss"] - routing[name, None]["val_loss"], 4)))
    return rows


def plot_results(loads, capacity, preset, device):
    fig, (ax_load, ax_drop) = harness.new_figure(2)
    names = list(dict.fromkeys(r["variant"] for r in loads))
    n_experts = sum(k.endswith("_%") for k in loads[0])
    width = 0.8 / len(names)
    for i, name in enumerate(names):  # each layer's experts sorted by load: expert ids differ between layers
        layers = [sorted((r[f"e{e}_%"] for e in range(n_experts)), reverse=True) for r in loads if r["variant"] == name]
        shares = list(zip(*layers))  # [rank][layer]
        mean = [statistics.fmean(s) for s in shares]
        err = [[m - min(s) for m, s in zip(mean, shares)], [max(s) - m for m, s in zip(mean, shares)]]
        cv_mean = statistics.fmean(r["cv"] for r in loads if r["variant"] == name)
        ax_load.bar([e + 1 + i * width for e in range(n_experts)], mean, width, yerr=err, capsize=2,
                    label=f"{name} (CV {cv_mean:.2f})")
    ax_load.axhline(100 / n_experts, color="gray", linewidth=0.8, linestyle="--", label="uniform")
    ax_load.set(xlabel="expert, busiest first (in each layer)", ylabel="share of assignments (%), mean over layers",
                title=f"expert load on validation windows (preset {preset.name}; bars: min-max over layers)")
    ax_load.legend(fontsize=8)
    for name in names:
        rows = [r for r in capacity if r["variant"] == name and r["capacity_factor"] != "none"]
        ax_drop.plot([r["capacity_factor"] for r in rows], [r["dropped_pct"] for r in rows], marker="o", label=name)
    ax_drop.set(xlabel="capacity factor", ylabel="assignments dropped (%)", ylim=(0, None),
                title=f"GShard capacity, a validation batch per pass ({device})")
    ax_drop.legend(fontsize=8)
    return fig


def headline(rows, loads, top_k, n_experts):
    by = {r["variant"].split(" (")[0]: r for r in rows}
    moe, active, total = by["moe, balanced"], by["dense, same active"], by["dense, same total"]
    cvs = {name: statistics.fmean(r["cv"] for r in loads if r["variant"] == name) for name in ("moe, balanced",
                                                                                                  "moe, unbalanced")}
    ratio = lambda key, r: "-" if iu.ratio(moe[key], r[key]) is None else f"{iu.ratio(moe[key], r[key]):.2f}x"  # noqa
    return dict(technique=f"mixture of experts, top-{top_k} of {n_experts}",
                figure=f"val loss {moe['val_loss']:.3f} against {active['val_loss']:.3f} (dense, same active) and "
                       f"{total['val_loss']:.3f} (dense, same total); TPOT {ratio('tpot_b1_ms', active)} same-active's at "
                       f"batch 1, {ratio('tpot_b64_ms', active)} at batch 64 (above 1: slower); load CV {cvs['moe, balanced']:.2f}"
                       f" balanced, {cvs['moe, unbalanced']:.2f} without balancing; sparse path = dense reference")


def parse_args(argv):
    """The flags, checked before any work: (args, preset, device, data)."""
    parser = harness.script_parser(__doc__)
    add = parser.add_argument
    add("--iters", type=harness.steps, default=400, help="training steps of each of the four models")
    add("--n-experts", type=harness.int_at_least(1), default=8, help="experts per MoE layer")
    add("--top-k", type=harness.int_at_least(1), default=2, help="experts each token is routed to")
    add("--d-expert", type=harness.int_at_least(1, harness.MAX_SIZE), default=None,
        help="hidden neurons of one expert (default: the preset's d_ff / n_experts, so that E experts hold d_ff)")
    add("--router", choices=("softmax", "sigmoid"), default="softmax",
        help="softmax top-k (balanced by the auxiliary loss) or DeepSeek-V3's sigmoid (balanced by the selection bias)")
    add("--aux-weight", type=harness.float_in(0.0, 100.0, low_open=True), default=0.01,
        help="weight of Switch's balancing loss in the balanced softmax MoE")
    add("--bias-rate", type=harness.float_in(0.0, 1.0, low_open=True), default=1e-3,
        help="selection-bias step of the balanced sigmoid MoE (DeepSeek-V3's gamma)")
    add("--capacity-factors", type=harness.float_in(0.0, 100.0, low_open=True), nargs="+", default=[1.0, 1.25, 2.0],
        help="capacity factors whose dropped assignments are counted (each > 0)")
    harness.add_generation_flags(parser, prompt_len=32, n_tokens=32, repeats=3)
    add("--val-batches", type=harness.batches, default=20, help="validation batches of 32 windows per loss")
    args = parser.parse_args(argv)
    harness.check_applies(parser, args, ["--bias-rate"], "--router sigmoid", args.router == "sigmoid")
    harness.check_applies(parser, args, ["--aux-weight"], "--router softmax", args.router == "softmax")
    args.capacity_factors = sorted(set(args.capacity_factors))

    def check_args(preset):
        if args.top_k > args.n_experts:
            parser.error(f"--top-k {args.top_k} exceeds --n-experts {args.n_experts}: a token is routed to k distinct "
                         "experts; give a smaller --top-k or more experts")
        d_ff = 4 * preset.d_model
        if args.d_expert is None:
            if d_ff % args.n_experts:
                parser.error(f"--n-experts {args.n_experts} does not divide the preset's d_ff={d_ff}: give --d-expert")
            args.d_expert = d_ff // args.n_experts
        harness.check_fits(parser, "--n-experts", 2 * args.n_experts * training.activation_bytes(preset, 32),
                           "the dense reference (every expert on every token) of a validation batch")
    return (args, *harness.setup(args, parser, check_args))


def main(argv=None):
    args, preset, device, data = parse_args(argv)
    recipe = iu.preset_recipe(preset, iters=args.iters, seed=args.seed)
    configs = model_configs(preset, args.n_experts, args.top_k, args.d_expert, args.router)
    rebuild = f"python main_moe.py --preset {preset.name}" + (f" --iters {args.iters}" if args.iters != 400 else "")
    models, seconds = train_models(configs, data, recipe, args.aux_weight, args.bias_rate, device, args.untrained,
                                   rebuild)
    window = corpus.sample_prompts(data, 8, preset.seqlen, seed=args.seed, device=device)
    checks, diffs = run_checks(models, window, window[:2, :16], 24, args.capacity_factors)
    harness.require_checks(checks)

    routing = routing_figures(models, data, args.capacity_factors, args.val_batches)
    timing = tpot_figures(models, data, args.prompt_len, args.n_tokens, args.repeats, args.seed, device)
    rows = make_rows(models, seconds, routing, timing, diffs, checks, args.val_batches, data)
    loads, capacity = load_rows(routing), capacity_rows(routing)
    balancing = (f"Switch's auxiliary loss x {args.aux_weight:g}" if args.router == "softmax"
                 else f"selection bias, step {args.bias_rate:g}")
    print(f"\n{args.n_experts} experts of {args.d_expert} neurons, top-{args.top_k}, {args.router} router; balanced: "
          f"{balancing}; every model {args.iters} steps of batch {preset.batch_size}; TPOT: greedy decoding with the "
          f"KV cache, {args.n_tokens} tokens after prompts of {args.prompt_len}, median of {args.repeats}")
    summary = list(checks) + [
        "active_params: the parameters one token runs (the MoE's k of E experts, its router and everything else)",
        "cv: std / mean of a layer's per-expert load over the validation windows (0: uniform); dropped_pct: "
        f"assignments past an expert's capacity, ceil(factor x 4096 tokens x {args.top_k} / {args.n_experts}) per pass"]
    harness.report(args, "main_moe.py", preset, device, rows, headline(rows, loads, args.top_k, args.n_experts),
                   summary=summary, tables=[harness.table("Expert load per layer (no capacity)", loads),
                                            harness.table("Dropped assignments against capacity factor", capacity)],
                   plot=lambda: plot_results(loads, capacity, preset, device), n_experts=args.n_experts,
                   top_k=args.top_k, d_expert=args.d_expert, router=args.router, iters=args.iters)


if __name__ == "__main__":
    harness.run(main)
