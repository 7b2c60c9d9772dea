"""A torchrun worker of tests/test_sequence_parallel.py (not a test file: pytest does not collect it).

    python -m torch.distributed.run --standalone --nproc-per-node 3 tests/sp_worker.py check OUT.json
    ... tests/sp_worker.py die OUT.json      # rank 1 exits at its second ring step, in the middle of the ring
    ... tests/sp_worker.py hang OUT.json     # rank 1 stops answering there; its peers time out

`check`: at two lengths (one that 2P divides, one that P does not), every rank runs ring, zigzag and
Ulysses attention on its shard of the same random Q, K, V and compares it with the explicit attention on
the whole sequence; then the prefill of a tiny rotary GPTlite (6 heads, weights from N(0, 0.5), a 16-token
window, prompts of 3x that) against GPTlite_RoPE's own forward: logits, the keys and values gathered from
the shards, and greedy decoding from them. Rank 0 writes the figures (diffs: the worst over the ranks;
work and bytes: per rank) to OUT.json. The references are written here, not taken from the script.
"""
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gptlite_sp as sp  # noqa: E402
from gptlite import scaled_dot_product_attention  # noqa: E402
from gptlite_kvcache import decode_n_tokens, generate_kvcache  # noqa: E402
from gptlite_rope import GPTlite_RoPE  # noqa: E402
from gptlite_tp import CommStats  # noqa: E402
from lib import distributed, files, harness  # noqa: E402

CONFIG = dict(vocab_size=65, d_model=24, n_heads=6, d_head=4, n_layers=2, dropout_p=0.0, seqlen=16)  # 6 heads: P = 2, 3
LENGTHS = (48, 47)  # 48: 2P divides it (P = 2, 3); 47: P does not
N_DECODE = 6
TIMEOUT_S = 300  # a collective of a correct run
FAULT_TIMEOUT_S = 3  # die and hang: the peer's error has to come quickly
METHODS = {"ring": (sp.ring_attention, False), "zigzag": (sp.ring_attention, True),
           "ulysses": (sp.ulysses_attention, False)}


def tiny_rope():
    torch.manual_seed(0)
    model = GPTlite_RoPE(**CONFIG).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model


def fail_at_second_ring_step(mode):
    """Rank 1's batch_isend_irecv: the first step as usual, then exit (die) or stop answering (hang)."""
    real, calls = dist.batch_isend_irecv, itertools.count()

    def faulty(ops):
        if next(calls) == 1:
            if mode == "die":
                os._exit(3)
            time.sleep(60)
        return real(ops)
    dist.batch_isend_irecv = faulty


def worst(value):
    t = torch.tensor(float(value))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def per_rank(value, world):
    parts = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(parts, torch.tensor([float(value)], dtype=torch.float64))
    return [p.item() for p in parts]


@torch.inference_mode()
def check(d, model):
    figures = {}
    for seq_len in LENGTHS:
        q, k, v = torch.randn(3, 2, 6, seq_len, 4, generator=torch.Generator().manual_seed(seq_len)).unbind(0)
        expected = scaled_dot_product_attention(q, k, v)  # [2, 6, S, 4]
        prompts = torch.randint(65, (2, seq_len), generator=torch.Generator().manual_seed(seq_len))
        ref = GPTlite_RoPE(**dict(CONFIG, seqlen=seq_len + N_DECODE)).eval()
        ref.load_state_dict(model.state_dict())
        logits, cache = ref(prompts)
        tokens = generate_kvcache(ref, prompts, N_DECODE, ref.seqlen)[:, seq_len:]
        for name, (fn, zigzag) in METHODS.items():
            layout = sp.Layout(seq_len, d.world_size, zigzag)
            comm, work = CommStats(), sp.Work()
            out = fn(*(layout.shard(x, d.rank) for x in (q, k, v)), layout, d.rank, comm, work)
            f = dict(attn_diff=worst((out - layout.shard(expected, d.rank)).abs().max()),
                     blocks=per_rank(work.blocks, d.world_size), skipped=per_rank(work.skipped, d.world_size),
                     pairs=per_rank(work.pairs, d.world_size), sent=per_rank(comm.nbytes, d.world_size),
                     shard=per_rank(layout.length(d.rank), d.world_size))
            attention = lambda q, k, v, fn=fn, layout=layout: fn(q, k, v, layout, d.rank)  # noqa: E731
            sp_logits, sp_cache = sp.sp_prefill(model, layout.shard(prompts, d.rank, dim=1), layout, d.rank, attention)
            handed = [tuple(sp.gather_sequence(x, layout, d.rank) for x in kv) for kv in sp_cache]
            first = sp.gather_sequence(sp_logits, layout, d.rank, dim=1)[:, -1:].argmax(dim=-1)
            rest, _ = decode_n_tokens(ref, first, handed, N_DECODE - 1, ref.seqlen)
            f.update(logits_diff=worst((sp_logits - layout.shard(logits, d.rank, dim=1)).abs().max()),
                     kv_diff=worst(max((a - b).abs().max() for kv, r in zip(handed, cache) for a, b in zip(kv, r))),
                     tokens_differ=worst(not torch.equal(torch.cat([first, *rest], dim=1), tokens)))
            figures[f"{seq_len}/{name}"] = f
    return figures


def main():
    mode, out = sys.argv[1], Path(sys.argv[2])
    timeout_s = FAULT_TIMEOUT_S if mode in ("die", "hang") else TIMEOUT_S
    torch.set_num_threads(1)
    model = tiny_rope()
    d = distributed.init("cpu", timeout_s=timeout_s)
    with distributed.collective_errors(timeout_s):
        if mode in ("die", "hang") and d.rank == 1:
            fail_at_second_ring_step(mode)
        figures = check(d, model)
    if d.rank == 0:
        files.atomic_write_bytes(json.dumps(dict(world_size=d.world_size, figures=figures)).encode(), out)
    distributed.shutdown()


if __name__ == "__main__":
    harness.run(main)
