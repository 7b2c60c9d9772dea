"""lib/vllm_peer: vLLM's rows are skipped with one line when its environment is missing, fails or hangs, and no
process of its worker outlives the peer (fake workers: no vLLM needed); with vLLM's environment present, its tokens
on a trace equal generating each request alone."""
import json
import os
import time

import pytest

import main_continuous_batching
from lib import vllm_peer

TRACE = ["--untrained", "--preset", "cpu", "--device", "cpu", "--n-requests", "6", "--prompt-median", "8",
         "--output-median", "4", "--repeats", "1", "--batch-size", "2"]


def fake_python(tmp_path, body):
    """An executable standing in for the vLLM environment's Python: called as `python worker.py FD`."""
    path = tmp_path / "python"
    path.write_text("#!/bin/bash\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def alive(pid, grace=5.0):
    """Whether process pid still runs after up to `grace` seconds (a killed orphan is a zombie until init reaps it:
    that counts as gone)."""
    deadline = time.monotonic() + grace
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                running = f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            running = False
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.1)


def test_a_missing_environment_is_one_line_and_the_other_rows_are_measured(real_data, tmp_path, capsys):
    out = tmp_path / "c.json"
    main_continuous_batching.main(TRACE + ["--vllm-python", str(tmp_path / "nowhere"), "--json", str(out)])
    result = json.loads(out.read_text())
    line = next(s for s in result["summary"] if s.startswith("no vLLM environment at"))
    assert "--vllm-python" in line and vllm_peer.INSTALL in line and line.endswith("its rows are skipped")
    assert len(result["rows"]) == 4 and "tables" not in result or not result["tables"]


def test_a_worker_that_exits_is_one_clear_error(tmp_path):
    with pytest.raises(vllm_peer.VLLMError, match=r"exited \(status 3\) during start; its rows are skipped"):
        with vllm_peer.VLLMPeer(fake_python(tmp_path, "exit 3"), timeout=30):
            pass


def test_a_worker_whose_vllm_does_not_import_is_one_clear_error(tmp_path):
    python = fake_python(tmp_path, """echo '{"error": "vllm does not import: ModuleNotFoundError"}' >&$2""")
    with pytest.raises(vllm_peer.VLLMError, match="vllm does not import: ModuleNotFoundError; its rows are skipped"):
        with vllm_peer.VLLMPeer(python, timeout=30):
            pass


def test_a_silent_worker_times_out_and_leaves_no_process(tmp_path):
    pids = tmp_path / "pids"
    python = fake_python(tmp_path, f"sleep 300 & echo $! > {pids}; echo $$ >> {pids}; wait")
    start = time.monotonic()
    with pytest.raises(vllm_peer.VLLMError, match="did not answer within 2 s during start"):
        with vllm_peer.VLLMPeer(python, timeout=2):
            pass
    assert time.monotonic() - start < 30
    assert not any(alive(int(p)) for p in pids.read_text().split())  # the worker and the child it started


def test_closing_the_peer_kills_what_its_worker_started(tmp_path):
    pids = tmp_path / "pids"
    python = fake_python(tmp_path, f"""sleep 300 & echo $! > {pids}; echo '{{"ready": "fake 0"}}' >&$2; cat > /dev/null""")
    with vllm_peer.VLLMPeer(python, timeout=30) as peer:
        assert peer.version == "fake 0"
        child = int(pids.read_text())
        assert alive(child, grace=0)
        with pytest.raises(vllm_peer.VLLMError, match="did not answer within 1 s during the start of engine k"):
            peer.timeout = 1
            peer.engine("k", tmp_path, 128, 2, 32, 18, chunked=True, prefix_caching=False)
    assert not alive(child)


needs_vllm = pytest.mark.skipif(vllm_peer.python_or_none() is None,
                                reason=f"no vLLM environment (create it with `{vllm_peer.INSTALL}`)")


@needs_vllm
def test_vllm_on_a_trace_gives_each_request_its_tokens_alone(real_data, tmp_path):
    out = tmp_path / "c.json"
    main_continuous_batching.main(TRACE + ["--variants", "chunked", "--json", str(out)])
    result = json.loads(out.read_text())
    rows = result["tables"][0]["rows"]
    assert [r["variant"].split(" (")[0].split(" 0.")[0] for r in rows] == ["paged, chunked prefill 16", "vLLM"] * 2
    assert all(r["same"] == "yes" for r in rows)
    assert all(r["vs_vllm"] is None or r["vs_vllm"] > 0 for r in rows[::2]) and all(r["block_tokens"] == 32 for r in rows[1::2])
    assert any(c.startswith("vLLM ") and c.endswith("every request's tokens equal generating it alone")
               for c in result["checks"]) if "checks" in result else True
