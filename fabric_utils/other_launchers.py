"""Processes another launcher started (torchrun, SLURM, Kubeflow, Ray): their count checked against the flags, a
launcher named in ``FABRIC_TEMPLATE_CLUSTER``, torchrun's restarted workers; loaded only in such processes."""

import importlib
import os

import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.environments import ClusterEnvironment, LightningEnvironment

from fabric_utils.errors import UserError
from fabric_utils.launcher import CLUSTER_ENVIRONMENT, count_processes

# launchers whose processes Fabric cannot tell apart from its own, named by the launcher or the job's manifest
CLUSTER_ENVIRONMENTS = {"kubeflow": ("lightning.fabric.plugins.environments", "KubeflowEnvironment"),  # a PyTorchJob
                        "ray": ("ray.train.lightning", "RayLightningEnvironment")}  # set by scripts/ray_train.py


def named_cluster_environment() -> ClusterEnvironment:
    """The environment named in ``CLUSTER_ENVIRONMENT`` (unset: Fabric detects it), imported only when named."""
    name = os.environ[CLUSTER_ENVIRONMENT]
    if name not in CLUSTER_ENVIRONMENTS:
        known = " or ".join(CLUSTER_ENVIRONMENTS)
        raise UserError(f"{CLUSTER_ENVIRONMENT}={name} is not a launcher this knows: set {known}, or unset it")
    module, cls = CLUSTER_ENVIRONMENTS[name]
    return getattr(importlib.import_module(module), cls)()


def join_restarted_torchrun_workers(fabric: Fabric) -> None:
    """Workers restarted by ``torchrun --max-restarts`` join under their attempt's key prefix: the store still holds
    the dead workers' addresses (the restart count is per node, so attempts are counted in the store)."""
    if torch.distributed.is_initialized():
        return
    store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    world_size = int(os.environ["WORLD_SIZE"])
    attempt = (store.add("fabric-template/workers-started", 1) - 1) // world_size
    if attempt == 0:
        return
    torch.distributed.init_process_group("nccl" if fabric.device.type == "cuda" else "gloo",
                                         store=torch.distributed.PrefixStore(f"attempt-{attempt}", store),
                                         rank=int(os.environ["RANK"]), world_size=world_size)


def check_world_size(environment: ClusterEnvironment, settings: dict) -> None:
    """Flags that count other processes than a launcher started (torchrun, SLURM, Kubeflow, Ray) give processes wrong
    ranks, and the run wrong metrics without a word."""
    counted, lightning = count_processes(settings), type(environment) is LightningEnvironment
    if lightning and "WORLD_SIZE" in os.environ:  # it counts the flags' processes: a launcher's are in the variable
        started = int(os.environ["WORLD_SIZE"])
    elif not lightning and environment.creates_processes_externally:
        started = environment.world_size()
    else:
        return
    if started != counted:
        raise UserError(f"{type(environment).__name__} started {started} processes, but --devices {settings['devices']}"
                        f" x --num-nodes {settings['num_nodes']} count {counted}; pass --devices (processes per node) "
                        f"and --num-nodes that multiply to {started}")
    node, local, per_node = environment.node_rank(), environment.local_rank(), counted // settings["num_nodes"]
    if lightning and "RANK" in os.environ and int(os.environ["RANK"]) != node * per_node + local:
        raise UserError(f"the launcher made this process rank {os.environ['RANK']} (RANK), but --devices "
                        f"{settings['devices']} x --num-nodes {settings['num_nodes']} make it rank "
                        f"{node * per_node + local} (node {node} x {per_node} + local rank {local}); launch through "
                        f"torchrun, or give Fabric the launcher's cluster environment (docs/launching.md)",
                        rank=int(os.environ["RANK"]))
