"""vLLM's CPU engine serving request traces: the worker that lib/vllm_peer.py starts in vLLM's own environment.

    .venv-vllm/bin/python lib/vllm_worker.py RESULT_FD     # commands on stdin, one JSON object a line

Runs only with the standard library and vllm (it is not run by the repository's environment, and imports nothing
of the repository). Commands, each answered by one JSON line on the file descriptor RESULT_FD (vLLM's own logs go
to stdout and stderr):
- {"cmd": "engine", "key": K, "model": DIR, "max_model_len": S, "max_num_seqs": B, "block_size": N,
  "max_num_batched_tokens": T, "enable_chunked_prefill": bool, "enable_prefix_caching": bool, "num_blocks": M}:
  build an engine (vLLM's LLM, in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0) with a pool of M KV blocks (vLLM's
  null block included; null: what 1 GiB holds), kept under K.
- {"cmd": "run", "key": K, "prompts": [[ids]], "n_tokens": [n], "arrivals": [s]}: replay the trace through engine K
  on the serving clock of lib/serving.py (measured step times, idle gaps skipped: a request is added once the clock
  has passed its arrival), greedy, exactly n_tokens new tokens each, from an empty prefix cache. Answers the tokens,
  each request's first and last token's clock and its prompt tokens found in the prefix cache, the busy seconds,
  the steps and the KV blocks in use after each step.
- {"cmd": "quit"}.
"""
import json
import os
import sys
import time
import traceback
from collections import deque


def build(command):
    from vllm import LLM
    return LLM(model=command["model"], skip_tokenizer_init=True, dtype="float32", seed=0, enforce_eager=True,
               max_model_len=command["max_model_len"], max_num_seqs=command["max_num_seqs"],
               block_size=command["block_size"], max_num_batched_tokens=command["max_num_batched_tokens"],
               enable_chunked_prefill=command["enable_chunked_prefill"],
               enable_prefix_caching=command["enable_prefix_caching"],
               num_gpu_blocks_override=command.get("num_blocks"))


def block_pool(llm):
    """vLLM's pool of KV blocks (in this process: the in-process engine core's scheduler), or None."""
    try:
        return llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    except AttributeError:
        return None


def replay(llm, command):
    from vllm import SamplingParams
    engine, pool = llm.llm_engine, block_pool(llm)
    arrivals, n_tokens = command["arrivals"], command["n_tokens"]
    n = len(arrivals)
    tokens, first, last, cached = [None] * n, [None] * n, [None] * n, [0] * n
    llm.reset_prefix_cache()  # each run starts cold, as a new engine of the repository's does
    now = busy = 0.0
    steps, blocks = 0, []
    waiting = deque(sorted(range(n), key=lambda i: arrivals[i]))
    while waiting or engine.has_unfinished_requests():
        start = time.perf_counter()
        while waiting and arrivals[waiting[0]] <= now:
            i = waiting.popleft()
            engine.add_request(str(i), {"prompt_token_ids": command["prompts"][i]},
                               SamplingParams(max_tokens=n_tokens[i], min_tokens=n_tokens[i], temperature=0.0,
                                              ignore_eos=True, detokenize=False))
        if not engine.has_unfinished_requests():
            now = max(now, arrivals[waiting[0]])  # idle: skip to the next arrival
            continue
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        now, busy, steps = now + elapsed, busy + elapsed, steps + 1
        if pool is not None:
            blocks.append(pool.num_gpu_blocks - pool.get_num_free_blocks())
        for out in outputs:
            i, got = int(out.request_id), list(out.outputs[0].token_ids)
            if got and first[i] is None:
                first[i] = now
            if out.finished:
                last[i], tokens[i], cached[i] = now, got, out.num_cached_tokens or 0
    return {"tokens": tokens, "first": first, "last": last, "busy": busy, "steps": steps, "blocks": blocks,
            "cached": cached}


def main():
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: steps timed here
    # 1 GiB of KV cache: by default the CPU backend reserves 92% of the machine's memory, and refuses to start
    # when that much is not free
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    out = os.fdopen(int(sys.argv[1]), "w", buffering=1)
    engines = {}
    try:
        import vllm
        out.write(json.dumps({"ready": vllm.__version__}) + "\n")
    except Exception as error:  # noqa: BLE001 (the parent prints this one line)
        out.write(json.dumps({"error": f"vllm does not import: {type(error).__name__}: {error}"}) + "\n")
        return
    for line in sys.stdin:
        command = json.loads(line)
        try:
            if command["cmd"] == "quit":
                break
            if command["cmd"] == "engine":
                engines[command["key"]] = build(command)
                answer = {"ok": True}
            else:
                answer = replay(engines[command["key"]], command)
        except Exception as error:  # noqa: BLE001 (one line back to the parent, the traceback in the log)
            traceback.print_exc()
            answer = {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}
        out.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    main()
