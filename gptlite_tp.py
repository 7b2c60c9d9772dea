"""GPTlite split across N processes by Megatron-style tensor parallelism (Shoeybi et al., 2019).

Blog section: "Scaling out: parallelism and offloading". Every rank holds a shard of each block, cut from the same trained
state dict (shard_state_dict):
- column-parallel: the query, key and value projections split by heads, and the MLP's first layer
  split by neurons (rows of the weight, entries of the bias); each rank computes its heads' attention
  and its neurons' ReLU on its own, with no communication;
- row-parallel: the attention's output projection and the MLP's second layer split by input columns;
  each rank's product is a partial sum of the full output, so one all-reduce adds them up and the bias
  (replicated) is added once, after the sum. Two all-reduces per block.
Embeddings, LayerNorms and the output head are replicated. Each rank's KV cache holds its heads only:
a GPTlite_TP is a GPTlite_KVCache built with n_heads / N heads and d_ff / N neurons, so the cache,
generate_kvcache and the rest of the KV-cache code work unchanged.
"""
import dataclasses
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from gptlite import GPTliteConfig
from gptlite_kvcache import GPTlite_KVCache

COLUMN_PARALLEL = ("mha.query_proj.weight", "mha.query_proj.bias", "mha.key_proj.weight", "mha.key_proj.bias",
                   "mha.value_proj.weight", "mha.value_proj.bias", "ffwd.net.0.weight", "ffwd.net.0.bias")
ROW_PARALLEL = ("mha.out_proj.weight", "ffwd.net.2.weight")  # their biases stay whole


def check_tp_size(n_heads, d_ff, world_size):
    """N must split the heads and the MLP's neurons evenly: a clear error before any work."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"the tensor-parallel size must be a positive integer, got {world_size!r}")
    if n_heads % world_size or d_ff % world_size:
        divisors = [n for n in range(1, n_heads + 1) if n_heads % n == 0 and d_ff % n == 0]
        raise ValueError(f"{world_size} ranks cannot split n_heads={n_heads} and the MLP width d_ff={d_ff} evenly; "
                         f"use a number of processes that divides both: one of {divisors}")


def shard_state_dict(state_dict, rank, world_size):
    """This rank's shard of a GPTlite state dict: column-parallel weights and biases cut along their
    output rows (heads, neurons), row-parallel weights along their input columns, the rest whole."""
    shard = {}
    for name, tensor in state_dict.items():
        if name.endswith(COLUMN_PARALLEL):
            tensor = tensor.chunk(world_size, dim=0)[rank]  # [out / N, in] or [out / N]
        elif name.endswith(ROW_PARALLEL):
            tensor = tensor.chunk(world_size, dim=1)[rank]  # [out, in / N]
        shard[name] = tensor.clone()  # its own storage: the full tensor can be freed
    return shard


class CommStats:
    """Counts of one kind of collective: calls, payload bytes and wall time spent in them (waiting for a
    slower rank included). Tensor parallelism's all-reduce and expert parallelism's all-to-all keep one."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.calls, self.nbytes, self.seconds = 0, 0, 0.0

    def timed(self, op, device, nbytes):
        """Run op() (a collective), count it with `nbytes` of payload; returns what op returns."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # NCCL is asynchronous: time the transfer, not its launch
        start = time.perf_counter()
        result = op()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        self.nbytes += nbytes
        return result


class AllReduce(CommStats):
    """Sum a tensor over the ranks in place (the row-parallel layers' one communication), counted."""

    def __init__(self, world_size, group=None):
        super().__init__()
        self.world_size, self.group = world_size, group

    def __call__(self, x):
        if self.world_size == 1:
            return x
        self.timed(lambda: dist.all_reduce(x, group=self.group), x.device, x.nbytes)  # the sum over ranks
        return x


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_rank @ W_rank^T) + b: this rank's in_features are a slice of the full layer's."""

    def __init__(self, in_features, out_features, all_reduce):
        super().__init__(in_features, out_features)
        self.all_reduce = all_reduce

    def forward(self, x):
        y = F.linear(x, self.weight)  # [B, T, out]: this rank's partial sum
        return self.all_reduce(y) + self.bias  # the bias once, after the sum


@dataclasses.dataclass(frozen=True, kw_only=True)
class TPConfig(GPTliteConfig):
    """The whole model's sizes (n_heads, d_ff of all ranks together) and the number of ranks."""
    world_size: int = 1


class GPTlite_TP(GPTlite_KVCache):
    """One rank's GPTlite: n_heads / N heads and d_ff / N neurons per block, two all-reduces per block.
    Its config is the whole model's (TPConfig), the process group is not part of it."""
    config_class = TPConfig

    def __init__(self, vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, d_ff=None,
                 world_size=1, group=None):
        config = TPConfig(vocab_size, d_model, n_heads, d_head, n_layers, dropout_p, seqlen, d_ff,
                          world_size=world_size)
        check_tp_size(n_heads, config.d_ff, world_size)
        heads, neurons = n_heads // world_size, config.d_ff // world_size
        super().__init__(vocab_size, d_model, heads, d_head, n_layers, dropout_p, seqlen, d_ff=neurons)
        self.config = config
        self.all_reduce = AllReduce(world_size, group)  # shared by every row-parallel layer: one set of counts
        for block in self.blocks:
            block.mha.out_proj = RowParallelLinear(heads * d_head, d_model, self.all_reduce)
            block.ffwd.net[2] = RowParallelLinear(neurons, d_model, self.all_reduce)


def tensor_parallel_model(state_dict, config, rank, world_size, group=None):
    """Rank `rank` of `world_size`: a GPTlite_TP of `config` (GPTlite's keyword arguments) holding its
    shard of `state_dict`, in eval mode, on the device of the state dict's tensors."""
    model = GPTlite_TP(**config, world_size=world_size, group=group)
    model.load_state_dict(shard_state_dict(state_dict, rank, world_size))
    return model.to(next(iter(state_dict.values())).device).eval()
