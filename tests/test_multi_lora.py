"""gptlite_lora.py and main_multi_lora.py: peft's adapters taken out exactly, the BGMV layer against the
merged weight row by row, batched and merged serving against each request generated alone, bad input."""
import copy
import dataclasses
import json
import re

import pytest
import torch
from conftest import TINY, renders_on_its_page

import gptlite_lora as gl
import inference_utils as iu
import main_multi_lora
from gptlite import GPTlite
from lib import corpus, files, harness, lora_peft, presets, training
from lib.errors import GPTliteError, TrainingDiverged

SEQLEN = TINY["seqlen"]
TARGETS = ("query_proj", "value_proj", "ffwd.net.0")  # attention and MLP: both kinds of target


def tokens(*shape, seed=0):
    return torch.randint(TINY["vocab_size"], shape, generator=torch.Generator().manual_seed(seed))


def adapters_for(model, n, targets=TARGETS, rank=4):
    return [gl.random_adapter(model, rank, targets, seed=s, std=0.3) for s in range(n)]


@torch.no_grad()
def one_token_at_a_time(model, prompt, n_tokens):
    """Greedy decoding by the full forward pass of the whole sequence at every step (no cache). prompt: 1-D."""
    sequence = prompt
    for _ in range(n_tokens):
        sequence = torch.cat([sequence, training.logits_of(model(sequence[None]))[0, -1].argmax()[None]])
    return sequence


@torch.no_grad()
def merged_by_hand(model, adapter):
    """W + (alpha / r) B A written into a plain GPTlite, from the module names: the reference merge."""
    merged = GPTlite(**TINY).eval()
    merged.load_state_dict(model.state_dict())
    params = dict(merged.named_parameters())
    for i, name in enumerate(adapter.names):
        params[f"{name}.weight"] += adapter.alpha / adapter.rank * adapter.B[i] @ adapter.A[i]
    return merged


def test_adapter_taken_out_of_peft_gives_peft_logits(tiny_models):
    base, _ = tiny_models
    peft = lora_peft.peft_model(copy.deepcopy(base), 4, TARGETS, alpha=6)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)  # peft starts B at zero: make the update show
    adapter = lora_peft.adapter_from_peft(peft, base)
    assert adapter.rank == 4 and adapter.targets == TARGETS and adapter.scaling == 6 / 4
    x = tokens(2, SEQLEN)
    with torch.no_grad():
        expected = peft(x)
        assert (expected - base(x)).abs().max() > 0.1  # the adapter changes the logits
        torch.testing.assert_close(gl.merge_adapter(base, adapter)(x), expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(merged_by_hand(base, adapter)(x), expected, atol=1e-5, rtol=0)


def test_peft_trains_only_the_adapter(tiny_models):
    base, _ = tiny_models
    peft = lora_peft.peft_model(copy.deepcopy(base), 2)
    trainable = [n for n, p in peft.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert len(trainable) == 2 * TINY["n_layers"] * len(gl.ATTENTION_TARGETS)


def test_lora_linear_is_the_merged_weight_row_by_row():
    torch.manual_seed(0)
    base = torch.nn.Linear(6, 5)
    A, B = torch.randn(3, 6, 2), torch.randn(3, 2, 5)  # [N, in, r], [N, r, out]
    layer = gl.LoRALinear(base, A, B)
    x, ids = torch.randn(4, 7, 6), torch.tensor([2, 0, 2, 1])
    layer.ids = ids
    for b, a in enumerate(ids.tolist()):
        weight = base.weight + (A[a] @ B[a]).t()  # [out, in]
        torch.testing.assert_close(layer(x)[b], x[b] @ weight.t() + base.bias, atol=1e-5, rtol=0)
    layer.ids = None
    assert torch.equal(layer(x), base(x))


@pytest.mark.parametrize("targets", [gl.ATTENTION_TARGETS, TARGETS])
def test_batched_and_merged_give_each_request_alone_with_its_merged_adapter(tiny_models, targets):
    base, base_kv = tiny_models
    adapters = adapters_for(base, 3, targets)
    prompts, ids, n_tokens = tokens(6, 5, seed=1), torch.tensor([0, 2, 1, 2, 0, 0]), SEQLEN - 5
    expected = torch.stack([one_token_at_a_time(merged_by_hand(base, adapters[a]), prompts[i], n_tokens)
                            for i, a in enumerate(ids.tolist())])
    served = gl.multi_lora_model(base, adapters)
    batched = gl.generate_multi_lora(served, prompts, ids, n_tokens, SEQLEN)
    merged = gl.generate_merged([gl.merge_adapter(base_kv, a) for a in adapters], prompts, ids, n_tokens, SEQLEN)
    assert torch.equal(batched, expected)
    assert torch.equal(merged, expected)
    assert not torch.equal(expected[0], one_token_at_a_time(base, prompts[0], n_tokens))  # the adapters matter


def test_multi_lora_model_shares_the_base_weights_and_without_ids_is_the_base(tiny_models):
    base, base_kv = tiny_models
    served = gl.multi_lora_model(base, adapters_for(base, 2))
    weights = dict(base.named_parameters())
    for name, p in served.named_parameters():
        assert p.data_ptr() == weights[name.replace(".base.", ".")].data_ptr()
    x = tokens(2, SEQLEN)
    with torch.no_grad():
        assert torch.equal(served(x)[0], base_kv(x)[0])
    assert iu.model_size_mb(served) == pytest.approx(
        iu.model_size_mb(base) + gl.adapters_nbytes(adapters_for(base, 2)) / 2**20)


def test_a_zero_adapter_is_the_base_model(tiny_models):
    base, _ = tiny_models
    adapter = gl.LoRAAdapter(base, 3)  # LoRA's init: B = 0
    x = tokens(1, SEQLEN)
    with torch.no_grad():
        assert torch.equal(gl.merge_adapter(base, adapter)(x), base(x))


def test_speaker_turns_and_slices():
    text = "ROMEO:\nO she doth teach.\n\nJULIET:\nAy me!\n\nROMEO:\nShe speaks.\n\nFIRST ROMEO:\nNo."
    assert corpus.speaker_turns(text, "ROMEO") == "ROMEO:\nO she doth teach.\n\nROMEO:\nShe speaks."
    assert corpus.speakers_by_text(text)[0] == "ROMEO"
    assert corpus.slug("DUKE VINCENTIO") == "duke_vincentio"


def test_speaker_data_splits_the_speakers_turns(real_data):
    data = corpus.speaker_data(real_data, "PETRUCHIO", 128)
    text = real_data.decode(data.train.tolist()) + real_data.decode(data.val.tolist())
    assert text.startswith("PETRUCHIO:\n") and len(data.val) == len(text) - int(0.8 * len(text))
    val_text = real_data.decode(real_data.val.tolist())  # the split the base model never trained on
    assert all(turn in val_text for turn in text.split("\n\n"))
    assert "PETRUCHIO:\nAnd you, good sir!" in text and "GREMIO:" not in text
    with pytest.raises(GPTliteError, match="no speaker 'ROMEO' in tiny Shakespeare's validation split.*PETRUCHIO"):
        corpus.speaker_data(real_data, "ROMEO", 128)  # his lines are all in the training split
    with pytest.raises(GPTliteError, match="'PETER' has 49 characters in the validation split, too few"):
        corpus.speaker_data(real_data, "PETER", 128)


# ----------------------------------------------------------------------------------------------------
# Bad input: clear errors before any work.

@pytest.mark.parametrize("rank", [0, -1, 1.5, True])
def test_rank_below_one_is_refused(tiny_models, rank):
    base, _ = tiny_models
    with pytest.raises(ValueError, match="LoRA rank must be an integer of at least 1"):
        gl.LoRAAdapter(base, rank)
    with pytest.raises(ValueError, match="LoRA rank must be an integer of at least 1"):
        lora_peft.peft_model(copy.deepcopy(base), rank)


def test_unknown_target_is_refused(tiny_models):
    base, _ = tiny_models
    with pytest.raises(ValueError, match=r"unknown LoRA target module\(s\) \['fc_in'\]; choose among query_proj"):
        gl.LoRAAdapter(base, 2, ("query_proj", "fc_in"))
    with pytest.raises(ValueError, match="unknown LoRA target"):
        lora_peft.peft_model(copy.deepcopy(base), 2, ("mha",))


@pytest.mark.parametrize("rank, target", [(33, "query_proj"), (25, "query_proj"), (25, "out_proj"),
                                          (33, "ffwd.net.0"), (1000, "ffwd.net.2")])
def test_rank_above_the_layer_is_refused(tiny_models, rank, target):
    """TINY: d_model 32, n_heads * d_head 24, d_ff 128: query_proj is 32 -> 24, out_proj 24 -> 32 (at most 24),
    ffwd.net.0 32 -> 128 and ffwd.net.2 128 -> 32 (at most 32)."""
    base, _ = tiny_models
    limit = {"query_proj": 24, "out_proj": 24, "ffwd.net.0": 32, "ffwd.net.2": 32}[target]
    message = rf"LoRA rank {rank} is larger than the layer {target} .* at most {limit}, the smaller of the two"
    with pytest.raises(ValueError, match=message):
        gl.LoRAAdapter(base, rank, (target,))
    with pytest.raises(ValueError, match=message):
        lora_peft.peft_model(copy.deepcopy(base), rank, (target,))
    assert gl.LoRAAdapter(base, limit, (target,)).A[0].shape[0] == limit  # the largest rank is fine


@pytest.mark.parametrize("alpha", [float("nan"), float("inf"), -float("inf"), 0, 0.0, -2.0, True, "8"])
def test_alpha_that_is_not_a_positive_finite_number_is_refused(tiny_models, alpha):
    base, _ = tiny_models
    message = r"LoRA alpha must be a positive finite number \(the update is scaled by alpha / r\)"
    with pytest.raises(ValueError, match=message):
        gl.LoRAAdapter(base, 2, alpha=alpha)
    with pytest.raises(ValueError, match=message):
        lora_peft.peft_model(copy.deepcopy(base), 2, alpha=alpha)
    with pytest.raises(ValueError, match=message):
        gl.random_adapter(base, 2, alpha=alpha)


def test_a_state_dict_of_another_rank_is_a_clear_error_naming_both(tiny_models):
    base, _ = tiny_models
    saved = gl.random_adapter(base, 4, TARGETS, seed=1).state_dict()
    with pytest.raises(ValueError, match=r"the state dict holds a rank-4 adapter, this LoRAAdapter has rank 8: "
                                         r"build it with rank=4"):
        gl.LoRAAdapter(base, 8, TARGETS).load_state_dict(saved)
    with pytest.raises(ValueError, match="the state dict holds 6 A/B pairs, this adapter 8"):
        gl.LoRAAdapter(base, 4).load_state_dict(saved)  # other targets
    same = gl.LoRAAdapter(base, 4, TARGETS)
    same.load_state_dict(saved)  # the same shape: loads, exactly
    assert all(torch.equal(a, b) for a, b in zip(same.state_dict().values(), saved.values()))


def test_a_single_string_target_is_one_target(tiny_models):
    base, _ = tiny_models
    adapter = gl.LoRAAdapter(base, 2, "value_proj")
    assert adapter.targets == ("value_proj",) and adapter.names == ["blocks.0.mha.value_proj",
                                                                    "blocks.1.mha.value_proj"]
    peft = lora_peft.peft_model(copy.deepcopy(base), 2, "value_proj")
    assert sorted(n for n, p in peft.named_parameters() if p.requires_grad) == [
        f"base_model.model.blocks.{i}.mha.value_proj.lora_{m}.default.weight" for i in (0, 1) for m in "AB"]
    message = (r"unknown LoRA target module\(s\) \['fc_in'\]; choose among query_proj, key_proj, value_proj, "
               r"out_proj, ffwd.net.0, ffwd.net.2")  # the name, not its characters
    with pytest.raises(ValueError, match=message):
        gl.LoRAAdapter(base, 2, "fc_in")
    with pytest.raises(ValueError, match=message):
        lora_peft.peft_model(copy.deepcopy(base), 2, "fc_in")


def test_a_diverged_lora_training_names_alpha_and_the_learning_rate(real_data, tiny_models, monkeypatch):
    base, _ = tiny_models
    preset = presets.Preset("tiny", **{k: v for k, v in TINY.items() if k != "vocab_size"}, batch_size=2, lr=1e-3, iters=1)
    slice_data = corpus.speaker_data(real_data, "TRANIO", SEQLEN)
    recipe = main_multi_lora.Recipe(rank=2, alpha=4.0, targets=("query_proj",), steps=2, batch_size=2, lr=1e-2)
    train_steps = training.train_steps
    nan_loss = lambda model, x, y: training.cross_entropy_loss(model, x, y) * float("nan")  # noqa: E731
    monkeypatch.setattr(training, "train_steps", lambda *a, **k: train_steps(*a, **{**k, "loss_fn": nan_loss}))
    with pytest.raises(TrainingDiverged, match=r"training diverged: the training loss is nan at step 1 of 2 \(LoRA "
                                                  r"alpha 4, so a scale alpha / r = 2, and peak learning rate 0.01\); "
                                                  r"rerun with a lower alpha or a lower learning rate. "
                                                  r"Nothing was saved"):
        main_multi_lora.train_adapter(base, slice_data, recipe, preset.seqlen, "TRANIO")
    with pytest.raises(TrainingDiverged, match=r"at step 1 of 2 \(peak learning rate 0.01\); rerun with a lower "
                                                  r"learning rate. Nothing was saved"):  # elsewhere: as it was
        training.train_steps(base, slice_data, 2, 2, SEQLEN, 1e-2, loss_fn=nan_loss)


@pytest.mark.parametrize("ids, match", [(torch.tensor([0, 2]), r"adapter id out of range: ids must be in \[0, 2\)"),
                                        (torch.tensor([-1, 0]), "adapter id out of range"),
                                        (torch.tensor([0]), "got 1 adapter ids for 2 requests"),
                                        ([0, 1], "1-D LongTensor")])
def test_adapter_id_out_of_range_is_refused(tiny_models, ids, match):
    base, base_kv = tiny_models
    adapters = adapters_for(base, 2)
    served, prompts = gl.multi_lora_model(base, adapters), tokens(2, 4)
    with pytest.raises(ValueError, match=match):
        gl.generate_multi_lora(served, prompts, ids, 3, SEQLEN)
    with pytest.raises(ValueError, match=match):
        gl.generate_merged([gl.merge_adapter(base_kv, a) for a in adapters], prompts, ids, 3, SEQLEN)


def test_adapters_of_other_ranks_cannot_be_stacked(tiny_models):
    base, _ = tiny_models
    with pytest.raises(ValueError, match="must share rank and targets"):
        gl.multi_lora_model(base, [gl.LoRAAdapter(base, 2), gl.LoRAAdapter(base, 4)])


@pytest.mark.parametrize("flags, match", [(["--rank", "0"], "--rank: .*must be at least 1"),
                                          (["--targets", "fc_in"], "--targets: invalid choice: 'fc_in'"),
                                          (["--rank", "600", "--preset", "cpu"],
                                           "--rank: LoRA rank 600 is larger than the layer query_proj"),
                                          (["--adapter-counts", "64"], "at most --batch-size=32"),
                                          (["--prompt-len", "100", "--n-tokens", "64"], "at most seqlen=128"),
                                          (["--speakers", "ROMEO", "ROMEO"], "name each speaker once")])
def test_script_flags_are_checked_before_any_work(flags, match, capsys):
    with pytest.raises(SystemExit):
        main_multi_lora.main(["--device", "cpu", "--data", "/nonexistent"] + flags)
    assert re.search(match, capsys.readouterr().err)


def test_unknown_speaker_fails_before_training(real_data, monkeypatch):
    monkeypatch.setattr(main_multi_lora, "load_or_train", lambda *a: pytest.fail("trained despite a bad speaker"))
    with pytest.raises(GPTliteError, match="no speaker 'Romeo'"):
        main_multi_lora.main(["--device", "cpu", "--untrained", "--speakers", "Romeo"])


# ----------------------------------------------------------------------------------------------------
# Saved adapters are reused; other settings train a new one.

def test_adapters_are_saved_with_a_checksum_and_reused(tiny_models, monkeypatch, tmp_path, real_data):
    base, _ = tiny_models
    monkeypatch.setattr(files, "CHECKPOINT_DIR", tmp_path)
    preset = presets.Preset("tiny", **{k: v for k, v in TINY.items() if k != "vocab_size"}, batch_size=4, lr=1e-3, iters=1)
    slice_data = corpus.speaker_data(real_data, "TRANIO", SEQLEN)
    recipe = main_multi_lora.Recipe(rank=2, alpha=4.0, targets=("query_proj", "value_proj"), steps=3, batch_size=2,
                                    lr=1e-2, seed=0)
    rebuild = "python main_multi_lora.py"
    adapter, info = main_multi_lora.load_or_train(base, real_data, slice_data, recipe, preset, "TRANIO", rebuild)
    assert info["source"].startswith("trained") and info["peft_diff"] <= 1e-4
    path = tmp_path / "tiny_lora_tranio_r2_qv.pt"
    assert path.exists() and files.load_checkpoint(path)["meta"]["stamp"]["steps"] == 3
    again, info = main_multi_lora.load_or_train(base, real_data, slice_data, recipe, preset, "TRANIO", rebuild)
    assert info["source"] == "loaded tiny_lora_tranio_r2_qv.pt"
    assert all(torch.equal(a, b) for a, b in zip(adapter.state_dict().values(), again.state_dict().values()))
    recipe = dataclasses.replace(recipe, steps=4)  # other settings: a new adapter, not the old file
    _, info = main_multi_lora.load_or_train(base, real_data, slice_data, recipe, preset, "TRANIO", rebuild)
    assert info["source"].startswith("trained") and files.load_checkpoint(path)["meta"]["stamp"]["steps"] == 4


# ----------------------------------------------------------------------------------------------------
# The script end to end, on random weights and the smallest flags.

SMOKE = ["--device", "cpu", "--untrained", "--speakers", "TRANIO", "--lora-steps", "1", "--batch-size", "3",
         "--adapter-counts", "1", "3", "--prompt-len", "4", "--n-tokens", "3", "--repeats", "1",
         "--val-batches", "1"]


def test_script_runs_and_writes_its_table(real_data, tmp_path, monkeypatch):
    out = tmp_path / "lora.json"  # the data: $GPTLITE_DATA, as the real_data fixture found it
    main_multi_lora.main(SMOKE + ["--json", str(out), "--plot", str(tmp_path / "l.png")])
    result = json.loads(out.read_text())
    names = [r["variant"] for r in result["rows"]]
    assert names == ["base model, no adapter", "merged, 1 adapter", "batched, 1 adapter", "merged, 3 adapters",
                     "batched, 3 adapters"]
    assert all(result["checks"].values()) and result["n_trained"] == 1
    merged3, batched3 = result["rows"][3], result["rows"][4]
    assert merged3["weights_mb"] == pytest.approx(3 * result["rows"][0]["weights_mb"])
    assert result["rows"][0]["weights_mb"] < batched3["weights_mb"] < merged3["weights_mb"]
    assert (tmp_path / "l.png").exists()


def test_a_failed_check_writes_nothing(real_data, tmp_path, monkeypatch):
    def wrong(model, prompts, ids, n_tokens, seqlen):  # a broken batched path: every token 0
        return torch.zeros(prompts.shape[0], prompts.shape[1] + n_tokens, dtype=torch.long)
    monkeypatch.setattr(main_multi_lora, "generate_multi_lora", wrong)
    out = tmp_path / "lora.json"
    with pytest.raises(GPTliteError, match="checks failed: batched \\(BGMV\\) = each request alone"):
        main_multi_lora.main(SMOKE + ["--json", str(out)])
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--batch-size", "--lora-batch-size"])
def test_a_huge_size_flag_is_a_parser_error_before_any_work(flag, capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        main_multi_lora.main(["--untrained", "--device", "cpu", "--preset", "cpu", flag, "1000000000000"])
    assert e.value.code == 2 and f"error: {flag}: " in capsys.readouterr().err


def test_many_adapters_are_bounded_by_their_merged_copies(capsys, monkeypatch):
    """--adapter-counts within a huge --batch-size: the merged copies of the model are what overflow."""
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    monkeypatch.setattr(harness, "available_memory", lambda: 2**30)  # a machine of 1 GiB free
    with pytest.raises(SystemExit) as e:
        main_multi_lora.main(["--untrained", "--device", "cpu", "--preset", "cpu", "--batch-size", "2000",
                              "--adapter-counts", "1000"])
    assert e.value.code == 2 and "error: --adapter-counts: 1000 merged copies" in capsys.readouterr().err


def test_the_json_has_the_headline_and_the_loss_table(real_data, tmp_path):
    out = tmp_path / "lora.json"
    main_multi_lora.main(SMOKE + ["--json", str(out)])
    result = json.loads(out.read_text())
    assert result["headline"]["technique"] == "multi-LoRA serving, 3 requests over 3 adapters of rank 8"
    assert "TRANIO" in result["headline"]["figure"] and "merged copies" in result["headline"]["figure"]
    assert [r["variant"] for r in result["tables"][0]["rows"]] == ["TRANIO"]
    renders_on_its_page("main_multi_lora", result)
