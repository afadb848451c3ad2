"""Test-only script: ``python tests/launcher_probe.py [train.py flags]`` builds and launches Fabric as train.py does
and prints one JSON line with the ranks Fabric computed and the process group's."""

import json
import os
import sys

import torch.distributed as dist

from fabric_utils.errors import exit_on_user_error
from fabric_utils.launcher import build_fabric, end_job, launch
from train import parse_args


@exit_on_user_error
def main(argv: list) -> None:
    flags = parse_args(argv)
    fabric = build_fabric(accelerator=flags.accelerator, devices=flags.devices, num_nodes=flags.num_nodes,
                          strategy=flags.strategy, precision=flags.precision)
    launch(fabric)
    ranks = {"environment": type(fabric.strategy.cluster_environment).__name__, "global_rank": fabric.global_rank,
             "world_size": fabric.world_size, "node_rank": fabric.node_rank, "local_rank": fabric.local_rank,
             "group": [dist.get_rank(), dist.get_world_size()]}
    # one write, whole: the pod's processes share its stdout, where print's two writes (line, newline) interleave
    os.write(sys.stdout.fileno(), (json.dumps(ranks) + "\n").encode())
    end_job(fabric)


if __name__ == "__main__":
    main(sys.argv[1:])
