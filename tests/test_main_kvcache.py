"""main_kvcache.py end to end on random weights: the checks, the table, --json and --plot; bad flags."""
import json

import pytest

import inference_utils as iu
import main_kvcache
from lib import harness, presets


def test_main_kvcache_runs_checks_and_saves_json_and_plot(real_data, tmp_path, capsys):
    out_json, out_png = tmp_path / "kv.json", tmp_path / "kv.png"
    main_kvcache.main(["--untrained", "--preset", "cpu", "--device", "cpu", "--prompt-len", "64", "--n-tokens", "70",
                       "--batch-sizes", "1", "2", "--repeats", "1", "--json", str(out_json), "--plot", str(out_png)])
    printed = capsys.readouterr().out
    assert "static KV cache" in printed and "meaningless" in printed
    result = json.loads(out_json.read_text())
    assert result["script"] == "main_kvcache.py" and result["preset"] == "cpu" and result["untrained"]
    assert [(r["variant"], r["batch_size"]) for r in result["rows"]] == [
        (v, b) for b in (1, 2) for v in ("no cache", "dynamic KV cache", "static KV cache")]
    assert all(r["same_in_window"] == "yes" for r in result["rows"])
    assert result["tokens_in_window"] == 128 - 64 + 1
    p = presets.PRESETS["cpu"]
    for batch_size in (1, 2):
        rows = {r["variant"]: r for r in result["rows"] if r["batch_size"] == batch_size}
        full = batch_size * p.n_layers * 2 * p.n_heads * p.seqlen * p.d_head * 4 / 2**20  # float32
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


@pytest.mark.parametrize("flags", [["--n-tokens", "1"], ["--prompt-len", "0"], ["--prompt-len", "129"],
                                   ["--batch-sizes", "1", "0"], ["--batch-sizes", "1", "1"], ["--plot", "out.txt"],
                                   ["--bogus"], ["--preset", "huge"], ["--json", "/no/such/folder/r.json"],
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
