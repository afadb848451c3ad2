"""Operations: torch.compile under a strategy, the batch-size finder, cluster scripts, worker counts, shared caches,
the training clock."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from torch._dynamo.eval_frame import OptimizedModule
from torch.nn.parallel import DistributedDataParallel
from transformers import PreTrainedTokenizerFast

from conftest import REPO, build_fabric_from_flags, subprocess_env
from data.demo import LABELS, prepare_demo
from fabric_utils.progress import Throughput
from fabric_utils.speed import default_num_workers
from fabric_utils.threads import processes_sharing
import task
from task import build_model, load_tokenizer
import train


def test_compile_is_applied_around_the_ddp_wrapper(monkeypatch):
    """--compile hands Fabric a compiled module; fabric.setup wraps the original in DDP and compiles the wrapper."""
    for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)  # a one-process DDP launch sets them here: undone after the test
    launch = ("--accelerator", "cpu", "--devices", "1", "--strategy", "ddp")
    args = train.parse_args(["--demo", "--compile", *launch])
    fabric = build_fabric_from_flags(*launch)
    fabric.launch()
    try:
        spec = task.setup(args, verbose=False)
        loss_fn = lambda model, batch: spec.objective.loss(spec.objective.forward(model, batch), batch)  # noqa: E731
        module = train.build(fabric, args, spec, loss_fn, fresh=True)[0]  # as --compile builds
    finally:
        torch.distributed.destroy_process_group()
    compiled = module._forward_module
    assert isinstance(compiled, OptimizedModule), type(compiled)
    assert isinstance(compiled._orig_mod, DistributedDataParallel)
    assert compiled._orig_mod.module is module.module  # DDP holds the original model ...
    assert "forward" not in vars(module.module)  # ... not one whose forward was compiled inside the wrapper
    assert compiled._compile_kwargs == {"mode": "default", "dynamic": True}
    assert module.module.config.num_labels == len(LABELS)  # what train.py reads for FLOPs and the export


def test_the_training_clock_leaves_out_validations_and_checkpoints():
    """train.py runs validation and checkpoints under ``paused()``: rates, MFU and the study's time to accuracy are
    training time, whatever the validation settings."""
    fabric = build_fabric_from_flags()
    monitor = Throughput(fabric, peak_tflops=None, flops_of=lambda rows, tokens, tokens_sq: 0.0, sized=True)
    monitor.start(step=0)
    time.sleep(0.2)
    with monitor.paused():
        time.sleep(1.0)
    monitor.count(2, torch.tensor([5, 7]), computed=(2, 8))
    logged = monitor.log(step=1)
    result = monitor.stop()
    assert 0.2 <= logged["time"] < 0.7 and 0.2 <= result["train_time_s"] < 0.7
    assert result["train_samples_per_s"] == pytest.approx(2 / result["train_time_s"])


def test_mfu_counts_real_tokens_and_the_padded_batch_the_device_computes():
    """Compiled or eager, a row's MFU comes from host counts: over its real tokens, and over the (rows, length) the
    device computes, filling rows and padding included (what a GPU's peak is measured against)."""
    fabric = build_fabric_from_flags()
    monitor = Throughput(fabric, peak_tflops=1e-12, flops_of=lambda rows, tokens, tokens_sq: 10 * rows + tokens,
                         sized=True)
    monitor.start(step=0)
    monitor.count(2, torch.tensor([5, 7]), computed=(4, 8))  # 2 rows filled to 4, padded to 8 tokens
    monitor.count(3, torch.tensor([8, 8, 8]), computed=(4, 8))
    result = monitor.stop()
    seconds = result["train_time_s"]
    assert result["mfu"] == pytest.approx((10 * 5 + 36) / seconds)
    assert result["mfu_padded"] == pytest.approx((10 * 8 + 64) / seconds)


@pytest.mark.parametrize("other_cpus, expected", [(range(6), 6 // 2 - 1), (range(6, 12), 4)])
def test_loader_workers_count_the_cpus_this_process_may_use(monkeypatch, other_cpus, expected):
    """Bound to 6 of a node's 64 CPUs (taskset, a cgroup), 2 GPU processes that share them get 2 workers each, not 4.
    SLURM binds each task to CPUs of its own (--cpus-per-task 6): dividing them again used to leave 2, not 4."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)), raising=False)

    def all_gather(mask):  # this process's [host, CPU flags], and the other's on the same host
        other = mask.clone()
        other[1:] = 0
        other[1 + torch.tensor(list(other_cpus))] = 1
        return torch.stack([mask, other])
    fabric = SimpleNamespace(device=torch.device("cuda", 0), world_size=2, all_gather=all_gather)
    assert default_num_workers(fabric.device, processes_sharing(fabric, os.sched_getaffinity(0))) == expected


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="Linux: VmHWM")
def test_a_process_reports_its_own_peak_memory_not_that_of_the_process_that_started_it():
    """A rank's memory on CPU is its process's peak; one started from a larger process (a notebook, a test runner)
    must not report the larger one's, as ``ru_maxrss`` would after exec."""
    held = torch.ones(2**28)  # 1 GiB, resident in this process while the child starts
    probe = "import torch; from fabric_utils.speed import peak_memory_mb; print(peak_memory_mb(torch.device('cpu')))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert 50 < float(done.stdout) < held.nbytes / 2**20 / 2, done.stdout


SHARING = r"""
import json, os, sys
from fabric_utils.launcher import build_fabric, end_job
from fabric_utils.threads import processes_sharing

fabric = build_fabric(accelerator="cpu", devices="2", strategy="ddp", precision="32-true")
fabric.launch()
found = {"shared": processes_sharing(fabric, os.sched_getaffinity(0)),
         "bound": processes_sharing(fabric, {fabric.global_rank})}  # as SLURM binds each task to its own CPUs
if fabric.global_rank == 0:
    print(json.dumps(found))
end_job(fabric)
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_processes_sharing_cpus_are_counted_across_the_job(tmp_path):
    script = tmp_path / "sharing.py"  # a file: Lightning's launcher starts rank 1 by running it again
    script.write_text(SHARING)
    done = subprocess.run([sys.executable, str(script)], cwd=REPO, env={**subprocess_env(), "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"shared": 2, "bound": 1}


def test_an_interrupted_demo_write_leaves_no_folder_that_looks_done(tmp_path, monkeypatch):
    """Stopped after the model's config and weights, before its tokenizer (a crash, or what a second node on a shared
    filesystem would see midway): the next prepare_demo must write the model again, not trust the half."""
    def crash(*args, **kwargs):
        raise RuntimeError("stopped midway")

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", crash)
    with pytest.raises(RuntimeError, match="stopped midway"):
        prepare_demo(tmp_path)
    monkeypatch.undo()
    data_dir, model_dir = prepare_demo(tmp_path)
    tokenizer = load_tokenizer(str(model_dir))  # transformers would build an empty one from a folder without its files
    assert tokenizer.convert_tokens_to_ids("good") != tokenizer.unk_token_id
    assert len(pd.read_parquet(data_dir / "test.parquet")) > 0
    assert sorted(path.name for path in tmp_path.iterdir()) == ["data", "model"]  # no temporary folder left behind


DEMO_ON_RANK_1 = """
import sys, torch, torch.distributed as dist
rank, port, root = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
if rank == 1:  # rank 0 of a second node, whose cache is its own
    from data.demo import prepare_demo
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    prepare_demo(__import__("pathlib").Path(root))
    assert torch.equal(torch.rand(3), expected), "preparing the demo changed the global random state"
dist.barrier()
dist.destroy_process_group()
"""


def test_the_demo_is_written_whole_by_a_process_that_is_not_global_rank_0(tmp_path):
    """A second node's local rank 0 prepares its node's demo cache once the process group exists (transformers'
    save_pretrained writes only on global rank 0 then), without touching the run's random state."""
    port = str(29700 + os.getpid() % 1000)
    ranks = [subprocess.Popen([sys.executable, "-c", DEMO_ON_RANK_1, str(rank), port, str(tmp_path)], cwd=REPO,
                              env={**subprocess_env(), "PYTHONPATH": str(REPO)}, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    errors = [rank.communicate(timeout=300)[1] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], errors
    tokenizer = load_tokenizer(str(tmp_path / "model"))
    model = build_model(str(tmp_path / "model"), LABELS, "single_label", attention_dropout=0.0, hidden_dropout=None)
    assert tokenizer.convert_tokens_to_ids("good") != tokenizer.unk_token_id and model.config.hidden_size == 64


def test_a_demo_folder_left_incomplete_is_replaced(tmp_path):
    """A model folder holding only the tokenizer (what an older write on a second node left) is written again."""
    _, model_dir = prepare_demo(tmp_path)
    (model_dir / "model.safetensors").unlink()
    (model_dir / "config.json").unlink()
    _, model_dir = prepare_demo(tmp_path)
    assert (model_dir / "config.json").exists() and (model_dir / "model.safetensors").exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["data", "model"]


def test_slurm_log_folders_exist_in_a_fresh_clone():
    """SLURM does not create the folder of --output/--error; sbatch runs from the repository root, so the folder
    must be the root or one git tracks (a fresh clone has only tracked files)."""
    script = REPO / "scripts" / "slurm.sbatch"
    paths = re.findall(r"^#SBATCH\s+--(?:output|error)[= ](\S+)", script.read_text(), flags=re.MULTILINE)
    assert paths, "the script names its log"
    for path in paths:
        folder = os.path.dirname(path) or "."
        tracked = subprocess.run(["git", "ls-files", "--", folder], cwd=REPO, capture_output=True, text=True,
                                 check=True).stdout
        assert tracked, f"{path}: {folder}/ is not in a fresh clone"


def test_slurm_tasks_get_the_cpus_the_job_asks_for():
    """Since Slurm 22.05 srun does not take --cpus-per-task from sbatch: each task would be bound to one CPU."""
    script = (REPO / "scripts" / "slurm.sbatch").read_text()
    assert re.search(r"^#SBATCH\s+--cpus-per-task", script, flags=re.MULTILINE)
    assert 'export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"' in script.split("\nsrun ")[0]
