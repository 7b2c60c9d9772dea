"""MoBA: the block selection and attention against a reference written here (one query at a time, an
explicit softmax over the chosen keys), dense at top-k = every block, FlexAttention against the mask,
the cost formula against the mask, checkpoint reuse, clear errors; main_moba.py end to end."""
import json
import math

import pytest
import torch
from conftest import TINY, random_gptlite, renders_on_its_page

import main_moba
from lib import files, harness, presets, training
from gptlite_moba import GPTlite_MoBA, check_moba_args, moba_attention, moba_flex_attention, moba_mask, select_blocks
from lib.moba import attention_cost, keys_read

ATOL = 1e-6  # float32 attention outputs on random unit inputs


def random_qkv(S=37, B=2, H=2, D=8, seed=0):
    return torch.randn(3, B, H, S, D, generator=torch.Generator().manual_seed(seed))


def reference_moba(Q, K, V, block_size, top_k):
    """One query at a time: score each whole past block by q . (mean of its keys), keep the best
    top_k - 1 and the query's own block, softmax over those keys up to the query itself."""
    B, H, S, D = Q.shape
    out = torch.zeros_like(Q)
    for b in range(B):
        for h in range(H):
            for t in range(S):
                q, own = Q[b, h, t], t // block_size
                past = sorted(range(own), key=lambda j: -(q @ K[b, h, j * block_size:(j + 1) * block_size].mean(0)))
                keys = [s for j in past[:top_k - 1] + [own]
                        for s in range(j * block_size, min((j + 1) * block_size, t + 1))]
                weights = torch.softmax(K[b, h, keys] @ q / math.sqrt(D), dim=0)
                out[b, h, t] = weights @ V[b, h, keys]
    return out


def reference_dense(Q, K, V):
    S = Q.shape[-2]
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])
    scores = scores.masked_fill(torch.ones(S, S).triu(1).bool(), float("-inf"))
    return torch.softmax(scores, dim=-1) @ V


@pytest.mark.parametrize("block_size, top_k", [(8, 1), (8, 2), (8, 3), (5, 2), (5, 4), (16, 2)])
def test_moba_attention_matches_the_one_query_at_a_time_reference(block_size, top_k):
    Q, K, V = random_qkv(S=37)  # 37: the last block is partial for every block size here
    assert torch.allclose(moba_attention(Q, K, V, block_size, top_k), reference_moba(Q, K, V, block_size, top_k),
                          atol=ATOL)


@pytest.mark.parametrize("block_size, top_k", [(8, 5), (8, 6), (5, 8), (37, 1)])
def test_top_k_of_every_block_is_exactly_dense_attention(block_size, top_k):
    Q, K, V = random_qkv(S=37)  # 5 blocks of 8, 8 of 5, 1 of 37; more than there are: still dense
    assert torch.allclose(moba_attention(Q, K, V, block_size, top_k), reference_dense(Q, K, V), atol=ATOL)


def test_fewer_blocks_differ_from_dense():
    Q, K, V = random_qkv(S=37)
    assert not torch.allclose(moba_attention(Q, K, V, 8, 4), reference_dense(Q, K, V), atol=1e-3)


def test_the_selection_keeps_the_own_block_and_never_a_future_one():
    Q, K, _ = random_qkv(S=37)
    chosen = select_blocks(Q, K, 8, 3)  # [B, H, S, 5]
    own = torch.arange(37) // 8
    assert chosen[..., torch.arange(37), own].all()
    assert not (chosen & (torch.arange(5) > own[:, None])).any()
    assert (chosen.sum(-1) == torch.clamp(own + 1, max=3)).all()


@pytest.mark.parametrize("t", [0, 7, 8, 20, 36])
def test_one_decoding_query_reads_what_its_row_of_the_whole_sequence_reads(t):
    Q, K, V = random_qkv(S=37)
    Q, K, V = Q[:, :, :t + 1], K[:, :, :t + 1], V[:, :, :t + 1]
    whole = moba_attention(Q, K, V, 8, 2)
    assert torch.allclose(moba_attention(Q[:, :, -1:], K, V, 8, 2), whole[:, :, -1:], atol=ATOL)


def test_flex_attention_block_mask_gives_the_explicit_mask_outputs():
    Q, K, V = random_qkv(S=37)  # eager flex_attention: the same block mask as the compiled kernel, no compiler
    with torch.no_grad():
        assert torch.allclose(moba_flex_attention(Q, K, V, 8, 2), moba_attention(Q, K, V, 8, 2), atol=1e-5)


@pytest.mark.parametrize("block_size, top_k", [(8, 1), (8, 3), (5, 2)])
def test_keys_read_and_costs_count_the_mask(block_size, top_k):
    Q, K, _ = random_qkv(S=37)
    counted = moba_mask(select_blocks(Q, K, block_size, top_k), block_size, 37).sum(-1)  # [B, H, S]
    assert (counted == torch.tensor([keys_read(p, block_size, top_k) for p in range(37)])).all()
    flops, kv = attention_cost(36, block_size, top_k, n_heads=2, d_head=8, n_layers=3)
    means = 36 // block_size
    assert flops == 3 * 2 * 8 * (4 * counted[0, 0, -1].item() + 2 * means)
    assert kv == 3 * 2 * 8 * 4 * (2 * counted[0, 0, -1].item() + means)
    assert attention_cost(36, None, 1, n_heads=2, d_head=8, n_layers=3) == (3 * 2 * 8 * 4 * 37, 3 * 2 * 8 * 4 * 2 * 37)



def test_gptlite_moba_of_every_block_gives_gptlite_logits_and_fewer_blocks_do_not():
    base = random_gptlite()
    x = torch.randint(TINY["vocab_size"], (3, TINY["seqlen"]), generator=torch.Generator().manual_seed(1))
    dense = main_moba.moba_from(base, TINY, block_size=4, top_k=4)  # 16 tokens, 4 blocks
    with torch.no_grad():
        assert torch.equal(dense(x), base(x))
        assert not torch.allclose(main_moba.moba_from(base, TINY, 4, 2)(x), base(x), atol=1e-3)


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_moba_as_a_kv_cache_of_gptlites_own_forward_pass_gives_gptlite_moba(top_k):
    """MoBA's selection through the cache interface: a prompt, then one token at a time, equals the rows of
    GPTlite_MoBA's whole-sequence forward pass; the recorded keys read are the formula's."""
    from gptlite_kvcache import decode_one_token, generate_kvcache, kv_cache_view
    from gptlite_moba import MoBACache
    base = random_gptlite()
    x = torch.randint(TINY["vocab_size"], (3, TINY["seqlen"]), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = main_moba.moba_from(base, TINY, 4, top_k)(x)  # [B, S, vocab]
        cache = MoBACache(TINY["n_layers"], 4, top_k, TINY["seqlen"], record=True)
        cached = kv_cache_view(base)
        steps = [cached(x[:, :6], kv_cache=cache)[0]]
        for t in range(6, TINY["seqlen"]):
            steps.append(cached(x[:, t:t + 1], kv_cache=cache)[0])
            assert all(k.shape == (3, TINY["n_heads"], 1) and (k == keys_read(t, 4, top_k)).all()
                       for k in cache.keys_read)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
    # greedy decoding with it: the tokens of re-running GPTlite_MoBA on the whole sequence each step
    prompt, sequence = x[:, :5], x[:, :5]
    with torch.no_grad():
        for _ in range(TINY["seqlen"] - 5):
            sequence = torch.cat([sequence, main_moba.moba_from(base, TINY, 4, top_k)(sequence)[:, -1:].argmax(-1)], 1)
    out = generate_kvcache(cached, prompt, TINY["seqlen"] - 5, TINY["seqlen"],
                           kv_cache=MoBACache(TINY["n_layers"], 4, top_k, TINY["seqlen"]))
    assert torch.equal(out, sequence)
    with pytest.raises(ValueError, match="exceed seqlen"):  # the blocks are the cache's slots: no window
        decode_one_token(cached, x[:, :1], cache, TINY["seqlen"])


def test_the_script_checks_pass_with_flex_attention_and_catch_a_flex_that_ignores_the_mask():
    from torch.nn.attention.flex_attention import flex_attention
    base = random_gptlite()
    window = torch.randint(TINY["vocab_size"], (2, TINY["seqlen"]), generator=torch.Generator().manual_seed(2))
    checks = main_moba.run_checks(base, TINY, window, 4, [2, 1], flex_attention)  # eager: no compiler needed
    assert len(checks) == 5 and all(checks.values())

    def dense_flex(Q, K, V, block_mask):  # causal attention, the block mask ignored: a wrong kernel
        return torch.nn.functional.scaled_dot_product_attention(Q, K, V, is_causal=True)
    checks = main_moba.run_checks(base, TINY, window, 4, [2], dense_flex)
    assert checks == {"top-k = all blocks: GPTlite's logits": True, **{k: False for k in checks if "flex" in k},
                      "top-2: keys read = formula": True}


def test_gptlite_moba_trains_through_the_mask():
    model = main_moba.moba_from(random_gptlite(), TINY, 4, 2).train()
    x = torch.randint(TINY["vocab_size"], (2, TINY["seqlen"]))
    training.cross_entropy_loss(model, x, x).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("block_size, top_k, message", [
    (0, 2, "block_size must be a positive integer"), (-4, 2, "block_size must be a positive integer"),
    (2.5, 2, "block_size must be a positive integer"), (4, 0, "top_k must be an integer of at least 1"),
    (4, -1, "top_k must be an integer of at least 1"), (16, 2, "does not fit the window of seqlen=16"),
    (40, 2, "does not fit")])
def test_bad_moba_settings_are_clear_errors(block_size, top_k, message):
    with pytest.raises(ValueError, match=message):
        GPTlite_MoBA(**TINY, block_size=block_size, top_k=top_k)
    with pytest.raises(ValueError, match=message):
        check_moba_args(block_size, top_k, TINY["seqlen"])


def test_uptrained_models_are_saved_and_reused_only_with_the_same_budget(real_data, tmp_path, monkeypatch):
    preset = presets.Preset("tiny", **{k: v for k, v in TINY.items() if k != "vocab_size"}, batch_size=2, lr=1e-3,
                       iters=20)
    calls = []
    train_steps = training.train_steps
    monkeypatch.setattr(training, "train_steps", lambda *a, **kw: calls.append(1) or train_steps(*a, **kw))
    path, meta = tmp_path / "m.pt", dict(base_sha256="abc", uptrain_steps=1, lr=1e-3, seed=0)

    def run(meta):
        model = main_moba.moba_from(random_gptlite(), TINY, 4, 2)
        return main_moba.uptrained(model, "top-2", path, meta, real_data, preset, 1, 1e-3, 0, "python main_moba.py")
    first = run(meta)
    assert len(calls) == 1 and path.exists()
    assert torch.equal(run(meta).fc_out.weight, first.fc_out.weight) and len(calls) == 1  # reused
    run({**meta, "base_sha256": "other"})
    assert len(calls) == 2  # another base checkpoint: uptrained again
    assert files.load_checkpoint(path)["meta"]["stamp"]["base_sha256"] == "other"



def test_main_moba_runs_checks_and_writes_json_and_plot(real_data, tmp_path, capsys, monkeypatch,
                                                        one_batch_validation):
    monkeypatch.setattr(files, "CHECKPOINT_DIR", tmp_path / "checkpoints")  # --untrained saves no checkpoint
    out_json, out_png = tmp_path / "moba.json", tmp_path / "moba.png"
    main_moba.main(["--untrained", "--preset", "cpu", "--device", "cpu", "--uptrain-steps", "1", "--top-k", "2", "1",
                    "--no-flex", "--json", str(out_json), "--plot", str(out_png)])
    assert "meaningless" in capsys.readouterr().out
    result = json.loads(out_json.read_text())
    assert result["script"] == "main_moba.py" and result["untrained"] and result["uptrain_steps"] == 1
    assert all(result["checks"].values()) and result["n_blocks"] == 8 and result["flex_note"] == "left out (--no-flex)"
    rows = result["rows"]
    assert [(r["variant"], r["top_k"]) for r in rows] == [("dense (top-8 of 8)", 8), ("MoBA top-2 of 8", 2),
                                                          ("MoBA top-1 of 8", 1)]
    assert rows[0]["keys_per_query"] == 64.5 and rows[0]["sparsity"] == 0 and rows[0]["gap_inference"] == 0
    assert rows[0]["kv_kb_token"] == 4 * 2 * 128 * 128 * 4 / 2**10  # layers, K and V, keys, H * D, float32
    assert rows[1]["keys_per_query"] == (sum(p % 16 + 1 for p in range(128)) + 16 * 7 * 16) / 128
    for r in rows[1:]:
        assert r["gap_inference"] == pytest.approx(r["loss_inference"] - rows[0]["loss_inference"], abs=1e-4)
        assert r["gap_uptrained"] == pytest.approx(r["val_loss"] - rows[0]["val_loss"], abs=1e-4)
        assert 0 < r["kv_kb_token"] < rows[0]["kv_kb_token"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "checkpoints").exists()
    renders_on_its_page("main_moba", result)


@pytest.mark.parametrize("flags", [["--top-k", "0"], ["--top-k", "8"], ["--top-k", "2", "2"], ["--block-size", "0"],
                                   ["--block-size", "-3"], ["--block-size", "128"], ["--block-size", "200"],
                                   ["--uptrain-steps", "0"], ["--lr", "0"], ["--val-batches", "0"],
                                   ["--plot", "m.txt"], ["--bogus"]])
def test_main_moba_bad_flags_are_clear_errors_before_any_work(flags, capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        main_moba.main(["--untrained", "--device", "cpu"] + flags)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_main_moba_plot_changes_nothing_in_the_json_and_the_headline_is_in_it(real_data, tmp_path, monkeypatch,
                                                                              one_batch_validation):
    monkeypatch.setattr(files, "CHECKPOINT_DIR", tmp_path / "checkpoints")
    results = []
    for plot in ([], ["--plot", str(tmp_path / "moba.png")]):
        main_moba.main(["--untrained", "--preset", "cpu", "--device", "cpu", "--uptrain-steps", "1", "--top-k", "1",
                        "--no-flex", "--json", str(tmp_path / "moba.json")] + plot)
        results.append(json.loads((tmp_path / "moba.json").read_text()))
    assert results[0].keys() == results[1].keys()
    assert [r["variant"] for r in results[0]["rows"]] == [r["variant"] for r in results[1]["rows"]]
    assert results[0]["headline"] == results[1]["headline"]  # losses of fixed seeds: the same in both runs
    assert results[0]["headline"]["technique"] == "MoBA, blocks of 16, 1 uptraining steps"
    assert results[0]["headline"]["figure"].startswith("loss against dense at inference only / uptrained: top-1 (")
