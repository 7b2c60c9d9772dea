"""lib/compiled.py (the static-shape step, torch.compile, AOTInductor), lib/engines.py (the GPT-2 port,
CTranslate2) and main_compile.py. Nothing here asserts on a timing. One torch.compile and one AOTI
package of a tiny model per session (the module fixture): each takes about a minute on a loaded CPU."""
import importlib.util
import json

import pytest
import torch

import main_compile
from gptlite_kvcache import GPTlite_KVCache, StaticKVCache, generate_kvcache
from lib import compiled, engines, fast_decode, harness
from conftest import renders_on_its_page

# n_heads * d_head == d_model (GPT-2 needs it) and vocab 65 <= d_model (the head's bias folds into ln_f)
PORTABLE = dict(vocab_size=65, d_model=80, n_heads=4, d_head=20, n_layers=2, dropout_p=0.0, seqlen=16)
PROMPT_LEN, N_TOKENS = 4, 10  # 14 of the 16 slots


def peaked(config, seed=0):
    """A GPTlite_KVCache whose parameters are N(0, 0.5): peaked logits, so that a wrong mask, position or
    weight changes the greedy tokens (the N(0, 0.02) init gives near-ties)."""
    torch.manual_seed(seed)
    model = GPTlite_KVCache(**config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module")
def tiny():
    """(model, prompt [2, 4], eager tokens [2, 14]) with the static cache of the repository."""
    model = peaked(PORTABLE)
    prompt = torch.randint(0, 65, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    cache = StaticKVCache.for_model(model, 2)
    return model, prompt, generate_kvcache(model, prompt, N_TOKENS, model.seqlen, kv_cache=cache)


@pytest.fixture(scope="module")
def compiled_default(tiny):
    model, prompt, _ = tiny
    torch._dynamo.reset()
    return compiled.compiled_generation(model, "default", prompt, N_TOKENS)


def test_the_static_step_uncompiled_gives_the_static_cache_tokens(tiny):
    model, prompt, eager = tiny
    keys, values = compiled.new_buffers(model, 2)
    assert torch.equal(compiled.generate_static(compiled.StaticStep(model), prompt, N_TOKENS, keys, values), eager)
    # the buffers are overwritten from slot 0: a second run on the used buffers gives the same tokens
    assert torch.equal(compiled.generate_static(compiled.StaticStep(model), prompt, N_TOKENS, keys, values), eager)


def test_torch_compile_gives_eager_tokens_with_one_graph_for_every_decode_position(tiny, compiled_default):
    _, _, eager = tiny
    generate, seconds, graphs = compiled_default
    assert torch.equal(generate(N_TOKENS), eager)
    assert graphs == 2  # prefill and decode: the 9 decode positions share one graph
    assert seconds > 0


def test_an_aoti_package_gives_eager_tokens(tiny, tmp_path_factory):
    model, prompt, eager = tiny
    runners, _ = compiled.aoti_package(model, 2, PROMPT_LEN, tmp_path_factory.mktemp("aoti") / "tiny")
    keys, values = compiled.new_buffers(model, 2)
    assert torch.equal(compiled.aoti_generation(runners, prompt, keys, values)(N_TOKENS), eager)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_the_gpt2_port_has_gptlites_logits_and_tokens(tiny):
    model, prompt, eager = tiny
    hf = engines.to_gpt2(model)
    with torch.no_grad():
        ours, theirs = model(prompt)[0], hf(prompt).logits  # [2, 4, 65]
    # float32 through other kernels, and the head's bias through pinv: within 1e-4 on logits of a few units
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=0), (ours - theirs).abs().max()
    assert torch.equal(engines.hf_generate(hf, prompt, N_TOKENS), eager)


def test_gpt2_cannot_express_heads_narrower_than_the_model():
    with pytest.raises(ValueError, match="n_heads \\* d_head == d_model"):
        engines.to_gpt2(GPTlite_KVCache(**dict(PORTABLE, d_head=16)))


@pytest.mark.skipif(importlib.util.find_spec("ctranslate2") is None, reason="ctranslate2 is not installed")
def test_ctranslate2_float32_gives_eager_tokens_and_int8_runs(tiny, tmp_path):
    model, prompt, eager = tiny
    hf = engines.to_gpt2(model)
    generator = engines.ct2_generator(engines.ct2_model(hf, "float32", str(tmp_path / "f32")), threads=1)
    assert torch.equal(engines.ct2_generate(generator, prompt, N_TOKENS), eager)
    int8 = engines.ct2_generator(engines.ct2_model(hf, "int8", str(tmp_path / "i8")), threads=1)
    assert engines.ct2_generate(int8, prompt, N_TOKENS).shape == eager.shape  # its tokens may differ
    assert torch.equal(engines.hf_generate(hf, prompt, N_TOKENS), eager)  # converting left the port's weights alone


def test_a_missing_engine_is_one_line_naming_the_package():
    assert engines.missing("json") is None
    assert "pip install no_such_engine_pkg" in engines.missing("no_such_engine_pkg")


# ----------------------------------------------------------------------------------------------------
# main_compile.py

QUICK = ["--preset", "cpu", "--device", "cpu", "--repeats", "1", "--n-tokens", "4", "--prompt-len", "4",
         "--batch-sizes", "1", "--extra-presets", "--threads", "1"]


@pytest.mark.parametrize("flags, match", [
    (["--modes", "reduce-overhead"], "need a CUDA device"), (["--modes", "turbo"], "invalid choice"),
    (["--threads", "0"], "at least 1"), (["--n-tokens", "125"], "exceeds the cpu preset's seqlen=128"),
    (["--extra-presets", "cpu"], "is --preset's shape already"), (["--engines", "vllm"], "invalid choice"),
    (["--batch-sizes", "1", "1"], "repeats a value")])
def test_bad_compile_flags_are_clear_errors_before_any_work(flags, match, capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        main_compile.main(["--untrained"] + QUICK + flags)
    assert e.value.code == 2 and match in capsys.readouterr().err


def test_no_cpp_compiler_is_a_clear_error_before_any_work(capsys, monkeypatch):
    """torch.compile and the fast path build C++ on a CPU: without a compiler, one line, before the data."""
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    monkeypatch.setattr(harness.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit) as e:
        main_compile.main(["--untrained"] + QUICK + ["--modes", "fast"])
    assert e.value.code == 2 and "no C++ compiler" in capsys.readouterr().err


def test_main_compile_times_the_fast_path_with_eagers_tokens(real_data, tmp_path):
    """--modes fast: the C++ row is timed only after its tokens equal eager's (require_checks), and the
    goal lines compare the fastest of ours with the fastest engine per batch size."""
    out = tmp_path / "c.json"
    main_compile.main(["--untrained", "--json", str(out), "--modes", "fast", "--engines", "ct2"] + QUICK[:-5]
                      + ["--batch-sizes", "1", "2", "--extra-presets", "--threads", "1"])
    result = json.loads(out.read_text())
    rows = {(r["variant"], r["batch_size"]): r for r in result["rows"]}
    assert {("fast (C++)", 1), ("fast (C++)", 2)} <= set(rows)
    assert all(rows[("fast (C++)", b)]["same_tokens"] == "yes" for b in (1, 2))
    renders_on_its_page("main_compile", result)


def test_the_goal_compares_our_fastest_with_the_fastest_engine_per_batch():
    preset = main_compile.get_preset("cpu")
    rows = [dict(variant=v, shape="cpu (trained)", batch_size=b, tpot_ms=t, threads=1) for v, b, t in [
        ("eager", 1, 2.0), ("fast (C++)", 1, 0.06), ("ct2", 1, 0.08), ("ct2-int8", 1, 0.075),
        ("eager", 8, 5.0), ("fast (C++)", 8, 0.5), ("ct2", 8, 0.3), ("hf", 8, None)]]
    rows.append(dict(variant="fast (C++)", shape="distilled (untrained)", batch_size=8, tpot_ms=0.01, threads=1))
    lines = main_compile.goal_lines(rows, preset, calls=600, step_ms=1.0)
    assert "batch 1: fastest of ours fast (C++) 0.060 ms (1 threads) against ct2-int8 0.075 ms" in lines[0]
    assert lines[0].endswith("= 0.80x: met (<= 1.5x)")
    assert "batch 8: fastest of ours fast (C++) 0.500 ms" in lines[1] and lines[1].endswith("= 1.67x: NOT met (<= 1.5x)")
    assert main_compile.headline(rows, preset)["figure"] == ("batch 1: fast (C++) 0.80x ct2-int8's TPOT; "
                                                             "batch 8: fast (C++) 1.67x ct2's TPOT")


def test_main_compile_skips_an_engine_that_is_not_installed_in_one_line(real_data, tmp_path, capsys, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "ctranslate2" else find_spec(name))
    out = tmp_path / "c.json"
    main_compile.main(["--untrained", "--json", str(out), "--modes", "--engines", "hf", "ct2"] + QUICK)
    printed = capsys.readouterr().out
    assert "ct2: ctranslate2 is not installed (pip install ctranslate2)" in printed and "Traceback" not in printed
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"eager", "eager, static step"} | ({"hf"} if find_spec("transformers") else set())
    assert rows["eager"]["vs_eager"] in (None, pytest.approx(1.0)) and rows["eager"]["threads"] == 1  # None: noise
    assert all(r["same_tokens"] in ("yes", "no") or r["same_tokens"].startswith("no (") for r in rows.values())
