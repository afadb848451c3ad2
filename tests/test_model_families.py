"""Every family a user brings (tests/families.py: encoders, decoders as classifiers, encoder-decoders) trains, with and
without LoRA, in this one process: the tokenizer pads (decoders with their end-of-text token), FLOPs are counted or
the run says how, LoRA trains and exports the task's head, and the export loads with plain transformers and gives the
same logits for a row alone as in a padded batch; predict.py reads it. Llama also on two processes (fsdp2 with
--grad-checkpointing, ZeRO-3 under the CPU shim) and through a resume, each ending as one uninterrupted process."""

import csv
import json
import re
import shutil
import signal

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

import predict
import train
from conftest import REPO, resumed_step
from conftest import train as train_subprocess
from data.demo import prepare_demo
from families import FAMILIES, write_family_model

ROTARY = ("llama", "qwen2")
TEXTS = ["a good film", "boring and messy but the cast was superb and the music moving", "dull", "the plot was fun"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    data, _ = prepare_demo(root / "demo")
    return data, {family: write_family_model(family, root / family) for family in FAMILIES}


def train_in_process(*flags):
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        return train.setup(["--accelerator", "cpu", "--precision", "32-true", "--train-size", "48", "--val-size", "16",
                            "--test-size", "16", "--max-length", "64", "--batch-size", "8", "--max-steps", "2",
                            "--quiet", "--num-workers", "0", *map(str, flags)])
    finally:  # the run installed its preemption handlers in this process: put pytest's back
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def assert_alone_as_in_a_batch(folder, padding_side: str):
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side=padding_side)
    assert model.config.pad_token_id == tokenizer.pad_token_id is not None
    with torch.no_grad():
        batched = model(**tokenizer(TEXTS, padding=True, return_tensors="pt")).logits
        alone = torch.cat([model(**tokenizer([text], return_tensors="pt")).logits for text in TEXTS])
    torch.testing.assert_close(batched, alone, rtol=1e-4, atol=1e-5)
    return batched


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_exports_and_predicts(folders, tmp_path, capsys, monkeypatch, family, lora):
    from data import extras

    data, models = folders
    out, fresh = tmp_path / "run", {}

    def add_lora(*args, **kwargs):  # the head as LoRA starts training it: checkpoints leave its frozen copy out
        model = add_lora.wrapped(*args, **kwargs)
        fresh.update({name: value.detach().clone() for name, value in model.state_dict().items()
                      if ".modules_to_save.default." in name})
        return model
    add_lora.wrapped = extras.add_lora
    monkeypatch.setattr(extras, "add_lora", add_lora)
    results = train_in_process("--dataset", data, "--model", models[family], "--out-dir", out,
                               "--peak-tflops", "1",  # a CPU's FLOPs are counted only against a peak given
                               *(["--lora-r", "4", "--keep-best-checkpoint"] if lora else []))
    said = capsys.readouterr().out
    assert results["steps"] == 2
    # decoders shipped without a pad token pad with their end-of-text token, and say so
    assert ("padding with" in said) == (family in ("gpt2", "llama")), said
    # the heads of T5 and BART find each row's end token, which fake tensors cannot: counted by their weights
    assert ("MFU counts 6 x matrix weights" in said) == (family in ("t5", "bart")), said

    model, info = AutoModelForSequenceClassification.from_pretrained(out / "model", output_loading_info=True)
    assert not any(info.values()), info  # plain names: no lora_, base_layer, modules_to_save
    logits = assert_alone_as_in_a_batch(out / "model", "right")
    if family in ROTARY:  # the last real token is pooled whichever side pads (GPT-2's learned positions would shift)
        torch.testing.assert_close(assert_alone_as_in_a_batch(out / "model", "left"), logits, rtol=1e-4, atol=1e-5)

    if lora:  # the head trained in full, from its fresh values, and the export holds the trained one
        state = torch.load(out / "checkpoints" / "best" / "state", weights_only=True)["model"]
        heads = {name: value for name, value in state.items() if ".modules_to_save.default." in name}
        exported = load_file(out / "model" / "model.safetensors")
        assert heads and heads.keys() == fresh.keys(), "no head among LoRA's trained modules"
        assert not any(".original_module." in name or "base_layer" in name for name in state), state.keys()
        for name, value in heads.items():
            assert not torch.equal(value, fresh[name]), f"{name} did not train"
            plain = name.removeprefix("base_model.model.").replace(".modules_to_save.default", "")
            torch.testing.assert_close(exported[plain], value)

    rows = tmp_path / "rows.csv"
    with open(rows, "w", newline="") as f:
        csv.writer(f).writerows([["text"], *([text] for text in TEXTS)])
    with open(predict.main([str(out), str(rows)])) as f:
        predicted = [int(row["predicted"]) for row in csv.DictReader(f)]
    assert predicted == logits.argmax(dim=-1).tolist()
    assert json.loads((out / "results.json").read_text())["config"]["model"] == str(models[family])


def test_max_length_beyond_the_models_positions_is_one_line_and_leaves_nothing(folders, tmp_path, capsys):
    data, models = folders
    with pytest.raises(SystemExit) as exit:
        train_in_process("--dataset", data, "--model", models["roberta"], "--max-length", "512",
                         "--out-dir", tmp_path / "run")
    assert exit.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --max-length 512 is beyond the 128 positions of model {models['roberta']}: pass " \
                  "--max-length 128 or less", err
    assert not (tmp_path / "run").exists()


DROPOUT_NAMES = {"gpt2": ["attn_pdrop", "resid_pdrop", "embd_pdrop"], "t5": ["dropout_rate"],
                 "distilbert": ["dropout", "seq_classif_dropout"]}


@pytest.mark.parametrize("family, names", DROPOUT_NAMES.items())
def test_the_dropout_flags_reach_the_names_each_family_gives_them(folders, family, names):
    import task

    path = folders[1][family]
    assert all(getattr(AutoConfig.from_pretrained(path), name) > 0 for name in names)  # else this could not fail
    model = task.build_model(str(path), ["neg", "pos"], "single_label", attention_dropout=0.0, hidden_dropout=0.0)
    assert [getattr(model.config, name) for name in names] == [0.0] * len(names)


def test_the_readme_lists_the_families_tested_here():
    """The README's list of families is this file's: a family added to one and not the other fails."""
    names = {"bert": "BERT", "roberta": "RoBERTa", "distilbert": "DistilBERT", "deberta-v2": "DeBERTa-v2",
             "modernbert": "ModernBERT", "gpt2": "GPT-2", "llama": "Llama", "qwen2": "Qwen2", "t5": "T5", "bart": "BART"}
    listed = re.search(r"\| the model \|.*; tested: (.*?) \(", (REPO / "README.md").read_text()).group(1)
    assert listed.split(", ") == [names[family] for family in FAMILIES]


EXACT = ["--lora-r", "4", "--lr", "1e-2", "--attention-dropout", "0", "--hidden-dropout", "0", "--no-group-by-length"]


@pytest.fixture(scope="module")
def llama_run(folders, tmp_path_factory):
    """Llama with LoRA in one process, 8 rows per step, a checkpoint after each: what two processes of 4 rows each
    and a resumed run must end with. Its folder."""
    data, models = folders
    out = tmp_path_factory.mktemp("llama") / "one"
    train_in_process("--dataset", data, "--model", models["llama"], "--out-dir", out, *EXACT, "--save-every", "1")
    return out


@pytest.mark.parametrize("strategy, flags", [("fsdp2", ["--grad-checkpointing"]), ("deepspeed_stage_3", [])])
def test_a_sharded_decoder_with_lora_trains_as_one_process(folders, llama_run, tmp_path, strategy, flags):
    """Two CPU processes: the skeleton built sharded and filled from rank 0 (rotary tables rebuilt, not read), blocks
    recomputed under fsdp2, and the export gathered with the adapters merged: the same weights as one process."""
    data, models = folders
    results = train_subprocess(["--dataset", data, "--model", models["llama"], "--accelerator", "cpu", "--devices", "2",
                     "--strategy", strategy, "--precision", "32-true", "--train-size", "48", "--val-size", "16",
                     "--test-size", "16", "--max-length", "64", "--batch-size", "4", "--max-steps", "2", "--quiet",
                     "--num-workers", "0", *EXACT, *flags], tmp_path, deepspeed_cpu=strategy.startswith("deepspeed"))
    assert results["world_size"] == 2
    exported, reference = (load_file(out / "model" / "model.safetensors") for out in (tmp_path, llama_run))
    assert exported.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(exported[name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert_alone_as_in_a_batch(tmp_path / "model", "left")


def test_a_decoder_resumes_exactly(folders, llama_run, tmp_path, capsys):
    """Llama's run cut back to its step-1 checkpoint and resumed ends with the uninterrupted run's weights."""
    data, models = folders
    shutil.copytree(llama_run, tmp_path / "resumed")
    for later in ("checkpoints/step-000002", "model", "results.json"):
        shutil.rmtree(tmp_path / "resumed" / later) if (tmp_path / "resumed" / later).is_dir() else (
            tmp_path / "resumed" / later).unlink()
    capsys.readouterr()
    train_in_process("--dataset", data, "--model", models["llama"], *EXACT, "--save-every", "1", "--resume", "auto",
                     "--out-dir", tmp_path / "resumed")
    assert resumed_step(capsys.readouterr().out) == 1
    whole, resumed = (load_file(out / "model" / "model.safetensors") for out in (llama_run, tmp_path / "resumed"))
    assert whole.keys() == resumed.keys()
    for name, value in whole.items():
        torch.testing.assert_close(resumed[name], value, rtol=1e-5, atol=1e-6, msg=name)
