"""Structured pruning (Minitron-style): remove the least important attention heads and MLP neurons of
every block, really shrinking the weight matrices, then recover the loss by distilling from the original.

    python main_pruning.py                             # cpu preset: prune checkpoints/cpu.pt to half
    python main_pruning.py --preset gptlite --iters 2000 --json prune.json --plot prune.png
    python main_pruning.py --untrained --iters 10      # random weights, a quick smoke run

Blog section: "Pruning". Importance is measured on calibration batches: a head's is the norm of its
output (the input of out_proj, per head), a neuron's the absolute value of its ReLU output, summed over
every token. Keeping the top heads and neurons of every block slices rows and columns out of
query/key/value_proj, out_proj and the two MLP layers, so the pruned model is a plain, smaller GPTlite
with config n_heads = kept heads and d_ff = kept neurons (faster, smaller, smaller KV cache).

Three ways to reach the same half-size model, each with the same total distillation steps from the
original model as teacher: (1) one shot, then distill; (2) iteratively, --step of the original heads and
neurons at a time, re-scoring and distilling after each step; (3) baseline: the same small architecture
from random weights. The script checks that the pruned model's logits equal the original's with the
removed heads' outputs and neurons' activations zeroed, and reports the loss right after pruning by
importance against pruning random heads and neurons. Nothing is written unless every check passes;
with --save PATH the best pruned model is kept, a plain GPTlite whose config has n_heads and d_ff:
files.load_checkpoint(PATH), then GPTlite(**ckpt["config"]).
"""
import copy
import dataclasses
import functools

import torch
import torch.nn as nn

import inference_utils as iu
from gptlite import GPTlite
from lib import corpus, files, harness, training
from lib.errors import GPTliteError
from main_distillation import distillation_loss  # the post's reuse: pruning recovers by distillation

DEFAULT_ITERS = {"cpu": 200}  # distillation steps per variant; other presets: 2000
ZEROED_ATOL = 1e-4  # float32 logits of the pruned model against the original with the same heads and neurons zeroed


@torch.no_grad()
def compute_importance(model, data, n_batches, batch_size, seqlen, seed=0):
    """Importance of every head and MLP neuron of every block, summed over `n_batches` calibration
    batches of the training split. Returns heads and neurons, lists with one tensor per block:
    [n_heads] and [d_ff]."""
    if min(n_batches, batch_size) < 1 or not 1 <= seqlen <= model.seqlen:
        raise ValueError(f"need n_batches, batch_size >= 1 and 1 <= seqlen <= {model.seqlen}, "
                         f"got {n_batches}, {batch_size}, {seqlen}")
    device, config = next(model.parameters()).device, model.config
    heads = [torch.zeros(config.n_heads, device=device) for _ in range(config.n_layers)]
    neurons = [torch.zeros(config.d_ff, device=device) for _ in range(config.n_layers)]

    def head_hook(layer):
        def hook(module, args):  # forward pre-hook of out_proj: args[0] is the merged heads [B, S, H*D]
            per_head = args[0].unflatten(-1, (config.n_heads, config.d_head))  # [B, S, H, D]
            heads[layer] += per_head.norm(dim=-1).sum(dim=(0, 1))  # [H]
        return hook

    def neuron_hook(layer):
        def hook(module, args, out):  # forward hook of the ReLU: out [B, S, d_ff]
            neurons[layer] += out.abs().sum(dim=(0, 1))  # [d_ff]
        return hook

    handles = []
    for layer, block in enumerate(model.blocks):
        handles.append(block.mha.out_proj.register_forward_pre_hook(head_hook(layer)))
        handles.append(block.ffwd.net[1].register_forward_hook(neuron_hook(layer)))
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    try:
        for _ in range(n_batches):
            x, _ = corpus.get_batch(data.train, batch_size, seqlen, generator, device)
            model(x)
    finally:  # the hooks never outlive the call, even on an error
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return heads, neurons


def top_indices(scores, k):
    """The indices of the k highest scores, in their original order."""
    return scores.topk(k).indices.sort().values


def prune_linear(linear, rows=None, columns=None):
    """A new nn.Linear that keeps the output features `rows` and the input features `columns` (None: all)."""
    weight, bias = linear.weight, linear.bias  # weight: [out_features, in_features]
    if rows is not None:
        weight, bias = weight[rows], bias[rows] if bias is not None else None
    if columns is not None:
        weight = weight[:, columns]
    pruned = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                       device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        pruned.weight.copy_(weight)
        if bias is not None:
            pruned.bias.copy_(bias)
    return pruned


def prune(model, heads, neurons, n_heads, n_neurons):
    """Keep the n_heads most important heads and n_neurons most important MLP neurons of every block,
    slicing the weights in place. heads, neurons: one score tensor per block, [n_heads] and [d_ff], as
    compute_importance returns them (or stacked: [n_layers, n_heads], [n_layers, d_ff]). Returns the model,
    whose config now has n_heads and d_ff = n_neurons."""
    config = model.config
    H, d_ff, L, D = config.n_heads, config.d_ff, config.n_layers, config.d_head
    shapes = [tuple(t.shape) for t in heads], [tuple(t.shape) for t in neurons]
    if shapes != ([(H,)] * L, [(d_ff,)] * L):
        raise ValueError(f"importance scores of shapes {shapes[0]} and {shapes[1]} do not fit the model: "
                         f"expected {L} of ({H},) and {L} of ({d_ff},)")
    for name, keep, have in [("n_heads", n_heads, H), ("n_neurons", n_neurons, d_ff)]:
        if not isinstance(keep, int) or not 1 <= keep <= have:
            raise ValueError(f"{name} (kept per block) must be an integer between 1 and {have}, got {keep!r}")
    for layer, block in enumerate(model.blocks):
        mha, mlp = block.mha, block.ffwd.net
        kept = top_indices(heads[layer], n_heads).to(mha.out_proj.weight.device)  # [n_heads]
        dims = (kept[:, None] * D + torch.arange(D, device=kept.device)).flatten()  # [n_heads*D]
        mha.query_proj = prune_linear(mha.query_proj, rows=dims)
        mha.key_proj = prune_linear(mha.key_proj, rows=dims)
        mha.value_proj = prune_linear(mha.value_proj, rows=dims)
        mha.out_proj = prune_linear(mha.out_proj, columns=dims)
        mha.n_heads = n_heads
        kept = top_indices(neurons[layer], n_neurons).to(mlp[0].weight.device)  # [n_neurons]
        mlp[0] = prune_linear(mlp[0], rows=kept)
        mlp[2] = prune_linear(mlp[2], columns=kept)
    model.config = dataclasses.replace(config, n_heads=n_heads, d_ff=n_neurons)
    return model


@torch.no_grad()
def logits_with_zeroed(model, keep_heads, keep_neurons, x):
    """The model's logits on x when only the heads keep_heads[layer] and neurons keep_neurons[layer] speak:
    on a copy, the columns of out_proj that read the other heads and of the second MLP layer that read the
    other neurons are zeroed. What pruning must give, without removing anything."""
    zeroed = copy.deepcopy(model).eval()
    for block, kept_heads, kept_neurons in zip(zeroed.blocks, keep_heads, keep_neurons):
        out_proj, mlp_out = block.mha.out_proj, block.ffwd.net[2]
        head_of_column = torch.arange(out_proj.in_features, device=x.device) // model.config.d_head  # [H*D]
        neuron_of_column = torch.arange(mlp_out.in_features, device=x.device)  # [d_ff]
        out_proj.weight[:, ~torch.isin(head_of_column, kept_heads.to(x.device))] = 0
        mlp_out.weight[:, ~torch.isin(neuron_of_column, kept_neurons.to(x.device))] = 0
    return zeroed(x)


def prune_one_shot(teacher, heads, neurons, n_heads, n_neurons, x):
    """A pruned copy of the teacher, checked first: its logits on x [B, S] must be the teacher's with the
    same heads and neurons zeroed, up to float32 rounding. Returns it and the max |logit difference|."""
    pruned = prune(copy.deepcopy(teacher), heads, neurons, n_heads, n_neurons)
    keep_heads, keep_neurons = [top_indices(h, n_heads) for h in heads], [top_indices(n, n_neurons) for n in neurons]
    with torch.no_grad():
        error = (pruned(x) - logits_with_zeroed(teacher, keep_heads, keep_neurons, x)).abs().max().item()
    if error > ZEROED_ATOL:
        raise GPTliteError(f"the pruned model differs from the original with those heads and neurons zeroed "
                              f"(max |logit diff| {error:.1e}); this is a bug (nothing written)")
    return pruned, error


def random_pruning_losses(teacher, data, n_heads, n_neurons, draws, seed):
    """Validation loss right after keeping random heads and neurons (as many as by importance), per draw."""
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(draws):
        config = teacher.config
        heads = [torch.rand(config.n_heads, generator=generator) for _ in range(config.n_layers)]
        neurons = [torch.rand(config.d_ff, generator=generator) for _ in range(config.n_layers)]
        losses.append(training.validation_loss(prune(copy.deepcopy(teacher), heads, neurons, n_heads, n_neurons), data))
    return losses


def distill_curve(distill, model, data, n_steps, desc, start=0):
    """Distill `model` for n_steps. Returns its loss before and its curve [(step, loss)], counted from `start`."""
    before = training.validation_loss(model, data)
    return before, [(start, before)] + [(start + h["step"], h["val_loss"])
                                        for h in distill(model, n_steps=n_steps, desc=desc)]


def iterative_pruning(teacher, data, importance, distill, keep, n_stages, n_heads, n_neurons, iters):
    """n_stages times: re-score, prune to the next size (1 - keep of the original removed in equal steps),
    distill; iters steps in all. Returns the model, its loss right after the last prune and its curve."""
    model, done, curve = copy.deepcopy(teacher), 0, []
    H, d_ff = teacher.config.n_heads, teacher.config.d_ff
    for stage in range(1, n_stages + 1):
        fraction = 1 - (1 - keep) * stage / n_stages
        heads, neurons = importance(model)
        prune(model, heads, neurons, max(round(fraction * H), n_heads), max(round(fraction * d_ff), n_neurons))
        n_steps = iters * stage // n_stages - done
        desc = f"iterative {stage}/{n_stages}, distilling"
        pruned_loss, part = distill_curve(distill, model, data, n_steps, desc, done)
        curve, done = curve + part, done + n_steps
    return model, pruned_loss, curve


def from_scratch(config, data, distill, iters, seed, device):
    """The baseline: the pruned architecture (`config`, a GPTliteConfig) from random weights, distilled with
    the same budget. Returns the model, its loss before training and its curve."""
    torch.manual_seed(seed)
    model = GPTlite.from_config(config).to(device)
    return (model, *distill_curve(distill, model, data, iters, "random init, distilling"))


def prune_three_ways(teacher, data, distill, importance, x, keep, stages, n_heads, n_neurons, iters, draws, seed):
    """(1) one shot, checked first against the original with the removed heads and neurons zeroed on x,
    then distilled; (2) iteratively, the same total steps; (3) the baseline: the same architecture from random
    weights. Returns {name: student}, {name: loss right after pruning}, {name: curve}, the losses of `draws`
    random prunings and the one-shot check's max |logit difference|."""
    one_shot, error = prune_one_shot(teacher, *importance(teacher), n_heads, n_neurons, x)
    pruned_loss, curves = {}, {}
    pruned_loss["one-shot"], curves["one-shot"] = distill_curve(distill, one_shot, data, iters, "one-shot, distilling")
    random_losses = random_pruning_losses(teacher, data, n_heads, n_neurons, draws, seed)
    iterative, pruned_loss["iterative"], curves["iterative"] = iterative_pruning(
        teacher, data, importance, distill, keep, stages, n_heads, n_neurons, iters)
    scratch, pruned_loss["random init"], curves["random init"] = from_scratch(
        one_shot.config, data, distill, iters, seed, x.device)
    students = {"one-shot": one_shot, "iterative": iterative, "random init": scratch}
    return students, pruned_loss, curves, random_losses, error


NAMES = {"original": "original", "one-shot": "one-shot + distill", "iterative": "iterative + distill",
         "random init": "random init + distill"}


def table_rows(figures, val_losses, pruned_loss, random_losses):
    rows = [harness.make_row(NAMES[name], **figures[name], val_loss=val_losses[name], val_pruned=pruned_loss.get(name))
            for name in figures]
    pruned = figures["one-shot"]
    rows.insert(2, harness.make_row(f"random prune (mean of {len(random_losses)})", params=pruned["params"],
                               size_mb=pruned["size_mb"], val_pruned=sum(random_losses) / len(random_losses)))
    return rows


def summary_lines(device, error, pruned_loss, random_losses, val_losses, best):
    wins = val_losses[best] < val_losses["random init"]
    return [iu.peak_memory_label(device),
            f"pruned logits vs original with those heads and neurons zeroed: max |diff| {error:.1e}",
            f"right after pruning: by importance {pruned_loss['one-shot']:.4f}, random {min(random_losses):.4f} .. "
            f"{max(random_losses):.4f}; after distillation: best pruned ({best}) {val_losses[best]:.4f} vs random "
            f"init {val_losses['random init']:.4f} ({'pruning wins' if wins else 'pruning does NOT win'})"]


def headline(rows, config, iters):
    """The README's one-glance row, from this run's rows."""
    original, one_shot, iterative, scratch, random_prune = (next(r for r in rows if r["variant"].startswith(v)) for v in
                                                            ("original", "one-shot", "iterative", "random init",
                                                             "random prune"))
    return dict(technique=f"pruning to {config.n_heads} heads and {config.d_ff} neurons a block, {iters} "
                          "distillation steps",
                figure=f"val loss one-shot {one_shot['val_loss']:.3f}, iterative {iterative['val_loss']:.3f}, the same "
                       f"architecture from random weights {scratch['val_loss']:.3f} (original {original['val_loss']:.3f}); "
                       f"right after pruning {one_shot['val_pruned']:.2f} by importance against "
                       f"{random_prune['val_pruned']:.2f} at random")


def plot_curves(curves, original_loss, title):
    fig, ax = harness.new_figure()
    for name, curve in curves.items():
        ax.plot(*zip(*curve), marker="o", markersize=3, label=NAMES[name])
    ax.axhline(original_loss, color="gray", linestyle="--", label="original")
    ax.set(xlabel="distillation steps", ylabel="validation loss (nats/char)", title=title)
    ax.legend()
    return fig


def n_stages(keep, step):
    return max(round((1 - keep) / step), 1)


def parse_args(argv):
    """The flags, checked before any work: (args, preset, device, data)."""
    parser = harness.script_parser(__doc__)
    add = parser.add_argument
    add("--iters", type=harness.steps, default=None,
        help=f"distillation steps of each variant (default: {DEFAULT_ITERS['cpu']} for the cpu preset, else 2000)")
    add("--keep", type=harness.float_in(0, 1, low_open=True, high_open=True), default=0.5,
        help="fraction of the heads and MLP neurons kept per block, in (0, 1)")
    add("--step", type=harness.float_in(0, 1, low_open=True), default=0.1,
        help="fraction of the original heads and neurons removed per iterative step (at most 1 - --keep)")
    add("--temperature", type=harness.temperature, default=2.0, help="softening temperature T of the soft labels")
    add("--alpha", type=harness.float_in(0, 1), default=0.0, help="weight of the hard labels in the distillation loss")
    add("--lr", type=harness.learning_rate, default=None, help="peak learning rate of distillation (default: the preset's)")
    add("--batch-size", type=harness.int_at_least(1), default=None,
        help="distillation and calibration batch (default: the preset's)")
    add("--calib-batches", type=harness.batches, default=8, help="calibration batches of the importance scores")
    add("--random-draws", type=harness.repeats, default=5, help="random prunings compared with the pruning by importance")
    add("--save", default=None, metavar="PATH", help="also save the best pruned model there (default: not saved)")
    harness.add_generation_flags(parser, prompt_len=32, n_tokens=128, repeats=5)
    args = parser.parse_args(argv)

    def check_args(preset):
        if args.step > 1 - args.keep + 1e-9:  # --keep 0.9 --step 0.1: 1 - 0.9 is 0.0999... in floating point
            parser.error(f"--step must be at most 1 - --keep = {1 - args.keep:g}, got {args.step}")
        stages = n_stages(args.keep, args.step)
        if args.iters is not None and args.iters < stages:
            parser.error(f"--iters must be at least the {stages} iterative steps (one distillation step each)")
        batch_size = args.batch_size or preset.batch_size  # a distillation step: the student and the teacher's labels
        harness.check_fits(parser, "--batch-size", training.activation_bytes(preset, batch_size, backward=True)
                           + training.activation_bytes(preset, batch_size), f"a training batch of {batch_size} windows")
        harness.check_fits(parser, "--n-tokens", 3 * (args.prompt_len + args.n_tokens) * 8,
                           f"{args.n_tokens} new tokens after a prompt")
    return (args, *harness.setup(args, parser, check_args))


def main(argv=None):
    args, preset, device, data = parse_args(argv)
    teacher = iu.load_model(GPTlite, preset, device, data, untrained=args.untrained, seed=args.seed)
    teacher.requires_grad_(False)
    iters = args.iters if args.iters is not None else DEFAULT_ITERS.get(preset.name, 2000)
    lr = args.lr if args.lr is not None else preset.lr
    batch_size = args.batch_size if args.batch_size is not None else preset.batch_size
    H, d_ff = teacher.config.n_heads, teacher.config.d_ff
    n_heads, n_neurons = max(round(args.keep * H), 1), max(round(args.keep * d_ff), 1)
    loss = functools.partial(distillation_loss, temperature=args.temperature, alpha=args.alpha)
    distill = functools.partial(training.train_steps, data=data, batch_size=batch_size, seqlen=preset.seqlen, lr=lr,
                                seed=args.seed, loss_fn=training.teacher_loss_fn(teacher, loss),
                                hint=training.distillation_hint(args.temperature, lr))
    importance = functools.partial(compute_importance, data=data, n_batches=args.calib_batches, batch_size=batch_size,
                                   seqlen=preset.seqlen, seed=args.seed)
    print(f"pruning every block from {H} heads and {d_ff} neurons to {n_heads} and {n_neurons}; "
          f"{iters} distillation steps of batch {batch_size} per variant, lr {lr}, T={args.temperature}, alpha={args.alpha}")
    x, _ = corpus.get_batch(data.val, 4, preset.seqlen, torch.Generator().manual_seed(args.seed), device)
    students, pruned_loss, curves, random_losses, error = prune_three_ways(
        teacher, data, distill, importance, x, args.keep, n_stages(args.keep, args.step), n_heads, n_neurons, iters,
        args.random_draws, args.seed)
    config = students["one-shot"].config  # the pruned n_heads and d_ff
    val_losses = {"original": training.validation_loss(teacher, data)} | {n: training.validation_loss(m, data)
                                                                          for n, m in students.items()}
    best = min(("one-shot", "iterative"), key=val_losses.get)
    models = {"original": teacher} | students
    prompts = corpus.sample_prompts(data, 1, args.prompt_len, seed=args.seed, device=device)
    cached, checks = iu.kv_cache_checks(models, prompts, args.n_tokens)
    harness.require_checks(checks)  # before anything is timed or written
    rows = table_rows(iu.measure_models(models, cached, prompts, args.n_tokens, device, args.repeats), val_losses,
                      pruned_loss, random_losses)
    print(f"\nkept {n_heads}/{H} heads and {n_neurons}/{d_ff} neurons per block; {iters} distillation steps each; "
          f"generation: batch 1, {args.prompt_len}-token prompts, {args.n_tokens} new tokens with the KV cache, median of {args.repeats}")
    print("val_pruned: right after pruning (iterative: after its last step; random init: before training); "
          "val loss: after distillation")
    if args.save:
        training.save_and_reload(args.save, students[best], config.to_dict(), data.vocab,
                                 files.rebuild_command("main_pruning.py", argv, preset), teacher=preset.name,
                                 variant=best, iters=iters, val_loss=val_losses[best])
    title = f"pruning {preset.name} to {args.keep:g} of the heads and neurons ({device})"
    harness.report(args, "main_pruning.py", preset, device, rows, headline(rows, config, iters),
                   summary=summary_lines(device, error, pruned_loss, random_losses, val_losses, best),
                   plot=lambda: plot_curves(curves, val_losses["original"], title), config=config.to_dict(), iters=iters,
                   lr=lr, temperature=args.temperature, alpha=args.alpha, curves=curves, random_prune_losses=random_losses,
                   max_abs_diff_vs_zeroed=error, best=best, saved=args.save, checks=checks)


if __name__ == "__main__":
    harness.run(main)
