"""main_trainable_sparse.py: the decode steps of its microbenchmark (MoBA, DSA; NSA's in test_nsa.py) against
references written here, the benchmark's per-variant caches, the script end to end (checks, rows, the
DSA stages, the benchmark table, the summary rows) and its flag errors."""
import json
import math

import pytest
import torch

import gptlite_moba
import main_trainable_sparse
from lib import attention_benchmark, files, harness, moba
from lib.dsa import dsa_decode
from conftest import renders_on_its_page

ATOL = 1e-6  # float32 attention outputs on random unit inputs


def random_cache(n, B=2, H=2, D=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, 1, D, generator=generator), *torch.randn(2, B, H, n, D, generator=generator)


def softmax_over(q, K, V, keys):
    return torch.softmax(K[keys] @ q / math.sqrt(q.shape[-1]), dim=0) @ V[keys]


@pytest.mark.parametrize("n, block, top_k", [(37, 8, 2), (40, 8, 3), (5, 8, 2), (64, 4, 20)])
def test_moba_decode_is_the_last_row_of_moba_attention(n, block, top_k):
    q, K, V = random_cache(n)
    out = moba.moba_decode(q, K, V, gptlite_moba.block_mean_keys(K, block), block, top_k)
    assert torch.allclose(out, gptlite_moba.moba_attention(q, K, V, block, top_k), atol=ATOL)


@pytest.mark.parametrize("n, top_k", [(37, 5), (37, 37), (10, 50)])
def test_dsa_decode_attends_to_the_top_k_index_scores(n, top_k):
    q, K, V = random_cache(n)
    generator = torch.Generator().manual_seed(1)
    index_keys, index_q = torch.randn(2, n, 4, generator=generator), torch.randn(2, 3, 4, generator=generator)
    index_w = torch.rand(2, 3, generator=generator)
    out = dsa_decode(q, K, V, index_q, index_w, index_keys, top_k)
    for b in range(2):
        scores = [sum(index_w[b, j] * torch.relu(index_q[b, j] @ index_keys[b, s]) for j in range(3)) for s in range(n)]
        keys = sorted(range(n), key=lambda s: -scores[s])[:top_k]
        for h in range(2):
            assert torch.allclose(out[b, h, 0], softmax_over(q[b, h, 0], K[b, h], V[b, h], keys), atol=ATOL)


def test_benchmark_passes_each_variants_cache():
    seen = {}

    def with_cache(Q, K, V, means):
        seen["means"] = means.shape
        return Q
    variants = {"plain": lambda Q, K, V: Q, "cached": with_cache}
    results = attention_benchmark.benchmark(variants, [32, 48], 1, 2, 8, "cpu", repeats=1, n_queries=1,
                                            peak_memory=False,
                                            caches={"cached": lambda K, V: (gptlite_moba.block_mean_keys(K, 16),)})
    assert seen["means"] == (1, 2, 3, 8)  # the last context's: 48 keys in blocks of 16
    assert results["plain"]["context"] == results["cached"]["context"] == [32, 48] and "peak_mb" not in results["plain"]



def test_main_trainable_sparse_runs_checks_and_writes_json_and_plot(real_data, tmp_path, capsys, monkeypatch,
                                                                    one_batch_validation):
    monkeypatch.setattr(files, "CHECKPOINT_DIR", tmp_path / "checkpoints")  # --untrained saves no checkpoint
    out_json, out_png = tmp_path / "ts.json", tmp_path / "ts.png"
    main_trainable_sparse.main(["--untrained", "--preset", "cpu", "--device", "cpu", "--uptrain-steps", "1",
                                "--dsa-warmup-steps", "1", "--val-batches", "1", "--bench-contexts", "256", "1024",
                                "--bench-repeats", "1", "--json", str(out_json), "--plot", str(out_png)])
    assert "meaningless" in capsys.readouterr().out
    result = json.loads(out_json.read_text())
    assert result["script"] == "main_trainable_sparse.py" and result["untrained"] and result["uptrain_steps"] == 1
    assert len(result["checks"]) == 6 and all(result["checks"].values())
    rows = result["rows"]
    assert [r["variant"] for r in rows] == ["dense", "MoBA (blocks of 16, top-3)", "NSA (blocks of 8, top-3, window 8)",
                                       "DSA (top-48, indexer 4 x 16)"]
    assert rows[0]["keys_per_query"] == 64.5 and rows[0]["keys_last"] == 128
    assert [r["keys_last"] for r in rows[1:]] == [48, 48, 48]  # the defaults' matched budget: 48 keys
    assert rows[0]["kv_kb_token"] == 4 * 2 * 128 * 128 * 4 / 2**10  # layers, K and V, keys, H * D, float32
    assert rows[3]["keys_per_query"] == round(sum(min(p + 1, 48) for p in range(128)) / 128, 2)
    for r in rows[1:]:
        assert r["gap_inference"] == pytest.approx(r["loss_inference"] - rows[0]["loss_inference"], abs=1e-4)
        assert r["gap_uptrained"] == pytest.approx(r["val_loss"] - rows[0]["val_loss"], abs=1e-4)
        assert 0 < r["kv_kb_token"] < rows[0]["kv_kb_token"] and 0 < r["kflops_token"] < rows[0]["kflops_token"]
    stages, bench = result["tables"][0]["rows"], result["tables"][1]["rows"]
    assert len(stages) == 3 and all(0 < s["indexer_recall"] <= 1 for s in stages)
    assert stages[1]["val_loss"] == rows[3]["loss_inference"] and stages[2]["val_loss"] == rows[3]["val_loss"]
    assert [b["context"] for b in bench] == [256, 1024]
    assert bench[1]["dsa_keys"] == bench[1]["moba_keys"] == 1024
    assert bench[1]["nsa_keys"] == 1024 + 512 + 16  # selected (16 blocks of 64: all), window, summaries
    methods = result["attention_methods"]
    assert [m["method"] for m in methods] == [r["variant"] for r in rows[1:]]
    assert all(not m["exact"] and m["training_steps"] >= 1 and m["pays"] for m in methods)
    assert methods[2]["training_steps"] == 2  # DSA: the warm-up and the sparse step
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "checkpoints").exists()
    renders_on_its_page("main_trainable_sparse", result)


@pytest.mark.parametrize("flags, flag", [
    (["--nsa-block", "0"], "--nsa-block"), (["--nsa-block", "128"], "--nsa-block"),
    (["--nsa-top-n", "0"], "--nsa-top-n"), (["--nsa-top-n", "16"], "--nsa-top-n"),
    (["--nsa-window", "0"], "--nsa-window"), (["--nsa-window", "128"], "--nsa-window"),
    (["--moba-block", "0"], "--moba-block"), (["--moba-top-k", "8"], "--moba-top-k"),
    (["--dsa-top-k", "0"], "--dsa-top-k"),
    (["--dsa-top-k", "128"], "--dsa-top-k"), (["--dsa-warmup-steps", "0"], "--dsa-warmup-steps"),
    (["--uptrain-steps", "0"], "--uptrain-steps"), (["--bench-contexts", "512", "256"], "--bench-contexts"),
    (["--bench-contexts", "1"], "--bench-contexts"), (["--plot", "m.txt"], "--plot"), (["--bogus"], "--bogus")])
def test_bad_flags_are_clear_errors_before_any_work(flags, flag, capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        main_trainable_sparse.main(["--untrained", "--device", "cpu"] + flags)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and flag in err
