"""Static and continuous batching (the post's) against generating each request alone; steps; bad input;
the serving clock and trace; both scripts end to end on random weights."""
import json

import pytest
import torch
from conftest import TINY, renders_on_its_page

import inference_utils as iu
import main_continuous_batching
import main_static_batching
from gptlite_kvcache import generate_kvcache
from lib import harness, serving
from main_continuous_batching import continuous_batching
from main_static_batching import next_tokens, static_batching

SEQLEN = TINY["seqlen"]


def random_requests(n, seed, max_prompt=SEQLEN - 1):
    """n requests with random prompt lengths and output lengths that fit the window."""
    g = torch.Generator().manual_seed(seed)
    requests = []
    for _ in range(n):
        prompt_len = int(torch.randint(1, max_prompt + 1, (1,), generator=g))
        n_tokens = int(torch.randint(1, SEQLEN - prompt_len + 1, (1,), generator=g))
        requests.append((torch.randint(TINY["vocab_size"], (prompt_len,), generator=g), n_tokens))
    return requests


def one_at_a_time(cached, requests):
    return [generate_kvcache(cached, prompt[None], n, SEQLEN)[0] for prompt, n in requests]


def assert_same(outputs, expected):
    assert len(outputs) == len(expected)
    for i, (o, e) in enumerate(zip(outputs, expected)):
        assert torch.equal(o, e), f"request {i}: {o.tolist()} != {e.tolist()}"


def test_next_tokens_reads_each_sequence_at_its_own_last_position(tiny_models):
    base, _ = tiny_models
    sequences = [r[0] for r in random_requests(5, seed=1)]
    alone = torch.stack([base(s[None])[0, -1].argmax() for s in sequences])
    assert torch.equal(next_tokens(base, sequences, SEQLEN), alone)
    assert len({len(s) for s in sequences}) > 1  # the padding really differs between sequences
    with pytest.raises(ValueError, match="no sequences"):
        next_tokens(base, [], SEQLEN)
    with pytest.raises(ValueError, match="does not fit the window"):
        next_tokens(base, [torch.ones(SEQLEN + 1, dtype=torch.long)], SEQLEN)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("batch_size", [1, 3, 16])
def test_static_and_continuous_batching_equal_one_request_at_a_time(tiny_models, seed, batch_size):
    base, cached = tiny_models
    requests = random_requests(9, seed)
    expected = one_at_a_time(cached, requests)
    static, n_static = static_batching(base, requests, batch_size, SEQLEN)
    continuous, n_continuous = continuous_batching(base, requests, batch_size, SEQLEN)
    assert_same(static, expected)
    assert_same(continuous, expected)
    assert n_continuous <= n_static
    # static: each batch runs as long as its longest request; batch 1: one step per token
    lengths = [n for _, n in requests]
    assert n_static == sum(max(lengths[i:i + batch_size]) for i in range(0, len(lengths), batch_size))
    if batch_size == 1:
        assert n_continuous == n_static == sum(lengths)
    if batch_size >= len(requests):
        assert n_continuous == max(lengths)


def test_continuous_never_takes_more_steps_than_static_on_random_workloads(tiny_models):
    base, _ = tiny_models
    for seed in range(12):
        requests = [(torch.zeros(1, dtype=torch.long), n) for _, n in random_requests(12, seed + 100)]
        for batch_size in (2, 5):
            clock_s, clock_c = (serving.ServingClock.offline(requests) for _ in range(2))
            _, n_static = static_batching(base, requests, batch_size, SEQLEN, clock_s)
            _, n_continuous = continuous_batching(base, requests, batch_size, SEQLEN, clock_c)
            assert n_continuous <= n_static
            n_new = sum(n for _, n in requests)
            assert serving.latency_figures(clock_c)["wasted_slot_steps"] == 0  # every row's token is kept
            assert clock_s.slot_steps - n_new == serving.latency_figures(clock_s)["wasted_slot_steps"] >= 0


def test_a_worked_example_of_steps_and_wasted_slot_steps(tiny_models):
    base, _ = tiny_models
    requests = [(torch.tensor([1, 2]), n) for n in (1, 9, 2, 2)]
    clock = serving.ServingClock.offline(requests)
    _, n_static = static_batching(base, requests, 2, SEQLEN, clock)
    assert n_static == 9 + 2  # batches {1, 9} and {2, 2}
    assert serving.latency_figures(clock)["wasted_slot_steps"] == (9 - 1) + 0
    _, n_continuous = continuous_batching(base, requests, 2, SEQLEN)
    assert n_continuous == 9  # the 9-token request runs while the others take turns in the other slot


def test_requests_join_only_after_they_arrive(tiny_models):
    base, cached = tiny_models
    requests = random_requests(4, seed=7)
    arrivals = [0.0, 1e3, 2e3, 3e3]  # far apart: every request runs alone
    for fn in (static_batching, continuous_batching):
        clock = serving.ServingClock(arrivals, [n for _, n in requests])
        outputs, n_steps = fn(base, requests, 4, SEQLEN, clock)
        assert_same(outputs, one_at_a_time(cached, requests))
        assert n_steps == sum(n for _, n in requests)
        for arrival, first, last in zip(arrivals, clock.first, clock.last):
            assert arrival < first <= last < arrival + 1e3
        figures = serving.latency_figures(clock)
        assert 0 < figures["ttft_arrival_ms"] <= figures["ttft_arrival_p99_ms"] and figures["tokens_per_s"] > 0


def test_trace_is_seeded_long_tailed_and_fits_the_window():
    source = torch.arange(1000) % 65
    requests, arrivals = serving.make_trace(source, 400, 50.0, 128, 32, 16, seed=3)
    again, arrivals_again = serving.make_trace(source, 400, 50.0, 128, 32, 16, seed=3)
    assert arrivals == arrivals_again and all(torch.equal(a[0], b[0]) and a[1] == b[1] for a, b in zip(requests, again))
    assert arrivals[0] == 0 and all(b >= a for a, b in zip(arrivals, arrivals[1:]))
    assert 1 / 50 * 0.8 < arrivals[-1] / 399 < 1 / 50 * 1.2  # mean gap of a Poisson process at 50/s
    prompt_lens, outputs = [len(p) for p, _ in requests], [n for _, n in requests]
    assert all(p >= 1 and n >= 1 and p + n <= 128 for p, n in zip(prompt_lens, outputs))
    assert max(outputs) > 4 * sorted(outputs)[200]  # a long tail
    _, at_once = serving.make_trace(source, 5, float("inf"), 128, 32, 16)
    assert at_once == [0.0] * 5


def test_shared_prefix_trace_puts_one_system_prompt_before_every_question():
    source = torch.arange(1000) % 65
    requests, arrivals = serving.make_shared_prefix_trace(source, 50, 50.0, 128, 64, 16, 8, seed=3)
    again, _ = serving.make_shared_prefix_trace(source, 50, 50.0, 128, 64, 16, 8, seed=3)
    system = requests[0][0][:64]
    assert all(torch.equal(p[:64], system) and len(p) > 64 and len(p) + n <= 128 for p, n in requests)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(requests, again))
    assert len({tuple(p[64:].tolist()) for p, _ in requests}) > 40  # the questions differ
    assert arrivals == serving.make_trace(source, 50, 50.0, 64, 16, 8, seed=3)[1]
    with pytest.raises(ValueError, match="system prompt needs"):
        serving.make_shared_prefix_trace(source, 5, 50.0, 128, 127, 16, 8)


def test_multi_turn_trace_resends_each_conversation_with_its_answers(tiny_models):
    _, cached = tiny_models
    source = torch.arange(500) % 65
    requests, arrivals, previous = serving.make_multi_turn_trace(cached, source, 3, 3, 20.0, 1.0, SEQLEN, 2, seed=1)
    assert len(requests) == 9 and arrivals == sorted(arrivals) and previous.count(None) == 3
    for i, j in enumerate(previous):
        prompt, n = requests[i]
        assert n == 2 and len(prompt) + n <= SEQLEN
        if j is None:
            assert len(prompt) == SEQLEN // 3 - 2  # the first message only
            continue
        answered = generate_kvcache(cached, requests[j][0][None], 2, SEQLEN)[0]  # previous prompt + its answer
        assert torch.equal(prompt[:len(answered)], answered) and len(prompt) == len(answered) + SEQLEN // 3 - 2
        assert arrivals[i] == pytest.approx(arrivals[j] + 1.0)
    with pytest.raises(ValueError, match="output_len below seqlen // n_turns"):
        serving.make_multi_turn_trace(cached, source, 3, 4, 20.0, 1.0, SEQLEN, 4)
    with pytest.raises(ValueError, match="think_time > 0"):
        serving.make_multi_turn_trace(cached, source, 3, 2, 20.0, 0.0, SEQLEN, 2)


def test_early_turns_counts_turns_that_came_before_the_previous_answer_ended():
    clock = serving.ServingClock([0.0, 1.0, 2.0], [1, 1, 1])
    clock.last = [1.5, 1.8, 2.5]  # request 1 arrived (1.0) before request 0 ended (1.5); 2 after 1 ended
    assert serving.early_turns(clock, [None, 0, 1]) == 1


@pytest.mark.parametrize("fn", [static_batching, continuous_batching])
def test_bad_requests_are_clear_errors_before_any_work(tiny_models, fn, monkeypatch):
    base, _ = tiny_models
    for module in (main_static_batching, main_continuous_batching):
        monkeypatch.setattr(module, "next_tokens", lambda *a: pytest.fail("no work before the checks"))
    good = (torch.tensor([1, 2, 3]), 2)
    cases = {"empty": [good, (torch.tensor([], dtype=torch.long), 2)],
             "positive integer": [good, (torch.tensor([1]), 0)],
             "longer than the window": [good, (torch.ones(10, dtype=torch.long), SEQLEN - 9)],
             "1-D LongTensor": [good, (torch.ones(1, 3, dtype=torch.long), 2)],
             "vocabulary": [good, (torch.tensor([1, 99]), 2)],
             "no requests": []}
    for message, requests in cases.items():
        with pytest.raises(ValueError, match=message):
            fn(base, requests, 2, SEQLEN)
    with pytest.raises(ValueError, match="batch_size"):
        fn(base, [good], 0, SEQLEN)


TINY_TRACE = ["--untrained", "--preset", "cpu", "--device", "cpu", "--n-requests", "6", "--prompt-median", "8",
              "--output-median", "4"]


def test_main_static_batching_end_to_end(real_data, tmp_path, capsys):
    out_json, out_png = tmp_path / "s.json", tmp_path / "s.png"
    main_static_batching.main(TINY_TRACE + ["--repeats", "2", "--batch-sizes", "1", "3", "--json", str(out_json), "--plot", str(out_png)])
    assert "static batching, batch 3" in capsys.readouterr().out
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["same"] for r in rows] == ["yes", "yes"]
    headline = json.loads(out_json.read_text())["headline"]
    assert headline["technique"] == "static batching, 6 requests at time 0, no KV cache"
    assert headline["figure"] == "; ".join(f"{b}: {r['tokens_per_s']:.0f} tok/s, {r['wasted_slot_steps']} wasted slot-steps"
                                           for b, r in zip(("batch 1", "batch 3"), rows))
    assert rows[0]["wasted_slot_steps"] == 0 and rows[1]["steps"] <= rows[0]["steps"]
    assert all(r["ttft_ms"] is None and r["ttft_arrival_ms"] <= r["ttft_arrival_p99_ms"] for r in rows)
    assert all(r["tokens_per_s"] > 0 and r["tpot_p99_ms"] >= r["tpot_ms"] for r in rows)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    renders_on_its_page("main_static_batching", json.loads(out_json.read_text()))


def test_main_continuous_batching_end_to_end(real_data, tmp_path, capsys):
    out_json, out_png = tmp_path / "c.json", tmp_path / "c.png"
    main_continuous_batching.main(TINY_TRACE + ["--repeats", "1", "--batch-size", "2", "--chunk-size", "3", "--n-blocks", "40",
                                                "--sweep-batch-sizes", "1", "3", "--json", str(out_json),
                                                "--plot", str(out_png), "--no-vllm"])
    assert "continuous / static throughput" in capsys.readouterr().out
    result = json.loads(out_json.read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["static batching", "continuous batching", "paged, whole prompts", "paged, chunked prefill 3"]
    assert all(r["same"] == "yes" for r in rows.values())
    assert rows["continuous batching"]["steps"] <= rows["static batching"]["steps"]
    assert rows["paged, whole prompts"]["kv_cache_mb"] == pytest.approx(
        40 * 8 * 2 * 4 * 4 * 32 * 4 / 2**20)  # blocks x tokens x (K, V) x layers x heads x d_head x fp32
    assert set(result["sweep"]["variants"]) == set(rows)
    assert result["headline"]["technique"] == "continuous vs static batching, paged KV cache: 6-request trace, batch 2"
    assert result["headline"]["figure"].startswith("throughput ") and "of its reserved slots" in result["headline"]["figure"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    renders_on_its_page("main_continuous_batching", result)


def test_main_continuous_batching_runs_only_the_variants_asked_for(real_data, tmp_path, capsys):
    out_json = tmp_path / "c.json"
    main_continuous_batching.main(TINY_TRACE + ["--repeats", "1", "--batch-size", "2", "--variants", "chunked", "static",
                                                "--json", str(out_json)])
    printed = capsys.readouterr().out
    result = json.loads(out_json.read_text())
    assert [r["variant"] for r in result["rows"]] == ["paged, chunked prefill 16", "static batching"]
    assert all(r["same"] == "yes" for r in result["rows"])
    assert "continuous / static throughput" not in printed  # its two variants were not both run
    header = [c[1] for c in result["columns"]]
    assert "TTFT arrival ms" in header and "TTFT ms" not in header  # from arrival, not one generation's TTFT


def test_main_continuous_batching_prefix_sharing_end_to_end(real_data, tmp_path, capsys):
    out_json = tmp_path / "p.json"
    main_continuous_batching.main(TINY_TRACE + ["--n-requests", "8", "--repeats", "1", "--batch-size", "2",
                                                "--prefix-sharing", "--turns", "2", "--json", str(out_json)])
    assert "system prompt, without / with prefix sharing: p50 TTFT" in capsys.readouterr().out
    result = json.loads(out_json.read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["system prompt, no sharing", "system prompt, prefix sharing", "multi-turn, no sharing",
                          "multi-turn, prefix sharing", "multi-turn, 64 blocks, prefix sharing"]  # 4 conversations
    assert result["roomy_blocks"] == 64 and rows["multi-turn, 64 blocks, prefix sharing"]["hit_rate"] > 0
    assert all(r["same"] == "yes" for r in rows.values())
    for trace in ("system prompt", "multi-turn"):
        off, on = rows[f"{trace}, no sharing"], rows[f"{trace}, prefix sharing"]
        assert off["hit_rate"] == 0 < on["hit_rate"] and on["computed"] < off["computed"]
    assert result["system_len"] == 64 and all(n > 64 for n in result["prompt_lens"]["system_prompt"])
    assert result["headline"]["technique"] == ("prefix sharing in the paged engine: 64-token system prompt, "
                                               "2-turn conversations")
    assert "with a pool of 64 blocks" in result["headline"]["figure"]
    renders_on_its_page("main_continuous_batching_prefix_sharing", result)


@pytest.mark.parametrize("script, flags", [
    (main_static_batching, ["--batch-sizes", "0"]), (main_static_batching, ["--batch-sizes", "2", "2"]),
    (main_static_batching, ["--n-requests", "0"]), (main_static_batching, ["--rate", "5"]),
    (main_static_batching, ["--repeats", "0"]), (main_continuous_batching, ["--rate", "0"]),
    (main_continuous_batching, ["--batch-size", "0"]), (main_continuous_batching, ["--block-size", "0"]),
    (main_continuous_batching, ["--chunk-size", "0"]), (main_continuous_batching, ["--n-blocks", "0"]),
    (main_continuous_batching, ["--n-blocks", "15"]), (main_continuous_batching, ["--block-size", "129"]),
    (main_continuous_batching, ["--prompt-median", "128"]), (main_continuous_batching, ["--output-median", "0"]),
    (main_continuous_batching, ["--sweep-batch-sizes", "0"]), (main_continuous_batching, ["--bogus"]),
    (main_continuous_batching, ["--plot", "out.txt"]), (main_continuous_batching, ["--variants", "fast"]),
    (main_continuous_batching, ["--variants", "paged", "paged"]),
    (main_continuous_batching, ["--prefix-sharing", "--variants", "paged"]),
    (main_continuous_batching, ["--prefix-sharing", "--plot", "p.png"]),
    (main_continuous_batching, ["--plot", "p.png"]), (main_continuous_batching, ["--prefix-sharing", "--sweep-batch-sizes", "2"]),
    (main_continuous_batching, ["--prefix-sharing", "--n-requests", "3"]),
    (main_continuous_batching, ["--prefix-sharing", "--system-len", "100", "--prompt-median", "28"]),
    (main_continuous_batching, ["--prefix-sharing", "--output-median", "32"]),
    (main_continuous_batching, ["--turns", "1"]), (main_continuous_batching, ["--think-time", "0"]),
    (main_continuous_batching, ["--system-len", "0"])])
def test_bad_flags_are_clear_errors_before_any_work(script, flags, capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        script.main(["--untrained", "--device", "cpu"] + flags)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_median_figures_is_the_repositorys_one_median():
    runs = [dict(tpot_ms=1.0, steps=4, tokens_per_s=None), dict(tpot_ms=4.0, steps=6, tokens_per_s=10.0)]
    assert serving.median_figures(runs) == {"tpot_ms": iu.median([1.0, 4.0]), "steps": 5, "tokens_per_s": None}
    assert serving.median_figures(runs[:1] * 3) == runs[0]


def test_the_long_prompt_run_has_the_chunked_prefill_headline(real_data, tmp_path, monkeypatch):
    monkeypatch.setattr(main_continuous_batching.training, "validation_loss", lambda model, data: 4.2)
    out_json = tmp_path / "c.json"
    main_continuous_batching.main(TINY_TRACE + ["--repeats", "1", "--batch-size", "2", "--prompt-median", "64",
                                                "--chunk-size", "4", "--variants", "paged", "chunked", "--json", str(out_json)])
    result = json.loads(out_json.read_text())
    assert result["headline"]["technique"].startswith("chunked prefill, trace with long prompts (median ")
    assert result["headline"]["figure"].startswith("p99 TPOT ")
    renders_on_its_page("main_continuous_batching_long_prompts", result)


@pytest.mark.parametrize("script, flags", [
    (main_static_batching, []), (main_continuous_batching, ["--sweep-batch-sizes", "1", "2"])])
def test_plot_never_changes_the_json(real_data, tmp_path, monkeypatch, script, flags):
    monkeypatch.setattr(script.training, "validation_loss", lambda model, data: 4.2)
    common = TINY_TRACE + ["--n-requests", "3", "--repeats", "1"] + flags
    script.main(common + ["--json", str(tmp_path / "a.json")])
    script.main(common + ["--json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png")])
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "ab")
    assert a.keys() == b.keys() and [r.keys() for r in a["rows"]] == [r.keys() for r in b["rows"]]
    untimed = ("variant", "steps", "wasted_slot_steps", "wasted", "same", "kv_util", "kv_contig")
    if script is main_continuous_batching:  # its engine's clock advances by measured step times (serving.py), so
        untimed = ("variant", "same")       # which requests share a step, the steps and the KV use follow the machine
    assert [[r.get(k) for k in untimed] for r in a["rows"]] == [[r.get(k) for k in untimed] for r in b["rows"]]
    assert (tmp_path / "b.png").exists()


@pytest.mark.parametrize("script", [main_static_batching, main_continuous_batching])
def test_tokens_that_differ_stop_the_script_before_anything_is_timed_or_written(script, real_data, tmp_path,
                                                                                monkeypatch):
    wrong = lambda outputs, reference: "NO (1 differ)"  # noqa: E731  (a scheduler bug)
    monkeypatch.setattr(serving, "same_outputs", wrong)
    monkeypatch.setattr(iu, "time_round_robin", lambda *a, **k: pytest.fail("nothing is timed after a failed check"))
    with pytest.raises(harness.GPTliteError, match="checks failed: .*every request's tokens equal generating it alone"):
        script.main(TINY_TRACE + ["--n-requests", "3", "--repeats", "1", "--json", str(tmp_path / "r.json")])
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("script, flags, flag", [
    (main_static_batching, ["--batch-sizes", "1000000000000"], "--batch-sizes"),
    (main_static_batching, ["--n-requests", "100000000"], "--n-requests"),  # the type's bound: 10**8
    (main_continuous_batching, ["--batch-size", "1000000000000"], "--batch-size"),
    (main_continuous_batching, ["--sweep-batch-sizes", "2", "1000000000000"], "--sweep-batch-sizes"),
    (main_continuous_batching, ["--n-blocks", "1000000000000"], "--n-blocks"),
    (main_continuous_batching, ["--n-requests", "100000000"], "--n-requests"),
    (main_continuous_batching, ["--prefix-sharing", "--n-requests", "100000000"], "--n-requests")])
def test_a_size_flag_beyond_the_machine_is_a_parser_error_before_any_work(script, flags, flag, capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        script.main(["--untrained", "--device", "cpu", "--preset", "cpu"] + flags)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {flag}:" in err and "give a smaller value" in err
