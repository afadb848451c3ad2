"""Where a run's metrics go: Fabric's CSV log (always: the plots read it), and TensorBoard, MLflow or W&B beside it."""

from pathlib import Path

from lightning.fabric.loggers import CSVLogger, TensorBoardLogger

def make_loggers(names: str, out_dir: Path, project: str, resume: bool = False) -> list:
    """The CSV logger and those in ``names``, trackers (trackers.py) on rank 0 only; a ``resume`` continues the
    tracked runs."""
    names = set(names.split(","))
    trackers = []
    if names - {"csv", "tensorboard"}:  # before any logger leaves files behind: a missing package stops the run
        from fabric_utils.trackers import make_trackers
        trackers = make_trackers(names, out_dir, project, resume)
    loggers = [CSVLogger(out_dir, name="logs")]
    if "tensorboard" in names:
        loggers.append(TensorBoardLogger(out_dir, name="tensorboard"))
    return loggers + trackers


def start_trackers(fabric, out_dir: Path) -> None:
    """Starts the tracked runs, if any, keeping their ids in ``out_dir`` for a resume (trackers.py)."""
    if any(not isinstance(logger, (CSVLogger, TensorBoardLogger)) for logger in fabric.loggers):
        from fabric_utils.trackers import save_tracker_ids
        save_tracker_ids(fabric, out_dir)


def finalize_loggers(loggers: list, status: str = "success") -> None:
    """Flushes every logger and ends the tracked runs."""
    for logger in loggers:
        logger.finalize(status)


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
