"""lib/recall.py (MQAR, Zoology): the batches against an independent check (every query's target is the
value paired with its key earlier in the sequence, targets only there, the same batch for the same seed),
the accuracy against a hand-made example, clear errors for impossible tasks, and a tiny end-to-end run
of recall_rows (a few training steps, every kind of model, no accuracy asserted)."""
import json
import os

import pytest
import torch

import main_linear_attention as mla

from gptlite_linear import RULES
from lib import recall


def check_sequence(x, y, n_pairs, n_keys):
    """An independent reading of one sequence: pairs first, then each key queried once after them."""
    x, y = x.tolist(), y.tolist()
    keys, values = x[0:2 * n_pairs:2], x[1:2 * n_pairs:2]
    assert len(set(keys)) == n_pairs and all(1 <= k <= n_keys for k in keys)
    assert len(set(values)) == n_pairs and all(n_keys < v <= 2 * n_keys for v in values)
    assert all(t == -100 for t in y[:2 * n_pairs])  # no target inside the pairs
    value_of = dict(zip(keys, values))
    queried = []
    for i in range(2 * n_pairs, len(x)):
        if y[i] != -100:
            assert (i - 2 * n_pairs) % 2 == 0  # queries on every other slot after the pairs
            assert x[i] in value_of and y[i] == value_of[x[i]]  # the value paired with the queried key
            queried.append(x[i])
        else:
            assert x[i] == recall.FILLER  # a position without a target holds the filler
    assert sorted(queried) == sorted(keys)  # every key queried exactly once


@pytest.mark.parametrize("n_pairs, seqlen, n_keys", [(1, 4, 2), (3, 16, 8), (4, 17, 4), (8, 32, 16), (16, 64, 64)])
def test_mqar_batch_answers_every_query_with_its_paired_value(n_pairs, seqlen, n_keys):
    x, y = recall.mqar_batch(32, n_pairs, seqlen, n_keys, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (32, seqlen) and x.dtype == y.dtype == torch.long
    assert x.max() < recall.vocab_size(n_keys)
    for b in range(32):
        check_sequence(x[b], y[b], n_pairs, n_keys)
    assert (y != -100).sum(1).tolist() == [n_pairs] * 32  # targets at the answers only


def test_mqar_batch_is_determined_by_the_seed():
    a = recall.mqar_batch(8, 5, 32, 16, torch.Generator().manual_seed(3))
    b = recall.mqar_batch(8, 5, 32, 16, torch.Generator().manual_seed(3))
    c = recall.mqar_batch(8, 5, 32, 16, torch.Generator().manual_seed(4))
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert not torch.equal(a[0], c[0])


def test_query_gaps_follow_a_power_law():
    """Zoology's power_a = 0.01: a query is far more often right after the pairs than at the end."""
    x, y = recall.mqar_batch(2000, 1, 64, 8, torch.Generator().manual_seed(0))
    gap = ((y != -100).int().argmax(1) - 2) // 2  # [B], 0..30
    assert (gap == 0).float().mean() > 5 * (gap == 30).float().mean() and gap.max() > 10


@pytest.mark.parametrize("n_pairs, seqlen, n_keys, message", [
    (0, 16, 8, "1 <= pairs"), (9, 64, 8, "distinct keys"), (5, 19, 8, "at least 4 * pairs = 20"),
    (1, 8, 1, "at least 2 keys")])
def test_impossible_tasks_are_clear_errors(n_pairs, seqlen, n_keys, message):
    assert message in recall.task_error(n_pairs, seqlen, n_keys)
    with pytest.raises(ValueError, match=message.replace("*", r"\*")):
        recall.mqar_batch(2, n_pairs, seqlen, n_keys)


def test_accuracy_of_a_hand_made_example():
    y = torch.tensor([[-100, 5, -100, 6], [7, -100, -100, -100]])
    logits = torch.zeros(2, 4, 9)
    logits[0, 1, 5] = logits[0, 3, 2] = logits[1, 0, 7] = 1.0  # right, wrong, right
    logits[0, 0, 3] = logits[1, 2, 8] = 5.0  # positions without a target do not count
    assert recall.accuracy(logits, y) == pytest.approx(2 / 3)


def test_kinds_measure_every_rule_of_gptlite_linear():
    names = recall.kinds()
    assert {"softmax", "hybrid", *RULES} == set(names)


def test_recall_rows_end_to_end(tmp_path):
    """A few steps of every kind on a tiny task: one row per kind, accuracies in [0, 1], the KV cache of
    softmax larger than a linear state at this length, the hybrid's in between."""
    pairs = [1, 2, 4]
    rows = recall.recall_rows(pairs, steps=3, lr=1e-3, n_keys=8, seqlen=16, seed=0, batch_size=4)
    by = {r["variant"]: r for r in rows}
    assert set(by) == set(recall.kinds())
    for r in rows:
        assert all(0.0 <= r[f"acc_{p}"] <= 1.0 for p in pairs) and r["train_s"] is not None
    # the cache of one sequence of 16 tokens: softmax 2 layers x (K, V) x 16 tokens x 4 heads x 16 floats;
    # a linear layer's state 4 heads x 16 x 16 floats
    assert recall.MODEL["n_layers"] == 2 and recall.MODEL["n_heads"] == 4 and recall.MODEL["d_head"] == 16
    assert by["softmax"]["state_kb"] == pytest.approx(2 * 2 * 16 * 4 * 16 * 4 / 1024, abs=0.01)
    assert by["delta"]["state_kb"] == pytest.approx(2 * 4 * 16 * 16 * 4 / 1024, abs=0.01)
    assert by["delta"]["state_kb"] < by["hybrid"]["state_kb"] < by["softmax"]["state_kb"]


def test_lr_schedule_warms_up_holds_then_decays_to_zero():
    lrs = [recall.lr_at(step, 100, 1.0, 10) for step in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == lrs[50] == lrs[80] == 1.0
    assert lrs[81] < 1.0 and lrs[99] == pytest.approx(0.05) and all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


@pytest.mark.parametrize("flags, message", [
    (["--pairs", "7"], "--pairs (with --recall-keys 8 and --recall-seqlen 16): 7 pairs and their 7 queries need"),
    (["--pairs", "9", "--recall-seqlen", "64"], "--pairs (with --recall-keys 8 and --recall-seqlen 64): the pairs need distinct keys"),
    (["--recall-seqlen", "12"], "at least 4 * pairs = 16 tokens, got 12"),
    (["--recall-keys", "1"], "argument --recall-keys: must be at least 2"),
    (["--pairs", "0"], "argument --pairs: must be at least 1"),
    (["--recall-batch", "0"], "argument --recall-batch: must be at least 1"),
    (["--recall-steps", "0"], "argument --recall-steps: must be at least 1"),
    (["--recall-lr", "0"], "argument --recall-lr"),
])
def test_bad_recall_flags_are_clear_errors_before_any_work(flags, message, capsys, real_data, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        mla.main(flags + ["--untrained", "--data", os.environ["GPTLITE_DATA"], "--json", str(tmp_path / "r.json")])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written


def test_script_recall_rows_in_the_json(tmp_path, real_data):
    out = tmp_path / "linear.json"
    mla.main(["--untrained", "--data", os.environ["GPTLITE_DATA"], "--contexts", "8", "--batch-size", "1",
              "--n-tokens", "2", "--repeats", "1", "--val-batches", "1", "--pairs", "1", "2", "--recall-steps", "1",
              "--recall-seqlen", "8", "--recall-keys", "4", "--json", str(out)])
    result = json.loads(out.read_text())
    rows = {r["variant"]: r for r in result["recall_rows"]}
    assert set(rows) == set(recall.kinds()) and result["recall_pairs"] == [1, 2]
    assert all({"state_kb", "acc_1", "acc_2"} <= set(r) for r in rows.values())
    assert rows["softmax"]["state_kb"] == pytest.approx(2 * 2 * 8 * 4 * 16 * 4 / 1024)  # KV cache of 8 tokens
