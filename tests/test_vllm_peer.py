"""lib/vllm_peer: vLLM's rows are skipped with one line when its environment is missing, fails or hangs, and no
process of its worker outlives the peer (fake workers: no vLLM needed); with vLLM's environment present, its tokens
on a trace equal generating each request alone."""
import json
import time

import pytest
import torch
from types import SimpleNamespace

import main_continuous_batching
import inference_utils as iu
from lib import serving, vllm_peer

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


def recorded_pairs(experiments):
    """The pairs that main_continuous_batching's experiments build, with a stand-in for vLLM's engines that records
    their settings: [(the paged engine's row, vLLM's row, vLLM's settings)]."""
    def vllm(**settings):
        return settings
    return [tuple(variants) + (list(variants.values())[1],) for _, _, variants, _ in experiments(vllm, "x")]


def trace_args(**flags):
    return SimpleNamespace(**dict(chunk_size=16, batch_size=8, block_size=8, n_blocks=None) | flags)


def test_a_long_prompt_trace_also_pairs_whole_prompts_and_a_larger_budget_with_vllm():
    base = main_continuous_batching.GPTlite(65, 32, 2, 16, 1, 0.0, 128)
    data = torch.randint(0, 65, (4096,))
    for median, expected in [(20, ["budget 24 (batch 8)", "budget 48 (batch 32)"]),
                             (80, ["no chunked prefill (batch 8)", "budget 24 (batch 8)", "budget 48 (batch 32)",
                                   "budget 72 (batch 8)"])]:
        trace = serving.make_trace(data, 32, 100.0, 128, median, 4)
        assert (iu.median([len(p) for p, _ in trace[0]]) >= 64) == (median == 80)  # 4 chunks of 16: a long trace
        pairs = recorded_pairs(main_continuous_batching.vllm_experiments(base, (*trace, None), trace_args(), 128))
        assert [theirs.split(", ", 1)[1] for _, theirs, _ in pairs] == expected
    ours = [o for o, _, _ in pairs]
    assert ours == ["paged, whole prompts (batch 8)", "paged, chunked prefill 16 (batch 8)",
                    "paged, chunked prefill 16 (batch 32)", "paged, chunked prefill 64 (batch 8)"]
    settings = [s for _, _, s in pairs]
    assert [s["token_budget"] for s in settings] == [8 * 128, 24, 48, 72]
    assert [s.get("chunked", True) for s in settings] == [False, True, True, True]
    # the same KV memory: the paged engine's batch * seqlen tokens in blocks of 8, vLLM's in blocks of 32
    assert [s["n_blocks"] for s in settings] == [32, 32, 128, 32]
    assert main_continuous_batching.vllm_blocks(10, 8) == 3  # rounded up: 80 tokens need three 32-token blocks


def test_prefix_sharing_pairs_each_variant_with_vllm_prefix_caching_alike():
    experiments = [("system prompt", "t1", None, {"chunked": 0, "shared, prefix sharing": 1}, 128),
                   ("multi-turn, 256 blocks", "t2", None, {"shared, prefix sharing": 2}, 256)]
    pairs = recorded_pairs(main_continuous_batching.vllm_sharing_experiments(experiments, trace_args()))
    assert [(o, t) for o, t, _ in pairs] == [
        ("system prompt, no sharing", "system prompt, vLLM x, prefix caching off"),
        ("system prompt, prefix sharing", "system prompt, vLLM x, prefix caching on"),
        ("multi-turn, 256 blocks, prefix sharing", "multi-turn, 256 blocks, vLLM x, prefix caching on")]
    assert [(s["prefix_caching"], s["n_blocks"], s["token_budget"]) for _, _, s in pairs] == [
        (False, 32, 24), (True, 32, 24), (True, 64, 24)]


needs_vllm = pytest.mark.skipif(vllm_peer.python_or_none() is None,
                                reason=f"no vLLM environment (create it with `{vllm_peer.INSTALL}`)")


@needs_vllm
def test_vllm_on_a_trace_gives_each_request_its_tokens_alone(real_data, tmp_path):
    out = tmp_path / "c.json"
    main_continuous_batching.main(TRACE + ["--variants", "chunked", "--json", str(out)])
    result = json.loads(out.read_text())
    rows = result["tables"][0]["rows"]
    assert [r["variant"].split(" (")[0].split(" 0.")[0] for r in rows] == [
        "paged, chunked prefill 16", "vLLM"] * 2
    assert all(r["same"] == "yes" for r in rows)
    assert all(r["vs_vllm"] is None or r["vs_vllm"] > 0 for r in rows[::2]) and all(r["block_tokens"] == 32 for r in rows[1::2])
    assert any(c.startswith("vLLM ") and c.endswith("every request's tokens equal generating it alone")
               for c in result["checks"]) if "checks" in result else True


@needs_vllm
def test_vllm_prefix_caching_finds_the_shared_prompt_and_keeps_the_tokens(real_data, tmp_path):
    out = tmp_path / "p.json"
    main_continuous_batching.main(["--untrained", "--preset", "cpu", "--device", "cpu", "--prefix-sharing",
                                   "--n-requests", "8", "--turns", "2", "--system-len", "64", "--prompt-median", "8",
                                   "--output-median", "4", "--repeats", "1", "--json", str(out)])
    rows = {r["variant"]: r for r in json.loads(out.read_text())["tables"][0]["rows"]}
    assert len(rows) == 10 and all(r["same"] == "yes" for r in rows.values())
    vllm = [r for name, r in rows.items() if ", vLLM " in name]
    # caching off finds nothing; on, the 64-token system prompt (two full 32-token blocks) of every later request
    assert [r["hit_rate"] for r in vllm if r["variant"].endswith("off")] == [0.0, 0.0]
    system_on = next(r for r in vllm if r["variant"].startswith("system prompt") and r["variant"].endswith("on"))
    assert system_on["hit_rate"] > 0.3
