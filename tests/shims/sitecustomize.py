"""Test-only shims that let CUDA-only paths run on CPU, so they can be tested end to end on a machine without a GPU.
Never used outside tests. Each is switched on by its own environment variable.

FABRIC_TEMPLATE_DEEPSPEED_CPU=1 lets Fabric's DeepSpeed strategy run on CPU processes (gloo).
Fabric refuses DeepSpeed unless the accelerator is CUDA, checks that device indices match local ranks (CPU devices
have no index), and passes ``device_rank=None`` to ``deepspeed.initialize`` on CPU where DeepSpeed expects an int.
DeepSpeed itself runs ZeRO 2 and 3 on CPU tensors.

FABRIC_TEMPLATE_FP16_CPU=1 makes ``--precision 16-mixed`` on CPU real fp16 autocast with a loss scaler.

FABRIC_TEMPLATE_FP8_CPU=1 lets ``--precision fp8-mixed`` run on CPU: torch computes float8 matrix products there too
(slowly), so torchao's layers train through the whole loop where only an H100-class GPU is otherwise accepted.

FABRIC_TEMPLATE_COMPILE_EAGER=1 makes every ``torch.compile`` (train.py's --compile, the Trainer's torch_compile) use
the aot_eager backend: the graphs, guards, recompiles and forward/backward split Inductor gets, run without its minutes
of building kernels on a CPU (bench/gpu_check.py's dry run; tests/test_shapes.py compiles with Inductor itself).

Python imports this file at start-up when tests put this folder on PYTHONPATH and set a variable; child processes
started by Fabric inherit both, and so does every other Python subprocess, such as the one py-cpuinfo starts for
DeepSpeed's CPU Adam and whose stdout it parses as JSON: naming the accelerator (DS_ACCELERATOR) keeps DeepSpeed's
"Setting accelerator to CPU" warning off it. Each patch waits until its module is imported: importing DeepSpeed and
Lightning here made each of those py-cpuinfo processes (six per DeepSpeed run) take seconds instead of a fraction of
one.
"""

import importlib.abc
import os
import sys


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` right after ``name`` is first imported, in processes that import it at all."""

    def __init__(self):
        self.patches: dict[str, list] = {}

    def add(self, name: str, patch) -> None:
        self.patches.setdefault(name, []).append(patch)

    def find_spec(self, name, path, target=None):
        if name not in self.patches:
            return None
        spec = next(filter(None, (finder.find_spec(name, path, target) for finder in sys.meta_path
                                  if finder is not self and hasattr(finder, "find_spec"))), None)
        if spec is None:
            return None
        patches, exec_module = self.patches.pop(name), spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            for patch in patches:
                patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


_after_import = _AfterImport()
sys.meta_path.insert(0, _after_import)

if os.environ.get("FABRIC_TEMPLATE_DEEPSPEED_CPU") == "1":
    os.environ["DS_ACCELERATOR"] = "cpu"

    def patch_fabric_deepspeed(fabric_deepspeed):
        from lightning.fabric.accelerators import CPUAccelerator

        fabric_deepspeed.CUDAAccelerator = CPUAccelerator
        fabric_deepspeed._validate_device_index_selection = lambda devices: None

    def patch_deepspeed(deepspeed):
        _initialize = deepspeed.initialize

        def initialize(*args, **kwargs):
            if getattr(kwargs.get("args"), "device_rank", 0) is None:
                kwargs["args"].device_rank = -1
            return _initialize(*args, **kwargs)

        deepspeed.initialize = initialize

    _after_import.add("lightning.fabric.strategies.deepspeed", patch_fabric_deepspeed)
    _after_import.add("deepspeed", patch_deepspeed)

# fp16 autocast with loss scaling on CPU, so the 16-mixed path (scaler, skipped overflow steps) can be tested without a
# GPU. Fabric swaps 16-mixed for bf16-mixed on CPU behind a warning; torch itself has fp16 CPU autocast and a CPU
# GradScaler, so this undoes the swap. FABRIC_TEMPLATE_FP16_CPU_INIT_SCALE sets the scaler's first scale (torch's
# default 2**16): a huge one forces overflow steps.
if os.environ.get("FABRIC_TEMPLATE_FP16_CPU") == "1":

    def patch_precision(connector):
        _check_and_init_precision = connector._Connector._check_and_init_precision

        def check_and_init_precision(self):
            import torch
            from lightning.fabric.plugins.precision import MixedPrecision

            asked = self._precision_input
            plugin = _check_and_init_precision(self)
            if asked == "16-mixed" and type(plugin) is MixedPrecision and plugin.precision == "bf16-mixed":
                init_scale = float(os.environ.get("FABRIC_TEMPLATE_FP16_CPU_INIT_SCALE", 2.0**16))
                return MixedPrecision("16-mixed", device="cpu",
                                      scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))
            return plugin

        connector._Connector._check_and_init_precision = check_and_init_precision

    _after_import.add("lightning.fabric.connector", patch_precision)

if os.environ.get("FABRIC_TEMPLATE_FP8_CPU") == "1":

    def patch_fp8(fp8):
        fp8.has_float8_matmuls = lambda device: True

    _after_import.add("fabric_utils.fp8", patch_fp8)

if os.environ.get("FABRIC_TEMPLATE_COMPILE_EAGER") == "1":

    def patch_compile(torch):
        compile_ = torch.compile

        def compile_eagerly(model=None, **kwargs):
            return compile_(model, **{**kwargs, "backend": "aot_eager", "mode": None, "options": None})

        torch.compile = compile_eagerly

    _after_import.add("torch", patch_compile)
