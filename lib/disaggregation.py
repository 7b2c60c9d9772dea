"""Disaggregated serving: prefill on one worker, decode on another, the KV cache handed over with
torch.distributed point-to-point calls (DistServe, Splitwise).

Blog section: "Prefill-decode disaggregation". Two ranks of one process group:
- the prefill worker (rank 0) runs the paged engine's Scheduler and ModelRunner on whole prompts
  only: every request is a Sequence of one token (its first); after the step that computes a prompt,
  its keys and values are gathered out of the pool through its block table, [2, L, P, H, D], and sent
  to the decode worker with the first token (dist.send: a header, then the payload);
- the decode worker (rank 1) runs the paged engine's continuous-batching loop; a receiving thread
  takes each request's header and payload off the wire, and the loop inserts the request's blocks
  into its own pool (`admit_prefilled`: blocks allocated, keys and values written to their slots,
  the sequence running with its first token) so that its next step is a decode step. Decode steps
  never wait for a prefill: no prompt is ever computed there (unless a transfer failed, below).

A failed transfer is never lost. The header carries a checksum of the payload (the sum of its 32-bit
words); a payload that arrives with another sum is dropped, and the decode worker recomputes the
request from its prompt, as the paged engine recomputes a preempted sequence (Scheduler.waiting).
A peer that dies or stops answering makes the other rank's dist.send / dist.recv fail within the
process group's timeout, one clear error (distributed.collective_errors), never a hang.

The clock. Two processes cannot share serving.ServingClock's simulated clock, so both variants run on
the wall clock (`LiveClock`, a ServingClock): every rank starts its clock as it leaves a barrier (the
two clocks agree up to the ranks' exit skew, not measured here), a request is admitted once its
arrival time has passed, an idle worker sleeps until the next arrival. A request's first token is stamped when the decode worker takes it off the wire (the client gets it from there),
so TTFT includes the transfer. Figures come from serving.latency_figures.
"""
import queue
import threading
import time
from collections import deque
from contextlib import contextmanager

import torch
import torch.distributed as dist

import inference_utils as iu
from lib import serving
from lib.errors import GPTliteError
from lib.paged_engine import BlockManager, ModelRunner, Scheduler, Sequence, admit_arrivals

PREFILL_RANK, DECODE_RANK = 0, 1
HEADER_TAG, PAYLOAD_TAG = 0, 1  # messages of one tag arrive in the order they were sent


class LiveClock(serving.ServingClock):
    """serving.ServingClock on the wall clock, started at construction: arrivals are real times since
    the start, an idle engine sleeps until the next arrival, each token is stamped with the time its
    step ended."""

    def __init__(self, arrivals, n_tokens, device="cpu"):
        super().__init__(arrivals, n_tokens, device)
        self.t0 = time.perf_counter()

    def elapsed(self):
        return time.perf_counter() - self.t0

    def arrived(self, i):
        self.now = self.elapsed()
        return super().arrived(i)

    def wait_for(self, i):
        time.sleep(max(0.0, self.arrivals[i] - self.elapsed()))
        self.now = self.elapsed()

    @contextmanager
    def step(self, rows):
        with super().step(rows):  # busy time and step count as ServingClock's
            yield
        self.now = self.elapsed()


def makespan_throughput(clock):
    """New tokens per second from the first arrival (time 0) to the last token: the same yardstick for
    one engine and for two workers whose busy times overlap."""
    return sum(clock.n_tokens) / max(clock.last)


def checksum(payload):
    """The sum of the payload's 32-bit words (int64): any changed word changes it."""
    return int(payload.contiguous().view(-1).view(torch.int32).sum(dtype=torch.int64))


def kv_of(runner, block_manager, seq, n_tokens):
    """The keys and values of the sequence's first n_tokens tokens, out of the pool through its block
    table: [2, L, n_tokens, H, D] (a copy)."""
    slots = torch.tensor(block_manager.slots(seq.seq_id, 0, n_tokens), device=runner.k_pool.device)
    return torch.stack([runner.k_pool[:, slots], runner.v_pool[:, slots]])


def admit_prefilled(scheduler, runner, seq, payload):
    """Insert a sequence whose prompt was computed elsewhere (payload [2, L, P, H, D], its first token
    in seq.output) into the pool: blocks for its P tokens, keys and values written to their slots, the
    sequence running, so that its next step is a decode step. False when no batch slot or too few
    free blocks (try again after a step)."""
    bm, P = scheduler.block_manager, payload.shape[2]
    if len(scheduler.running) >= scheduler.max_seqs or bm.blocks_for(P) > bm.n_free:
        return False
    bm.grow(seq.seq_id, P)
    slots = torch.tensor(bm.slots(seq.seq_id, 0, P), device=runner.k_pool.device)
    runner.k_pool[:, slots] = payload[0]
    runner.v_pool[:, slots] = payload[1]
    seq.n_computed = P
    scheduler.running.append(seq)
    return True


def engine_parts(model, n_blocks, block_size, max_seqs, chunk_size=None):
    """The paged engine's block manager, scheduler and model runner (paged_engine.py), unchanged."""
    bm = BlockManager(n_blocks, block_size)
    return Scheduler(bm, max_seqs, chunk_size), ModelRunner(model, n_blocks, block_size)


# ----------------------------------------------------------------------------------------------------
# The prefill worker.

def send_prefilled(seq_id, first_token, payload, dst, corrupt=False):
    """Header [seq_id, P, first token, checksum], then the payload; returns the seconds the sends took.
    `corrupt`: a test's fault, one word of the payload changed after its checksum was taken."""
    header = torch.tensor([seq_id, payload.shape[2], first_token, checksum(payload)], device=payload.device)
    if corrupt:
        payload = payload.clone()
        payload.view(-1)[0] += 1.0
    with iu.Timer() as sending:
        dist.send(header, dst, tag=HEADER_TAG)
        dist.send(payload, dst, tag=PAYLOAD_TAG)
    return sending.seconds


@torch.inference_mode()
def serve_prefill(model, requests, clock, n_blocks, block_size, max_seqs, dst=DECODE_RANK, corrupt=()):
    """Prefill every request's prompt as it arrives and send its KV cache and first token to `dst`.
    Returns {"send_s": [seconds per request], "kv_bytes": [payload bytes per request]}."""
    scheduler, runner = engine_parts(model, n_blocks, block_size, max_seqs)
    seqs = [Sequence(i, prompt.tolist(), 1) for i, (prompt, _) in enumerate(requests)]  # prefill: one token
    pending = deque(sorted(seqs, key=lambda s: clock.arrivals[s.seq_id]))
    stats = {"send_s": [0.0] * len(seqs), "kv_bytes": [0] * len(seqs)}
    while pending or scheduler.waiting or scheduler.running:
        if not admit_arrivals(pending, scheduler, clock):
            continue
        with clock.step(rows=0):
            batch = scheduler.schedule()
            next_tokens = runner.run(batch, scheduler.block_manager).tolist()
            prefilled = [(seq, token, kv_of(runner, scheduler.block_manager, seq, len(seq.prompt)))
                         for (seq, n), token in zip(batch, next_tokens) if seq.n_computed + n == len(seq.prompt)]
            scheduler.update(batch, next_tokens)  # frees their blocks: each sequence wanted one token
        for seq, token, payload in prefilled:
            stats["send_s"][seq.seq_id] = send_prefilled(seq.seq_id, token, payload, dst, seq.seq_id in corrupt)
            stats["kv_bytes"][seq.seq_id] = payload.nbytes
    return stats


# ----------------------------------------------------------------------------------------------------
# The decode worker.

def start_receiver(model, requests, src=PREFILL_RANK):
    """A thread that takes every request's header and payload off the wire into a queue, in the order
    sent: (seq_id, first token, payload or None if its checksum failed); an exception if a receive
    failed (a dead or silent peer). gloo's irecv reports completion only when waited on, hence a thread."""
    inbox = queue.Queue()
    config, weight = model.config, model.fc_out.weight
    L, H, D = config.n_layers, config.n_heads, config.d_head

    def receive():
        try:
            for _ in requests:
                header = torch.zeros(4, dtype=torch.long, device=weight.device)
                dist.recv(header, src, tag=HEADER_TAG)
                seq_id, P, token, expected = header.tolist()
                payload = torch.empty(2, L, P, H, D, dtype=weight.dtype, device=weight.device)
                dist.recv(payload, src, tag=PAYLOAD_TAG)
                inbox.put((seq_id, token, payload if checksum(payload) == expected else None))
        except Exception as e:  # noqa: BLE001  (handed to the serving loop, which raises it)
            inbox.put(e)

    threading.Thread(target=receive, daemon=True, name="kv-receiver").start()
    return inbox


def take(inbox, block, timeout_s):
    """The next message, or None when none is there (block: wait up to timeout_s for one)."""
    try:
        message = inbox.get(timeout=timeout_s) if block else inbox.get_nowait()
    except queue.Empty:
        if block:  # the receiving thread's own timeout normally fires first, with the cause
            raise GPTliteError(f"rank {dist.get_rank()}: no KV transfer arrived within {timeout_s} s and the "
                               "prefill worker reported nothing; is it alive?") from None
        return None
    if isinstance(message, Exception):
        raise message
    return message


@torch.inference_mode()
def serve_decode(model, requests, clock, n_blocks, block_size, max_seqs, timeout_s, src=PREFILL_RANK):
    """Decode every request whose KV cache arrives from `src`; a payload whose checksum failed is
    recomputed here from its prompt. Returns (outputs, stats): outputs[i] is request i's prompt followed
    by its new tokens (1-D); stats: "failed_transfers" (payloads dropped and recomputed), "preemptions"."""
    scheduler, runner = engine_parts(model, n_blocks, block_size, max_seqs)
    seqs = [Sequence(i, prompt.tolist(), n) for i, (prompt, n) in enumerate(requests)]
    inbox, ready = start_receiver(model, requests, src), deque()  # ready: received, waiting for a slot
    n_received = n_failed = 0
    while n_received < len(seqs) or ready or scheduler.waiting or scheduler.running:
        idle = not (ready or scheduler.waiting or scheduler.running)
        while n_received < len(seqs) and (message := take(inbox, idle, timeout_s + 5)) is not None:
            seq_id, token, payload = message
            seq, n_received, idle = seqs[seq_id], n_received + 1, False
            if payload is None:  # the transfer failed: recompute its prompt here, never lose it
                n_failed += 1
                scheduler.add(seq)
                continue
            clock.now = clock.elapsed()
            seq.output.append(token)
            clock.token(seq_id, 1)  # the first token reaches the client through the decode worker
            if not seq.done:
                ready.append((seq, payload))
        while ready and admit_prefilled(scheduler, runner, *ready[0]):
            ready.popleft()
        if not (scheduler.waiting or scheduler.running):
            continue
        with clock.step(rows=0):
            batch = scheduler.schedule()
            next_tokens = runner.run(batch, scheduler.block_manager).tolist()
            got_token = scheduler.update(batch, next_tokens)
        for seq in got_token:
            clock.token(seq.seq_id, len(seq.output))
    device = requests[0][0].device
    return [torch.tensor(s.tokens, dtype=torch.long, device=device) for s in seqs], {"failed_transfers": n_failed,
                                                                                   "preemptions": scheduler.n_preemptions}


def serve_disaggregated(model, requests, arrivals, n_blocks, block_size, max_seqs, timeout_s, corrupt=()):
    """Both ranks call it (rank 0 prefills, rank 1 decodes), their clocks started after a barrier.
    Returns, on every rank, (outputs, clock of the decode worker, stats): stats holds the prefill
    worker's send seconds and KV bytes per request and the decode worker's failed transfers."""
    device = requests[0][0].device
    dist.barrier()
    clock = LiveClock(arrivals, [n for _, n in requests], device)
    if dist.get_rank() == PREFILL_RANK:
        result = (None, None, serve_prefill(model, requests, clock, n_blocks, block_size, max_seqs,
                                            corrupt=set(corrupt)))
    else:
        outputs, stats = serve_decode(model, requests, clock, n_blocks, block_size, max_seqs, timeout_s)
        result = ([o.cpu() for o in outputs], clock, stats)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    (_, _, prefill_stats), (outputs, clock, decode_stats) = gathered[PREFILL_RANK], gathered[DECODE_RANK]
    return [o.to(device) for o in outputs], clock, prefill_stats | decode_stats
