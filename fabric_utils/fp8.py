"""``--precision fp8-mixed``: torchao's float8 matrix products in the model's blocks, the rest in Fabric's
bf16-mixed; loaded only when that flag asks."""

import importlib.util

import torch
from torch import nn

from fabric_utils.args import FP8, FSDP2
from fabric_utils.errors import UserError
from fabric_utils.progress import say
from fabric_utils.sharding import block_classes

# where torchao's float8 training composes: whole modules or fully_shard's, not flat parameters or an engine
STRATEGIES = ("auto", "ddp", "ddp_find_unused_parameters_true", FSDP2)


def check_fp8_supported(device: torch.device, strategy: str) -> None:
    """A one-line ``UserError`` where fp8-mixed cannot run."""
    if not has_float8_matmuls(device):
        here = f"this run is on the {device.type.upper()}"
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            here = f"the {torch.cuda.get_device_name(device)} is {major}.{minor}"
        raise UserError(f"--precision {FP8} needs an NVIDIA GPU with float8 matrix products, of compute capability "
                        f"8.9+ (H100, H200, L40S, RTX 4090), and {here}; use bf16-mixed")
    if strategy not in STRATEGIES:
        raise UserError(f"--precision {FP8} runs on one device or under --strategy ddp or {FSDP2}, not {strategy}")
    if importlib.util.find_spec("torchao") is None:
        raise UserError(f"--precision {FP8} needs torchao, which is not installed: pip install torchao")


def has_float8_matmuls(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def float8_eligible(model: nn.Module) -> set[nn.Linear]:
    """The Linear layers in the model's blocks with sides multiples of 16; outside them (pooler, head), float8's casts
    would cost more than they save."""
    blocks = block_classes(model, required=False)
    return {module for block in model.modules() if isinstance(block, blocks) for module in block.modules()
            if type(module) is nn.Linear and module.in_features % 16 == 0 and module.out_features % 16 == 0}


def convert_to_float8(model: nn.Module) -> None:
    """Swaps the eligible Linear layers for torchao's ``Float8Linear``, same parameters under the same names."""
    from torchao.float8 import convert_to_float8_training  # optional

    eligible = float8_eligible(model)
    if not eligible:
        raise UserError(f"--precision {FP8} found no Linear layer of {type(model).__name__}'s repeated blocks with "
                        f"sides that are multiples of 16; use bf16-mixed")
    convert_to_float8_training(model, module_filter_fn=lambda module, name: module in eligible)
    linear = sum(isinstance(module, nn.Linear) for module in model.modules())
    say(f"--precision {FP8}: {len(eligible)} of {linear} Linear layers compute in float8 (torchao), the rest in bf16")
