"""Bad input as a hostile user gives it: every flag of every script at 0, -1 and 10**9, output paths that
would replace a checkpoint, a page of the repository or the other output, folders that cannot be written,
training over a trained checkpoint, flags that do not apply, a file of random bytes as a checkpoint. Each
is refused in one line (argparse's exit code 2) before any work, or accepted with bounded work; nothing is
written. These tests run the scripts' argument parsing and checks only (their parse_args), never their work.
"""
import argparse
import contextlib
import glob
import importlib
import io
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import inference_utils as iu
from lib import files, harness
from lib.errors import CheckpointError, GPTliteError

ROOT = files.ROOT
SCRIPTS = sorted(Path(p).name for p in glob.glob(str(ROOT / "main_*.py")))
TRAINING_CLI = "gptlite.py"  # gptlite.py and gptlite_rope.py: harness.training_args
BOUNDLESS = {"--seed"}  # a value that selects, not sizes: any seed is the same work
HUGE = "1000000000"


def checker(script):
    """The function that parses and checks a script's flags (argv) and does nothing else."""
    if script == TRAINING_CLI:
        return lambda argv: harness.training_args("training", 10, argv)
    module = importlib.import_module(Path(script).stem)
    if script == "main_disaggregation.py":  # its launcher runs setup itself (then starts the 2 workers)
        def check(argv):
            parser, args, check_args = module.parse_args(argv)
            return harness.setup(args, parser, check_args)
        return check
    return module.parse_args


def outcome(check, argv):
    """('ok' | 'refused' | 'exit <code>', stderr): what checking `argv` did. An exception other than
    SystemExit propagates: a traceback fails the test."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            check(argv)
    except SystemExit as e:
        return ("refused" if e.code == 2 else f"exit {e.code}"), err.getvalue()
    return "ok", err.getvalue()


def numeric_flags(check, monkeypatch):
    """The flags of a script's --help whose values are numbers: [(flag, nargs)]."""
    parsers = []
    real = argparse.ArgumentParser.parse_args
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args",
                        lambda self, *a, **k: parsers.append(self) or real(self, *a, **k))
    assert outcome(check, ["--help"])[0] == "exit 0"
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", real)

    def is_number(action):
        for text in ("1", "0.5"):
            try:
                value = action.type(text)
            except (argparse.ArgumentTypeError, TypeError, ValueError):
                continue
            return isinstance(value, (int, float)) and not isinstance(value, bool)
        return False
    return [a.option_strings[-1] for a in parsers[-1]._actions
            if a.option_strings and a.type is not None and is_number(a)]


def written_files():
    """Every file under the repository's root (outside .git), with its size and time: what a run may write."""
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in ROOT.rglob("*")
            if p.is_file() and ".git" not in p.parts and "__pycache__" not in p.parts and ".pytest_cache" not in p.parts}


@pytest.fixture
def stubbed_data(real_data, monkeypatch, tmp_path):
    """setup loads the corpus once for all the calls; the working folder is an empty temporary one."""
    monkeypatch.setattr(harness, "load_data", lambda path=None: real_data)
    monkeypatch.chdir(tmp_path)
    return real_data


@pytest.mark.parametrize("script", SCRIPTS + [TRAINING_CLI, "reproduce.py"])
def test_every_numeric_flag_at_0_minus_1_and_1e9_is_bounded_or_refused_in_one_line(script, stubbed_data,
                                                                                  monkeypatch, tmp_path):
    """Each numeric flag of the script's --help at 0, -1 and 10**9 (and --threads at 100000): accepted (a
    value within the flag's bound, never 10**9 but for a seed) or refused with exit code 2 and one error line;
    no traceback, no file written."""
    check = checker(script) if script != "reproduce.py" else importlib.import_module("reproduce").parse_args
    flags = numeric_flags(check, monkeypatch)
    base = ["--untrained"] if script in SCRIPTS else []  # no checkpoint needed: the flags' own checks are reached
    assert outcome(check, base)[0] == "ok", f"{script}: its defaults are refused"
    before = written_files()
    for flag in flags:
        for value in ["0", "-1", HUGE] + (["100000"] if flag == "--threads" else []):
            result, err = outcome(check, base + [flag, value])
            if result == "ok":
                assert value != HUGE or flag in BOUNDLESS, f"{script} {flag} {value}: accepted, unbounded work"
            else:
                assert result == "refused", f"{script} {flag} {value}: {result}\n{err}"
                error_lines = [line for line in err.splitlines() if ": error: " in line]
                assert len(error_lines) == 1 and err.rstrip().endswith(error_lines[0]) and "Traceback" not in err
                named = flag in error_lines[0] or flag[2:].replace("-", "_") in error_lines[0]
                assert named, f"{script} {flag} {value}: refused for another reason: {error_lines[0]}"
    assert written_files() == before and not list(tmp_path.iterdir())
    if script == "main_quantization.py":  # the case: endless validation
        assert "--val-batches" in flags and outcome(check, ["--untrained", "--val-batches", HUGE])[0] == "refused"
    if script == "main_compile.py":  # torch.set_num_threads(100000) crashed the process
        assert outcome(check, ["--untrained", "--threads", "100000", "--modes", "--engines"])[0] == "refused"


def test_threads_beyond_the_cores_are_refused_by_every_script_that_has_the_flag(stubbed_data):
    """One check: every --threads is harness.thread_count, at most the cores this process may use."""
    cores = harness.cores()
    for script in ["main_compile.py", "main_expert_parallel.py", "main_pipeline_parallel.py",
                   "main_sequence_parallel.py", "main_tensor_parallel.py"]:
        check = checker(script)
        assert outcome(check, ["--threads", str(cores + 1)])[0] == "refused", script
        assert outcome(check, ["--untrained", "--threads", "1"])[0] == "ok", script


# ----------------------------------------------------------------------------------------------------
# Output paths: never a checkpoint, a file of the repository, the other output, or an unwritable folder.

def refusal(check, argv):
    result, err = outcome(check, argv)
    assert result == "refused", f"{argv}: {result}"
    return err.strip().splitlines()[-1]


def test_an_output_path_that_is_a_checkpoint_or_a_page_or_the_other_output_is_refused_before_any_work(
        stubbed_data, tmp_path, monkeypatch):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    monkeypatch.setattr(files, "CHECKPOINT_DIR", checkpoints)
    ckpt = checkpoints / "cpu.pt"
    ckpt.write_bytes(b"a trained checkpoint")
    check = checker("main_structured_decoding.py")
    assert "checkpoint" in refusal(check, ["--json", str(ckpt)])
    assert "checkpoint" in refusal(check, ["--plot", str(checkpoints / "new.png")])
    assert "checkpoint" in refusal(check, ["--json", str(tmp_path / "model.pt")])  # a checkpoint's suffix
    assert "file of the repository" in refusal(check, ["--json", str(ROOT / "README.md")])
    assert "file of the repository" in refusal(check, ["--plot", str(ROOT / "docs" / "kvcache_cpu.png")])
    assert "same file" in refusal(checker("main_kvcache.py"), ["--sweep", "--json", str(tmp_path / "x.png"),
                                                              "--plot", str(tmp_path / "x.png")])
    assert "checkpoints/" in refusal(checker("main_gqa.py"), ["--save", str(checkpoints / "gqa.pt")])
    assert ckpt.read_bytes() == b"a trained checkpoint"
    assert outcome(check, ["--json", str(tmp_path / "out.json")])[0] == "ok"
    assert outcome(checker("main_gqa.py"), ["--save", str(tmp_path / "gqa.pt")])[0] == "ok"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]  # nothing written, no probe left


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="/proc is Linux's")
def test_an_output_folder_that_cannot_be_written_is_refused_before_any_work(stubbed_data, tmp_path):
    err = refusal(checker("main_offloading.py"), ["--batch-sizes", "1", "--n-tokens", "4", "--repeats", "1",
                                                  "--json", "/proc/x.json"])
    assert "/proc/x.json" in err and "cannot be written" in err
    reproduce = importlib.import_module("reproduce")
    err = refusal(reproduce.parse_args, ["--out", "/proc/q"])
    assert "--out /proc/q" in err and "cannot be written" in err
    assert "is not a folder" in refusal(reproduce.parse_args, ["--out", str(ROOT / "README.md" / "q")])
    assert outcome(reproduce.parse_args, ["--out", str(tmp_path / "new" / "q"), "--skip-run"])[0] == "ok"
    assert not (tmp_path / "new").exists()  # made only when the run writes


# ----------------------------------------------------------------------------------------------------
# Training over a trained checkpoint.

def test_training_over_a_checkpoint_of_another_recipe_needs_overwrite_and_says_what_it_replaced(
        real_data, tmp_path, monkeypatch, capsys, one_batch_validation):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    monkeypatch.setattr(files, "CHECKPOINT_DIR", checkpoints)  # never the real checkpoints/
    sample = lambda m, p, n: p  # noqa: E731 (no sample: the checkpoint is what is tested)
    cli = lambda *flags: harness.training_cli("training", iu.train_checkpoint, sample, 1,  # noqa: E731
                                              ["--preset", "cpu", "--device", "cpu", *flags])
    ckpt = checkpoints / "cpu.pt"
    cli("--iters", "2")
    trained = ckpt.read_bytes()
    with pytest.raises(GPTliteError, match=r"another recipe.*'iters': 2.*'iters': 3.*--overwrite.*--out PATH"):
        cli("--iters", "3")
    assert ckpt.read_bytes() == trained  # refused before any training
    cli("--iters", "3", "--out", str(tmp_path / "three.pt"))  # elsewhere: the trained file stays
    assert ckpt.read_bytes() == trained
    assert files.load_checkpoint(tmp_path / "three.pt")["meta"]["stamp"]["iters"] == 3
    capsys.readouterr()
    cli("--iters", "3", "--overwrite")
    assert f"replacing {ckpt} (trained with {{'iters': 2" in capsys.readouterr().out
    assert files.load_checkpoint(ckpt)["meta"]["stamp"]["iters"] == 3
    ckpt.write_bytes(b"damaged")  # a damaged file is rebuilt by the command its error names
    cli("--iters", "3")
    assert "damaged" in capsys.readouterr().out and files.load_checkpoint(ckpt)


def test_a_checkpoint_of_random_bytes_or_foreign_objects_is_refused_without_torchs_weights_only_advice(tmp_path):
    (tmp_path / "random.pt").write_bytes(os.urandom(4096))

    class Foreign:
        def __reduce__(self):
            return (os.getcwd, ())
    torch.save({"config": {}, "x": Foreign()}, tmp_path / "foreign.pt")
    for name in ("random.pt", "foreign.pt"):
        with pytest.raises(CheckpointError) as e:
            files.load_checkpoint(tmp_path / name)
        assert "not a readable checkpoint" in str(e.value) and "weights_only" not in str(e.value)
        assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------------------------------
# Flags that do not apply, and a headline that says why a figure is missing.

@pytest.mark.parametrize("script, argv, needs", [
    ("main_continuous_batching.py", ["--turns", "3"], "--prefix-sharing"),
    ("main_continuous_batching.py", ["--system-len", "32"], "--prefix-sharing"),
    ("main_continuous_batching.py", ["--think-time", "1"], "--prefix-sharing"),
    ("main_moe.py", ["--router", "softmax", "--bias-rate", "0.5"], "--router sigmoid"),
    ("main_moe.py", ["--router", "sigmoid", "--aux-weight", "0.5"], "--router softmax"),
    ("main_speculative_decoding.py", ["--drafts", "lookup", "--mtp-weight", "0.5"], "--drafts mtp"),
    ("main_speculative_decoding.py", ["--drafts", "mtp", "--ngram", "2"], "--drafts lookup"),
    ("main_speculative_decoding.py", ["--drafts", "lookup", "--exit-layers", "1"], "--drafts 'early exit'"),
    ("main_speculative_decoding.py", ["--drafts", "eagle", "--medusa-heads", "4"], "--drafts medusa"),
    ("main_speculative_decoding.py", ["--drafts", "lookup", "--head-iters", "4"], "--drafts medusa or eagle"),
    ("main_speculative_decoding.py", ["--drafts", "mtp", "--draft-iters", "4"], "--drafts distilled")])
def test_a_flag_that_does_not_apply_is_refused_naming_the_flag_it_needs(stubbed_data, script, argv, needs):
    assert needs in refusal(checker(script), argv)


def test_a_flag_that_applies_is_accepted(stubbed_data):
    assert outcome(checker("main_continuous_batching.py"), ["--prefix-sharing", "--turns", "3"])[0] == "ok"
    assert outcome(checker("main_moe.py"), ["--router", "sigmoid", "--bias-rate", "0.5"])[0] == "ok"
    assert outcome(checker("main_speculative_decoding.py"), ["--drafts", "medusa", "--head-iters", "4"])[0] == "ok"


def test_the_offloading_headline_names_one_batch_once_and_says_why_a_tpot_is_unmeasured():
    main_offloading = importlib.import_module("main_offloading")
    rows = [dict(variant=v, batch_size=1, tpot_ms=t, tokens_per_s=s, hidden_pct=h)
            for v, t, s, h in [("resident", None, 1000.0, None), ("offload", 1.5, 500.0, 80.0)]]
    figure = main_offloading.headline(rows, "a file on disk")["figure"]
    assert figure.count("at batch 1") == 3  # TPOT, throughput, the prefetch: once each
    assert "TPOT offload / resident: - at batch 1" in figure and "raise --n-tokens or --repeats" in figure
    rows += [dict(r, batch_size=8, tpot_ms=2.0) for r in rows]
    figure = main_offloading.headline(rows, "a file on disk")["figure"]
    assert "at batch 1" in figure and "1.00x at batch 8" in figure


def test_the_readme_says_what_a_script_refuses_and_never_overwrites():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Flags"):]
    section = section[:section.index("\n## ", 4)]
    for words in ("refuse", "--overwrite", "checkpoints/", ".partial", "exit code 2"):
        assert words in section, words


def test_the_walk_covers_every_script_that_parses_flags():
    """A new main_*.py is walked without being listed; the model files with a command line use training_args."""
    assert len(SCRIPTS) >= 29
    for model_file in ("gptlite.py", "gptlite_rope.py"):
        assert "harness.training_cli(" in (ROOT / model_file).read_text()


# ----------------------------------------------------------------------------------------------------
# A rank started by hand (RANK and WORLD_SIZE set, no torchrun): what env:// lacks, and a peer that never comes.

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(env, *flags, script="main_pipeline_parallel.py", timeout_s=240):
    clean = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    return subprocess.run([sys.executable, script, "--untrained", *flags], cwd=ROOT,
                          env={**clean, "OMP_NUM_THREADS": "1", **env}, capture_output=True, text=True,
                          timeout=timeout_s, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("env, says", [
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR and MASTER_PORT are not"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29533"}, "MASTER_ADDR is not"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"}, "RANK must be one of"),
    ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"}, "must be whole numbers"),
])
def test_a_rank_started_by_hand_without_what_env_needs_is_refused_in_one_line(real_data, env, says):
    result = run_rank(env)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert says in result.stderr.strip().splitlines()[-1]


def test_main_disaggregation_refuses_what_env_lacks_too(real_data):
    """Its own parser (not parse_ranks): the same check, before it reads WORLD_SIZE."""
    result = run_rank({"RANK": "0", "WORLD_SIZE": "two"}, script="main_disaggregation.py")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "MASTER_ADDR and MASTER_PORT are not" in result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_rank_whose_peer_never_comes_waits_timeout_seconds_and_says_for_what(real_data, rank):
    """`RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=P python main_pipeline_parallel.py --timeout 3`
    (and rank 1 with no rank 0): a line says what the rank waits for, and --timeout bounds the wait."""
    port = free_port()
    result = run_rank({"RANK": rank, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                      "--timeout", "3")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"rank {rank} of 2: waiting up to 3 s for the 2 ranks to join at 127.0.0.1:{port}" in lines[0]
    assert lines[-1].startswith(f"error: rank {rank} of 2: waited 3 s at 127.0.0.1:{port}") and "--timeout" in lines[-1]
