"""Training and the validation loss: one AdamW loop for checkpoints, uptraining and distillation."""
import math

import torch
import torch.nn.functional as F
from tqdm import tqdm

from lib.corpus import get_batch
from lib.errors import GPTliteError, TrainingDiverged
from lib.files import atomic_file, load_checkpoint, save_checkpoint


def logits_of(output):
    """Models with a KV cache return (logits, cache); the others return logits."""
    return output[0] if isinstance(output, tuple) else output


@torch.no_grad()
@torch.no_grad()
def validation_loss(model, data, n_batches=20, batch_size=32, seqlen=None, seed=1234, loss=None, batches=None):
    """Mean of loss(model, x, y) (default: the cross entropy, nats per character) over fixed-seed validation
    batches, the same for every model: windows of data.val, or batches(batch_size, seqlen, device) (a stream
    seeded by its caller). The one validation loop: documents, draft heads and KIVI's chunks plug in here."""
    seqlen = seqlen or model.seqlen
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    draw = batches or (lambda b, s, d: get_batch(data.val, b, s, generator, d))
    loss = loss or cross_entropy_loss
    was_training = model.training
    model.eval()
    losses = [loss(model, *draw(batch_size, seqlen, device)).item() for _ in range(n_batches)]
    model.train(was_training)
    return sum(losses) / len(losses)


def cross_entropy_loss(model, x, y):
    return F.cross_entropy(logits_of(model(x)).flatten(0, 1), y.flatten())


def check_finite(loss, step, n_steps, lr, what, hint=None):
    """Stop a diverged run at once: its weights are useless, and the callers save only after training.
    hint: the likely causes and what to do, after the step (default: the learning rate)."""
    if not math.isfinite(loss):
        hint = hint or f"(peak learning rate {lr:g}); rerun with a lower learning rate"
        raise TrainingDiverged(f"training diverged: the {what} is {loss} at step {step} of {n_steps} {hint}. "
                               f"Nothing was saved.")


def cosine_schedule(n_steps, lr):
    """lr at each step: linear warm-up (a tenth of the steps, at most 100), then cosine decay to lr/10."""
    warmup = min(100, max(n_steps // 10, 1))

    def lr_at(step):
        if step < warmup:
            return lr * (step + 1) / warmup
        progress = (step - warmup) / max(n_steps - warmup, 1)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
    return lr_at


def train_steps(model, data, n_steps, batch_size, seqlen, lr, seed=0, eval_interval=None,
                loss_fn=cross_entropy_loss, desc="training", hint=None, evaluate=None, batches=None, schedule=None,
                betas=(0.9, 0.99), weight_decay=0.1):
    """Train `model` for `n_steps` AdamW steps (gradient clipping at 1.0): the one training loop.

    Returns the validation history [{"step", "val_loss"}], evaluated every `eval_interval` steps
    and after the last one. `loss_fn(model, x, y)` lets distillation swap the loss; `hint` is what a
    divergence error says about its causes (check_finite); `evaluate(model)`, the validation figure
    (default: validation_loss on 10 batches; False: none), lets a draft head that is not a language model
    report its own. `batches(generator, device)`: each step's (x, y) (default: random windows of data.train);
    `schedule(step)`: the learning rate (default: cosine_schedule); betas and weight_decay: AdamW's."""
    if n_steps < 1:
        raise ValueError(f"n_steps must be at least 1, got {n_steps}")
    device = next(model.parameters()).device
    eval_interval = eval_interval or max(n_steps // 5, 1)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay)
    lr_at = schedule or cosine_schedule(n_steps, lr)
    draw = batches or (lambda generator, device: get_batch(data.train, batch_size, seqlen, generator, device))

    history = []
    model.train()
    bar = tqdm(range(n_steps), desc=desc, dynamic_ncols=True, mininterval=0.5)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        x, y = draw(generator, device)
        loss = loss_fn(model, x, y)
        check_finite(loss.item(), step + 1, n_steps, lr, "training loss", hint)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if evaluate is not False and ((step + 1) % eval_interval == 0 or step + 1 == n_steps):
            val = evaluate(model) if evaluate else validation_loss(model, data, n_batches=10)
            history.append({"step": step + 1, "val_loss": val})
            check_finite(history[-1]["val_loss"], step + 1, n_steps, lr, "validation loss", hint)  # the last update
            model.train()
            bar.set_postfix(loss=f"{loss.item():.3f}", val=f"{history[-1]['val_loss']:.3f}")
        elif step % 10 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return history


def uptrain_budget(preset, steps=None, lr=None):
    """Steps (default: 5% of the checkpoint's training) and peak learning rate (default: the preset's / 3)
    of the short training that follows a conversion."""
    return (steps if steps is not None else max(1, round(0.05 * preset.iters)),
            lr if lr is not None else preset.lr / 3)


def uptrain(model, data, preset, steps, lr, seed, name):
    """Validation loss before and after `steps` of training (train_steps' own 10-batch figure is not used:
    both figures come from the same validation_loss batches as every other script's)."""
    before = validation_loss(model, data)
    train_steps(model, data, steps, preset.batch_size, preset.seqlen, lr, seed=seed, eval_interval=steps,
                desc=f"uptraining {name}")
    return before, validation_loss(model, data)


def activation_bytes(preset, n_sequences, length=None, backward=False):
    """Estimated peak bytes (float32) of one forward pass of `n_sequences` sequences of `length` tokens
    (default: the window) through a model of `preset`: the logits, the keys and values of every layer, and
    one layer's queries, attention scores and d_model-wide activations (every layer's, and the logits'
    gradient, when `backward`: training keeps them for the gradients), and the token ids. What a size flag
    (a batch, a count of windows) makes a script allocate, estimated before any work for harness.check_fits."""
    length = preset.seqlen if length is None else length
    layer = preset.n_heads * (preset.d_head + 2 * length) + 12 * preset.d_model
    per_token = 4 * ((2 if backward else 1) * preset.vocab_size + 2 * preset.n_layers * preset.n_heads * preset.d_head
                     + (preset.n_layers if backward else 1) * layer) + 8
    return n_sequences * length * per_token


@torch.inference_mode()
def cached_matches_full(model, window, atol=1e-4):
    """Prefill half of `window` [B, S], decode the rest one token at a time: the logits of the full pass
    within `atol` (float32)? For models whose forward takes and returns a cache."""
    full, _ = model(window)
    half = window.shape[1] // 2
    logits, cache = model(window[:, :half])
    steps = [logits]
    for t in range(half, window.shape[1]):
        logits, cache = model(window[:, t:t + 1], cache)
        steps.append(logits)
    return (torch.cat(steps, dim=1) - full).abs().max().item() <= atol


def distillation_hint(temperature, lr):
    """What a diverged distillation says (train_steps' hint): the soft labels' gradients are scaled by T**2,
    so a high temperature can diverge as surely as a high learning rate."""
    return (f"(distillation temperature T={temperature:g}, which scales the soft labels' gradients by "
            f"T**2 = {temperature**2:g}, and peak learning rate {lr:g}); rerun with a lower temperature or a lower "
            "learning rate")


def teacher_loss_fn(teacher, loss):
    """A train_steps loss_fn(model, x, y) = loss(student_logits, teacher_logits, targets=y), the frozen
    teacher's logits computed without gradient (the teacher is put in eval mode: no dropout in its labels)."""
    teacher.eval()

    def loss_fn(student, x, y):
        with torch.no_grad():
            logits_teacher = logits_of(teacher(x))  # [B, S, vocab]
        return loss(logits_of(student(x)), logits_teacher, targets=y)
    return loss_fn


def save_and_reload(path, model, config, vocab, rebuild, **meta):
    """Save `model` with its config, load it back as type(model)(**config) and check that the logits are
    identical; only then does the file replace `path` (an error leaves whatever was there)."""
    device = next(model.parameters()).device
    x = torch.randint(config["vocab_size"], (2, config["seqlen"]), device=device)
    with atomic_file(path) as tmp:
        save_checkpoint(tmp, model, config, vocab, rebuild=rebuild, **meta)
        ckpt = load_checkpoint(tmp, vocab=vocab, rebuild=rebuild)
        reloaded = type(model)(**ckpt["config"]).to(device).eval()
        reloaded.load_state_dict(ckpt["state_dict"])
        with torch.no_grad():
            if not torch.equal(logits_of(model.eval()(x)), logits_of(reloaded(x))):
                raise GPTliteError(f"{path}: the reloaded {type(model).__name__} gives other logits than the "
                                   "saved model; this is a bug (nothing saved)")
    print(f"saved {path}; reloaded as {type(model).__name__}(**config): identical logits")


def moe_loss_fn(aux_weight=0.01, bias_rate=0.0):
    """train_steps' loss_fn: cross entropy + aux_weight x the load-balancing loss. bias_rate > 0 (the
    sigmoid router's auxiliary-loss-free balancing) nudges each layer's selection bias after the forward
    pass, towards the experts that were under-loaded in this batch."""
    def loss_fn(model, x, y):
        loss = F.cross_entropy(logits_of(model(x)).flatten(0, 1), y.flatten())
        if bias_rate:
            for layer in model.moe_layers():
                layer.update_selection_bias(bias_rate)
        return loss + aux_weight * model.aux_loss() if aux_weight else loss
    return loss_fn
