"""Files that are never half written: atomic writes (temp file, then rename), the stale temp files of
killed writes, the output paths a script may write, and checkpoints (config, vocabulary, state dict and their sha256) verified when loaded."""
import contextlib
import glob
import hashlib
import json
import os
import pickle
import shlex
import subprocess
import sys
from pathlib import Path

import torch

from lib.errors import CheckpointError
from lib.presets import PRESETS

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT_DIR = ROOT / "checkpoints"


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


TEMP_SUFFIX = ".partial"  # a temp file is `.<target's name>.<pid>.partial`: a name no user picks


def temp_path(path, pid=None):
    """The temp file beside `path` that this process (or `pid`) writes before the rename."""
    return path.with_name(f".{path.name}.{os.getpid() if pid is None else pid}{TEMP_SUFFIX}")


def remove_stale_temps(path):
    """Remove the temp files beside `path` (`.<name>.<pid>.partial`) of processes that are gone (killed
    mid-write). Only that exact pattern for this target is touched: nothing a user named. A live process's
    temp file is kept: it may be writing the same path right now, and its rename must not fail. (Only on
    POSIX: on Windows os.kill(pid, 0) would send Ctrl+C, not check.)"""
    if os.name != "posix" or not path.parent.is_dir():
        return
    prefix = f".{path.name}."
    for tmp in path.parent.glob(f"{glob.escape(prefix)}*{TEMP_SUFFIX}"):
        pid = tmp.name[len(prefix):-len(TEMP_SUFFIX)]
        if pid.isdigit() and not pid_alive(int(pid)):
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
    tmp = temp_path(path)
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


CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt", ".safetensors", ".bin")


def tracked_files():
    """The repository's files under version control (README.md, docs/, the code), resolved: empty outside
    a git checkout or without git."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return set()
    return {(ROOT / name).resolve() for name in out.decode(errors="replace").split("\0") if name}


def output_problems(outputs, checkpoint_flags=()):
    """What is wrong with the paths a run would write, {flag: path}, found before any work: a path that is
    a folder, in a folder that is missing or cannot be written, a checkpoint (under checkpoints/, or with a
    checkpoint's suffix, unless its flag is in `checkpoint_flags`: --save writes one, never in checkpoints/),
    a file of the repository itself, or the path of another flag. Returns one message per problem."""
    problems, seen, tracked = [], {}, None
    for flag, out in outputs.items():
        path = Path(out).resolve()
        where = f"{flag} {out}"
        if path.is_dir() or not path.parent.is_dir():
            problems.append(f"{where}: give a file path in a folder that exists")
            continue
        if path in seen:
            problems.append(f"{where}: {seen[path]} writes the same file; give each output its own path")
            continue
        seen[path] = flag
        in_checkpoints = path.is_relative_to(CHECKPOINT_DIR.resolve())
        if in_checkpoints and flag in checkpoint_flags:
            problems.append(f"{where}: checkpoints/ holds the files the scripts train and load themselves; "
                            "save the model outside it (e.g. saved/model.pt)")
        elif flag not in checkpoint_flags and (in_checkpoints or path.suffix.lower() in CHECKPOINT_SUFFIXES):
            problems.append(f"{where}: that is a checkpoint's path, which results must not replace; "
                            "give another path")
        else:
            tracked = tracked_files() if tracked is None else tracked
            if path in tracked:
                problems.append(f"{where}: that is a file of the repository ({path.relative_to(ROOT.resolve())}); "
                                "give a path outside it, e.g. results/out.json")
            elif (error := unwritable(path.parent)) is not None:
                problems.append(f"{where}: the folder {path.parent} cannot be written ({error}); give another path")
    return problems


def unwritable(folder):
    """None when a file can be created in `folder` (a probe file, made and removed), else the reason."""
    probe = Path(folder) / f".gptlite-probe.{os.getpid()}{TEMP_SUFFIX}"
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        probe.unlink()
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


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
    except pickle.UnpicklingError:  # torch's message advises weights_only=False: never for a file of unknown origin
        raise CheckpointError(f"{path} is not a readable checkpoint: it is not a file of tensors and plain data that "
                              f"torch.save wrote (damaged, or it holds other objects, which are never loaded); "
                              f"{retrain}") from None
    except Exception as e:
        reason = str(e).splitlines()[0] if str(e) else ""
        raise CheckpointError(f"{path} is not a readable checkpoint ({type(e).__name__}: {reason}); {retrain}") from None
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


OUTPUT_FLAGS = ("--json", "--plot")  # where a script writes its results: nothing a trained file depends on


def without_output_flags(argv):
    """`argv` without --json PATH and --plot PATH (either spelling, `--json=PATH` too)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in OUTPUT_FLAGS:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in OUTPUT_FLAGS)):
            out.append(a)
    return out


def rebuild_command(script, argv, preset):
    """The shell command that reruns `script` with these flags (the preset named, the output paths left
    out): what rebuilds a file it saved."""
    argv = without_output_flags(sys.argv[1:] if argv is None else argv)
    if not any(a == "--preset" or a.startswith("--preset=") for a in argv):
        argv = ["--preset", preset.name] + argv
    return shlex.join(["python", script] + argv)

