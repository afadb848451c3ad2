"""Experiment trackers: MLflow and W&B record a run that their own clients read back, a resume continues the same
tracked runs, the plots come from the CSV log whatever --logger says, and a missing package is a one-line error."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.fabric import Fabric

from conftest import SMALL_DEMO, train
from fabric_utils.errors import UserError
from fabric_utils.loggers import finalize_loggers, make_loggers, plot_metrics


def wandb_history(run_dir: Path) -> list[dict]:
    """The rows a W&B offline run logged, read from its .wandb file by W&B's own reader (``wandb leet inspect``)."""
    records = subprocess.run([str(Path(sys.executable).with_name("wandb")), "leet", "inspect", "--json", str(run_dir)],
                             capture_output=True, text=True, check=True, stdin=subprocess.DEVNULL).stdout
    return [r["history"]["item"] for r in map(json.loads, records.splitlines()) if r["type"] == "history"]


def logged_steps(rows: list[dict], key: str) -> list[int]:
    return [row["trainer/global_step"] for row in rows if key in row]


def test_mlflow_and_wandb_record_the_run_and_a_resume_continues_the_same_tracked_runs(tmp_path, monkeypatch):
    # no tracking server, no W&B key, login or settings from this machine: MLflow's store is the run folder's and
    # W&B has to choose offline by itself
    for name in ("MLFLOW_TRACKING_URI", "WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    out_dir = tmp_path / "run"
    flags = [*SMALL_DEMO, "--logger", "mlflow,wandb", "--tracker-project", "trackers-test", "--max-steps", "4",
             "--save-every", "2", "--log-every", "2", "--val-every", "2", "--keep-best-checkpoint"]
    train(flags, out_dir)
    # the run cut back to its step-2 checkpoint, as a crash there would leave it (best kept, as before the finish),
    # then resumed: steps 3 and 4 again
    for later in ("checkpoints/step-000004", "model"):
        shutil.rmtree(out_dir / later)
    (out_dir / "results.json").unlink()
    train([*flags, "--resume", "auto"], out_dir)

    from mlflow import MlflowClient
    client = MlflowClient(f"sqlite:///{out_dir / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("trackers-test").experiment_id])
    assert len(runs) == 1, "the resume started a second MLflow run"
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == out_dir.name
    for key in ("train/loss", "val/acc"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == [2, 4, 4], key

    wandb_runs = sorted((out_dir / "wandb").glob("offline-run-*"))  # one offline folder per start of the run
    assert len(wandb_runs) == 2
    assert len({path.name.rsplit("-", 1)[1] for path in wandb_runs}) == 1, "the resume started another W&B run"
    first, resumed = map(wandb_history, wandb_runs)
    for key in ("train/loss", "val/acc"):
        assert logged_steps(first, key) == [2, 4] and logged_steps(resumed, key) == [4], key
    assert json.loads((out_dir / "trackers.json").read_text()) == {"mlflow": run.info.run_id,
                                                                   "wandb": wandb_runs[0].name.rsplit("-", 1)[1]}


def test_plots_come_from_the_csv_log_whatever_the_logger(tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1, loggers=make_loggers("tensorboard", tmp_path, "p"))
    for step in (1, 2):
        fabric.log_dict({"train/loss": 1 / step, "train/acc": step / 3, "val/loss": 1 / step, "val/acc": 0.5},
                        step=step)
    finalize_loggers(fabric.loggers)
    assert list((tmp_path / "tensorboard").rglob("events.out.tfevents.*"))
    assert [path.name for path in plot_metrics(tmp_path)] == ["loss.png", "acc.png"]


@pytest.mark.parametrize("package", ["mlflow", "wandb"])
def test_a_missing_tracker_package_is_a_one_line_error_before_anything_is_written(tmp_path, monkeypatch, package):
    monkeypatch.setitem(sys.modules, package, None)  # makes `import mlflow` / `import wandb` raise ImportError
    with pytest.raises(UserError, match=f"pip install {package}$") as err:
        make_loggers(f"csv,{package}", tmp_path, "p")
    assert "\n" not in str(err.value)
    assert not any(tmp_path.iterdir())
