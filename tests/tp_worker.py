"""A torchrun worker of tests/test_tensor_parallel.py (not a test file: pytest does not collect it).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/tp_worker.py check OUT.json
    ... tests/tp_worker.py die OUT.json      # rank 1 exits mid-generation
    ... tests/tp_worker.py hang OUT.json     # rank 1 stops answering; the collective times out
    ... tests/tp_worker.py oom OUT.json      # rank 0 runs out of memory (a real allocation that fails)
    ... tests/tp_worker.py memoryerror OUT.json   # rank 0's own code raises MemoryError

`check`: every rank builds the tiny model (same seed, weights drawn from N(0, 0.5)), cuts its shard,
and compares the tensor-parallel logits and greedy cached tokens with its own single-process model;
rank 0 writes the figures to OUT.json. Every rank builds its model before it joins the group.
Timeouts: joining waits distributed.STARTUP_TIMEOUT_S; the collectives of `check` and of the
memory modes wait TIMEOUT_S, which no correct run on a busy machine comes near; `die` and `hang`
wait FAULT_TIMEOUT_S, so that the silent peer's error comes within seconds.
"""
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import inference_utils as iu  # noqa: E402
from gptlite_kvcache import GPTlite_KVCache, StaticKVCache, generate_kvcache  # noqa: E402
from gptlite_tp import tensor_parallel_model  # noqa: E402
from lib import distributed  # noqa: E402
from lib import files, harness  # noqa: E402

# TINY of conftest.py with 4 heads (2 ranks split them); n_heads * d_head (24) != d_model (32) as there
CONFIG = dict(vocab_size=65, d_model=32, n_heads=4, d_head=6, n_layers=2, dropout_p=0.0, seqlen=16)
TIMEOUT_S = 300  # a collective of a correct run
FAULT_TIMEOUT_S = 3  # die and hang: the peer's error has to come quickly


def tiny_model():
    torch.manual_seed(0)
    model = GPTlite_KVCache(**CONFIG).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)  # peaked attention: a wrong head or shard shows far above 1e-5
    return model


@torch.inference_mode()
def main():
    mode, out = sys.argv[1], Path(sys.argv[2])
    timeout_s = FAULT_TIMEOUT_S if mode in ("die", "hang") else TIMEOUT_S
    torch.set_num_threads(1)
    single = tiny_model()
    tp = tensor_parallel_model(single.state_dict(), CONFIG, distributed.rank(), distributed.world_size())
    x = torch.randint(65, (3, CONFIG["seqlen"]), generator=torch.Generator().manual_seed(1))
    prompts = x[:, :5]
    d = distributed.init("cpu", timeout_s=timeout_s)
    with distributed.collective_errors(timeout_s, memory_hint="lower --batch-size"):
        if mode == "die" and d.rank == 1:
            os._exit(3)
        if mode == "hang" and d.rank == 1:
            time.sleep(60)
        logits_diff = (tp(x)[0] - single(x)[0]).abs().max().item()
        if mode == "oom" and d.rank == 0:
            torch.empty(2**50, dtype=torch.uint8)  # 1 PiB: more than any machine's memory and address space
        if mode == "memoryerror" and d.rank == 0:
            raise MemoryError("rank 0 could not allocate its buffers")
        expected = generate_kvcache(single, prompts, 11, CONFIG["seqlen"])
        dynamic = generate_kvcache(tp, prompts, 11, CONFIG["seqlen"])
        static = generate_kvcache(tp, prompts, 11, CONFIG["seqlen"], kv_cache=StaticKVCache.for_model(tp, 3))
        cache = StaticKVCache.for_model(tp, 3)
    if d.rank == 0:
        files.atomic_write_bytes(json.dumps({
            "world_size": d.world_size, "logits_max_diff": logits_diff,
            "tokens_equal": torch.equal(dynamic, expected), "static_tokens_equal": torch.equal(static, expected),
            "kv_heads": cache.keys.shape[2], "kv_bytes": cache.nbytes,
            "single_kv_bytes": StaticKVCache.for_model(single, 3).nbytes,
            "all_reduce_calls": tp.all_reduce.calls}).encode(), out)
    distributed.shutdown()


if __name__ == "__main__":
    harness.run(main)
