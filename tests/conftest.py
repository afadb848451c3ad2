import atexit
import csv
import functools
import hashlib
import json
import multiprocessing
import multiprocessing.forkserver
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHIMS = REPO / "tests" / "shims"
# a small, quick slice of the offline demo: ~400 training rows of up to 64 tokens
SMALL_DEMO = ["--demo", "--train-size", "400", "--val-size", "101", "--test-size", "201", "--epochs", "1",
              "--max-length", "64", "--quiet", "--num-workers", "0"]


@pytest.fixture(scope="module")
def demo_tokenizer(tmp_path_factory):
    from data.demo import prepare_demo
    from task import load_tokenizer

    _, model = prepare_demo(tmp_path_factory.mktemp("demo"))
    return load_tokenizer(str(model))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# what a launcher leaves in the environment of a process it started: a job started with them would think it was
# launched from outside and wait for ranks that never come
LAUNCH_VARIABLES = ("LOCAL_RANK", "RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT", "FABRIC_TEMPLATE_RUN_DIR")


def subprocess_env() -> dict:
    """Offline, one thread per process (runs of several processes share two cores, and oversubscribed OpenMP threads
    make them crawl), and none of the launch variables an in-process test may have left behind."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    for name in LAUNCH_VARIABLES:
        env.pop(name, None)
    return env


# ``python train.py`` (or a script built on it or its helpers: the tests' probes, the GPU check's profiler and peer)
# without its seconds of imports: forked from a process that imported them (multiprocessing's forkserver), one per
# environment the test worker runs scripts under (libraries read some of it at import, such as the CPU shims on
# PYTHONPATH). The script runs as ``__main__`` with the arguments, environment, output files and session of its own
# that a fresh interpreter would have. Every run starts a fresh interpreter with FABRIC_TEMPLATE_TESTS_FRESH=1.
FORKED_SCRIPTS = ("train.py", "predict.py", "tests/pretrained_probe.py", "tests/shims/zero_probe.py",
                  "tests/infra/eval_sweep_job.py", "tests/infra/plain_module_job.py", "tests/fsdp2_precision_probe.py",
                  "bench/profile_steps.py", "bench/hf_trainer.py", "bench/stuck_line.py")
# what a forkserver imports: the scripts, then what they import as they run (datasets' readers, DeepSpeed, which
# save_pretrained imports with MLflow wherever it is installed, and the demo's BERT); a library missing here is skipped
PRELOADED = ("train", "predict", "datasets", "deepspeed", "transformers.models.bert.modeling_bert")
# set in os.environ as tests run (by pytest, and by runs in a test's own process), or read by the scripts alone
RUN_TIME_VARIABLES = ("PYTEST_CURRENT_TEST", "PL_GLOBAL_SEED", "PL_SEED_WORKERS", "KMP_DUPLICATE_LIB_OK",
                      "_MLFLOW_TELEMETRY_SESSION_ID", "PROBE_OUT", "PROBE_LR0")
MAX_FORKSERVERS = 3  # kept by a test worker between test modules, the most recently used: each holds ~600 MB
_forkservers = {}  # the environment it imported under (sorted items) -> its ForkServer, the most recently used last


def _at_import(env: dict) -> tuple:
    return tuple(sorted((name, value) for name, value in env.items() if name not in RUN_TIME_VARIABLES))


@pytest.fixture(autouse=True)
def _launch_state_restored():
    """Each test starts as the worker did: a variable a test's in-process launch left would make the next one read
    another launcher's world (WORLD_SIZE), and a rank it left would silence rank-zero-only loggers."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    from fabric_utils.args import LAUNCH_DEFAULTS

    # and what an in-process `fabric run` leaves, named as fabric_run.py reads it
    names = (*LAUNCH_VARIABLES, "LT_CLI_USED", *(f"LT_{name.upper()}" for name in LAUNCH_DEFAULTS))
    saved, rank = {name: os.environ.get(name) for name in names}, getattr(rank_zero_only, "rank", None)
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    if rank is not None:
        rank_zero_only.rank = rank


@pytest.fixture(scope="module", autouse=True)
def _stop_unused_forkservers():
    """Stops forkservers at a test module's end, when none of its runs is left running."""
    yield
    for env in list(_forkservers)[:-MAX_FORKSERVERS]:
        _forkservers.pop(env)._stop()


def forkable(command: list) -> bool:
    return (not os.environ.get("FABRIC_TEMPLATE_TESTS_FRESH") and command[0] == sys.executable and len(command) > 1
            and command[1] in FORKED_SCRIPTS)


def _forkserver(env: dict) -> multiprocessing.forkserver.ForkServer:
    key = _at_import(env)
    server = _forkservers.pop(key, None) or multiprocessing.forkserver.ForkServer()
    _forkservers[key] = server  # the most recently used last
    server.set_forkserver_preload(list(PRELOADED))
    saved, here = dict(os.environ), os.getcwd()
    try:  # started (or, if it died, restarted) under the environment, importing the scripts from their folder
        os.environ.clear()
        os.environ.update(key)
        os.chdir(REPO)
        server.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
        os.chdir(here)
    return server


def _run_script(argv: list, env: dict, stdout: str, stderr: str, cwd: str) -> None:
    os.setsid()  # a session and process group of its own, as start_new_session=True gives
    if cwd != str(REPO):  # the script by its full path, as a run started elsewhere names it
        argv = [REPO / argv[0], *argv[1:]]
    os.chdir(cwd)
    os.environ.update(env)  # over the forkserver's: what its imports set stays, as a fresh interpreter's would
    for fd, path in ((1, stdout), (2, stderr)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), fd)
    sys.argv = [os.fspath(arg) for arg in argv]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")  # a str: runpy makes it sys.argv[0]
    finally:
        atexit._run_exitfuncs()  # an interpreter runs them at exit; multiprocessing's children do not


class ForkedRun:
    """A forked run with the part of ``subprocess.Popen``'s interface the tests use; its output goes to the files
    ``stdout`` and ``stderr`` (the same one for both: merged)."""

    def __init__(self, command: list, env: dict, stdout: Path, stderr: Path, cwd: Path = REPO):
        self.args = command
        # not a daemon: a run's DataLoader workers are multiprocessing children of their own
        self.process = multiprocessing.get_context("forkserver").Process(
            target=_run_script, args=(command[1:], env, str(stdout), str(stderr), str(cwd)))
        default = multiprocessing.forkserver.connect_to_new_process  # multiprocessing's one forkserver
        multiprocessing.forkserver.connect_to_new_process = _forkserver(env).connect_to_new_process
        try:
            self.process.start()
        finally:
            multiprocessing.forkserver.connect_to_new_process = default
        self.pid = self.process.pid

    @property
    def returncode(self):
        return self.process.exitcode

    def poll(self):
        return self.process.exitcode

    def send_signal(self, sig: int) -> None:
        if self.process.exitcode is None:
            os.kill(self.pid, sig)

    def wait(self, timeout=None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.process.exitcode


def popen(command: list, env: dict, log: Path, cwd: Path = REPO) -> subprocess.Popen | ForkedRun:
    """``command`` started from ``cwd`` (a script named from the repository root), its output in ``log``, in a
    process group of its own (a test can wait for every process of a multi-process run); forked where it can be."""
    if forkable(command):
        log.write_text("")
        return ForkedRun(command, env, log, log, cwd)
    if cwd != REPO:
        command = [command[0], str(REPO / command[1]), *command[2:]]
    with open(log, "w") as output:
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT,
                                start_new_session=True)


def shimmed(**switches: str) -> dict:
    """The environment that runs a Python process under the test-only CPU shims (tests/shims), these switched on."""
    return {**switches, "PYTHONPATH": os.pathsep.join([str(SHIMS), str(REPO)])}


def run(command: list, timeout=600, deepspeed_cpu=False, check=True, env=None) -> subprocess.CompletedProcess:
    """Runs a command from the repository root (``env``: variables set for it); with ``deepspeed_cpu``, under the
    test-only DeepSpeed CPU shim."""
    env = {**subprocess_env(), **(env or {})}
    if deepspeed_cpu:
        env.update(shimmed(FABRIC_TEMPLATE_DEEPSPEED_CPU="1"))
    if forkable(command):
        with tempfile.TemporaryDirectory() as folder:
            stdout, stderr = Path(folder) / "stdout", Path(folder) / "stderr"
            forked = ForkedRun(command, env, stdout, stderr)
            try:
                forked.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(forked.pid, signal.SIGKILL)
                raise
            result = subprocess.CompletedProcess(command, forked.returncode, stdout.read_text(), stderr.read_text())
    else:
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{command} exited {result.returncode}\n--- stdout\n{result.stdout[-3000:]}"
                             f"\n--- stderr\n{result.stderr[-5000:]}")
    return result


def build_fabric_from_flags(*flags):
    """The Fabric train.py builds for these flags."""
    from fabric_utils.launcher import build_fabric
    from train import parse_args

    args = parse_args(list(flags))
    return build_fabric(accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes,
                        strategy=args.strategy, precision=args.precision, grad_clip=args.grad_clip,
                        grad_checkpointing=args.grad_checkpointing)


@pytest.fixture
def deepspeed_accepts_cpu(monkeypatch):
    """Fabric's DeepSpeed strategy built in this process on the CPU, as the tests' shim lets a subprocess run it
    (Fabric accepts only CUDA for it): to test what the launcher makes of DeepSpeed flags."""
    from lightning.fabric.accelerators import CPUAccelerator
    from lightning.fabric.strategies import deepspeed as fabric_deepspeed

    monkeypatch.setattr(fabric_deepspeed, "CUDAAccelerator", CPUAccelerator)


def fake_gpu(monkeypatch, native_bf16: bool) -> None:
    """A GPU as torch.cuda reports it: every CUDA GPU emulates bf16 (V100, T4), only compute capability 8.0+ has it
    natively (A100, H100)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: native_bf16 or including_emulation)


def train(args: list, out_dir: Path, **kwargs) -> dict:
    """Runs ``python train.py ARGS --out-dir OUT_DIR`` and returns its results.json."""
    run([sys.executable, "train.py", *map(str, args), "--out-dir", str(out_dir)], **kwargs)
    return json.loads((out_dir / "results.json").read_text())


def logged(out_dir: Path, column: str, version: int | None = None) -> dict[int, float]:
    """step -> ``column``'s value in the run's CSV log: one segment's (``version``), or every segment's in order (a
    resume writes a new version)."""
    found = {}
    segments = (out_dir / "logs").glob(f"version_{'*' if version is None else version}/metrics.csv")
    for path in sorted(segments, key=lambda path: int(path.parent.name.removeprefix("version_"))):
        with open(path) as f:
            found.update({int(row["step"]): float(row[column]) for row in csv.DictReader(f) if row.get(column)})
    return found


def fabric_cli() -> str:
    return str(Path(sys.executable).with_name("fabric"))


def when_saved(jobs: dict, timeout=300, or_later=False) -> None:
    """Polls jobs that run together until each one's ``path`` exists (``or_later``: or a later step checkpoint beside
    it), and calls that job's ``action`` (None: none) as soon as it does: waiting on one job after another would let a
    faster one finish unseen. ``jobs``: job -> (path, action). Fails if a job ends first."""
    deadline, waiting = time.monotonic() + timeout, dict(jobs)
    while waiting:
        for job, (path, action) in list(waiting.items()):
            if path.exists() or or_later and any(later.name > path.name for later in path.parent.glob("step-*")):
                del waiting[job]
                if action is not None:
                    action()
                continue
            assert job.proc.poll() is None, (f"run ended (exit {job.proc.returncode}) before {path} appeared"
                                             f"\n{job.output()[-3000:]}")
            assert time.monotonic() < deadline, f"{path} did not appear within {timeout} s"
        time.sleep(0.01)


class Job:
    """``python train.py ...`` running in the background, its output in ``<out_dir>.log``; ``env``: variables set
    for it."""

    def __init__(self, out_dir: Path, *flags: str, launcher: tuple = (), env: dict | None = None):
        self.out_dir = out_dir
        self.log = out_dir.with_name(out_dir.name + f"-{time.monotonic_ns()}.log")
        self.command = [sys.executable, *launcher, "train.py", "--out-dir", str(out_dir), *flags]
        self.proc = popen(self.command, {**subprocess_env(), **(env or {})}, self.log)

    def wait(self, timeout=300) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise AssertionError(f"{self.command} ran over {timeout} s\n{self.output()[-3000:]}")

    def output(self) -> str:
        return self.log.read_text()

    def results(self) -> dict:
        rc = self.wait()
        assert rc == 0, f"{self.command} exited {rc}\n{self.output()[-5000:]}"
        return json.loads((self.out_dir / "results.json").read_text())

    def wait_for(self, path: Path, timeout=300, or_later=False) -> None:
        """Polls until ``path`` exists (``or_later``: or a later step checkpoint beside it); fails if the run ends
        first. A poll on a loaded machine can come after --keep-last has pruned the step checkpoint it waits for."""
        when_saved({self: (path, None)}, timeout, or_later)

    def kill_after(self, checkpoint: str, rank: int | None = None) -> None:
        """SIGKILL once ``checkpoints/<checkpoint>`` or a later one exists: to every process of the run, as a lost
        machine would, or to one ``rank``'s process only (a crashed process), after which the others must end by
        themselves."""
        self.wait_for(self.out_dir / "checkpoints" / checkpoint, or_later=True)
        if rank is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        else:  # rank 0 is the process started here; it started the others (Lightning's launcher)
            os.kill(self.proc.pid if rank == 0 else self.children()[rank - 1], signal.SIGKILL)
        self.wait_killed()

    def children(self) -> list[int]:
        """The processes the one started here started: the other ranks, or a launcher's workers."""
        return [int(pid) for pid in Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()]

    def wait_killed(self) -> None:
        self.wait()
        self.wait_group()
        assert not (self.out_dir / "results.json").exists(), "the run finished before it was killed"

    def wait_group(self, timeout=60) -> None:
        """Waits until every process of the run's group has exited (the ranks a launcher started)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            if time.monotonic() > deadline:
                os.killpg(self.proc.pid, signal.SIGKILL)
                raise AssertionError(f"processes of {self.command} still ran {timeout} s after the launcher exited")
            time.sleep(0.1)


def kill_each_after(jobs: list, checkpoint: str, timeout=300) -> None:
    """``Job.kill_after`` for jobs that run together: each is killed as soon as its own checkpoint appears, so a
    faster one cannot finish while the test waits on a slower one."""
    kill = {job: functools.partial(os.killpg, job.proc.pid, signal.SIGKILL) for job in jobs}
    when_saved({job: (job.out_dir / "checkpoints" / checkpoint, kill[job]) for job in jobs}, timeout)
    for job in jobs:
        job.wait_killed()
        # on a loaded machine the poll can come a few steps late, after the job wrote later checkpoints (a CI run
        # resumed from step 12 instead of 8): remove them, so the run resumes from the checkpoint the test names
        for later in (job.out_dir / "checkpoints").glob("step-*"):
            if later.name > checkpoint:
                shutil.rmtree(later)


def resumed_step(output: str) -> int:
    found = re.findall(r"resumed from \S+ at step (\d+)", output)
    assert found, f"the run did not resume:\n{output[-3000:]}"
    return int(found[-1])


def digest(path: Path) -> dict:
    """Every file under ``path`` (links too, by name) with its content hash: what must stay as it was."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "link"
            for p in sorted(path.rglob("*")) if p.is_file() or p.is_symlink()}


def copy_repo(dest: Path) -> Path:
    """The repository's git-tracked files, as they are in the working tree, copied into ``dest``: a copy to edit."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for name in filter(None, names.split("\0")):
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, dest / name, follow_symlinks=False)  # template/ links stay links
    return dest


def kill_all(jobs: dict) -> None:
    """Ends what a failed test left running."""
    for job in jobs.values():
        if job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two emulated nodes (tests/cluster.py) for a module's multi-node tests; skipped where they cannot be made."""
    from cluster import Cluster

    cluster = Cluster(tmp_path_factory.mktemp("cluster"))
    yield cluster
    cluster.close()


def node_env(**variables):
    """The environment of a node's process, with ``variables`` beside it (a callable of the node's index)."""
    return lambda node: {**subprocess_env(), **{name: value(node) if callable(value) else value
                                                 for name, value in variables.items()}}
