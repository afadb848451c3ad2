#!/usr/bin/env bash
# Creates .venv and installs the template (and pytest). Without an NVIDIA GPU, torch comes from the PyTorch CPU
# index: a ~200 MB wheel instead of PyPI's multi-GB CUDA build. With one, PyPI's CUDA build is what GPUs need.
# Usage: bash scripts/setup.sh [extra requirement files, e.g. requirements-bench.txt]
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
pip=(.venv/bin/python -m pip install --quiet)
torch_pin=$(grep -E '^torch==' requirements.txt)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  "${pip[@]}" "$torch_pin"
else
  # torch alone (--no-deps), so only torch is looked up on the extra index; its dependencies come from PyPI next
  "${pip[@]}" --retries 1 --no-deps --extra-index-url https://download.pytorch.org/whl/cpu "$torch_pin"
fi
"${pip[@]}" -r requirements-dev.txt
for extra in "$@"; do "${pip[@]}" -r "$extra"; done
.venv/bin/python -c "import torch; print('torch', torch.__version__, 'cuda' if torch.cuda.is_available() else 'cpu')"
