"""Sequence (context) parallelism: the prefill of one long prompt split over P ranks by tokens.

Blog section: "Scaling out: parallelism and offloading". Every rank holds a shard of the prompt's tokens;
everything but attention works per token and runs on the shard alone. Attention needs every earlier key:
- Ring Attention (Liu et al., 2023): each rank keeps its queries and passes its keys and values around a
  ring, P steps, one batched isend/irecv a step (the next block travels while this one is computed). Each
  block's partial output is merged with the others through their log-sum-exp (merge_); a block of keys
  entirely in the future of a query block is skipped, not computed.
- zigzag (ring-flash-attention, Llama 3): the same ring over 2P chunks, rank r holding chunks r and
  2P-1-r. With contiguous shards rank 0 computes one block and rank P-1 computes P (causal); with zigzag
  every rank holds an early and a late chunk and computes the same amount at every step.
- Ulysses (DeepSpeed-Ulysses, Jacobs et al., 2023): an all-to-all turns sequence shards into head shards
  (every rank: all tokens of H/P heads), attention runs locally, a second all-to-all turns them back. P
  must divide the heads.
Shards need not be equal: a length that P (or 2P) does not divide gives chunks one token apart, and every
rank knows every shard's size (Layout), so each receive buffer has the exact size: no padding, no mask.
"""
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gptlite_rope import apply_rope, rope_tables
from gptlite_tp import CommStats


@dataclass(frozen=True)
class Layout:
    """Which tokens of a sequence of `seq_len` each of `world_size` ranks holds: contiguous shards, or
    zigzag (2P chunks, rank r holding chunks r and 2P-1-r). Chunks differ by at most one token."""
    seq_len: int
    world_size: int
    zigzag: bool = False

    def __post_init__(self):
        if self.world_size < 1 or self.seq_len < self.n_chunks:
            raise ValueError(f"{self.seq_len} tokens cannot be cut into the {self.n_chunks} chunks of "
                             f"{'zigzag over ' if self.zigzag else ''}{self.world_size} rank(s): give at least "
                             f"{self.n_chunks} tokens")

    @property
    def n_chunks(self):
        return 2 * self.world_size if self.zigzag else self.world_size

    def chunks(self, rank):
        """[(start, end)] of the rank's chunks, in position order."""
        base, extra = divmod(self.seq_len, self.n_chunks)
        bounds = [i * base + min(i, extra) for i in range(self.n_chunks + 1)]  # the first `extra` get a token more
        ids = (rank, 2 * self.world_size - 1 - rank) if self.zigzag else (rank,)
        return [(bounds[i], bounds[i + 1]) for i in ids]

    def length(self, rank):
        return sum(end - start for start, end in self.chunks(rank))

    def positions(self, rank, device=None):
        return torch.cat([torch.arange(start, end, device=device) for start, end in self.chunks(rank)])

    def shard(self, x, rank, dim=-2):
        """The rank's tokens of the whole sequence x (along `dim`)."""
        return torch.cat([x.narrow(dim, start, end - start) for start, end in self.chunks(rank)], dim=dim)


def check_ulysses_size(n_heads, world_size):
    """Ulysses gives each rank H/P whole heads: P must divide H (so at most H ranks)."""
    if world_size > n_heads or n_heads % world_size:
        divisors = [p for p in range(1, n_heads + 1) if n_heads % p == 0]
        raise ValueError(f"Ulysses splits the {n_heads} heads over the ranks: {world_size} ranks cannot share them "
                         f"evenly (at most {n_heads} ranks, a divisor of {n_heads}: one of {divisors})")


@dataclass
class Work:
    """A rank's attention work: blocks computed and skipped (entirely in the future), query-key pairs
    attended (a causal diagonal block counts its lower triangle) times heads and batch, kernel seconds."""
    blocks: int = 0
    skipped: int = 0
    pairs: int = 0
    seconds: float = 0.0

    def reset(self):
        self.blocks = self.skipped = self.pairs = 0
        self.seconds = 0.0

    def attend(self, q, k, v, causal):
        """attend_block, counted; timed on CPU only (on CUDA a synchronize would wait for the ring's transfer
        in flight too, and undo the overlap it measures)."""
        start = time.perf_counter()  # the CPU computes synchronously: the clock after the call is its end
        result = attend_block(q, k, v, causal)
        B, H, Tq, _ = q.shape
        seconds = time.perf_counter() - start if q.device.type == "cpu" else 0.0
        self.blocks, self.seconds = self.blocks + 1, self.seconds + seconds
        self.pairs += B * H * (Tq * (Tq + 1) // 2 if causal else Tq * k.shape[-2])
        return result


def attend_block(q, k, v, causal):
    """Softmax attention of queries q [B, H, Tq, D] over keys and values [B, H, Tk, D]: the output
    [B, H, Tq, D] and each query's log-sum-exp of its scaled scores [B, H, Tq] (float32), what merging
    needs. causal: the keys are the queries' own positions (a diagonal block, Tq == Tk). A fused kernel
    that never holds the [Tq, Tk] scores: FlashAttention's on CPU (F.scaled_dot_product_attention's), the
    memory-efficient one on CUDA."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)[:2]
    return out, lse[..., :q.shape[-2]]  # its lse is padded to a multiple of 32 queries


def merge_(out, lse, block_out, block_lse):
    """Fold a block's partial attention into the running one, in place in `out` [B, H, T, D] (lse None: the
    first block). Both are softmax averages over disjoint keys; the merged average weighs each by its share
    of the total exp-sum, exp(lse_i - lse_total). Returns the total lse [B, H, T]."""
    if lse is None:
        out.copy_(block_out)
        return block_lse
    total = torch.logaddexp(lse, block_lse)
    out.mul_((lse - total).exp().unsqueeze(-1)).add_(block_out.mul_((block_lse - total).exp().unsqueeze(-1)))
    return total


def wait_all(requests):
    """Wait for point-to-point requests. gloo raises a dead or silent peer as a plain RuntimeError from
    wait(), in this frame: as a DistError, collective_errors names it as a peer's failure."""
    try:
        for request in requests:
            request.wait()
    except RuntimeError as e:
        raise dist.DistError(str(e)) from e


def ring_attention(q, k, v, layout, rank, comm=None, work=None, group=None):
    """Causal attention of this rank's queries q [B, H, S_r, D] (its tokens of `layout`) over the whole
    sequence, every rank's keys and values k, v [B, H, S_r, D] coming around the ring. Returns this
    rank's output [B, H, S_r, D]. comm (CommStats): bytes sent and seconds blocked waiting for the next
    block; work (Work): the blocks computed and skipped."""
    P, work, comm = layout.world_size, work if work is not None else Work(), comm if comm is not None else CommStats()
    offsets = lambda chunks: [sum(e - s for s, e in chunks[:i]) for i in range(len(chunks))]  # noqa: E731
    mine = layout.chunks(rank)
    k, v = k.contiguous(), v.contiguous()  # what isend takes
    out = torch.empty_like(q)  # [B, H, S_r, D], merged into in place, chunk by chunk
    lse = [None] * len(mine)  # [B, H, chunk] each
    for step in range(P):
        src = (rank - step) % P  # whose keys and values this rank holds now
        if step + 1 < P:  # pass them on while computing on them
            shape = (*k.shape[:2], layout.length((src - 1) % P), k.shape[-1])
            k_in, v_in = k.new_empty(shape), v.new_empty(shape)
            requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, k, (rank + 1) % P, group),
                                               dist.P2POp(dist.isend, v, (rank + 1) % P, group),
                                               dist.P2POp(dist.irecv, k_in, (rank - 1) % P, group),
                                               dist.P2POp(dist.irecv, v_in, (rank - 1) % P, group)])
        for i, (q_off, (q_start, q_end)) in enumerate(zip(offsets(mine), mine)):
            for k_off, (k_start, k_end) in zip(offsets(layout.chunks(src)), layout.chunks(src)):
                if k_start >= q_end:  # chunks are equal or disjoint: this one is entirely in the future
                    work.skipped += 1
                    continue
                block = work.attend(q.narrow(2, q_off, q_end - q_start), k.narrow(2, k_off, k_end - k_start),
                                    v.narrow(2, k_off, k_end - k_start), causal=k_start == q_start)
                lse[i] = merge_(out.narrow(2, q_off, q_end - q_start), lse[i], *block)
                del block  # its output: freed before the next block's
        if step + 1 < P:
            comm.timed(lambda: wait_all(requests), q.device, k.nbytes + v.nbytes)
            k, v = k_in, v_in
    return out


def all_to_all(out, x, recv_sizes, send_sizes, rank, comm, group=None):
    """all_to_all_single with uneven splits along dim 0, counted: the bytes sent to the other ranks."""
    nbytes = x[:sum(send_sizes[:rank])].nbytes + x[sum(send_sizes[:rank + 1]):].nbytes
    comm.timed(lambda: dist.all_to_all_single(out, x, recv_sizes, send_sizes, group=group), x.device, nbytes)
    return out


def ulysses_attention(q, k, v, layout, rank, comm=None, work=None, group=None):
    """Causal attention of this rank's contiguous shard q, k, v [B, H, S_r, D]: all-to-all to every token
    of H/P heads, local attention, all-to-all back. Returns this rank's output [B, H, S_r, D]. The
    all-to-alls split dim 0, so tokens go first: [tokens, ...] buffers, uneven splits of whole tokens."""
    B, H, S_r, D = q.shape
    P, work, comm = layout.world_size, work if work is not None else Work(), comm if comm is not None else CommStats()
    check_ulysses_size(H, P)
    if layout.zigzag:
        raise ValueError("Ulysses gathers the tokens in rank order: give it contiguous shards, not zigzag")
    h, sizes = H // P, [layout.length(r) for r in range(P)]

    send = q.new_empty(P, S_r, B, h, D)  # to rank j its heads; one buffer for Q, K and V (gloo may still hold the last)

    def to_heads(x):  # [B, H, S_r, D] -> [B, h, S, D]: every token, this rank's heads
        send.copy_(x.reshape(B, P, h, S_r, D).permute(1, 3, 0, 2, 4))
        recv = all_to_all(x.new_empty(layout.seq_len, B, h, D), send.view(P * S_r, B, h, D), sizes, [S_r] * P, rank,
                          comm, group)  # [S, B, h, D]
        return recv.permute(1, 2, 0, 3)
    # one all-to-all per tensor, as DeepSpeed's: a third of the buffers of one packed Q, K, V at a time
    out = work.attend(to_heads(q), to_heads(k), to_heads(v), causal=True)[0]  # [B, h, S, D]
    out = out.permute(2, 0, 1, 3).contiguous()  # [S, B, h, D]: tokens first, to split them
    back = all_to_all(out.new_empty(P * S_r, B, h, D), out, [S_r] * P, sizes, rank, comm, group)  # [P * S_r, B, h, D]
    return back.view(P, S_r, B, h, D).permute(2, 0, 3, 1, 4).reshape(B, H, S_r, D)  # heads back in rank order


def gather_sequence(x, layout, rank, dim=-2, group=None):
    """The whole sequence, in position order, from every rank's shard x (along `dim`), on every rank:
    all_gather needs equal sizes, so the shards travel padded to the longest."""
    P, dim = layout.world_size, dim % x.dim()
    if P == 1:
        return x  # its one or two chunks are in position order
    longest = max(layout.length(r) for r in range(P))
    pad = list(x.shape)
    pad[dim] = longest - x.shape[dim]
    padded = torch.cat([x, x.new_zeros(pad)], dim=dim).contiguous()
    parts = [torch.empty_like(padded) for _ in range(P)]
    dist.all_gather(parts, padded, group=group)
    shape = list(x.shape)
    shape[dim] = layout.seq_len
    full = x.new_empty(shape)
    for r, part in enumerate(parts):
        offset = 0
        for start, end in layout.chunks(r):
            full.narrow(dim, start, end - start).copy_(part.narrow(dim, offset, end - start))
            offset += end - start
    return full


@torch.inference_mode()
def sp_prefill(model, idx, layout, rank, attention):
    """The prefill of a GPTlite_RoPE's weights on this rank's tokens idx [B, S_r] of a prompt of
    layout.seq_len tokens (past the model's window: rotary positions have no table to run out of).
    Everything but attention is per token; attention(q, k, v) on the shards [B, H, S_r, D] is
    ring_attention or ulysses_attention with the same layout. Returns the logits [B, S_r, vocab] and the
    cache shard to hand to decoding: each layer's (keys before rotation, values) [B, H, S_r, D], as
    GPTlite_RoPE caches them."""
    cos, sin = rope_tables(layout.seq_len, model.config.d_head)  # [S, D/2]
    pos = layout.positions(rank)
    cos, sin = cos[pos].to(idx.device), sin[pos].to(idx.device)  # this rank's positions
    x = model.token_embedding(idx)  # [B, S_r, d_model]
    cache = []
    for block in model.blocks:
        mha, h = block.mha, block.ln1(x)
        q, k, v = (mha.split_heads(proj(h)) for proj in (mha.query_proj, mha.key_proj, mha.value_proj))
        out = attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)  # [B, H, S_r, D]
        x = x + mha.out_proj(mha.merge_heads(out))
        x = x + block.ffwd(block.ln2(x))
        cache.append((k, v))
    return model.fc_out(model.ln(x)), cache
