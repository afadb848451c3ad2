#!/usr/bin/env bash
# Fills a folder with wheels of everything scripts/setup.sh installs, on a machine with access, for one without:
# there, `bash scripts/setup.sh --wheelhouse DIR` installs from it alone. DeepSpeed is published as source only, so
# its wheel is built here, without compiled ops (DS_BUILD_OPS=0: it compiles the ones a run needs on first use there).
# torch: requirements-torch.txt's, PyPI's CUDA build (TORCH_BUILD=cuda, the default) or the PyTorch CPU index's
# (TORCH_BUILD=cpu: a small folder for a cluster that has its own torch, which setup.sh keeps; pip still needs one
# to resolve the packages that depend on it).
# Every wheel's SHA-256 goes into DIR/requirements-hashes.txt, which setup.sh checks each wheel it installs against:
# a wheel changed after this (a disk, a copy, a hand) stops the offline install. `--hashes DIR` records them again
# for a folder whose wheels were added by hand.
# Usage: [TORCH_BUILD=cuda|cpu] bash scripts/wheelhouse.sh DIR [--python-version 3.11] [--platform TAG]...
#        [extra requirement files, e.g. requirements-bench.txt]
#        bash scripts/wheelhouse.sh --hashes DIR
#        --python-version and --platform name the target machine where it differs from this one: its Python's X.Y,
#        and manylinux_2_N_ARCH for glibc 2.N (its `ldd --version`) on ARCH (`uname -m`), e.g. manylinux_2_28_x86_64.
set -euo pipefail
cd "$(dirname "$0")/.."

# DIR/requirements-hashes.txt: each wheel as name==version with its SHA-256, as pip's --require-hashes reads them
record_hashes() {
  python3 - "$1" <<'EOF'
import hashlib, pathlib, sys
from collections import defaultdict
folder, pins = pathlib.Path(sys.argv[1]), defaultdict(list)
for wheel in sorted(folder.glob("*.whl")):
    name, version = wheel.name.split("-")[:2]
    digest = hashlib.sha256()
    with open(wheel, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    pins[f"{name}=={version}"].append(digest.hexdigest())
(folder / "requirements-hashes.txt").write_text("".join(
    f"{pin} " + " ".join(f"--hash=sha256:{digest}" for digest in digests) + "\n" for pin, digests in pins.items()))
EOF
}

if [ "${1:-}" = --hashes ]; then
  [ $# -eq 2 ] && [ -d "$2" ] || { echo "--hashes needs the wheelhouse folder: bash scripts/wheelhouse.sh --hashes DIR" >&2; exit 2; }
  record_hashes "$2"
  exit 0
fi
if [ $# -lt 1 ] || [[ $1 == -* ]]; then
  echo "usage: bash scripts/wheelhouse.sh DIR [--python-version X.Y] [--platform TAG]... [requirement files]" >&2
  exit 2
fi
dir=$1
shift
target=()
extras=()
while [ $# -gt 0 ]; do
  case $1 in
    --python-version | --platform)
      [ $# -ge 2 ] || { echo "$1 needs a value" >&2; exit 2; }
      target+=("$1" "$2")
      # pip matches a platform tag exactly, but a machine with glibc 2.N installs every manylinux wheel up to 2.N
      # (manylinux2014 is 2.17, manylinux2010 2.12, manylinux1 2.5): name them all
      if [[ $1 == --platform && $2 =~ ^manylinux_2_([0-9]+)_(.+)$ ]]; then
        glibc=${BASH_REMATCH[1]} arch=${BASH_REMATCH[2]}
        for ((minor = glibc - 1; minor >= 5; minor--)); do target+=(--platform "manylinux_2_${minor}_$arch"); done
        for alias in 2014:17 2010:12 1:5; do
          if [ "$glibc" -ge "${alias#*:}" ]; then target+=(--platform "manylinux${alias%:*}_$arch"); fi
        done
      fi
      shift 2 ;;
    -*) echo "unknown option $1: give --python-version X.Y, --platform TAG or requirement files" >&2; exit 2 ;;
    *) [ -f "$1" ] || { echo "no requirement file $1: name one that exists, e.g. requirements-bench.txt" >&2; exit 2; }
       extras+=(-r "$1")
       shift ;;
  esac
done
case "${TORCH_BUILD:-cuda}" in
  cuda | cpu) ;;
  *) echo "TORCH_BUILD must be cuda or cpu, not '$TORCH_BUILD'" >&2; exit 2 ;;
esac
mkdir -p "$dir"

# a pure-Python wheel (py3-none-any): any target Python takes it
DS_BUILD_OPS=0 python3 -m pip wheel --quiet --no-deps --wheel-dir "$dir" "$(grep -E '^deepspeed' requirements.txt)"
download=(python3 -m pip download --quiet --only-binary :all: --dest "$dir" --find-links "$dir" "${target[@]}")
if [ "${TORCH_BUILD:-cuda}" = cpu ]; then
  "${download[@]}" --no-deps --retries 1 --extra-index-url https://download.pytorch.org/whl/cpu \
    "$(grep -E '^torch==' requirements-torch.txt)"
fi
# the rest from PyPI; requirements-torch.txt pins the torch pip resolves the others against (already here for cpu)
"${download[@]}" -c requirements-torch.txt -r requirements-dev.txt "${extras[@]}"
record_hashes "$dir"
echo "$(ls "$dir" | wc -l) wheels in $dir: on the offline machine, bash scripts/setup.sh --wheelhouse DIR"
