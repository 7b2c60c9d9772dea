"""distillation_loss against its definition; the frozen teacher; main_distillation.py end to end."""
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, renders_on_its_page
from test_gqa import diverging_loss, positive_or_none, rebuild_of  # noqa: F401

import inference_utils as iu
import main_distillation
from gptlite import GPTlite, generate
from gptlite_kvcache import GPTlite_KVCache, generate_kvcache
from lib import files, harness, presets, training
from lib.errors import GPTliteError, TrainingDiverged
from main_distillation import distillation_loss, distillation_loss_fn, student_preset


def logits_pair(seed=0, shape=(2, 5, 65)):
    g = torch.Generator().manual_seed(seed)
    return 3 * torch.randn(shape, generator=g), 3 * torch.randn(shape, generator=g)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 4.0])
def test_zero_for_identical_logits_positive_otherwise(temperature):
    student, teacher = logits_pair()
    assert distillation_loss(teacher.clone(), teacher, temperature).item() == pytest.approx(0.0, abs=1e-6)
    assert distillation_loss(student, teacher, temperature).item() > 0.01


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0, 4.0])
def test_is_temperature_squared_times_the_mean_kl_of_the_softened_distributions(temperature):
    student, teacher = logits_pair(1)
    p = F.softmax(teacher / temperature, dim=-1)  # [B, S, V]
    kl = (p * (p.log() - F.log_softmax(student / temperature, dim=-1))).sum(-1)  # [B, S], one KL per position
    expected = temperature**2 * kl.mean()
    assert distillation_loss(student, teacher, temperature).item() == pytest.approx(expected.item(), rel=1e-5)
    # the T**2 factor: softening by T is dividing the logits by T, then scaling by T**2
    assert distillation_loss(student, teacher, temperature).item() == pytest.approx(
        temperature**2 * distillation_loss(student / temperature, teacher / temperature, 1.0).item(), rel=1e-5)


def test_alpha_mixes_in_the_hard_label_cross_entropy():
    student, teacher = logits_pair(2)
    targets = torch.randint(65, student.shape[:2], generator=torch.Generator().manual_seed(0))
    hard = F.cross_entropy(student.flatten(0, 1), targets.flatten())
    soft = distillation_loss(student, teacher, 2.0)
    mixed = distillation_loss(student, teacher, 2.0, targets, alpha=0.3)
    assert mixed.item() == pytest.approx((0.7 * soft + 0.3 * hard).item(), rel=1e-6)
    assert distillation_loss(student, teacher, 2.0, targets, alpha=1.0).item() == pytest.approx(hard.item(), rel=1e-6)


def test_no_gradient_reaches_the_teacher():
    student_logits, teacher_logits = (t.requires_grad_() for t in logits_pair(3))
    distillation_loss(student_logits, teacher_logits, 2.0).backward()
    assert teacher_logits.grad is None and student_logits.grad.abs().sum() > 0

    torch.manual_seed(0)
    teacher, student = GPTlite(**TINY), GPTlite(**TINY)  # the teacher's parameters still require grad
    x, y = torch.randint(65, (2, 8)), torch.randint(65, (2, 8))
    distillation_loss_fn(teacher, 2.0, alpha=0.5)(student, x, y).backward()
    assert all(p.grad is None for p in teacher.parameters())
    assert all(p.grad is not None for p in student.parameters())
    assert not teacher.training  # frozen in eval mode (no dropout in the soft labels)


@pytest.mark.parametrize("kwargs, match", [(dict(temperature=0.0), "temperature"), (dict(temperature=-1.0), "temperature"),
                                           (dict(temperature=float("inf")), "temperature"),
                                           (dict(temperature=float("nan")), "temperature"),
                                           (dict(temperature=1.0, alpha=1.5), "alpha"),
                                           (dict(temperature=1.0, alpha=0.5), "targets")])
def test_bad_input_is_a_clear_error(kwargs, match):
    student, teacher = logits_pair()
    with pytest.raises(ValueError, match=match):
        distillation_loss(student, teacher, **kwargs)
    with pytest.raises(ValueError, match="same shape"):
        distillation_loss(student[:, :4], teacher, 1.0)


def test_student_of_gptlite_is_the_distilled_preset_and_the_cpu_student_is_smaller():
    assert student_preset(presets.PRESETS["gptlite"]) == presets.PRESETS["distilled"]
    cpu, student = presets.PRESETS["cpu"], student_preset(presets.PRESETS["cpu"])
    assert (student.d_model, student.n_layers, student.n_heads, student.d_head) == (64, 2, 3, 32)
    assert (student.seqlen, student.vocab_size, student.batch_size) == (cpu.seqlen, cpu.vocab_size, cpu.batch_size)


def quick_validation_loss(model, data, n_batches=20, batch_size=32, seqlen=None, seed=1234,
                          _validation_loss=training.validation_loss):
    """validation_loss on 2 batches of 8 for the scripts' end-to-end tests (train_steps calls it too)."""
    return _validation_loss(model, data, n_batches=2, batch_size=8, seqlen=seqlen, seed=seed)


def test_main_distillation_trains_three_students_saves_the_best_and_it_loads(real_data, tmp_path, capsys, monkeypatch,
                                                                             unmeasurable_tpot):
    monkeypatch.setattr(training, "validation_loss", quick_validation_loss)  # tiny settings: 2 batches of 8
    unmeasurable_tpot("soft labels")
    out_json, out_png, out_ckpt = tmp_path / "d.json", tmp_path / "d.png", tmp_path / "student.pt"
    main_distillation.main(["--untrained", "--preset", "cpu", "--device", "cpu", "--iters", "2", "--prompt-len", "8",
                            "--n-tokens", "4", "--repeats", "1", "--batch-size", "4", "--save", str(out_ckpt),
                            "--json", str(out_json), "--plot", str(out_png)])
    printed = capsys.readouterr().out
    assert "identical logits" in printed and "meaningless" in printed
    result = json.loads(out_json.read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["teacher", "hard labels", "soft labels", "soft + hard (alpha=0.5)"]
    student_params = sum(p.numel() for p in GPTlite(**student_preset(presets.PRESETS["cpu"]).gptlite_kwargs()).parameters())
    assert rows["teacher"]["params"] > 6 * student_params and rows["hard labels"]["params"] == student_params
    for r in rows.values():
        assert positive_or_none(r["tpot_ms"]) and r["tokens_per_s"] > 0 and r["val_loss"] > 0
        teacher_tpot = rows["teacher"]["tpot_ms"]
        if teacher_tpot is None or r["tpot_ms"] is None:  # an unmeasurable TPOT: no speedup, printed "-"
            assert r["speedup"] is None
        else:
            assert r["speedup"] == pytest.approx(teacher_tpot / r["tpot_ms"], abs=0.006)
    assert rows["soft labels"]["tpot_ms"] is None and rows["soft labels"]["speedup"] is None
    assert all(len(h) == 2 for h in result["histories"].values())  # evaluated after each of the 2 steps
    assert result["headline"]["technique"] == (f"distillation, {student_params / 1e6:.2f}M student of the "
                                               f"{rows['teacher']['params'] / 1e6:.2f}M model, 2 steps")
    assert result["headline"]["figure"].startswith(f"val loss soft + hard {rows['soft + hard (alpha=0.5)']['val_loss']:.3f}")
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    ckpt = files.load_checkpoint(out_ckpt, vocab=real_data.vocab)
    assert ckpt["meta"]["variant"] == result["best"] and result["saved"] == str(out_ckpt)
    assert rebuild_of(ckpt).startswith("python main_distillation.py --untrained --preset cpu")
    model = GPTlite(**ckpt["config"]).eval()
    model.load_state_dict(ckpt["state_dict"])
    cached = GPTlite_KVCache(**ckpt["config"]).eval()
    cached.load_state_dict(ckpt["state_dict"])
    prompt = torch.tensor([real_data.encode("ROMEO:")])
    assert torch.equal(generate_kvcache(cached, prompt, 8, model.seqlen), generate(model, prompt, 8, model.seqlen))
    assert training.validation_loss(model, real_data) == pytest.approx(rows[result["best"]]["val_loss"], abs=1e-6)  # the best one
    renders_on_its_page("main_distillation", result)


def test_a_diverging_run_is_an_error_and_writes_nothing(real_data, tmp_path, monkeypatch, diverging_loss):
    monkeypatch.setattr(training, "validation_loss", quick_validation_loss)
    with pytest.raises(GPTliteError):
        main_distillation.main(["--untrained", "--preset", "cpu", "--device", "cpu", "--iters", "1", "--prompt-len", "8",
                                "--n-tokens", "2", "--repeats", "1", "--batch-size", "2", "--save", str(tmp_path / "s.pt"),
                                "--json", str(tmp_path / "d.json"), "--plot", str(tmp_path / "d.png")])
    assert list(tmp_path.iterdir()) == []  # no file, not even a temporary one


@pytest.mark.parametrize("flags", [["--temperature", "0"], ["--temperature", "-2"], ["--temperature", "inf"],
                                   ["--temperature", "nan"], ["--alpha", "0"], ["--alpha", "1"], ["--alpha", "nan"],
                                   ["--iters", "0"], ["--batch-size", "0"], ["--n-tokens", "1"], ["--prompt-len", "129"],
                                   ["--prompt-len", "0"], ["--repeats", "0"], ["--save", "/no/such/folder/s.pt"], ["--bogus"]])
def test_bad_flags_are_clear_errors_before_any_work(flags, capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        main_distillation.main(["--untrained", "--device", "cpu"] + flags)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--batch-size", "--n-tokens"])
def test_a_huge_size_flag_is_a_parser_error_before_any_work(flag, capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        main_distillation.main(["--untrained", "--device", "cpu", "--preset", "cpu", flag, "1000000000000"])
    assert e.value.code == 2 and f"error: {flag}: " in capsys.readouterr().err


def test_kv_cache_tokens_that_differ_stop_the_run_before_any_timing(real_data, tmp_path, monkeypatch):
    monkeypatch.setattr(training, "validation_loss", quick_validation_loss)
    monkeypatch.setattr(iu, "generate_kvcache", lambda model, prompts, n, seqlen: torch.zeros(  # a broken cache
        prompts.shape[0], prompts.shape[1] + n, dtype=torch.long))
    monkeypatch.setattr(iu, "compare_generation", lambda *a, **k: pytest.fail("timed despite a failed check"))
    with pytest.raises(GPTliteError, match="checks failed: teacher: KV-cache tokens = the model's own"):
        main_distillation.main(["--untrained", "--preset", "cpu", "--device", "cpu", "--iters", "1", "--prompt-len", "8",
                                "--n-tokens", "2", "--repeats", "1", "--batch-size", "2", "--json", str(tmp_path / "d.json")])
    assert list(tmp_path.iterdir()) == []


def test_a_diverged_distillation_names_the_temperature_not_only_the_learning_rate(real_data):
    """Soft labels scale the gradients by T**2: a divergence of a distilled student names T; the hard-label
    student, trained as gptlite.py trains, names the learning rate as before."""
    nan_loss = lambda model, x, y: training.cross_entropy_loss(model, x, y) * float("nan")  # noqa: E731
    config = dict(TINY, vocab_size=len(real_data.vocab))
    for name, message in [("soft labels", r"\(distillation temperature T=4, which scales the soft labels' gradients "
                                          r"by T\*\*2 = 16, and peak learning rate 0.001\); rerun with a lower "
                                          r"temperature or a lower learning rate. Nothing was saved"),
                          ("hard labels", r"\(peak learning rate 0.001\); rerun with a lower learning rate. Nothing")]:
        with pytest.raises(TrainingDiverged, match=message):
            main_distillation.train_students(real_data, config, {name: nan_loss}, 2, 2, 1e-3, 0, "cpu", temperature=4.0)
