"""The trackers beside the CSV log, MLflow and W&B: loaded only when ``--logger`` names one."""

import importlib
import json
import os
from pathlib import Path

from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.loggers import MLFlowLogger, WandbLogger  # they import mlflow and wandb only when built

from fabric_utils.errors import UserError

# what each tracker imports, all installed by ``pip install <tracker>``
TRACKER_MODULES = {"mlflow": ("mlflow", "sqlalchemy", "alembic"), "wandb": ("wandb",)}
TRACKER_IDS_FILE = "trackers.json"


def make_trackers(names: set[str], out_dir: Path, project: str, resume: bool) -> list:
    """The trackers in ``names``, on rank 0 only; a ``resume`` continues the tracked runs."""
    trackers = [name for name in TRACKER_MODULES if name in names]
    for name in trackers:
        for module in TRACKER_MODULES[name]:
            try:
                importlib.import_module(module)
            except ImportError as err:
                raise UserError(f"--logger {name} needs the {module} package: pip install {name}") from err
    if rank_zero_only.rank != 0:  # known from the environment before Fabric starts the processes
        return []
    ids_file = out_dir / TRACKER_IDS_FILE
    ids = json.loads(ids_file.read_text()) if resume and ids_file.is_file() else {}
    make = {"mlflow": _mlflow_logger, "wandb": _wandb_logger}
    return [make[name](out_dir, project, ids.get(name)) for name in trackers]


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
    return _FinishingWandbLogger(name=out_dir.name, save_dir=out_dir, project=project, id=run_id,
                                 mode="offline" if offline else None)  # None: wandb's default, or WANDB_MODE


class _FinishingWandbLogger(WandbLogger):
    """Ends its W&B run when finalized, as a second run in the process would reuse it."""

    def finalize(self, status: str) -> None:
        super().finalize(status)
        self.experiment.finish()


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
