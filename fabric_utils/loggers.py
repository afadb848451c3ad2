"""Where a run's metrics go: Fabric's CSV log (always), and TensorBoard, MLflow or W&B beside it; loss/acc plots.

The CSV log is the run's own record: the plots are drawn from it and a resumed run appends a new version to it, so
it is kept whatever else ``--logger`` names. MLflow and W&B go through Lightning's own loggers, which implement
Fabric's logger interface (``fabric.log_dict`` calls their ``log_metrics``).
"""

import importlib
import json
import os
from pathlib import Path

from lightning.fabric.loggers import CSVLogger, TensorBoardLogger
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.loggers import MLFlowLogger, WandbLogger  # they import mlflow and wandb only when built

from fabric_utils.errors import UserError

# what each tracker imports, and the command that installs it (MLflow's local sqlite store needs SQLAlchemy, alembic)
TRACKER_PACKAGES = {"mlflow": (("mlflow", "sqlalchemy", "alembic"), "pip install mlflow"),
                    "wandb": (("wandb",), "pip install wandb")}
TRACKER_IDS_FILE = "trackers.json"


def make_loggers(names: str, out_dir: Path, project: str, resume_ids: dict | None = None) -> list:
    """Fabric's CSV logger (``logs/version_N/metrics.csv``; each start of the run, a resume too, gets a new version)
    and the others named in ``names``. ``resume_ids`` (from ``tracker_ids``) continue the same MLflow and W&B runs.

    Trackers are made only on rank 0, the one process that logs: MLflow opens (and creates) its store as soon as its
    logger is built, which every process of the job at once would race for."""
    names = set(names.split(","))
    trackers = [name for name in TRACKER_PACKAGES if name in names]
    for name in trackers:  # before any logger exists, so a missing package leaves nothing behind
        modules, install = TRACKER_PACKAGES[name]
        for module in modules:
            try:
                importlib.import_module(module)
            except ImportError as err:
                raise UserError(f"--logger {name} needs the {module} package: {install}") from err
    resume_ids = resume_ids or {}
    loggers = [CSVLogger(out_dir, name="logs")]
    if "tensorboard" in names:
        loggers.append(TensorBoardLogger(out_dir, name="tensorboard"))
    if rank_zero_only.rank == 0:  # known from the launcher's environment before Fabric starts the processes
        if "mlflow" in trackers:
            loggers.append(_mlflow_logger(out_dir, project, resume_ids.get("mlflow")))
        if "wandb" in trackers:
            loggers.append(_wandb_logger(out_dir, project, resume_ids.get("wandb")))
    return loggers


def _mlflow_logger(out_dir: Path, project: str, run_id: str | None):
    """``MLFLOW_TRACKING_URI`` if set (a server or a shared store), else a SQLite store in the run folder: MLflow 3
    refuses its old ``file:`` store unless told to, and SQLite needs no server."""
    tracking_uri = os.environ.get("MLFLOW_TRACKING_URI")
    artifact_location = None  # a server chooses its own
    if not tracking_uri:
        out_dir.mkdir(parents=True, exist_ok=True)  # a default run folder is made only later, as the job agrees on it
        tracking_uri = f"sqlite:///{(out_dir / 'mlflow.db').resolve()}"
        artifact_location = (out_dir / "mlartifacts").resolve().as_uri()  # else ./mlruns of the working folder
    return MLFlowLogger(experiment_name=project, run_name=out_dir.name, tracking_uri=tracking_uri,
                        artifact_location=artifact_location, run_id=run_id)


def _wandb_logger(out_dir: Path, project: str, run_id: str | None):
    """W&B's files go to ``<out_dir>/wandb``. It runs offline unless an API key is configured (``wandb login`` or
    ``WANDB_API_KEY``), so a run never stops to ask for one; ``WANDB_MODE`` decides if set. ``wandb sync`` uploads
    an offline run later."""
    import wandb

    mode = None  # wandb's default, or WANDB_MODE
    if "WANDB_MODE" not in os.environ and not wandb.login(prompt=False, verify=False):
        mode = "offline"
    return WandbLogger(name=out_dir.name, save_dir=out_dir, project=project, id=run_id, mode=mode)


def tracker_ids(loggers: list) -> dict:
    """The run id of each tracker, as ``{"mlflow": ..., "wandb": ...}``, for ``make_loggers(resume_ids=...)``. Starts
    the tracked runs if nothing was logged yet. Rank 0 only: elsewhere there are no trackers."""
    ids = {}
    for logger in loggers:
        if isinstance(logger, MLFlowLogger):
            ids["mlflow"] = logger.run_id
        elif isinstance(logger, WandbLogger):
            ids["wandb"] = logger.experiment.id
    return ids


def save_tracker_ids(fabric, out_dir: Path) -> None:
    """Starts the tracked runs and keeps their ids in the run folder. Not in the checkpoint: Fabric takes its loggers
    when it is built, so a resume needs the ids (``saved_tracker_ids``) before any checkpoint can be read."""
    if fabric.is_global_zero:
        ids = tracker_ids(fabric.loggers)
        if ids:
            (out_dir / TRACKER_IDS_FILE).write_text(json.dumps(ids))


def saved_tracker_ids(out_dir: Path) -> dict:
    path = out_dir / TRACKER_IDS_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def finalize_loggers(loggers: list, status: str = "success") -> None:
    """Flushes every logger (metrics.csv, which the plots read; the MLflow run is marked finished). Lightning's
    ``WandbLogger.finalize`` leaves the W&B run open until the process exits: finish it here, so a second run in the
    same process (a notebook, a sweep) starts a new one instead of reusing it."""
    for logger in loggers:
        logger.finalize(status)
        if isinstance(logger, WandbLogger):
            logger.experiment.finish()


def plot_metrics(out_dir: Path) -> list[Path]:
    """One PNG per metric (loss, acc, f1, ...): its train and validation curves against the step, from every
    ``metrics.csv`` of the run (a resumed run has one per start)."""
    csvs = sorted(out_dir.glob("logs/version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1]))
    if not csvs:
        return []
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    frames = []
    for csv in csvs:  # a resumed run logs again from its checkpoint's step: the later log wins from there on
        frame = pd.read_csv(csv)
        frames = [f[f["step"] < frame["step"].min()] for f in frames] + [frame]
    metrics = pd.concat(frames)
    written = []
    names = {column.split("/", 1)[1] for column in metrics if column.startswith(("train/", "val/"))}
    for name in ["loss", *sorted(names - {"loss"})]:
        fig, ax = plt.subplots(figsize=(6, 4))
        for split in ("train", "val"):
            column = f"{split}/{name}"
            if column in metrics:
                points = metrics[["step", column]].dropna()
                # markers where points are few: a line alone hides that a short run logged once or twice
                ax.plot(points["step"], points[column], marker="o" if split == "val" or len(points) <= 30 else None,
                        label=split)
        ax.set(xlabel="optimizer step", ylabel=name, title=f"{name} per step")
        ax.legend()
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
