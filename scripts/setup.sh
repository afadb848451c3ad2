#!/usr/bin/env bash
# Creates .venv and installs the template (and pytest). torch comes as PyPI's CUDA build where an NVIDIA GPU
# answers, else from the PyTorch CPU index: a ~200 MB wheel instead of the multi-GB CUDA build. Clusters often build
# environments on login nodes without GPUs: there, say which build the compute nodes need with TORCH_BUILD.
# Usage: [TORCH_BUILD=cuda|cpu|auto] bash scripts/setup.sh [extra requirement files, e.g. requirements-bench.txt]
#        DRY_RUN=1 prints the commands instead of running them.
set -euo pipefail
cd "$(dirname "$0")/.."

run() { if [ "${DRY_RUN:-0}" = 1 ]; then echo "$*"; else "$@"; fi; }

torch_build() {
  case "${TORCH_BUILD:-auto}" in
    cuda | cpu) echo "$TORCH_BUILD" ;;
    auto) if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then echo cuda; else echo cpu; fi ;;
    *) echo "TORCH_BUILD must be cuda, cpu or auto, not '$TORCH_BUILD'" >&2; return 2 ;;
  esac
}

build=$(torch_build)
run python3 -m venv .venv
pip=(.venv/bin/python -m pip install --quiet)
torch_pin=$(grep -E '^torch==' requirements.txt)
if [ "$build" = cuda ]; then
  run "${pip[@]}" "$torch_pin"
else
  # torch alone (--no-deps), so only torch is looked up on the extra index; its dependencies come from PyPI next
  run "${pip[@]}" --retries 1 --no-deps --extra-index-url https://download.pytorch.org/whl/cpu "$torch_pin"
fi
run "${pip[@]}" -r requirements-dev.txt
for extra in "$@"; do run "${pip[@]}" -r "$extra"; done
run .venv/bin/python -c "import torch; print('torch', torch.__version__, 'cuda' if torch.cuda.is_available() else 'cpu')"
