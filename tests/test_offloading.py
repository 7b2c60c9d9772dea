"""lib/offload.py (weights streamed block by block from a safetensors file) and main_offloading.py."""
import json

import pytest
import torch
from conftest import TINY, renders_on_its_page

import main_offloading
from gptlite_kvcache import GPTlite_KVCache, generate_kvcache
from lib import harness, offload
from lib.errors import CheckpointError


def random_model(seed=0, **overrides):
    """A GPTlite_KVCache of TINY's shape with N(0, 0.5) weights: peaked attention, so that a wrong weight
    anywhere changes the tokens (see conftest.tiny_models)."""
    torch.manual_seed(seed)
    model = GPTlite_KVCache(**dict(TINY, **overrides)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model


def other_cpu_model():
    """A GPTlite_KVCache of the cpu preset with other weights than the script's --untrained model (seed 0)."""
    torch.manual_seed(123)
    return GPTlite_KVCache(**harness.get_preset("cpu").gptlite_kwargs())


def written(model, tmp_path, name="w.safetensors"):
    path = tmp_path / name
    offload.write_offload_file(model, path)
    return path


@pytest.mark.parametrize("n_layers", [2, 3])  # 3: the last block and the next pass's first share a buffer
@pytest.mark.parametrize("prefetch", [True, False])
def test_offloaded_logits_and_tokens_equal_the_resident_models_exactly(tmp_path, n_layers, prefetch):
    resident = random_model(n_layers=n_layers)
    model, streamer = offload.offloaded_model(written(resident, tmp_path), resident.config.to_dict(), "cpu",
                                              prefetch=prefetch, sha256=offload.weights_sha256(resident))
    window = torch.randint(0, TINY["vocab_size"], (3, TINY["seqlen"]), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert torch.equal(model(window)[0], resident(window)[0])
    prompts = window[:, :5]
    assert torch.equal(generate_kvcache(model, prompts, 20, TINY["seqlen"]),  # past the window too
                       generate_kvcache(resident, prompts, 20, TINY["seqlen"]))
    streamer.close()


@pytest.mark.parametrize("prefetch", [True, False])
def test_every_pass_streams_the_blocks_weight_bytes_once(tmp_path, prefetch):
    resident = random_model(n_layers=3)
    model, streamer = offload.offloaded_model(written(resident, tmp_path), resident.config.to_dict(), "cpu",
                                              prefetch=prefetch)
    prompts = torch.zeros(2, 4, dtype=torch.long)
    generate_kvcache(model, prompts, 6, TINY["seqlen"])  # the prefill and 5 decoding passes
    streamer.drain()
    stats = streamer.stats()
    state = resident.state_dict()
    blocks = sum(t.nbytes for name, t in state.items() if name.startswith("blocks."))
    assert stats["passes"] == 6 and stats["streamed_bytes"] == 6 * blocks
    assert 0.0 <= stats["hidden"] <= 1.0 and stats["transfer_s"] > 0
    others = sum(t.nbytes for name, t in state.items() if not name.startswith("blocks."))
    assert streamer.weight_bytes() == others + (2 if prefetch else 1) * blocks // 3  # one or two blocks held
    streamer.close()


@pytest.mark.parametrize("prefetch", [True, False])
def test_every_pass_reads_the_blocks_from_the_file_again(tmp_path, prefetch):
    """Bytes changed in the file after it was opened and checked show in the next pass: nothing of a block
    is kept between passes (a stand-in for a changed file, which the sha256 check refuses at opening)."""
    resident = random_model()
    path = written(resident, tmp_path)
    model, streamer = offload.offloaded_model(path, resident.config.to_dict(), "cpu", prefetch=prefetch)
    window = torch.randint(0, TINY["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        assert torch.equal(model(window)[0], resident(window)[0])
        streamer.drain()
        start, end = (offload.read_header(path, "")[0]["blocks.1.ffwd.net.0.weight"][i] for i in (2, 3))
        with open(path, "r+b") as f:
            f.seek(start)
            f.write(bytes(end - start))  # block 1's first MLP weight: zeros
        assert not torch.equal(model(window)[0], resident(window)[0])
    streamer.close()


def test_each_blocks_pages_leave_the_process_once_read(tmp_path):
    resident = random_model(d_model=256, n_heads=4, d_head=64)  # blocks of ~3 MB: many pages each
    path = written(resident, tmp_path)
    for drop, held in ((True, False), (False, True)):
        model, streamer = offload.offloaded_model(path, resident.config.to_dict(), "cpu", drop_page_cache=drop)
        generate_kvcache(model, torch.zeros(1, 4, dtype=torch.long), 2, TINY["seqlen"])
        streamer.drain()
        assert (streamer.file.resident_bytes() > 0) == held
        streamer.close()


def test_the_file_holds_the_state_dict_with_its_config_and_hash(tmp_path):
    from safetensors import safe_open
    resident = random_model()
    with safe_open(str(written(resident, tmp_path)), framework="pt") as f:  # an ordinary safetensors file
        assert f.metadata()["sha256"] == offload.weights_sha256(resident)
        assert json.loads(f.metadata()["config"]) == resident.config.to_dict()
        assert all(torch.equal(f.get_tensor(name), t) for name, t in resident.state_dict().items())


@pytest.mark.parametrize("cut", [1, 1000, 10, 4])  # a tensor's last byte, many tensors, into the header, its length
def test_a_truncated_file_is_refused_and_named(tmp_path, cut):
    resident = random_model()
    path = written(resident, tmp_path)
    raw = path.read_bytes()
    path.write_bytes(raw[:-cut] if cut > 10 or cut == 1 else raw[:cut])
    with pytest.raises(CheckpointError, match=f"{path}.*(truncated|damaged)"):
        offload.offloaded_model(path, resident.config.to_dict(), "cpu")


def test_a_missing_file_and_a_non_safetensors_file_are_refused_and_named(tmp_path):
    config = random_model().config.to_dict()
    with pytest.raises(CheckpointError, match=f"no offload file at {tmp_path / 'none.safetensors'}"):
        offload.offloaded_model(tmp_path / "none.safetensors", config, "cpu")
    (tmp_path / "text.safetensors").write_text("To be, or not to be" * 10)
    with pytest.raises(CheckpointError, match="text.safetensors .*(truncated|not a readable)"):
        offload.offloaded_model(tmp_path / "text.safetensors", config, "cpu")


def test_a_changed_byte_fails_the_hash(tmp_path):
    resident = random_model()
    path = written(resident, tmp_path)
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x01  # a bit of the last tensor, the size unchanged
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=f"{path} is damaged"):
        offload.OffloadFile(path, resident.config.to_dict())


def test_a_file_written_for_another_model_is_refused(tmp_path):
    path = written(random_model(n_layers=3), tmp_path)
    with pytest.raises(CheckpointError, match="written for another model"):
        offload.OffloadFile(path, random_model().config.to_dict())
    resident, other = random_model(seed=0), random_model(seed=1)  # the same config, other weights
    with pytest.raises(CheckpointError, match="weights of another model"):
        offload.OffloadFile(written(other, tmp_path, "other.safetensors"), resident.config.to_dict(),
                            sha256=offload.weights_sha256(resident))


def test_a_failed_write_leaves_the_old_file_and_no_partial_one(tmp_path, monkeypatch):
    resident = random_model()
    path = written(resident, tmp_path)
    before = path.read_bytes()

    def dies_half_way(tensors, filename, metadata=None):
        open(filename, "wb").write(b"\0" * 100)
        raise OSError("disk full")
    monkeypatch.setattr(offload, "save_file", dies_half_way)
    with pytest.raises(OSError, match="disk full"):
        offload.write_offload_file(random_model(seed=1), path)
    with pytest.raises(OSError):
        offload.write_offload_file(resident, tmp_path / "new.safetensors")
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]


# ----------------------------------------------------------------------------------------------------
# main_offloading.py

QUICK = ["--preset", "cpu", "--device", "cpu", "--untrained", "--batch-sizes", "1", "3", "--n-tokens", "4",
         "--prompt-len", "8", "--repeats", "1"]


@pytest.mark.parametrize("flags, match", [
    (["--batch-sizes", "0"], "at least 1"), (["--batch-sizes", "2", "2"], "repeats"),
    (["--n-tokens", "1"], "at least 2"), (["--repeats", "0"], "at least 1"),
    (["--offload-file", "/no/such/folder/w.safetensors"], "folder that exists"),
    (["--prompt-len", "500"], "seqlen"), (["--batch-sizes", "100000000"], "--batch-sizes"),
    (["--offload-file", "."], "give a file path")])
def test_bad_offloading_flags_are_clear_errors_before_any_work(flags, match, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        main_offloading.main(QUICK + ["--offload-file", str(tmp_path / "w.safetensors")] + flags)
    assert e.value.code == 2 and match in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_main_offloading_checks_tokens_and_writes_its_rows(real_data, tmp_path):
    out_json, out_png, path = tmp_path / "o.json", tmp_path / "o.png", tmp_path / "w.safetensors"
    main_offloading.main(QUICK + ["--offload-file", str(path), "--json", str(out_json), "--plot", str(out_png)])
    result = json.loads(out_json.read_text())
    rows = result["rows"]
    assert [(r["variant"], r["batch_size"]) for r in rows] == [
        (v, b) for b in (1, 3) for v in ("resident", "offload", "offload, no prefetch")]
    assert all(ok for ok in result["checks"].values()) and len(result["checks"]) == 4
    blocks = 4 * result["block_mb"] * 2**20  # the cpu preset's 4 blocks, every pass
    for r in rows:
        assert r["same_tokens"] == ("reference" if r["variant"] == "resident" else "yes")
        expected = 0.0 if r["variant"] == "resident" else round(blocks / r["batch_size"] / 2**10, 1)
        assert r["streamed_KB_per_token"] == expected
        assert r["tpot_ms"] is None or r["tpot_ms"] > 0
    by = {(r["variant"], r["batch_size"]): r for r in rows}
    assert by["offload, no prefetch", 1]["peak_weight_mb"] < by["resident", 1]["peak_weight_mb"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.is_file()
    renders_on_its_page("main_offloading", result)


def test_a_damaged_or_foreign_offload_file_stops_the_script_before_decoding(real_data, tmp_path, monkeypatch):
    path, out_json = tmp_path / "w.safetensors", tmp_path / "o.json"
    flags = QUICK + ["--offload-file", str(path), "--json", str(out_json)]
    offload.write_offload_file(other_cpu_model(), path)
    monkeypatch.setattr(main_offloading, "generate_kvcache", lambda *a, **k: pytest.fail("decoding started"))
    with pytest.raises(CheckpointError, match=f"{path} holds the weights of another model"):
        main_offloading.main(flags)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=f"{path} is truncated"):
        main_offloading.main(flags)
    assert not out_json.exists()


def test_the_default_file_is_written_once_and_again_for_other_weights(real_data, tmp_path, monkeypatch, capsys):
    path = tmp_path / "checkpoints" / "cpu_offload.safetensors"  # a clean clone has no checkpoints/ yet
    monkeypatch.setattr(main_offloading, "default_offload_file", lambda preset: path)
    main_offloading.main(QUICK + ["--batch-sizes", "1"])
    assert f"no offload file at {path}: writing" in capsys.readouterr().out and path.is_file()
    offload.write_offload_file(other_cpu_model(), path)
    main_offloading.main(QUICK + ["--batch-sizes", "1"])
    assert "holds other weights than the loaded model's: writing it again" in capsys.readouterr().out
    written_at = path.stat().st_mtime_ns
    main_offloading.main(QUICK + ["--batch-sizes", "1"])
    assert "writing" not in capsys.readouterr().out and path.stat().st_mtime_ns == written_at
