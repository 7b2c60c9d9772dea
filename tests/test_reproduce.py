"""reproduce.py's renderer on small fake results, and its runner on tiny stand-in scripts (seconds)."""
import argparse
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

import reproduce
from lib import attention_summary
from reproduce import ReproduceError, Run

COLUMNS = [["variant", "variant", "{}"], ["ttft_ms", "TTFT ms", "{:.2f}"], ["steps", "steps", "{}"],
           ["ok", "ok", "{}"]]


def test_markdown_table_from_columns_and_rows():
    rows = [{"variant": "no cache", "ttft_ms": 4.526, "steps": 12, "ok": "yes", "ignored": 1.0},
            {"variant": "a | b", "ttft_ms": None, "steps": None, "ok": "NO"}]
    assert reproduce.markdown_table(COLUMNS, rows) == (
        "| variant | TTFT ms | steps | ok |\n"
        "| --- | ---: | ---: | --- |\n"
        "| no cache | 4.53 | 12 | yes |\n"
        "| a \\| b | - | - | NO |")


def test_a_format_that_does_not_fit_is_a_clear_error():
    with pytest.raises(ReproduceError, match="format '{:d}' does not fit 1.5"):
        reproduce.markdown_table([["x", "x", "{:d}"]], [{"x": 1.5}])


PAGE = """# Title

Prose with 1.23 in it.
<!-- reproduce:one:table -->
old table
<!-- /reproduce:one:table -->
Prose between.
<!-- reproduce:two:table -->
other block
<!-- /reproduce:two:table -->
End.
"""


def test_replace_block_changes_only_the_text_between_its_markers():
    new = reproduce.replace_block(PAGE, "one", "table", "| new |", "page.md")
    assert new == PAGE.replace("old table", "\n| new |\n")
    assert reproduce.replace_block(new, "one", "table", "| new |", "page.md") == new  # a rerun changes nothing


@pytest.mark.parametrize("text", [PAGE.replace("<!-- reproduce:one:table -->\n", ""),
                                  PAGE.replace("<!-- /reproduce:one:table -->\n", ""),
                                  PAGE + "<!-- reproduce:one:table -->\n"])
def test_a_missing_or_repeated_marker_is_a_clear_error(text):
    with pytest.raises(ReproduceError, match="page.md needs exactly one block <!-- reproduce:one:table -->"):
        reproduce.replace_block(text, "one", "table", "x", "page.md")


# ----------------------------------------------------------------------------------------------------
# The runner, on stand-in scripts in a fake repository.

OK_SCRIPT = """import json, sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
open(args["--plot"], "wb").write(b"png of ok")
json.dump({"script": "ok.py", "preset": "cpu", "device": args.get("--device", "cpu"), "untrained": False, "torch": "9.9",
           "columns": [["variant", "variant", "{}"], ["ms", "TPOT ms", "{:.1f}"]],
           "rows": [{"variant": "fast", "ms": 1.26}, {"variant": "slow", "ms": None}],
           "summary": ["fast / slow: -"], "headline": {"technique": "ok technique", "figure": "TPOT 1.26 ms"},
           "attention_methods": [{"method": "fast attention", "exact": True, "difference": "max |diff| 1e-06",
                                  "training_steps": 0, "training": "none", "reduces": "memory",
                                  "reduction": "9x less at 8k", "pays": "from 512 tokens"}],
           "tables": [{"title": "An extra table:", "columns": [["x", "x", "{:.2f}"]], "rows": [{"x": 0.5}]}]},
          open(args["--json"], "w"))
"""
FAIL_SCRIPT = """import sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
open(args["--plot"], "wb").write(b"png of a failed run")
open(args["--json"], "w").write("{}")
print("line 1 of stderr", file=sys.stderr)
sys.exit("error: the checks failed; this is a bug")
"""
README = """# Fake
<!-- reproduce:summary:table -->
old summary
<!-- /reproduce:summary:table -->
<!-- reproduce:checkpoints:table -->
old checkpoints
<!-- /reproduce:checkpoints:table -->
<!-- reproduce:attention_summary:table -->
old short attention summary
<!-- /reproduce:attention_summary:table -->
"""
ATTENTION_PAGE = """## Summary
<!-- reproduce:attention_summary:table -->
old attention summary
<!-- /reproduce:attention_summary:table -->
"""
DOCS = """## Ok
<!-- reproduce:ok:table -->
old ok table
<!-- /reproduce:ok:table -->
<!-- reproduce:ok:plot -->
<!-- /reproduce:ok:plot -->
## Failing
<!-- reproduce:bad:table -->
old bad table
<!-- /reproduce:bad:table -->
<!-- reproduce:bad:plot -->
old bad plot
<!-- /reproduce:bad:plot -->
"""


@pytest.fixture
def fake_repo(tmp_path, monkeypatch):
    (tmp_path / "docs").mkdir()
    (tmp_path / "ok.py").write_text(OK_SCRIPT)
    (tmp_path / "bad.py").write_text(FAIL_SCRIPT)
    (tmp_path / "README.md").write_text(README)
    (tmp_path / "docs" / "page.md").write_text(DOCS)
    (tmp_path / "docs" / "attention_summary.md").write_text(ATTENTION_PAGE)
    runs = [Run("ok", "ok.py", "docs/page.md", "ok", "ok plot"),
            Run("bad", "bad.py", "docs/page.md", "bad", "bad plot")]
    monkeypatch.setattr(reproduce, "ROOT", tmp_path)
    monkeypatch.setattr(reproduce, "RUNS", runs)
    monkeypatch.setattr(reproduce, "load_average", lambda: 0.5)  # a quiet machine, whatever this one's load
    return tmp_path


def test_a_failing_script_is_reported_and_leaves_its_block_while_the_others_are_rendered(fake_repo, capsys):
    with pytest.raises(SystemExit) as exit_info:
        reproduce.main([])
    assert exit_info.value.code != 0
    message = str(exit_info.value.code)
    assert "bad.py failed with exit code 1" in message
    assert "line 1 of stderr" in message and "error: the checks failed; this is a bug" in message
    page = (fake_repo / "docs" / "page.md").read_text()
    assert DOCS[DOCS.index("## Failing"):] in page  # the failed run's blocks, untouched
    assert not (fake_repo / "docs" / "bad_cpu.png").exists()
    assert not (fake_repo / "results" / "bad.json").exists()
    ok_block = page[page.index("<!-- reproduce:ok:table -->"):page.index("<!-- /reproduce:ok:table -->")]
    assert "| fast | 1.3 |" in ok_block and "| slow | - |" in ok_block and "- fast / slow: -" in ok_block
    assert "From `python ok.py`, run by `python reproduce.py` on " in ok_block and "preset `cpu`" in ok_block
    assert "old ok table" not in ok_block
    assert "![ok plot](ok_cpu.png)" in page
    assert (fake_repo / "docs" / "ok_cpu.png").read_bytes() == b"png of ok"
    saved = json.loads((fake_repo / "results" / "ok.json").read_text())
    assert saved["reproduce"]["command"] == "python ok.py" and saved["rows"][0]["ms"] == 1.26
    summary = README[:README.index("<!-- /reproduce:summary:table -->")]
    assert (fake_repo / "README.md").read_text().startswith(summary)  # the one-glance table needs every run's results
    assert "FAILED" in capsys.readouterr().out


def test_every_run_succeeds_then_the_one_glance_table_is_rendered(fake_repo):
    (fake_repo / "bad.py").write_text(OK_SCRIPT)
    reproduce.main([])  # no SystemExit: exit code 0
    readme = (fake_repo / "README.md").read_text()
    assert "| ok technique | TPOT 1.26 ms |" in readme and "[page](docs/page.md)" in readme
    assert "old summary" not in readme and readme.startswith("# Fake\n<!-- reproduce:summary:table -->\n")
    (fake_repo / "results" / "ok.json").write_text(
        (fake_repo / "results" / "ok.json").read_text().replace("1.26", "7.77"))  # the row and the headline
    reproduce.main(["--skip-run", "--only", "ok.py"])  # re-render from the saved JSON, run nothing
    page = (fake_repo / "docs" / "page.md").read_text()
    assert "| fast | 7.8 |" in page and "TPOT 7.77 ms" in (fake_repo / "README.md").read_text()


def test_the_summary_of_attention_methods_is_rendered_from_the_rows_of_the_runs_that_succeeded(fake_repo):
    with pytest.raises(SystemExit):  # bad.py fails: the summary has ok.py's rows only
        reproduce.main([])
    full = (fake_repo / "docs" / "attention_summary.md").read_text()
    assert "old attention summary" not in full and "from the last runs of `ok.py`" in full
    assert "| fast attention | yes, max \\|diff\\| 1e-06 | none | memory: 9x less at 8k | from 512 tokens | `ok.py` |" in full
    readme = (fake_repo / "README.md").read_text()
    assert "| fast attention | yes | no | memory | `ok.py` |" in readme and "old short attention summary" not in readme
    (fake_repo / "results" / "ok.json").write_text(
        (fake_repo / "results" / "ok.json").read_text().replace('"training_steps": 0', '"training_steps": 40'))
    reproduce.main(["--skip-run", "--only", "ok.py"])
    assert "| fast attention | yes | yes (40 steps) | memory | `ok.py` |" in (fake_repo / "README.md").read_text()


@pytest.mark.parametrize("bad", [dict(exact="yes"), dict(training_steps=-1), dict(pays="")])
def test_a_bad_attention_row_is_an_error_when_the_script_builds_it(bad):
    good = dict(method="m", exact=True, difference="d", training_steps=0, training="none", reduces="r",
                reduction="x", pays="p")
    assert attention_summary.method_row(**good)["exact"] is True
    with pytest.raises(ValueError, match="m: "):
        attention_summary.method_row(**(good | bad))


def test_pays_from_names_the_context_from_which_the_method_stays_faster():
    assert attention_summary.pays_from([1, 2, 4, 8], [5, 3, 1, 1], [2, 2, 2, 4]) == "from 4 tokens (the baseline's time / its: 4.00x at 8)"
    assert attention_summary.pays_from([1, 2], [1, 3], [2, 2]).startswith("not up to 2 tokens here")


def save_tiny_checkpoint(path, seed):
    from gptlite import GPTlite
    from lib import files
    torch.manual_seed(seed)
    model = GPTlite(vocab_size=5, d_model=8, n_heads=2, d_head=4, n_layers=1, dropout_p=0.0, seqlen=4)
    files.save_checkpoint(path, model, model.config.to_dict(), "abcde", rebuild="python tiny.py --seed 1 --json /tmp/run/x.json",
                          val_loss=1.25, train_seconds=3)
    return files.load_checkpoint(path)["sha256"]


def test_the_checkpoints_of_a_run_are_listed_with_the_hash_of_their_weights(fake_repo):
    (fake_repo / "bad.py").write_text(OK_SCRIPT)
    sha = save_tiny_checkpoint(fake_repo / "checkpoints" / "tiny.pt", seed=1)
    reproduce.main([])
    readme = (fake_repo / "README.md").read_text()
    block = readme[readme.index("<!-- reproduce:checkpoints:table -->"):]
    assert f"| checkpoints/tiny.pt | `{sha}` | 1.2500 | 3 | `python tiny.py --seed 1` |" in block
    assert "old checkpoints" not in block
    assert json.loads((fake_repo / "results" / "checkpoints.json").read_text())["rows"][0]["sha256"] == sha
    assert sha != save_tiny_checkpoint(fake_repo / "checkpoints" / "other.pt", seed=2)  # the hash sees the weights


def test_a_damaged_checkpoint_gets_no_hash_on_the_page(fake_repo):
    (fake_repo / "bad.py").write_text(OK_SCRIPT)
    path = fake_repo / "checkpoints" / "tiny.pt"
    save_tiny_checkpoint(path, seed=1)
    ckpt = torch.load(path, weights_only=True)
    next(iter(ckpt["state_dict"].values())).view(-1)[0] += 1.0  # a weight changed outside save_checkpoint
    torch.save(ckpt, path)
    with pytest.raises(SystemExit) as exit_info:
        reproduce.main([])
    assert "checkpoints table" in str(exit_info.value.code) and "tiny.pt" in str(exit_info.value.code)
    assert "old checkpoints" in (fake_repo / "README.md").read_text()


def test_fresh_sets_the_old_checkpoints_aside_before_the_scripts_run(fake_repo):
    (fake_repo / "bad.py").write_text(OK_SCRIPT)
    save_tiny_checkpoint(fake_repo / "checkpoints" / "tiny.pt", seed=1)
    reproduce.main(["--fresh"])
    assert not (fake_repo / "checkpoints" / "tiny.pt").exists()
    [aside] = (fake_repo / "checkpoints").glob("before-fresh-*/tiny.pt")  # kept, not deleted
    readme = (fake_repo / "README.md").read_text()
    assert "used no checkpoint" in readme and "tiny.pt" not in readme


@pytest.mark.parametrize("flag", ["--skip-run", "--quick", "--only"])
def test_fresh_with_a_partial_run_is_an_error_before_anything_moves(fake_repo, flag, capsys):
    save_tiny_checkpoint(fake_repo / "checkpoints" / "tiny.pt", seed=1)
    with pytest.raises(SystemExit) as exit_info:
        reproduce.main(["--fresh", flag] + (["ok.py"] if flag == "--only" else []))
    assert exit_info.value.code == 2 and f"drop {flag}" in capsys.readouterr().err
    assert (fake_repo / "checkpoints" / "tiny.pt").exists()


def test_a_missing_marker_stops_before_any_script_runs(fake_repo):
    (fake_repo / "docs" / "page.md").write_text(DOCS.replace("<!-- reproduce:ok:plot -->\n", ""))
    with pytest.raises(ReproduceError, match="page.md needs exactly one block <!-- reproduce:ok:plot -->"):
        reproduce.main([])
    assert not (fake_repo / "results").exists()


def test_out_renders_copies_and_leaves_the_pages_alone(fake_repo, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    reproduce.main(["--only", "ok", "--out", str(out)])
    assert (fake_repo / "docs" / "page.md").read_text() == DOCS
    assert not (fake_repo / "docs" / "ok_cpu.png").exists()
    assert "| fast | 1.3 |" in (out / "pages" / "docs" / "page.md").read_text()
    assert (out / "pages" / "docs" / "ok_cpu.png").read_bytes() == b"png of ok"
    assert (out / "ok.json").is_file()


def test_an_unknown_name_after_only_is_an_error_before_any_run(fake_repo, capsys):
    with pytest.raises(SystemExit) as exit_info:
        reproduce.main(["--only", "main_nothing.py"])
    assert exit_info.value.code == 2
    assert "--only main_nothing.py: choose among bad, bad.py, ok, ok.py" in capsys.readouterr().err
    assert not (fake_repo / "results").exists()


def test_the_extra_tables_of_a_script_are_rendered_under_its_table(fake_repo):
    (fake_repo / "bad.py").write_text(OK_SCRIPT)
    reproduce.main([])
    page = (fake_repo / "docs" / "page.md").read_text()
    assert "An extra table:\n\n| x |\n| ---: |\n| 0.50 |" in page


def test_gpu_results_go_into_their_own_blocks_beside_the_cpu_ones(fake_repo, monkeypatch):
    (fake_repo / "bad.py").write_text(OK_SCRIPT)
    reproduce.main([])
    cpu_page, cpu_readme = (fake_repo / "docs" / "page.md").read_text(), (fake_repo / "README.md").read_text()
    monkeypatch.setattr(reproduce.harness, "get_device", lambda name: torch.device(name or "cpu"))  # no GPU here
    reproduce.main(["--device", "cuda"])
    page, readme = (fake_repo / "docs" / "page.md").read_text(), (fake_repo / "README.md").read_text()
    cpu_block = cpu_page[cpu_page.index("<!-- reproduce:ok:table -->"):cpu_page.index("<!-- /reproduce:ok:table -->")]
    assert cpu_block in page  # the CPU figures stay
    gpu_block = page[page.index("<!-- reproduce:ok:table:cuda -->"):page.index("<!-- /reproduce:ok:table:cuda -->")]
    assert "device `cuda`" in gpu_block and "device `cuda`" not in cpu_block
    assert page.index("<!-- /reproduce:ok:table -->") < page.index("<!-- reproduce:ok:table:cuda -->")
    assert "![ok plot](ok_cuda.png)" in page and "![ok plot](ok_cpu.png)" in page
    assert (fake_repo / "docs" / "ok_cpu.png").exists() and (fake_repo / "docs" / "ok_cuda.png").exists()
    assert (fake_repo / "results" / "cuda" / "ok.json").is_file() and (fake_repo / "results" / "ok.json").is_file()
    assert cpu_readme[:cpu_readme.index("<!-- /reproduce:summary:table -->")] in readme
    assert "<!-- reproduce:summary:table:cuda -->" in readme


def test_a_busy_machine_does_not_replace_the_pages_unless_told(fake_repo, monkeypatch):
    monkeypatch.setattr(reproduce, "load_average", lambda: 6.0 * (os.cpu_count() or 1))
    with pytest.raises(ReproduceError, match="machine is busy.*--busy-ok"):
        reproduce.main([])
    assert not (fake_repo / "results").exists() and (fake_repo / "docs" / "page.md").read_text() == DOCS
    reproduce.main(["--only", "ok", "--busy-ok"])
    assert "| fast | 1.3 |" in (fake_repo / "docs" / "page.md").read_text()


def test_each_script_of_a_run_for_the_pages_waits_for_a_quiet_machine(fake_repo, monkeypatch):
    loads = iter([0.5, 1.8, 0.996, 0.9] + [0.5] * 50)  # main's check; the previous script's load decaying; quiet
    slept = []
    monkeypatch.setattr(reproduce, "load_average", lambda: next(loads))
    monkeypatch.setattr(reproduce.time, "sleep", slept.append)
    reproduce.main(["--only", "ok"])
    assert slept == [5, 5]  # two polls at 1.0 or above as the caption rounds them, then the script ran
    assert json.loads((fake_repo / "results" / "ok.json").read_text())["reproduce"]["load_average"] <= 0.9


def test_the_wait_for_a_quiet_machine_gives_up_after_its_limit(monkeypatch):
    slept = []
    monkeypatch.setattr(reproduce, "load_average", lambda: 3.0)  # a machine that stays busy
    monkeypatch.setattr(reproduce.time, "sleep", slept.append)
    assert reproduce.wait_for_quiet(limit=1.0, max_s=20, poll_s=5) == 3.0  # the run then records load 3.0
    assert slept == [5, 5, 5, 5]


def test_a_run_that_started_on_a_busy_machine_keeps_its_block(fake_repo, monkeypatch):
    reproduce.main(["--only", "ok"])
    saved = fake_repo / "results" / "ok.json"
    result = json.loads(saved.read_text())
    result["reproduce"]["load_average"] = 6.0 * (os.cpu_count() or 1)
    result["rows"][0]["ms"] = 9.99
    saved.write_text(json.dumps(result))
    with pytest.raises(SystemExit, match="busy when it ran"):
        reproduce.main(["--only", "ok", "--skip-run"])
    assert "| fast | 1.3 |" in (fake_repo / "docs" / "page.md").read_text()
    reproduce.main(["--only", "ok", "--skip-run", "--busy-ok"])
    assert "| fast | 10.0 |" in (fake_repo / "docs" / "page.md").read_text()


def test_out_on_a_file_is_an_error_before_any_run(fake_repo, capsys):
    (fake_repo / "a_file").write_text("x")
    with pytest.raises(SystemExit) as exit_info:
        reproduce.main(["--out", str(fake_repo / "a_file")])
    assert exit_info.value.code == 2 and "is a file: give a folder" in capsys.readouterr().err
    assert not (fake_repo / "results").exists()


# ----------------------------------------------------------------------------------------------------
# Every real script's JSON renders: its table block and its one-glance row, from its own headline.

@pytest.mark.parametrize("run", reproduce.RUNS, ids=lambda run: run.name)
def test_each_quick_command_is_accepted_by_its_script(run, tmp_path):
    """`python reproduce.py --quick` runs these: each parses in the script itself (nothing is run here)."""
    import importlib
    cmd = reproduce.command(run, argparse.Namespace(quick=True, device="cpu"))
    module = importlib.import_module(run.script[:-3])
    parsed = module.parse_args([*cmd[1:], "--json", str(tmp_path / "out.json")])
    args = next(value for value in parsed if isinstance(value, argparse.Namespace))
    assert args.untrained and args.device == "cpu"


SOURCES = "".join(path.read_text() for path in Path(__file__).parent.glob("test_*.py"))


@pytest.mark.parametrize("run", reproduce.RUNS, ids=lambda run: run.name)
def test_each_run_has_an_end_to_end_test_whose_json_renders(run):
    """Each script's real JSON renders (its headline, its table block): the end-to-end test of each run
    writes it with the run's flags and checks it with conftest.renders_on_its_page, so no run is missed."""
    assert f'renders_on_its_page("{run.name}"' in SOURCES, f"no end-to-end test renders {run.name}'s JSON"


# ----------------------------------------------------------------------------------------------------
# The GPU run (--device cuda --budget): its plan, printed and tested without a GPU.

def test_the_gpu_plan_fits_its_budget_and_sizes_the_checkpoint_to_it(capsys):
    reproduce.main(["--device", "cuda", "--budget", "10", "--dry-run"])
    out = capsys.readouterr().out
    iters = int(10 * 60 * reproduce.GPU_TRAIN_SHARE / reproduce.GPU_TRAIN_STEP_S)
    assert 1 <= iters < reproduce.presets.get_preset("gptlite").iters  # cut to the budget
    assert f"python gptlite.py --preset gptlite --device cuda --iters {iters}" in out
    _, train_minutes, planned, skipped = reproduce.gpu_plan(10, {run.name for run in reproduce.RUNS})
    assert train_minutes + sum(step.minutes for step in planned) <= 10
    assert {step.name for step in reproduce.GPU_STEPS} <= {run.name for run in reproduce.RUNS}
    for step in planned:  # each with the budget's checkpoint, and the line says so
        line = next(line for line in out.splitlines() if f"python {step.name}.py" in line)
        assert f"--device cuda --preset gptlite --train-iters {iters}" in line and f"{step.minutes:4.1f} min" in line
    for line in skipped:
        assert line in out
    assert len(planned) + len(skipped) == len(reproduce.GPU_STEPS)


def test_a_small_budget_skips_what_does_not_fit_with_one_line_each(capsys):
    reproduce.main(["--device", "cuda", "--budget", "3", "--dry-run"])
    out = capsys.readouterr().out
    skipped = [line for line in out.splitlines() if line.strip().startswith("skipped ")]
    assert skipped and all("of the budget left" in line for line in skipped)
    assert "skipped main_static_batching: about 0.5 min" in out
    planned = [line for line in out.splitlines() if "--train-iters" in line]
    assert planned and len(planned) + len(skipped) == len(reproduce.GPU_STEPS)
    reproduce.main(["--device", "cuda", "--budget", "10", "--dry-run", "--only", "main_gqa.py"])
    lines = [line for line in capsys.readouterr().out.splitlines() if "--train-iters" in line]
    assert len(lines) == 1 and "python main_gqa.py" in lines[0]  # --only keeps only its runs


@pytest.mark.parametrize("step", reproduce.GPU_STEPS, ids=lambda step: step.name)
def test_each_gpu_command_is_accepted_by_its_script(step, monkeypatch):
    """The plan's flags parse in the script itself (on the CPU here: --device cpu for cuda, nothing run)."""
    import importlib
    run = next(run for run in reproduce.RUNS if run.name == step.name)
    cmd = reproduce.gpu_command(run, step, 123, "cpu")
    module = importlib.import_module(run.script[:-3])
    parsed = module.parse_args(cmd[1:])
    args, preset = parsed[0], parsed[1]
    assert args.train_iters == 123 and preset.name == "gptlite" and preset.iters == 123  # the checkpoint's recipe


@pytest.mark.parametrize("argv, message", [
    (["--budget", "5"], "--budget sizes the GPU run: add --device cuda"),
    (["--device", "cuda", "--budget", "0", "--dry-run"], "--budget 0: give minutes above 0"),
    (["--device", "cuda", "--budget", "5", "--quick", "--dry-run"], "--budget plans its own runs and checkpoint"),
])
def test_bad_budget_flags_are_one_clear_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        reproduce.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_one_line_before_any_work(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(reproduce, "ROOT", tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        reproduce.main(["--device", "cuda", "--budget", "10"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and "asked for CUDA, which this machine does not have" in err[-1]
    assert not any(tmp_path.iterdir())  # nothing written


def test_the_gpu_run_trains_then_runs_what_fits_and_stops_at_the_budget(fake_repo, monkeypatch, capsys):
    (fake_repo / "gptlite.py").write_text("import sys; print('trained', sys.argv[1:])\n")
    (fake_repo / "bad.py").write_text("import time; time.sleep(60)\n")  # overruns: stopped at the budget's end
    monkeypatch.setattr(reproduce, "GPU_STEPS", [reproduce.GpuStep("ok", 0.01), reproduce.GpuStep("bad", 0.01),
                                                 reproduce.GpuStep("ok", 100)])
    monkeypatch.setattr(reproduce.harness, "get_device", lambda name: torch.device(name or "cpu"))  # no GPU here
    with pytest.raises(SystemExit):
        reproduce.main(["--device", "cuda", "--budget", "0.1"])  # 6 s
    out = capsys.readouterr()
    assert "skipped ok: about 100 min" in out.out
    assert "was stopped after" in out.err + out.out
    assert "--train-iters" in (fake_repo / "results" / "cuda" / "ok.json").read_text()  # the planned command
    assert "trained" in (fake_repo / "results" / "cuda" / "logs" / "checkpoint.out").read_text()
    page = (fake_repo / "docs" / "page.md").read_text()
    assert "<!-- reproduce:ok:table:cuda -->" in page and "<!-- reproduce:bad:table:cuda -->" not in page
    assert "<!-- reproduce:summary:table:cuda -->" in (fake_repo / "README.md").read_text()  # the runs it made


# ----------------------------------------------------------------------------------------------------
# Results as data: a partial run never shrinks the summaries, and the committed results are the pages.

def test_the_attention_summary_waits_for_every_run_that_holds_its_rows(fake_repo, monkeypatch, capsys):
    monkeypatch.setattr(reproduce.attention_summary, "ORDER", ("ok.py", "bad.py"))  # bad.py fails: no results
    with pytest.raises(SystemExit):
        reproduce.main([])
    assert "summary of attention methods (docs/attention_summary.md) is left as it was: no results of bad" in \
        capsys.readouterr().out
    assert "old attention summary" in (fake_repo / "docs" / "attention_summary.md").read_text()
    assert "old short attention summary" in (fake_repo / "README.md").read_text()


def test_a_partial_run_keeps_the_checkpoints_it_did_not_see(fake_repo):
    (fake_repo / "results").mkdir()
    old = {"checkpoint": "checkpoints/elsewhere.pt", "sha256": "ab" * 32, "val_loss": 1.5, "train_seconds": 9,
           "rebuild": "python gptlite.py"}
    (fake_repo / "results" / "checkpoints.json").write_text(json.dumps({"date": "2026-01-01", "rows": [old]}))
    (fake_repo / "checkpoints").mkdir()
    reproduce.record_checkpoints(fake_repo / "results", fresh=False)
    assert json.loads((fake_repo / "results" / "checkpoints.json").read_text())["rows"] == [dict(old, machine=None)]
    reproduce.record_checkpoints(fake_repo / "results", fresh=True)  # --fresh: only what this run trained
    assert json.loads((fake_repo / "results" / "checkpoints.json").read_text())["rows"] == []


def test_a_checkpoint_trained_on_another_machine_keeps_its_row_while_a_page_was_measured_there(fake_repo,
                                                                                             monkeypatch):
    results = fake_repo / "results"
    results.mkdir()
    row = {"checkpoint": "checkpoints/cpu.pt", "sha256": "ab" * 32, "val_loss": 1.5, "train_seconds": 9,
           "rebuild": "python gptlite.py"}
    (results / "checkpoints.json").write_text(json.dumps({"date": "2026-01-01", "machine": "old CPU", "rows": [row]}))
    (results / "main_a.json").write_text(json.dumps({"reproduce": {"machine": "old CPU"}}))
    monkeypatch.setattr(reproduce, "machine", lambda device: "new CPU")
    monkeypatch.setattr(reproduce, "checkpoint_rows", lambda folder: [dict(row, sha256="cd" * 32)])
    reproduce.record_checkpoints(results, fresh=False)
    record = json.loads((results / "checkpoints.json").read_text())
    assert [(r["machine"], r["sha256"]) for r in record["rows"]] == [("new CPU", "cd" * 32), ("old CPU", "ab" * 32)]
    block = reproduce.checkpoints_block(record)
    assert "on 2 machines" in block and "| old CPU |" in block and "| new CPU |" in block
    reproduce.record_checkpoints(results, fresh=False)  # this machine's file replaces its own row only
    assert len(json.loads((results / "checkpoints.json").read_text())["rows"]) == 2
    (results / "main_a.json").write_text(json.dumps({"reproduce": {"machine": "new CPU"}}))  # rerun here
    reproduce.record_checkpoints(results, fresh=False)
    record = json.loads((results / "checkpoints.json").read_text())
    assert [r["machine"] for r in record["rows"]] == ["new CPU"]
    assert "on 2 machines" not in reproduce.checkpoints_block(record)


def test_a_clone_without_the_results_plots_renders_with_the_pages_own(fake_repo):
    (fake_repo / "bad.py").write_text(OK_SCRIPT)
    reproduce.main([])
    before = (fake_repo / "docs" / "page.md").read_text()
    (fake_repo / "results" / "ok.png").unlink()  # results/*.png are not committed
    reproduce.main(["--skip-run"])
    assert (fake_repo / "docs" / "page.md").read_text() == before
    (fake_repo / "docs" / "ok_cpu.png").unlink()
    with pytest.raises(SystemExit):
        reproduce.main(["--skip-run"])  # neither image: the block stays, and the run says so


COMMITTED = [run for run in reproduce.RUNS if (reproduce.ROOT / "results" / f"{run.name}.json").is_file()
             and subprocess.run(["git", "ls-files", "--error-unmatch", f"results/{run.name}.json"], cwd=reproduce.ROOT,
                                capture_output=True).returncode == 0]


@pytest.mark.parametrize("run", COMMITTED, ids=lambda run: run.name)
def test_each_committed_result_is_what_its_page_shows(run):
    """The pages are rendered from results/: a committed run's table block is its JSON's table, as it stands."""
    result = reproduce.load_result(reproduce.ROOT / "results" / f"{run.name}.json")
    page = (reproduce.ROOT / run.page).read_text()
    start, end = reproduce.markers(run.name, "table")
    assert page[page.index(start) + len(start):page.index(end)].strip() == reproduce.table_block(result).strip()


def test_a_first_partial_run_leaves_the_checkpoints_table_as_it_was(fake_repo, capsys):
    (fake_repo / "bad.py").write_text(OK_SCRIPT)
    reproduce.main(["--only", "ok"])
    assert "checkpoints table of README.md is left as it was: a partial run" in capsys.readouterr().out
    assert "old checkpoints" in (fake_repo / "README.md").read_text()
    assert not (fake_repo / "results" / "checkpoints.json").exists()
    reproduce.main([])  # every run: the record is made, and later partial runs add to it
    assert (fake_repo / "results" / "checkpoints.json").is_file()
