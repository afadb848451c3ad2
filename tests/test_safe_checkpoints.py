"""A run folder from someone else can hold anything: a pickle planted in any file that a resume, the export or
predict.py reads is refused with one line before it is read, under every strategy; a checkpoint file changed since it
was written (same size, one byte) is skipped by --resume auto for the one before it.

One short run per strategy, started together (DeepSpeed through the CPU shim); each test plants into copies of their
checkpoints. The fsdp2 run also shows what the optimizer gets of sharded weights, rather than start a run of its own
for that."""

import io
import json
import os
import pickle
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import Job, run, shimmed
from fabric_utils.checkpoint import load_weights, verify, write_manifest
from fabric_utils.resume import find_resume_checkpoint
from fabric_utils.errors import UserError
from fabric_utils.safe_pickle import load_torch_file

TINY = ["--demo", "--train-size", "64", "--val-size", "16", "--test-size", "16", "--batch-size", "8",
        "--max-length", "32", "--max-steps", "2", "--save-every", "1", "--quiet", "--num-workers", "0",
        "--accelerator", "cpu", "--keep-best-checkpoint"]
TWO = ["--devices", "2", "--strategy"]
STRATEGIES = {"single": ([], {}), "ddp": ([*TWO, "ddp"], {}), "fsdp2": ([*TWO, "fsdp2"], {}),
              "deepspeed": ([*TWO, "deepspeed_stage_2", "--precision", "bf16-mixed"],
                            {"FABRIC_TEMPLATE_DEEPSPEED_CPU": "1"})}


class Payload:
    """Unpickling it runs a shell command that writes ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("safe")
    jobs = [Job(root / name, *TINY, *flags, env=shimmed(**shim) if shim else None)
            for name, (flags, shim) in STRATEGIES.items()]
    for job in jobs:
        job.results()
    return root


def pickled_files(folder: Path) -> list[str]:
    """The files of a checkpoint that a library unpickles: all but the records, DeepSpeed's scripts and tag file."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()
                  and p.suffix not in (".json", ".py") and p.name != "latest")


def plant(folder: Path, name: str, marker: Path) -> None:
    """A payload in ``folder/name`` as its own format holds values, and a manifest rewritten to match (it is no
    signature: whoever can write the folder can rewrite it)."""
    path = folder / name
    if path.name == ".metadata":  # torch distributed checkpoint's index: a plain pickle
        path.write_bytes(pickle.dumps(Payload(marker)))
    elif path.suffix == ".distcp":  # a non-tensor value (step, lr): appended, and the index pointed at it
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        index_file = path.parent / ".metadata"
        metadata = pickle.loads(index_file.read_bytes())
        info = next(info for index, info in metadata.storage_data.items()
                    if isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata))
        value = io.BytesIO()
        torch.save(Payload(marker), value)
        info.relative_path, info.offset, info.length = path.name, path.stat().st_size, len(value.getvalue())
        with open(path, "ab") as f:
            f.write(value.getvalue())
        index_file.write_bytes(pickle.dumps(metadata))
    else:  # a torch.save file: the payload beside what it holds
        held = torch.load(path, weights_only=False)
        torch.save({**held, "planted": Payload(marker)} if isinstance(held, dict) else [held, Payload(marker)], path)
    write_manifest(folder)


RANK_0 = SimpleNamespace(is_global_zero=True, broadcast=lambda obj: obj)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_payload_in_any_checkpoint_file_is_refused_naming_it(runs, tmp_path, strategy):
    """What a resume (``--resume``) and the export (``checkpoints/best``, through load_weights) check first."""
    written = runs / strategy / "checkpoints" / "step-000002"
    names = pickled_files(written)
    assert any(name.startswith("state") for name in names) and any(name.startswith("rng-") for name in names)
    marker = tmp_path / "marker"
    for name in names:
        folder = shutil.copytree(written, tmp_path / name.replace("/", "_"))
        plant(folder, name, marker)
        with pytest.raises(UserError) as refused:
            if name.startswith("rng-"):  # each rank loads its own, to name itself if it is refused
                load_torch_file(folder / name)
            verify(RANK_0, folder)
        assert f"refusing checkpoint file {folder / name}: it needs posix.system" in str(refused.value), name
        assert "\n" not in str(refused.value)
        assert not marker.exists(), f"{name}: the payload ran"


def test_sharded_weights_decay_every_matrix_and_nothing_else(runs):
    """A sharded rank holds a slice of each weight (a 1-D slice of a flat shard under FSDP1, or an empty one): a rule
    by the shape the optimizer sees would put weights in the no-decay group."""
    from lightning.fabric.utilities.load import _load_distributed_checkpoint

    checkpoint = _load_distributed_checkpoint(runs / "fsdp2" / "checkpoints" / "step-000002" / "state")
    groups = {group["weight_decay"]: set(group["params"]) for group in checkpoint["optimizer"]["param_groups"]}
    shapes = {name: weight.shape for name, weight in checkpoint["model"].items()}
    assert groups[0.01] == {name for name, shape in shapes.items() if len(shape) >= 2}
    assert groups[0.0] == {name for name, shape in shapes.items() if len(shape) < 2}
    assert (runs / "fsdp2" / "model" / "model.safetensors").exists()  # consolidated from the shards


def test_the_export_reads_best_only_after_checking_it(runs, tmp_path):
    folder = shutil.copytree(runs / "fsdp2" / "checkpoints" / "best", tmp_path / "best")
    plant(folder, "state/.metadata", tmp_path / "marker")
    with pytest.raises(UserError, match="it needs posix.system"):
        load_weights(RANK_0, folder / "state", model=None)
    assert not (tmp_path / "marker").exists()


def test_resuming_a_planted_fsdp2_checkpoint_is_one_line_on_two_processes(runs, tmp_path):
    """The plain pickle.load of torch distributed checkpoint's index used to run the payload on every rank."""
    out = shutil.copytree(runs / "fsdp2", tmp_path / "run")
    plant(out / "checkpoints" / "step-000002", "state/.metadata", tmp_path / "marker")
    done = run([sys.executable, "train.py", *TINY, *STRATEGIES["fsdp2"][0], "--out-dir", str(out), "--resume", "auto"],
               check=False)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"error: refusing checkpoint file {out}/checkpoints/step-000002/state/.metadata: it needs posix.system, which "
        f"no checkpoint of train.py holds (loading it could run code); pass another --resume or start a new "
        f"--out-dir"], done.stderr[-3000:]
    assert not (tmp_path / "marker").exists()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_changed_byte_in_any_checkpoint_file_is_skipped_for_the_one_before(runs, tmp_path, strategy):
    ckpt = runs / strategy / "checkpoints"
    names = [str(p.relative_to(ckpt / "step-000002")) for p in (ckpt / "step-000002").rglob("*") if p.is_file()]
    for name in names:
        if name == "manifest.json":
            continue
        copy = shutil.copytree(ckpt, tmp_path / name.replace("/", "_"))
        path = copy / "step-000002" / name
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 1
        path.write_bytes(bytes(data))
        said = []
        assert find_resume_checkpoint("auto", copy, report=said.append) == copy / "step-000001", name
        assert said == [f"skipping damaged checkpoint {copy / 'step-000002'}: {name} is not the file written (its "
                        f"SHA-256 differs)"]
        with pytest.raises(UserError, match=f"is damaged: {name} is not the file written"):
            find_resume_checkpoint(str(copy / "step-000002"), copy)


def test_resume_auto_continues_from_the_checkpoint_before_a_damaged_one(runs, tmp_path):
    out = shutil.copytree(runs / "single", tmp_path / "run")
    state = out / "checkpoints" / "step-000002" / "state"
    data = bytearray(state.read_bytes())
    data[-100] ^= 1  # inside the zip's records: same size
    state.write_bytes(bytes(data))
    done = run([sys.executable, "train.py", *TINY, "--out-dir", str(out), "--resume", "auto"], check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (f"skipping damaged checkpoint {out / 'checkpoints' / 'step-000002'}: state is not the file written"
            in done.stdout)
    assert f"resumed from {out / 'checkpoints' / 'step-000001'} at step 1" in done.stdout


def test_predict_runs_no_code_and_reads_no_pickle_from_the_model_folder(runs, tmp_path):
    run_dir = shutil.copytree(runs / "single", tmp_path / "run")
    model, marker = run_dir / "model", tmp_path / "marker"
    (model / "custom.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
                                     f"from transformers import BertForSequenceClassification as Custom\n")
    for name, auto_map in (("config.json", {"AutoModelForSequenceClassification": "custom.Custom"}),
                           ("tokenizer_config.json", {"AutoTokenizer": ["custom.Custom", None]})):
        config = json.loads((model / name).read_text())
        (model / name).write_text(json.dumps({**config, "auto_map": auto_map}))
    rows = tmp_path / "rows.csv"
    rows.write_text("text\ngreat film\ndull film\n")
    predict = [sys.executable, "predict.py", str(run_dir), str(rows)]
    done = run(predict, check=False)
    assert done.returncode == 0 and "2 predictions" in done.stdout, done.stderr[-3000:]
    (model / "model.safetensors").unlink()  # weights as a pickle instead
    torch.save({"planted": Payload(marker)}, model / "pytorch_model.bin")
    done = run(predict, check=False)
    assert done.returncode == 2 and done.stderr.splitlines() == [
        f"error: cannot load the exported model in {model}: Error no file named model.safetensors found in directory "
        f"{model}. (predict.py reads the model.safetensors train.py exports)"], done.stderr[-3000:]
    assert not marker.exists()


def test_the_export_writes_the_stock_classes_only(runs, tmp_path):
    """A source model's auto_map (its own code, which training never ran) is not copied into the export."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    import task

    tokenizer = AutoTokenizer.from_pretrained(runs / "single" / "model", trust_remote_code=False)
    tokenizer.init_kwargs["auto_map"] = {"AutoTokenizer": ["custom.Custom", None]}
    trained = BertForSequenceClassification(BertConfig(
        vocab_size=len(tokenizer), hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
        auto_map={"AutoModelForSequenceClassification": "custom.Custom"}))
    task.export(trained.state_dict(), trained, tokenizer, tmp_path)
    for name in ("config.json", "tokenizer_config.json"):
        assert "auto_map" not in json.loads((tmp_path / name).read_text()), name


def _manifest_edit(edit):
    def plant(folder: Path) -> None:
        manifest = json.loads((folder / "manifest.json").read_text())
        (folder / "manifest.json").write_text(edit(manifest) if callable(edit) else edit)
    return plant


def _record(text: str):
    def plant(folder: Path) -> None:
        (folder / "record.json").write_text(text)
        write_manifest(folder)
    return plant


def _symlink_loop(folder: Path) -> None:
    (folder / "loop").symlink_to("loop")
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**manifest, "loop": {"bytes": 0, "sha256": "0" * 64}}))


# planted into a checkpoint's manifest.json or record.json, the latter with a manifest rewritten to match
PLANTED = {"manifest_list": _manifest_edit("[]"), "manifest_null": _manifest_edit("null"),
           "size_1e400": _manifest_edit(lambda m: json.dumps(m).replace('"bytes": ', '"bytes": 1e400, "was": ', 1)),
           "name_nul": _manifest_edit(lambda m: json.dumps({**m, "state\0x": m["state"]})),
           "name_300": _manifest_edit(lambda m: json.dumps({**m, "x" * 300: m["state"]})),
           "symlink_loop": _symlink_loop,
           "record_empty": _record("{}"),
           "record_rows_negative": _record(json.dumps({"world_size": 2, "fingerprint": {
               "rows per optimizer step (--batch-size x devices x --grad-accum)": -8}}))}


@pytest.mark.parametrize("planted", PLANTED)
def test_a_planted_manifest_or_record_is_skipped_by_resume_auto_and_refused_by_name(runs, tmp_path, planted):
    copy = shutil.copytree(runs / "single" / "checkpoints", tmp_path / "checkpoints", symlinks=True)
    PLANTED[planted](copy / "step-000002")
    said = []
    assert find_resume_checkpoint("auto", copy, report=said.append) == copy / "step-000001"
    assert len(said) == 1 and said[0].startswith(f"skipping damaged checkpoint {copy / 'step-000002'}: "), said
    with pytest.raises(UserError) as refused:
        find_resume_checkpoint(str(copy / "step-000002"), copy)
    assert "is damaged" in str(refused.value) and "\n" not in str(refused.value)


def test_resume_auto_skips_a_record_that_would_loop_forever(runs, tmp_path):
    """Rows per step -8 from another world size made --grad-accum -1: a run that never took a step."""
    out = shutil.copytree(runs / "single", tmp_path / "run")
    PLANTED["record_rows_negative"](out / "checkpoints" / "step-000002")
    done = run([sys.executable, "train.py", *TINY, "--out-dir", str(out), "--resume", "auto"], check=False,
               timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"skipping damaged checkpoint {out / 'checkpoints' / 'step-000002'}: its record.json" in done.stdout
    assert f"resumed from {out / 'checkpoints' / 'step-000001'} at step 1" in done.stdout


def _build_on_a_class() -> bytes:
    """A pickle that sets ``PosixPath.is_relative_to = PosixPath``, through BUILD on the class itself."""
    name = b"is_relative_to"
    posix_path = pickle.GLOBAL + b"pathlib\nPosixPath\n"
    return (pickle.PROTO + b"\x02" + posix_path + pickle.NONE + pickle.EMPTY_DICT + pickle.BINUNICODE
            + len(name).to_bytes(4, "little") + name + posix_path + pickle.SETITEM + pickle.TUPLE2 + pickle.BUILD
            + pickle.STOP)


def test_the_unpickler_builds_and_never_changes_a_class(runs, tmp_path):
    import pathlib

    original = pathlib.PosixPath.is_relative_to
    folder = shutil.copytree(runs / "fsdp2" / "checkpoints" / "step-000002", tmp_path / "step")
    (folder / "state" / ".metadata").write_bytes(_build_on_a_class())
    write_manifest(folder)
    with pytest.raises(UserError, match=r"its \.metadata is damaged or was not written by train.py \(BUILD on a "):
        verify(RANK_0, folder)
    assert pathlib.PosixPath.is_relative_to is original


def test_a_dcp_entry_pointing_outside_its_folder_is_refused(runs, tmp_path):
    """A tensor's entry in .metadata naming another run's .distcp: read under weights_only, but by no manifest's
    hash."""
    folder = shutil.copytree(runs / "fsdp2" / "checkpoints" / "step-000002", tmp_path / "step")
    metadata = pickle.loads((folder / "state" / ".metadata").read_bytes())
    elsewhere = next((runs / "fsdp2" / "checkpoints" / "step-000001" / "state").glob("*.distcp"))
    next(iter(metadata.storage_data.values())).relative_path = str(elsewhere)
    (folder / "state" / ".metadata").write_bytes(pickle.dumps(metadata))
    write_manifest(folder)
    with pytest.raises(UserError, match="it points outside its folder"):
        verify(RANK_0, folder)


def test_the_export_replaces_a_link_in_place_of_model_and_leaves_its_target(runs, tmp_path):
    from fabric_utils.export import export_model

    elsewhere, out = tmp_path / "elsewhere", tmp_path / "run" / "model"
    elsewhere.mkdir()
    (elsewhere / "mine.txt").write_text("mine\n")
    out.parent.mkdir()
    out.symlink_to(elsewhere)
    fabric = SimpleNamespace(is_global_zero=True, barrier=lambda: None, strategy=None)  # no engine
    export_model(fabric, runs / "single" / "checkpoints" / "best" / "state", out, model=torch.nn.Module(),
                 fingerprint={})  # a model with no frozen weights to add
    assert not out.is_symlink() and (out / "model.pt").is_file()
    assert [p.name for p in elsewhere.iterdir()] == ["mine.txt"]
