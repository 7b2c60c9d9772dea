import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import inference_utils  # noqa: E402
from gptlite import GPTlite  # noqa: E402
from gptlite_kvcache import GPTlite_KVCache  # noqa: E402
from lib import corpus, training  # noqa: E402

# A tiny GPTlite with n_heads * d_head (24) != d_model (32), like the post's preset (384 against 512).
TINY = dict(vocab_size=65, d_model=32, n_heads=3, d_head=8, n_layers=2, dropout_p=0.0, seqlen=16)


def random_gptlite(seed=0):
    """A TINY GPTlite in eval mode with every parameter drawn from N(0, 0.5): logits of a few units and
    peaked attention, so a wrong mask or position shows far above the float32 tolerance (GPTlite's
    N(0, 0.02) init gives near-uniform attention)."""
    torch.manual_seed(seed)
    model = GPTlite(**TINY).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model


def randomized(model, seed=0):
    """`model`'s parameters drawn from N(0, 0.5) after seeding (as random_gptlite's), in eval mode."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model.eval()


@pytest.fixture
def tiny_models():
    """The same random weights (random_gptlite) in GPTlite and GPTlite_KVCache, in eval mode."""
    base = random_gptlite()
    cached = GPTlite_KVCache(**TINY).eval()
    cached.load_state_dict(base.state_dict())
    return base, cached


@pytest.fixture(scope="session")
def real_data():
    """Tiny Shakespeare from $GPTLITE_DATA (CI sets it); skipped, with the reason, when it is not there."""
    path = os.environ.get("GPTLITE_DATA")
    if not path or not Path(path).is_file():
        pytest.skip("GPTLITE_DATA does not point at tinyshakespeare.txt (CI sets it; tests never download)")
    return corpus.load_data(path)


@pytest.fixture
def one_batch_validation(monkeypatch):
    """Validation on one batch instead of 20 (10 inside train_steps): a script's logic, not its precision."""
    validation_loss = training.validation_loss
    monkeypatch.setattr(training, "validation_loss", lambda model, data, n_batches=20, **kw: validation_loss(
        model, data, n_batches=1, **kw))


@pytest.fixture
def unmeasurable_tpot(monkeypatch):
    """compare_generation as it is, but `variant`'s TPOT None, as timing noise makes it with few tokens
    and one repeat: the scripts' handling of None is then exercised on every run, not by chance."""
    def patch(variant):
        compare_generation = inference_utils.compare_generation

        def noisy(variants, *args, **kwargs):
            results = compare_generation(variants, *args, **kwargs)
            if variant in results:  # a script's other timings (e.g. its gptlite-shape rows) as they are
                results[variant]["tpot_ms"] = None
            return results
        monkeypatch.setattr(inference_utils, "compare_generation", noisy)
    return patch


def as_torchrun_rank_0(monkeypatch, world):
    """This process's environment as torchrun sets it for rank 0 of `world` (nothing is listening)."""
    for name, value in (("RANK", 0), ("WORLD_SIZE", world), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", 29500)):
        monkeypatch.setenv(name, str(value))


def renders_on_its_page(run_name, result):
    """`result` (a script's JSON, as its --json wrote it) renders as reproduce.py renders run `run_name` of
    RUNS: its headline (the one-glance row, worded by the script) and its table block with every extra table.
    Each run of reproduce.RUNS has an end-to-end test that calls this (tests/test_reproduce.py checks)."""
    import reproduce
    run = next(run for run in reproduce.RUNS if run.name == run_name)
    result = dict(result, reproduce={"command": f"python {run.script}", "machine": "test", "date": "today",
                                     "seconds": 1, "load_average": 0.0})
    headline = result["headline"]
    assert set(headline) == {"technique", "figure"} and all(isinstance(v, str) and v for v in headline.values())
    row = reproduce.summary_row(run, result)
    assert row["technique"] == headline["technique"] and row["figure"] == headline["figure"]
    block = reproduce.table_block(result)
    assert block.count("\n| ") >= 2 + len(result["rows"])  # header, rule and one line per row, at least
    for table in result.get("tables") or []:
        assert table["title"] in block
