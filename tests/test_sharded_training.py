"""Sharded and mixed-precision paths that used to train silently differently or refuse to start: fsdp2's precision
under auto and what its collectives move under bf16-mixed (tests/fsdp2_precision_probe.py), the dtype ZeRO accumulates
in. (Sharded weights' decay: test_safe_checkpoints.py, on its fsdp2 run; --compile under DeepSpeed:
test_deepspeed.py, on its probe.)"""

import json
import sys

import pytest
import torch

from conftest import build_fabric_from_flags, fake_gpu, run
from fabric_utils import launcher
from fabric_utils.errors import UserError

def test_auto_precision_on_a_gpu_without_bf16_is_one_fsdp2_runs(monkeypatch):
    """fsdp2 (Fabric's ModelParallelStrategy) has no loss scaler and refuses 16-mixed, which auto used to pick on
    GPUs without native bf16 (V100, T4): the default flags did not start there."""
    fake_gpu(monkeypatch, native_bf16=False)
    auto = {"accelerator": "cuda", "devices": "1", "precision": "auto"}
    picked = launcher.resolve_launch_settings({**auto, "strategy": launcher.FSDP2})["precision"]
    assert launcher.resolve_launch_settings({**auto, "strategy": "ddp"})["precision"] == "16-mixed"
    monkeypatch.undo()  # the strategy accepts or refuses a precision whatever the device: check it on this CPU
    launcher.build_fabric(accelerator="cpu", devices="1", strategy=launcher.FSDP2, precision=picked)
    with pytest.raises(UserError, match="does not support"):
        launcher.build_fabric(accelerator="cpu", devices="1", strategy=launcher.FSDP2, precision="16-mixed")


@pytest.mark.gpu
def test_fsdp2_starts_with_the_default_precision_on_this_gpu():
    fabric = build_fabric_from_flags("--accelerator", "cuda", "--devices", "1", "--strategy", "fsdp2")
    native_bf16 = torch.cuda.get_device_capability() >= (8, 0)
    assert fabric.strategy.precision.precision == ("bf16-mixed" if native_bf16 else "32-true")


def test_fsdp2_bf16_mixed_gathers_bf16_weights_and_reduces_fp32_gradients(tmp_path):
    """Without a MixedPrecisionPolicy FSDP2 gathered the fp32 weights, twice the bytes of the bf16 autocast computes
    in. Training still matches one process under the same autocast on the same rows."""
    out = tmp_path / "probe.json"
    run([sys.executable, "tests/fsdp2_precision_probe.py", "bf16-mixed", str(out)])
    found = json.loads(out.read_text())
    assert set(found["gathered"]) == {"torch.bfloat16"} and set(found["reduced"]) == {"torch.float32"}
    assert found["losses"] == pytest.approx(found["reference_losses"], rel=2e-2)


@pytest.mark.parametrize("strategy, precision, accumulates_in", [
    ("deepspeed_stage_2", "bf16-mixed", "fp32"), ("deepspeed_stage_3_offload", "bf16-true", "fp32"),
    ("deepspeed_stage_2", "32-true", None), ("deepspeed_stage_1", "bf16-mixed", None)])
def test_zero_2_and_3_accumulate_bf16_gradients_in_fp32(deepspeed_accepts_cpu, strategy, precision, accumulates_in):
    """DeepSpeed accumulates micro-batch gradients in the weights' dtype unless its config says otherwise: bf16
    gradient shards under --grad-accum rounded the sum at every micro-batch. (ZeRO-1 would swap in DeepSpeed's
    BF16_Optimizer, whose checkpoints zero_to_fp32 cannot export.)"""
    fabric = launcher.build_fabric(accelerator="cpu", devices="2", strategy=strategy, precision=precision)
    assert fabric.strategy.config.get("data_types", {}).get("grad_accum_dtype") == accumulates_in
