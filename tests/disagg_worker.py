"""A torchrun worker of tests/test_disaggregation.py (not a test file: pytest does not collect it).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/disagg_worker.py MODE OUT.json

MODE: `check` (a small trace, a pool small enough to preempt, served twice: clean, then with the
payloads of requests 1 and 4 changed on the way), `die` (the prefill worker exits after sending 2 requests), `hang` (it stops
answering after 2), `oom` (it runs out of memory after 2: an allocation that fails). Both ranks build
the same tiny model (same seed, weights drawn from N(0, 0.5)) and trace before they join the group;
rank 0 writes the outputs, the references (generate_kvcache alone) and the stats to OUT.json.
Timeouts: joining waits distributed.STARTUP_TIMEOUT_S; `check` and `oom` wait TIMEOUT_S for a peer,
which no correct run on a busy machine comes near; `die` and `hang` wait FAULT_TIMEOUT_S, so that
the silent peer's error comes within seconds.
"""
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import inference_utils as iu  # noqa: E402
from gptlite_kvcache import GPTlite_KVCache  # noqa: E402
from lib import disaggregation  # noqa: E402
from lib import distributed  # noqa: E402
from lib import serving  # noqa: E402
from lib import files, harness  # noqa: E402

CONFIG = dict(vocab_size=65, d_model=32, n_heads=3, d_head=8, n_layers=2, dropout_p=0.0, seqlen=16)  # TINY
TIMEOUT_S = 300  # a transfer or barrier of a correct run
FAULT_TIMEOUT_S = 3  # die and hang: the peer's error has to come quickly


def tiny_model():
    torch.manual_seed(0)
    model = GPTlite_KVCache(**CONFIG).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model


def fail_after(n_sent, how):
    """Make the prefill worker exit (die), stop answering (hang) or run out of memory (oom) after
    sending n_sent requests."""
    send, sent = disaggregation.send_prefilled, []

    def failing(*args, **kwargs):
        if len(sent) == n_sent:
            if how == "die":
                os._exit(3)
            if how == "oom":
                torch.empty(2**50, dtype=torch.uint8)  # 1 PiB: more than any machine's memory and address space
            time.sleep(60)
        sent.append(1)
        return send(*args, **kwargs)
    disaggregation.send_prefilled = failing


def main():
    mode, out = sys.argv[1], Path(sys.argv[2])
    timeout_s = FAULT_TIMEOUT_S if mode in ("die", "hang") else TIMEOUT_S
    torch.set_num_threads(1)
    model = tiny_model()
    source = torch.randint(65, (400,), generator=torch.Generator().manual_seed(1))
    requests, arrivals = serving.make_trace(source, 8, 400.0, CONFIG["seqlen"], 7, 4, seed=0)
    reference = serving.reference_outputs(model, requests, CONFIG["seqlen"])
    if mode in ("die", "hang", "oom") and distributed.rank() == disaggregation.PREFILL_RANK:
        fail_after(2, mode)
    d = distributed.init("cpu", timeout_s=timeout_s)
    runs = {}
    with distributed.collective_errors(timeout_s, memory_hint="lower --batch-size"):
        for run in ("clean", "corrupt") if mode == "check" else (mode,):
            outputs, clock, stats = disaggregation.serve_disaggregated(
                model, requests, arrivals, n_blocks=6, block_size=4, max_seqs=3, timeout_s=timeout_s,
                corrupt=(1, 4) if run == "corrupt" else ())
            runs[run] = {"outputs": [o.tolist() for o in outputs], "first": clock.first, "last": clock.last,
                         "arrivals": clock.arrivals, **stats}
    if d.rank == 0:
        files.atomic_write_bytes(json.dumps({
            "reference": [r.tolist() for r in reference], "n_tokens": [n for _, n in requests],
            "prompt_lens": [len(p) for p, _ in requests], **runs}).encode(), out)
    distributed.shutdown()


if __name__ == "__main__":
    harness.run(main)
