"""What only a CUDA GPU can show: fp16 with loss scaling, real DeepSpeed kernels, NCCL, float8 matrix products.
Skipped without CUDA."""

import json
import sys

import pytest
import torch

from conftest import SMALL_DEMO, build_fabric_from_flags, logged, run, train

pytestmark = pytest.mark.gpu


def test_auto_precision_on_this_gpu():
    fabric = build_fabric_from_flags("--accelerator", "cuda", "--devices", "1")
    native_bf16 = torch.cuda.get_device_capability() >= (8, 0)  # Ampere and later; V100 (7.0), T4 (7.5) emulate it
    expected = "bf16-mixed" if native_bf16 else "16-mixed"
    assert fabric.strategy.precision.precision == expected


def test_fp16_mixed_uses_a_loss_scaler_and_trains(tmp_path):
    fabric = build_fabric_from_flags("--accelerator", "cuda", "--devices", "1", "--precision", "16-mixed")
    assert fabric.strategy.precision.scaler is not None
    # the whole demo, as test_train holds it to on CPU: the small slice stays near chance in any precision
    results = train(["--accelerator", "cuda", "--devices", "1", "--precision", "16-mixed", "--demo", "--quiet"],
                    tmp_path)
    assert results["precision"] == "16-mixed" and results["test_acc"] >= 0.9


@pytest.mark.parametrize("strategy", ["deepspeed_stage_2", "deepspeed_stage_3"])
def test_deepspeed_on_gpu_without_the_cpu_shim(tmp_path, strategy):
    results = train(["--accelerator", "cuda", "--devices", "1", "--strategy", strategy, *SMALL_DEMO], tmp_path)
    assert results["strategy"] == "DeepSpeedStrategy"
    assert (tmp_path / "model" / "model.safetensors").exists()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_ddp_over_nccl(tmp_path):
    results = train(["--accelerator", "cuda", "--devices", "2", "--strategy", "ddp", *SMALL_DEMO], tmp_path)
    assert results["world_size"] == 2 and results["test_examples"] == 201


def test_compile_on_gpu(tmp_path):
    results = train(["--accelerator", "cuda", "--devices", "1", "--compile", *SMALL_DEMO], tmp_path)
    assert results["test_examples"] == 201


def seconds_per_step_after_the_first(out_dir) -> float:
    clock = logged(out_dir, "time")
    first, last = min(clock), max(clock)
    return (clock[last] - clock[first]) / (last - first)


def test_bf16_on_length_grouped_batches_keeps_pace_with_fp32(tmp_path):
    # nearly every length-grouped batch has a new shape, which an attention kernel that plans per shape pays every step
    flags = ["--accelerator", "cuda", "--devices", "1", "--demo", "--train-size", "1500", "--val-size", "64",
             "--test-size", "64", "--max-length", "256", "--batch-size", "32", "--log-every", "1", "--quiet"]
    per_step = {}
    for precision in ("32-true", "bf16-mixed"):
        train([*flags, "--precision", precision], tmp_path / precision)
        per_step[precision] = seconds_per_step_after_the_first(tmp_path / precision)
    assert per_step["bf16-mixed"] < 2.5 * per_step["32-true"], per_step


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs float8 matrix products: compute capability 8.9+ (H100, H200, L40S)")
@pytest.mark.parametrize("extra", [[], ["--strategy", "fsdp2"], ["--compile"]], ids=["one-device", "fsdp2", "compile"])
def test_fp8_mixed_trains_the_demo_as_bf16_mixed_does(tmp_path, extra):
    flags = ["--accelerator", "cuda", "--devices", "1", *extra, "--demo", "--log-every", "1", "--quiet"]
    printed = {precision: run([sys.executable, "train.py", *flags, "--precision", precision, "--out-dir",
                               str(tmp_path / precision)]).stdout for precision in ("bf16-mixed", "fp8-mixed")}
    assert "12 of 14 Linear layers compute in float8" in printed["fp8-mixed"]  # the demo's blocks: 6 a layer
    results = {precision: json.loads((tmp_path / precision / "results.json").read_text()) for precision in printed}
    losses = {precision: list(logged(tmp_path / precision, "train/loss").values()) for precision in results}
    assert len(losses["fp8-mixed"]) == len(losses["bf16-mixed"]) >= 50
    # float8's rounding moves single steps; the curve, averaged over 10 steps, stays on bf16's
    for start in range(0, len(losses["bf16-mixed"]) - 9, 10):
        window = {precision: sum(values[start:start + 10]) / 10 for precision, values in losses.items()}
        assert abs(window["fp8-mixed"] - window["bf16-mixed"]) <= 0.05, (start, window)
    assert results["fp8-mixed"]["test_acc"] >= 0.9
    assert abs(results["fp8-mixed"]["test_acc"] - results["bf16-mixed"]["test_acc"]) <= 0.02
    assert results["fp8-mixed"]["config"]["precision"] == results["fp8-mixed"]["precision"] == "fp8-mixed"
