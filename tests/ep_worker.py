"""A torchrun worker of tests/test_expert_parallel.py (not a test file: pytest does not collect it).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/ep_worker.py OUT.json

Every rank builds the same tiny MoE (same seed, weights drawn from N(0, 0.5): peaked routing, expert outputs
far above 1e-5), splits it by experts and by neurons (gptlite_ep.parallel_moe_model), and compares each split
with its own single-process model on its rows of a batch: logits, greedy cached tokens, and the assignments
dropped, dropless and at capacity factors that drop some. Rank 0 writes the figures (the worst over the ranks,
the drops summed) to OUT.json.
"""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gptlite_ep import parallel_moe_model, split_batch  # noqa: E402
from gptlite_kvcache import StaticKVCache, generate_kvcache  # noqa: E402
from gptlite_moe import GPTlite_MoE  # noqa: E402
from lib import distributed, files, harness  # noqa: E402

CONFIG = dict(vocab_size=65, d_model=16, n_heads=2, d_head=8, n_layers=2, dropout_p=0.0, seqlen=16, n_experts=4,
              top_k=2, d_expert=8)
TIMEOUT_S = 300


def tiny_moe(**kwargs):
    torch.manual_seed(0)
    model = GPTlite_MoE(**CONFIG, **kwargs).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model


@torch.inference_mode()
def main():
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    d = distributed.init("cpu", timeout_s=TIMEOUT_S)
    figures = {}
    with distributed.collective_errors(TIMEOUT_S):
        x = torch.randint(65, (4, 16), generator=torch.Generator().manual_seed(1))
        for kind, kwargs in (("plain", {}), ("sigmoid_shared", dict(router="sigmoid", shared_expert=True))):
            single = tiny_moe(**kwargs)
            modes = ("expert",) if kwargs.get("shared_expert") else ("expert", "tensor")
            for mode in modes:
                model = parallel_moe_model(single, d.rank, d.world_size, mode)
                rows = (lambda b: split_batch(b, d.rank, d.world_size)) if mode == "expert" else (lambda b: b)
                for factor in (None, 0.5, 1.0):
                    for layer in (*single.moe_layers(), *model.moe_layers()):
                        layer.capacity_factor = factor
                    expected = single(x)[0]
                    single_dropped = sum(layer.routing.dropped for layer in single.moe_layers())
                    diff = (model(rows(x))[0] - rows(expected)).abs().max()
                    dropped = torch.tensor(float(sum(layer.routing.dropped for layer in model.moe_layers())))
                    if mode == "tensor" and d.rank != 0:
                        dropped.zero_()  # every rank routes alike: rank 0 counts
                    prompts = x[:, :5]
                    tokens = generate_kvcache(model, rows(prompts), 10, 16,
                                              StaticKVCache.for_model(model, len(rows(prompts))))
                    mismatch = torch.tensor(0.0 if torch.equal(tokens, rows(generate_kvcache(single, prompts, 10, 16)))
                                            else 1.0)
                    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
                    dist.all_reduce(mismatch, op=dist.ReduceOp.MAX)
                    dist.all_reduce(dropped)
                    figures[f"{kind}/{mode}/{factor}"] = dict(
                        logits_max_diff=diff.item(), tokens_equal=mismatch.item() == 0, dropped=int(dropped),
                        single_dropped=single_dropped, calls=model.comm.calls)
    if d.rank == 0:
        files.atomic_write_bytes(json.dumps(dict(world_size=d.world_size, figures=figures)).encode(), out)
    distributed.shutdown()


if __name__ == "__main__":
    harness.run(main)
