"""Each process's CPU threads: the idle CPUs it may use (affinity, cgroup quota) shared among the job's processes on
the node; --num-threads and a user's OMP_NUM_THREADS win, a launcher's OMP_NUM_THREADS does not."""

import os

import pytest

from fabric_utils import threads
from fabric_utils.threads import choose_threads, launcher_sets_threads, usable_cpus


@pytest.mark.parametrize("cpu_max, expected", [
    (None, 4),                # no cgroup file (not Linux's cgroup v2): the affinity
    ("max 100000\n", 4),      # no quota
    ("150000 100000\n", 2),   # 1.5 CPUs of time: 2 threads, each busy part of the time
    ("50000 100000\n", 1),
    ("800000 100000\n", 4),   # a quota above the affinity: the affinity
])
def test_usable_cpus_is_the_affinity_within_the_cgroup_quota(tmp_path, monkeypatch, cpu_max, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    if cpu_max is not None:
        (tmp_path / "cpu.max").write_text(cpu_max)
    assert usable_cpus(tmp_path) == expected


def idle(value):
    return lambda: value


@pytest.mark.parametrize("cpus, idle_now, sharing, expected", [
    (2, 2.0, 1, 2),    # an idle 2-core machine, one process: both cores
    (2, 1.9, 2, 1),    # two processes on it (python train.py --devices 2, fabric run, torchrun): one each
    (2, 0.1, 1, 1),    # two busy processes of another job on both cores: one thread, never zero
    (2, 1.0, 1, 1),    # one core busy elsewhere
    (16, 15.6, 4, 4),  # 4 processes on a 16-core node
    (4, 16.0, 1, 4),   # idle CPUs beyond the quota or affinity do not count
])
def test_threads_are_the_idle_usable_cpus_shared_among_the_nodes_processes(cpus, idle_now, sharing, expected):
    assert choose_threads(None, cpus, idle(idle_now), sharing, None, launcher_sets_it=False)[0] == expected


def test_num_threads_and_a_users_omp_num_threads_win_a_launchers_does_not():
    assert choose_threads(3, 2, idle(2.0), 1, "1", launcher_sets_it=False) == (3, "--num-threads")
    assert choose_threads(None, 2, idle(2.0), 1, "1", launcher_sets_it=False) == (1, "OMP_NUM_THREADS")
    # `fabric run` sets it to every CPU in each process: 2 processes on 2 cores get 1 thread each, not 2
    assert choose_threads(None, 2, idle(2.0), 2, "2", launcher_sets_it=True)[0] == 1
    assert choose_threads(None, 2, idle(2.0), 1, "0", launcher_sets_it=False)[0] == 2  # not a thread count


def test_fabric_run_and_torchrun_set_omp_num_threads_themselves(monkeypatch):
    for name in ("LT_CLI_USED", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    assert not launcher_sets_threads()
    monkeypatch.setenv("LT_CLI_USED", "1")
    assert launcher_sets_threads()
    monkeypatch.delenv("LT_CLI_USED")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert launcher_sets_threads()


def test_set_threads_sets_torchs_threads_and_says_why(monkeypatch):
    import torch
    from lightning.fabric import Fabric
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # restored after
    before = torch.get_num_threads()
    try:
        assert threads.set_threads(Fabric(accelerator="cpu", devices=1), 1) == ("1 thread (--num-threads)", 1)
        assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"
    finally:
        torch.set_num_threads(before)
