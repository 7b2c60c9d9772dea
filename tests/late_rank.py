"""A torchrun wrapper of the tests (not a test file: pytest does not collect it): it runs a worker
with one rank late, as a busy machine makes a rank, to show that a correct run does not trip a timeout.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/late_rank.py RANK DELAY_S WORKER ARGS...

Rank RANK sleeps DELAY_S seconds before it starts WORKER (its peers wait for it to join the process
group), and again before its first dist.all_reduce and its first dist.send (its peers wait for it in
the collective or the receive). Every other rank runs WORKER ARGS as torchrun would.
"""
import os
import runpy
import sys
import time

import torch.distributed as dist


def late(fn, delay_s):
    """fn, whose first call starts delay_s seconds late."""
    first = [True]

    def wrapper(*args, **kwargs):
        if first:
            first.clear()
            time.sleep(delay_s)
        return fn(*args, **kwargs)
    return wrapper


def main():
    rank, delay_s, worker, args = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4:]
    if int(os.environ["RANK"]) == rank:
        time.sleep(delay_s)
        dist.all_reduce = late(dist.all_reduce, delay_s)  # the callers look them up in the module at each call
        dist.send = late(dist.send, delay_s)
    sys.argv = [worker, *args]
    runpy.run_path(worker, run_name="__main__")


if __name__ == "__main__":
    main()
