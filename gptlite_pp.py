"""GPTlite split into P pipeline stages on P processes (GPipe's layout), forward only, with a KV cache.

Blog section: "Scaling out: parallelism and offloading" (pipeline parallelism "places different layers on
different devices"). Rank s holds blocks s*L/P .. (s+1)*L/P - 1 and their KV cache; rank 0 also the
embeddings, the last rank the final LayerNorm and the head. A batch is cut into m micro-batches that follow
each other through the stages: while stage 1 runs micro-batch j, stage 0 runs micro-batch j+1.

Generation (`pipeline_generate`) is a ring: stage s receives a micro-batch's activations [b, T, d_model]
from stage s-1 (rank 0: the prompt, then the token that the last stage sends back), runs its blocks through
that micro-batch's KV cache and sends them on; the last stage picks the greedy token. Each micro-batch's
next token starts its next step at stage 0 as soon as it is back, so with m >= P micro-batches every stage
stays busy while decoding; a prefill (one pass) fills and drains the pipeline: (P-1)/(m+P-1) of each
stage's time is the bubble (GPipe).

Point-to-point calls written plainly (dist.isend and dist.recv) rather than torch.distributed.pipelining: a
pipelining schedule runs one step of a fixed module over micro-batches, while generation here keeps one KV
cache per micro-batch and stage and loops the last stage's token back to the first.
"""
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from gptlite_kvcache import GPTlite_KVCache, StaticKVCache


def check_pp_size(n_layers, n_stages):
    """P must split the blocks evenly: a clear error before any work."""
    if not isinstance(n_stages, int) or n_stages < 1:
        raise ValueError(f"the number of pipeline stages must be a positive integer, got {n_stages!r}")
    if n_layers % n_stages:
        divisors = [p for p in range(1, n_layers + 1) if n_layers % p == 0]
        raise ValueError(f"{n_stages} stages cannot split the {n_layers} layers evenly; use a number of processes that "
                         f"divides them: one of {divisors}")


class PipelineStage(nn.Module):
    """Stage `stage` of `n_stages` of a GPTlite_KVCache: its blocks (the model's own modules, shared, not
    copied), the embeddings on the first stage, the LayerNorm and head on the last."""

    def __init__(self, model, stage, n_stages):
        super().__init__()
        check_pp_size(len(model.blocks), n_stages)
        per = len(model.blocks) // n_stages
        self.stage, self.n_stages, self.seqlen = stage, n_stages, model.seqlen
        self.first, self.last = stage == 0, stage == n_stages - 1
        self.blocks = nn.ModuleList(model.blocks[stage * per:(stage + 1) * per])
        if self.first:
            self.token_embedding, self.position_embedding = model.token_embedding, model.position_embedding
        if self.last:
            self.ln, self.fc_out = model.ln, model.fc_out
        c = model.config
        self.n_heads, self.d_head, self.d_model = c.n_heads, c.d_head, c.d_model

    def new_cache(self, batch_size):
        """This stage's layers' KV cache for a micro-batch of `batch_size` sequences."""
        p = self.blocks[0].ln1.weight
        return StaticKVCache(len(self.blocks), batch_size, self.n_heads, self.d_head, self.seqlen, p.device, p.dtype)

    def forward(self, x, cache):
        """x: token ids [b, T] (first stage) or activations [b, T, d_model]; returns the activations, or the
        greedy next token [b, 1] on the last stage. `cache` (this stage's) is updated in place."""
        T = x.shape[1]
        cache.check_new_tokens(T)
        if self.first:
            x = self.token_embedding(x) + self.position_embedding(cache.positions(T, x.device))  # [b, T, d]
        for layer, block in enumerate(self.blocks):
            x, _ = block(x, cache, None, layer)
        cache.advance(T)
        if self.last:
            return self.fc_out(self.ln(x[:, -1:])).argmax(dim=-1)  # [b, 1]
        return x


def pipeline_stage(model, stage, n_stages):
    """This rank's PipelineStage of the GPTlite_KVCache `model`, in eval mode."""
    if not isinstance(model, GPTlite_KVCache):
        raise ValueError(f"a pipeline splits a GPTlite_KVCache, got a {type(model).__name__}")
    return PipelineStage(model, stage, n_stages).eval()


class Timeline:
    """One rank's seconds: busy in its stage's compute, and the wall time of each phase."""

    def __init__(self):
        self.busy = {"prefill": 0.0, "decode": 0.0}
        self.wall = {"prefill": 0.0, "decode": 0.0}


@torch.inference_mode()
def pipeline_generate(stage, micro_batches, n_tokens, comm, group=None, sync=None):
    """Greedy generation of n_tokens per sequence through the P stages (P ranks 0..P-1 of the default group,
    this one `stage.stage`). micro_batches: the prompts' micro-batches [b_j, S] (every rank needs their
    shapes; only rank 0 reads the tokens). comm: a CommStats that counts this rank's sends. `group`: the P
    ranks' group, whose barrier separates the prefill from the decode steps. `sync`: called before each clock
    read (CUDA). Returns the new tokens of each micro-batch [b_j, n_tokens] on the last stage (None elsewhere),
    and this rank's Timeline."""
    s, P = stage.stage, stage.n_stages
    sync = sync or (lambda: None)
    caches = [stage.new_cache(mb.shape[0]) for mb in micro_batches]
    tokens = [[] for _ in micro_batches]
    sends = [None] * len(micro_batches)  # each micro-batch's last send: waited before its next one
    timeline = Timeline()
    d, device = stage.d_model, micro_batches[0].device
    for phase, steps in (("prefill", range(1)), ("decode", range(1, n_tokens))):
        sync()
        start = time.perf_counter()
        for step in steps:
            for j, mb in enumerate(micro_batches):
                if s == 0:
                    x = mb if step == 0 else tokens[j][-1] if P == 1 else recv(mb.new_empty(mb.shape[0], 1), P - 1)
                else:
                    x = recv(torch.empty(mb.shape[0], mb.shape[1] if step == 0 else 1, d, device=device), s - 1)
                t0 = time.perf_counter()
                out = stage(x, caches[j])
                sync()
                timeline.busy[phase] += time.perf_counter() - t0
                if stage.last:
                    tokens[j].append(out)
                if P > 1 and not (stage.last and step == n_tokens - 1):  # the last token goes nowhere
                    if sends[j] is not None:
                        sends[j].wait()
                    sends[j] = comm.timed(lambda: dist.isend(out.contiguous(), (s + 1) % P), out.device, out.nbytes)
        if group is not None:
            dist.barrier(group=group)  # the phase ends when the last stage is done: one wall time for all
        sync()
        timeline.wall[phase] = time.perf_counter() - start
    for work in sends:
        if work is not None:
            work.wait()
    return ([torch.cat(t, dim=1) for t in tokens] if stage.last else None), timeline


def recv(buffer, source):
    dist.recv(buffer, source)
    return buffer
