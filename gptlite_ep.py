"""GPTlite_MoE across N processes: expert parallelism (GShard, DeepSeek-V3's serving), or tensor parallelism of
the experts, on torch.distributed.

Blog section: "Scaling out: parallelism and offloading" ("expert parallelism places the experts of a
mixture-of-experts model on different GPUs, and routes the tokens to them with all-to-all communication").

- Expert parallelism (`expert_parallel_model`): rank r holds experts r*E/N .. (r+1)*E/N - 1 of every layer and
  a slice of the batch (attention is data-parallel: its own rows, its own KV cache). In each MoE layer a rank
  routes its tokens (the router is replicated), sends every assignment's token to the rank of its expert with
  one `all_to_all_single` (after one that tells every rank how many rows to expect), the owner runs its
  experts, and a second `all_to_all_single` brings the outputs back to be weighted and summed. An expert's
  capacity is GShard's over the whole batch: the owner sees the assignments of every rank with their global
  queue key (choice j, global token t: j * N_tokens + t) and keeps the first `capacity` of each expert's queue
  (gptlite_moe.within_capacity, the single process's rule), so drops are those of one process.
- Tensor parallelism of the experts (`expert_tensor_parallel_model`): every rank holds every expert with d_expert / N
  of its neurons (column-parallel first layer, row-parallel second, Megatron's MLP split) and runs the whole
  batch; the router is replicated, so every rank routes alike, and one all-reduce per layer adds up the
  partial outputs. The second layer's bias is held by rank 0 only (added once by the sum).
Embeddings, attention, LayerNorms and the head are replicated in both. Every rank must hold the same number
of tokens (the batch split evenly); each model counts its collectives' calls, bytes and seconds (`comm`).
"""
import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from gptlite_moe import MoEFeedForward, Routing, within_capacity
from gptlite_tp import AllReduce, CommStats

MODES = ("expert", "tensor")


def check_ep_size(n_experts, d_expert, world_size, mode):
    """Expert parallelism splits the experts, tensor parallelism each expert's neurons: evenly."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"the number of ranks must be a positive integer, got {world_size!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    size, what = (n_experts, "experts") if mode == "expert" else (d_expert, "neurons of each expert (d_expert)")
    if size % world_size:
        divisors = [n for n in range(1, size + 1) if size % n == 0]
        raise ValueError(f"{world_size} ranks cannot split the {size} {what} evenly; use a number of processes "
                         f"that divides it: one of {divisors}")


class AllToAll(CommStats):
    """dist.all_to_all_single with uneven splits, counted: nbytes are the bytes this rank sends to other ranks
    (its own rows are a local copy)."""

    def __init__(self, rank, world_size, group=None):
        super().__init__()
        self.rank, self.world_size, self.group = rank, world_size, group

    def __call__(self, x, send_splits, recv_splits):
        """x [sum(send_splits), ...] -> [sum(recv_splits), ...]: rows send_splits[i] go to rank i."""
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        remote = (sum(send_splits) - send_splits[self.rank]) * x[0:1].nbytes if len(x) else 0
        self.timed(lambda: dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=self.group),
                   x.device, remote)
        return out

    def counts(self, send_counts):
        """Each rank's number of rows for this one: a [N] tensor of counts in, the [N] it will receive out."""
        out = torch.empty_like(send_counts)
        self.timed(lambda: dist.all_to_all_single(out, send_counts, group=self.group), send_counts.device,
                   send_counts[0:1].nbytes * (self.world_size - 1))
        return out


class SplitMoE(MoEFeedForward):
    """A copy of the MoE layer `full` (its router, shared expert and settings); a subclass then keeps its share
    of the experts' weights."""

    def __init__(self, full):
        d_model, d_expert = full.w_in.shape[1:]
        super().__init__(d_model, d_expert, full.n_experts, full.top_k, full.capacity_factor, full.router,
                         full.shared is not None)
        self.load_state_dict(full.state_dict())


class ExpertParallelMoE(SplitMoE):
    """One rank's MoE layer: the router and shared expert whole, experts [first, first + E/N) only."""

    def __init__(self, full, rank, world_size, all_to_all):
        super().__init__(full)
        per = full.n_experts // world_size
        self.first, self.per_rank, self.rank, self.world_size = rank * per, per, rank, world_size
        for name in ("w_in", "b_in", "w_out", "b_out"):  # [E/N, ...]: this rank's experts
            setattr(self, name, nn.Parameter(getattr(full, name)[self.first:self.first + per].detach().clone()))
        self.all_to_all = all_to_all

    def forward(self, x):
        """x [b, S, d]: this rank's rows -> [b, S, d]; every rank calls it together (two all-to-alls)."""
        flat = x.reshape(-1, x.shape[-1])  # [n, d]
        experts, weights, _ = self.select(flat)  # [n, k], the capacity is the owner's
        n, k = experts.shape
        token = torch.arange(n, device=x.device).repeat_interleave(k)  # assignment a = t * k + j
        choice = torch.arange(k, device=x.device).repeat(n)
        n_all = n * self.world_size  # every rank holds n tokens: rank r's are r*n .. r*n + n - 1 of the batch
        key = choice * n_all + self.rank * n + token  # GShard's queue order over the whole batch
        expert = experts.reshape(-1)
        order = torch.argsort(expert, stable=True)  # by expert, hence by destination rank
        send = torch.bincount(expert // self.per_rank, minlength=self.world_size)  # [N]
        recv = self.all_to_all.counts(send)
        send, recv = send.tolist(), recv.tolist()
        meta = torch.stack([expert[order] % self.per_rank, key[order]], dim=1)
        rows = self.all_to_all(flat[token[order]], send, recv)  # [R, d]: the tokens sent to this rank's experts
        rows_meta = self.all_to_all(meta, send, recv)  # [R, 2]: their local expert and global queue key
        local = rows_meta[:, 0]
        kept = (torch.ones_like(local, dtype=torch.bool) if self.capacity_factor is None
                else within_capacity(local, rows_meta[:, 1], self.per_rank, self.capacity(n_all)))
        outputs = torch.zeros_like(rows)  # a dropped assignment returns zeros: it adds nothing
        outputs[kept] = self.expert_outputs(rows[kept], local[kept])
        back = self.all_to_all(outputs, recv, send)  # [n*k, d] in `order`
        self.routing = Routing(load=torch.bincount(local[kept], minlength=self.per_rank),
                               dropped=int((~kept).sum()), aux_loss=None)  # of this rank's experts
        out = torch.zeros_like(flat).index_add_(0, token[order], back * weights.reshape(-1)[order, None])
        return self.finish(out, flat, x.shape)


class ExpertTensorParallelMoE(SplitMoE):
    """One rank's MoE layer: every expert with d_expert / N neurons, the router whole; one all-reduce."""

    def __init__(self, full, rank, world_size, all_reduce):
        super().__init__(full)
        d_expert = full.w_in.shape[2]
        part = slice(rank * d_expert // world_size, (rank + 1) * d_expert // world_size)
        self.w_in = nn.Parameter(full.w_in[:, :, part].detach().clone())  # [E, d, h/N]: column-parallel
        self.b_in = nn.Parameter(full.b_in[:, part].detach().clone())
        self.w_out = nn.Parameter(full.w_out[:, part].detach().clone())  # [E, h/N, d]: row-parallel
        self.b_out = nn.Parameter(full.b_out.detach().clone() * (rank == 0))  # added once, by rank 0's share
        self.all_reduce = all_reduce

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        experts, weights = self.route(flat)  # the same on every rank: the same tokens, the same router
        return self.finish(self.all_reduce(self.combine(flat, experts, weights)), flat, x.shape)


def parallel_moe_model(model, rank, world_size, mode, group=None):
    """Rank `rank`'s copy of the GPTlite_MoE `model` with its MoE layers split (mode "expert" or "tensor");
    everything else shared with `model`'s weights. `comm` counts the collectives."""
    config = model.config
    check_ep_size(config.n_experts, config.d_expert, world_size, mode)
    if config.shared_expert and mode == "tensor":
        raise ValueError("tensor parallelism of the experts splits the routed experts only; a shared expert would "
                         "be replicated and summed N times: use mode 'expert', or a model without one")
    parallel = copy.copy(model)  # a new module list of its own, the other modules shared
    parallel._modules = dict(model._modules, blocks=nn.Sequential(*[copy.copy(b) for b in model.blocks]))
    for block in parallel.blocks:
        block._modules = dict(block._modules)
    if mode == "expert":
        parallel.comm = AllToAll(rank, world_size, group)
        layer = lambda full: ExpertParallelMoE(full, rank, world_size, parallel.comm)  # noqa: E731
    else:
        parallel.comm = AllReduce(world_size, group)
        layer = lambda full: ExpertTensorParallelMoE(full, rank, world_size, parallel.comm)  # noqa: E731
    for block, full in zip(parallel.blocks, model.moe_layers()):
        block.ffwd = layer(full).to(full.w_in.device).eval()
    return parallel.eval()


def split_batch(batch, rank, world_size):
    """Rank `rank`'s rows of a batch [B, ...] split evenly (expert parallelism's data-parallel attention)."""
    if batch.shape[0] % world_size:
        raise ValueError(f"a batch of {batch.shape[0]} rows does not split evenly over {world_size} ranks")
    per = batch.shape[0] // world_size
    return batch[rank * per:(rank + 1) * per]

