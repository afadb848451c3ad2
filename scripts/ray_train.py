"""Runs the unchanged train.py on a Ray cluster: N workers of Ray Train's TorchTrainer, one rank each.

    .venv/bin/python scripts/ray_train.py --address HEAD:6379 --workers 8 --gpus -- --out-dir /shared/runs/x [flags]

Fabric takes its ranks from Ray (``RayLightningEnvironment``), with --devices and --num-nodes set from Ray's layout
(the same number of workers on every node). The run folder (--out-dir, required) must be on storage every node
shares: when a worker dies, Ray restarts the whole group (--max-failures) and the run continues from its newest
checkpoint (``--resume auto``; pass --save-every). Rank 0 reports the run's results and its exported model
(``<out-dir>/model``) to Ray, which keeps them under --storage.
"""

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # train.py, when run as scripts/ray_train.py

LAUNCH_FLAGS = ("--devices", "--num-nodes", "--resume")  # this script sets them from Ray's layout


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     usage="%(prog)s [options] -- [train.py flags] --out-dir SHARED_FOLDER")
    parser.add_argument("--address", help="the Ray cluster's head, HOST:PORT (default: RAY_ADDRESS, else a Ray of "
                                          "this machine)")
    parser.add_argument("--workers", type=int, required=True, help="processes (ranks) in all")
    parser.add_argument("--gpus", action="store_true", help="one GPU per worker (else CPU workers, gloo)")
    parser.add_argument("--cpus-per-worker", type=float, default=1)
    parser.add_argument("--max-failures", type=int, default=3, help="worker-group restarts before the run fails")
    parser.add_argument("--storage", help="where Ray keeps the reported results and model (default: beside "
                                          "--out-dir, in <out-dir>-ray)")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="-- then train.py's flags")
    args = parser.parse_args(argv)
    args.flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    given = [flag for flag in args.flags if flag.split("=")[0] in LAUNCH_FLAGS]
    if given:
        parser.error(f"{', '.join(given)}: this script sets them from Ray's layout (--workers)")
    import train  # its flags fail here, before Ray starts

    flags = train.parse_args(args.flags)
    if flags.out_dir is None:
        parser.error("pass train.py's --out-dir: a folder every node shares, where a restarted group continues")
    args.out_dir = Path(flags.out_dir).resolve()
    return args


def train_worker(config: dict) -> None:
    """One rank, in a Ray worker: train.py with the layout Ray made, then rank 0 reports what it wrote."""
    import ray.train

    from fabric_utils.launcher import CLUSTER_ENVIRONMENT

    os.chdir(config["cwd"])  # the flags' relative paths, as on the driver
    os.environ[CLUSTER_ENVIRONMENT] = "ray"  # Fabric's ranks are Ray's
    context = ray.train.get_context()
    per_node = context.get_local_world_size()
    layout = ["--devices", str(per_node), "--num-nodes", str(context.get_world_size() // per_node)]
    import train

    results = train.setup([*config["flags"], *layout, "--resume", "auto"])
    metrics = {name: value for name, value in results.items() if isinstance(value, (int, float))}
    checkpoint = None
    if context.get_world_rank() == 0:
        checkpoint = ray.train.Checkpoint.from_directory(str(Path(config["out_dir"]) / "model"))
    ray.train.report(metrics, checkpoint=checkpoint)


def main(argv=None) -> None:
    args = parse_args(argv)
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(address=args.address, runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})  # train.py, fabric_utils
    storage = Path(args.storage or f"{args.out_dir}-ray").resolve()
    trainer = TorchTrainer(
        train_worker,
        train_loop_config={"flags": args.flags, "cwd": os.getcwd(), "out_dir": str(args.out_dir)},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=args.gpus,
                                     resources_per_worker={"CPU": args.cpus_per_worker}),
        torch_config=TorchConfig(backend="nccl" if args.gpus else "gloo"),
        run_config=RunConfig(name=args.out_dir.name, storage_path=str(storage),
                             failure_config=FailureConfig(max_failures=args.max_failures)))
    result = trainer.fit()
    print(f"ray: {result.metrics}; model {result.checkpoint.path if result.checkpoint else None}", flush=True)


if __name__ == "__main__":
    main()
