"""main_kvcache.py end to end on random weights: the checks, the table, --json and --plot; bad flags."""
import json

import pytest

import inference_utils as iu
import main_kvcache
from lib import harness, presets
from conftest import renders_on_its_page


def test_main_kvcache_runs_checks_and_saves_json_and_plot(real_data, tmp_path, capsys):
    out_json, out_png = tmp_path / "kv.json", tmp_path / "kv.png"
    main_kvcache.main(["--untrained", "--preset", "cpu", "--device", "cpu", "--prompt-len", "64", "--n-tokens", "70",
                       "--batch-sizes", "1", "2", "--repeats", "1", "--json", str(out_json), "--sweep", "--plot",
                       str(out_png)])
    printed = capsys.readouterr().out
    assert "static KV cache" in printed and "meaningless" in printed
    result = json.loads(out_json.read_text())
    assert result["script"] == "main_kvcache.py" and result["preset"] == "cpu" and result["untrained"]
    assert [(r["variant"], r["path"], r["batch_size"]) for r in result["rows"]] == [
        (v, p, b) for b in (1, 2) for v, p in (("no cache", "eager"), ("dynamic KV cache", "eager"),
                                               ("static KV cache", "eager"), ("no cache", "fast"),
                                               ("static KV cache", "fast"))]
    assert all(r["same_in_window"] == "yes" for r in result["rows"])
    assert result["tokens_in_window"] == 128 - 64 + 1
    p = presets.PRESETS["cpu"]
    for batch_size in (1, 2):
        rows = {r["variant"]: r for r in result["rows"] if r["batch_size"] == batch_size and r["path"] == "eager"}
        fast = {r["variant"]: r for r in result["rows"] if r["batch_size"] == batch_size and r["path"] == "fast"}
        full = batch_size * p.n_layers * 2 * p.n_heads * p.seqlen * p.d_head * 4 / 2**20  # float32
        assert fast["static KV cache"]["kv_cache_mb"] == pytest.approx(full) and fast["no cache"]["kv_cache_mb"] is None
        assert rows["static KV cache"]["kv_cache_mb"] == pytest.approx(full)
        assert rows["dynamic KV cache"]["kv_cache_mb"] == pytest.approx(full)  # 64 + 69 > seqlen: full
        assert rows["no cache"]["kv_cache_mb"] is None
        for r in rows.values():
            assert r["ttft_ms"] > 0 and r["tokens_per_s"] > 0 and r["peak_mem_mb"] > 0
            # one noisy repeat: TPOT is a positive figure, or None when noise swallowed it; never negative
            assert r["tpot_ms"] is None or r["tpot_ms"] > 0
        assert rows["no cache"]["val_loss"] == pytest.approx(rows["dynamic KV cache"]["val_loss"], abs=1e-5)
    assert set(result["tpot_sweep"]) == {"1", "2"}
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["headline"]["technique"] == "KV cache, dynamic and static"
    assert result["headline"]["figure"].startswith("TPOT no cache / static cache: eager ")
    assert "; fast " in result["headline"]["figure"] and " at batch 2, " in result["headline"]["figure"] and "the same tokens within the window" in printed
    renders_on_its_page("main_kvcache", result)


def without_timings(value):
    """The JSON with every measured time or memory figure blanked: what must not depend on --plot."""
    timed = ("_ms", "tokens_per_s", "peak_mem_mb", "figure", "summary")
    if isinstance(value, dict):
        return {k: None if any(k.endswith(t) for t in timed) else without_timings(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


def test_plot_never_changes_what_is_measured_or_the_json(real_data, tmp_path, monkeypatch):
    monkeypatch.setattr(main_kvcache.training, "validation_loss", lambda model, data: 4.2)  # seconds, tested elsewhere
    flags = ["--untrained", "--preset", "cpu", "--device", "cpu", "--prompt-len", "100", "--n-tokens", "4",
             "--batch-sizes", "1", "--repeats", "1", "--sweep"]
    main_kvcache.main(flags + ["--json", str(tmp_path / "a.json")])
    main_kvcache.main(flags + ["--json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png")])
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "ab")
    assert a.keys() == b.keys() and a["tpot_sweep"]["1"].keys() == b["tpot_sweep"]["1"].keys()
    assert without_timings(a) == without_timings(b)
    assert (tmp_path / "b.png").exists()


def test_tokens_that_differ_stop_the_script_before_anything_is_timed_or_written(real_data, tmp_path, monkeypatch):
    def wrong(model, prompts, n, seqlen, kv_cache=None):  # a cache bug: the last new token is off by one
        tokens = generate_kvcache(model, prompts, n, seqlen, kv_cache=kv_cache).clone()
        tokens[:, -1] = (tokens[:, -1] + 1) % model.fc_out.out_features
        return tokens
    generate_kvcache = main_kvcache.generate_kvcache
    monkeypatch.setattr(main_kvcache, "generate_kvcache", wrong)
    monkeypatch.setattr(iu, "compare_generation", lambda *a, **k: pytest.fail("nothing is timed after a failed check"))
    with pytest.raises(main_kvcache.harness.GPTliteError, match="dynamic KV cache, eager path \\(batch 1\\): tokens equal"):
        main_kvcache.main(["--untrained", "--preset", "cpu", "--device", "cpu", "--prompt-len", "8", "--n-tokens", "4",
                           "--batch-sizes", "1", "--repeats", "1", "--json", str(tmp_path / "r.json")])
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("flags, flag", [(["--batch-sizes", "1000000000000"], "--batch-sizes"),
                                         (["--batch-sizes", "1", "1000000000000"], "--batch-sizes"),
                                         (["--n-tokens", "1000000000000"], "--n-tokens")])
def test_a_size_flag_beyond_the_machine_is_a_parser_error_before_any_work(flags, flag, capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        main_kvcache.main(["--untrained", "--device", "cpu", "--preset", "cpu"] + flags)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {flag}:" in err and "give a smaller value" in err


@pytest.mark.parametrize("flags", [["--n-tokens", "1"], ["--prompt-len", "0"], ["--prompt-len", "129"],
                                   ["--batch-sizes", "1", "0"], ["--batch-sizes", "1", "1"], ["--plot", "out.txt"],
                                   ["--bogus"], ["--plot", "p.png"], ["--preset", "huge"], ["--json", "/no/such/folder/r.json"],
                                   ["--json", "."], ["--device", "foo"], ["--device", "tpu"]])
def test_bad_flags_are_clear_errors_before_any_work(flags, capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        main_kvcache.main(["--untrained", "--device", "cpu"] + flags)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_a_missing_data_file_ends_the_script_with_one_clear_line(tmp_path):
    with pytest.raises(SystemExit) as e:
        harness.run(lambda: main_kvcache.main(["--untrained", "--device", "cpu", "--data", str(tmp_path / "no.txt")]))
    assert str(e.value.code).startswith("error: --data points at")
