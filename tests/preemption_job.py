"""The smallest job that leaves the way train.py does: Fabric's DDP, a DataLoader with a worker process, the CSV and
TensorBoard loggers, checkpoints, and ``fabric_utils.preemption``. Each job trains (a step every 50 ms)
until SIGTERM, SIGUSR1 or Ctrl-C, then saves a checkpoint and exits 75; with ``--steps N`` it finishes after N steps,
spending ``--finish-s`` in a stand-in for the test and export. A checkpoint after step 1 tells a test that the loop
runs, and ``finishing`` in the job's folder that the loop has ended.

    python tests/preemption_job.py ROOT --jobs 20 [--steps N --finish-s S]

starts JOBS jobs of 2 ranks at once, as srun starts a job's tasks (RANK, WORLD_SIZE, MASTER_* set; the job's own
process group, whose id goes to ROOT/job-J/pgid, so a signal to the group reaches every process of the job), and
once all have ended writes every rank's exit status to ROOT/statuses.json (75, 0, or minus a fatal signal: -6 for an
abort). The ranks are forked from this process, which imports torch and Lightning once: 40 fresh interpreters would
spend minutes of two cores on imports alone. A forked rank still leaves as any process does, through interpreter
teardown, with its own threads, loader workers and process group.
"""

import argparse
import gc
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.utils.tensorboard  # noqa: F401  rank 0's TensorBoard logger imports it: once here, not in every job
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fabric_utils.checkpoint import save_checkpoint  # noqa: E402
from fabric_utils.launcher import build_fabric, launch  # noqa: E402
from fabric_utils.loaders import ignore_sigterm_in_worker  # noqa: E402
from fabric_utils.loggers import finalize_loggers, make_loggers  # noqa: E402
from fabric_utils.preemption import Preemption  # noqa: E402

RANKS = 2


def job(out_dir: Path, steps: int, finish_s: float) -> None:
    """One rank's job, which ends the way train.py's main() does."""
    fabric = build_fabric(accelerator="cpu", devices=RANKS, strategy="ddp", precision="32-true",
                          loggers=make_loggers("csv,tensorboard", out_dir, project="preemption"))
    launch(fabric)
    preemption = Preemption()
    model = torch.nn.Linear(8, 1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    rows = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    loaders = {"train": fabric.setup_dataloaders(DataLoader(rows, batch_size=8, num_workers=1, persistent_workers=True,
                                                            worker_init_fn=ignore_sigterm_in_worker))}
    state, ckpt_dir = {"model": model, "optimizer": optimizer, "step": 0}, out_dir / "checkpoints"
    while state["step"] < steps:
        for x, y in loaders["train"]:
            loss = torch.nn.functional.mse_loss(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            state["step"] += 1
            step = state["step"]
            fabric.log("train/loss", loss.item(), step=step)
            time.sleep(0.05)  # a real step takes time; this one leaves the CPU to the other jobs
            stop = preemption.agreed(fabric)
            if stop or step == 1:
                save_checkpoint(fabric, ckpt_dir, f"step-{step:06d}", state)
            if stop:
                finalize_loggers(fabric.loggers, status="preempted")
                preemption.exit(fabric, loaders, out_dir, step=step, checkpoint=ckpt_dir / f"step-{step:06d}")
            if step == steps:
                break
    preemption.training_ended()
    fabric.barrier()  # every rank has left the loop before a test sends its late signals
    if fabric.is_global_zero:
        (out_dir / "finishing").touch()
    time.sleep(finish_s)
    finalize_loggers(fabric.loggers)
    preemption.close(fabric, loaders)


def fork_rank(out_dir: Path, rank: int, port: int, pgid: int, steps: int, finish_s: float) -> int:
    pid = os.fork()
    if pid:
        os.setpgid(pid, pgid or pid)  # here and in the child: whichever runs first
        return pid
    os.setpgid(0, pgid)
    log = os.open(out_dir / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)  # where the C++ runtime writes "terminate called ..."
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(RANKS), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    try:
        job(out_dir, steps, finish_s)
    except Exception:  # a bug in the job: fail the test now, not after a teardown that waits on a live process group
        traceback.print_exc()
        os._exit(1)
    sys.exit(0)  # a finished job; a preempted one left by SystemExit(75). Either way through interpreter teardown


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("root", type=Path)
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--finish-s", type=float, default=0.0)
    args = p.parse_args()

    # the ranks' garbage collector leaves alone what this process imported: walking it would copy every page it
    # sits on into each rank (1.3 s of CPU a rank); what a rank creates itself is collected as usual
    gc.freeze()
    ranks = {}
    for j in range(args.jobs):
        out_dir = args.root / f"job-{j}"
        out_dir.mkdir(parents=True)
        port, pgid = free_port(), 0
        for rank in range(RANKS):
            pid = fork_rank(out_dir, rank, port, pgid, args.steps, args.finish_s)
            pgid = pgid or pid
            ranks[pid] = (j, rank)
        (out_dir / "pgid").write_text(str(pgid))
    statuses = {j: [None] * RANKS for j in range(args.jobs)}
    for _ in ranks:
        pid, status = os.wait()
        j, rank = ranks[pid]
        statuses[j][rank] = os.waitstatus_to_exitcode(status)
    (args.root / "statuses.json").write_text(json.dumps(statuses))


if __name__ == "__main__":
    main()
