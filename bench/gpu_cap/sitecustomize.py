"""Caps each process's CUDA memory at GPU_CHECK_MEMORY_FRACTION of its GPU, for bench/gpu_check.py's "bigger than one
device" rows: Python imports this file at start-up when that folder is on PYTHONPATH, and the ranks a launcher
starts inherit both, so every rank is capped before it allocates anything."""

import os

if os.environ.get("GPU_CHECK_MEMORY_FRACTION"):
    import torch

    torch.cuda.set_per_process_memory_fraction(float(os.environ["GPU_CHECK_MEMORY_FRACTION"]),
                                               int(os.environ.get("LOCAL_RANK", 0)))
