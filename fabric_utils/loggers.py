"""Where a run's metrics go: Fabric's CSV log (always: the plots read it), and TensorBoard, MLflow or W&B beside it."""

import importlib
import json
import os
from pathlib import Path

from lightning.fabric.loggers import CSVLogger, TensorBoardLogger
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.loggers import MLFlowLogger, WandbLogger  # they import mlflow and wandb only when built

from fabric_utils.errors import UserError

# what each tracker imports, all installed by ``pip install <tracker>``
TRACKER_MODULES = {"mlflow": ("mlflow", "sqlalchemy", "alembic"), "wandb": ("wandb",)}
TRACKER_IDS_FILE = "trackers.json"


def make_loggers(names: str, out_dir: Path, project: str, resume: bool = False) -> list:
    """The CSV logger and those in ``names``, trackers on rank 0 only; a ``resume`` continues the tracked runs."""
    names = set(names.split(","))
    trackers = [name for name in TRACKER_MODULES if name in names]
    for name in trackers:  # before any logger leaves files behind
        for module in TRACKER_MODULES[name]:
            try:
                importlib.import_module(module)
            except ImportError as err:
                raise UserError(f"--logger {name} needs the {module} package: pip install {name}") from err
    loggers = [CSVLogger(out_dir, name="logs")]
    if "tensorboard" in names:
        loggers.append(TensorBoardLogger(out_dir, name="tensorboard"))
    if rank_zero_only.rank == 0:  # known from the environment before Fabric starts the processes
        ids_file = out_dir / TRACKER_IDS_FILE
        ids = json.loads(ids_file.read_text()) if resume and ids_file.is_file() else {}
        make = {"mlflow": _mlflow_logger, "wandb": _wandb_logger}
        loggers += [make[name](out_dir, project, ids.get(name)) for name in trackers]
    return loggers


def _mlflow_logger(out_dir: Path, project: str, run_id: str | None):
    """``MLFLOW_TRACKING_URI`` if set, else a SQLite store in the run folder (MLflow 3 refuses its ``file:`` store)."""
    tracking_uri = os.environ.get("MLFLOW_TRACKING_URI")
    artifact_location = None  # a server chooses its own
    if not tracking_uri:
        out_dir.mkdir(parents=True, exist_ok=True)
        tracking_uri = f"sqlite:///{(out_dir / 'mlflow.db').resolve()}"
        artifact_location = (out_dir / "mlartifacts").resolve().as_uri()  # else ./mlruns of the working folder
    return MLFlowLogger(experiment_name=project, run_name=out_dir.name, tracking_uri=tracking_uri,
                        artifact_location=artifact_location, run_id=run_id)


def _wandb_logger(out_dir: Path, project: str, run_id: str | None):
    """Offline unless an API key is configured (or ``WANDB_MODE`` says), so a run never stops to ask for one."""
    import wandb

    offline = "WANDB_MODE" not in os.environ and not wandb.login(prompt=False, verify=False)
    return WandbLogger(name=out_dir.name, save_dir=out_dir, project=project, id=run_id,
                       mode="offline" if offline else None)  # None: wandb's default, or WANDB_MODE


def save_tracker_ids(fabric, out_dir: Path) -> None:
    """Starts the tracked runs and keeps their ids in the run folder: a resume needs them before Fabric exists."""
    if fabric.is_global_zero:
        ids = {}
        for logger in fabric.loggers:
            if isinstance(logger, MLFlowLogger):
                ids["mlflow"] = logger.run_id
            elif isinstance(logger, WandbLogger):
                ids["wandb"] = logger.experiment.id
        if ids:
            (out_dir / TRACKER_IDS_FILE).write_text(json.dumps(ids))


def finalize_loggers(loggers: list, status: str = "success") -> None:
    """Flushes every logger and ends the tracked runs; W&B's too, which a second run in the process would reuse."""
    for logger in loggers:
        logger.finalize(status)
        if isinstance(logger, WandbLogger):
            logger.experiment.finish()


def read_metrics(out_dir: Path):
    """Every start's ``metrics.csv`` as one pandas DataFrame, a resumed start's rows replacing those it repeats."""
    csvs = sorted(out_dir.glob("logs/version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1]))
    if not csvs:
        return None
    import pandas as pd

    frames = []
    for csv in csvs:
        frame = pd.read_csv(csv)
        frames = [f[f["step"] < frame["step"].min()] for f in frames] + [frame]
    return pd.concat(frames)


def plot_metrics(out_dir: Path) -> list[Path]:
    """One PNG per metric: its train and validation curves against the step."""
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
                # markers where points are few: a line alone hides a single point
                ax.plot(points["step"], points[column], marker="o" if split == "val" or len(points) <= 30 else None,
                        label=split)
        ax.set(xlabel="optimizer step", ylabel=name, title=f"{name} per step")
        ax.legend()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=100)
        written.append(path)
    return written
