"""Where a run's metrics go: Fabric's CSV log (always: the run's own record, which the plots read), and TensorBoard,
MLflow or W&B beside it (Lightning's loggers, which implement Fabric's interface); loss/acc plots."""

import importlib
import json
import os
from pathlib import Path

from lightning.fabric.loggers import CSVLogger, TensorBoardLogger
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.loggers import MLFlowLogger, WandbLogger  # they import mlflow and wandb only when built

from fabric_utils.errors import UserError

# what each tracker imports, all installed by ``pip install <tracker>`` (MLflow's sqlite store needs the other two)
TRACKER_MODULES = {"mlflow": ("mlflow", "sqlalchemy", "alembic"), "wandb": ("wandb",)}
TRACKER_IDS_FILE = "trackers.json"


def make_loggers(names: str, out_dir: Path, project: str, resume: bool = False) -> list:
    """The CSV logger (a new ``logs/version_N`` per start) and those in ``names``; a ``resume`` continues the tracked
    runs whose ids ``save_tracker_ids`` kept. Trackers exist on rank 0 only: MLflow creates its store when built."""
    names = set(names.split(","))
    trackers = [name for name in TRACKER_MODULES if name in names]
    for name in trackers:  # before any logger exists, so a missing package leaves nothing behind
        for module in TRACKER_MODULES[name]:
            try:
                importlib.import_module(module)
            except ImportError as err:
                raise UserError(f"--logger {name} needs the {module} package: pip install {name}") from err
    loggers = [CSVLogger(out_dir, name="logs")]
    if "tensorboard" in names:
        loggers.append(TensorBoardLogger(out_dir, name="tensorboard"))
    if rank_zero_only.rank == 0:  # known from the launcher's environment before Fabric starts the processes
        ids_file = out_dir / TRACKER_IDS_FILE
        ids = json.loads(ids_file.read_text()) if resume and ids_file.is_file() else {}
        make = {"mlflow": _mlflow_logger, "wandb": _wandb_logger}
        loggers += [make[name](out_dir, project, ids.get(name)) for name in trackers]
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
    """Files in ``<out_dir>/wandb``; offline unless an API key is configured, so a run never stops to ask for one
    (``WANDB_MODE`` decides if set; ``wandb sync`` uploads later)."""
    import wandb

    offline = "WANDB_MODE" not in os.environ and not wandb.login(prompt=False, verify=False)
    return WandbLogger(name=out_dir.name, save_dir=out_dir, project=project, id=run_id,
                       mode="offline" if offline else None)  # None: wandb's default, or WANDB_MODE


def save_tracker_ids(fabric, out_dir: Path) -> None:
    """Starts the tracked runs and keeps their ids in the run folder, not the checkpoint: Fabric takes its loggers when
    built, so a resume needs them (``make_loggers``) before any checkpoint can be read."""
    if fabric.is_global_zero:  # the one process with trackers
        ids = {}
        for logger in fabric.loggers:  # each id starts its run
            if isinstance(logger, MLFlowLogger):
                ids["mlflow"] = logger.run_id
            elif isinstance(logger, WandbLogger):
                ids["wandb"] = logger.experiment.id
        if ids:
            (out_dir / TRACKER_IDS_FILE).write_text(json.dumps(ids))


def finalize_loggers(loggers: list, status: str = "success") -> None:
    """Flushes every logger (metrics.csv, which the plots read) and ends the tracked runs; W&B's here, as Lightning
    leaves it open until the process exits and a second run in it (a notebook, a sweep) would reuse it."""
    for logger in loggers:
        logger.finalize(status)
        if isinstance(logger, WandbLogger):
            logger.experiment.finish()


def read_metrics(out_dir: Path):
    """The run's logged metrics, one row per logged step and kind, from every ``metrics.csv`` of the run (one per
    start) as one pandas DataFrame; None if it logged none."""
    csvs = sorted(out_dir.glob("logs/version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1]))
    if not csvs:
        return None
    import pandas as pd

    frames = []
    for csv in csvs:  # a resumed run logs again from its checkpoint's step: the later log wins from there on
        frame = pd.read_csv(csv)
        frames = [f[f["step"] < frame["step"].min()] for f in frames] + [frame]
    return pd.concat(frames)


def plot_metrics(out_dir: Path) -> list[Path]:
    """One PNG per metric (loss, acc, f1, ...): its train and validation curves against the step, from every
    ``metrics.csv`` of the run (``read_metrics``)."""
    metrics = read_metrics(out_dir)
    if metrics is None:
        return []
    from matplotlib.figure import Figure  # not pyplot: no global backend or figure to close

    written = []
    names = {column.split("/", 1)[1] for column in metrics if column.startswith(("train/", "val/"))}
    for name in ["loss", *sorted(names - {"loss"})]:
        fig = Figure(figsize=(6, 4), layout="tight")
        ax = fig.subplots()
        for split in ("train", "val"):
            column = f"{split}/{name}"
            if column in metrics:
                points = metrics[["step", column]].dropna()
                # markers where points are few: a line alone hides that a short run logged once or twice
                ax.plot(points["step"], points[column], marker="o" if split == "val" or len(points) <= 30 else None,
                        label=split)
        ax.set(xlabel="optimizer step", ylabel=name, title=f"{name} per step")
        ax.legend()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=100)
        written.append(path)
    return written
