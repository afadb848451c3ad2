"""LoRA (--lora-r): only the adapters and the head train, the export merges the adapters into a plain
Hugging Face model, resume is exact, and two processes (DDP, DeepSpeed ZeRO-2 and ZeRO-3) train the same adapters
as one.

Every run is the same few exact steps (fp32, no dropout, fixed batches) of the demo, so a run of one process with
16 rows per step, a resumed one and runs of two processes with 8 rows each must end with the same weights."""

import json
import re
import shutil
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer, BertConfig, DistilBertConfig

import task
from conftest import SMALL_DEMO, run, train
from fabric_utils.errors import UserError
from train import parse_args

# 6 steps of 16 rows: one epoch of the 96 training rows
EXACT = [*SMALL_DEMO, "--train-size", "96", "--val-size", "16", "--test-size", "16", "--lora-r", "8", "--lr", "1e-2",
         "--precision", "32-true", "--attention-dropout", "0", "--hidden-dropout", "0", "--no-group-by-length",
         "--max-steps", "6", "--save-every", "3"]
COMPARED = ("val_loss", "test_loss", "trainable_params", "total_params")
CHECKPOINT_RATIO = 6  # a step checkpoint's bytes over the trainable weights' at most (with the frozen model: over 10)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, 16 rows per step; checkpoints at steps 3 and 6, and the best one kept. Its results and what it
    wrote on stderr."""
    out = tmp_path_factory.mktemp("lora") / "one"
    done = run([sys.executable, "train.py", *EXACT, "--batch-size", "16", "--keep-best-checkpoint",
                "--out-dir", str(out)])
    return out, json.loads((out / "results.json").read_text()), done.stderr, done.stdout


def trained_model():
    """The model the runs train, built afresh: the pretrained demo model with LoRA adapters."""
    return task.build_model(str(task.DEMO_ROOT / "model"), ["negative", "positive"], "single_label",
                            attention_dropout=0.0, hidden_dropout=0.0, lora_r=8)


def checkpoint_bytes(folder) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def exported_weights(out) -> dict:
    return load_file(out / "model" / "model.safetensors")


def assert_same_run(out, results, reference):
    ref_out, ref_results, _, _ = reference
    for key in COMPARED:
        assert results[key] == pytest.approx(ref_results[key], rel=1e-4), key
    ours, theirs = exported_weights(out), exported_weights(ref_out)
    assert ours.keys() == theirs.keys()
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-5, msg=name)


def test_lora_trains_a_small_part_and_exports_a_plain_model_with_the_adapters_merged(reference):
    out, results, stderr, stdout = reference
    assert not stderr, stderr  # a quiet run shows nothing of the libraries underneath: no warnings
    assert checkpoint_bytes(out / "checkpoints" / "step-000006") < CHECKPOINT_RATIO * 4 * results["trainable_params"]
    # the first step checkpoint's line: what the run's checkpoints and export take
    assert re.search(r"checkpoint step-000003: [\d.]+ kB, what trains only \(the frozen base comes from its source\); "
                     r"the run needs ~[\d.]+ [kM]B under \S+: step checkpoints 2 x [\d.]+ kB \(--keep-last\), the best "
                     r"model \(at most as much\) and the export \(~[\d.]+ kB\); [\d.]+ [GT]B free", stdout), stdout

    exported = out / "model"
    assert not list(exported.glob("adapter_*")), "peft's adapter files in the export"
    config = (exported / "config.json").read_text()
    assert "peft" not in config and "lora" not in config
    model, info = AutoModelForSequenceClassification.from_pretrained(exported, output_loading_info=True)
    assert not any(info.values()), info  # every weight has its plain name: no lora_, base_layer, modules_to_save

    # the trained model: the best checkpoint (kept: --keep-best-checkpoint) holds the adapters and the head alone, to
    # load on the pretrained model
    trained = trained_model()
    frozen = {name for name, p in trained.named_parameters() if not p.requires_grad}
    missing, unexpected = trained.load_state_dict(
        torch.load(out / "checkpoints" / "best" / "state", weights_only=True)["model"], strict=False)
    assert not unexpected and set(missing) == frozen
    # adapters on every linear layer of a 64-wide model, and its head: an eighth of it
    assert results["trainable_params"] == sum(p.numel() for p in trained.parameters() if p.requires_grad)
    assert 0 < results["trainable_params"] < results["total_params"] / 6
    tokenizer = AutoTokenizer.from_pretrained(exported)
    batch = tokenizer(["a good film with a dull plot", "boring and messy but the cast was superb"] * 4,
                      padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = trained.eval()(**batch).logits
        with trained.disable_adapter():
            without_adapters = trained(**batch).logits
        got = model.eval()(**batch).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(got, without_adapters, atol=1e-3), "the adapters were not merged (or never trained)"


def test_resume_from_a_checkpoint_ends_with_the_same_adapters(reference, tmp_path):
    """The reference run's folder cut back to its step-3 checkpoint, then resumed: it must end where the
    uninterrupted run did."""
    ref_out, _, _, _ = reference
    out = tmp_path / "resumed"
    shutil.copytree(ref_out, out)
    for later in ("checkpoints/step-000006", "checkpoints/best", "model"):
        shutil.rmtree(out / later)
    (out / "results.json").unlink()
    resumed = run([sys.executable, "train.py", *EXACT, "--batch-size", "16", "--resume", "auto",
                   "--out-dir", str(out)])
    assert "resumed from" in resumed.stdout and "at step 3" in resumed.stdout, resumed.stdout[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert_same_run(out, results, reference)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "deepspeed_stage_2", "deepspeed_stage_3"])
def test_two_processes_train_the_same_adapters_as_one(reference, tmp_path, strategy):
    """Two CPU processes of 8 rows each: gradients of the adapters and the head averaged over both, the sharded
    checkpoints of fsdp2 and DeepSpeed gathered and merged for the export, the parameters counted whole (ZeRO-3
    leaves each rank a shard)."""
    flags = [*EXACT, "--batch-size", "8", "--accelerator", "cpu", "--devices", "2", "--strategy", strategy]
    results = train(flags, tmp_path, deepspeed_cpu=strategy.startswith("deepspeed"))
    assert results["world_size"] == 2
    assert_same_run(tmp_path, results, reference)
    step = tmp_path / "checkpoints" / "step-000006"
    if strategy == "fsdp2":  # torch's distributed checkpoint frames each small tensor: its index names what it holds
        from torch.distributed.checkpoint import FileSystemReader
        saved = {key.removeprefix("model.") for key in FileSystemReader(step / "state").read_metadata()
                 .state_dict_metadata if key.startswith("model.")}
        trained = trained_model()
        frozen = {name for name, p in trained.named_parameters() if not p.requires_grad}
        assert not saved & frozen and {name for name, p in trained.named_parameters() if p.requires_grad} <= saved
    else:  # the adapters, the head, their optimizer state and bookkeeping: not the frozen model, 7 times their size
        written = checkpoint_bytes(step)
        assert written < CHECKPOINT_RATIO * 4 * results["trainable_params"], written
    if strategy in ("fsdp2", "deepspeed_stage_3"):  # resumed from step 3 on the rebuilt base, it ends the same
        for later in ("checkpoints/step-000006", "model"):
            shutil.rmtree(tmp_path / later)
        (tmp_path / "results.json").unlink()
        resumed = run([sys.executable, "train.py", *flags, "--resume", "auto", "--out-dir", str(tmp_path)],
                      deepspeed_cpu=strategy.startswith("deepspeed"))
        assert "at step 3" in resumed.stdout, resumed.stdout[-3000:]
        assert_same_run(tmp_path, json.loads((tmp_path / "results.json").read_text()), reference)


def tiny_model(folder, config) -> str:
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("config, adapted, head", [
    (BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64),
     {"query", "key", "value", "dense"}, {"classifier"}),  # dense: attention output, MLP, pooler
    (DistilBertConfig(dim=32, n_layers=1, n_heads=2, hidden_dim=64),
     {"q_lin", "k_lin", "v_lin", "out_lin", "lin1", "lin2"}, {"pre_classifier", "classifier"}),
])
def test_default_target_modules_and_trainable_head_per_architecture(tmp_path, config, adapted, head):
    model = task.build_model(tiny_model(tmp_path, config), ["a", "b"], "single_label", None, None, lora_r=4)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert {name.split(".lora_")[0].rsplit(".", 1)[-1] for name in trainable if ".lora_" in name} == adapted
    assert {name.split(".modules_to_save")[0].rsplit(".", 1)[-1] for name in trainable if "modules_to_save" in name
            } == head  # the fresh head trains; everything else is frozen
    assert all(".lora_" in name or "modules_to_save" in name for name in trainable)


def test_bad_target_modules_name_the_linear_layers(tmp_path):
    source = tiny_model(tmp_path, BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=64))
    with pytest.raises(UserError, match=r"--lora-target-modules q_proj.*'query'"):
        task.build_model(source, ["a", "b"], "single_label", None, None, lora_r=4, lora_target_modules=["q_proj"])


def test_lora_brings_its_learning_rate_unless_one_is_given(tmp_path):
    assert parse_args(["--lora-r", "8"]).lr is None  # left to the task, which chooses LoRA's rate
    assert task.learning_rate_for(DistilBertConfig(), 38, lora=True) == task.LORA_LR != task.learning_rate_for(
        DistilBertConfig(), 38)
    assert parse_args(["--lora-r", "8", "--lr", "1e-3"]).lr == 1e-3
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"lora_r": 8, "lr": 1e-3}))
    assert parse_args(["--config", str(config)]).lr == 1e-3  # the file's rate wins over the preset's


def test_a_resume_on_another_base_model_is_one_line(tmp_path):
    """A LoRA checkpoint holds the adapters alone: resumed on a base whose weights changed since (the same folder),
    the run stops with one line before training."""
    from data.demo import prepare_demo
    from safetensors.torch import save_file

    data, demo_model = prepare_demo(tmp_path / "demo")
    base = tmp_path / "base"
    shutil.copytree(demo_model, base)
    flags = ["--model", str(base), "--dataset", str(data), *EXACT[EXACT.index("--train-size"):], "--batch-size", "16",
             "--max-steps", "3", "--out-dir", str(tmp_path / "run")]
    run([sys.executable, "train.py", *flags])
    weights = load_file(base / "model.safetensors")
    save_file({name: value + 0.01 for name, value in weights.items()}, base / "model.safetensors",
              metadata={"format": "pt"})
    resumed = run([sys.executable, "train.py", *flags, "--resume", "auto"], check=False)
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    error = resumed.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"error: checkpoint \S+step-000003 was written with base model weights \(SHA-256\) "
                        r"[0-9a-f]{16} \(now [0-9a-f]{16}\); resume with the same flags, or start a new --out-dir",
                        error), error
