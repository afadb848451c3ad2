"""A hyperparameter sweep (Optuna) whose every trial is a whole run, started by any launch command:

    .venv/bin/python scripts/sweep.py --study-dir runs/sweep --trials 16 --parallel 2 \\
        --param lr=1e-5:1e-3:log --param warmup=0:0.2 -- .venv/bin/python train.py --devices 2 --val-every 50 ...

Each trial runs the command after ``--`` with its flags (``--lr ... --out-dir STUDY/trial-N --resume auto``), so every
rank of a multi-process trial reads the same values: ``python train.py --devices 2``, ``fabric run``, ``srun``,
torchrun or scripts/ray_train.py. The study lives in STUDY/study.db (SQLite), held by one sweep at a time: the same
command continues a killed sweep, rerunning its interrupted trials in their own folders from their checkpoints.
Trials are pruned on the validation metric each writes to its metrics.csv, by killing their process group. Rerun a
trial with ``--config STUDY/trial-N/config.yaml``; STUDY/trials.csv and STUDY/trials.png hold the table and the curves.
"""

import argparse
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # fabric_utils, when run as scripts/sweep.py

from fabric_utils.errors import UserError, exit_on_user_error  # noqa: E402
from fabric_utils.run_folder import LOCK_FILE  # noqa: E402

POLL_S = 1.0  # how often a running trial's metrics.csv is read
RETRY_WAIT_S = 300  # the most an interrupted trial's rerun waits for the killed sweep's ranks to let go of its folder
# a trial's command is exec'd by this, which asks the kernel to SIGKILL it when the sweep's thread that started it dies
# (kill -9 of the sweep too); its other processes end as any run's do when its first process is gone
DIE_WITH_SWEEP = ("import ctypes, os, sys; ctypes.CDLL(None).prctl(1, 9)\n"  # PR_SET_PDEATHSIG, SIGKILL
                  "if os.getppid() != int(sys.argv[1]): sys.exit(1)\n"  # the sweep died before prctl
                  "os.execvp(sys.argv[2], sys.argv[2:])")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], usage="%(prog)s [options] -- COMMAND ...")
    parser.add_argument("--study-dir", required=True, help="the study's folder: its database, trial folders, logs")
    parser.add_argument("--trials", type=int, required=True, help="trials to finish (completed or pruned)")
    parser.add_argument("--param", action="append", required=True, metavar="NAME=SPACE",
                        help="a train.py flag and its range: LOW:HIGH (float), LOW:HIGH:log, LOW:HIGH:int, or A,B,C")
    parser.add_argument("--metric", default="loss", help="the validation metric (val/NAME in metrics.csv)")
    parser.add_argument("--direction", choices=("minimize", "maximize"), default="minimize")
    parser.add_argument("--parallel", type=int, help="trials at once (default: one per --gpus-per-trial, else 1)")
    parser.add_argument("--gpus", help="GPU indices the trials share, e.g. 0,1,2,3 (each gets CUDA_VISIBLE_DEVICES)")
    parser.add_argument("--gpus-per-trial", type=int, default=1)
    parser.add_argument("--startup-trials", type=int, default=5, help="finished trials before pruning starts")
    parser.add_argument("--prune-from-step", type=int, default=0,
                        help="no pruning before this step: early validation losses barely differ")
    parser.add_argument("--seed", type=int, default=0, help="the sampler's, offset by the trials the study holds, so "
                                                             "a continued sweep draws new values")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the launch command without trial flags")
    args = parser.parse_args(argv)
    args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not args.command:
        parser.error("give the launch command after --, e.g. -- .venv/bin/python train.py --devices 2")
    args.space = dict(parse_param(text) for text in args.param)
    if args.gpus:
        gpus = args.gpus.split(",")
        args.slots = [",".join(gpus[i:i + args.gpus_per_trial])
                      for i in range(0, len(gpus) - args.gpus_per_trial + 1, args.gpus_per_trial)]
        if not args.slots:
            parser.error(f"--gpus {args.gpus} holds fewer than --gpus-per-trial {args.gpus_per_trial} GPUs")
        args.slots = args.slots[:args.parallel or len(args.slots)]
    else:
        args.slots = [None] * (args.parallel or 1)
    return args


def parse_param(text: str):
    """``NAME=SPACE`` as (flag name, a function of an Optuna trial that draws its value)."""
    name, sep, space = text.partition("=")
    parts = space.split(":")
    if not sep or not name:
        raise UserError(f"--param {text}: write NAME=LOW:HIGH, NAME=LOW:HIGH:log, NAME=LOW:HIGH:int or NAME=A,B,C")
    if len(parts) == 1:
        choices = parts[0].split(",")
        return name, lambda trial: trial.suggest_categorical(name, choices)
    try:
        if len(parts) == 3 and parts[2] == "int":
            low, high = int(parts[0]), int(parts[1])
            return name, lambda trial: trial.suggest_int(name, low, high)
        low, high = float(parts[0]), float(parts[1])
    except ValueError:
        raise UserError(f"--param {text}: LOW and HIGH must be numbers") from None
    if len(parts) > 3 or len(parts) == 3 and parts[2] != "log" or not low < high:
        raise UserError(f"--param {text}: write NAME=LOW:HIGH with LOW < HIGH, and :log or :int after it")
    return name, lambda trial: trial.suggest_float(name, low, high, log=len(parts) == 3)


class Trials:
    """The trials' processes: each in a process group of its own, killed as a group (pruned, or the sweep stopped)."""

    def __init__(self):
        self.running, self.lock = set(), threading.Lock()

    def start(self, command: list, env: dict, log: Path) -> subprocess.Popen:
        with open(log, "a") as output, self.lock:
            proc = subprocess.Popen([sys.executable, "-c", DIE_WITH_SWEEP, str(os.getpid()), *command], env=env,
                                    stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
            self.running.add(proc)
        return proc

    def kill(self, proc: subprocess.Popen) -> None:
        """SIGKILL to its group, then waits until the group is empty (the ranks it started)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 60  # a process stuck in the kernel (a dead network filesystem) outlives SIGKILL
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        self.done(proc)

    def done(self, proc: subprocess.Popen) -> None:
        with self.lock:
            self.running.discard(proc)

    def kill_all(self) -> None:
        for proc in list(self.running):
            self.kill(proc)


def validation_values(folder: Path, column: str) -> dict[int, float]:
    """step -> the validation metric in the trial's metrics.csv files (a resumed trial's too); none while unwritten."""
    from fabric_utils.loggers import read_metrics

    try:
        metrics = read_metrics(folder)
    except (OSError, ValueError, KeyError):  # a file being written: read again at the next poll
        return {}
    if metrics is None or column not in metrics:
        return {}
    rows = metrics[["step", column]].dropna()
    return dict(zip(rows["step"].astype(int), rows[column].astype(float)))


class TrialFailed(Exception):
    """The trial's command failed: the trial is FAIL, the sweep goes on."""


def make_objective(args, study_dir: Path, trials: Trials, slots: queue.Queue):
    import filelock
    import optuna
    from lightning.fabric.plugins.environments.lightning import find_free_network_port
    from optuna.storages import RetryHeartbeatStaleTrialCallback

    def objective(trial: optuna.Trial) -> float:
        values = {name: draw(trial) for name, draw in args.space.items()}
        frozen = trial.study.get_trials(deepcopy=False)[trial.number]
        retried = RetryHeartbeatStaleTrialCallback.retry_history(frozen)
        first = (retried or [trial.number])[0]  # a rerun keeps its folder
        folder = study_dir / f"trial-{first:04d}"
        trial.set_user_attr("folder", str(folder))
        flags = [word for name, value in values.items() for word in (f"--{name.replace('_', '-')}", str(value))]
        command = [*args.command, *flags, "--out-dir", str(folder), "--resume", "auto"]
        if retried and folder.is_dir():  # the killed sweep's ranks may hold its folder a moment longer
            try:
                with filelock.FileLock(folder / LOCK_FILE, timeout=RETRY_WAIT_S, fallback_to_soft=False):
                    pass
            except filelock.Timeout:
                raise TrialFailed(f"trial {trial.number}: {folder} is still held by a run after {RETRY_WAIT_S} s; "
                                  f"end it, then run the sweep again") from None
        slot = slots.get()
        port = str(find_free_network_port())  # trials at once: a port each (python and fabric run's, torchrun's)
        env = {**os.environ, "MASTER_PORT": port, "PET_MASTER_PORT": port}
        if slot is not None:
            env["CUDA_VISIBLE_DEVICES"] = slot
        log = study_dir / f"trial-{first:04d}.log"
        try:
            print(f"trial {trial.number}: {' '.join(flags)} in {folder}", flush=True)
            proc = trials.start(command, env, log)
            reported = set()
            while True:
                running = proc.poll() is None  # then one more read: the values written at the end
                for step, value in sorted(validation_values(folder, f"val/{args.metric}").items()):
                    if step not in reported:
                        reported.add(step)
                        trial.report(value, step)
                        if running and trial.should_prune():
                            trials.kill(proc)
                            print(f"trial {trial.number}: pruned at step {step} (val {args.metric} {value:.4f})",
                                  flush=True)
                            raise optuna.TrialPruned()
                if not running:
                    break
                time.sleep(POLL_S)
            trials.done(proc)
            if proc.returncode != 0:
                raise TrialFailed(f"trial {trial.number} exited {proc.returncode}: see {log}")
            results = folder / "results.json"
            value = json.loads(results.read_text()).get(f"val_{args.metric}") if results.is_file() else None
            if value is None:
                raise TrialFailed(f"trial {trial.number} wrote no val_{args.metric} in {results}: see {log}")
            return value
        finally:
            slots.put(slot)

    return objective


@exit_on_user_error
def main(argv=None) -> None:
    args = parse_args(argv)
    import filelock
    import optuna

    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # retries: stable enough
    from optuna.storages import RetryHeartbeatStaleTrialCallback
    from optuna.study import MaxTrialsCallback
    from optuna.trial import TrialState

    study_dir = Path(args.study_dir).resolve()  # the trials' --out-dir, wherever their launcher runs them
    study_dir.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(study_dir / ".lock")
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        raise UserError(f"another sweep is running in --study-dir {study_dir}; let it finish, or pass another "
                        f"--study-dir") from None
    storage = study_storage(study_dir / "study.db")
    study = optuna.create_study(study_name="sweep", storage=storage, direction=args.direction, load_if_exists=True,
                                pruner=optuna.pruners.MedianPruner(n_startup_trials=args.startup_trials,
                                                                   n_warmup_steps=args.prune_from_step))
    held = study.trials
    study.sampler = optuna.samplers.TPESampler(seed=args.seed + len(held))  # a continued sweep draws anew
    # this sweep holds the lock, so a running trial is a killed sweep's: it fails and reruns (at most 3 times), in its
    # folder from its checkpoint; no heartbeat, whose lateness under load would fail a live trial
    for trial in held:
        if trial.state == TrialState.RUNNING:
            print(f"continuing a killed sweep: trial {trial.number} reruns", flush=True)
            storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
            RetryHeartbeatStaleTrialCallback(max_retry=3)(study, storage.get_trial(trial._trial_id))
    finished = (TrialState.COMPLETE, TrialState.PRUNED)
    left = args.trials - sum(trial.state in finished for trial in study.trials)
    trials, slots = Trials(), queue.Queue()
    for slot in args.slots:
        slots.put(slot)
    def stop(signum, frame):  # as a kill -9 would: the trials stay running in the study, which a rerun continues
        trials.kill_all()
        print(f"{signal.Signals(signum).name}: stopped; the same command continues the sweep", flush=True)
        os._exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    try:
        if left > 0:
            study.optimize(make_objective(args, study_dir, trials, slots), n_trials=left, n_jobs=len(args.slots),
                           catch=(TrialFailed,),
                           callbacks=[MaxTrialsCallback(args.trials, states=finished)])
    finally:
        trials.kill_all()
    write_report(study, study_dir, args)


def study_storage(path: Path):
    """Optuna's SQLite storage, each transaction holding the write lock from its start: Optuna reads a queued trial's
    state, then sets it, and two trials at once would otherwise both take the same queued (or rerun) trial."""
    from optuna.storages import RDBStorage
    from sqlalchemy import event

    storage = RDBStorage(f"sqlite:///{path}",  # timeout: the trials at once wait for each other's writes
                         engine_kwargs={"connect_args": {"timeout": 60, "isolation_level": None}})
    event.listen(storage.engine, "begin", lambda connection: connection.exec_driver_sql("BEGIN IMMEDIATE"))
    return storage


def write_report(study, study_dir: Path, args) -> None:
    """trials.csv (Optuna's table) and trials.png (each trial's validation curve), and the best trial's rerun."""
    from matplotlib.figure import Figure

    table = study.trials_dataframe(attrs=("number", "value", "state", "params", "user_attrs", "duration"))
    table.to_csv(study_dir / "trials.csv", index=False)
    fig = Figure(figsize=(7, 4), layout="tight")
    ax = fig.subplots()
    for trial in study.trials:
        if trial.intermediate_values:
            steps = sorted(trial.intermediate_values)
            ax.plot(steps, [trial.intermediate_values[step] for step in steps], marker="o",
                    linestyle="--" if trial.state.name == "PRUNED" else "-",
                    label=f"{trial.number} {trial.state.name.lower()}")
    ax.set(xlabel="optimizer step", ylabel=f"val {args.metric}", title="trials (dashed: pruned)")
    if ax.lines:
        ax.legend(fontsize="small")
    fig.savefig(study_dir / "trials.png", dpi=100)
    completed = [trial for trial in study.trials if trial.state.name == "COMPLETE"]
    if completed:
        best = study.best_trial
        print(f"best: trial {best.number}, val {args.metric} {best.value:.4f}, {best.params}; rerun it with "
              f"{' '.join(args.command)} --config {best.user_attrs['folder']}/config.yaml --out-dir NEW_FOLDER")


if __name__ == "__main__":
    main()
