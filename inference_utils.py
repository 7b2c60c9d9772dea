"""A few helpers shared by all files: model loading, timing and evaluation (the post's words).

The script skeleton (flags, table, JSON, plot) is lib/harness.py; presets and data lib/corpus.py; the
training loop lib/training.py; atomic files and checkpoint integrity lib/files.py."""
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from gptlite import GPTlite, generate
from gptlite_kvcache import GPTlite_KVCache, generate_kvcache, kv_cache_model  # noqa: F401 (kv_cache_model: re-exported)
from lib.errors import CheckpointError, GPTliteError  # noqa: F401 (GPTliteError: re-exported)
from lib.files import checkpoint_path, gptlite_command, load_checkpoint, save_checkpoint
from lib.presets import get_preset
from lib.training import train_steps

# ----------------------------------------------------------------------------------------------------
# Model loading: load or train, one rule for every trained file.

def preset_recipe(preset, iters=None, seed=0):
    """How a preset's checkpoint is trained (gptlite.py's recipe): the stamp its file carries."""
    return dict(iters=iters or preset.iters, batch_size=preset.batch_size, seqlen=preset.seqlen, lr=preset.lr,
                seed=seed)


def train_recipe(model, data, recipe, desc, **train_kwargs):
    """Train `model` with a recipe of preset_recipe's form (train_kwargs: train_steps' own, e.g. loss_fn);
    returns train_steps' validation history."""
    return train_steps(model, data, recipe["iters"], recipe["batch_size"], recipe["seqlen"], recipe["lr"],
                       seed=recipe["seed"], desc=desc, **train_kwargs)


def cached_model(model, config, path, train, vocab, rebuild, stamp=None, untrained=False, retrains=False):
    """Load or train, one rule for every trained file of the repository.

    `model` is built for `config` (its constructor's keyword arguments) with its starting weights (random
    from a seed, or converted from a base model). The file at `path` is reused when it was saved for the
    same config and vocabulary and the same `stamp` (what else its weights depend on: the training recipe,
    the base checkpoint's sha256). A file with another stamp is stale: `train(model)` runs again and
    replaces it. A damaged file, or one saved for another config or vocabulary, is an error that says how
    to rebuild it: `rebuild` itself when it retrains without loading (`retrains`), else deleting the file
    first. untrained=True: `model` as it is; path None: trained now, never saved.
    Returns (model in eval mode, seconds of training or None when loaded)."""
    if untrained:
        return model.eval(), None
    if path is None:
        return train_and_save(model, config, None, train, vocab, rebuild, stamp)
    path = Path(path)
    if path.exists():
        hint = rebuild if retrains else f"rm {path} && {rebuild}"
        ckpt = load_checkpoint(path, config=config, vocab=vocab, rebuild=hint)
        if ckpt["meta"].get("stamp") == stamp:
            try:
                model.load_state_dict(ckpt["state_dict"])
            except RuntimeError as e:
                first = " ".join(line.strip() for line in str(e).splitlines()[1:3])
                raise CheckpointError(f"{path} does not fit {type(model).__name__}: {first}; rebuild it with: "
                                      f"{hint}") from None
            return model.eval(), None
        print(f"{path} was trained with another recipe or base checkpoint: training it again")
    else:
        print(f"no checkpoint at {path}: training one (once)")
    return train_and_save(model, config, path, train, vocab, rebuild, stamp)


def train_and_save(model, config, path, train, vocab, rebuild, stamp=None):
    """`train(model)`, then save it at `path` (None: not saved) with its stamp; a diverged run raises before
    anything is saved.
    Returns (model in eval mode, seconds of training)."""
    with Timer() as t:
        result = train(model)
    if path is None:
        return model.eval(), t.seconds
    meta = dict(stamp=stamp, train_seconds=round(t.seconds))
    if isinstance(result, list) and result and "val_loss" in result[-1]:  # train_steps' history
        meta["val_loss"] = result[-1]["val_loss"]
    save_checkpoint(path, model, config, vocab, rebuild=rebuild, **meta)
    print(f"saved {path}" + (f" (validation loss {meta['val_loss']:.4f})" if "val_loss" in meta else ""))
    return model.eval(), t.seconds


def check_replace(path, stamp, overwrite=False):
    """Before a training command writes `path`: a trained checkpoint there of another recipe (`stamp`) is
    replaced only with `overwrite` (every script would then retrain or use it); a GPTliteError says so before
    any work. Prints what is replaced."""
    path = Path(path)
    if not path.exists():
        return
    try:
        old = load_checkpoint(path)["meta"].get("stamp")
    except CheckpointError:
        print(f"replacing {path}, which is damaged")
        return
    if old != stamp and not overwrite:
        raise GPTliteError(f"{path} holds a checkpoint trained with another recipe ({old}); this run's ({stamp}) "
                           "would replace it: add --overwrite to replace it, or --out PATH to write elsewhere")
    print(f"replacing {path} (trained with {'the same recipe' if old == stamp else old})")


def train_checkpoint(preset, data, device, iters=None, seed=0, path=None, overwrite=False):
    """Train a GPTlite of `preset` from a fixed seed and save it as checkpoints/<preset>.pt (or `path`):
    gptlite.py's command. A trained file of another recipe there is replaced only with `overwrite`. A
    diverged run raises TrainingDiverged before saving."""
    preset, recipe = get_preset(preset), preset_recipe(get_preset(preset), iters, seed)
    path = path or checkpoint_path(preset.name)
    check_replace(path, recipe, overwrite)
    torch.manual_seed(seed)
    model = GPTlite(**preset.gptlite_kwargs()).to(device)
    print(f"training preset {preset.name!r} ({n_params(model) / 1e6:.2f}M parameters) for {recipe['iters']} "
          f"steps on {device}")
    rebuild = gptlite_command(preset.name, iters if recipe["iters"] != preset.iters else None, seed)
    train = lambda m: train_recipe(m, data, recipe, f"training {preset.name}")  # noqa: E731
    return train_and_save(model, model.config.to_dict(), path, train, data.vocab, rebuild, stamp=recipe)[0]


def load_model(model_class, preset, device="cpu", data=None, untrained=False, path=None, seed=0, rebuild=None,
               **model_kwargs):
    """Build `model_class` for `preset` with the weights of checkpoints/<preset>.pt (or `path`), trained
    first with the preset's recipe when missing or stale (needs `data`); `untrained=True` keeps random
    weights. `rebuild`: the command named in the errors (default: gptlite.py's). `model_kwargs`: extra
    constructor arguments of variants (e.g. n_groups). Returns the model on `device`, in eval mode."""
    preset = get_preset(preset)
    config = preset.gptlite_kwargs()
    torch.manual_seed(seed)
    if untrained:
        return model_class(**config, **model_kwargs).to(device).eval()
    path = Path(path) if path else checkpoint_path(preset.name)
    rebuild = rebuild or gptlite_command(preset.name)
    if data is None and not path.exists():
        raise CheckpointError(f"no checkpoint at {path}; pass data to train one, or run: {rebuild}")
    recipe = preset_recipe(preset, seed=seed)
    base = GPTlite(**config).to(device)  # trained as GPTlite whatever the class: python gptlite.py's weights
    base, _ = cached_model(base, config, path, lambda m: train_recipe(m, data, recipe, f"training {preset.name}"),
                           data.vocab if data is not None else None, rebuild, stamp=recipe, retrains=True)
    model = model_class(**config, **model_kwargs)
    try:
        model.load_state_dict(base.state_dict())
    except RuntimeError as e:
        first = str(e).splitlines()[1:3]
        raise CheckpointError(f"{path} does not fit {model_class.__name__}{model_kwargs or ''}: "
                              f"{' '.join(s.strip() for s in first)}; convert the weights or load the "
                              "model class the checkpoint was saved from") from None
    return model.to(device).eval()


def model_size_mb(model):
    """Parameters and buffers, in MiB."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


# ----------------------------------------------------------------------------------------------------
# Timing and memory: one round-robin timer, one median.

def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """`with Timer(device) as t: ...` then `t.seconds`; synchronizes CUDA before reading the clock."""

    def __init__(self, device="cpu"):
        self.device = device

    def __enter__(self):
        synchronize(self.device)
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        synchronize(self.device)
        self.seconds = time.perf_counter() - self.start


def median(values):
    """The one median of the repository (of timings, figures over repeats, ...): the mean of the two middle
    values for an even count, as statistics.median."""
    return statistics.median(values)


def time_round_robin(fns, device="cpu", warmup=1, repeats=5):
    """Raw wall times in seconds of each `fns[name]()`: `warmup` untimed rounds, then `repeats` rounds that
    call every function once in turn (round-robin), so that a slow moment of the machine falls on all of
    them alike. CUDA is synchronized before each clock read, outside the timed calls' own work.
    Returns {name: [seconds of each round]}."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            with Timer(device) as t:
                fn()
            times[name].append(t.seconds)
    return times


def time_fn(fn, device="cpu", warmup=1, repeats=5):
    """Median wall time of `fn()` in seconds over `repeats` runs, after `warmup` untimed runs."""
    return median(time_round_robin({"": fn}, device, warmup, repeats)[""])


def compare_generation(variants, n_tokens, batch_size, device="cpu", warmup=1, repeats=5):
    """TTFT, TPOT and throughput of each `variants[name](n)`, a call that generates n tokens per sequence.

    TTFT is the median time to the first token (prefill + one sample); TPOT is the extra time of the
    other n_tokens - 1 tokens, per token; throughput counts every sequence of the batch. Every variant's
    1-token and n_tokens runs are timed round-robin (time_round_robin)."""
    calls = {(name, n): (lambda fn=fn, n=n: fn(n)) for name, fn in variants.items() for n in (1, n_tokens)}
    times = time_round_robin(calls, device, warmup, repeats)
    results = {}
    for name in variants:
        ttft, total = median(times[name, 1]), median(times[name, n_tokens])
        noise = max(times[name, 1]) - min(times[name, 1])  # the spread of the repeated TTFT runs
        results[name] = {"ttft_ms": ttft * 1e3, "tpot_ms": tpot_ms(ttft, total, n_tokens, noise),
                         "tokens_per_s": batch_size * n_tokens / total}
    return results


def tpot_ms(ttft, total, n_tokens, noise=0.0):
    """TPOT from the median times (s) of generating 1 and n_tokens tokens, in ms; None when it cannot be
    measured: one token, or a decode time (total - ttft) no larger than the timing noise (the spread of
    the TTFT runs): too few tokens or repeats, and the difference would be noise, even negative."""
    if n_tokens < 2 or total - ttft <= noise:
        return None
    return (total - ttft) / (n_tokens - 1) * 1e3


def ratio(a, b):
    """a / b, or None when either figure could not be measured (None) or b is not positive."""
    return a / b if a is not None and b is not None and b > 0 else None


def measure_generation(generate_fn, n_tokens, batch_size, device="cpu", warmup=1, repeats=5):
    """compare_generation for one variant."""
    return compare_generation({"": generate_fn}, n_tokens, batch_size, device, warmup, repeats)[""]


@contextlib.contextmanager
def stderr_silenced():
    """The profiler's library prints start/stop lines on stderr; hide them while it runs."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_memory_mb(fn, device="cpu"):
    """Peak memory that `fn()` allocates above what was allocated when it started, in MiB.

    CUDA: torch.cuda.max_memory_allocated after a reset. CPU: the PyTorch profiler's allocation
    events (every tensor allocation and free, in order), whose running sum's maximum is the peak of
    tensor memory. Both count tensors only, not the Python process around them."""
    if torch.device(device).type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        fn()
        synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - start) / 2**20
    from torch.profiler import ProfilerActivity, profile
    with stderr_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    current = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        current += e.nbytes()
        peak = max(peak, current)
    return peak / 2**20


def peak_memory_label(device):
    return ("peak_mem_mb: torch.cuda.max_memory_allocated above the start" if torch.device(device).type == "cuda"
            else "peak_mem_mb: peak tensor memory above the start, from the PyTorch profiler's CPU allocation events")


def kv_cache_bytes(kv_cache):
    """Bytes held by a cache: a tensor, nested lists/tuples of tensors, or an object with `nbytes`
    (a StaticKVCache counts its whole preallocation)."""
    if kv_cache is None:
        return 0
    if isinstance(kv_cache, (list, tuple)):
        return sum(kv_cache_bytes(c) for c in kv_cache)
    if not hasattr(kv_cache, "nbytes"):
        raise TypeError(f"cannot count the bytes of a {type(kv_cache).__name__}")
    return kv_cache.nbytes


# ----------------------------------------------------------------------------------------------------
# Evaluation: a model's size and generation figures, checked against generation without a cache.

def n_params(model):
    return sum(p.numel() for p in model.parameters())


def generation_figures(variants, n_tokens, batch_size, device, repeats):
    """compare_generation of {name: fn(n)} (one warm-up, median of `repeats`, round-robin), and the peak
    memory of generating n_tokens with each: {name: {ttft_ms, tpot_ms, tokens_per_s, peak_mem_mb}}."""
    timings = compare_generation(variants, n_tokens, batch_size, device, warmup=1, repeats=repeats)
    return {name: dict(timings[name], peak_mem_mb=peak_memory_mb(lambda fn=fn: fn(n_tokens), device))
            for name, fn in variants.items()}


def kv_cache_checks(models, prompts, n_tokens):
    """Correctness first: the kv_cache_model of each GPTlite of {name: model}, and whether its greedy
    tokens after `prompts` [B, P] equal generate()'s (no cache) while they fit the window.
    Returns {name: cached model} and the checks {"<name>: KV-cache tokens = the model's own": ok}."""
    cached, checks = {}, {}
    for name, model in models.items():
        cached[name], seqlen = kv_cache_model(model), model.seqlen
        n = min(seqlen - prompts.shape[1] + 1, n_tokens)
        checks[f"{name}: KV-cache tokens = the model's own"] = torch.equal(
            generate_kvcache(cached[name], prompts, n, seqlen), generate(model.eval(), prompts, n, seqlen))
    return cached, checks


def measure_models(models, cached, prompts, n_tokens, device, repeats):
    """Generation figures of each GPTlite of {name: model} with its checked twin cached[name] (kv_cache_checks)
    and generate_kvcache: params, size_mb, kv_cache_mb (the cache at the end of generation: the last
    min(length, seqlen) tokens) and generation_figures'. Returns {name: dict of figures}."""
    batch_size, prompt_len = prompts.shape
    fns, figures = {}, {}
    for name, model in models.items():
        fns[name] = lambda n, m=cached[name]: generate_kvcache(m, prompts, n, m.seqlen)
        with torch.inference_mode():
            full = torch.ones(batch_size, min(prompt_len + n_tokens - 1, model.seqlen), dtype=torch.long,
                              device=prompts.device)
            kv_mb = kv_cache_bytes(cached[name](full)[1]) / 2**20
        figures[name] = dict(params=n_params(model), size_mb=model_size_mb(model), kv_cache_mb=kv_mb)
    timings = generation_figures(fns, n_tokens, batch_size, device, repeats)
    return {name: dict(figures[name], **timings[name]) for name in models}
