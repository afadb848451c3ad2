"""--best-metric: which validation metric picks checkpoints/best, in which direction, ties to the lower loss."""

import json
import sys

import pytest

from conftest import logged, run
from fabric_utils.checkpoint import best_rule
from fabric_utils.errors import UserError
from task import ClassifierObjective

SINGLE, REGRESSION = ClassifierObjective("single_label", 3), ClassifierObjective("regression", 1)


def test_the_tasks_metric_by_default():
    assert best_rule(SINGLE, None)[:2] == ("acc", "max")
    assert best_rule(REGRESSION, None)[:2] == ("rmse", "min")


@pytest.mark.parametrize("objective, choice, expected", [
    (SINGLE, "loss", ("loss", "min")),
    (SINGLE, "acc", ("acc", "max")),            # torchmetrics' classes know their direction
    (REGRESSION, "pearson:max", ("pearson", "max")),  # torchmetrics leaves a correlation's direction open
    (REGRESSION, "rmse", ("rmse", "min")),
    (SINGLE, "loss:max", ("loss", "max")),      # said outright
])
def test_any_validation_metric_with_its_direction(objective, choice, expected):
    name, direction, is_better = best_rule(objective, choice)
    assert (name, direction) == expected
    assert is_better(2.0, 1.0) == (direction == "max") and is_better(1.0, None)


@pytest.mark.parametrize("choice, message", [
    ("f1", "--best-metric f1: the validation metrics are loss, acc"),
    ("acc:up", "--best-metric acc:up: the direction is max or min, got up"),
    ("pearson", "--best-metric pearson: its direction is not known; pass pearson:max or pearson:min"),
])
def test_an_unknown_metric_or_direction_is_one_line(choice, message):
    with pytest.raises(UserError, match=message):
        best_rule(REGRESSION if choice == "pearson" else SINGLE, choice)


def test_a_tie_goes_to_the_lower_validation_loss():
    """An easy task's accuracy reaches 1.0 early and then only ties: the later, lower-loss model is kept."""
    rule = best_rule(SINGLE, None)
    best = {"acc": 1.0, "loss": 0.35}
    assert rule.improves({"acc": 1.0, "loss": 0.04}, best)
    assert not rule.improves({"acc": 1.0, "loss": 0.5}, best)
    assert not rule.improves({"acc": 0.9, "loss": 0.01}, best)
    assert rule.improves({"acc": 0.5, "loss": 9.0}, {})  # the first validation
    assert best_rule(SINGLE, "loss").improves({"acc": 0.5, "loss": 0.3}, best)


def test_a_run_keeps_the_checkpoint_of_the_metric_asked_for(tmp_path):
    """--best-metric loss over several validations: the tested model is the one of the lowest validation loss, and
    the header says so."""
    out = tmp_path / "run"
    done = run([sys.executable, "train.py", "--demo", "--accelerator", "cpu", "--precision", "32-true",
                "--train-size", "200", "--val-size", "32", "--test-size", "32", "--max-steps", "6", "--val-every", "2",
                "--best-metric", "loss", "--out-dir", str(out)])
    assert "checkpoints/best by validation loss (min)" in done.stdout
    results = json.loads((out / "results.json").read_text())
    losses = logged(out, "val/loss")
    assert sorted(losses) == [2, 4, 6] and results["val_loss"] == pytest.approx(min(losses.values()))
