"""`python gptlite.py --preset P --iters N` trains, saves the checkpoint atomically and prints a sample."""
import runpy
import sys

import torch

import inference_utils as iu
from lib import files, presets


def test_training_cli_saves_a_loadable_checkpoint_and_prints_a_sample(real_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(files, "CHECKPOINT_DIR", tmp_path)  # never touch the real checkpoints/
    monkeypatch.setattr(sys, "argv", ["gptlite.py", "--preset", "cpu", "--device", "cpu", "--iters", "2",
                                      "--sample-tokens", "20"])
    runpy.run_path(str(files.ROOT / "gptlite.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "preset: cpu" in out and "saved" in out
    sample = out[out.index("\n", out.index("saved ")) + 1:]
    assert len(sample) == 20 + 1  # 20 characters, then print's newline
    ckpt = torch.load(tmp_path / "cpu.pt", weights_only=True)
    assert ckpt["config"] == presets.PRESETS["cpu"].gptlite_kwargs() and ckpt["meta"]["stamp"]["iters"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["cpu.pt"]
