"""Knowledge distillation: a small student learns from the trained GPTlite (the teacher) instead of,
or besides, the one-hot next characters.

    python main_distillation.py                        # cpu preset: teacher checkpoints/cpu.pt
    python main_distillation.py --preset gptlite --iters 5000 --json distill.json --plot distill.png
    python main_distillation.py --untrained --iters 20 # random teacher, a quick smoke run

Blog section: "Knowledge distillation". The student minimizes the KL divergence between the teacher's
and its own next-token distributions, both softened by a temperature T (times T**2, so that gradients
keep their size as T changes), optionally mixed with the usual cross entropy on the hard labels.
Three students of the same architecture, initial weights, steps, batches and learning rate are trained:
on hard labels only, on soft labels only, and on soft + hard labels. The table compares them with the
teacher; the best student is saved (config included) as the `distilled` checkpoint of the preset,
checkpoints/distilled_from_<preset>.pt (the draft model of speculative decoding). It is a different
model from checkpoints/distilled.pt, which gptlite.py trains on hard labels for the `distilled` preset.

The student of `gptlite` is the `distilled` preset (half the width, half the layers, 4 heads instead of
6). Other presets get a student by the same rule (see student_preset), e.g. cpu: 0.82M -> 0.13M parameters.
"""
import argparse
import dataclasses
from pathlib import Path

import torch
import torch.nn.functional as F

import inference_utils as iu
from gptlite import GPTlite, generate
from gptlite_kvcache import GPTlite_KVCache, generate_kvcache

DEFAULT_ITERS = {"cpu": 300}  # student training steps; other presets: the student preset's iters


def distillation_loss(logits_student, logits_teacher, temperature, targets=None, alpha=0.0):
    """(1 - alpha) * T**2 * KL(teacher_T || student_T) + alpha * cross_entropy(student, targets).

    logits: [B, S, vocab] (or any [..., vocab]); every position is one distribution, and the KL is
    averaged over positions (batchmean over the flattened [B*S, vocab]). The teacher gets no gradient."""
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha (the weight of the hard-label loss) must be in [0, 1], got {alpha}")
    if logits_student.shape != logits_teacher.shape:
        raise ValueError(f"student logits {tuple(logits_student.shape)} and teacher logits "
                         f"{tuple(logits_teacher.shape)} must have the same shape")
    vocab = logits_student.shape[-1]
    log_p_student = F.log_softmax(logits_student.reshape(-1, vocab) / temperature, dim=-1)  # [B*S, vocab]
    log_p_teacher = F.log_softmax(logits_teacher.detach().reshape(-1, vocab) / temperature, dim=-1)
    soft = F.kl_div(log_p_student, log_p_teacher, log_target=True, reduction="batchmean") * temperature**2
    if alpha == 0.0:
        return soft
    if targets is None:
        raise ValueError("alpha > 0 mixes in the hard-label cross entropy: give the targets")
    hard = F.cross_entropy(logits_student.reshape(-1, vocab), targets.reshape(-1))
    return (1 - alpha) * soft + alpha * hard


def distillation_loss_fn(teacher, temperature, alpha):
    """A train_steps loss_fn(model, x, y): the frozen teacher's logits are the soft labels."""
    teacher.eval()

    def loss_fn(student, x, y):
        with torch.no_grad():
            logits_teacher = iu.logits_of(teacher(x))  # [B, S, vocab]
        return distillation_loss(iu.logits_of(student(x)), logits_teacher, temperature, y, alpha)
    return loss_fn


def student_preset(preset):
    """The student of a teacher preset: half the width, half the layers, 2/3 of the heads (same head
    width), the teacher's window, batch and dropout. For gptlite this is exactly the distilled preset."""
    student = dataclasses.replace(preset, name=f"{preset.name}-student", d_model=preset.d_model // 2,
                                  n_layers=max(preset.n_layers // 2, 1),
                                  n_heads=max(round(preset.n_heads * 2 / 3), 1))
    if preset.name == "gptlite":
        distilled = iu.PRESETS["distilled"]
        assert student.model_config() == distilled.model_config(), "the rule must give the distilled preset"
        return distilled
    return student


def distilled_checkpoint_path(preset):
    """Where the best student of `preset` is saved (never checkpoints/distilled.pt of gptlite.py)."""
    return iu.checkpoint_path(f"distilled_from_{iu.get_preset(preset).name}")


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def save_and_reload(path, model, config, vocab, **meta):
    """Save with its config, load back as GPTlite(**ckpt["config"]) and check the logits are identical."""
    iu.save_checkpoint(path, model, config, vocab, **meta)
    ckpt = iu.load_checkpoint(path, vocab=vocab)
    device = next(model.parameters()).device
    reloaded = GPTlite(**ckpt["config"]).to(device).eval()
    reloaded.load_state_dict(ckpt["state_dict"])
    x = torch.randint(config["vocab_size"], (2, config["seqlen"]), device=device)
    with torch.no_grad():
        same = torch.equal(model.eval()(x), reloaded(x))
    print(f"saved {path}; reloaded as GPTlite(**config): {'identical logits' if same else 'LOGITS DIFFER'}")
    return same


def measure_models(models, data, n_tokens, prompt_len, batch_size, device, repeats, seed=0):
    """Generation figures of each {name: (GPTlite model, config)} with GPTlite_KVCache + generate_kvcache.

    Correctness first: the cached model's tokens must equal generate()'s (no cache) while they fit the
    window. Returns {name: dict of figures} and the names whose tokens differ."""
    prompts = iu.sample_prompts(data, batch_size, prompt_len, seed=seed, device=device)
    in_window = min(next(iter(models.values()))[1]["seqlen"] - prompt_len + 1, n_tokens)
    fns, figures, failures = {}, {}, []
    for name, (model, config) in models.items():
        cached = GPTlite_KVCache(**config).to(device).eval()
        cached.load_state_dict(model.state_dict())
        seqlen = config["seqlen"]
        reference = generate(model.eval(), prompts, in_window, seqlen)
        if not torch.equal(generate_kvcache(cached, prompts, in_window, seqlen), reference):
            failures.append(name)
        fns[name] = lambda n, cached=cached, seqlen=seqlen: generate_kvcache(cached, prompts, n, seqlen)
        with torch.inference_mode():  # the cache at the end of generation: the last min(length, seqlen) tokens
            full = torch.ones(batch_size, min(prompt_len + n_tokens - 1, seqlen), dtype=torch.long, device=device)
            kv_mb = iu.kv_cache_bytes(cached(full)[1]) / 2**20
        figures[name] = dict(params=n_params(model), size_mb=iu.model_size_mb(model), kv_cache_mb=kv_mb,
                             peak_mem_mb=iu.peak_memory_mb(lambda fn=fns[name]: fn(n_tokens), device))
    timings = iu.compare_generation(fns, n_tokens, batch_size, device, warmup=1, repeats=repeats)
    for name in models:
        figures[name].update(timings[name])
    return figures, failures


def add_run_args(parser, what):
    """Flags both scripts share: where the result is saved and how generation is timed."""
    parser.add_argument("--temperature", type=float, default=2.0, help="softening temperature T of the soft labels")
    parser.add_argument("--save", default=None, metavar="PATH",
                        help=f"where to save the {what} (default: checkpoints/<name>_from_<preset>.pt; "
                             "with --untrained nothing is saved unless given)")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt length of the timed generation")
    parser.add_argument("--n-tokens", type=int, default=128, help="new tokens per prompt of the timed generation")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per figure, median taken (after a warm-up)")


def check_run_args(args, parser, preset):
    for flag, value, low in [("--iters", args.iters, 1), ("--n-tokens", args.n_tokens, 2), ("--repeats", args.repeats, 1)]:
        if value is not None and value < low:
            parser.error(f"{flag} must be at least {low}, got {value}")
    if not args.temperature > 0:
        parser.error(f"--temperature must be positive, got {args.temperature}")
    if not 1 <= args.prompt_len <= preset.seqlen:
        parser.error(f"--prompt-len must be between 1 and the model's seqlen={preset.seqlen}, got {args.prompt_len}")
    if args.save is not None and (Path(args.save).is_dir() or not Path(args.save).resolve().parent.is_dir()):
        parser.error(f"--save {args.save}: give a file path in a folder that exists")


def check_args(args, parser, preset):
    check_run_args(args, parser, preset)
    if args.batch_size is not None and args.batch_size < 1:
        parser.error(f"--batch-size must be at least 1, got {args.batch_size}")
    if not 0 < args.alpha < 1:
        parser.error(f"--alpha (hard-label weight of the soft + hard student) must be between 0 and 1, got {args.alpha}")


def plot_histories(histories, teacher_loss, path, title):
    fig, ax = iu.new_figure()
    for name, history in histories.items():
        ax.plot([h["step"] for h in history], [h["val_loss"] for h in history], marker="o", label=name)
    ax.axhline(teacher_loss, color="gray", linestyle="--", label="teacher")
    ax.set(xlabel="training steps", ylabel="validation loss (nats/char)", title=title)
    ax.legend()
    iu.save_plot(fig, path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    iu.add_common_args(parser)
    parser.add_argument("--iters", type=int, default=None,
                        help=f"training steps of each student (default: {DEFAULT_ITERS['cpu']} for the cpu preset, else the student preset's)")
    parser.add_argument("--alpha", type=float, default=0.5, help="weight of the hard labels in the soft + hard student")
    parser.add_argument("--batch-size", type=int, default=None, help="training batch (default: the preset's)")
    add_run_args(parser, "best student")
    args = parser.parse_args(argv)
    preset, device, data = iu.setup(args, parser, lambda preset: check_args(args, parser, preset))

    teacher = iu.load_model(GPTlite, preset, device, data, untrained=args.untrained, seed=args.seed)
    teacher.requires_grad_(False)  # frozen: eval mode (load_model) and no gradients
    student_cfg = student_preset(preset)
    config = student_cfg.model_config()
    iters = args.iters or DEFAULT_ITERS.get(preset.name, student_cfg.iters)
    batch_size = args.batch_size or preset.batch_size
    print(f"teacher: {preset.name} ({n_params(teacher) / 1e6:.2f}M parameters); student: {config} "
          f"({n_params(GPTlite(**config)) / 1e6:.2f}M); {iters} steps of batch {batch_size}, lr {student_cfg.lr}, "
          f"T={args.temperature}")

    variants = {"hard labels": iu.cross_entropy_loss,  # the student trained as gptlite.py would train it
                "soft labels": distillation_loss_fn(teacher, args.temperature, alpha=0.0),
                f"soft + hard (alpha={args.alpha})": distillation_loss_fn(teacher, args.temperature, args.alpha)}
    students, histories = {}, {}
    for name, loss_fn in variants.items():
        torch.manual_seed(args.seed)  # the same initial weights, batches and schedule for every student
        student = GPTlite(**config).to(device)
        histories[name] = iu.train_steps(student, data, iters, batch_size, preset.seqlen, student_cfg.lr,
                                         seed=args.seed, loss_fn=loss_fn, desc=f"student, {name}")
        students[name] = student.eval()

    val_losses = {name: iu.validation_loss(model, data) for name, model in students.items()}
    val_losses["teacher"] = iu.validation_loss(teacher, data)
    best = min(students, key=val_losses.get)
    reloaded_ok = True
    save = args.save or (None if args.untrained else distilled_checkpoint_path(preset))
    if save:
        reloaded_ok = save_and_reload(save, students[best], config, data.vocab, teacher=preset.name, variant=best,
                                      iters=iters, temperature=args.temperature, val_loss=val_losses[best])

    models = {"teacher": (teacher, preset.model_config())} | {name: (m, config) for name, m in students.items()}
    figures, failures = measure_models(models, data, args.n_tokens, args.prompt_len, 1, device, args.repeats,
                                       args.seed)
    rows = [iu.make_row(name, **{k: v for k, v in figures[name].items() if k not in ("params", "size_mb")},
                        val_loss=val_losses[name], params=figures[name]["params"],
                        size_mb=round(figures[name]["size_mb"], 3),
                        speedup=round(figures["teacher"]["tpot_ms"] / figures[name]["tpot_ms"], 2))
            for name in models]
    print(f"\n{iters} steps per student, batch {batch_size}; generation: batch 1, {args.prompt_len}-token prompts, "
          f"{args.n_tokens} new tokens with the KV cache, median of {args.repeats}; speedup = teacher TPOT / TPOT")
    iu.print_table(rows, untrained=args.untrained)
    print(iu.peak_memory_label(device))
    hard, soft = val_losses["hard labels"], min(val_losses[n] for n in students if n != "hard labels")
    print(f"best distilled student against the hard-label student: {soft:.4f} vs {hard:.4f} "
          f"({'distillation wins' if soft < hard else 'distillation does NOT win'}); saved: {best}")

    if args.plot:
        plot_histories(histories, val_losses["teacher"], args.plot,
                       f"students of {preset.name}, T={args.temperature} ({device})")
    if args.json:
        iu.save_json(args.json, "main_distillation.py", preset, device, rows, untrained=args.untrained,
                     student_config=config, iters=iters, batch_size=batch_size, temperature=args.temperature,
                     alpha=args.alpha, histories=histories, best=best, saved=str(save) if save else None)
    if failures or not reloaded_ok:
        raise iu.GPTliteError(f"{', '.join(failures) or 'the saved checkpoint'}: the KV-cache tokens or the reloaded "
                              "logits differ from the model's own; this is a bug")


if __name__ == "__main__":
    iu.run(main)
