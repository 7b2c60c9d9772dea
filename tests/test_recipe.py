"""The training recipe of the cpu preset, pinned: the first training losses of `python gptlite.py --preset
cpu` (iu.train_checkpoint: the seed, the initial weights, the batch sampler, AdamW, the warm-up) equal
recorded values. The pages' figures come from checkpoints this recipe trains (training is deterministic),
so a change to the model, the data pipeline, the sampler or the optimizer that changes training fails here,
and updating these numbers is a deliberate step: retrain with `python reproduce.py --fresh` and commit the
pages with the new checkpoint hashes."""
from dataclasses import replace

import inference_utils as iu
from lib import presets, training

# The first 20 training losses of the cpu preset's recipe (800 steps, batch 32, lr 3e-3, seed 0), recorded
# with torch 2.13.0 on a 2-core AMD EPYC. atol: float32 sums in another order (another CPU, another thread count) move
# them by about 1e-6; another batch, initial weight or learning rate moves them by 1e-3 or more.
RECIPE_LOSSES = [4.205638408660889, 4.146533012390137, 4.049382209777832, 3.942018985748291, 3.844297409057617,
                 3.8044772148132324, 3.7636923789978027, 3.737765312194824, 3.6765847206115723, 3.629554033279419,
                 3.6286137104034424, 3.601450204849243, 3.5507314205169678, 3.5377891063690186, 3.476048231124878,
                 3.4174211025238037, 3.428929328918457, 3.3622586727142334, 3.2741167545318604, 3.2504308223724365]
ATOL = 2e-4


class Enough(Exception):
    pass


def first_training_losses(data, n, path):
    """The first `n` training losses of gptlite.py's recipe for the cpu preset, read where train_steps
    checks each loss (training.check_finite), stopped before anything is saved."""
    losses, check = [], training.check_finite

    def record(loss, step, n_steps, lr, what, hint=None):
        check(loss, step, n_steps, lr, what, hint)
        if what == "training loss":
            losses.append(loss)
            if len(losses) == n:
                raise Enough

    training.check_finite = record
    try:
        iu.train_checkpoint("cpu", data, "cpu", path=path)
    except Enough:
        return losses
    finally:
        training.check_finite = check
    raise AssertionError(f"training ended after {len(losses)} steps, before {n}")


def test_the_cpu_recipe_trains_as_recorded(real_data, tmp_path):
    losses = first_training_losses(real_data, len(RECIPE_LOSSES), tmp_path / "cpu.pt")
    assert not (tmp_path / "cpu.pt").exists()  # stopped before saving
    worst = max(abs(a - b) for a, b in zip(losses, RECIPE_LOSSES))
    assert worst <= ATOL, (f"the cpu preset's training changed (largest loss difference {worst:.2e} over the first "
                           f"{len(losses)} steps): if on purpose, retrain with python reproduce.py --fresh and "
                           f"record the new losses {losses}")


def test_the_pin_sees_a_change_of_the_learning_rate(real_data, tmp_path, monkeypatch):
    """The same check catches a small change of the recipe: the peak learning rate 5% higher."""
    monkeypatch.setitem(presets.PRESETS, "cpu", replace(presets.PRESETS["cpu"], lr=presets.PRESETS["cpu"].lr * 1.05))
    losses = first_training_losses(real_data, len(RECIPE_LOSSES), tmp_path / "cpu.pt")
    assert max(abs(a - b) for a, b in zip(losses, RECIPE_LOSSES)) > 10 * ATOL
