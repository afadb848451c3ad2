"""Runs a training script (train.py, bench/hf_trainer.py) in this process and measures its optimizer steps as a
profiler does, writing one JSON to ``--out``: after ``--skip`` steps (warm-up, compiling), ``--timed`` steps timed by
CUDA events (wall clock on CPU), the last ``--steady`` of them the steady window, then ``--profiled`` steps under
torch.profiler: kernel launches (a CUDA graph's replay is one launch), host syncs, the fraction of the window the GPU
was busy, and the FLOPs of the matrix products the profiler saw (none inside CUDA graphs).

    python bench/profile_steps.py --out profile.json -- train.py --demo --accelerator cuda
"""

import argparse
import json
import runpy
import sys
import time
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
            "cudaLaunchCooperativeKernel")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
NOT_ON_CPU = "n/a (cpu)"
HOST_SIDE = ("Optimizer.step", "aten::_fused_adam", "DataLoader")  # where a CPU run reads host tensors


class StepProfiler:
    """Called after every optimizer step (``register_optimizer_step_post_hook``): times, then profiles, a window."""

    def __init__(self, out: Path, skip: int, timed: int, steady: int, profiled: int):
        self.out, self.skip, self.timed, self.steady, self.profiled = out, skip, timed, steady, profiled
        self.cuda = torch.cuda.is_available()
        self.step, self.marks, self.profiler, self.written = 0, [], None, False

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # queued: no wait for the GPU
        return event

    def __call__(self, optimizer, args, kwargs) -> None:
        self.step += 1
        if self.skip <= self.step <= self.skip + self.timed:
            self.marks.append(self.mark())
        if self.step == self.skip + self.timed:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self.profiler = profile(activities=activities, with_flops=True)
            self.profiler.start()
            self.window_start = time.perf_counter()
        elif self.profiler and self.step == self.skip + self.timed + self.profiled:
            if self.cuda:
                torch.cuda.synchronize()
            window = time.perf_counter() - self.window_start
            self.profiler.stop()
            self.write(self.profiler.events(), window)
            self.profiler = None

    def step_seconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]

    def write(self, events, window_s: float) -> None:
        steps = self.step_seconds()
        per_step = lambda count: count / self.profiled  # noqa: E731
        names = [event.name for event in events]
        flops = sum(event.flops or 0 for event in events)
        report = {"steps_timed": len(steps), "step_s": sum(steps) / len(steps),
                  "steady_steps": min(self.steady, len(steps)),
                  "steady_step_s": sum(steps[-self.steady:]) / len(steps[-self.steady:]),
                  "steps_profiled": self.profiled, "window_s": window_s,
                  "matmul_flops_per_step": per_step(flops) if flops else None,
                  "cuda_graphs": "cudaGraphLaunch" in names}
        if self.cuda:
            kernels = sorted((e.time_range.start, e.time_range.end) for e in events
                             if e.device_type == torch.autograd.DeviceType.CUDA)
            report.update(kernel_launches_per_step=per_step(sum(name in LAUNCHES for name in names)),
                          host_syncs_per_step=per_step(sum(name in SYNCS for name in names)),
                          gpu_busy=busy_us(kernels) / 1e6 / window_s)
        else:  # a CPU device: no kernels nor a GPU to wait for; values read back are what would sync a GPU, but for
            # reads of host tensors (the optimizer's step counts, the loader's batches)
            reads = [e for e in events if e.name == "aten::_local_scalar_dense" and not host_side(e)]
            report.update(kernel_launches_per_step=NOT_ON_CPU, gpu_busy=NOT_ON_CPU,
                          host_syncs_per_step=per_step(len(reads)))
        self.out.write_text(json.dumps(report, indent=2))
        self.written = True


def host_side(event) -> bool:
    while event is not None:
        if any(part in event.name for part in HOST_SIDE):
            return True
        event = event.cpu_parent
    return False


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of sorted (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in intervals:
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--skip", type=int, default=20, help="optimizer steps left out first (warm-up, compiling)")
    p.add_argument("--timed", type=int, default=50, help="optimizer steps timed after those")
    p.add_argument("--steady", type=int, default=30, help="the last of the timed steps: the steady window")
    p.add_argument("--profiled", type=int, default=10, help="optimizer steps profiled after the timed ones")
    p.add_argument("script", help="the training script and its flags, after --")
    p.add_argument("flags", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    profiler = StepProfiler(args.out, args.skip, args.timed, args.steady, args.profiled)
    register_optimizer_step_post_hook(profiler)
    sys.argv = [args.script, *args.flags]
    sys.path.insert(0, str(ROOT))
    runpy.run_path(str(ROOT / args.script), run_name="__main__")
    if not profiler.written:
        sys.exit(f"profile_steps: the run took {profiler.step} optimizer steps, fewer than the "
                 f"{args.skip + args.timed + args.profiled} measured (--skip, --timed, --profiled)")


if __name__ == "__main__":
    main()
