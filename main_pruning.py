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
importance against pruning random heads and neurons. The best pruned model is saved to
checkpoints/pruned_from_<preset>.pt.
"""
import argparse
import copy
from pathlib import Path

import torch
import torch.nn as nn

import inference_utils as iu
from gptlite import GPTlite
from main_distillation import (add_run_args, check_run_args, distillation_loss_fn, measure_models,
                               save_and_reload)

DEFAULT_ITERS = {"cpu": 200}  # distillation steps per variant; other presets: 2000


@torch.no_grad()
def compute_importance(model, data, n_batches, batch_size, seqlen, seed=0):
    """Importance of every head and MLP neuron of every block, summed over `n_batches` calibration
    batches of the training split. Returns heads [n_layers, n_heads] and neurons [n_layers, d_ff]."""
    if min(n_batches, batch_size) < 1 or not 1 <= seqlen <= model.seqlen:
        raise ValueError(f"need n_batches, batch_size >= 1 and 1 <= seqlen <= {model.seqlen}, "
                         f"got {n_batches}, {batch_size}, {seqlen}")
    device = next(model.parameters()).device
    heads = torch.zeros(len(model.blocks), model.blocks[0].mha.n_heads, device=device)
    neurons = torch.zeros(len(model.blocks), model.blocks[0].ffwd.net[0].out_features, device=device)

    def head_hook(layer, mha):
        def hook(module, args):  # forward pre-hook of out_proj: args[0] is the merged heads [B, S, H*D]
            per_head = args[0].unflatten(-1, (mha.n_heads, mha.d_head))  # [B, S, H, D]
            heads[layer] += per_head.norm(dim=-1).sum(dim=(0, 1))  # [H]
        return hook

    def neuron_hook(layer):
        def hook(module, args, out):  # forward hook of the ReLU: out [B, S, d_ff]
            neurons[layer] += out.abs().sum(dim=(0, 1))  # [d_ff]
        return hook

    handles = []
    for layer, block in enumerate(model.blocks):
        handles.append(block.mha.out_proj.register_forward_pre_hook(head_hook(layer, block.mha)))
        handles.append(block.ffwd.net[1].register_forward_hook(neuron_hook(layer)))
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    try:
        for _ in range(n_batches):
            x, _ = iu.get_batch(data.train, batch_size, seqlen, generator, device)
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
    """Keep the n_heads most important heads and n_neurons most important MLP neurons of every block
    (importance as from compute_importance), slicing the weights in place. Returns the model."""
    blocks = model.blocks
    H, d_ff = blocks[0].mha.n_heads, blocks[0].ffwd.net[0].out_features
    if tuple(heads.shape) != (len(blocks), H) or tuple(neurons.shape) != (len(blocks), d_ff):
        raise ValueError(f"importance shapes {tuple(heads.shape)}, {tuple(neurons.shape)} do not fit the model: "
                         f"expected ({len(blocks)}, {H}) and ({len(blocks)}, {d_ff})")
    for name, keep, have in [("n_heads", n_heads, H), ("n_neurons", n_neurons, d_ff)]:
        if not isinstance(keep, int) or not 1 <= keep <= have:
            raise ValueError(f"{name} (kept per block) must be an integer between 1 and {have}, got {keep!r}")
    for layer, block in enumerate(blocks):
        mha, mlp = block.mha, block.ffwd.net
        kept = top_indices(heads[layer], n_heads).to(mha.out_proj.weight.device)  # [n_heads]
        dims = (kept[:, None] * mha.d_head + torch.arange(mha.d_head, device=kept.device)).flatten()  # [n_heads*D]
        mha.query_proj = prune_linear(mha.query_proj, rows=dims)
        mha.key_proj = prune_linear(mha.key_proj, rows=dims)
        mha.value_proj = prune_linear(mha.value_proj, rows=dims)
        mha.out_proj = prune_linear(mha.out_proj, columns=dims)
        mha.n_heads = n_heads
        kept = top_indices(neurons[layer], n_neurons).to(mlp[0].weight.device)  # [n_neurons]
        mlp[0] = prune_linear(mlp[0], rows=kept)
        mlp[2] = prune_linear(mlp[2], columns=kept)
    return model


def model_config(model):
    """The GPTlite(**config) of a (possibly pruned) model, read from its modules."""
    mha = model.blocks[0].mha
    return dict(vocab_size=model.token_embedding.num_embeddings, d_model=model.token_embedding.embedding_dim,
                n_heads=mha.n_heads, d_head=mha.d_head, n_layers=len(model.blocks), dropout_p=mha.dropout.p,
                seqlen=model.seqlen, d_ff=model.blocks[0].ffwd.net[0].out_features)


@torch.no_grad()
def logits_with_zeroed(model, keep_heads, keep_neurons, x):
    """The model's logits with every head and neuron not in keep_heads[layer] / keep_neurons[layer]
    zeroed by hooks (its output at the input of out_proj, its ReLU activation): what pruning must give."""
    def zero_heads(keep, mha):
        def hook(module, args):
            mask = torch.zeros(mha.n_heads, 1, device=x.device)
            mask[keep] = 1
            return (args[0] * mask.repeat_interleave(mha.d_head, dim=0).flatten(),)  # [B, S, H*D]
        return hook

    def zero_neurons(keep):
        def hook(module, args, out):
            mask = torch.zeros(out.shape[-1], device=x.device)
            mask[keep] = 1
            return out * mask  # [B, S, d_ff]
        return hook

    handles = []
    for block, kh, kn in zip(model.blocks, keep_heads, keep_neurons):
        handles.append(block.mha.out_proj.register_forward_pre_hook(zero_heads(kh, block.mha)))
        handles.append(block.ffwd.net[1].register_forward_hook(zero_neurons(kn)))
    try:
        return model.eval()(x)
    finally:
        for handle in handles:
            handle.remove()


def check_args(args, parser, preset):
    check_run_args(args, parser, preset)
    for flag, value in [("--calib-batches", args.calib_batches), ("--random-draws", args.random_draws),
                        ("--batch-size", args.batch_size)]:
        if value is not None and value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if not 0 < args.keep < 1:
        parser.error(f"--keep (fraction of heads and neurons kept) must be between 0 and 1, got {args.keep}")
    if not 0 < args.step <= 1 - args.keep:
        parser.error(f"--step must be positive and at most 1 - --keep = {1 - args.keep:g}, got {args.step}")
    if args.iters is not None and args.iters < n_stages(args):
        parser.error(f"--iters must be at least the {n_stages(args)} iterative steps (one distillation step each)")
    if not 0 <= args.alpha <= 1:
        parser.error(f"--alpha must be between 0 and 1, got {args.alpha}")


def n_stages(args):
    return max(round((1 - args.keep) / args.step), 1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    iu.add_common_args(parser)
    parser.add_argument("--iters", type=int, default=None,
                        help=f"distillation steps of each variant (default: {DEFAULT_ITERS['cpu']} for the cpu preset, else 2000)")
    parser.add_argument("--keep", type=float, default=0.5, help="fraction of the heads and MLP neurons kept per block")
    parser.add_argument("--step", type=float, default=0.1,
                        help="fraction of the original heads and neurons removed per iterative step")
    parser.add_argument("--alpha", type=float, default=0.0, help="weight of the hard labels in the distillation loss")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate of the distillation (default: the preset's)")
    parser.add_argument("--batch-size", type=int, default=None, help="distillation and calibration batch (default: the preset's)")
    parser.add_argument("--calib-batches", type=int, default=8, help="calibration batches of the importance scores")
    parser.add_argument("--random-draws", type=int, default=5, help="random prunings compared with pruning by importance")
    add_run_args(parser, "best pruned model")
    args = parser.parse_args(argv)
    preset, device, data = iu.setup(args, parser, lambda preset: check_args(args, parser, preset))

    teacher = iu.load_model(GPTlite, preset, device, data, untrained=args.untrained, seed=args.seed)
    teacher.requires_grad_(False)
    iters = args.iters or DEFAULT_ITERS.get(preset.name, 2000)
    lr, batch_size = args.lr or preset.lr, args.batch_size or preset.batch_size
    H, d_ff = preset.n_heads, 4 * preset.d_model
    n_heads, n_neurons = max(round(args.keep * H), 1), max(round(args.keep * d_ff), 1)
    loss_fn = distillation_loss_fn(teacher, args.temperature, args.alpha)
    importance = lambda model: compute_importance(model, data, args.calib_batches, batch_size,  # noqa: E731
                                                  preset.seqlen, seed=args.seed)
    print(f"pruning every block from {H} heads and {d_ff} neurons to {n_heads} and {n_neurons}; "
          f"{iters} distillation steps of batch {batch_size} per variant, lr {lr}, T={args.temperature}, alpha={args.alpha}")

    def distill(model, n_steps, desc):
        return iu.train_steps(model, data, n_steps, batch_size, preset.seqlen, lr, seed=args.seed,
                              loss_fn=loss_fn, desc=desc)

    # (1) one shot, checked against the original with the removed heads and neurons zeroed
    heads, neurons = importance(teacher)
    one_shot = prune(copy.deepcopy(teacher), heads, neurons, n_heads, n_neurons)
    x, _ = iu.get_batch(data.val, 4, preset.seqlen, torch.Generator().manual_seed(args.seed), device)
    keep_h, keep_n = [top_indices(h, n_heads) for h in heads], [top_indices(n, n_neurons) for n in neurons]
    with torch.no_grad():
        error = (one_shot(x) - logits_with_zeroed(teacher, keep_h, keep_n, x)).abs().max().item()
    pruned_loss, curves = {"one-shot": iu.validation_loss(one_shot, data)}, {}
    curves["one-shot"] = [(0, pruned_loss["one-shot"])] + [
        (h["step"], h["val_loss"]) for h in distill(one_shot, iters, "one-shot, distilling")]

    # does the importance score matter? the same sizes with random heads and neurons kept
    generator = torch.Generator().manual_seed(args.seed)
    random_losses = [iu.validation_loss(prune(copy.deepcopy(teacher), torch.rand(heads.shape, generator=generator),
                                              torch.rand(neurons.shape, generator=generator), n_heads, n_neurons), data)
                     for _ in range(args.random_draws)]

    # (2) iteratively: re-score, remove --step of the original, distill; the same total steps
    stages = n_stages(args)
    iterative, done, curves["iterative"] = copy.deepcopy(teacher), 0, []
    for stage in range(1, stages + 1):
        fraction = 1 - (1 - args.keep) * stage / stages
        h, n = importance(iterative)
        prune(iterative, h, n, max(round(fraction * H), n_heads), max(round(fraction * d_ff), n_neurons))
        pruned_loss["iterative"] = iu.validation_loss(iterative, data)  # the last one: right after reaching the size
        curves["iterative"].append((done, pruned_loss["iterative"]))
        n_steps = iters * stage // stages - done
        curves["iterative"] += [(done + p["step"], p["val_loss"])
                                for p in distill(iterative, n_steps, f"iterative {stage}/{stages}, distilling")]
        done += n_steps

    # (3) baseline: the pruned architecture from random weights
    config = model_config(one_shot)
    torch.manual_seed(args.seed)
    scratch = GPTlite(**config).to(device)
    pruned_loss["random init"] = iu.validation_loss(scratch, data)
    curves["random init"] = [(0, pruned_loss["random init"])] + [
        (h["step"], h["val_loss"]) for h in distill(scratch, iters, "random init, distilling")]

    students = {"one-shot": one_shot, "iterative": iterative, "random init": scratch}
    val_losses = {name: iu.validation_loss(m, data) for name, m in students.items()}
    val_losses["original"] = iu.validation_loss(teacher, data)
    best = min(("one-shot", "iterative"), key=val_losses.get)
    reloaded_ok, save = True, args.save or (None if args.untrained else iu.checkpoint_path(f"pruned_from_{preset.name}"))
    if save:
        reloaded_ok = save_and_reload(save, students[best], config, data.vocab, teacher=preset.name, variant=best,
                                      iters=iters, val_loss=val_losses[best])

    models = {"original": (teacher, preset.model_config())} | {n: (m, config) for n, m in students.items()}
    figures, failures = measure_models(models, data, args.n_tokens, args.prompt_len, 1, device, args.repeats,
                                       args.seed)
    names = {"original": "original", "one-shot": "one-shot + distill", "iterative": "iterative + distill",
             "random init": "random init + distill"}
    rows = [iu.make_row(names[n], **figures[n], val_loss=val_losses[n], val_pruned=pruned_loss.get(n)) for n in models]
    rows.insert(2, iu.make_row(f"random prune (mean of {args.random_draws})", params=figures["one-shot"]["params"],
                               size_mb=figures["one-shot"]["size_mb"],
                               val_pruned=sum(random_losses) / len(random_losses)))
    for row in rows:
        row["size_mb"] = round(row["size_mb"], 3)
        row["val_pruned"] = round(row["val_pruned"], 4) if row["val_pruned"] is not None else None
    print(f"\nkept {n_heads}/{H} heads and {n_neurons}/{d_ff} neurons per block; {iters} distillation steps each; "
          f"generation: batch 1, {args.prompt_len}-token prompts, {args.n_tokens} new tokens with the KV cache, median of {args.repeats}")
    print("val_pruned: right after pruning (iterative: after its last step; random init: before training); "
          "val loss: after distillation")
    iu.print_table(rows, untrained=args.untrained)
    print(iu.peak_memory_label(device))
    print(f"pruned logits vs original with those heads and neurons zeroed: max |diff| {error:.1e}")
    print(f"right after pruning: by importance {pruned_loss['one-shot']:.4f}, random {min(random_losses):.4f} .. "
          f"{max(random_losses):.4f}; after distillation: best pruned ({best}) {val_losses[best]:.4f} vs random "
          f"init {val_losses['random init']:.4f} ({'pruning wins' if val_losses[best] < val_losses['random init'] else 'pruning does NOT win'})")

    if args.plot:
        fig, ax = iu.new_figure()
        for name, curve in curves.items():
            ax.plot(*zip(*curve), marker="o", markersize=3, label=names[name])
        ax.axhline(val_losses["original"], color="gray", linestyle="--", label="original")
        ax.set(xlabel="distillation steps", ylabel="validation loss (nats/char)",
               title=f"pruning {preset.name} to {args.keep:g} of the heads and neurons ({device})")
        ax.legend()
        iu.save_plot(fig, args.plot)
    if args.json:
        iu.save_json(args.json, "main_pruning.py", preset, device, rows, untrained=args.untrained, config=config,
                     iters=iters, lr=lr, temperature=args.temperature, alpha=args.alpha, curves=curves,
                     random_prune_losses=random_losses, max_abs_diff_vs_zeroed=error, best=best,
                     saved=str(save) if save else None)
    if error > 1e-4 or failures or not reloaded_ok:
        raise iu.GPTliteError(f"pruned model differs from the zeroed original (max |diff| {error:.1e}), or the KV-cache "
                              f"tokens / reloaded logits differ ({', '.join(failures) or 'checkpoint'}); this is a bug")


if __name__ == "__main__":
    iu.run(main)
