"""Speculative decoding and multi-token prediction: a cheap draft proposes gamma tokens and the target checks
them all in one forward pass, so that one read of the target's weights yields several tokens.

    python main_speculative_decoding.py                 # cpu preset: target checkpoints/cpu.pt, drafts trained once
    python main_speculative_decoding.py --gammas 1 2 4 --batch-sizes 1 --json spec.json --plot spec.png
    python main_speculative_decoding.py --untrained --draft-iters 2 --head-iters 2 --mtp-steps 2 --gammas 1 2 \\
        --n-tokens 16 --repeats 1 --stat-samples 200  # random weights, a quick smoke run

Part 2 of the post ("What's next": speculative decoding and multi-token prediction). The algorithm of
Leviathan et al. and Chen et al. (lib/speculative.py: speculative_generate, accept_draft): the target
scores the pending token and the gamma draft tokens on top of its static cache; draft token i is kept
with probability min(1, p/q), the first rejected one replaced by a token drawn from norm(max(0, p - q)),
a bonus token drawn from p when all are kept; target cache and draft rolled back to the kept tokens.

The drafts, one row each: `distilled` (the student of main_distillation.py, soft + hard labels),
`distilled small` (the same with one layer: the draft-cost term), `lookup` (prompt lookup: n-gram
match in the text so far, no model), `early exit` (the target's first layers and its own head),
`medusa` (K heads on the frozen target's last state), `eagle` (one block over [embedding, state]
reusing the target's head, trained on the frozen target) and `mtp` (DeepSeek-V3's multi-token
prediction module trained with the model: cpu.pt trained on with the MTP loss, gptlite_mtp.py; its
speedup is against plain decoding of that model). Each is trained once and saved in checkpoints/.

Each figure is measured on every decode path of --paths, side by side in one run: `eager` (the
PyTorch model, about 2 ms a step at the cpu preset, most of it operator overhead) and `fast`
(lib/fast_decode.py: target and model drafts as one C++ call per pass, a few hundredths of a ms), where a
draft's cost and the verification pass's cost follow bytes and FLOPs rather than operator counts. The
speculation loop, the acceptance rule and the heads (medusa, eagle, mtp) are the same PyTorch code on both.

Checks before any timing: greedy speculative tokens equal the target's greedy tokens without a cache
(generate) for every draft, gamma and batch; sampling keeps the target's distribution: the first
--stat-chars characters after a prompt, drawn --stat-samples times, pass Pearson's chi-square test
against the target's exact probabilities at --significance, and the same test rejects a wrong rule that
keeps every draft token (the control). Per batch size and decoding (greedy, sampling at --temperature)
the table gives each draft at its best gamma: acceptance rate alpha, tokens per target call tau against
(1 - alpha^(gamma+1)) / (1 - alpha), the draft's cost c per token over a target step, and the speedup
(plain TPOT / TPOT, plain decoding timed round-robin beside each draft in this run) against (1 -
alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)), and against tau / (gamma c + verify), with the measured cost
of the gamma + 1 token verification pass.
"""
import torch

import inference_utils as iu
from gptlite import GPTlite, generate
from gptlite_mtp import FeatureHead, GPTlite_MTP
from lib import corpus, files, harness, training
from lib.draft_heads import (MedusaHeads, eagle_loss_fn, feature_loss, head_evaluate, medusa_loss, medusa_loss_fn,
                             mtp_loss_fn)
from lib.speculative import (FeatureDrafter, LookupDrafter, MedusaDrafter, ModelDrafter,  # noqa: F401
                             accept_always, accept_draft, early_exit_model, exact_continuations, measure_group,
                             plain_generate, run_once, sampling_test, speculative_generate)
from lib.fast_decode import on_path
from main_distillation import distillation_loss  # the post's reuse: the draft is distilled
from lib.presets import student_preset

DEFAULTS = {"cpu": dict(draft_iters=150, head_iters=120, mtp_steps=60)}  # other presets: the student preset's iters
PASSES = "target's"  # the sampling check's verdict: the counts fit the target's distribution
HEAD_BATCH = 16  # windows per step of the Medusa and EAGLE heads: 2,048 positions, half a model's batch
DRAFTS = ["distilled", "distilled small", "lookup", "early exit", "medusa", "eagle", "mtp"]


def check_draft(target, draft, name):
    """A draft must speak the target's vocabulary and see at least its window."""
    t, d = target.config, draft.config
    if d.vocab_size != t.vocab_size:
        raise iu.GPTliteError(f"draft {name} has a vocabulary of {d.vocab_size} tokens, the target {t.vocab_size}: "
                              "speculation compares their distributions token by token; use a draft of the same vocabulary")
    if d.seqlen < t.seqlen:
        raise iu.GPTliteError(f"draft {name} has a window of {d.seqlen} tokens, shorter than the target's {t.seqlen}")
    return draft


def trained(model, config, name, preset, data, rebuild, stamp, steps, lr, seed, loss_fn, untrained, evaluate=None,
            batch_size=None):
    """`model` loaded from checkpoints/<preset>_spec_<name>.pt when its config and stamp match, else trained
    with train_steps (batches of batch_size windows, default the preset's) and saved.
    Returns (model, {variant (the draft), params, steps, source, val_loss})."""
    batch_size = batch_size or preset.batch_size
    path = files.checkpoint_path(f"{preset.name}_spec_{name.replace(' ', '_')}")
    evaluate = evaluate or (lambda m: training.validation_loss(m, data))
    history = []

    def train(m):
        history.extend(training.train_steps(m, data, steps, batch_size, preset.seqlen, lr, seed=seed, loss_fn=loss_fn,
                                            desc=f"training draft {name}", evaluate=evaluate))
        return history
    torch.manual_seed(seed)
    model, seconds = iu.cached_model(model, config, path, train, data.vocab, rebuild, stamp=dict(stamp, batch_size=batch_size),
                                     untrained=untrained)
    source = "untrained" if untrained else (f"trained in {seconds:.0f} s" if seconds is not None else f"loaded {path.name}")
    val_loss = history[-1]["val_loss"] if history else evaluate(model)  # training evaluated the final weights
    return model, dict(variant=name, params=iu.n_params(model), steps=steps, source=source, val_loss=val_loss)


def build_drafts(target, preset, data, device, args, rebuild):
    """The drafts of args.drafts: {name: (target name, make)}, make(path) a new drafter whose models run on
    that decode path (lib/fast_decode.on_path; the heads stay eager modules), the targets {name: GPTlite}
    and one row per trained draft (parameters, steps, how it was obtained, its validation loss: a model's
    own; a head's on the token after next). Only the drafts asked for are trained or loaded."""
    base = dict(seed=args.seed, base_sha256=None if args.untrained else files.checkpoint_sha256(
        preset.gptlite_kwargs(), data.vocab, target.state_dict()))
    common = dict(preset=preset, data=data, rebuild=rebuild, seed=args.seed, untrained=args.untrained)
    student, d, h, k = student_preset(preset), preset.d_model, preset.n_heads, preset.d_head
    drafters, targets, infos = {}, {"target": target}, []
    for name in args.drafts:
        torch.manual_seed(args.seed)
        if name in ("distilled", "distilled small"):
            config = dict(student.gptlite_kwargs(), n_layers=student.n_layers if name == "distilled" else 1)
            distill = training.teacher_loss_fn(target, lambda s, t, targets: distillation_loss(s, t, 2.0, targets, 0.5))
            draft, info = trained(GPTlite(**config).to(device), config, name, stamp=dict(base, steps=args.draft_iters),
                                  steps=args.draft_iters, lr=student.lr, loss_fn=distill, **common)
            drafters[name] = ("target", lambda path, m=check_draft(target, draft, name): ModelDrafter(on_path(m, path)))
        elif name == "lookup":
            drafters[name], info = ("target", lambda path: LookupDrafter(args.ngram)), None
        elif name == "early exit":
            drafters[name], info = ("target", lambda path, m=early_exit_model(target, args.exit_layers): ModelDrafter(
                on_path(m, path))), None
        elif name == "medusa":
            heads, info = trained(MedusaHeads(d, args.medusa_heads).to(device), dict(d_model=d, heads=args.medusa_heads),
                                  name, stamp=dict(base, steps=args.head_iters), steps=args.head_iters, lr=preset.lr,
                                  loss_fn=medusa_loss_fn(target), evaluate=head_evaluate(
                                      lambda m, x, y: medusa_loss(m, target, x, y), data, preset.seqlen),
                                  batch_size=HEAD_BATCH, **common)
            drafters[name] = ("target", lambda path, heads=heads: MedusaDrafter(heads, target))
        elif name == "eagle":
            eagle, info = trained(FeatureHead(d, h, k).to(device), dict(d_model=d, n_heads=h, d_head=k), name,
                                  stamp=dict(base, steps=args.head_iters), steps=args.head_iters, lr=preset.lr,
                                  loss_fn=eagle_loss_fn(target), evaluate=head_evaluate(
                                      lambda m, x, y: feature_loss(m, target, x, y), data, preset.seqlen),
                                  batch_size=HEAD_BATCH, **common)
            drafters[name] = ("target", lambda path, eagle=eagle: FeatureDrafter(eagle, target))
        else:  # mtp: the target's weights and a new MTP module, trained on together
            mtp = GPTlite_MTP(**preset.gptlite_kwargs()).to(device)
            mtp.load_state_dict(target.state_dict(), strict=False)
            mtp, info = trained(mtp, mtp.config.to_dict(), name, stamp=dict(base, steps=args.mtp_steps,
                                                                             weight=args.mtp_weight),
                                steps=args.mtp_steps, lr=preset.lr / 3, loss_fn=mtp_loss_fn(args.mtp_weight), **common)
            targets["mtp model"] = mtp.main_model()  # a plain GPTlite: the model MTP trained, without its module
            drafters[name] = ("mtp model", lambda path, mtp=mtp: FeatureDrafter(mtp.mtp, targets["mtp model"]))
        infos += [info] if info else []
    return drafters, targets, infos


def run_checks(targets, drafts, prompts_by_batch, gammas, n_tokens, stat, seed, path="eager"):
    """Correctness before any timing: {check: ok} and the statistical tests' rows (eager path only: the
    rule and the sampler are the same code on both paths; the fast path's tokens are checked greedy).

    Greedy: for every batch, draft and gamma the tokens equal generate()'s (no cache, the full forward pass
    each step). Sampling: the chi-square test of every draft (one batch of all the samples: rows that
    accepted more than the slowest give their next draft token, the slowest its correction), of plain
    sampling (a correct sampler: it must pass) and of the accept-always rule (a wrong one: it must fail)."""
    checks = {}
    for B, prompts in prompts_by_batch.items():
        expected = {t: generate(m, prompts, n_tokens, m.seqlen) for t, m in targets.items()}  # eager, no cache
        for t, m in targets.items():  # the baseline of every speedup on this path
            checks[f"greedy, batch {B}, {path} path: plain decoding of the {t} = generate's"] = torch.equal(
                plain_generate(on_path(m, path), prompts, n_tokens), expected[t])
        for name, (t, drafter) in drafts.items():
            on_it = on_path(targets[t], path)
            same = all(torch.equal(run_once(on_it, drafter, prompts, n_tokens, g, None, seed)[0], expected[t])
                       for g in gammas)
            checks[f"greedy, batch {B}, {path} path: {name} tokens = the target's for gamma "
                   f"{gammas[0]}..{gammas[-1]}"] = same
    if path != "eager":
        return checks, []
    prompt, g = next(iter(prompts_by_batch.values()))[0, -stat["prompt_len"]:], stat["gamma"]
    control = next(iter(drafts))
    tests = {name: (t, d, accept_draft) for name, (t, d) in drafts.items()}
    tests |= {"plain sampling (control)": ("target", None, None),
              f"{control}, accept always (control)": (drafts[control][0], drafts[control][1], accept_always)}
    exact = {t: exact_continuations(m, prompt, stat["chars"], stat["temperature"]) for t, m in targets.items()}
    rows = []
    for name, (t, drafter, accept) in tests.items():
        result = sampling_test(targets[t], drafter, prompt, exact[t], g, stat["temperature"], stat["samples"], seed,
                               accept or accept_draft)
        p_value = result["p_value"]
        passed = p_value is not None and p_value >= stat["significance"]
        rows.append(dict(variant=name, gamma=None if drafter is None else g, samples=stat["samples"],
                         chi2=round(result["statistic"], 1), dof=result["dof"], p_value=p_value,
                         tv=round(result["tv"], 3),
                         verdict="too few samples" if p_value is None else PASSES if passed else "rejected"))
        if p_value is not None:  # a test that cannot judge (too few samples for the cells) checks nothing
            ok = not passed if accept is accept_always else passed
            checks[f"sampling: {name} {'fails' if accept is accept_always else 'passes'} the chi-square test"] = ok
    return checks, rows


def best_rows(results, path, batch, decoding):
    """The main table's rows of one group: plain decoding of each target (the median of its runs beside
    every draft), then each draft at the gamma of its best measured speedup (the first gamma when no TPOT
    could be measured), with the TPOT of the plain runs timed beside it (its speedup's baseline)."""
    rows = []
    for target in dict.fromkeys(r["target"] for r in results):
        plain = [r for r in results if r["draft"] == "plain" and r["target"] == target]
        tpots = [r["tpot_ms"] for r in plain if r["tpot_ms"] is not None]
        rows.append(harness.make_row(f"plain ({target})", path=path, batch_size=batch, decoding=decoding, gamma=None,
                                     ttft_ms=iu.median([r["ttft_ms"] for r in plain]),
                                     tpot_ms=iu.median(tpots) if tpots else None,
                                     tokens_per_s=iu.median([r["tokens_per_s"] for r in plain]), speedup=1.0))
    for name in dict.fromkeys(r["draft"] for r in results if r["draft"] != "plain"):
        mine = [r for r in results if r["draft"] == name]
        best = max(mine, key=lambda r: -1 if r["speedup"] is None else r["speedup"])
        rows.append(harness.make_row(name, path=path, batch_size=batch, decoding=decoding, gamma=best["gamma"],
                                     ttft_ms=best["ttft_ms"],
                                     tpot_ms=best["tpot_ms"], tokens_per_s=best["tokens_per_s"],
                                     **{k: rounded(best[k]) for k in ("plain_tpot_ms", "speedup", "alpha", "tau",
                                                                      "tau_formula", "c", "verify", "speedup_formula",
                                                                      "speedup_formula_verify")}))
    return rows


def plain_spread(sweep):
    """How much the machine's speed moved during the run: plain decoding's TPOT, timed beside each draft."""
    groups = dict.fromkeys((r["path"], r["batch_size"], r["decoding"]) for r in sweep)
    parts = []
    for path, batch, decoding in groups:
        tpots = [r["tpot_ms"] for r in sweep if r["draft"] == "plain" and r["target"] == "target" and r["path"] == path
                 and r["batch_size"] == batch and r["decoding"] == decoding and r["tpot_ms"] is not None]
        if tpots:
            parts.append(f"{path} batch {batch} {decoding} {min(tpots):.3f}-{max(tpots):.3f} ms")
    return ("plain decoding's TPOT, timed beside each draft (the machine's speed during the run): "
            + ", ".join(parts))


def rounded(value, digits=3):
    return None if value is None else round(value, digits)


def gamma_table(results, gammas, path, batch, decoding):
    """Measured speedup (and tau) of every draft at every gamma, one row per draft."""
    rows = []
    for name in dict.fromkeys(r["draft"] for r in results if r["draft"] != "plain"):
        by_gamma = {r["gamma"]: r for r in results if r["draft"] == name}
        rows.append(dict(variant=name, **{f"x g={g}": rounded(by_gamma[g]["speedup"], 2) for g in gammas},
                         **{f"tau g={g}": rounded(by_gamma[g]["tau"], 2) for g in gammas[-1:]}))
    return harness.table(f"speedup over plain decoding by gamma, {path} path, batch {batch}, {decoding} (and tau at "
                         "the largest)",
                         rows)


def plot_sweep(sweep, title):
    """At batch 1 (the smallest), greedy: the speedup against gamma on each decode path, and tau, measured
    (solid) beside the formula (dashed; dotted: with the verification pass's measured cost)."""
    paths = list(dict.fromkeys(r["path"] for r in sweep))
    batch = min(r["batch_size"] for r in sweep)
    fig, axes = harness.new_figure(len(paths) + 1)
    for ax, path in zip(axes, paths):
        group = [r for r in sweep if r["path"] == path and r["batch_size"] == batch and r["decoding"] == "greedy"
                 and r["draft"] != "plain"]
        for i, name in enumerate(dict.fromkeys(r["draft"] for r in group)):
            mine = [r for r in group if r["draft"] == name]
            gammas = [r["gamma"] for r in mine]
            ax.plot(gammas, [r["speedup"] for r in mine], marker="o", color=f"C{i}", label=name)
            ax.plot(gammas, [r["speedup_formula"] for r in mine], linestyle="--", color=f"C{i}")
            ax.plot(gammas, [r["speedup_formula_verify"] for r in mine], linestyle=":", color=f"C{i}")
            if path == paths[0]:  # tau does not depend on the path (the same tokens)
                axes[-1].plot(gammas, [r["tau"] for r in mine], marker="o", color=f"C{i}", label=name)
                axes[-1].plot(gammas, [r["tau_formula"] for r in mine], linestyle="--", color=f"C{i}")
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set(xlabel="gamma (draft tokens per round)", ylabel="speedup over plain decoding",
               title=f"{title}, {path} path, batch {batch}, greedy:\nmeasured (solid), formula (dashed; dotted: "
                     "with the verify pass's cost)")
        ax.legend(fontsize=8)
    axes[-1].set(xlabel="gamma (draft tokens per round)", ylabel="tau (tokens per target call)",
                 title="tokens per target call: measured (solid), formula (dashed)")
    return fig


def parse_args(argv):
    """The flags, checked before any work: (args, preset, device, data)."""
    parser = harness.script_parser(__doc__)
    add = parser.add_argument
    add("--gammas", type=harness.int_at_least(1), nargs="+", default=list(range(1, 9)),
        help="draft tokens per round, one measurement each (default 1 .. 8)")
    add("--batch-sizes", type=harness.int_at_least(1, harness.MAX_SIZE), nargs="+", default=[1, 8], help="a row group each")
    add("--temperature", type=harness.temperature, default=0.8, help="the sampling rows' temperature")
    add("--drafts", nargs="+", choices=DRAFTS, default=DRAFTS, help="the drafts measured (default: all)")
    add("--ngram", type=harness.int_at_least(1, harness.MAX_SIZE), default=3, help="longest n-gram prompt lookup matches")
    add("--exit-layers", type=harness.int_at_least(1), default=None,
        help="layers of the early-exit draft (default: half the target's)")
    add("--medusa-heads", type=harness.int_at_least(1, 64), default=None,
        help="Medusa heads (default: the largest gamma of --gammas and --stat-gamma)")
    add("--draft-iters", type=harness.steps, default=None,
        help=f"steps of each distilled draft (default {DEFAULTS['cpu']['draft_iters']} on cpu, else the student preset's)")
    add("--head-iters", type=harness.steps, default=None,
        help=f"steps of the Medusa and EAGLE heads (default {DEFAULTS['cpu']['head_iters']} on cpu, else 1000)")
    add("--mtp-steps", type=harness.steps, default=None,
        help=f"steps of training the target on with the MTP loss (default {DEFAULTS['cpu']['mtp_steps']} on cpu, else 500)")
    add("--mtp-weight", type=harness.float_in(0.0, 100.0, low_open=True), default=0.3, help="weight of the MTP loss")
    add("--stat-samples", type=harness.int_at_least(100), default=4000, help="samples of the chi-square test")
    add("--stat-chars", type=harness.int_at_least(2), default=3,
        help="characters after the prompt it counts (the first is the prefill's, the others drafted)")
    add("--stat-gamma", type=harness.int_at_least(1), default=2, help="draft tokens per round in the chi-square test")
    add("--significance", type=harness.float_in(0, 1, low_open=True, high_open=True), default=1e-3,
        help="the chi-square test's significance level")
    harness.add_generation_flags(parser, prompt_len=32, n_tokens=40, repeats=3)
    harness.add_paths_flag(parser)
    args = parser.parse_args(argv)
    drafts = set(args.drafts)
    for flags, needs, names in [(["--draft-iters"], "--drafts distilled or 'distilled small'", {"distilled", "distilled small"}),
                                (["--ngram"], "--drafts lookup", {"lookup"}),
                                (["--exit-layers"], "--drafts 'early exit'", {"early exit"}),
                                (["--medusa-heads"], "--drafts medusa", {"medusa"}),
                                (["--head-iters"], "--drafts medusa or eagle", {"medusa", "eagle"}),
                                (["--mtp-steps", "--mtp-weight"], "--drafts mtp", {"mtp"})]:
        harness.check_applies(parser, args, flags, needs, bool(drafts & names))

    def check_args(preset):
        if len(set(args.gammas)) != len(args.gammas) or args.gammas != sorted(args.gammas):
            parser.error(f"--gammas must be increasing without repeats, got {args.gammas}")
        if len(set(args.batch_sizes)) != len(args.batch_sizes):
            parser.error(f"--batch-sizes repeats a value: {args.batch_sizes}")
        if args.prompt_len + max(args.gammas + [args.stat_gamma]) + 1 > preset.seqlen:
            parser.error(f"--gammas/--stat-gamma: gamma={max(args.gammas + [args.stat_gamma])} and the gamma + 1 "
                         f"tokens of a verification pass after a {args.prompt_len}-token prompt exceed the window "
                         f"seqlen={preset.seqlen}; use gamma <= {preset.seqlen - args.prompt_len - 1}")
        if args.prompt_len + args.n_tokens - 1 > preset.seqlen:
            parser.error(f"--n-tokens: {args.prompt_len} + {args.n_tokens} tokens exceed the window seqlen="
                         f"{preset.seqlen} (speculation rolls its cache back within one window)")
        if preset.vocab_size ** args.stat_chars > 2**22:
            parser.error(f"--stat-chars {args.stat_chars}: {preset.vocab_size}^{args.stat_chars} continuations are "
                         "too many to score exactly; use 3 or fewer")
        args.exit_layers = args.exit_layers or max(preset.n_layers // 2, 1)
        if args.exit_layers >= preset.n_layers:
            parser.error(f"--exit-layers must be below the target's {preset.n_layers} layers, got {args.exit_layers}")
        largest = max(args.gammas + [args.stat_gamma])
        args.medusa_heads = args.medusa_heads or largest
        if args.medusa_heads < largest and "medusa" in args.drafts:
            parser.error(f"--medusa-heads {args.medusa_heads}: gamma={largest} needs as many heads")
        defaults = DEFAULTS.get(preset.name, dict(draft_iters=student_preset(preset).iters, head_iters=1000,
                                                  mtp_steps=500))
        for key, value in defaults.items():
            setattr(args, key, getattr(args, key) or value)
        harness.check_fits(parser, "--stat-samples", 4 * preset.vocab_size ** args.stat_chars * 8,
                           f"the exact probabilities of {args.stat_chars} characters")
    return (args, *harness.setup(args, parser, check_args))


def headline(rows, stat_rows):
    """The README's one-glance row: the best measured speedup per path, batch and decoding, and the sampling check."""
    def best(path, batch, decoding):
        mine = [r for r in rows if (r["path"], r["batch_size"], r["decoding"]) == (path, batch, decoding)
                and r["gamma"] and r["speedup"] is not None]
        r = max(mine, key=lambda r: r["speedup"], default=None)
        return (f"{decoding} -" if r is None else
                f"{decoding} {r['variant']} {r['speedup']:.2f}x (gamma {r['gamma']}, alpha {r['alpha']:.2f}, tau {r['tau']:.2f})")
    paths, decodings = dict.fromkeys(r["path"] for r in rows), dict.fromkeys(r["decoding"] for r in rows)
    batches = dict.fromkeys(r["batch_size"] for r in rows)
    gammas = sorted({r["gamma"] for r in rows if r["gamma"]})
    tests = [r for r in stat_rows if "control" not in r["variant"]]
    control = next(r for r in stat_rows if "accept always" in r["variant"])
    p = control["p_value"]
    control_p = "too few samples" if p is None else (f"chi-square {control['chi2']:.0f} on {control['dof']} degrees of "
                                                     f"freedom, p {f'{p:.0e}' if p > 0 else 'below 1e-300'}")
    return dict(technique=f"speculative decoding, {len(tests)} drafts, best gamma of {gammas[0]}..{gammas[-1]}",
                figure="; ".join(f"{p} batch {b}: " + ", ".join(best(p, b, d) for d in decodings)
                                 for p in paths for b in batches)
                + f"; sampling: {sum(r['verdict'] == PASSES for r in tests)} of {len(tests)} drafts "
                  f"keep the target's distribution (chi-square), accept-always rejected ({control_p})")


def measure_paths(targets, drafts, prompts, args, device):
    """Every path, batch and decoding (lib/speculative.measure_group): the main rows, the sweep, the gamma tables."""
    rows, sweep, tables = [], [], []
    for path in args.paths:
        path_targets = {t: on_path(m, path) for t, m in targets.items()}
        for B in args.batch_sizes:
            for decoding, temperature in (("greedy", None), (f"T={args.temperature:g}", args.temperature)):
                print(f"timing the {path} path, batch {B}, {decoding}: plain decoding and {len(drafts)} drafts x "
                      f"{len(args.gammas)} gammas")
                path_drafts = {name: (t, make(path)) for name, (t, make) in drafts.items()}  # fresh caches
                results = measure_group(path_targets, path_drafts, prompts[B], args.gammas, args.n_tokens, temperature,
                                        device, args.repeats, args.seed)
                rows += best_rows(results, path, B, decoding)
                sweep += [dict(r, path=path, batch_size=B, decoding=decoding) for r in results]
                tables.append(gamma_table(results, args.gammas, path, B, decoding))
    return rows, sweep, tables


def main(argv=None):
    args, preset, device, data = parse_args(argv)
    target = iu.load_model(GPTlite, preset, device, data, untrained=args.untrained, seed=args.seed)
    rebuild = files.rebuild_command("main_speculative_decoding.py", argv, preset)
    drafts, targets, infos = build_drafts(target, preset, data, device, args, rebuild)
    prompts = {B: corpus.sample_prompts(data, B, args.prompt_len, seed=args.seed, device=device)
               for B in args.batch_sizes}
    stat = dict(prompt_len=args.prompt_len, chars=args.stat_chars, temperature=args.temperature, gamma=args.stat_gamma,
                samples=args.stat_samples, significance=args.significance)
    checks, stat_rows = {}, []
    for path in args.paths:  # each path with drafters of its own (they hold caches)
        on_path_checks, rows = run_checks(targets, {name: (t, make(path)) for name, (t, make) in drafts.items()},
                                          prompts, args.gammas, args.n_tokens, stat, args.seed, path)
        checks |= on_path_checks
        stat_rows += rows
    harness.require_checks(checks)  # before anything is timed or written
    rows, sweep, tables = measure_paths(targets, drafts, prompts, args, device)
    tables += [harness.table("the drafts", infos),
               harness.table(f"sampling check: the first {args.stat_chars} characters after a prompt against the "
                             f"target's exact probabilities (Pearson chi-square, T={args.temperature:g})", stat_rows)]
    print(f"\n{args.prompt_len}-token prompts, {args.n_tokens} new tokens, median of {args.repeats}; speedup = "
          "plain_tpot_ms (plain decoding of the same target, batch and decoding, timed beside the draft) / TPOT; "
          "c = draft time per draft token / target step; verify = the gamma + 1 token pass / target step")
    summary = ["a batch keeps in every row the fewest draft tokens any row accepted: tau falls with the batch",
               plain_spread(sweep)]
    if "mtp" in drafts:
        summary.append(f"the mtp rows' target is {preset.name}.pt trained {args.mtp_steps} more steps with the MTP loss "
                       f"(val loss {next(i for i in infos if i['variant'] == 'mtp')['val_loss']:.4f}); the other rows' "
                       f"is {preset.name}.pt itself")
    harness.report(args, "main_speculative_decoding.py", preset, device, rows, headline(rows, stat_rows),
                   summary=summary,
                   tables=tables, plot=lambda: plot_sweep(sweep, f"{preset.name} ({device})"), sweep=sweep,
                   checks=checks, gammas=args.gammas, n_tokens=args.n_tokens, prompt_len=args.prompt_len)


if __name__ == "__main__":
    harness.run(main)
