"""Shared helpers of every script: presets, data, checkpoints, training, timing, memory, evaluation,
reporting and the common flags. Written once here so that each main_<technique>.py stays thin."""
import argparse
import contextlib
import hashlib
import http.client
import json
import math
import os
import statistics
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from gptlite import GPTlite

ROOT = Path(__file__).resolve().parent
CHECKPOINT_DIR = ROOT / "checkpoints"


class GPTliteError(RuntimeError):
    """An error with a message that says what to do; scripts print it without a traceback."""


class DataError(GPTliteError):
    pass


class CheckpointError(GPTliteError):
    pass


class TrainingDiverged(GPTliteError):
    """The loss became NaN or infinite: raised before anything is saved."""


# ----------------------------------------------------------------------------------------------------
# Presets: plain data, one place.

@dataclass(frozen=True)
class Preset:
    name: str
    d_model: int       # embedding width
    n_heads: int       # attention heads per block
    d_head: int        # width of one head (n_heads * d_head need not equal d_model)
    n_layers: int      # transformer blocks
    dropout_p: float   # dropout while training
    seqlen: int        # context window in characters
    batch_size: int    # training batch, in sequences of seqlen
    lr: float          # peak AdamW learning rate (warm-up, then cosine decay to lr/10)
    iters: int         # training steps of the checkpoint
    vocab_size: int = 65  # tiny Shakespeare has 65 distinct characters

    def model_config(self):
        """The keyword arguments of GPTlite(...) for this preset."""
        return dict(vocab_size=self.vocab_size, d_model=self.d_model, n_heads=self.n_heads,
                    d_head=self.d_head, n_layers=self.n_layers, dropout_p=self.dropout_p,
                    seqlen=self.seqlen)


PRESETS = {
    # the post's model: 6 layers, d_model 512, 6 heads of 64, seqlen 128 (about 19M parameters)
    "gptlite": Preset("gptlite", d_model=512, n_heads=6, d_head=64, n_layers=6, dropout_p=0.1,
                      seqlen=128, batch_size=32, lr=6e-4, iters=5000),
    # the post's smaller student: fewer layers, smaller embedding, same vocabulary and window
    "distilled": Preset("distilled", d_model=256, n_heads=4, d_head=64, n_layers=3, dropout_p=0.1,
                        seqlen=128, batch_size=32, lr=1e-3, iters=5000),
    # a 0.8M-parameter model that trains on 2 CPU cores in minutes
    "cpu": Preset("cpu", d_model=128, n_heads=4, d_head=32, n_layers=4, dropout_p=0.0,
                  seqlen=128, batch_size=32, lr=3e-3, iters=800),
}


def get_preset(name):
    if isinstance(name, Preset):
        return name
    if name not in PRESETS:
        raise GPTliteError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


# ----------------------------------------------------------------------------------------------------
# Data: tiny Shakespeare, character level, first 90% train, last 10% validation.

DATA_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
DATA_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
DATA_BYTES = 1_115_394
DEFAULT_DATA = ROOT / "data" / "tinyshakespeare.txt"


def data_help():
    return ("Give the tiny Shakespeare file in one of three ways: --data PATH, the GPTLITE_DATA "
            f"environment variable, or {DEFAULT_DATA} (downloaded from {DATA_URL} when missing and online).")


@dataclass
class Data:
    vocab: str           # the sorted characters; token id = index
    train: torch.Tensor  # [N_train] token ids
    val: torch.Tensor    # [N_val] token ids

    def encode(self, text):
        unknown = sorted(set(text) - set(self.vocab))
        if unknown:
            raise ValueError(f"characters {unknown} are not in the tiny Shakespeare vocabulary")
        index = {c: i for i, c in enumerate(self.vocab)}
        return [index[c] for c in text]

    def decode(self, ids):
        return "".join(self.vocab[i] for i in ids)


def _download(path):
    """Fetch the canonical file into `path`; only a file with the right hash is ever put there."""
    try:
        with urllib.request.urlopen(DATA_URL, timeout=30) as response:
            raw = response.read()
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
        raise DataError(f"no data file found and the download failed ({e}). {data_help()}") from None
    if hashlib.sha256(raw).hexdigest() != DATA_SHA256:
        raise DataError(f"the downloaded file is not the canonical tiny Shakespeare (sha256 differs). {data_help()}")
    try:
        atomic_write_bytes(raw, path)
    except OSError as e:
        raise DataError(f"downloaded tiny Shakespeare but cannot write it to {path} ({e}). {data_help()}") from None


def load_data(path=None):
    """Load tiny Shakespeare from `path`, else $GPTLITE_DATA, else data/ (downloading it there)."""
    if path:
        path, source = Path(path), "--data"
    elif os.environ.get("GPTLITE_DATA"):
        path, source = Path(os.environ["GPTLITE_DATA"]), "GPTLITE_DATA"
    else:
        path, source = DEFAULT_DATA, None
    try:
        if not path.is_file():
            if source is not None:  # an explicit path that is wrong is an error, not a reason to download
                raise DataError(f"{source} points at {path}, which is not a file. {data_help()}")
            _download(path)
        raw = path.read_bytes()
    except OSError as e:  # permission denied, a folder in the way, ...
        raise DataError(f"cannot read {path} ({e}). {data_help()}") from None
    digest = hashlib.sha256(raw).hexdigest()
    if digest != DATA_SHA256:  # before decoding: a file that is not UTF-8 fails here, with what to do
        raise DataError(f"{path} is not the canonical tiny Shakespeare ({len(raw):,} bytes, sha256 {digest}; "
                        f"expected {DATA_BYTES:,} bytes, sha256 {DATA_SHA256}). Replace it. {data_help()}")
    text = raw.decode("ascii")  # the canonical file is ASCII: the hash above guarantees it
    vocab = "".join(sorted(set(text)))
    table = torch.zeros(256, dtype=torch.long)  # byte -> token id (the canonical file is ASCII)
    for i, c in enumerate(vocab):
        table[ord(c)] = i
    tokens = table[torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()]
    n_train = int(0.9 * len(tokens))
    return Data(vocab=vocab, train=tokens[:n_train], val=tokens[n_train:])


def get_batch(tokens, batch_size, seqlen, generator=None, device="cpu"):
    """Random windows of `tokens`: inputs and next-token targets, each [batch_size, seqlen]."""
    starts = torch.randint(len(tokens) - seqlen - 1, (batch_size,), generator=generator)
    x = torch.stack([tokens[s:s + seqlen] for s in starts])
    y = torch.stack([tokens[s + 1:s + seqlen + 1] for s in starts])
    return x.to(device), y.to(device)


def sample_prompts(data, n_prompts, length, seed=0, device="cpu"):
    """`n_prompts` windows of `length` characters from the validation split: [n_prompts, length]."""
    if not 1 <= length < len(data.val):
        raise ValueError(f"prompt length must be between 1 and {len(data.val) - 1}, got {length}")
    generator = torch.Generator().manual_seed(seed)
    return get_batch(data.val, n_prompts, length, generator, device)[0]


def logits_of(output):
    """Models with a KV cache return (logits, cache); the others return logits."""
    return output[0] if isinstance(output, tuple) else output


@torch.no_grad()
def validation_loss(model, data, n_batches=20, batch_size=32, seqlen=None, seed=1234):
    """Mean cross entropy (nats per character) on fixed-seed validation batches, the same for every model."""
    seqlen = seqlen or model.seqlen
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    losses = []
    for _ in range(n_batches):
        x, y = get_batch(data.val, batch_size, seqlen, generator, device)
        logits = logits_of(model(x))  # [B, S, vocab]
        losses.append(F.cross_entropy(logits.flatten(0, 1), y.flatten()).item())
    model.train(was_training)
    return sum(losses) / len(losses)


# ----------------------------------------------------------------------------------------------------
# Training: one loop for checkpoints and for the short uptraining of converted models.

def cross_entropy_loss(model, x, y):
    return F.cross_entropy(logits_of(model(x)).flatten(0, 1), y.flatten())


def check_finite(loss, step, n_steps, lr, what, hint=None):
    """Stop a diverged run at once: its weights are useless, and the callers save only after training.
    hint: the likely causes and what to do, after the step (default: the learning rate)."""
    if not math.isfinite(loss):
        hint = hint or f"(peak learning rate {lr:g}); rerun with a lower learning rate"
        raise TrainingDiverged(f"training diverged: the {what} is {loss} at step {step} of {n_steps} {hint}. "
                               f"Nothing was saved.")


def train_steps(model, data, n_steps, batch_size, seqlen, lr, seed=0, eval_interval=None,
                loss_fn=cross_entropy_loss, desc="training", hint=None):
    """Train `model` for `n_steps` AdamW steps (warm-up, cosine decay, gradient clipping at 1.0).

    Returns the validation history [{"step", "val_loss"}], evaluated every `eval_interval` steps
    and after the last one. `loss_fn(model, x, y)` lets distillation swap the loss; `hint` is what a
    divergence error says about its causes (check_finite)."""
    if n_steps < 1:
        raise ValueError(f"n_steps must be at least 1, got {n_steps}")
    device = next(model.parameters()).device
    eval_interval = eval_interval or max(n_steps // 5, 1)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.1)
    warmup = min(100, max(n_steps // 10, 1))

    def lr_at(step):  # linear warm-up, then cosine decay to lr/10
        if step < warmup:
            return lr * (step + 1) / warmup
        progress = (step - warmup) / max(n_steps - warmup, 1)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    history = []
    model.train()
    bar = tqdm(range(n_steps), desc=desc, dynamic_ncols=True, mininterval=0.5)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        x, y = get_batch(data.train, batch_size, seqlen, generator, device)
        loss = loss_fn(model, x, y)
        check_finite(loss.item(), step + 1, n_steps, lr, "training loss", hint)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if (step + 1) % eval_interval == 0 or step + 1 == n_steps:
            history.append({"step": step + 1, "val_loss": validation_loss(model, data, n_batches=10)})
            check_finite(history[-1]["val_loss"], step + 1, n_steps, lr, "validation loss", hint)  # the last update
            model.train()
            bar.set_postfix(loss=f"{loss.item():.3f}", val=f"{history[-1]['val_loss']:.3f}")
        elif step % 10 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return history


# ----------------------------------------------------------------------------------------------------
# Checkpoints: config + vocabulary + state dict, written atomically, loaded with weights_only=True.

def checkpoint_path(name):
    return CHECKPOINT_DIR / f"{name}.pt"


def gptlite_command(preset, iters=None, seed=0):
    """The command that trains checkpoints/<preset>.pt: the rebuild hint of a preset checkpoint."""
    flags = (f" --iters {iters}" if iters else "") + (f" --seed {seed}" if seed else "")
    return f"python gptlite.py --preset {preset}{flags}"


def pid_alive(pid):
    try:
        os.kill(pid, 0)  # signal 0: no signal, only the check that the process exists
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # PermissionError: another user's process; cannot tell: keep its file
        pass
    return True


def remove_stale_temps(path):
    """Remove the `<name>.tmp<pid>` files beside `path` of processes that are gone (killed mid-write).
    A live process's temp file is kept: it may be writing the same path right now, and its rename must
    not fail. (Only on POSIX: on Windows os.kill(pid, 0) would send Ctrl+C, not check.)"""
    if os.name != "posix":
        return
    for tmp in path.parent.iterdir():
        pid = tmp.name.removeprefix(f"{path.name}.tmp")
        if tmp.name != pid and pid.isdigit() and not pid_alive(int(pid)):
            with contextlib.suppress(OSError):  # a file we cannot remove must not stop the save
                tmp.unlink()


@contextlib.contextmanager
def atomic_file(path):
    """Yield a temporary path beside `path`; on success it is synced to disk and renamed to `path`, on
    failure removed. A killed run never leaves a corrupt file, and an old file survives a failed write;
    the temp file a killed run leaves is removed by the next write of the same path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(raw, path):
    with atomic_file(path) as tmp:
        tmp.write_bytes(raw)


def atomic_torch_save(obj, path):
    with atomic_file(path) as tmp:
        torch.save(obj, tmp)


def checkpoint_sha256(config, vocab, state_dict):
    """sha256 over the config, the vocabulary and every tensor (name, dtype, shape and bytes, in name
    order): one changed byte anywhere in the weights changes it."""
    h = hashlib.sha256(json.dumps([config, vocab], sort_keys=True).encode())
    for name in sorted(state_dict):
        t = state_dict[name].detach().cpu().contiguous()
        h.update(f"\n{name} {t.dtype} {tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # the raw bytes, whatever the dtype
    return h.hexdigest()


def save_checkpoint(path, model, config, vocab, rebuild=None, **meta):
    """Save config, vocabulary, state dict and their checksum atomically. `rebuild`: the shell command
    that rebuilds this file, kept in the meta for the load errors (load_checkpoint's `rebuild`)."""
    config, state_dict = dict(config), model.state_dict()
    meta = {**meta, "rebuild": rebuild} if rebuild else meta
    atomic_torch_save({"config": config, "vocab": vocab, "state_dict": state_dict, "meta": meta,
                       "sha256": checkpoint_sha256(config, vocab, state_dict)}, path)


def load_checkpoint(path, config=None, vocab=None, rebuild=None):
    """Read and verify a checkpoint; a damaged file, or another `config` or `vocab` than asked for, is a
    clear error that names `rebuild`, the shell command that rebuilds this file (default: the command
    saved in it, else gptlite.py's for a preset checkpoint)."""
    path = Path(path)

    def how_to_rebuild(command):
        return f"rebuild it with: {command}" if command else "rebuild it with the script that saved it"

    retrain = how_to_rebuild(rebuild or (gptlite_command(path.stem) if path.stem in PRESETS else None))
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        ok = (isinstance(ckpt, dict) and isinstance(ckpt.get("config"), dict)
              and isinstance(ckpt.get("vocab"), str) and isinstance(ckpt.get("state_dict"), dict)
              and all(isinstance(t, torch.Tensor) for t in ckpt["state_dict"].values()))
    except Exception as e:
        raise CheckpointError(f"{path} is not a readable checkpoint ({type(e).__name__}: {e}); {retrain}") from None
    if not ok:
        raise CheckpointError(f"{path} is not a checkpoint of this repository (config, vocab and state_dict "
                              f"expected); {retrain}")
    saved_command = ckpt["meta"].get("rebuild") if isinstance(ckpt.get("meta"), dict) else None
    if not rebuild and isinstance(saved_command, str):  # the file says how it was made
        retrain = how_to_rebuild(saved_command)
    if "sha256" not in ckpt:
        raise CheckpointError(f"{path} has no checksum of its weights (saved before checkpoints carried one, or not "
                              f"by save_checkpoint), so it cannot be verified and is refused; {retrain}")
    if ckpt["sha256"] != checkpoint_sha256(ckpt["config"], ckpt["vocab"], ckpt["state_dict"]):
        raise CheckpointError(f"{path} is damaged: its weights do not match their checksum (a changed byte or an "
                              f"edit outside save_checkpoint); {retrain}")
    if not all(torch.isfinite(t).all() for t in ckpt["state_dict"].values() if t.is_floating_point()):
        raise CheckpointError(f"{path} holds non-finite weights (NaN or inf): the training diverged; {retrain}")
    if config is not None and ckpt["config"] != dict(config):
        saved, asked = ckpt["config"], dict(config)
        diff = {k: (saved.get(k), asked.get(k)) for k in sorted(set(saved) | set(asked)) if saved.get(k) != asked.get(k)}
        raise CheckpointError(f"{path} was trained with another configuration (as saved, as asked: {diff}); {retrain}")
    if vocab is not None and ckpt["vocab"] != vocab:
        raise CheckpointError(f"{path} was trained on another vocabulary than this data file's; "
                              f"use the matching data file, or {retrain}")
    return ckpt


def train_checkpoint(preset, data, device, iters=None, seed=0, path=None):
    """Train a GPTlite of `preset` from a fixed seed and save it as checkpoints/<preset>.pt (or `path`).
    A diverged run raises TrainingDiverged before saving: an existing file is left as it was."""
    preset = get_preset(preset)
    iters = iters or preset.iters
    torch.manual_seed(seed)
    model = GPTlite(**preset.model_config()).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"training preset {preset.name!r} ({n_params / 1e6:.2f}M parameters) for {iters} steps on {device}")
    history = train_steps(model, data, iters, preset.batch_size, preset.seqlen, preset.lr, seed=seed,
                          desc=f"training {preset.name}")
    rebuild = None if path else gptlite_command(preset.name, iters if iters != preset.iters else None, seed)
    path = path or checkpoint_path(preset.name)
    save_checkpoint(path, model, preset.model_config(), data.vocab, rebuild=rebuild, preset=preset.name, iters=iters,
                    seed=seed, val_loss=history[-1]["val_loss"])
    print(f"saved {path} (validation loss {history[-1]['val_loss']:.4f})")
    return model


def load_model(model_class, preset, device="cpu", data=None, untrained=False, path=None, seed=0, rebuild=None,
               **model_kwargs):
    """Build `model_class` for `preset` with the weights of checkpoints/<preset>.pt (or `path`).

    A missing checkpoint is trained first (needs `data`); `untrained=True` keeps random weights.
    `rebuild`: the shell command that rebuilds the file, named in the errors (default: gptlite.py's for
    the preset). `model_kwargs` are the extra constructor arguments of variants (e.g. n_groups). Returns
    the model on `device`, in eval mode."""
    preset = get_preset(preset)
    config = preset.model_config()
    if untrained:
        torch.manual_seed(seed)
        return model_class(**config, **model_kwargs).to(device).eval()
    path = Path(path) if path else checkpoint_path(preset.name)
    rebuild = rebuild or gptlite_command(preset.name)
    if not path.exists():
        if data is None:
            raise CheckpointError(f"no checkpoint at {path}; pass data to train one, or run: {rebuild}")
        print(f"no checkpoint at {path}: training one first")
        train_checkpoint(preset, data, device, seed=seed, path=path)
    ckpt = load_checkpoint(path, config=config, vocab=data.vocab if data is not None else None, rebuild=rebuild)
    model = model_class(**ckpt["config"], **model_kwargs)
    try:
        model.load_state_dict(ckpt["state_dict"])
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
# Timing and memory.

def get_device(name=None):
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise GPTliteError(f"--device {name} is not a device; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise GPTliteError(f"--device {name}: only cpu and cuda are supported")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise GPTliteError(f"--device {name} asked for CUDA, which this machine does not have; use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise GPTliteError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


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


def time_fn(fn, device="cpu", warmup=1, repeats=5):
    """Median wall time of `fn()` in seconds over `repeats` runs, after `warmup` untimed runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        with Timer(device) as t:
            fn()
        times.append(t.seconds)
    return statistics.median(times)


def compare_generation(variants, n_tokens, batch_size, device="cpu", warmup=1, repeats=5):
    """TTFT, TPOT and throughput of each `variants[name](n)`, a call that generates n tokens per sequence.

    TTFT is the median time to the first token (prefill + one sample); TPOT is the extra time of the
    other n_tokens - 1 tokens, per token; throughput counts every sequence of the batch. The variants
    are timed round-robin, so that a slow moment of the machine falls on all of them alike."""
    for fn in variants.values():
        for _ in range(warmup):
            fn(1), fn(n_tokens)
    times = {name: {1: [], n_tokens: []} for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            for n in (1, n_tokens):
                with Timer(device) as t:
                    fn(n)
                times[name][n].append(t.seconds)
    results = {}
    for name in variants:
        ttft, total = statistics.median(times[name][1]), statistics.median(times[name][n_tokens])
        noise = max(times[name][1]) - min(times[name][1])  # the spread of the repeated TTFT runs
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
# Experiments on derived models (main_gqa, main_mla, main_distillation, main_pruning): uptraining,
# the cached-against-full check, a model's config and its KV-cache twin, measuring a list of models,
# saving a derived checkpoint that is checked before it replaces anything.

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


def teacher_loss_fn(teacher, loss):
    """A train_steps loss_fn(model, x, y) = loss(student_logits, teacher_logits, targets=y), the frozen
    teacher's logits computed without gradient (the teacher is put in eval mode: no dropout in its labels)."""
    teacher.eval()

    def loss_fn(student, x, y):
        with torch.no_grad():
            logits_teacher = logits_of(teacher(x))  # [B, S, vocab]
        return loss(logits_of(student(x)), logits_teacher, targets=y)
    return loss_fn


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def model_config(model):
    """The GPTlite(**config) of a (possibly pruned) GPTlite, read from its modules; d_ff only when it
    is not the default 4 * d_model, so that an unpruned model's config is its preset's."""
    mha, d_model = model.blocks[0].mha, model.token_embedding.embedding_dim
    config = dict(vocab_size=model.token_embedding.num_embeddings, d_model=d_model, n_heads=mha.n_heads,
                  d_head=mha.d_head, n_layers=len(model.blocks), dropout_p=mha.dropout.p, seqlen=model.seqlen)
    d_ff = model.blocks[0].ffwd.net[0].out_features
    return config if d_ff == 4 * d_model else dict(config, d_ff=d_ff)


def kv_cache_model(model):
    """A GPTlite_KVCache with the config and weights of the GPTlite `model`, on its device, in eval mode."""
    from gptlite_kvcache import GPTlite_KVCache  # gptlite_kvcache does not import this module; kept local
    weight = model.fc_out.weight
    cached = GPTlite_KVCache(**model_config(model)).to(weight.device, weight.dtype)
    cached.load_state_dict(model.state_dict())
    return cached.eval()


def generation_figures(variants, n_tokens, batch_size, device, repeats):
    """compare_generation of {name: fn(n)} (one warm-up, median of `repeats`, round-robin), and the peak
    memory of generating n_tokens with each: {name: {ttft_ms, tpot_ms, tokens_per_s, peak_mem_mb}}."""
    timings = compare_generation(variants, n_tokens, batch_size, device, warmup=1, repeats=repeats)
    return {name: dict(timings[name], peak_mem_mb=peak_memory_mb(lambda fn=fn: fn(n_tokens), device))
            for name, fn in variants.items()}


def measure_models(models, data, n_tokens, prompt_len, batch_size, device, repeats, seed=0):
    """Generation figures of each GPTlite of {name: model}, with its kv_cache_model + generate_kvcache.

    Correctness first: the cached model's tokens must equal generate()'s (no cache) while they fit the
    window. Returns {name: dict of figures} and the names whose tokens differ."""
    from gptlite import generate
    from gptlite_kvcache import generate_kvcache
    prompts = sample_prompts(data, batch_size, prompt_len, seed=seed, device=device)
    fns, figures, failures = {}, {}, []
    for name, model in models.items():
        cached, seqlen = kv_cache_model(model), model.seqlen
        in_window = min(seqlen - prompt_len + 1, n_tokens)
        if not torch.equal(generate_kvcache(cached, prompts, in_window, seqlen),
                           generate(model.eval(), prompts, in_window, seqlen)):
            failures.append(name)
        fns[name] = lambda n, cached=cached, seqlen=seqlen: generate_kvcache(cached, prompts, n, seqlen)
        with torch.inference_mode():  # the cache at the end of generation: the last min(length, seqlen) tokens
            full = torch.ones(batch_size, min(prompt_len + n_tokens - 1, seqlen), dtype=torch.long, device=device)
            kv_mb = kv_cache_bytes(cached(full)[1]) / 2**20
        figures[name] = dict(params=n_params(model), size_mb=model_size_mb(model), kv_cache_mb=kv_mb)
    timings = generation_figures(fns, n_tokens, batch_size, device, repeats)
    return {name: dict(figures[name], **timings[name]) for name in models}, failures


def rebuild_command(script, argv, preset):
    """The shell command that reruns `script` with these flags (the preset named): what rebuilds a
    file it saved."""
    import shlex
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--preset" or a.startswith("--preset=") for a in argv):
        argv = ["--preset", preset.name] + argv
    return shlex.join(["python", script] + argv)


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


# ----------------------------------------------------------------------------------------------------
# Flags, set-up and reporting.

def int_at_least(low):
    """An argparse type: an integer of at least `low` (the error names the flag and the bound)."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    parse.__name__ = f"integer >= {low}"
    return parse


def float_in(low=-math.inf, high=math.inf, low_open=False, high_open=False):
    """An argparse type: a finite float in [low, high] (an open end with low_open / high_open).
    inf and nan are refused: a non-finite learning rate or temperature trains a NaN model."""
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        below = value <= low if low_open else value < low
        above = value >= high if high_open else value > high
        if not math.isfinite(value) or below or above:
            interval = (f"{'(' if low_open or low == -math.inf else '['}{low:g}, "
                        f"{high:g}{')' if high_open or high == math.inf else ']'}")
            raise argparse.ArgumentTypeError(f"must be a finite number in {interval}, got {text}")
        return value
    parse.__name__ = "number"
    return parse


positive_float = float_in(0.0, low_open=True)  # learning rates, temperatures


def add_model_args(parser):
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="model preset (default: gptlite on CUDA, cpu elsewhere)")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--seed", type=int_at_least(0), default=0, help="random seed of training, prompts and weights")
    parser.add_argument("--data", default=None, metavar="PATH",
                        help="tiny Shakespeare file (default: $GPTLITE_DATA, else data/tinyshakespeare.txt)")


def script_parser(doc):
    """A script's argument parser: its docstring as the help text, and the common flags."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    return parser


def add_common_args(parser):
    add_model_args(parser)
    parser.add_argument("--untrained", action="store_true",
                        help="random weights, no checkpoint: a quick smoke run (loss figures are meaningless)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--plot", default=None, metavar="PATH", help="also save the script's plot as PNG to PATH")


def setup(args, parser, check_args=None):
    """Check the common flags (and the output paths and prompt length of the scripts that have them),
    choose device and preset (and say which), run the script's own `check_args(preset)`, then load the
    data: every flag error comes before any work."""
    for flag in ("json", "plot", "save"):
        out = getattr(args, flag, None)
        if out is not None:
            if Path(out).is_dir() or not Path(out).resolve().parent.is_dir():
                parser.error(f"--{flag} {out}: give a file path in a folder that exists")
            if flag == "plot" and Path(out).suffix.lower() != ".png":
                parser.error(f"--plot {out}: the plot is a PNG, give a path ending in .png")
    try:
        device = get_device(args.device)
    except GPTliteError as e:
        parser.error(str(e))
    preset = get_preset(args.preset or ("gptlite" if device.type == "cuda" else "cpu"))
    if getattr(args, "prompt_len", None) is not None and args.prompt_len > preset.seqlen:
        parser.error(f"--prompt-len must be at most the model's seqlen={preset.seqlen}, got {args.prompt_len}")
    if check_args is not None:
        check_args(preset)
    print(f"preset: {preset.name} ({'from --preset' if args.preset else 'default for ' + device.type}), "
          f"device: {device}, torch {torch.__version__}")
    torch.manual_seed(args.seed)
    return preset, device, load_data(args.data)


def require_checks(checks):
    """Stop with one clear error, before anything is written, when a check ({name: ok}) failed."""
    failures = [name for name, ok in checks.items() if not ok]
    if failures:
        raise GPTliteError(f"checks failed: {'; '.join(failures)}; this is a bug (nothing written)")


def run(main):
    """Run a script's main(); our own errors are printed as one clear line, without a traceback."""
    try:
        main()
    except GPTliteError as e:
        sys.exit(f"error: {e}")


COLUMNS = [  # key, header, format
    ("variant", "variant", "{}"),
    ("ttft_ms", "TTFT ms", "{:.2f}"),  # one generation: prefill + the first token
    ("ttft_arrival_ms", "TTFT arrival ms", "{:.1f}"),  # serving: from the request's arrival, queueing included
    ("ttft_arrival_p99_ms", "p99", "{:.1f}"),
    ("tpot_ms", "TPOT ms", "{:.3f}"),
    ("tpot_p99_ms", "p99", "{:.3f}"),
    ("tokens_per_s", "tok/s", "{:.0f}"),
    ("peak_mem_mb", "peak MB", "{:.2f}"),
    ("kv_cache_mb", "KV MB", "{:.3f}"),
    ("val_loss", "val loss", "{:.4f}"),
]


def make_row(variant, **figures):
    """A result row with every standard column (None where a figure does not apply) plus extras."""
    row = {key: None for key, _, _ in COLUMNS}
    row.update(variant=variant, **figures)
    return row


def float_format(values):
    """One format for a column of numbers: as many decimals as its most precise value needs (at most
    4), so that 0.940 stands beside 0.938, not 0.94; integers as integers."""
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return "{}"
    decimals = max((len(f"{v:.4f}".rstrip("0").split(".")[1]) for v in values if math.isfinite(v)), default=0)
    return f"{{:.{decimals}f}}"


def table_columns(rows):
    """The printed columns: the standard ones that some row fills (TTFT ms, TPOT ms, ...), then every
    extra key in first-seen order; extra numbers get one format per column. [(key, header, format)]"""
    standard = {key for key, _, _ in COLUMNS}
    columns = [c for c in COLUMNS if c[0] == "variant" or any(r.get(c[0]) is not None for r in rows)]
    extras = dict.fromkeys(k for r in rows for k in r if k not in standard)
    for key in extras:
        numbers = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
        columns.append((key, key, float_format(numbers) if numbers else "{}"))
    return columns


def format_table(rows, untrained=False):
    columns = table_columns(rows)

    def cell(row, key, fmt):
        value = row.get(key)
        if value is None:
            return "-"
        text = fmt.format(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)
        return text + "*" if key == "val_loss" and untrained else text

    table = [[header for _, header, _ in columns]] + [[cell(r, k, f) for k, _, f in columns] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
             for line in table]
    lines.insert(1, "-" * len(lines[0]))
    if untrained:
        lines.append("* untrained weights (--untrained): loss figures are meaningless")
    return "\n".join(lines)


def print_table(rows, untrained=False):
    print(format_table(rows, untrained))


def strict_json(value):
    """`value` with every NaN or infinity replaced by None: JSON has no such numbers (json.dumps would
    write NaN/Infinity, which strict parsers reject)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def save_json(path, script, preset, device, rows, untrained=False, **extra):
    """Write the results as {"script", "preset", "device", "columns", "rows": [...]} (temp file, then
    rename): `columns` are the table's [key, header, format] as printed; strict JSON (no NaN)."""
    result = {"script": script, "preset": preset.name, "device": str(device), "untrained": untrained,
              "torch": torch.__version__, "preset_config": asdict(preset),
              "columns": [list(c) for c in table_columns(rows)], "rows": rows, **extra}
    text = json.dumps(strict_json(result), indent=2, allow_nan=False)
    atomic_write_bytes((text + "\n").encode(), path)
    print(f"wrote {path}")


def save_plot(fig, path):
    """Save a matplotlib figure as PNG (temp file, then rename)."""
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
    print(f"saved {path}")


def new_figure(n_axes=1):
    import matplotlib
    matplotlib.use("Agg")  # no screen needed
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, n_axes, figsize=(6 * n_axes, 4.2))
    return fig, axes
