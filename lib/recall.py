"""Multi-query associative recall (MQAR, Zoology: Arora et al. 2023): can a model look up a value by its key?

A sequence holds n_pairs key-value pairs, then every key once more as a query, each at its own position
in the rest of the sequence (the other positions hold the filler token 0). The target of a query is the
value that followed its key among the pairs; every other target is -100, ignored by the loss and the
accuracy, so the model is trained and scored on the lookups only. As in Zoology's `multiquery_ar`:
keys and values are distinct tokens of two halves of the vocabulary, distinct within a sequence, and the
gap of a query after the pairs follows a power law (power_a = 0.01: most queries come soon after the
pairs, a few far), which needs seqlen >= 4 * n_pairs.

Softmax attention keeps every pair in its KV cache and solves the task with two layers (one head copies
a value's key into it, the next matches a query against those keys: an induction head). A linear
attention layer must write every pair into its fixed state, so its accuracy falls as the pairs outgrow it.

    inputs   k1 v1 k2 v2 k3 v3  0 k2  0  0 k1  0 k3  0 ...
    targets   .  .  .  .  .  .  . v2  .  . v1  . v3  . ...
"""
import torch
import torch.nn.functional as F

import inference_utils as iu
from gptlite_kvcache import GPTlite_KVCache
from gptlite_linear import RULES, GPTlite_Linear, linear_config
from lib import files, harness, training

FILLER = 0  # the token between the queries; keys are 1..n_keys, values n_keys+1..2*n_keys
POWER_A = 0.01  # Zoology's train_power_a and test_power_a
# The models: 2 layers (an induction head needs two), no dropout, 4 heads of 16: a linear layer's state is
# 4 x 16 x 16 numbers, 16 keys of 16 dimensions can be orthogonal (Zoology: 2 layers, d_model 64-512). With
# 2 heads softmax GPTlite left the plateau later, or not at all, within the CPU recipe's steps.
MODEL = dict(d_model=64, n_heads=4, d_head=16, n_layers=2, dropout_p=0.0)
EVAL_SEQUENCES, EVAL_SEED = 256, 4321


def vocab_size(n_keys):
    """The filler, n_keys keys and n_keys values."""
    return 2 * n_keys + 1


def task_error(n_pairs, seqlen, n_keys):
    """Why (n_pairs, seqlen, n_keys) is not a valid task, or None: the scripts name their flags with it."""
    if n_keys < 2:
        return f"at least 2 keys are needed, got {n_keys}"
    if n_pairs < 1 or n_pairs > n_keys:
        return f"the pairs need distinct keys: 1 <= pairs <= keys={n_keys}, got {n_pairs}"
    if 4 * n_pairs > seqlen:
        return (f"{n_pairs} pairs and their {n_pairs} queries need a sequence of at least 4 * pairs = "
                f"{4 * n_pairs} tokens, got {seqlen}")
    return None


def mqar_batch(batch_size, n_pairs, seqlen, n_keys, generator=None, power_a=POWER_A):
    """batch_size MQAR sequences: inputs x [B, seqlen] and targets y [B, seqlen] (the value at each query's
    position, -100 elsewhere). `generator` makes them reproducible."""
    if (error := task_error(n_pairs, seqlen, n_keys)) is not None:
        raise ValueError(error)
    B, P = batch_size, n_pairs
    keys = torch.rand(B, n_keys, generator=generator).argsort(-1)[:, :P] + 1  # distinct keys [B, P]
    values = torch.rand(B, n_keys, generator=generator).argsort(-1)[:, :P] + n_keys + 1  # distinct values [B, P]
    space = (seqlen - 2 * P) // 2  # query slots: every other position after the pairs
    weights = power_a * torch.arange(1, space + 1, dtype=torch.float64) ** (power_a - 1)  # p(gap) ~ gap^(a-1)
    gaps = torch.multinomial(weights.expand(B, space), P, replacement=False, generator=generator)  # [B, P]
    position = 2 * P + 2 * gaps  # where each key is queried
    x = torch.full((B, seqlen), FILLER, dtype=torch.long)
    x[:, 0:2 * P:2], x[:, 1:2 * P:2] = keys, values
    x.scatter_(1, position, keys)
    y = torch.full_like(x, -100).scatter_(1, position, values)
    return x, y


def accuracy(logits, y):
    """Fraction of the targets (y != -100) that the argmax of logits [B, S, V] gets right."""
    answers = y != -100
    return (logits.argmax(-1)[answers] == y[answers]).float().mean().item()


def kinds():
    """The recall models by name: (class, rule, hybrid_every). Every rule of gptlite_linear.RULES (read at
    run time: a rule added there is measured here too), and a hybrid whose second block is softmax."""
    linear = {rule: (GPTlite_Linear, rule, None) for rule in RULES}
    return {"softmax": (GPTlite_KVCache, None, None), "hybrid": (GPTlite_Linear, "delta", 2), **linear}


def model_config(n_keys, seqlen, rule=None, hybrid_every=None, d_model=None):
    """The constructor arguments of a recall model; rule None: softmax GPTlite (a position table of seqlen)."""
    base = dict(MODEL, vocab_size=vocab_size(n_keys), seqlen=seqlen)
    if d_model is not None:  # the full recipe's width: the heads grow with it
        base.update(d_model=d_model, d_head=d_model // base["n_heads"])
    # chunks no longer than a sequence: a short sequence padded to a 32-token chunk costs 2-3x (KDA: 523 against
    # 241 ms a step at 16 tokens, one thread)
    return base if rule is None else dict(linear_config(base, rule, hybrid_every), chunk_size=min(32, seqlen))


def lr_at(step, steps, lr, warmup):
    """Linear warm-up, constant, then linear decay to 0 over the last fifth of the steps. A constant phase
    rather than a cosine: these models sit on a plateau (chance accuracy) for hundreds of steps before the
    lookup circuit forms, and a decaying rate lengthens the plateau."""
    decay_from = int(0.8 * steps)
    return lr * min(1, (step + 1) / warmup) * min(1, (steps - step) / max(1, steps - decay_from))


def train(model, steps, lr, pairs, seqlen, n_keys, batch_size, seed, desc, warmup=100):
    """AdamW without weight decay (0.1 keeps these small models on the plateau); each step a fresh batch
    of seqlen tokens and a pair count drawn from 1..max(pairs) (one model for every count); the loss on the
    answers only. (Batches only as long as their pairs need were tried: they stalled softmax GPTlite.)"""
    def batches(generator, device):
        n_pairs = int(torch.randint(1, max(pairs) + 1, (1,), generator=generator))
        return (t.to(device) for t in mqar_batch(batch_size, n_pairs, seqlen, n_keys, generator))

    def answers_loss(model, x, y):
        return F.cross_entropy(training.logits_of(model(x)).flatten(0, 1), y.flatten(), ignore_index=-100)
    training.train_steps(model, None, steps, batch_size, seqlen, lr, seed, loss_fn=answers_loss, desc=desc,
                         evaluate=False, batches=batches, schedule=lambda step: lr_at(step, steps, lr, min(warmup, steps)),
                         betas=(0.9, 0.98), weight_decay=0.0)


@torch.inference_mode()
def evaluate(model, n_pairs, seqlen, n_keys, n_sequences=EVAL_SEQUENCES, seed=EVAL_SEED):
    """Accuracy on fixed-seed sequences (another seed than training's), and the bytes of the state or KV
    cache of one sequence after the whole of it."""
    x, y = mqar_batch(n_sequences, n_pairs, seqlen, n_keys, torch.Generator().manual_seed(seed + n_pairs))
    device = next(model.parameters()).device
    logits, cache = model(x.to(device))
    return accuracy(logits.cpu(), y), iu.kv_cache_bytes(cache) // n_sequences


def recall_rows(pairs, steps, lr, n_keys, seqlen, seed, batch_size=64, d_model=None, device="cpu",
                checkpoint_prefix=None, rebuild=None, untrained=False):
    """Train (or load) one model of each kind on MQAR, then its accuracy at each pair count and its state
    bytes at seqlen. checkpoint_prefix: files <prefix>_<name>.pt (None: not saved).
    Returns rows (variant, state_kb, acc_<p> per p, train_s) and the kinds' names."""
    rows = []
    for name, (model_class, rule, hybrid_every) in kinds().items():
        config = model_config(n_keys, seqlen, rule, hybrid_every, d_model)
        stamp = dict(steps=steps, lr=lr, pairs=max(pairs), batch_size=batch_size, seed=seed, task="mqar-zoology")
        path = None if checkpoint_prefix is None else files.checkpoint_path(f"{checkpoint_prefix}_{name}")
        torch.manual_seed(seed)
        model, seconds = iu.cached_model(
            model_class(**config).to(device), config, path,
            lambda m, name=name: train(m, steps, lr, pairs, seqlen, n_keys, batch_size, seed, f"recall {name}"),
            f"mqar{n_keys}", rebuild, stamp=stamp, untrained=untrained)
        results = {p: evaluate(model, p, seqlen, n_keys) for p in pairs}
        state = results[max(pairs)][1]  # a linear state does not depend on the pairs, a KV cache on seqlen only
        rows.append(harness.make_row(name, state_kb=round(state / 1024, 2),
                                     **{f"acc_{p}": round(acc, 3) for p, (acc, _) in results.items()},
                                     train_s=None if seconds is None else round(seconds, 1)))
    return rows


def plot_recall(ax_pairs, ax_state, rows, pairs, seqlen):
    """Accuracy against the pairs (one line per model), and at the most pairs against the state bytes."""
    for r in rows:
        line, = ax_pairs.plot(pairs, [r[f"acc_{p}"] for p in pairs], marker="o", label=r["variant"])
        ax_state.scatter(r["state_kb"], r[f"acc_{max(pairs)}"], color=line.get_color(), label=r["variant"])
        ax_state.annotate(r["variant"], (r["state_kb"], r[f"acc_{max(pairs)}"]), fontsize=8,
                          xytext=(4, 4), textcoords="offset points")
    ax_pairs.set(xlabel="key-value pairs in the context", ylabel="recall accuracy", ylim=(0, 1.02),
                 title="associative recall (MQAR)")
    ax_state.set(xlabel=f"state or KV cache per sequence at {seqlen} tokens (KiB)", xscale="log",
                 ylabel=f"recall accuracy at {max(pairs)} pairs", ylim=(0, 1.02), title="recall against state size")
    ax_pairs.legend()
