"""torch.distributed helpers shared by the multi-process scripts (main_tensor_parallel.py,
main_disaggregation.py) and their tests. A script is launched by torchrun, which sets RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for every process:

    torchrun --nproc-per-node 2 main_tensor_parallel.py            # 2 processes on this machine
    python main_tensor_parallel.py                                 # 1 process, no torchrun needed

The API, small on purpose (everything else is plain torch.distributed):

    backend_for(device) -> "gloo" | "nccl"   gloo on CPU, NCCL on CUDA; a clear error when the
                                             device or the backend is not there (before any work)
    launched() -> bool                       True under torchrun (RANK and WORLD_SIZE are set)
    world_size() -> int                      torchrun's WORLD_SIZE, else 1 (readable before init)
    rank() -> int                            torchrun's RANK, else 0 (readable before init)
    init(device, timeout_s) -> Dist          join the process group (a group of one without
                                             torchrun); Dist(rank, world_size, local_rank, device,
                                             backend); a collective that waits longer than timeout_s
                                             for a peer raises instead of hanging
    shutdown()                               leave the process group (safe to call twice)
    collective_errors(timeout_s)             a context manager: a failed collective (a peer died or
                                             timed out) becomes one clear GPTliteError
    launch(script, args, nproc, timeout_s,   run `python -m torch.distributed.run --standalone
           capture=True, env=None)           --nproc-per-node N script args` (what torchrun does) and
                                             return the CompletedProcess; a run past timeout_s is
                                             killed, with every worker, and raises GPTliteError

Across machines, torchrun's rendezvous flags do the rest: see docs/distributed.md.
"""
import contextlib
import datetime
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from lib.errors import GPTliteError

DEFAULT_TIMEOUT_S = 60  # how long a collective waits for a peer before it fails


@dataclass(frozen=True)
class Dist:
    rank: int            # this process, 0 .. world_size - 1
    world_size: int      # processes in the group
    local_rank: int      # this process on its machine (its GPU index on CUDA)
    device: torch.device
    backend: str         # "gloo" or "nccl"


def backend_for(device):
    """gloo for CPU tensors, NCCL for CUDA tensors; a clear error when CUDA or NCCL is missing."""
    device = torch.device(device)
    if device.type == "cpu":
        if not dist.is_gloo_available():
            raise GPTliteError("this PyTorch build has no gloo backend, which torch.distributed needs on CPU; "
                               "install a standard PyTorch wheel")
        return "gloo"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise GPTliteError(f"device {device} asks for CUDA and the NCCL backend, but this machine has no CUDA "
                               "device; run on CPU (--device cpu: the gloo backend)")
        if not dist.is_nccl_available():
            raise GPTliteError("this PyTorch build has no NCCL backend, which torch.distributed needs on CUDA; "
                               "install a CUDA build of PyTorch, or run on CPU (--device cpu: gloo)")
        return "nccl"
    raise GPTliteError(f"device {device}: torch.distributed is used here on cpu (gloo) or cuda (NCCL) only")


def launched():
    """True when torchrun (or another launcher) set RANK and WORLD_SIZE for this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def world_size():
    """The number of processes torchrun started (1 without torchrun), known before init."""
    return int(os.environ["WORLD_SIZE"]) if launched() else 1


def rank():
    """This process's rank as torchrun set it (0 without torchrun), known before init."""
    return int(os.environ["RANK"]) if launched() else 0


def init(device="cpu", timeout_s=DEFAULT_TIMEOUT_S):
    """Join the process group with the backend of `device`: under torchrun its world, else a group of
    one process (a HashStore: no port to open). On CUDA each process takes cuda:LOCAL_RANK.
    Every check comes before the group is joined. Returns a Dist."""
    device = torch.device(device)
    backend = backend_for(device)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise GPTliteError(f"local rank {local_rank} needs cuda:{local_rank}, but this machine has "
                               f"{torch.cuda.device_count()} CUDA device(s); start at most that many processes "
                               "per machine (--nproc-per-node)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        if launched():
            dist.init_process_group(backend, timeout=timeout)  # env://: torchrun's MASTER_ADDR, MASTER_PORT
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def shutdown():
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def collective_errors(timeout_s=DEFAULT_TIMEOUT_S):
    """Turn the error of a failed collective or point-to-point call (a peer that died, or did not answer
    within timeout_s) into one GPTliteError that says what happened and where to look."""
    try:
        yield
    except (RuntimeError, dist.DistError) as e:  # DistBackendError, gloo's "Connection closed by peer", ...
        if isinstance(e, GPTliteError):
            raise
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise GPTliteError(f"rank {rank}: a torch.distributed call failed: a peer process died or did not answer "
                           f"within {timeout_s} s ({type(e).__name__}: {first}); torchrun's summary names the rank "
                           "that failed first (Root Cause) and its own error is printed above it") from None


def launch(script, args=(), nproc=2, timeout_s=120, capture=True, env=None, cwd=None):
    """Run `script` on `nproc` local processes with torchrun (`python -m torch.distributed.run
    --standalone`: a free port, no other setup) and return the CompletedProcess (stdout and stderr as
    text when `capture`, else they go to this process's). A run that exceeds `timeout_s` (None: no
    limit) is killed with all its workers and raises GPTliteError. The workers run in `cwd` (default:
    this process's), so relative paths in `args` mean what they meant here. Each worker gets
    OMP_NUM_THREADS=1 unless `env` or the environment sets it. (torchrun's parser reads the script's
    flags too: a flag that abbreviates one of torchrun's, such as --nproc, is refused as ambiguous.)"""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(Path(script).resolve()), *map(str, args)]  # relative paths in `args` stay the caller's
    full_env = {"OMP_NUM_THREADS": "1", **os.environ, **(env or {})}
    pipe = subprocess.PIPE if capture else None
    # a session of its own: on a timeout the whole process group (torchrun and its workers) is killed
    with subprocess.Popen(cmd, stdout=pipe, stderr=pipe, stdin=subprocess.DEVNULL, text=True, env=full_env,
                          cwd=cwd, start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            tail = "\n".join((stderr or "").strip().splitlines()[-5:])
            message = (f"{Path(script).name} on {nproc} processes did not finish within {timeout_s} s and was "
                       "killed (a rank stuck waiting for a peer?)")
            raise GPTliteError(message + (f"; last lines:\n{tail}" if tail else ""))
        except BaseException:  # Ctrl+C: do not leave workers behind
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
