"""Data, checkpoints, training, memory and reporting helpers, and their clear errors."""
import argparse
import hashlib
import io
import json
import math
import os
import signal
import struct
import subprocess
import sys
import urllib.error
import zipfile
from dataclasses import replace

import pytest
import torch
from conftest import TINY

import inference_utils as iu
from gptlite import GPTlite
from gptlite_kvcache import GPTlite_KVCache, StaticKVCache
from lib import corpus, files, harness, presets, training
from lib.errors import CheckpointError, DataError, GPTliteError, TrainingDiverged

TINY_PRESET = presets.Preset("tiny", d_model=32, n_heads=3, d_head=8, n_layers=2, dropout_p=0.0, seqlen=16,
                        batch_size=8, lr=3e-3, iters=3)


def synthetic_data(text="to be or not to be, that is the question\n" * 50):
    """A small Data object for checkpoint tests that need no real corpus."""
    vocab = "".join(sorted(set(text)))
    tokens = torch.tensor([vocab.index(c) for c in text])
    n = int(0.9 * len(tokens))
    return corpus.Data(vocab=vocab, train=tokens[:n], val=tokens[n:])


def tiny_preset_for(data, **changes):
    return replace(TINY_PRESET, vocab_size=len(data.vocab), **changes)


# --- data ---------------------------------------------------------------------------------------

def test_real_data_is_character_level_and_split_90_10(real_data):
    assert len(real_data.vocab) == 65
    assert len(real_data.train) + len(real_data.val) == corpus.DATA_BYTES
    assert len(real_data.train) == int(0.9 * corpus.DATA_BYTES)
    assert real_data.decode(real_data.train[:14].tolist()) == "First Citizen:"
    assert real_data.encode("First") == real_data.train[:5].tolist()


def test_wrong_hash_is_a_clear_error(tmp_path):
    path = tmp_path / "tinyshakespeare.txt"
    path.write_text("not Shakespeare\n")
    with pytest.raises(DataError, match="not the canonical tiny Shakespeare") as e:
        corpus.load_data(path)
    assert "--data" in str(e.value) and "GPTLITE_DATA" in str(e.value)


def test_missing_explicit_path_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("GPTLITE_DATA", str(tmp_path / "nowhere.txt"))
    with pytest.raises(DataError, match="GPTLITE_DATA points at"):
        corpus.load_data()
    with pytest.raises(DataError, match="--data points at"):
        corpus.load_data(tmp_path / "missing.txt")


def test_missing_data_offline_names_the_three_ways(tmp_path, monkeypatch):
    monkeypatch.delenv("GPTLITE_DATA", raising=False)
    default = tmp_path / "data" / "tinyshakespeare.txt"
    monkeypatch.setattr(corpus, "DEFAULT_DATA", default)

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(corpus.urllib.request, "urlopen", offline)
    with pytest.raises(DataError, match="download failed") as e:
        corpus.load_data()
    assert all(way in str(e.value) for way in ("--data", "GPTLITE_DATA", str(default)))
    assert not default.exists() and not list(default.parent.glob("*"))  # no partial file left behind


def test_a_download_with_the_wrong_hash_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.delenv("GPTLITE_DATA", raising=False)
    default = tmp_path / "data" / "tinyshakespeare.txt"
    monkeypatch.setattr(corpus, "DEFAULT_DATA", default)

    class Response(io.BytesIO):
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(corpus.urllib.request, "urlopen", lambda *a, **k: Response(b"an error page"))
    with pytest.raises(DataError, match="downloaded file is not the canonical"):
        corpus.load_data()
    assert not default.exists()


def test_a_data_path_that_is_not_a_file_is_a_clear_error(tmp_path):
    (tmp_path / "a_file").write_text("x")
    for path in (tmp_path, tmp_path / "a_file" / "below_a_file.txt"):  # a folder; a parent that is a file
        with pytest.raises(DataError, match="--data points at .*which is not a file"):
            corpus.load_data(path)


def test_an_unreadable_data_file_is_a_clear_error(tmp_path, monkeypatch):
    path = tmp_path / "tinyshakespeare.txt"
    path.write_text("x")

    def denied(self):  # chmod cannot provoke it when the tests run as root
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(corpus.Path, "read_bytes", denied)
    with pytest.raises(DataError, match="cannot read .*Permission denied.*GPTLITE_DATA"):
        corpus.load_data(path)


def test_a_data_file_that_is_not_utf8_fails_the_hash_check(tmp_path):
    path = tmp_path / "tinyshakespeare.txt"
    path.write_bytes(b"\xff\xfe not UTF-8 \x80")
    with pytest.raises(DataError, match="not the canonical tiny Shakespeare"):
        corpus.load_data(path)


@pytest.mark.parametrize("in_the_way", ["folder", "file above"])
def test_a_download_that_cannot_be_written_is_a_clear_error(tmp_path, monkeypatch, in_the_way):
    monkeypatch.delenv("GPTLITE_DATA", raising=False)
    if in_the_way == "folder":  # data/tinyshakespeare.txt is a folder: the rename onto it fails
        default = tmp_path / "data" / "tinyshakespeare.txt"
        default.mkdir(parents=True)
    else:  # data is a file: the folder cannot be made
        (tmp_path / "data").write_text("x")
        default = tmp_path / "data" / "tinyshakespeare.txt"
    monkeypatch.setattr(corpus, "DEFAULT_DATA", default)
    fake = b"a canonical file, for this test"
    monkeypatch.setattr(corpus, "DATA_SHA256", hashlib.sha256(fake).hexdigest())

    class Response(io.BytesIO):
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(corpus.urllib.request, "urlopen", lambda *a, **k: Response(fake))
    with pytest.raises(DataError, match="cannot write it to"):
        corpus.load_data()


def test_sample_prompts_are_fixed_by_the_seed(real_data):
    a = corpus.sample_prompts(real_data, 3, 20, seed=7)
    assert a.shape == (3, 20) and a.dtype == torch.long
    assert torch.equal(a, corpus.sample_prompts(real_data, 3, 20, seed=7))
    assert not torch.equal(a, corpus.sample_prompts(real_data, 3, 20, seed=8))


# --- checkpoints --------------------------------------------------------------------------------

def test_missing_checkpoint_is_trained_saved_and_loads_in_every_class(tmp_path):
    data = synthetic_data()
    preset = tiny_preset_for(data)
    path = tmp_path / "tiny.pt"
    model = iu.load_model(GPTlite, preset, data=data, path=path)
    assert path.exists() and not list(tmp_path.glob("*.tmp*"))
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["config"] == preset.gptlite_kwargs() and ckpt["vocab"] == data.vocab
    cached = iu.load_model(GPTlite_KVCache, preset, data=data, path=path)  # the same state dict
    for (k, a), (_, b) in zip(model.state_dict().items(), cached.state_dict().items()):
        assert torch.equal(a, b), k
    x = data.val[None, :16]
    torch.testing.assert_close(cached(x)[0], model(x), atol=1e-6, rtol=0)


def test_checkpoint_of_another_config_is_a_clear_error(tmp_path):
    data = synthetic_data()
    path = tmp_path / "tiny.pt"
    iu.load_model(GPTlite, tiny_preset_for(data), data=data, path=path)
    with pytest.raises(CheckpointError, match="another configuration.*n_layers"):
        iu.load_model(GPTlite, tiny_preset_for(data, n_layers=3), data=data, path=path)


def test_checkpoint_of_another_vocabulary_is_a_clear_error(tmp_path):
    data = synthetic_data()
    path = tmp_path / "tiny.pt"
    iu.load_model(GPTlite, tiny_preset_for(data), data=data, path=path)
    other = synthetic_data("to be or not to be, that is the zuestion\n" * 50)  # same size, another letter
    with pytest.raises(CheckpointError, match="another vocabulary"):
        iu.load_model(GPTlite, tiny_preset_for(other), data=other, path=path)


def test_corrupt_checkpoint_is_a_clear_error(tmp_path):
    path = tmp_path / "tiny.pt"
    path.write_bytes(b"\x80\x02 half a checkpoint")
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        iu.load_model(GPTlite, TINY_PRESET, data=synthetic_data(), path=path)


def restamped(ckpt):
    """The checkpoint with a checksum of its (edited) contents, as save_checkpoint would write it."""
    ckpt["sha256"] = files.checkpoint_sha256(ckpt["config"], ckpt["vocab"], ckpt["state_dict"])
    return ckpt


def drop_a_weight(ckpt):
    del ckpt["state_dict"]["fc_out.bias"]
    return restamped(ckpt)


def add_a_config_key(ckpt):
    ckpt["config"]["n_groups"] = 2
    return restamped(ckpt)


def a_nan_weight(ckpt):
    ckpt["state_dict"]["fc_out.weight"][0, 0] = float("nan")
    return restamped(ckpt)


def an_edited_weight(ckpt):  # edited after saving: the checksum is the old one
    ckpt["state_dict"]["fc_out.weight"][0, 0] += 1
    return ckpt


def no_checksum(ckpt):  # as saved before checkpoints carried one
    del ckpt["sha256"]
    return ckpt


@pytest.mark.parametrize("damage, message", [
    (drop_a_weight, "does not fit GPTlite"),
    (lambda ckpt: [ckpt["state_dict"]], "not a checkpoint of this repository"),
    (lambda ckpt: {**ckpt, "config": [1, 2]}, "not a checkpoint of this repository"),
    (lambda ckpt: {**ckpt, "state_dict": [1, 2]}, "not a checkpoint of this repository"),
    (add_a_config_key, "another configuration.*n_groups.*--preset tiny"),
    (a_nan_weight, "non-finite"),
    (an_edited_weight, "damaged: its weights do not match their checksum.*python gptlite.py --preset tiny"),
    (no_checksum, "no checksum.*refused.*python gptlite.py --preset tiny"),
])
def test_a_damaged_checkpoint_is_a_clear_error(tmp_path, damage, message):
    data = synthetic_data()
    path = tmp_path / "tiny.pt"
    iu.load_model(GPTlite, tiny_preset_for(data), data=data, path=path)
    torch.save(damage(torch.load(path, weights_only=True)), path)
    with pytest.raises(CheckpointError, match=message):
        iu.load_model(GPTlite, tiny_preset_for(data), data=data, path=path)


def flip_a_byte_of_the_first_tensor(path):
    """Flip one bit in the middle of the bytes of the checkpoint's first stored tensor, in the file itself."""
    with zipfile.ZipFile(path) as z:
        record = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
    raw = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", raw[record.header_offset + 26:record.header_offset + 30])
    start = record.header_offset + 30 + name_len + extra_len  # torch stores tensors uncompressed
    raw[start + record.file_size // 2] ^= 0x01
    path.write_bytes(raw)


def test_one_flipped_byte_inside_a_tensor_is_a_clear_error(tmp_path):
    data = synthetic_data()
    path = tmp_path / "tiny.pt"
    iu.load_model(GPTlite, tiny_preset_for(data), data=data, path=path)
    before = torch.load(path, weights_only=True)["state_dict"]
    flip_a_byte_of_the_first_tensor(path)
    after = torch.load(path, weights_only=True)["state_dict"]  # torch itself loads it silently
    assert sum(not torch.equal(before[k], after[k]) for k in before) == 1
    with pytest.raises(CheckpointError, match="damaged.*checksum.*rebuild it with: python gptlite.py --preset tiny"):
        iu.load_model(GPTlite, tiny_preset_for(data), data=data, path=path)


def test_the_checksum_covers_names_dtypes_shapes_and_bytes():
    state = {"a": torch.zeros(2, 3), "b": torch.ones(4, dtype=torch.int64)}
    digest = files.checkpoint_sha256({"d": 1}, "ab", state)
    assert digest == files.checkpoint_sha256({"d": 1}, "ab", dict(reversed(state.items())))  # order of the dict
    for changed in ({"a": torch.zeros(3, 2), "b": state["b"]}, {"a": torch.zeros(2, 3, dtype=torch.float64),
                    "b": state["b"]}, {"c": state["a"], "b": state["b"]}, {"a": state["a"], "b": state["b"] + 1}):
        assert files.checkpoint_sha256({"d": 1}, "ab", changed) != digest
    assert files.checkpoint_sha256({"d": 2}, "ab", state) != digest != files.checkpoint_sha256({"d": 1}, "ac", state)


def test_the_rebuild_command_is_saved_and_named_in_the_errors(tmp_path):
    data = synthetic_data()
    model = GPTlite(**tiny_preset_for(data).gptlite_kwargs())
    path = tmp_path / "cpu_gqa.pt"
    command = "python main_gqa.py --preset cpu"
    files.save_checkpoint(path, model, tiny_preset_for(data).gptlite_kwargs(), data.vocab, rebuild=command, steps=1)
    assert files.load_checkpoint(path)["meta"] == {"steps": 1, "rebuild": command}
    torch.save(an_edited_weight(torch.load(path, weights_only=True)), path)
    with pytest.raises(CheckpointError, match=f"rebuild it with: {command}$"):  # read from the file
        files.load_checkpoint(path)
    with pytest.raises(CheckpointError, match="rebuild it with: python other.py$"):  # the caller's wins
        files.load_checkpoint(path, rebuild="python other.py")
    path.write_bytes(b"not a checkpoint")  # unreadable: only the caller can say
    with pytest.raises(CheckpointError, match=f"(?s)not a readable checkpoint.*rebuild it with: {command}$"):
        files.load_checkpoint(path, rebuild=command)
    with pytest.raises(CheckpointError, match="rebuild it with the script that saved it$"):
        files.load_checkpoint(path)
    (tmp_path / "cpu.pt").write_bytes(b"not a checkpoint")  # a preset's checkpoint: gptlite.py rebuilds it
    with pytest.raises(CheckpointError, match="rebuild it with: python gptlite.py --preset cpu$"):
        files.load_checkpoint(tmp_path / "cpu.pt")
    with pytest.raises(CheckpointError, match=f"no checkpoint at .*run: {command}$"):
        iu.load_model(GPTlite, "cpu", path=tmp_path / "missing.pt", rebuild=command)


def test_train_checkpoint_saves_the_command_that_rebuilds_it(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "CHECKPOINT_DIR", tmp_path)
    data = synthetic_data()
    iu.train_checkpoint(tiny_preset_for(data), data, "cpu", iters=2, seed=3)
    meta = files.load_checkpoint(tmp_path / "tiny.pt")["meta"]
    assert meta["rebuild"] == "python gptlite.py --preset tiny --iters 2 --seed 3"


def test_a_failed_save_leaves_no_file(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"

    def killed(obj, f):
        open(f, "wb").write(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(iu.torch, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        files.atomic_torch_save({"x": 1}, path)
    assert list(tmp_path.iterdir()) == []


def test_an_existing_checkpoint_survives_a_failed_save(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    files.atomic_torch_save({"x": torch.ones(2)}, path)
    monkeypatch.setattr(iu.torch, "save", lambda obj, f: (open(f, "wb").write(b"half"), 1 / 0))
    with pytest.raises(ZeroDivisionError):
        files.atomic_torch_save({"x": torch.zeros(2)}, path)
    assert torch.equal(torch.load(path, weights_only=True)["x"], torch.ones(2))


KILLED_MID_WRITE = """
import os, signal, sys
from lib import files
with files.atomic_file(sys.argv[1]) as tmp:
    tmp.write_bytes(b"half a checkpoint")
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.skipif(os.name != "posix", reason="stale temp files are recognised by pid on POSIX only")
def test_the_temp_file_of_a_killed_save_is_removed_by_the_next_save(tmp_path):
    path = tmp_path / "ckpt.pt"
    killed = subprocess.Popen([sys.executable, "-c", KILLED_MID_WRITE, str(path)], cwd=files.ROOT)
    assert killed.wait() == -signal.SIGKILL
    assert [p.name for p in tmp_path.iterdir()] == [f".ckpt.pt.{killed.pid}.partial"]  # left behind
    alive = tmp_path / f".ckpt.pt.{os.getppid()}.partial"  # a live process may be writing the same path: kept
    others = [tmp_path / f".other.pt.{killed.pid}.partial", tmp_path / ".ckpt.pt.x.partial",  # not ckpt.pt's
              tmp_path / f"ckpt.pt.tmp{killed.pid}", tmp_path / f".ckpt.pt.{killed.pid}"]  # names a user may pick
    for p in [alive, *others]:
        p.write_bytes(b"x")
    files.atomic_write_bytes(b"whole", path)
    assert path.read_bytes() == b"whole"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in [path, alive, *others])


def test_untrained_models_are_seeded():
    a = iu.load_model(GPTlite, TINY_PRESET, untrained=True, seed=3)
    b = iu.load_model(GPTlite, TINY_PRESET, untrained=True, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


# --- training and evaluation --------------------------------------------------------------------

def test_validation_loss_is_the_same_for_every_model_class(real_data):
    torch.manual_seed(0)
    base = GPTlite(**TINY).eval()
    cached = GPTlite_KVCache(**TINY).eval()
    cached.load_state_dict(base.state_dict())
    loss = training.validation_loss(base, real_data, n_batches=3, batch_size=4)
    assert loss == training.validation_loss(base, real_data, n_batches=3, batch_size=4)
    assert loss == pytest.approx(training.validation_loss(cached, real_data, n_batches=3, batch_size=4), abs=1e-6)


def test_a_short_training_run_lowers_the_validation_loss(real_data):
    torch.manual_seed(0)
    model = GPTlite(**TINY)
    before = training.validation_loss(model, real_data, n_batches=5, batch_size=16)
    history = training.train_steps(model, real_data, 60, batch_size=16, seqlen=TINY["seqlen"], lr=3e-3, eval_interval=30)
    assert [h["step"] for h in history] == [30, 60]
    after = training.validation_loss(model, real_data, n_batches=5, batch_size=16)
    assert after < before - 0.5, (before, after)
    assert not model.training


def an_infinite_loss(model, x, y):
    return training.cross_entropy_loss(model, x, y) * math.inf


@pytest.mark.parametrize("n_steps, lr, loss_fn, message", [
    (3, 1e-3, an_infinite_loss, "training loss is inf at step 1 of 3"),
    (20, 1e30, training.cross_entropy_loss, r"training loss is (nan|inf) at step \d+ of 20"),
    (1, 1e30, training.cross_entropy_loss, "validation loss is (nan|inf) at step 1 of 1"),  # the last update diverges
])
def test_a_diverging_run_stops_with_a_clear_error(n_steps, lr, loss_fn, message):
    data = synthetic_data()
    torch.manual_seed(0)
    model = GPTlite(**tiny_preset_for(data).gptlite_kwargs())
    with pytest.raises(TrainingDiverged, match=message + r".*lower learning rate"):
        training.train_steps(model, data, n_steps, batch_size=4, seqlen=16, lr=lr, loss_fn=loss_fn)


def test_a_diverged_training_leaves_the_existing_checkpoint_untouched(tmp_path):
    data = synthetic_data()
    path = tmp_path / "tiny.pt"
    iu.train_checkpoint(tiny_preset_for(data), data, "cpu", path=path)
    saved = path.read_bytes()
    with pytest.raises(TrainingDiverged):
        iu.train_checkpoint(tiny_preset_for(data, lr=1e30, iters=20), data, "cpu", path=path, overwrite=True)
    assert path.read_bytes() == saved and [p.name for p in tmp_path.iterdir()] == ["tiny.pt"]


# --- measurement --------------------------------------------------------------------------------

def test_peak_memory_sees_a_temporary_allocation():
    def work():
        x = torch.ones(2**21)  # 8 MiB of float32, freed on return
        return (x * 2).sum()  # and another 8 MiB while both are alive

    peak = iu.peak_memory_mb(work)
    assert 16 <= peak < 17


def test_kv_cache_bytes_by_hand(tiny_models):
    _, cached = tiny_models
    _, cache = cached(torch.zeros(2, 5, dtype=torch.long))
    per_layer = 2 * (2 * TINY["n_heads"] * 5 * TINY["d_head"]) * 4  # keys and values, float32
    assert iu.kv_cache_bytes(cache) == TINY["n_layers"] * per_layer
    static = StaticKVCache.for_model(cached, 2)
    assert iu.kv_cache_bytes(static) == TINY["n_layers"] * per_layer * TINY["seqlen"] // 5
    assert iu.kv_cache_bytes(None) == 0
    with pytest.raises(TypeError, match="cannot count"):
        iu.kv_cache_bytes({"keys": 1})


def test_measure_generation_times_one_token_and_n_tokens():
    calls = []
    result = iu.measure_generation(calls.append, n_tokens=10, batch_size=4, warmup=1, repeats=3)
    assert calls == [1, 10] * 4  # warm-up plus repeats, for TTFT and for the whole generation
    assert set(result) == {"ttft_ms", "tpot_ms", "tokens_per_s"}


def test_compare_generation_interleaves_the_variants():
    calls = []
    results = iu.compare_generation({"a": lambda n: calls.append(("a", n)), "b": lambda n: calls.append(("b", n))},
                                    n_tokens=5, batch_size=1, warmup=1, repeats=2)
    assert list(results) == ["a", "b"]
    assert calls == [("a", 1), ("a", 5), ("b", 1), ("b", 5)] * 3


def test_model_size_mb(tiny_models):
    base, _ = tiny_models
    n = sum(p.numel() for p in base.parameters())
    assert iu.model_size_mb(base) == pytest.approx(n * 4 / 2**20)


# --- flags and reporting ------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_asking_for_cuda_without_it_is_a_clear_error():
    with pytest.raises(GPTliteError, match="does not have"):
        harness.get_device("cuda")


def test_a_device_that_is_not_one_is_a_clear_error():
    with pytest.raises(GPTliteError, match="not a device"):
        harness.get_device("foo")
    with pytest.raises(GPTliteError, match="only cpu and cuda"):
        harness.get_device("meta")


def test_table_marks_missing_figures_and_untrained_losses():
    rows = [harness.make_row("a", ttft_ms=1.234, val_loss=4.2), harness.make_row("b", tpot_ms=0.5)]
    text = harness.format_table(rows, untrained=True)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["variant", "TTFT", "ms"]
    assert "1.23" in lines[2] and "4.2000*" in lines[2] and " - " in lines[3]
    assert "meaningless" in lines[-1]


def test_json_has_the_common_schema(tmp_path):
    path = tmp_path / "r.json"
    harness.save_json(path, "main_x.py", TINY_PRESET, "cpu", [harness.make_row("a", ttft_ms=1.0)])
    result = json.loads(path.read_text())
    assert {"script", "preset", "device", "rows"} <= set(result)
    assert set(result["rows"][0]) >= {"variant", "ttft_ms", "tpot_ms", "tokens_per_s", "peak_mem_mb",
                                      "kv_cache_mb", "val_loss"}
    assert result["rows"][0]["tpot_ms"] is None


def test_extra_columns_share_one_format_and_non_finite_numbers_print():
    rows = [harness.make_row("a", ttft_ms=1.0, util=0.94, n=3, ratio=float("inf")),
            harness.make_row("b", ttft_ms=2.0, util=0.938, n=4, ratio=1.5, same="yes")]
    lines = harness.format_table(rows).splitlines()
    assert lines[0].split() == ["variant", "TTFT", "ms", "util", "n", "ratio", "same"]  # unused standard columns left out
    assert lines[2].split() == ["a", "1.00", "0.940", "3", "inf", "-"]
    assert lines[3].split() == ["b", "2.00", "0.938", "4", "1.5", "yes"]


def test_json_never_writes_nan_or_infinity(tmp_path):
    path = tmp_path / "r.json"
    rows = [harness.make_row("a", val_loss=math.nan, tpot_ms=math.inf), harness.make_row("b", tpot_ms=1.5)]
    harness.save_json(path, "main_x.py", TINY_PRESET, "cpu", rows, curve=[1.0, -math.inf, {"x": math.nan}])

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    result = json.loads(path.read_text(), parse_constant=refuse)  # a strict parser
    assert result["rows"][0]["val_loss"] is None and result["rows"][0]["tpot_ms"] is None
    assert result["rows"][1]["tpot_ms"] == 1.5 and result["curve"] == [1.0, None, {"x": None}]


def test_tpot_is_none_when_the_decode_time_is_within_the_timing_noise():
    assert iu.tpot_ms(ttft=0.010, total=0.019, n_tokens=10) == pytest.approx(1.0)  # (19 - 10) ms / 9 tokens
    assert iu.tpot_ms(0.010, 0.009, 10) is None  # a negative difference of medians is no time per token
    assert iu.tpot_ms(0.010, 0.012, 2, noise=0.003) is None  # 2 ms of decoding inside 3 ms of TTFT spread
    assert iu.tpot_ms(0.010, 0.012, 2, noise=0.001) == pytest.approx(2.0)
    assert iu.tpot_ms(0.010, 0.012, 1) is None  # one token: no time per output token
    assert iu.ratio(None, 2.0) is None and iu.ratio(3.0, 0.0) is None and iu.ratio(3.0, 2.0) == 1.5


def test_compare_generation_reports_tpot_from_the_medians_and_none_inside_the_noise(monkeypatch):
    # a fake clock: generating n tokens takes 10 ms + n ms, and TTFT runs vary by 0 to 2 ms
    ttft_jitter = iter([0.0, 0.002, 0.001] * 2)
    clock = {"now": 0.0}
    monkeypatch.setattr(iu.time, "perf_counter", lambda: clock["now"])

    def fn(n):
        clock["now"] += 0.010 + n * 0.001 + (next(ttft_jitter) if n == 1 else 0.0)

    result = iu.compare_generation({"a": fn}, n_tokens=11, batch_size=2, warmup=0, repeats=3)["a"]
    assert result["ttft_ms"] == pytest.approx(12.0) and result["tpot_ms"] == pytest.approx(0.9)  # (21 - 12) / 10
    ttft_jitter = iter([0.0, 0.002, 0.001] * 2)
    assert iu.compare_generation({"a": fn}, n_tokens=2, batch_size=2, warmup=0, repeats=3)["a"]["tpot_ms"] is None


def test_require_checks_names_every_failed_check():
    harness.require_checks({"same tokens": True, "same logits": True})
    with pytest.raises(GPTliteError, match=r"checks failed: same logits; cache; this is a bug"):
        harness.require_checks({"same tokens": True, "same logits": False, "cache": False})


# --- load or train: one rule for every trained file ------------------------------------------------

def tiny_cached(path, train, stamp=None, rebuild="python main_x.py --preset tiny"):
    data = synthetic_data()
    config = tiny_preset_for(data).gptlite_kwargs()
    torch.manual_seed(0)
    return iu.cached_model(GPTlite(**config), config, path, train, data.vocab, rebuild, stamp=stamp)


def test_cached_model_reuses_a_file_of_the_same_stamp_and_retrains_a_stale_one(tmp_path):
    path, calls = tmp_path / "derived.pt", []

    def train(model):
        calls.append(1)
        with torch.no_grad():
            model.fc_out.bias.fill_(len(calls))
    first, seconds = tiny_cached(path, train, stamp={"steps": 1, "base_sha256": "a"})
    again, seconds_again = tiny_cached(path, train, stamp={"steps": 1, "base_sha256": "a"})
    assert calls == [1] and seconds is not None and seconds_again is None
    assert torch.equal(first.fc_out.bias, again.fc_out.bias)
    for stamp in ({"steps": 2, "base_sha256": "a"}, {"steps": 2, "base_sha256": "b"}):  # recipe, then base
        model, _ = tiny_cached(path, train, stamp=stamp)
        assert torch.all(model.fc_out.bias == len(calls))
        assert files.load_checkpoint(path)["meta"]["stamp"] == stamp
    assert len(calls) == 3


@pytest.mark.parametrize("damage", [an_edited_weight, no_checksum, a_nan_weight])
def test_a_damaged_derived_checkpoint_names_a_command_that_really_rebuilds_it(tmp_path, damage):
    """The script loads its file before it would train: its own command alone would fail the same way, so
    the error says to delete the file first; doing so does rebuild it."""
    path, calls = tmp_path / "derived.pt", []
    tiny_cached(path, lambda m: calls.append(1))
    torch.save(damage(torch.load(path, weights_only=True)), path)
    with pytest.raises(CheckpointError, match=f"rebuild it with: rm {path} && python main_x.py --preset tiny$"):
        tiny_cached(path, lambda m: calls.append(1))
    path.unlink()  # what the message says, then the script's command
    tiny_cached(path, lambda m: calls.append(1))
    assert calls == [1, 1] and files.load_checkpoint(path)["meta"]["stamp"] is None


def test_start_up_removes_no_file_only_a_write_removes_its_own_stale_temp(tmp_path, monkeypatch, real_data):
    """Only the repository's own temp files (`.<target>.<pid>.partial` of a dead pid), and only beside a
    target being written, are ever removed: a script's start (setup) sweeps nothing, neither in the folder of
    --json nor in the repository's folders, so a user's `thesis.tmp<pid>` survives the run, whatever its end."""
    monkeypatch.setattr(files, "ROOT", tmp_path)
    (tmp_path / "checkpoints").mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    users = [tmp_path / f"thesis.tmp{dead.pid}", tmp_path / f"out.json.tmp{dead.pid}", tmp_path / "notes.tmp999999",
             tmp_path / "checkpoints" / f"cpu.pt.tmp{dead.pid}"]
    ours = tmp_path / f".out.json.{dead.pid}.partial"  # a killed write of out.json: removed when out.json is written
    for p in users + [ours]:
        p.write_bytes(b"draft")
    parser = harness.script_parser("a script")
    args = parser.parse_args(["--device", "cpu", "--json", str(tmp_path / "out.json"), "--data", os.environ["GPTLITE_DATA"]])
    harness.setup(args, parser)
    assert all(p.exists() for p in users + [ours])
    files.atomic_write_bytes(b"{}", tmp_path / "out.json")
    assert not ours.exists() and all(p.exists() for p in users)


def test_report_marks_the_untrained_losses_of_every_table_that_has_them(capsys):
    """--untrained: a val_loss column is marked with * in the main table and in an extra table that has
    one, not in an extra table without losses."""
    args = argparse.Namespace(untrained=True, json=None, plot=None)
    rows = [harness.make_row("a", val_loss=4.2)]
    losses = harness.table("Losses:", [dict(variant="b", val_loss=4.25)])
    times = harness.table("Times:", [dict(variant="c", ms=1.5)])
    harness.report(args, "x.py", TINY_PRESET, "cpu", rows, dict(technique="t", figure="f"), tables=[losses, times])
    out = capsys.readouterr().out
    assert "4.2000*" in out and "4.2500*" in out and out.count("* untrained weights") == 2
    assert "1.5" in out.split("Times:")[1] and "*" not in out.split("Times:")[1].split("t: f")[0]
