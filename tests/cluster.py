"""Emulated cluster nodes on one machine for the multi-node tests: real processes, a real network stack between them
and real SLURM daemons; not NFS or Lustre semantics, NCCL or InfiniBand.

Each node is a network namespace with an address of its own. Every process on it runs in its own mount and UTS
namespaces too, with the node's hostname and an /etc/hosts that names every node (``nsenter`` + ``unshare`` rather
than ``ip netns exec``, which remounts /sys, where slurmd then finds no cgroups). A bridge in a namespace of its
own joins the nodes; they have no default route, and the host refuses their subnet, so nothing leaves the machine.
The filesystem is shared, as a cluster's shared storage; each node has a HOME of its own, as node-local caches are.
"""

import itertools
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

_clusters = itertools.count()


def ip(*args: str, check=True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def skip_unless_namespaces() -> None:
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("nsenter") or not shutil.which("unshare"):
        pytest.skip("emulated nodes need root, iproute2 and util-linux (nsenter, unshare)")
    probe = f"ftprobe{os.getpid()}"
    made = ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        pytest.skip(f"this machine cannot make network namespaces: {made.stderr.strip()}")
    ip("netns", "del", probe)


class Cluster:
    """``nodes`` emulated nodes named node1, node2, ...; ``close()`` kills what still runs on them and removes every
    namespace, interface and route it made."""

    def __init__(self, root: Path, nodes: int = 2):
        skip_unless_namespaces()
        self.root = root
        self.tag = f"ft{os.getpid()}c{next(_clusters)}"
        self.names = [f"node{i + 1}" for i in range(nodes)]
        self.namespaces = [f"{self.tag}-{name}" for name in self.names]
        self.bridge = f"{self.tag}-bridge"
        self.subnet, self.addresses = None, []
        self.started, self.folders = [], []  # what close() ends and removes
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def _create(self) -> None:
        for third in range(1, 255):  # a /24 that no other cluster on this machine has taken: its route marks it
            if ip("route", "add", "prohibit", f"10.213.{third}.0/24", check=False).returncode == 0:
                self.subnet = f"10.213.{third}.0/24"
                break
        else:
            raise RuntimeError("no free 10.213.x.0/24 subnet for emulated nodes")
        prefix = self.subnet.rsplit(".", 1)[0]
        self.addresses = [f"{prefix}.{i + 1}" for i in range(len(self.names))]
        ip("netns", "add", self.bridge)
        ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        ip("-n", self.bridge, "link", "set", "br0", "up")
        for i, (name, namespace, address) in enumerate(zip(self.names, self.namespaces, self.addresses)):
            ip("netns", "add", namespace)
            ip("-n", self.bridge, "link", "add", f"veth{i}", "type", "veth", "peer", "name", "eth0", "netns", namespace)
            ip("-n", self.bridge, "link", "set", f"veth{i}", "master", "br0")
            ip("-n", self.bridge, "link", "set", f"veth{i}", "up")
            ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
            ip("-n", namespace, "link", "set", "eth0", "up")
            ip("-n", namespace, "link", "set", "lo", "up")
            (self.home(i) / ".cache").mkdir(parents=True)
        self.write_hosts()

    def write_hosts(self, own_name_on_loopback=False) -> None:
        """Each node's /etc/hosts, for the processes started from now on. ``own_name_on_loopback``: a node's own
        hostname resolves to 127.0.1.1, as Debian's installer writes it."""
        for name in self.names:
            hosts = "127.0.0.1 localhost\n" + "".join(
                f"{'127.0.1.1' if own_name_on_loopback and other == name else address} {other}\n"
                for address, other in zip(self.addresses, self.names))
            (self.root / name / "hosts").write_text(hosts)

    def home(self, node: int) -> Path:
        return self.root / self.names[node] / "home"

    def command(self, node: int, argv: list) -> list:
        """``argv`` as a process of ``node`` runs it."""
        on_node = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'
        return ["nsenter", f"--net=/run/netns/{self.namespaces[node]}", "unshare", "--mount", "--uts", "sh", "-c",
                on_node, "sh", str(self.root / self.names[node] / "hosts"), self.names[node], *map(str, argv)]

    def env(self, node: int, base: dict) -> dict:
        return {**base, "HOME": str(self.home(node))}

    def start(self, node: int, argv: list, env: dict, log: Path, cwd=None) -> subprocess.Popen:
        """``argv`` on ``node`` in the background, in a process group of its own, its output in ``log``."""
        with open(log, "ab") as out:
            proc = subprocess.Popen(self.command(node, argv), env=self.env(node, env), cwd=cwd, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.started.append(proc)
        return proc

    def run(self, node: int, argv: list, env: dict, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(node, argv), env=self.env(node, env), capture_output=True, text=True,
                              **kwargs)

    def pids(self, node: int) -> list[int]:
        """Every process on ``node``."""
        listed = ip("netns", "pids", self.namespaces[node], check=False).stdout.split()
        return [int(pid) for pid in listed]

    def kill_node(self, node: int) -> None:
        """SIGKILL to every process on ``node``, as a lost machine; returns once none is left."""
        deadline = time.monotonic() + 30
        while pids := self.pids(node):
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            assert time.monotonic() < deadline, f"processes {pids} on {self.names[node]} outlived SIGKILL"
            time.sleep(0.05)
        for proc in self.started:
            if proc.poll() is None and proc.args[1] == f"--net=/run/netns/{self.namespaces[node]}":
                proc.wait(10)

    def close(self) -> None:
        for node, namespace in enumerate(self.namespaces):
            if namespace in self.existing_namespaces():
                self.kill_node(node)
        for proc in self.started:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
        for namespace in [*self.namespaces, self.bridge]:
            ip("netns", "del", namespace, check=False)
        if self.subnet:
            ip("route", "del", "prohibit", self.subnet, check=False)
        for folder in self.folders:
            shutil.rmtree(folder, ignore_errors=True)

    def existing_namespaces(self) -> list[str]:
        return [line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.strip()]

    def leftovers(self) -> list[str]:
        """What of this cluster is still there: namespaces, its route, processes started from here."""
        left = [name for name in self.existing_namespaces() if name.startswith(self.tag + "-")]
        if self.subnet and self.subnet in ip("route", "show").stdout:
            left.append(f"route {self.subnet}")
        left += [f"pid {proc.pid}" for proc in self.started if proc.poll() is None]
        return left + [str(folder) for folder in self.folders if folder.exists()]


SLURM_CONF = """\
ClusterName=fabric-template-test
SlurmctldHost={first}({first_address})
SlurmctldPort=6817
SlurmdPort=6818
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class Slurm:
    """A private SLURM on a cluster's nodes: its own munged key and socket, slurmctld on node1, one slurmd per node,
    its own slurm.conf; no system daemon or /etc/slurm is touched. Its commands run on node1 (``command``)."""

    def __init__(self, cluster: Cluster, env: dict):
        if not shutil.which("slurmctld") or not shutil.which("munged"):
            pytest.skip("SLURM is not installed (apt-get install slurm-wlm munge)")
        # short paths: slurmd's and munged's sockets live here, and a socket's path has at most 107 bytes
        self.cluster, self.root = cluster, Path(tempfile.mkdtemp(prefix="slurm-"))
        cluster.folders.append(self.root)
        for folder in ("state", *(f"spool-{name}" for name in cluster.names)):
            (self.root / folder).mkdir()
        key = self.root / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        nodes = "".join(f"NodeName={name} NodeAddr={address} CPUs={os.cpu_count()} State=UNKNOWN\n"
                        for name, address in zip(cluster.names, cluster.addresses))
        conf = self.root / "slurm.conf"
        conf.write_text(SLURM_CONF.format(first=cluster.names[0], first_address=cluster.addresses[0], root=self.root,
                                          nodes=nodes.strip()))
        self.env = {**env, "SLURM_CONF": str(conf)}
        log = self.root / "daemons.log"
        # the key and socket are files on the shared filesystem: one munged, on node1, serves every node. In the
        # foreground, so that stopping it is the cluster's to do; --force: munged refuses to run as root otherwise
        self.munged = cluster.start(0, ["munged", "--foreground", "--force", f"--socket={self.root}/munge.socket",
                                        f"--key-file={key}", f"--pid-file={self.root}/munged.pid",
                                        f"--log-file={self.root}/munged.log", f"--seed-file={self.root}/munged.seed"],
                                    env, self.root / "munged.out")
        try:
            deadline = time.monotonic() + 30
            while not (self.root / "munge.socket").exists():
                assert time.monotonic() < deadline, "munged did not start"
                time.sleep(0.05)
            cluster.start(0, ["slurmctld", "-D", "-c"], self.env, log)
            for node, name in enumerate(cluster.names):
                cluster.start(node, ["slurmd", "-D", "-N", name], self.env, log)
            deadline = time.monotonic() + 60
            while self.command("sinfo", "--noheader", "--format=%T", check=False).strip() != "idle":
                assert time.monotonic() < deadline, "the SLURM nodes did not come up\n" + self.logs()
                time.sleep(0.2)
        except BaseException:
            self.close()
            raise

    def command(self, *argv: str, check=True) -> str:
        done = self.cluster.run(0, list(argv), self.env, timeout=60)
        if check and done.returncode != 0:
            raise AssertionError(f"{argv} exited {done.returncode}: {done.stderr}\n{self.logs()}")
        return done.stdout

    def logs(self) -> str:
        return "".join(f"--- {path.name}\n{path.read_text()[-2000:]}" for path in sorted(self.root.glob("*.log")))

    def close(self) -> None:
        """Cancels every job, then stops the daemons, munged last."""
        if self.munged.poll() is None:
            self.command("scancel", "--full", "--user=root", check=False)
        for node in reversed(range(len(self.cluster.names))):
            self.cluster.kill_node(node)


class Nodes:
    """A job of one command per node of ``cluster``, started ``apart`` seconds apart as on a real cluster; each node's
    output in ``<root>/nodeN.log``. ``cold``: the nodes' own caches start empty."""

    def __init__(self, cluster: Cluster, root: Path, commands: list, env, cwd: Path, cold=True, apart=1.1):
        self.cluster, self.logs = cluster, [root / f"{name}.log" for name in cluster.names[:len(commands)]]
        if cold:
            for node in range(len(commands)):
                shutil.rmtree(cluster.home(node) / ".cache", ignore_errors=True)
        self.procs = []
        for node, command in enumerate(commands):
            self.procs.append(cluster.start(node, command, env(node), self.logs[node], cwd=cwd))
            time.sleep(apart)  # a run folder named by the clock would differ from node to node

    def wait(self, timeout=300) -> list[int]:
        deadline = time.monotonic() + timeout
        try:
            return [proc.wait(max(1.0, deadline - time.monotonic())) for proc in self.procs]
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the job ran over {timeout} s\n{self.output()}") from None

    def wait_for(self, path: Path, timeout=300) -> None:
        """Polls until ``path`` exists; fails if a node's command ends first."""
        deadline = time.monotonic() + timeout
        while not path.exists():
            assert all(proc.poll() is None for proc in self.procs), f"ended before {path}\n{self.output()}"
            assert time.monotonic() < deadline, f"no {path} within {timeout} s\n{self.output()}"
            time.sleep(0.05)

    def output(self) -> str:
        return "".join(f"--- {log.name}\n{log.read_text()[-4000:]}" for log in self.logs)

    def train_py(self, node: int) -> list[int]:
        """The processes on ``node`` that run train.py itself (not a launcher that runs it in a child)."""
        def runs_train_py(pid: int) -> bool:
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
            except OSError:
                return False
            return any(arg.endswith("train.py") for arg in argv[1:3]) and "nsenter" not in argv[0]
        return [pid for pid in self.cluster.pids(node) if runs_train_py(pid)]
