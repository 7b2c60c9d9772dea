"""A torchrun worker of tests/test_pipeline_parallel.py (not a test file: pytest does not collect it).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/pp_worker.py check OUT.json
    ... tests/pp_worker.py die OUT.json      # rank 1 exits in the middle of the generation
    ... tests/pp_worker.py hang OUT.json     # rank 1 stops answering; rank 0's barrier times out

`check`: every rank builds the same tiny GPTlite_KVCache of 4 blocks (weights drawn from N(0, 0.5): peaked
attention, a wrong cache or position shows in the tokens), takes its stage of 2, and generates a batch of 5
prompts in 1, 2 and 3 micro-batches (uneven); the last stage compares the tokens with one process's
generate_kvcache; rank 0 writes the figures (every rank's agreement and bytes) to OUT.json.
"""
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gptlite_kvcache import GPTlite_KVCache, generate_kvcache  # noqa: E402
from gptlite_pp import pipeline_generate, pipeline_stage  # noqa: E402
from gptlite_tp import CommStats  # noqa: E402
from lib import distributed, files, harness  # noqa: E402

CONFIG = dict(vocab_size=65, d_model=32, n_heads=3, d_head=8, n_layers=4, dropout_p=0.0, seqlen=16)
TIMEOUT_S = 300
FAULT_TIMEOUT_S = 3


@torch.inference_mode()
def main():
    mode, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPTlite_KVCache(**CONFIG).eval()
    for p in model.parameters():
        p.normal_(0.0, 0.5)
    prompts = torch.randint(65, (5, 6), generator=torch.Generator().manual_seed(1))
    expected = generate_kvcache(model, prompts, 8, 16)[:, 6:]
    timeout_s = FAULT_TIMEOUT_S if mode in ("die", "hang") else TIMEOUT_S
    d = distributed.init("cpu", timeout_s=timeout_s)
    stage = pipeline_stage(model, d.rank, d.world_size)
    group = distributed.new_group(range(d.world_size), timeout_s)
    figures = {}
    with distributed.collective_errors(timeout_s):
        if mode in ("die", "hang") and d.rank == 1:  # in the middle: after the first micro-batch of the prefill
            x = torch.empty(5, 6, CONFIG["d_model"])  # m = 1: the whole batch
            dist.recv(x, 0)
            os._exit(3) if mode == "die" else time.sleep(3600)  # silent until torchrun ends it
        for m in (1, 2, 3):
            comm = CommStats()
            tokens, timeline = pipeline_generate(stage, list(prompts.tensor_split(m)), 8, comm, group)
            same = torch.tensor(float(tokens is None or torch.equal(torch.cat(tokens), expected)))
            dist.all_reduce(same, op=dist.ReduceOp.MIN)
            sent = torch.tensor(float(comm.nbytes))
            dist.all_reduce(sent)
            figures[m] = dict(tokens_equal=same.item() == 1.0, sent_bytes=sent.item(),
                              busy=timeline.busy, wall=timeline.wall)
    if d.rank == 0:
        files.atomic_write_bytes(json.dumps(dict(world_size=d.world_size, figures=figures)).encode(), out)
    distributed.shutdown()


if __name__ == "__main__":
    harness.run(main)
