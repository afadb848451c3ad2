"""Installing onto a torch that is already there, and offline: scripts/wheelhouse.sh fills a folder on a machine with
access, scripts/setup.sh --wheelhouse installs from it alone, and keeps a torch of requirements.txt's range."""

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.tags import sys_tags

from conftest import REPO, SMALL_DEMO, copy_repo, subprocess_env

TORCH_RANGE = re.search(r"^(torch[<>=].*)$", (REPO / "requirements.txt").read_text(), re.MULTILINE).group(1)
TORCH_PIN = re.search(r"^torch==(.*)$", (REPO / "requirements-torch.txt").read_text(), re.MULTILINE).group(1)


def offline_pip_env() -> dict:
    """pip with no configuration file (this machine's names local wheel folders and indexes) and every connection
    sent to a closed port: only the flags the scripts give say where packages come from."""
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "https_proxy": "http://127.0.0.1:9",
           "http_proxy": "http://127.0.0.1:9", "PIP_NO_COMPILE": "1"}  # .pyc files get written on first import
    for name in [name for name in env if name.startswith("PIP_") and name not in ("PIP_CONFIG_FILE", "PIP_NO_COMPILE")]:
        env.pop(name)
    return env


def bash(command: list, cwd: Path, env: dict, check=True) -> subprocess.CompletedProcess:
    result = subprocess.run(["bash", *command], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    if check and result.returncode != 0:
        raise AssertionError(f"{command} exited {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def test_a_wheelhouse_installs_offline_onto_the_torch_in_the_venv_and_the_demo_runs(tmp_path):
    wheelhouse = tmp_path / "wheelhouse"
    # named as for another machine: this one's Python and newest manylinux tag
    target = ["--python-version", f"{sys.version_info.major}.{sys.version_info.minor}",
              "--platform", next(tag.platform for tag in sys_tags() if tag.platform.startswith("manylinux"))]
    # this machine's pip as it is (the machine with access); the CPU build keeps the folder small
    bash(["scripts/wheelhouse.sh", str(wheelhouse), *target], cwd=REPO, env={**os.environ, "TORCH_BUILD": "cpu"})
    assert list(wheelhouse.glob("deepspeed-*-py3-none-any.whl")), "DeepSpeed's wheel was not built"
    assert list(wheelhouse.glob(f"torch-{TORCH_PIN}*.whl"))

    repo = copy_repo(tmp_path / "repo")
    env = offline_pip_env()
    venv_python = repo / ".venv" / "bin" / "python"
    subprocess.run([sys.executable, "-m", "venv", str(repo / ".venv")], check=True)
    subprocess.run([str(venv_python), "-m", "pip", "install", "--quiet", "--no-index", "--find-links", str(wheelhouse),
                    f"torch=={TORCH_PIN}"], env=env, check=True)
    torch_init = next((repo / ".venv" / "lib").glob("python3*/site-packages/torch/__init__.py"))
    before = torch_init.stat()

    setup = bash(["scripts/setup.sh", "--wheelhouse", str(wheelhouse)], cwd=repo, env=env)
    site_packages = torch_init.parents[1]
    assert f"keeping torch {TORCH_PIN}+cpu ({site_packages}): within {TORCH_RANGE}" in setup.stdout.splitlines()
    after = torch_init.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns), "torch was reinstalled"
    check = subprocess.run([str(venv_python), "-m", "pip", "check"], env=env, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout

    demo_env = {**subprocess_env(), "PYTHONPATH": ""}  # only the new venv's packages
    demo = subprocess.run([str(venv_python), "train.py", *SMALL_DEMO, "--out-dir", str(tmp_path / "run")],
                          cwd=repo, env=demo_env, capture_output=True, text=True, timeout=600)
    assert demo.returncode == 0, demo.stderr[-3000:]
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["environment"]["torch"] == f"{TORCH_PIN}+cpu" and results["test_examples"] == 201


def scripts_only(tmp_path: Path) -> Path:
    """What setup.sh reads, in a folder of its own: its .venv is the test's to make."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy2(REPO / "scripts" / "setup.sh", repo / "scripts")
    for requirements in REPO.glob("requirements*.txt"):
        shutil.copy2(requirements, repo)
    return repo


def python_with_torch(folder: Path, version: str) -> Path:
    """A venv whose torch is only its record (importlib.metadata reads the version from it): what setup.sh checks,
    without installing a torch. It borrows this machine's pip from the Python that made it."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(folder)], check=True)
    site_packages = next((folder / "lib").glob("python3*")) / "site-packages"
    record = site_packages / f"torch-{version}.dist-info"
    record.mkdir(parents=True)
    (record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    return folder / "bin" / "python"


def dry_setup(repo: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return bash(["scripts/setup.sh", *args], cwd=repo, env={**os.environ, "DRY_RUN": "1", **env}, check=False)


@pytest.mark.parametrize(("version", "kept"), [("2.7.0", True), ("2.9.1+cu128", True), ("2.6.0", False),
                                               ("3.0.0", False)])
def test_setup_keeps_a_torch_in_the_venv_within_the_range_and_refuses_one_outside(tmp_path, version, kept):
    repo = scripts_only(tmp_path)
    python_with_torch(repo / ".venv", version)
    result = dry_setup(repo)
    if kept:
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines()[0].startswith(f"keeping torch {version} (")
        assert not [line for line in result.stdout.splitlines() if "torch==" in line]
        assert any(line.endswith("install --quiet -r requirements-dev.txt") for line in result.stdout.splitlines())
    else:
        assert result.returncode == 2
        assert result.stderr.strip() == (f"torch {version} ({next(repo.glob('.venv/lib/python3*/site-packages'))}) "
                                          f"is outside {TORCH_RANGE}: upgrade it, or remove .venv for a fresh install")


def test_setup_builds_the_venv_on_the_torch_of_the_python_it_is_given(tmp_path):
    """A cluster's module or container brings a Python with its own CUDA torch: .venv sees its packages."""
    repo = scripts_only(tmp_path)
    cluster_python = python_with_torch(tmp_path / "cluster", "2.8.0")
    result = dry_setup(repo, PYTHON=str(cluster_python))
    assert result.stdout.splitlines()[0] == f"{cluster_python} -m venv --system-site-packages .venv"


@pytest.mark.parametrize(("torch_build", "gpu", "expected"), [
    (None, True, "cuda"), (None, False, "cpu"), ("cuda", False, "cuda"), ("cpu", True, "cpu")])
def test_setup_picks_the_torch_build_where_there_is_none(tmp_path, torch_build, gpu, expected):
    """Where nvidia-smi lists a GPU, PyPI's CUDA build; else the CPU index; TORCH_BUILD overrides both (a login
    node without GPUs building for GPU nodes). A fake nvidia-smi stands in for the hardware; DRY_RUN installs nothing."""
    repo = scripts_only(tmp_path)
    (tmp_path / "nvidia-smi").write_text(f"#!/bin/sh\nexit {0 if gpu else 9}\n")  # 9: driver present, no GPU
    (tmp_path / "nvidia-smi").chmod(0o755)
    env = {"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "TORCH_BUILD": torch_build or "auto"}
    commands = dry_setup(repo, "requirements-bench.txt", **env).stdout.splitlines()
    torch_install = next(line for line in commands if f" torch=={TORCH_PIN}" in line)
    assert ("download.pytorch.org/whl/cpu" in torch_install) == (expected == "cpu")
    assert commands[-2].endswith("-r requirements-bench.txt")  # the extras still follow


def test_setup_says_what_it_installs_as_it_goes(tmp_path):
    result = dry_setup(scripts_only(tmp_path), "requirements-bench.txt", TORCH_BUILD="cpu")
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        "setup: creating .venv with python3",
        f"setup: installing torch=={TORCH_PIN}, the cpu build (a minute or more: a large wheel)",
        "setup: installing requirements-dev.txt: Lightning, transformers, datasets, DeepSpeed, peft and the rest, and "
        "pytest",
        "setup: installing requirements-bench.txt"]


def test_setup_refuses_an_unknown_torch_build(tmp_path):
    result = dry_setup(scripts_only(tmp_path), TORCH_BUILD="rocm")
    assert result.returncode == 2 and result.stderr.strip() == "TORCH_BUILD must be cuda, cpu or auto, not 'rocm'"


def test_setup_from_a_wheelhouse_asks_no_index(tmp_path):
    """pip resolves torch and every requirement file from the wheelhouse alone, then installs exactly that with
    --require-hashes."""
    repo = scripts_only(tmp_path)
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "requirements-hashes.txt").write_text("")
    commands = dry_setup(repo, "--wheelhouse", str(tmp_path / "wheels"), "requirements-bench.txt").stdout.splitlines()
    installs = [line for line in commands if " pip install " in line]
    assert len(installs) == 2 and " --dry-run --report " in installs[0]
    assert installs[0].endswith(f" torch=={TORCH_PIN} -r requirements-dev.txt -r requirements-bench.txt")
    assert " --require-hashes --no-deps -r " in installs[1]
    assert all(f"--no-index --find-links {tmp_path / 'wheels'}" in line for line in installs)
    assert not [line for line in installs if "download.pytorch.org" in line]
    from_env = dry_setup(repo, WHEELHOUSE=str(tmp_path / "wheels")).stdout.splitlines()
    assert next(line for line in from_env if " --dry-run " in line).endswith(
        f" torch=={TORCH_PIN} -r requirements-dev.txt")


def test_a_wheelhouse_without_recorded_hashes_is_refused(tmp_path):
    (tmp_path / "wheels").mkdir()
    result = dry_setup(scripts_only(tmp_path), "--wheelhouse", str(tmp_path / "wheels"))
    assert result.returncode == 2 and result.stderr.splitlines() == [
        f"the wheelhouse '{tmp_path / 'wheels'}' records no SHA-256 of its wheels (requirements-hashes.txt): fill it "
        f"with scripts/wheelhouse.sh DIR"]


@pytest.mark.parametrize(("script", "args", "message"), [
    ("setup.sh", ["--wheelhouse", "/nonexistent"], "the wheelhouse '/nonexistent' is not a folder: fill one with "
                                                   "scripts/wheelhouse.sh DIR"),
    ("setup.sh", ["--wheelhouse"], "--wheelhouse needs a folder: scripts/setup.sh --wheelhouse DIR"),
    ("wheelhouse.sh", [], "usage: bash scripts/wheelhouse.sh DIR [--python-version X.Y] [--platform TAG]... "
                          "[requirement files]"),
    ("wheelhouse.sh", ["/tmp/wh", "--abi", "cp311"], "unknown option --abi: give --python-version X.Y, --platform TAG "
                                                     "or requirement files"),
    ("wheelhouse.sh", ["/tmp/wh", "--platform"], "--platform needs a value"),
    ("wheelhouse.sh", ["/tmp/wh", "requirements-gpu.txt"], "no requirement file requirements-gpu.txt: name one that "
                                                           "exists, e.g. requirements-bench.txt"),
])
def test_bad_input_gets_one_line_saying_what_to_change(script, args, message):
    result = bash([f"scripts/{script}", *args], cwd=REPO, env={**os.environ, "DRY_RUN": "1"}, check=False)
    assert result.returncode == 2 and result.stderr.strip() == message


def test_the_install_page_states_the_range_and_the_torch_setup_installs():
    page = (REPO / "docs" / "install.md").read_text()
    assert f"`{TORCH_RANGE}`" in page and f"within {TORCH_RANGE}`" in page
    assert f"`requirements-torch.txt`'s ({TORCH_PIN}, the version CI tests)" in page


def write_wheel(folder: Path, name: str, requires=()) -> Path:
    """A pure-Python wheel of package ``name`` 1.0, made by hand: what pip needs of one."""
    dist = f"{name}-1.0.dist-info"
    files = {f"{name}/__init__.py": "",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"
                                 + "".join(f"Requires-Dist: {r}\n" for r in requires),
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{dist}/RECORD"])
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for member, text in files.items():
            wheel.writestr(member, text)
    return path


def test_an_offline_install_checks_each_wheel_against_the_hash_the_wheelhouse_recorded(tmp_path):
    """scripts/wheelhouse.sh records every wheel's SHA-256; setup.sh installs what pip resolves with
    --require-hashes, and a wheel changed since stops it with one line, before anything is installed."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    write_wheel(wheels, "fabtpl_app", requires=["fabtpl_dep"])
    dep = write_wheel(wheels, "fabtpl_dep")
    bash(["scripts/wheelhouse.sh", "--hashes", str(wheels)], cwd=REPO, env=os.environ)
    assert sorted(line.split()[0] for line in (wheels / "requirements-hashes.txt").read_text().splitlines()) == [
        "fabtpl_app==1.0", "fabtpl_dep==1.0"]
    recorded = dep.read_bytes()
    with zipfile.ZipFile(dep, "a") as wheel:  # changed since: one more file in it
        wheel.writestr("fabtpl_dep/planted.py", "import os\n")

    repo = scripts_only(tmp_path)
    (repo / "requirements-dev.txt").write_text("fabtpl_app\n")
    python_with_torch(repo / ".venv", "2.9.1")  # kept: only the wheelhouse's own packages are installed
    installed = repo / ".venv" / "bin" / "python"
    setup = bash(["scripts/setup.sh", "--wheelhouse", str(wheels)], cwd=repo, env=offline_pip_env(), check=False)
    said = [line for line in setup.stderr.splitlines() if not line.startswith("setup: ")]  # not its progress lines
    assert setup.returncode == 2 and said == [
        f"{dep} is not the wheel scripts/wheelhouse.sh recorded (its SHA-256 differs): it changed since; fill the "
        f"wheelhouse again from a source you trust"], setup.stderr
    listed = subprocess.run([str(installed), "-m", "pip", "list"], capture_output=True, text=True).stdout
    assert "fabtpl" not in listed

    dep.write_bytes(recorded)
    setup = bash(["scripts/setup.sh", "--wheelhouse", str(wheels)], cwd=repo, env=offline_pip_env(), check=False)
    assert not [line for line in setup.stderr.splitlines() if "SHA-256" in line and not line.startswith("setup: ")]
    listed = subprocess.run([str(installed), "-m", "pip", "list"], capture_output=True, text=True).stdout
    assert "fabtpl_app" in listed and "fabtpl_dep" in listed
