"""GQA/MQA: conversion by mean pooling against the multi-head model, the smaller cache, cached against
uncached decoding, clear errors; main_gqa.py end to end on random weights."""
import json

import pytest
import torch
from conftest import TINY, renders_on_its_page

import inference_utils as iu
import main_gqa
from gptlite import GPTlite, generate
from gptlite_gqa import GPTlite_GQA, convert_mha_to_gqa, group_counts
from lib.variant_checkpoints import load_gqa
from gptlite_kvcache import StaticKVCache, generate_kvcache
from lib import files, harness, presets, training
from lib.errors import CheckpointError, GPTliteError

ATOL = 1e-5  # float32
SEQLEN, H, D = TINY["seqlen"], TINY["n_heads"], TINY["d_head"]
FOUR_HEADS = dict(TINY, n_heads=4)  # 4 heads: MHA, GQA with 2 groups, MQA


def random_tokens(batch_size, length, seed=1):
    return torch.randint(TINY["vocab_size"], (batch_size, length), generator=torch.Generator().manual_seed(seed))


def random_mha(config, seed=0):
    """A GPTlite with every parameter from N(0, 0.5), as conftest's tiny_models."""
    torch.manual_seed(seed)
    model = GPTlite(**config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model


def converted(base, config, n_groups):
    model = GPTlite_GQA(**config, n_groups=n_groups).eval()
    model.load_state_dict(convert_mha_to_gqa(base.state_dict(), config["n_heads"], config["d_head"], n_groups))
    return model


@torch.inference_mode()
def greedy_without_cache(model, prompt, n_tokens):
    """Greedy decoding that re-encodes the whole sequence at every step, for models returning (logits, cache).
    Returns the prompt followed by the new tokens, as generate_kvcache does."""
    idx = prompt
    for _ in range(n_tokens):
        next_token = model(idx)[0][:, -1].argmax(dim=-1, keepdim=True)
        idx = torch.cat([idx, next_token], dim=1)
    return idx


@torch.inference_mode()
def prefill_then_steps(model, x, n_prefill, kv_cache=None, max_seqlen=None):
    """Logits of x [B, S]: the first n_prefill tokens at once, then one token at a time on the cache."""
    logits, cache = model(x[:, :n_prefill], kv_cache=kv_cache, max_seqlen=max_seqlen)
    steps = [logits]
    for t in range(n_prefill, x.shape[1]):
        logits, cache = model(x[:, t:t + 1], kv_cache=cache, max_seqlen=max_seqlen)
        steps.append(logits)
    return torch.cat(steps, dim=1), cache


def test_mha_conversion_equals_the_multi_head_model_exactly(tiny_models):
    base, cached = tiny_models
    mha = converted(base, TINY, H)
    x = random_tokens(3, SEQLEN)
    with torch.inference_mode():
        assert torch.equal(mha(x)[0], base(x))
        assert torch.equal(mha(x)[0], cached(x)[0])
    prompt = random_tokens(3, 5, seed=2)
    n_tokens = SEQLEN - 5 + 1
    expected = generate(base, prompt, n_tokens, SEQLEN)
    assert torch.equal(generate_kvcache(mha, prompt, n_tokens, SEQLEN), expected)
    # past the window too (the cache keeps the last max_seqlen entries), the logits of the multi-head cached model
    long = random_tokens(2, 3 * SEQLEN, seed=4)
    for window in (SEQLEN, 7):
        torch.testing.assert_close(prefill_then_steps(mha, long, 5, max_seqlen=window)[0],
                                   prefill_then_steps(cached, long, 5, max_seqlen=window)[0], atol=ATOL, rtol=0)


def test_conversion_mean_pools_consecutive_heads():
    """GQA with the pooled weights = the multi-head model whose every head carries its group's pooled key
    and value head: checks the pooling and which heads form a group."""
    base = random_mha(FOUR_HEADS)
    gqa = converted(base, FOUR_HEADS, 2)
    expanded = {}
    for name, tensor in gqa.state_dict().items():
        if ".key_proj." in name or ".value_proj." in name:  # [G*D, ...] -> each group head repeated H/G times
            tensor = tensor.view(2, D, *tensor.shape[1:]).repeat_interleave(2, dim=0).reshape(4 * D, *tensor.shape[1:])
        expanded[name] = tensor
    reference = GPTlite(**FOUR_HEADS).eval()
    reference.load_state_dict(expanded)
    x = random_tokens(2, SEQLEN)
    with torch.inference_mode():
        torch.testing.assert_close(gqa(x)[0], reference(x), atol=ATOL, rtol=0)
        assert not torch.allclose(gqa(x)[0], base(x), atol=1e-2)  # pooling changes the model
    w = base.state_dict()["blocks.0.mha.key_proj.weight"]  # [4*D, d_model]
    torch.testing.assert_close(gqa.state_dict()["blocks.0.mha.key_proj.weight"][:D], (w[:D] + w[D:2 * D]) / 2)


@pytest.mark.parametrize("config", [TINY, FOUR_HEADS], ids=["3 heads", "4 heads"])
def test_cache_holds_the_groups_only_mqa_is_one_over_n_heads(config):
    base = random_mha(config)
    x = random_tokens(2, SEQLEN)
    n_heads = config["n_heads"]
    sizes = {}
    for n_groups in group_counts(n_heads):
        with torch.inference_mode():
            _, cache = converted(base, config, n_groups)(x)
        assert cache[0][0].shape == (2, n_groups, SEQLEN, D)
        sizes[n_groups] = iu.kv_cache_bytes(cache)
    assert sizes[1] * n_heads == sizes[n_heads]  # MQA
    assert all(sizes[g] * n_heads == sizes[n_heads] * g for g in sizes)
    static = StaticKVCache.for_model(converted(base, config, 1), 2)  # n_groups heads, read off key_proj
    assert static.nbytes * n_heads == StaticKVCache.for_model(converted(base, config, n_heads), 2).nbytes


@pytest.mark.parametrize("n_groups", [1, 2, 4])
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_gqa_with_a_cache_matches_gqa_without(n_groups, kind):
    gqa = converted(random_mha(FOUR_HEADS), FOUR_HEADS, n_groups)
    x = random_tokens(3, SEQLEN, seed=3)
    with torch.inference_mode():
        full = gqa(x)[0]
    new_cache = (lambda: None) if kind == "dynamic" else (lambda: StaticKVCache.for_model(gqa, 3))
    logits, cache = prefill_then_steps(gqa, x, 5, new_cache())
    torch.testing.assert_close(logits, full, atol=ATOL, rtol=0)
    assert cache[0][0].shape[1] == n_groups if kind == "dynamic" else cache.keys.shape[2] == n_groups
    chunks, cache = [], new_cache()  # several new tokens on top of a cache
    for start, stop in [(0, 4), (4, 9), (9, SEQLEN)]:
        logits, cache = gqa(x[:, start:stop], kv_cache=cache)
        chunks.append(logits)
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=ATOL, rtol=0)
    prompt, n_tokens = x[:, :5], SEQLEN - 5 + 1
    tokens = generate_kvcache(gqa, prompt, n_tokens, SEQLEN, kv_cache=new_cache())
    assert torch.equal(tokens, greedy_without_cache(gqa, prompt, n_tokens))


def test_bad_group_counts_and_caches_are_clear_errors(tiny_models):
    base, cached = tiny_models
    for n_groups in (2, 0, 4, 1.5):
        with pytest.raises(ValueError, match=r"n_groups must divide n_heads=3.*\[1, 3\]"):
            GPTlite_GQA(**TINY, n_groups=n_groups)
        with pytest.raises(ValueError, match="n_groups must divide"):
            convert_mha_to_gqa(base.state_dict(), H, D, n_groups)
    with pytest.raises(ValueError, match="not n_heads \\* d_head"):
        convert_mha_to_gqa(base.state_dict(), 4, D, 2)  # the wrong head count for this state dict
    mqa, prompt = converted(base, TINY, 1), random_tokens(2, 4)
    _, mha_cache = cached(prompt)
    with pytest.raises(ValueError, match="another model, batch or dtype"):
        generate_kvcache(mqa, prompt, 3, SEQLEN, kv_cache=mha_cache)  # 3 heads cached, MQA has 1
    with pytest.raises(ValueError, match="another model, batch or dtype"):
        mha_static = StaticKVCache(TINY["n_layers"], 2, H, D, SEQLEN)  # n_heads, not n_groups
        generate_kvcache(mqa, prompt, 3, SEQLEN, kv_cache=mha_static)


def test_saved_gqa_checkpoint_loads_with_its_config(tmp_path):
    gqa = converted(random_mha(FOUR_HEADS), FOUR_HEADS, 2)
    path = tmp_path / "gqa.pt"
    files.save_checkpoint(path, gqa, {**FOUR_HEADS, "n_groups": 2}, "abc")
    loaded = load_gqa(path)
    x = random_tokens(2, SEQLEN)
    with torch.inference_mode():
        assert torch.equal(loaded(x)[0], gqa(x)[0])
    files.save_checkpoint(path, random_mha(TINY), TINY, "abc")
    with pytest.raises(CheckpointError, match="not a GQA checkpoint"):
        load_gqa(path)



@pytest.fixture
def diverging_loss(monkeypatch):
    """Every train_steps call trains on a NaN loss, as a run whose loss diverges."""
    train_steps = training.train_steps

    def nan_loss(model, x, y):
        return training.cross_entropy_loss(model, x, y) * float("nan")
    monkeypatch.setattr(training, "train_steps", lambda *args, **kwargs: train_steps(*args, **{**kwargs, "loss_fn": nan_loss}))


def rebuild_of(ckpt):
    """The command saved with a derived checkpoint that rebuilds it (at the top or in its meta)."""
    return ckpt.get("rebuild") or ckpt["meta"]["rebuild"]


SMALL_SHAPE = ("--shape-batch", "2", "--shape-context", "16", "--shape-tokens", "3")  # the gptlite-shape rows, quick


def positive_or_none(value):
    """A TPOT (or a ratio of TPOTs) is positive, or None when timing noise left it unmeasurable; never <= 0."""
    return value is None or value > 0


def test_main_gqa_runs_checks_saves_json_plot_and_checkpoint(real_data, tmp_path, capsys, one_batch_validation,
                                                              unmeasurable_tpot):
    unmeasurable_tpot(("MQA", "eager"))
    out_json, out_png, out_ckpt = tmp_path / "gqa.json", tmp_path / "gqa.png", tmp_path / "gqa.pt"
    main_gqa.main(["--untrained", "--preset", "cpu", "--device", "cpu", "--uptrain-steps", "1", "--batch-size", "2",
                   "--n-tokens", "4", "--repeats", "1", "--json", str(out_json), "--plot", str(out_png),
                   "--save", str(out_ckpt), *SMALL_SHAPE])
    printed = capsys.readouterr().out
    assert "meaningless" in printed and "equals the multi-head model: yes" in printed
    assert "identical logits" in printed
    result = json.loads(out_json.read_text())
    assert result["script"] == "main_gqa.py" and result["untrained"] and result["uptrain_steps"] == 1
    assert result["saved"] == str(out_ckpt)
    shape_checks = {c for c in result["checks"] if c.startswith("gptlite shape, ")}
    assert all(result["checks"].values()) and set(result["checks"]) - shape_checks == {
        "MHA", "GQA-2", "MQA", "MHA conversion exact"} | {f"{v}: fast path tokens = eager's" for v in ("MHA", "GQA-2", "MQA")}
    gptlite = presets.PRESETS["gptlite"]  # 6 heads: MHA, GQA-3, GQA-2, MQA
    names = ["MHA", "GQA-3", "GQA-2", "MQA"]
    assert sorted(c.split(":")[0] for c in shape_checks) == sorted(f"gptlite shape, {v}" for v in names)
    (shape,) = result["tables"]
    assert [(r["variant"], r["path"], r["shape"], r["batch_size"], r["context"]) for r in shape["rows"]] == [
        (v, p, "gptlite", 2, 16) for p in ("eager", "fast") for v in names]
    for r, g in zip(shape["rows"], [6, 3, 2, 1] * 2):  # the cache of g key/value heads, float32
        kv = 2 * 16 * gptlite.n_layers * 2 * g * gptlite.d_head * 4
        assert r["kv_mb"] == round(kv / 2**20, 1) and r["bytes_per_step"] > kv and r["weight_mb"] > 50
        at_json_bandwidth = r["bytes_per_step"] / result["bandwidth_GB_per_s"] / 1e6  # its bandwidth rounded to 0.1
        assert r["at_bandwidth_ms"] == pytest.approx(at_json_bandwidth, rel=0.01, abs=0.01)
        assert positive_or_none(r["tpot_ms"]) and positive_or_none(r["tpot_vs_mha"])
    assert [r["tpot_vs_mha"] for r in shape["rows"] if r["variant"] == "MHA"] == [1.0, 1.0]
    assert result["bandwidth_GB_per_s"] > 0 and "Decoding at the gptlite shape" in shape["title"]
    assert [(r["variant"], r["path"]) for r in result["rows"]] == [
        (v, p) for p in ("eager", "fast") for v in ("MHA", "GQA-2", "MQA")]
    fast = result["rows"][3:]
    rows = result["rows"][:3]
    assert [(r["variant"], r["n_groups"], r["kv_vs_mha"]) for r in rows] == [
        ("MHA", 4, 1.0), ("GQA-2", 2, 0.5), ("MQA", 1, 0.25)]
    assert [r["val_loss"] for r in fast] == [r["val_loss"] for r in rows]  # the same models, timed on the C++ path
    assert all(r["ttft_ms"] > 0 and positive_or_none(r["tpot_ms"]) for r in fast)
    p = presets.PRESETS["cpu"]
    assert rows[0]["kv_cache_mb"] == pytest.approx(2 * p.n_layers * 2 * p.n_heads * p.seqlen * p.d_head * 4 / 2**20)
    for r in rows:
        assert r["ttft_ms"] > 0 and positive_or_none(r["tpot_ms"]) and r["tokens_per_s"] > 0 and r["peak_mem_mb"] > 0
        assert r["val_loss"] > 0 and r["loss_converted"] > 0 and r["cached_ok"] == "yes"
        assert r["loss_vs_mha"] == pytest.approx(r["val_loss"] - rows[0]["val_loss"], abs=1e-4)
    assert rows[2]["tpot_ms"] is None and rows[0]["loss_vs_mha"] == 0
    assert "TPOT ms" in result["columns"][2] and "loss_vs_mha" in [c[0] for c in result["columns"]]
    base = iu.load_model(GPTlite, "cpu", untrained=True, seed=0)  # the script's random weights
    assert rows[0]["loss_converted"] == pytest.approx(training.validation_loss(base, real_data), abs=1e-4)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # a None TPOT is left out of the plot
    saved = load_gqa(out_ckpt)
    assert saved.blocks[0].mha.n_groups == 2 and files.load_checkpoint(out_ckpt)["meta"]["uptrain_steps"] == 1
    assert rebuild_of(files.load_checkpoint(out_ckpt)).startswith("python main_gqa.py --untrained --preset cpu --device cpu")


def test_main_gqa_saves_nothing_unless_asked(real_data, tmp_path, monkeypatch, one_batch_validation):
    monkeypatch.setattr(files, "CHECKPOINT_DIR", tmp_path)
    monkeypatch.chdir(tmp_path)
    main_gqa.main(["--untrained", "--preset", "cpu", "--device", "cpu", "--uptrain-steps", "1", "--batch-size", "2",
                   "--n-tokens", "2", "--repeats", "1", "--shape-batch", "0"])
    assert list(tmp_path.iterdir()) == []


def test_a_diverging_run_is_an_error_and_writes_nothing(real_data, tmp_path, one_batch_validation, diverging_loss):
    out = [tmp_path / "gqa.json", tmp_path / "gqa.png", tmp_path / "gqa.pt"]
    with pytest.raises(GPTliteError):
        main_gqa.main(["--untrained", "--preset", "cpu", "--device", "cpu", "--uptrain-steps", "1", "--batch-size", "2",
                       "--n-tokens", "2", "--repeats", "1", "--json", str(out[0]), "--plot", str(out[1]),
                       "--save", str(out[2]), "--shape-batch", "0"])
    assert list(tmp_path.iterdir()) == []  # no file, not even a temporary one


def test_rebuild_command_names_the_script_its_flags_and_the_preset():
    cpu = presets.PRESETS["cpu"]
    assert files.rebuild_command("main_gqa.py", ["--save", "a b.pt"], cpu) == "python main_gqa.py --preset cpu --save 'a b.pt'"
    assert files.rebuild_command("main_gqa.py", ["--preset=gptlite"], cpu) == "python main_gqa.py --preset=gptlite"
    # the output paths are not part of it (a reproduce run's temporary paths would be)
    assert (files.rebuild_command("main_gqa.py", ["--json", "/tmp/a.json", "--steps", "3", "--plot=/tmp/a.png"], cpu)
            == "python main_gqa.py --preset cpu --steps 3")


@pytest.mark.parametrize("flags", [["--uptrain-steps", "0"], ["--batch-size", "0"], ["--n-tokens", "1"],
                                   ["--prompt-len", "129"], ["--prompt-len", "0"], ["--repeats", "0"], ["--lr", "0"],
                                   ["--lr", "inf"], ["--lr", "nan"], ["--save-groups", "3"], ["--save-groups", "0"],
                                   ["--save", "/no/such/folder/g.pt"], ["--plot", "g.txt"], ["--bogus"]])
def test_main_gqa_bad_flags_are_clear_errors_before_any_work(flags, capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        main_gqa.main(["--untrained", "--device", "cpu"] + flags)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--batch-size", "--n-tokens"])
def test_main_gqa_a_huge_size_flag_is_a_parser_error_before_any_work(flag, capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        main_gqa.main(["--untrained", "--device", "cpu", "--preset", "cpu", flag, "1000000000000"])
    assert e.value.code == 2 and f"error: {flag}: " in capsys.readouterr().err


def test_main_gqa_a_failed_check_stops_before_any_timing(real_data, tmp_path, monkeypatch, one_batch_validation):
    monkeypatch.setattr(training, "cached_matches_full", lambda model, window, atol=1e-4: False)
    monkeypatch.setattr(iu, "compare_generation", lambda *a, **k: pytest.fail("timed despite a failed check"))
    with pytest.raises(GPTliteError, match="checks failed: MHA; GQA-2; MQA; this is a bug"):
        main_gqa.main(["--untrained", "--preset", "cpu", "--device", "cpu", "--uptrain-steps", "1", "--batch-size", "2",
                       "--n-tokens", "2", "--repeats", "1", "--json", str(tmp_path / "g.json"), *SMALL_SHAPE])
    assert list(tmp_path.iterdir()) == []


def test_main_gqa_json_has_its_headline(real_data, tmp_path, one_batch_validation):
    out = tmp_path / "g.json"
    main_gqa.main(["--untrained", "--preset", "cpu", "--device", "cpu", "--uptrain-steps", "1", "--batch-size", "2",
                   "--n-tokens", "2", "--repeats", "1", "--json", str(out), "--shape-batch", "0"])
    result = json.loads(out.read_text())
    assert result["headline"]["technique"] == "GQA and MQA, converted from MHA, 1 uptraining steps"
    assert result["headline"]["figure"].startswith("KV cache / MHA's: GQA-2 0.5, MQA 0.25; TPOT at batch 2: eager MHA ")
    assert "; fast MHA " in result["headline"]["figure"]
    renders_on_its_page("main_gqa", result)
