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
teacher. Nothing is written unless every check passes. With --save PATH the best student is kept
(config included; a plain GPTlite: files.load_checkpoint(PATH), then GPTlite(**ckpt["config"])), e.g. as
the draft model of speculative decoding; checkpoints/distilled.pt is another model, the `distilled`
preset that gptlite.py trains on hard labels alone.

The student of `gptlite` is the `distilled` preset (half the width, half the layers, 4 heads instead of
6). Other presets get a student by the same rule (see student_preset), e.g. cpu: 0.83M -> 0.13M parameters.
"""
import functools
import math

import torch
import torch.nn.functional as F

import inference_utils as iu
from gptlite import GPTlite
from lib import corpus, files, harness, training
from lib.presets import student_preset  # the student of a teacher preset, by the post's rule

DEFAULT_ITERS = {"cpu": 300}  # student training steps; other presets: the student preset's iters


def distillation_loss(logits_student, logits_teacher, temperature, targets=None, alpha=0.0):
    """(1 - alpha) * T**2 * KL(teacher_T || student_T) + alpha * cross_entropy(student, targets).

    logits: [B, S, vocab] (or any [..., vocab]); every position is one distribution, and the KL is
    averaged over positions (batchmean over the flattened [B*S, vocab]). The teacher gets no gradient."""
    if not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be a finite positive number, got {temperature}")
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
    return training.teacher_loss_fn(teacher, functools.partial(distillation_loss, temperature=temperature, alpha=alpha))


def train_students(data, config, variants, iters, batch_size, lr, seed, device, temperature=None):
    """One student per {name: loss_fn}, each with the same initial weights, batches and schedule; a diverged
    one names the temperature of its soft labels. Returns {name: student in eval mode} and {name: validation
    history}."""
    students, histories = {}, {}
    for name, loss_fn in variants.items():
        torch.manual_seed(seed)
        student = GPTlite(**config).to(device)
        soft = temperature is not None and name != "hard labels"
        histories[name] = training.train_steps(student, data, iters, batch_size, config["seqlen"], lr, seed=seed,
                                               loss_fn=loss_fn, desc=f"student, {name}",
                                               hint=training.distillation_hint(temperature, lr) if soft else None)
        students[name] = student.eval()
    return students, histories


def table_rows(figures, val_losses):
    """One row per model; speedup = the teacher's TPOT / the model's ("-" when a TPOT is unmeasurable)."""
    rows = []
    for name in figures:
        speedup = iu.ratio(figures["teacher"]["tpot_ms"], figures[name]["tpot_ms"])
        rows.append(harness.make_row(name, **figures[name], val_loss=val_losses[name],
                                speedup=None if speedup is None else round(speedup, 2)))
    return rows


def plot_histories(histories, teacher_loss, title):
    fig, ax = harness.new_figure()
    for name, history in histories.items():
        ax.plot([h["step"] for h in history], [h["val_loss"] for h in history], marker="o", label=name)
    ax.axhline(teacher_loss, color="gray", linestyle="--", label="teacher")
    ax.set(xlabel="training steps", ylabel="validation loss (nats/char)", title=title)
    ax.legend()
    return fig


def parse_args(argv):
    """The flags, checked before any work: (args, preset, device, data)."""
    parser = harness.script_parser(__doc__)
    add = parser.add_argument
    add("--iters", type=harness.steps, default=None, help=f"training steps of each student "
        f"(default: {DEFAULT_ITERS['cpu']} for the cpu preset, else the student preset's)")
    add("--temperature", type=harness.temperature, default=2.0, help="softening temperature T of the soft labels")
    add("--alpha", type=harness.float_in(0, 1, low_open=True, high_open=True), default=0.5,
        help="weight of the hard labels in the soft + hard student, in (0, 1)")
    add("--batch-size", type=harness.int_at_least(1), default=None, help="training batch (default: the preset's)")
    add("--save", default=None, metavar="PATH", help="also save the best student there (default: not saved)")
    harness.add_generation_flags(parser, prompt_len=32, n_tokens=128, repeats=5)
    args = parser.parse_args(argv)

    def check_args(preset):
        batch_size = args.batch_size or preset.batch_size  # a student's training step, with the teacher's labels
        harness.check_fits(parser, "--batch-size", training.activation_bytes(student_preset(preset), batch_size, backward=True)
                           + training.activation_bytes(preset, batch_size), f"a training batch of {batch_size} windows")
        harness.check_fits(parser, "--n-tokens", 3 * (args.prompt_len + args.n_tokens) * 8,
                           f"{args.n_tokens} new tokens after a prompt")
    return (args, *harness.setup(args, parser, check_args))


def headline(rows, iters):
    """The README's one-glance row, from this run's rows."""
    teacher, hard, soft, both = (next(r for r in rows if r["variant"].startswith(v))
                                 for v in ("teacher", "hard labels", "soft labels", "soft + hard"))
    speedup = "-" if hard["speedup"] is None else f"{hard['speedup']:.1f}"
    return dict(technique=f"distillation, {hard['params'] / 1e6:.2f}M student of the {teacher['params'] / 1e6:.2f}M "
                          f"model, {iters} steps",
                figure=f"val loss soft + hard {both['val_loss']:.3f}, hard labels {hard['val_loss']:.3f}, soft labels "
                       f"{soft['val_loss']:.3f} (teacher {teacher['val_loss']:.3f}); TPOT {speedup}x below the teacher's")


def main(argv=None):
    args, preset, device, data = parse_args(argv)
    teacher = iu.load_model(GPTlite, preset, device, data, untrained=args.untrained, seed=args.seed)
    teacher.requires_grad_(False)  # frozen: eval mode (load_model) and no gradients
    student_cfg = student_preset(preset)
    config = student_cfg.gptlite_kwargs()
    iters = args.iters if args.iters is not None else DEFAULT_ITERS.get(preset.name, student_cfg.iters)
    batch_size = args.batch_size if args.batch_size is not None else preset.batch_size
    print(f"teacher: {preset.name} ({iu.n_params(teacher) / 1e6:.2f}M parameters); student: {config} "
          f"({iu.n_params(GPTlite(**config)) / 1e6:.2f}M); {iters} steps of batch {batch_size}, lr {student_cfg.lr}, "
          f"T={args.temperature}")

    variants = {"hard labels": training.cross_entropy_loss,  # the student trained as gptlite.py would train it
                "soft labels": distillation_loss_fn(teacher, args.temperature, alpha=0.0),
                f"soft + hard (alpha={args.alpha})": distillation_loss_fn(teacher, args.temperature, args.alpha)}
    students, histories = train_students(data, config, variants, iters, batch_size, student_cfg.lr,
                                         args.seed, device, args.temperature)
    val_losses = {name: training.validation_loss(model, data) for name, model in students.items()}
    val_losses["teacher"] = training.validation_loss(teacher, data)
    best = min(students, key=val_losses.get)
    models = {"teacher": teacher} | students
    prompts = corpus.sample_prompts(data, 1, args.prompt_len, seed=args.seed, device=device)
    cached, checks = iu.kv_cache_checks(models, prompts, args.n_tokens)
    harness.require_checks(checks)  # before anything is timed or written
    rows = table_rows(iu.measure_models(models, cached, prompts, args.n_tokens, device, args.repeats), val_losses)

    print(f"\n{iters} steps per student, batch {batch_size}; generation: batch 1, {args.prompt_len}-token prompts, "
          f"{args.n_tokens} new tokens with the KV cache, median of {args.repeats}; speedup = teacher TPOT / TPOT")
    hard, soft = val_losses["hard labels"], min(val_losses[n] for n in students if n != "hard labels")
    summary = [iu.peak_memory_label(device),
               f"best distilled student against the hard-label student: {soft:.4f} vs {hard:.4f} "
               f"({'distillation wins' if soft < hard else 'distillation does NOT win'}); best: {best}"]
    if args.save:
        training.save_and_reload(args.save, students[best], config, data.vocab,
                                 files.rebuild_command("main_distillation.py", argv, preset), teacher=preset.name,
                                 variant=best, iters=iters, temperature=args.temperature, val_loss=val_losses[best])
    title = f"students of {preset.name}, T={args.temperature} ({device})"
    harness.report(args, "main_distillation.py", preset, device, rows, headline(rows, iters), summary=summary,
                   plot=lambda: plot_histories(histories, val_losses["teacher"], title), student_config=config,
                   iters=iters, batch_size=batch_size, temperature=args.temperature, alpha=args.alpha,
                   histories=histories, best=best, saved=args.save, checks=checks)


if __name__ == "__main__":
    harness.run(main)
