import json
import os
import shutil
import subprocess
import sys
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


def run(command: list, timeout=600, deepspeed_cpu=False, check=True) -> subprocess.CompletedProcess:
    """Runs a command from the repository root; with ``deepspeed_cpu``, under the test-only DeepSpeed CPU shim."""
    env = subprocess_env()
    if deepspeed_cpu:
        env.update(FABRIC_TEMPLATE_DEEPSPEED_CPU="1", PYTHONPATH=os.pathsep.join([str(SHIMS), str(REPO)]))
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


def train(args: list, out_dir: Path, **kwargs) -> dict:
    """Runs ``python train.py ARGS --out-dir OUT_DIR`` and returns its results.json."""
    run([sys.executable, "train.py", *map(str, args), "--out-dir", str(out_dir)], **kwargs)
    return json.loads((out_dir / "results.json").read_text())


def fabric_cli() -> str:
    return str(Path(sys.executable).with_name("fabric"))


def copy_repo(dest: Path) -> Path:
    """The repository's git-tracked files, as they are in the working tree, copied into ``dest``: a copy to edit."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for name in filter(None, names.split("\0")):
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, dest / name)
    return dest
