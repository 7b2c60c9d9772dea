"""torch.distributed helpers shared by the multi-process scripts (main_tensor_parallel.py,
main_disaggregation.py, main_expert_parallel.py) and their tests. A script is launched by torchrun, which sets RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for every process:

    torchrun --nproc-per-node 2 main_tensor_parallel.py            # 2 processes on this machine
    python main_tensor_parallel.py                                 # 1 process, no torchrun needed

The API, small on purpose (everything else is plain torch.distributed):

    backend_for(device) -> "gloo" | "nccl"   gloo on CPU, NCCL on CUDA; a clear error when the
                                             device or the backend is not there (before any work)
    launched() -> bool                       True under torchrun (RANK and WORLD_SIZE are set)
    world_size() -> int                      torchrun's WORLD_SIZE, else 1 (readable before init)
    rank() -> int                            torchrun's RANK, else 0 (readable before init)
    init(device, timeout_s,                  join the process group (a group of one without
         startup_timeout_s) -> Dist          torchrun); Dist(rank, world_size, local_rank, device,
                                             backend); every rank waits up to startup_timeout_s for
                                             the others to join (rendezvous: one line that says what
                                             it waited for), then a collective that waits longer
                                             than timeout_s for a peer raises instead of hanging;
                                             what env:// lacks is refused first (environment_problem)
    watch_launcher()                         a rank ends itself when its launcher is gone (SIGKILL too)
    check_environment(parser)                what env:// lacks as a parser error, before any work
    shutdown()                               leave the process group (safe to call twice)
    new_group(ranks, timeout_s)              a subgroup whose collectives wait timeout_s too (torch's
                                             own default for a new group is 30 minutes)
    collective_errors(timeout_s,             a context manager: a failed collective (a peer died or
                      memory_hint)           timed out) becomes one clear GPTliteError; this rank's own
                                             out-of-memory error too (it says which flag to lower)
    launch(script, args, nproc, timeout_s,   run `python -m torch.distributed.run --standalone
           capture=True, env=None)           --nproc-per-node N script args` (what torchrun does) and
                                             return the CompletedProcess; a run past timeout_s is
                                             ended, with every worker, and raises GPTliteError
    relaunch(script, argv, nproc)            a script's own start under torchrun once its flags are
                                             checked (launch without a limit; a failed rank raises)
    rank_group(device, timeout_s,            a context manager: join the group (timeout_s bounds the
               memory_hint) -> Dist          start too), yield the Dist, only rank 0 prints,
                                             collective_errors around the block, leave
    add_rank_flags(parser, ranks, script)    a multi-process script's --ranks, --threads and --timeout;
    parse_ranks(parser, argv, ranks)         its args with args.world (torchrun's world, else --ranks),
                                             and check_ranks(parser, args, device) its cores and GPUs;
    setup(args, parser, check_args)          harness.setup run by the launcher and by every rank, only
                                             the ranks' rank 0 printing
    run_child(cmd, env, cwd, capture, ...)   run a command to its end in a session of its own; a
                                             SIGTERM, SIGINT or SIGHUP to this process, an exception
                                             or a timeout ends the command with every process it
                                             started (no orphans), then the signal takes its course;
                                             the child gets SIGKILL if this process dies (Linux)

Across machines, torchrun's rendezvous flags do the rest: see docs/distributed.md.
"""
import contextlib
import ctypes
import datetime
import functools
import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import inference_utils as iu
from lib import harness
from lib.errors import GPTliteError

DEFAULT_TIMEOUT_S = 60  # how long a collective waits for a peer before it fails
# How long a rank waits for the others to join the group: they start one after another (Python, torch,
# the data) and a busy 2-core machine takes tens of seconds for that; no correct start-up comes near it.
STARTUP_TIMEOUT_S = 600
GRACE_S = 10  # run_child: seconds between SIGTERM and SIGKILL when it ends a command's processes


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


def init(device="cpu", timeout_s=DEFAULT_TIMEOUT_S, startup_timeout_s=STARTUP_TIMEOUT_S):
    """Join the process group with the backend of `device`: under torchrun its world, else a group of
    one process (a HashStore: no port to open). On CUDA each process takes cuda:LOCAL_RANK.
    Two timeouts: every rank waits up to startup_timeout_s (at least timeout_s) for the last one to
    arrive (rendezvous), as the ranks start seconds apart on a busy machine; from then on joining,
    a collective or a point-to-point call waits timeout_s for a peer before it raises.
    Every check comes before the group is joined; under a launcher, a watch thread ends this process
    once its launcher is gone (watch_launcher). Returns a Dist."""
    problem = environment_problem()
    if problem:
        raise GPTliteError(problem)
    watch_launcher()
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
        if launched():  # env://: torchrun's MASTER_ADDR and MASTER_PORT, its store
            store, my_rank, world = rendezvous(max(timeout_s, startup_timeout_s))
            store.set_timeout(timeout)
            # what init_process_group does with env:// itself, every rank now at hand
            dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=my_rank,
                                    world_size=world, timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def new_group(ranks, timeout_s):
    """dist.new_group over `ranks` whose collectives wait timeout_s for a peer, like the default group's:
    torch gives a new group its own default of 30 minutes, so a barrier on it would wait that long for a
    silent peer instead of raising within --timeout. Every rank of the world calls it, in one order."""
    return dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=timeout_s))


def environment_problem():
    """Under a launcher (RANK and WORLD_SIZE set), what env:// also needs and does not find, as one line
    that says what to set (None when nothing is missing). torchrun sets all of it; a rank started by hand
    needs it too."""
    if not launched():
        return None
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        return (f"RANK and WORLD_SIZE are set but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: "
                "a rank started by hand needs MASTER_ADDR (the address of rank 0's machine) and MASTER_PORT (a free "
                "port there) as well, the same for every rank; or start the ranks with torchrun, which sets them all")
    try:
        rank_, world, port = (int(os.environ[name]) for name in ("RANK", "WORLD_SIZE", "MASTER_PORT"))
    except ValueError:
        values = ", ".join(f"{name}={os.environ[name]!r}" for name in ("RANK", "WORLD_SIZE", "MASTER_PORT"))
        return f"{values}: RANK, WORLD_SIZE and MASTER_PORT must be whole numbers"
    if not 0 <= rank_ < world:
        return f"RANK={rank_} with WORLD_SIZE={world}: RANK must be one of 0 .. WORLD_SIZE-1"
    if not 1 <= port <= 65535:
        return f"MASTER_PORT={port}: a port is a number from 1 to 65535"
    return None


def check_environment(parser):
    """environment_problem as a parser error: before any work, and before world_size() or rank() is read."""
    problem = environment_problem()
    if problem:
        parser.error(problem)


def rendezvous(timeout_s):
    """Meet the other ranks at MASTER_ADDR:MASTER_PORT (env://: rank 0 serves the key-value store), then
    wait until every rank has arrived (startup_barrier); all of it within timeout_s, or one GPTliteError
    that says what was awaited. A rank started by hand (not by torchrun) says first what it waits for.
    Returns torch's (store, rank, world size)."""
    me, world = rank(), world_size()
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    by_hand = "TORCHELASTIC_RUN_ID" not in os.environ  # torchrun starts every rank at once; by hand, they may be apart
    if by_hand:
        print(f"rank {me} of {world}: waiting up to {timeout_s} s for the {world} ranks to join at {where} "
              "(MASTER_ADDR:MASTER_PORT)", file=sys.stderr, flush=True)
    deadline = time.monotonic() + timeout_s
    try:
        if by_hand and me != 0:
            wait_for_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), deadline)
        timeout = datetime.timedelta(seconds=max(1.0, deadline - time.monotonic()))
        store, my_rank, world = next(dist.rendezvous("env://", timeout=timeout))
        startup_barrier(store, world, timeout)
    except (RuntimeError, ValueError, OSError) as e:  # DistError is a RuntimeError: a timeout, a refused connection
        first = (str(e).strip().splitlines() or [""])[0][:200]
        if "address already in use" in first.lower():
            raise GPTliteError(f"rank 0 of {world}: another process already listens on {where}, where rank 0 serves "
                               "the ranks' key-value store; give every rank another MASTER_PORT") from None
        awaited = (f"the other {world - 1} rank(s) did not all join it" if me == 0 else
                   "rank 0 (which serves it) did not answer, or the other ranks did not all join")
        raise GPTliteError(f"rank {me} of {world}: waited {timeout_s} s at {where} (MASTER_ADDR:MASTER_PORT) and "
                           f"{awaited} ({type(e).__name__}: {first}); start every rank 0 .. {world - 1} with the "
                           "same MASTER_ADDR, MASTER_PORT and WORLD_SIZE, or raise --timeout") from None
    return store, my_rank, world


def wait_for_store(address, port, deadline):
    """Until the monotonic `deadline`, try to reach rank 0's key-value store at address:port; a TimeoutError
    when it never answers. (torch's own client retries too, but logs a C++ stack trace at each try.)"""
    while True:
        try:
            socket.create_connection((address, port), timeout=1).close()
            return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no answer from {address}:{port} ({e.strerror or e})") from None
            time.sleep(0.2)


def startup_barrier(store, world, timeout):
    """Wait, up to `timeout`, until all `world` ranks have arrived, on torchrun's key-value store: the
    group is then joined by ranks that are all there, so its own timeout (a collective's) is not spent
    on one that is still importing torch. Its keys are those of this launch (torchrun's restart count)."""
    barrier = dist.PrefixStore(f"gptlite_startup_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    barrier.set_timeout(timeout)
    if barrier.add("arrived", 1) == world:
        barrier.set("all", "1")
    barrier.wait(["all"])


LAUNCHER_PID = "GPTLITE_LAUNCHER_PID"  # set by launch() for the ranks it starts: the process they watch
WATCH_S = 0.5  # how often a rank looks whether its launcher is still there


def watch_launcher():
    """Start (once per process) a daemon thread that ends this rank when the process that launched it is
    gone, SIGKILL included, where no signal handler runs: the launch() caller (LAUNCHER_PID), else this
    process's parent when that is torchrun (started by hand). torchrun starts each rank in a session of
    its own, so nothing else would end it: it would run on, its parent now PID 1. A rank started by hand
    without torchrun is left alone (its parent is a shell, which nohup may outlive on purpose)."""
    if not launched() or any(t.name == "gptlite-launcher-watch" for t in threading.enumerate()):
        return
    if LAUNCHER_PID in os.environ:
        pid = int(os.environ[LAUNCHER_PID])
    elif "TORCHELASTIC_RUN_ID" in os.environ:
        pid = os.getppid()
    else:
        return
    start = _start_time(pid)

    def watch():
        while _start_time(pid) == start is not None:
            time.sleep(WATCH_S)
        with contextlib.suppress(OSError):
            print(f"rank {rank()}: its launcher (pid {pid}) is gone; this rank stops too", file=sys.stderr, flush=True)
        os._exit(1)  # from this thread: the main thread may be waiting in a collective that never returns
    threading.Thread(target=watch, name="gptlite-launcher-watch", daemon=True).start()


def _start_time(pid):
    """The start time of the running process `pid` (a zombie has ended), None when there is none; where
    there is no /proc (not Linux), 0 while a signal can reach it."""
    try:
        stat = _stat(pid)
    except OSError:  # no /proc here
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return 0
    return None if stat is None or stat[2] in "ZX" else stat[1]


def shutdown():
    if dist.is_initialized():
        dist.destroy_process_group()


TORCH_DISTRIBUTED = Path(dist.__file__).resolve().parent  # where torch.distributed's Python code lives


def out_of_memory(e):
    """True for a failed allocation: Python's MemoryError, torch's OutOfMemoryError (CUDA) and the
    RuntimeError of torch's CPU allocator ("DefaultCPUAllocator: can't allocate memory")."""
    if isinstance(e, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())


def raised_by_torch_distributed(e):
    """True when `e` came out of a torch.distributed call: a DistError, or an error whose innermost
    frame is torch.distributed's code (gloo's "Connection closed by peer" and "Timed out waiting" are
    plain RuntimeErrors raised there). An error of this process's own code, the model's say, is not."""
    if isinstance(e, dist.DistError):
        return True
    tb = e.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(TORCH_DISTRIBUTED)


@contextlib.contextmanager
def collective_errors(timeout_s=DEFAULT_TIMEOUT_S, memory_hint=None):
    """Say which rank failed and how when the block raises:
    - this rank ran out of memory (out_of_memory): one GPTliteError that says so, that it is this
      rank's own error and not a peer's, and `memory_hint` (what to lower, e.g. "lower --batch-size");
    - a torch.distributed call failed (raised_by_torch_distributed): one GPTliteError, a peer process
      died (its connection closed) or did not answer within timeout_s;
    - any other error is this rank's own: it goes on unchanged, its traceback with a note naming the rank.
    The other ranks then see this one as a peer that died; torchrun's summary names the rank that
    failed first (Root Cause)."""
    try:
        yield
    except GPTliteError:
        raise
    except Exception as e:  # noqa: BLE001  (sorted below; everything not converted is re-raised as it is)
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
        first = (str(e).strip().splitlines() or [""])[0][:300]
        what = type(e).__name__ + (f": {first}" if first else "")
        if out_of_memory(e):
            raise GPTliteError(f"rank {rank} ran out of memory ({what}); this is its own error, not a peer's: "
                               f"{memory_hint or 'run a smaller workload'}") from None
        if raised_by_torch_distributed(e):
            text = str(e).lower()
            if "timed out" in text or "timeout" in text:
                cause = f"a peer process did not answer within {timeout_s} s (stuck, or slower than that)"
            elif any(word in text for word in ("closed", "reset", "broken pipe", "connection refused")):
                cause = "a peer process died (it closed its connection)"
            else:
                cause = f"a peer process died or did not answer within {timeout_s} s"
            raise GPTliteError(f"rank {rank}: a torch.distributed call failed: {cause} ({what}); torchrun's "
                               "summary names the rank that failed first (Root Cause) and its own error is "
                               "printed above it") from None
        e.add_note(f"(raised on rank {rank} by its own code, not by a peer)")
        raise


def launch(script, args=(), nproc=2, timeout_s=120, capture=True, env=None, cwd=None, monitor_s=None):
    """Run `script` on `nproc` local processes with torchrun (`python -m torch.distributed.run
    --standalone`: a free port, no other setup) and return the CompletedProcess (stdout and stderr as
    text when `capture`, else they go to this process's). A run that exceeds `timeout_s` (None: no
    limit) is ended with all its workers and raises GPTliteError; so is a run whose launcher gets
    SIGTERM, SIGINT or SIGHUP, after which the signal takes its course (run_child). The workers run
    in `cwd` (default: this process's), so relative paths in `args` mean what they meant here. Each
    worker gets OMP_NUM_THREADS=1 unless `env` or the environment sets it. (torchrun's parser reads the
    script's flags too: a flag that abbreviates one of torchrun's, such as --nproc, is refused as
    ambiguous.) monitor_s: how often torchrun looks at its workers (None: its default, a fraction of a second);
    a longer one leaves a rank that outlives a dead peer the time to say so before torchrun ends it."""
    monitor = ["--monitor-interval", str(monitor_s)] if monitor_s is not None else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *monitor,
           str(Path(script).resolve()), *map(str, args)]  # relative paths in `args` stay the caller's
    full_env = {"OMP_NUM_THREADS": "1", **os.environ, **(env or {}), LAUNCHER_PID: str(os.getpid())}
    try:
        return run_child(cmd, env=full_env, cwd=cwd, capture=capture, timeout_s=timeout_s)
    except subprocess.TimeoutExpired as e:
        tail = "\n".join((e.stderr or "").strip().splitlines()[-5:])
        message = (f"{Path(script).name} on {nproc} processes did not finish within {timeout_s} s and was "
                   "killed (a rank stuck waiting for a peer?)")
        raise GPTliteError(message + (f"; last lines:\n{tail}" if tail else "")) from None


# ----------------------------------------------------------------------------------------------------
# Running a command without leaving orphans.

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name))


def relaunch(script, argv, nproc):
    """Start `nproc` ranks of `script` under torchrun with the same flags (`argv`, None: sys.argv's), as
    a script does once it has checked them; each rank then sees launched(). A failed rank raises one
    GPTliteError that points at its traceback, which torchrun prints above."""
    rc = launch(script, sys.argv[1:] if argv is None else argv, nproc, timeout_s=None, capture=False).returncode
    if rc != 0:
        raise GPTliteError(f"torchrun exited with code {rc}: the failing rank's error is above "
                           "(torchrun's summary names it)")


def rank0_speaks():
    """A context in which only rank 0's stdout is shown (every rank computes the same report)."""
    return contextlib.nullcontext() if rank() == 0 else contextlib.redirect_stdout(io.StringIO())


@contextlib.contextmanager
def rank_group(device, timeout_s=DEFAULT_TIMEOUT_S, memory_hint=None):
    """The body of a multi-process script: join the process group (init), yield the Dist with only rank
    0 printing and every failure named (collective_errors), then leave the group."""
    with rank0_speaks():
        d = init(device, timeout_s, startup_timeout_s=timeout_s)  # the script's --timeout bounds the start too
        with collective_errors(timeout_s, memory_hint):
            yield d
    shutdown()


def run_ranks(script, argv, parse_args, experiment, memory_hint):
    """The main of a multi-process script: every flag checked first, parse_args(argv) -> (args, preset, device,
    data); then with args.world > 1 and not yet under torchrun, start the ranks (relaunch); on each rank, join
    the group (rank_group), take args.threads threads and run experiment(args, preset, d, data), d the rank's
    Dist."""
    args, preset, device, data = parse_args(argv)
    if args.world > 1 and not launched():
        return relaunch(script, argv, args.world)
    with rank_group(device, args.timeout, memory_hint=memory_hint) as d:
        torch.set_num_threads(args.threads)
        experiment(args, preset, d, data)


def report(args, script, preset, d, rows, headline, summary, plot, **extra):
    """harness.report of a rank's rows, its JSON with the world it ran on (world_size, backend, threads)."""
    harness.report(args, script, preset, d.device, rows, headline, summary=summary, plot=plot,
                   world_size=d.world_size, backend=d.backend, threads=args.threads, **extra)


# ----------------------------------------------------------------------------------------------------
# The flags of a multi-process script (main_tensor_parallel.py and its kin).

def script_parser(doc, ranks, script):
    """harness.script_parser with the rank flags (add_rank_flags)."""
    parser = harness.script_parser(doc)
    add_rank_flags(parser, ranks, script)
    return parser


def add_rank_flags(parser, ranks, script):
    """--ranks (default `ranks`), --threads and --timeout."""
    parser.add_argument("--ranks", type=harness.int_at_least(1), default=ranks,
                        help="processes on this machine: with N > 1 the script starts itself under torchrun "
                             f"(= torchrun --nproc-per-node N {script}); under torchrun: its world size")
    parser.add_argument("--threads", type=harness.thread_count, default=1,
                        help="torch threads per rank (and of the one-process baseline)")
    parser.add_argument("--timeout", type=harness.int_at_least(1, 3600), default=DEFAULT_TIMEOUT_S,
                        help="seconds a rank waits for a peer in a collective before it stops with an error")


def parse_ranks(parser, argv, ranks):
    """parser.parse_args(argv) with args.world: torchrun's world size under torchrun (a --ranks other than the
    default `ranks` that differs from it is an error), else --ranks."""
    args = parser.parse_args(argv)
    check_environment(parser)
    args.world = world_size() if launched() else args.ranks
    if launched() and args.ranks not in (ranks, args.world):
        parser.error(f"--ranks {args.ranks} differs from torchrun's {args.world} processes; give one or the other")
    return args


def check_ranks(parser, args):
    """The ranks of this machine x --threads fit its cores (the one-process baseline runs that many threads
    too), and on CUDA each rank has a GPU: a parser error before any work."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", args.world))  # the ranks on this machine
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if local * args.threads > cores:
        parser.error(f"{local} rank(s) x --threads {args.threads} exceed the {cores} CPU cores this process may use: "
                     "the timings would measure threads waiting for a core; lower --threads or --ranks")
    device = harness.get_device(args.device)
    if device.type == "cuda" and args.world > torch.cuda.device_count():
        parser.error(f"{args.world} processes need {args.world} CUDA devices on this machine (NCCL: one GPU per "
                     f"rank); it has {torch.cuda.device_count()}")


def round_robin(variants, rank, device, repeats):
    """Time the variants of a multi-process script round-robin (iu.time_round_robin, a warm-up round first):
    {name: (ranks, threads, fn)}. Every rank starts each variant together (a barrier); the ranks below
    `ranks` run fn() with `threads` threads (timed inside fn), the others go on to the next barrier.
    Returns {name: [this rank's fn() results]}, the warm-up's left out (none on a rank outside the variant)."""
    samples = {name: [] for name in variants}

    def one(name, ranks, threads, fn):
        dist.barrier()
        if rank < ranks:
            torch.set_num_threads(threads)
            samples[name].append(fn())
    iu.time_round_robin({name: functools.partial(one, name, *v) for name, v in variants.items()}, device, warmup=1,
                        repeats=repeats)
    dist.barrier()
    return {name: runs[1:] for name, runs in samples.items()}


def setup(args, parser, check_args):
    """harness.setup in a multi-process script: the launcher checks every flag (then starts torchrun) and each
    rank checks them again; only the ranks' rank 0 prints. Returns (preset, device, data)."""
    launcher = args.world > 1 and not launched()
    quiet = launcher or launched() and rank() != 0
    with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
        return harness.setup(args, parser, check_args)


class _Stopped(BaseException):
    """Raised in run_child's wait by the first stop signal."""


class _StopSignals:
    """While the command runs: SIGTERM, SIGINT and SIGHUP are recorded in `received`, and the first one
    raises _Stopped once `armed` (the child exists). Installed in the main thread only (Python's rule),
    never for a signal this process ignores (a background job's SIGINT, nohup's SIGHUP)."""

    def __init__(self):
        self.received, self.armed, self.previous = [], False, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                handler = signal.getsignal(sig)
                if handler is not signal.SIG_IGN:
                    self.previous[sig] = signal.SIG_DFL if handler is None else handler
                    signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.received.append(signum)
        if self.armed and len(self.received) == 1:  # later signals wait for the clean-up under way
            self.armed = False
            raise _Stopped(signum)

    def arm(self):
        self.armed = True
        if self.received:  # one came while the child was starting
            self.armed = False
            raise _Stopped(self.received[0])

    def __exit__(self, *exc):
        self.armed = False
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _stat(pid):
    """(parent pid, start time, state) of process `pid`, read from /proc (Linux); None when there is none.
    An OSError other than FileNotFoundError means that there is no /proc to read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:  # no such process (it ended meanwhile)
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (command)": state, ppid, ...
    return int(fields[1]), int(fields[19]), fields[0]


def _process_table():
    """{pid: (parent pid, start time, state)} of every process, read from /proc (Linux); {} elsewhere."""
    table = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit() and (stat := _stat(entry.name)):
                table[int(entry.name)] = stat
    return table


def _descendants(pids, table):
    """{pid: start time} of every process below `pids` in `table`."""
    children = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, list(pids)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found[child] = table[child][1]
                todo.append(child)
    return found


def end_process_tree(proc, grace_s=GRACE_S):
    """End the Popen `proc` (started with start_new_session=True), its process group and every process
    descended from it, even those in sessions of their own (torchrun starts each worker so): SIGTERM
    once to each, SIGKILL to whatever is alive `grace_s` seconds later; then reap `proc`. Descendants
    are remembered from the first look on, so that those re-parented when their parent ends are still
    reached. Without /proc (not Linux) only the child's process group is."""
    known, terminated = {}, set()  # pid -> start time: a pid is signalled only while it is that process

    def send(pid, sig, group=False):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            (os.killpg if group else os.kill)(pid, sig)

    def living(table):  # the known processes still running (a zombie has ended)
        return [pid for pid, start in known.items() if pid in table and table[pid][1] == start and table[pid][2] != "Z"]

    deadline = time.monotonic() + grace_s
    while True:
        table = _process_table()
        running = proc.poll() is None  # not reaped yet: its pid is still its own and its group's id
        for pid, start in _descendants([proc.pid] * running + living(table), table).items():
            known.setdefault(pid, start)
        alive = living(table)
        if not running and not alive:
            break
        if time.monotonic() >= deadline:
            if running:
                send(proc.pid, signal.SIGKILL, group=True)
            for pid in alive:
                send(pid, signal.SIGKILL)
            break
        if running and proc.pid not in terminated:
            send(proc.pid, signal.SIGTERM, group=True)
            terminated.add(proc.pid)
        for pid in alive:
            if pid not in terminated:
                send(pid, signal.SIGTERM)
                terminated.add(pid)
        time.sleep(0.05)
    proc.wait()


def _die_with(parent):
    """On Linux, a preexec_fn that has the kernel SIGKILL the child when `parent` dies, SIGKILL
    included (prctl PR_SET_PDEATHSIG: what no signal handler of the parent can do); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it

    def preexec():
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)
    return preexec


def run_child(cmd, env=None, cwd=None, capture=False, stdout=None, stderr=None, timeout_s=None, grace_s=GRACE_S):
    """Run the command `cmd` (a list: program and arguments) to its end; return the CompletedProcess.

    env: the child's whole environment (None: this process's); cwd: its directory (None: this one's);
    capture: stdout and stderr as text in the result; else they go to `stdout` and `stderr` (an open
    file, or None: this process's own). stdin is /dev/null.

    The child runs in a session of its own (a Ctrl+C in the terminal reaches this process only), and it
    never outlives this call: on SIGTERM, SIGINT or SIGHUP to this process, on any exception while it
    waits, and after `timeout_s` seconds (None: no limit), end_process_tree ends the child with every
    process it started (SIGTERM, SIGKILL after `grace_s`). Then a timeout raises
    subprocess.TimeoutExpired (with the output captured so far), an exception goes on, and a signal is
    raised again under this process's previous handler: by default SIGTERM and SIGHUP end the process
    with that signal's status (143 and 129 in a shell) and SIGINT raises KeyboardInterrupt, as if no child
    had been running; a handler that returns makes run_child return the ended child's CompletedProcess."""
    if capture and (stdout is not None or stderr is not None):
        raise ValueError("run_child: give either capture=True or stdout/stderr, not both")
    cmd = [str(c) for c in cmd]
    if capture:
        stdout = stderr = subprocess.PIPE
    signals, proc, output = _StopSignals(), None, (None, None)
    try:
        with signals:
            try:
                proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, text=capture,
                                        env=env, cwd=cwd, start_new_session=True, preexec_fn=_die_with(os.getpid()))
                signals.arm()
                output = proc.communicate(timeout=timeout_s)
                signals.armed = False
            except _Stopped:
                end_process_tree(proc, grace_s)
                with contextlib.suppress(ValueError, OSError):  # what the interrupted read had left
                    output = proc.communicate()
            except subprocess.TimeoutExpired:
                signals.armed = False
                end_process_tree(proc, grace_s)
                output = proc.communicate()
                raise subprocess.TimeoutExpired(cmd, timeout_s, *output) from None
            except BaseException:
                signals.armed = False
                if proc is not None:
                    end_process_tree(proc, grace_s)
                raise
    finally:  # the handlers are restored: a signal that came now takes its usual course
        if signals.received:
            signal.raise_signal(signals.received[0])
    return subprocess.CompletedProcess(cmd, proc.returncode, *output)
