"""The launcher builds the right Fabric pieces from flags, alone and under `fabric run`."""

import os
import sys
import typing
import warnings
from types import SimpleNamespace
from pathlib import Path

import lightning.fabric.fabric
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy
from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import FSDPModule

import task
from conftest import build_fabric_from_flags, fabric_cli, fake_gpu, run
from fabric_utils import launcher
from fabric_utils.errors import UserError
from fabric_utils.sharding import block_classes, recompute_blocks
from fabric_utils.strategy import checkpoints_blocks
from train import parse_args


def fabric_for(*flags):
    return build_fabric_from_flags(*flags)


def test_every_registered_strategy_that_launch_starts_is_a_valid_flag():
    """ddp_spawn, ddp_fork, ddp_notebook and the XLA names need the job as a function given to fabric.launch(), and
    used to stop with a raw TypeError."""
    refused = {"ddp_spawn", "ddp_fork", "ddp_notebook", "xla", "xla_fsdp"}
    assert {name for name in STRATEGY_REGISTRY.available_strategies() if not offered(name)} == refused
    assert not offered("ddp_turbo")


def test_the_flags_offer_what_fabrics_registries_hold():
    """fabric_utils/args.py writes the names out so that parsing the flags imports no Lightning."""
    from lightning.fabric.accelerators import ACCELERATOR_REGISTRY
    from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT_STR, _PRECISION_INPUT_STR_ALIAS

    from fabric_utils import args
    assert set(args.ACCELERATORS) == {"auto", *ACCELERATOR_REGISTRY.available_accelerators()}
    assert args.PRECISIONS == ("auto", *typing.get_args(_PRECISION_INPUT_STR),
                               *typing.get_args(_PRECISION_INPUT_STR_ALIAS), args.FP8)


def offered(strategy: str) -> bool:
    try:
        return parse_args(["--strategy", strategy]).strategy == strategy
    except SystemExit:  # argparse: not among the choices
        return False


@pytest.mark.parametrize("name", [n for n in STRATEGY_REGISTRY.available_strategies()
                                  if STRATEGY_REGISTRY[n]["strategy"] is DDPStrategy])
def test_ddp_strategies_offered_are_those_launch_starts_without_a_function(name):
    """Fabric.launch() refuses to start a multiprocessing launcher without a function (checked before it starts any
    process, as here)."""
    fabric = Fabric(accelerator="cpu", devices=2, strategy=name)
    spawns = isinstance(fabric.strategy.launcher, _MultiProcessingLauncher)
    assert offered(name) == (not spawns)
    if spawns:
        with pytest.raises(TypeError, match="needs to be called with a function"):
            fabric.launch()


@pytest.mark.parametrize("devices", ["4", "0,1", "auto", "-1"])
def test_devices_accepts_what_fabric_accepts(devices):
    assert parse_args(["--devices", devices]).devices == devices


@pytest.mark.parametrize("name, cls, expected", [
    ("ddp", DDPStrategy, {}),
    ("deepspeed_stage_2", DeepSpeedStrategy, {"stage": 2, "offload_optimizer": False}),
    ("deepspeed_stage_2_offload", DeepSpeedStrategy, {"stage": 2, "offload_optimizer": True}),
    ("deepspeed_stage_3", DeepSpeedStrategy, {"stage": 3, "offload_optimizer": False}),
    ("deepspeed_stage_3_offload", DeepSpeedStrategy, {"stage": 3, "offload_optimizer": True}),
])
def test_strategy_flags_build_the_strategy(deepspeed_accepts_cpu, name, cls, expected):
    fabric = fabric_for("--accelerator", "cpu", "--devices", "2", "--strategy", name, "--precision", "32-true",
                        "--grad-clip", "0.5")
    assert type(fabric.strategy) is cls
    assert fabric.world_size == 2
    if cls is DeepSpeedStrategy:
        zero = fabric.strategy.config["zero_optimization"]
        assert zero["stage"] == expected["stage"]
        assert ("offload_optimizer" in zero) == expected["offload_optimizer"]
        assert fabric.strategy.config["gradient_clipping"] == 0.5  # DeepSpeed clips inside its optimizer step


@pytest.mark.parametrize("precision, plugin", [
    ("32-true", Precision), ("64-true", DoublePrecision), ("bf16-mixed", MixedPrecision), ("bf16-true", HalfPrecision),
])
def test_precision_flags_build_the_plugin(precision, plugin):
    fabric = fabric_for("--accelerator", "cpu", "--precision", precision)
    assert type(fabric.strategy.precision) is plugin
    assert fabric.strategy.precision.precision == precision


def test_fsdp_runs_as_fsdp2_saying_so_once(capsys):
    """torch's FSDP1 is gone: Fabric's name for it runs fully_shard, on the same processes, and says so in one line."""
    fabric = fabric_for("--accelerator", "cpu", "--devices", "2", "--strategy", "fsdp")
    assert type(fabric.strategy) is ModelParallelStrategy and fabric.world_size == 2
    assert capsys.readouterr().out.splitlines() == [
        "--strategy fsdp runs as --strategy fsdp2 (torch's fully_shard, which replaces FSDP1)"]


def test_fsdp_cpu_offload_is_refused_naming_what_to_pass():
    with pytest.raises(UserError, match=r"^--strategy fsdp_cpu_offload ran torch's FSDP1, .*: use --strategy fsdp2 "
                                        r"\(each device holds a share of the model\), or a ZeRO offload strategy"):
        fabric_for("--accelerator", "cpu", "--devices", "2", "--strategy", "fsdp_cpu_offload")


def test_fsdp2_shards_each_block():
    """Each block its own unit (one unit for the whole model would save no memory over DDP), recomputed under
    --grad-checkpointing inside it, then the root."""
    environ = dict(os.environ)  # launching sets the process group's variables: gone after the test
    fabric = fabric_for("--accelerator", "cpu", "--devices", "1", "--strategy", "fsdp2", "--precision", "bf16-mixed",
                        "--grad-checkpointing")
    fabric.launch()  # a process group of one
    try:
        model = fabric.setup_module(demo_bert())
        units = [type(getattr(m, "_checkpoint_wrapped_module", m)).__name__.removeprefix("FSDP")
                 for m in model.modules() if isinstance(m, FSDPModule)]
        assert sorted(units) == ["BertEmbeddings", "BertForSequenceClassification", "BertLayer", "BertLayer"]
        assert sum(isinstance(m, CheckpointWrapper) for m in model.modules()) == 3
    finally:
        torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)


def test_grad_checkpointing_uses_a_hugging_face_models_own_without_a_warning():
    """--grad-checkpointing outside FSDP: the model's own checkpointing (its weights keep their names), called by
    the name that does not warn, as every warning reaches the user's terminal."""
    model = demo_bert()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recompute_blocks(model)
    assert any(getattr(module, "gradient_checkpointing", False) for module in model.modules())
    assert not any(isinstance(module, CheckpointWrapper) for module in model.modules())


def demo_bert():
    """A two-layer BERT: Hugging Face models name their blocks in ``_no_split_modules`` (here BertEmbeddings and
    BertLayer)."""
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=2,
                                                    num_attention_heads=2, intermediate_size=16))


def test_block_classes_without_no_split_modules_are_those_of_the_layer_list():
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    distilbert = DistilBertForSequenceClassification(DistilBertConfig(vocab_size=32, dim=8, n_layers=2, n_heads=2,
                                                                      hidden_dim=16))
    assert not distilbert._no_split_modules
    assert [cls.__name__ for cls in block_classes(distilbert)] == ["TransformerBlock"]
    with pytest.raises(UserError, match="_no_split_modules"):
        block_classes(nn.Linear(2, 2))


@pytest.mark.parametrize("strategy, by_model", [("ddp", True), ("fsdp2", False)])
def test_grad_checkpointing_is_left_to_fsdp(strategy, by_model):
    """Hugging Face's checkpointing conflicts with FSDP, which checkpoints the blocks it shards itself."""
    built = launcher.build_strategy({"strategy": strategy, "accelerator": "cpu", "devices": "2", "num_nodes": 1,
                                     "precision": "32-true"}, grad_checkpointing=True)
    assert checkpoints_blocks(SimpleNamespace(strategy=built)) != by_model


def test_fsdp2_shards_over_every_process(monkeypatch):
    fabric = fabric_for("--accelerator", "cpu", "--devices", "2", "--strategy", "fsdp2", "--precision", "bf16-mixed")
    assert type(fabric.strategy) is ModelParallelStrategy and fabric.world_size == 2
    assert (fabric.strategy._data_parallel_size, fabric.strategy._tensor_parallel_size) == (2, 1)
    fabric_run_env(monkeypatch, accelerator="cpu", devices="3", num_nodes="2")
    assert fabric_for("--strategy", "fsdp2").strategy._data_parallel_size == 6


def test_fsdp_under_fabric_run_keeps_the_block_policy(monkeypatch):
    """`fabric run --strategy fsdp`: Fabric must take the configured strategy (fsdp2's), not rebuild a plain one from
    the CLI's LT_STRATEGY (which it reports as a conflict)."""
    fabric_run_env(monkeypatch, accelerator="cpu", devices="2", num_nodes="1", strategy="fsdp")
    fabric = fabric_for()
    assert type(fabric.strategy) is ModelParallelStrategy and fabric.strategy._data_parallel_size == 2


def test_precision_the_hardware_lacks_is_a_user_error():
    with pytest.raises(UserError, match="16-mixed"):
        fabric_for("--accelerator", "cpu", "--precision", "16-mixed")


@pytest.mark.parametrize("cuda, cuda_bf16, cpu_bf16, expected", [
    (True, True, False, "bf16-mixed"), (True, False, False, "16-mixed"),
    (False, False, True, "bf16-mixed"), (False, False, False, "32-true"),
])
def test_auto_precision(monkeypatch, cuda, cuda_bf16, cpu_bf16, expected):
    if cuda:
        fake_gpu(monkeypatch, native_bf16=cuda_bf16)
    else:
        monkeypatch.setattr(launcher.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(launcher, "cpu_has_fast_bf16", lambda: cpu_bf16)
    assert launcher.auto_precision("auto") == expected
    assert launcher.resolve_launch_settings(vars(parse_args([])))["precision"] == expected


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_precision_on_a_gpu_that_only_emulates_it_is_a_user_error(monkeypatch, precision):
    fake_gpu(monkeypatch, native_bf16=False)
    with pytest.raises(UserError, match="16-mixed"):
        launcher.check_precision_supported(precision, built=precision, device=torch.device("cuda"))
    fake_gpu(monkeypatch, native_bf16=True)
    launcher.check_precision_supported(precision, built=precision, device=torch.device("cuda"))


@pytest.mark.parametrize("vendor, flags, fast", [
    ("GenuineIntel", "avx512f amx_bf16 amx_tile avx512_bf16", True),
    ("GenuineIntel", "avx512f avx512_bf16", False),  # trained slower than fp32
    ("AuthenticAMD", "avx512f avx512_bf16", True),
    ("AuthenticAMD", "avx2", False),
])
def test_fast_bf16_on_a_cpu_is_amx_or_amd_avx512_bf16(vendor, flags, fast):
    assert launcher.cpu_has_fast_bf16(f"vendor_id\t: {vendor}\nflags\t\t: fpu sse2 {flags}\n") is fast


def test_auto_precision_on_this_cpu_follows_its_cpuinfo():
    fast = launcher.cpu_has_fast_bf16(open("/proc/cpuinfo").read())
    assert launcher.auto_precision("cpu") == ("bf16-mixed" if fast else "32-true")


def fabric_run_env(monkeypatch, **settings):
    monkeypatch.setenv("LT_CLI_USED", "1")
    # under `fabric run`, Fabric joins the other processes as it is built; here there are none to join
    monkeypatch.setattr(lightning.fabric.fabric, "_is_using_cli", lambda: False)
    for name, value in settings.items():
        monkeypatch.setenv(f"LT_{name.upper()}", value)


def test_fabric_run_settings_win_without_conflict(monkeypatch):
    fabric_run_env(monkeypatch, accelerator="cpu", devices="2", num_nodes="1", strategy="ddp", precision="bf16-mixed")
    fabric = fabric_for()  # the script's own defaults must not trip Fabric's "conflicts with the CLI" error
    assert type(fabric.strategy) is DDPStrategy
    assert fabric.world_size == 2 and fabric.strategy.precision.precision == "bf16-mixed"
    fabric = fabric_for("--devices", "2", "--strategy", "ddp")  # same value both ways: fine
    assert fabric.world_size == 2


def test_fabric_run_conflict_says_which_to_remove(monkeypatch):
    fabric_run_env(monkeypatch, accelerator="cpu", devices="2", num_nodes="1")
    with pytest.raises(UserError, match=r"--devices is set twice.*remove --devices from the train.py arguments"):
        parse_args(["--devices", "3"])  # before torch loads, so it says so at once
    with pytest.raises(UserError, match=r"--devices is set twice"):
        launcher.build_fabric(devices="3")  # as the loop builds it, flags parsed or not


def test_fabric_run_conflict_end_to_end(tmp_path):
    """`fabric run` takes its own options wherever they stand, so a conflicting value reaches train.py through a
    config file, as when a run saved with one device count is rerun under `fabric run` with another."""
    config = tmp_path / "config.yaml"
    config.write_text("devices: '1'\n")
    result = run([fabric_cli(), "run", "--accelerator", "cpu", "--devices", "2", "train.py", *task.TEST_FLAGS,
                  "--config", str(config), "--out-dir", str(tmp_path / "run")], check=False, timeout=300)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "remove --devices" in errors[0]
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_an_error_every_rank_finds_is_one_line_under_torchrun_when_rank_zero_is_slowest():
    """torchrun stops the other workers within a tenth of a second of the first exit: rank 0, a second behind,
    still reports the error, once."""
    job = Path(__file__).with_name("shared_error_job.py")
    result = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(job),
                  "1"], check=False, timeout=120)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: the same bad input on every rank"]


def test_the_runs_config_holds_the_flags_and_what_the_run_decided_read_only():
    """The loop reads one config: a value changed after it is made would differ between what ran and config.yaml."""
    from argparse import Namespace

    from fabric_utils.args import Config

    config = Config(Namespace(lr=1e-3, batch_size="auto"), batch_size=8)
    assert (config.lr, config.batch_size) == (1e-3, 8)
    for change in (lambda: setattr(config, "lr", 1.0), lambda: delattr(config, "lr")):
        with pytest.raises(AttributeError, match="read-only: decide lr before making it"):
            change()
    assert config.lr == 1e-3
