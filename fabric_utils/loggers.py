"""Fabric's loggers under the run folder, and the loss and accuracy plots drawn from them."""

from pathlib import Path

from lightning.fabric.loggers import CSVLogger, TensorBoardLogger


def make_loggers(names: str, out_dir: Path) -> list:
    """Fabric's own loggers, writing under the run folder: ``logs/version_N/metrics.csv`` and/or TensorBoard event
    files. Each start of the run (a resume too) gets a new version, so no earlier log is overwritten."""
    make = {"csv": lambda: CSVLogger(out_dir, name="logs"),
            "tensorboard": lambda: TensorBoardLogger(out_dir, name="tensorboard")}
    return [make[name]() for name in names.split(",")]


def plot_metrics(out_dir: Path) -> list[Path]:
    """Loss and accuracy curves (train and validation against step) from every ``metrics.csv`` of the run (a
    resumed run has one per start), as PNG files."""
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
    for name in ("loss", "acc"):
        fig, ax = plt.subplots(figsize=(6, 4))
        for split in ("train", "val"):
            column = f"{split}/{name}"
            if column in metrics:
                points = metrics[["step", column]].dropna()
                ax.plot(points["step"], points[column], marker="o" if split == "val" else None, label=split)
        ax.set(xlabel="optimizer step", ylabel=name, title=f"{name} per step")
        ax.legend()
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
