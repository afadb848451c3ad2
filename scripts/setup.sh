#!/usr/bin/env bash
# Creates .venv and installs the template (and pytest) onto a torch within requirements.txt's range: one already in
# .venv, or the one of the Python that creates it (a cluster's module or container, whose CUDA build must stay: .venv
# then sees that Python's packages), is kept. Only where there is none does it install requirements-torch.txt's:
# PyPI's CUDA build where an NVIDIA GPU answers, else the PyTorch CPU index's, a ~200 MB wheel instead of several GB
# of CUDA libraries the machine can't use. Clusters often build environments on login nodes without GPUs: there, say
# which build the compute nodes need with TORCH_BUILD. Offline, --wheelhouse DIR (or WHEELHOUSE=DIR) installs
# everything from a folder that scripts/wheelhouse.sh filled on a machine with access, each wheel checked against the
# SHA-256 it recorded (pip's --require-hashes): a wheel changed since stops the install with one line.
# Usage: [TORCH_BUILD=cuda|cpu|auto] [PYTHON=python3] bash scripts/setup.sh [--wheelhouse DIR] [extra requirement files]
#        DRY_RUN=1 prints the commands instead of running them.
set -euo pipefail
cd "$(dirname "$0")/.."

run() { if [ "${DRY_RUN:-0}" = 1 ]; then echo "$*"; else "$@"; fi; }
# what it is doing, on stderr (stdout keeps the commands DRY_RUN prints): pip runs --quiet for minutes at a time
say() { echo "setup: $*" >&2; }

torch_build() {
  case "${TORCH_BUILD:-auto}" in
    cuda | cpu) echo "$TORCH_BUILD" ;;
    auto) if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then echo cuda; else echo cpu; fi ;;
    *) echo "TORCH_BUILD must be cuda, cpu or auto, not '$TORCH_BUILD'" >&2; return 2 ;;
  esac
}

# Prints the torch version this Python sees and where; exits 1 where it has none, 3 where it is outside the range.
torch_of() {
  "$1" - "$torch_range" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pip._vendor.packaging.specifiers import SpecifierSet  # pip's own version rules; every venv has pip
try:
    torch = distribution("torch")
except PackageNotFoundError:
    sys.exit(1)
print(torch.version, torch.locate_file(""))
sys.exit(0 if SpecifierSet(sys.argv[1].removeprefix("torch")).contains(torch.version, prereleases=True) else 3)
EOF
}

# Reads pip's --report of what it would install from the wheelhouse; prints each wheel pinned to the SHA-256 that
# scripts/wheelhouse.sh recorded, or stops (one line, status 2) at a wheel that does not match it or has none.
pin_wheels() {
  .venv/bin/python - "$1" "$2" > "$3" <<'EOF'
import hashlib, json, re, sys
from pathlib import Path
from urllib.parse import unquote, urlparse
report, folder = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
canonical = lambda name: re.sub(r"[-_.]+", "-", name).lower()
def refuse(line):
    print(line, file=sys.stderr)
    sys.exit(2)
recorded = {}
for line in (folder / "requirements-hashes.txt").read_text().splitlines():
    pin, *hashes = line.split()
    name, version = pin.split("==")
    recorded[canonical(name), version] = [h.removeprefix("--hash=sha256:") for h in hashes]
for item in report["install"]:
    wheel = Path(unquote(urlparse(item["download_info"]["url"]).path))
    name, version = wheel.name.split("-")[:2]
    with open(wheel, "rb") as f:
        found = hashlib.file_digest(f, "sha256").hexdigest()
    digests = recorded.get((canonical(name), version))
    if digests is None:
        refuse(f"{wheel} has no SHA-256 in {folder}/requirements-hashes.txt: fill the wheelhouse with "
                 f"scripts/wheelhouse.sh, or record a wheel you trust with scripts/wheelhouse.sh --hashes {folder}")
    if found not in digests:
        refuse(f"{wheel} is not the wheel scripts/wheelhouse.sh recorded (its SHA-256 differs): it changed since; "
                 f"fill the wheelhouse again from a source you trust")
    print(f"{name}=={version} " + " ".join(f"--hash=sha256:{digest}" for digest in digests))
EOF
}

wheelhouse=${WHEELHOUSE:-}
if [ "${1:-}" = --wheelhouse ]; then
  [ $# -ge 2 ] || { echo "--wheelhouse needs a folder: scripts/setup.sh --wheelhouse DIR" >&2; exit 2; }
  wheelhouse=$2
  shift 2
fi
if [ -n "$wheelhouse" ] && [ ! -d "$wheelhouse" ]; then
  echo "the wheelhouse '$wheelhouse' is not a folder: fill one with scripts/wheelhouse.sh DIR" >&2
  exit 2
fi
if [ -n "$wheelhouse" ] && [ ! -f "$wheelhouse/requirements-hashes.txt" ]; then
  echo "the wheelhouse '$wheelhouse' records no SHA-256 of its wheels (requirements-hashes.txt): fill it with" \
    "scripts/wheelhouse.sh DIR" >&2
  exit 2
fi

build=$(torch_build)
torch_range=$(grep -E '^torch[<>=]' requirements.txt)
python=${PYTHON:-python3}
if [ ! -e .venv/bin/python ]; then
  venv=(-m venv .venv)
  if torch_of "$python" >/dev/null; then venv=(-m venv --system-site-packages .venv); fi
  say "creating .venv with $python"
  run "$python" "${venv[@]}"
fi
pip=(.venv/bin/python -m pip install --quiet)
if [ -n "$wheelhouse" ]; then pip+=(--no-index --find-links "$wheelhouse"); fi
requirements=(-r requirements-dev.txt)
for extra in "$@"; do requirements+=(-r "$extra"); done
found=$(torch_of .venv/bin/python) && status=0 || status=$?
if [ "$status" = 0 ]; then
  echo "keeping torch ${found% *} (${found#* }): within $torch_range"
elif [ "$status" = 3 ]; then
  echo "torch ${found% *} (${found#* }) is outside $torch_range: upgrade it, or remove .venv for a fresh install" >&2
  exit 2
else
  torch_pin=$(grep -E '^torch==' requirements-torch.txt)
  say "installing $torch_pin, the $build build${wheelhouse:+ from $wheelhouse} (a minute or more: a large wheel)"
  if [ -n "$wheelhouse" ]; then
    requirements=("$torch_pin" "${requirements[@]}")
  elif [ "$build" = cuda ]; then
    run "${pip[@]}" "$torch_pin"
  else
    # torch alone (--no-deps), so only torch is looked up on the extra index; its dependencies come from PyPI next
    run "${pip[@]}" --retries 1 --no-deps --extra-index-url https://download.pytorch.org/whl/cpu "$torch_pin"
  fi
fi
if [ -n "$wheelhouse" ]; then  # what pip resolves from the wheelhouse, then exactly that, each wheel's hash checked
  say "installing what requirements-dev.txt${*:+ and $*} need from $wheelhouse, each wheel checked against its SHA-256"
  pinned=$(mktemp)
  run "${pip[@]}" --dry-run --report "$pinned.json" "${requirements[@]}"
  run pin_wheels "$pinned.json" "$wheelhouse" "$pinned"
  if [ "${DRY_RUN:-0}" = 1 ] || [ -s "$pinned" ]; then run "${pip[@]}" --require-hashes --no-deps -r "$pinned"; fi
  rm -f "$pinned" "$pinned.json"
else
  for requirement in "${requirements[@]}"; do
    [ "$requirement" = -r ] && continue
    if [ "$requirement" = requirements-dev.txt ]; then
      say "installing requirements-dev.txt: Lightning, transformers, datasets, DeepSpeed, peft and the rest, and pytest"
    else
      say "installing $requirement"
    fi
    run "${pip[@]}" -r "$requirement"
  done
fi
run .venv/bin/python -c "import torch; print('torch', torch.__version__, 'cuda' if torch.cuda.is_available() else 'cpu')"
