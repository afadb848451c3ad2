"""--precision fp8-mixed: refused in one line where float8 cannot run, and which layers torchao's float8 takes over
(tests/test_gpu.py trains it; bench/gpu_check.py's dry run trains it on CPU through the tests' shim)."""

import importlib.util
import sys

import pytest
import torch
from torch import nn

from conftest import run
from fabric_utils import fp8, launcher
from fabric_utils.errors import UserError


def test_fp8_on_a_cpu_is_refused_in_one_line_before_anything_is_written(tmp_path):
    out = tmp_path / "run"
    result = run([sys.executable, "train.py", "--demo", "--precision", "fp8-mixed", "--accelerator", "cpu",
                  "--out-dir", str(out)], check=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: --precision fp8-mixed needs an NVIDIA GPU with float8 matrix products, of compute capability 8.9+ "
        "(H100, H200, L40S, RTX 4090), and this run is on the CPU; use bf16-mixed"]
    assert not out.exists()


def a_gpu(monkeypatch, capability: tuple[int, int]) -> torch.device:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    return torch.device("cuda", 0)


def test_a_gpu_without_float8_or_a_strategy_that_hides_the_weights_is_refused(monkeypatch):
    with pytest.raises(UserError, match=r"8\.9\+ .*, and the NVIDIA A100-SXM4-80GB is 8\.0; use bf16-mixed$"):
        fp8.check_fp8_supported(a_gpu(monkeypatch, (8, 0)), "auto")
    h100 = a_gpu(monkeypatch, (9, 0))
    for strategy in ("auto", "ddp", "fsdp2"):
        fp8.check_fp8_supported(h100, strategy)
    for strategy in ("fsdp", "deepspeed_stage_2", "dp"):
        with pytest.raises(UserError, match=f"runs on one device or under --strategy ddp or fsdp2, not {strategy}$"):
            fp8.check_fp8_supported(h100, strategy)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match="needs torchao, which is not installed: pip install torchao$"):
        fp8.check_fp8_supported(h100, "ddp")


def tiny_bert(hidden: int, intermediate: int) -> nn.Module:
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.for_model("bert", vocab_size=100, hidden_size=hidden, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=intermediate, num_labels=3)
    return AutoModelForSequenceClassification.from_config(config)


def test_float8_takes_the_blocks_linear_layers_whose_sides_are_multiples_of_16_and_keeps_their_names():
    float8_linear = pytest.importorskip("torchao.float8.float8_linear").Float8Linear
    model = tiny_bert(hidden=32, intermediate=40)  # the feed-forward layers' 40 is no multiple of 16
    names, params = list(model.state_dict()), dict(model.named_parameters())
    fp8.convert_to_float8(model)
    converted = {name for name, module in model.named_modules() if isinstance(module, float8_linear)}
    assert converted == {f"bert.encoder.layer.{i}.attention.{part}" for i in range(2)
                         for part in ("self.query", "self.key", "self.value", "output.dense")}
    # the pooler and the head see one token per row; the feed-forward layers' sides do not fit float8
    for name in ("bert.pooler.dense", "classifier", "bert.encoder.layer.0.intermediate.dense",
                 "bert.encoder.layer.0.output.dense"):
        assert type(model.get_submodule(name)) is nn.Linear
    # the same parameters under the same names: checkpoints, resume and the export read and write what they did
    assert list(model.state_dict()) == names
    assert all(param is params[name] for name, param in model.named_parameters())


def test_a_model_without_a_layer_float8_can_take_is_a_user_error():
    with pytest.raises(UserError, match="found no Linear layer of BertForSequenceClassification's repeated blocks"):
        fp8.convert_to_float8(tiny_bert(hidden=24, intermediate=40))


def test_fabric_runs_what_float8_leaves_in_bf16_mixed():
    assert launcher.resolve_launch_settings({"precision": "fp8-mixed"})["precision"] == "bf16-mixed"
