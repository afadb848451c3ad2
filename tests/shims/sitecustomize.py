"""Test-only shim: lets Fabric's DeepSpeed strategy run on CPU processes (gloo), so the DeepSpeed flags can be
tested end to end on a machine without a GPU. Never used outside tests.

Fabric refuses DeepSpeed unless the accelerator is CUDA, checks that device indices match local ranks (CPU devices
have no index), and passes ``device_rank=None`` to ``deepspeed.initialize`` on CPU where DeepSpeed expects an int.
DeepSpeed itself runs ZeRO 2 and 3 on CPU tensors. Python imports this file at start-up when tests put this folder
on PYTHONPATH and set FABRIC_TEMPLATE_DEEPSPEED_CPU=1; child processes started by Fabric inherit both.

So does every other Python subprocess, such as the one py-cpuinfo starts for DeepSpeed's CPU Adam and whose
stdout it parses as JSON: naming the accelerator keeps DeepSpeed's "Setting accelerator to CPU" warning off it.
"""

import os

if os.environ.get("FABRIC_TEMPLATE_DEEPSPEED_CPU") == "1":
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import lightning.fabric.strategies.deepspeed as fabric_deepspeed
    from lightning.fabric.accelerators import CPUAccelerator

    fabric_deepspeed.CUDAAccelerator = CPUAccelerator
    fabric_deepspeed._validate_device_index_selection = lambda devices: None
    _initialize = deepspeed.initialize

    def initialize(*args, **kwargs):
        if getattr(kwargs.get("args"), "device_rank", 0) is None:
            kwargs["args"].device_rank = -1
        return _initialize(*args, **kwargs)

    deepspeed.initialize = initialize
