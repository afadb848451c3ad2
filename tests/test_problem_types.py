"""Multi-label and regression train end to end through train.py: their own loss and metrics in results.json, the
best model picked by the right metric, and an exported config that makes from_pretrained predict the right way."""

import json
import math
import random
import subprocess
import sys

import pandas as pd
import pytest

from conftest import REPO, logged, subprocess_env, train
from data.demo import NEGATIVE, POSITIVE, make_review, prepare_demo
from fabric_utils.errors import UserError

FAST = ["--accelerator", "cpu", "--precision", "32-true", "--num-workers", "0", "--max-length", "64", "--epochs", "2",
        "--lr", "3e-3", "--quiet", "--val-size", "100", "--test-size", "100"]


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    """The demo's tiny BERT as a base model (no classification head), so any head size can be put on it."""
    from transformers import AutoTokenizer, BertModel

    _, demo_model = prepare_demo(tmp_path_factory.mktemp("demo"))
    folder = tmp_path_factory.mktemp("base")
    BertModel.from_pretrained(demo_model).save_pretrained(folder)
    AutoTokenizer.from_pretrained(demo_model).save_pretrained(folder)
    return folder


def reviews(rows: int) -> list[str]:
    rng = random.Random(0)
    return [make_review(rng)[0] for _ in range(rows)]


def tags(text: str) -> list[str]:
    words = set(text.split())
    return [tag for tag, vocabulary in (("praise", POSITIVE), ("complaint", NEGATIVE), ("plot", {"plot"}))
            if words & set(vocabulary)]


def score(text: str) -> float:
    words = text.split()
    return (sum(w in POSITIVE for w in words) - sum(w in NEGATIVE for w in words)) / 2


EXPORT_CHECK = r"""
import json, sys
from transformers import AutoConfig
config = AutoConfig.from_pretrained(sys.argv[1])
print(json.dumps({"problem_type": config.problem_type, "labels": list(config.id2label.values())}))
"""


@pytest.mark.parametrize("problem_type", ["multi_label", "regression"])
def test_problem_type_trains_end_to_end(tmp_path, base_model, problem_type):
    texts = reviews(1200)
    labels = [tags(t) for t in texts] if problem_type == "multi_label" else [score(t) for t in texts]
    pd.DataFrame({"text": texts, "label": labels}).to_parquet(tmp_path / "data.parquet")
    results = train([*FAST, "--dataset", tmp_path / "data.parquet", "--model", base_model], tmp_path / "run")
    assert results["config"]["problem_type"] == problem_type  # auto-detected from the label column
    if problem_type == "multi_label":
        assert results["test_f1"] > 0.8 and 0 <= results["test_exact_match"] <= 1  # chance F1 is about 0.5
    else:
        spread = pd.Series(labels).std()
        assert results["test_rmse"] < 0.95 * spread and results["test_pearson"] > 0.3  # better than the mean
    best = "val/f1" if problem_type == "multi_label" else "val/rmse"
    scores = logged(tmp_path / "run", best).values()
    assert results[best.replace("/", "_")] == pytest.approx(max(scores) if problem_type == "multi_label"
                                                            else min(scores))  # picked by the right metric
    done = subprocess.run([sys.executable, "-c", EXPORT_CHECK, str(tmp_path / "run" / "model")], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=120)
    exported = json.loads(done.stdout.strip().splitlines()[-1])
    expected = {"multi_label": ("multi_label_classification", ["complaint", "plot", "praise"]),
                "regression": ("regression", ["label"])}[problem_type]
    assert (exported["problem_type"], exported["labels"]) == expected


@pytest.mark.parametrize("problem_type", ["single_label", "multi_label", "regression"])
def test_chance_loss_is_what_the_best_constant_output_on_the_training_labels_scores(problem_type):
    """The stuck-at-chance line compares a run's losses with ignoring the inputs: the constant output fitted on the
    training labels, scored by the objective's own loss on the training rows and on others (validation's)."""
    import torch

    from task import ClassifierObjective

    objective, g = ClassifierObjective(problem_type, num_labels=3), torch.Generator().manual_seed(0)
    shares = torch.tensor([0.6, 0.3, 0.1])

    def draw(rows: int) -> torch.Tensor:
        if problem_type == "single_label":
            return torch.multinomial(shares, rows, replacement=True, generator=g)
        if problem_type == "multi_label":
            return (torch.rand(rows, 3, generator=g) < shares).float()
        return torch.rand(rows, generator=g)

    def constant(fitted_on: torch.Tensor) -> torch.Tensor:  # the output for every row
        if problem_type == "single_label":
            return (torch.bincount(fitted_on, minlength=3) / len(fitted_on)).log()
        return fitted_on.float().mean(dim=0).logit() if problem_type == "multi_label" else fitted_on.mean()

    train_labels, val_labels = draw(400), draw(120)
    output = constant(train_labels)
    for labels in (train_labels, val_labels):
        scored = objective.loss(output.expand(len(labels), *output.shape), {"labels": labels}).item()
        assert objective.chance_loss(labels, fitted_on=train_labels) == pytest.approx(scored, rel=1e-5)
    nudged = output + 0.05 * torch.linspace(1, -1, output.numel()).reshape(output.shape)  # another constant: worse
    assert objective.loss(nudged.expand(len(train_labels), *output.shape), {"labels": train_labels}).item() > \
        objective.chance_loss(train_labels, fitted_on=train_labels)


def test_the_predictions_files_name_each_label_and_score_each_class():
    """test_predictions.csv and predict.py's predictions.csv: the label's name beside its id, a probability per class."""
    import torch

    from task import ClassifierObjective

    single = ClassifierObjective("single_label", 3, label_names=["business", "sport", "tech"])
    logits = torch.tensor([[0.0, 2.0, 0.0], [3.0, 0.0, 1.0]])
    columns = {"row": torch.arange(2), **single.predict(logits, {"labels": torch.tensor([1, 2])})}
    table = single.table(columns)
    assert list(table)[:6] == ["row", "label", "label_name", "predicted", "predicted_name", "score"]
    assert table["label_name"] == ["sport", "tech"] and table["predicted_name"] == ["sport", "business"]
    probabilities = logits.softmax(dim=-1)
    assert table["score_tech"] == pytest.approx(probabilities[:, 2].tolist())
    assert table["score"] == pytest.approx(probabilities.max(dim=-1).values.tolist())

    multi = ClassifierObjective("multi_label", 3, label_names=["complaint", "plot", "praise"])
    table = multi.table(multi.predict(torch.tensor([[2.0, -2.0, 3.0]]), {"labels": torch.tensor([[1.0, 1.0, 0.0]])}))
    assert table["label_name"] == ["complaint,plot"] and table["predicted_name"] == ["complaint,praise"]
    assert table["score_plot"] == pytest.approx([torch.tensor(-2.0).sigmoid().item()])

    regression = ClassifierObjective("regression", 1, label_names=["label"])
    table = regression.table(regression.predict(torch.tensor([0.5]), {"labels": torch.tensor([0.25])}))
    assert table == {"label": [0.25], "predicted": [0.5]}  # a value has no name


def test_balanced_class_weights_count_each_class_as_much_and_chance_moves_with_them():
    import torch

    from task import ClassifierObjective, TaskData, class_weights

    labels = [0] * 6 + [1] * 2  # 3:1
    data = TaskData({"train": {"labels": labels}}, ["common", "rare"], "single_label", None, None, [])
    weights = class_weights("balanced", data)
    assert weights == pytest.approx((8 / (2 * 6), 8 / (2 * 2))) and data.notes == [
        "--class-weights balanced: common 0.667, rare 2"]
    assert class_weights("none", data) is None
    weighted = ClassifierObjective("single_label", 2, class_weights=weights)
    logits, batch = torch.tensor([[2.0, 0.0], [0.0, 1.0]]), {"labels": torch.tensor([0, 1])}
    per_row = torch.nn.functional.cross_entropy(logits, batch["labels"], reduction="none")
    assert weighted.loss(logits, batch).item() == pytest.approx(
        ((per_row * torch.tensor([2 / 3, 2.0])).sum() / (2 / 3 + 2.0)).item())
    # the best constant output under the weights: the classes' shares times their weights (here even), log 2
    assert weighted.chance_loss(torch.tensor(labels), fitted_on=torch.tensor(labels)) == pytest.approx(math.log(2))
    multi = TaskData({"train": {"labels": [[1, 0]]}}, ["a", "b"], "multi_label", None, None, [])
    with pytest.raises(UserError, match="--class-weights balanced is for single_label tasks; this one is multi_label"):
        class_weights("balanced", multi)
