"""vLLM's CPU engine as a peer of the repository's paged engine: the same weights, the same request traces.

Blog: "Continuous batching" and "PagedAttention". vLLM pins its own stack (transformers, xgrammar), so it runs in
its own environment (requirements-vllm.txt, README): this module finds that environment's Python (--vllm-python,
else GPTLITE_VLLM_PYTHON, else .venv-vllm/bin/python), writes GPTlite there as a GPT2LMHeadModel directory
(lib/engines.to_gpt2: the head's bias folded into the final LayerNorm), and drives lib/vllm_worker.py in a child
process: one command a line on its stdin, one JSON answer a line on a pipe of its own. The worker replays a trace
on the serving clock of lib/serving.py, so vLLM's TTFT and TPOT are measured as the paged engine's are.
Anything that goes wrong (no environment, vLLM failing to start, a timeout) is a VLLMError with one line; the
child is killed with its whole process group when the peer closes, whatever happened.
"""
import json
import os
import select
import signal
import subprocess
from pathlib import Path

from lib import engines

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).with_name("vllm_worker.py")
INSTALL = ("python -m venv .venv-vllm && .venv-vllm/bin/pip install -r requirements-vllm.txt && "
           ".venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec")


class VLLMError(RuntimeError):
    """vLLM's rows cannot be measured: the one line that says why."""


def find_python(flag=None):
    """The vLLM environment's Python: `flag` (--vllm-python), else $GPTLITE_VLLM_PYTHON, else .venv-vllm/bin/python
    in the repository; a VLLMError naming where it looked when there is none."""
    path = flag or os.environ.get("GPTLITE_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python"
    where = "--vllm-python" if flag else "GPTLITE_VLLM_PYTHON" if os.environ.get("GPTLITE_VLLM_PYTHON") else "the default"
    if not Path(path).is_file() or not os.access(path, os.X_OK):
        raise VLLMError(f"no vLLM environment at {path} ({where}): create it with `{INSTALL}`; its rows are skipped")
    return str(path)


class VLLMPeer:
    """`with VLLMPeer(python, timeout) as peer:` a worker process in vLLM's environment; peer.engine(...) builds an
    engine under a key, peer.run(key, requests, clock) replays a trace through it."""

    def __init__(self, python, timeout=600, log=None):
        self.python, self.timeout, self.log = python, timeout, log
        self.proc = None

    def __enter__(self):
        read, write = os.pipe()
        log = open(self.log or os.devnull, "ab")
        try:
            self.proc = subprocess.Popen([self.python, str(WORKER), str(write)], stdin=subprocess.PIPE, stdout=log,
                                         stderr=log, pass_fds=(write,), start_new_session=True, cwd=ROOT)
        except OSError as error:
            os.close(read)
            raise VLLMError(f"{self.python} does not start ({error}); its rows are skipped") from None
        finally:
            os.close(write)
            log.close()
        self.answers = os.fdopen(read, "r")
        try:
            ready = self._answer("start")
            if "error" in ready:
                raise VLLMError(f"{self.python}: {ready['error']}; its rows are skipped")
        except BaseException:
            self.close()
            raise
        self.version = ready["ready"]
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Stop the worker and everything it started (its process group), then reap it."""
        if self.proc is None:
            return
        try:
            self.proc.stdin.write(b'{"cmd": "quit"}\n')
            self.proc.stdin.flush()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever is left of the group
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.answers.close()
        self.proc = None

    def _answer(self, what):
        ready, _, _ = select.select([self.answers], [], [], self.timeout)
        line = self.answers.readline() if ready else None
        if not line:
            status = self.proc.poll()
            why = f"did not answer within {self.timeout} s" if line is None and status is None else (
                f"exited (status {status})")
            raise VLLMError(f"vLLM's worker {why} during {what}; its rows are skipped")
        return json.loads(line)

    def _call(self, command, what):
        try:
            self.proc.stdin.write((json.dumps(command) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            raise VLLMError(f"vLLM's worker exited before {what}; its rows are skipped") from None
        answer = self._answer(what)
        if "error" in answer:
            raise VLLMError(f"vLLM failed during {what}: {answer['error']}; its rows are skipped")
        return answer

    def engine(self, key, model_dir, seqlen, batch_size, block_size, token_budget, chunked, prefix_caching,
               n_blocks=None):
        """Build engine `key`: at most batch_size sequences, KV blocks of block_size tokens, token_budget tokens a
        step (prompts split into chunks when `chunked`), automatic prefix caching on or off, a pool of n_blocks
        blocks that vLLM can fill (its null block comes on top; None: what 1 GiB holds)."""
        self._call(dict(cmd="engine", key=key, model=str(model_dir), max_model_len=seqlen, max_num_seqs=batch_size,
                        block_size=block_size, max_num_batched_tokens=token_budget, enable_chunked_prefill=chunked,
                        enable_prefix_caching=prefix_caching, num_blocks=None if n_blocks is None else n_blocks + 1),
                   f"the start of engine {key}")

    def run(self, key, requests, clock):
        """The trace (requests, clock.arrivals) through engine `key`, its times written into the serving clock `clock`
        as the paged engine writes its own (serving.latency_figures reads it): (outputs [prompt + new tokens, 1-D
        LongTensor] in request order, KV blocks in use after each step (its null block not counted), each request's
        prompt tokens found in the prefix cache)."""
        import torch
        answer = self._call(dict(cmd="run", key=key, prompts=[p.tolist() for p, _ in requests],
                                 n_tokens=[n for _, n in requests], arrivals=list(clock.arrivals)), f"a run of {key}")
        clock.first, clock.last, clock.busy, clock.n_steps = answer["first"], answer["last"], answer["busy"], answer["steps"]
        clock.now = max(answer["last"]) if requests else 0.0
        clock.slot_steps = sum(n for _, n in requests)  # vLLM does not say its padded rows: none counted as wasted
        outputs = [torch.cat([p, p.new_tensor(t)]) for (p, _), t in zip(requests, answer["tokens"])]
        return outputs, [b - 1 for b in answer["blocks"]], answer["cached"]


def write_model(model, folder):
    """GPTlite `model` as a transformers GPT2LMHeadModel directory in `folder` (safetensors), for vLLM."""
    engines.to_gpt2(model).save_pretrained(folder)
    return folder


def python_or_none(flag=None):
    """find_python, or None where there is no vLLM environment."""
    try:
        return find_python(flag)
    except VLLMError:
        return None
