"""bench/gpu_check.py, the GPU acceptance command, run as CI can: its dry run on CPU writes every row, measured by a
CPU stand-in or skipped with its reason, so the command cannot rot before a GPU run."""

import json

import pytest
import torch

from conftest import LAUNCH_VARIABLES, REPO, popen, subprocess_env

SECTIONS = ["peers, same call", "one GPU: all-MiniLM-L6-v2, pretrained", "one GPU: random weights, length 512",
            "bigger than one device: memory capped below the training state",
            "bigger than one device: memory capped below the fp32 model", "2+ GPUs: strategies, all-MiniLM-L6-v2",
            "decoder LLMs as classifiers: random weights, length 512"]


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


def test_the_dry_run_writes_every_row_measured_or_skipped_with_a_reason(tmp_path, gpu_check):
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path), "--peak-tflops", "1"]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = report["rows"]
    assert [section for section in dict.fromkeys(row["section"] for row in rows)] == SECTIONS
    assert {row["status"] for row in rows} == {"measured", "skipped"}
    assert all(row["reason"] for row in rows if row["status"] == "skipped")
    measured = {row["name"]: row for row in rows if row["status"] == "measured"}
    hf, raschka = gpu_check.HF_PEER, gpu_check.RASCHKA
    assert set(measured) == {"32-true", "bf16-mixed", "16-mixed", "DistilBERT-shaped, bf16-mixed, --batch-size auto",
                             "ddp", hf, raschka, gpu_check.FP8_ROW, gpu_check.DECODER_LORA_ROW}
    for row in measured.values():
        assert row["results"]["train_samples_per_s"] > 0 and 0 <= row["results"]["test_acc"] <= 1
    assert measured["ddp"]["results"]["world_size"] == 2
    # the peers and the one-GPU rows, measured as a profiler does: a steady window of timed steps, then profiled
    # ones; a CPU has no kernels nor GPU to be busy, and the template reads nothing back between log steps
    for name in ("32-true", "bf16-mixed", "16-mixed", hf, raschka):
        profile = measured[name]["profile"]
        assert measured[name]["steady_samples_per_s"] > 0 and profile["steps_timed"] == 3, (name, profile)
        assert profile["steady_steps"] == 2 and profile["steps_profiled"] == 2 and profile["matmul_flops_per_step"] > 0
        assert profile["kernel_launches_per_step"] == profile["gpu_busy"] == "n/a (cpu)"
        assert profile["host_syncs_per_step"] >= 0
    assert measured["bf16-mixed"]["profile"]["host_syncs_per_step"] == 0
    assert measured[raschka]["results"]["config"]["pad_to_max_length"] and measured[raschka]["results"]["precision"] == \
        "16-mixed" and measured[raschka]["results"]["config"]["batch_size"] == 8  # the dry run's batch
    assert measured[hf]["results"]["precision"] == "bf16-mixed" and measured["bf16-mixed"]["results"][
        "recompiles_after_warm_up"] == 0
    assert measured["bf16-mixed"]["profile"]["mfu_padded"] > 0  # --peak-tflops: a half-precision peak
    # --peak-tflops is a half-precision peak: a CPU has none of its own, so only those rows get an MFU
    assert measured["bf16-mixed"]["results"]["mfu"] > 0 and measured["32-true"]["results"]["mfu"] is None
    assert measured["16-mixed"]["results"]["precision"] == "16-mixed"  # the CPU shim's real fp16, not bf16
    assert any("steps skipped by the loss scaler" in note for note in measured["16-mixed"]["notes"])
    assert any("losses within" in note for note in measured["bf16-mixed"]["notes"])
    assert any("one GPU's" in note for note in measured["ddp"]["notes"])
    assert measured["DistilBERT-shaped, bf16-mixed, --batch-size auto"]["results"]["config"]["batch_size"] > 8
    # fp8-mixed through the CPU shim, eager: torchao's layers in the blocks, the rest bf16-mixed
    fp8 = measured[gpu_check.FP8_ROW]
    assert fp8["results"]["config"]["precision"] == fp8["results"]["precision"] == "fp8-mixed"
    assert "--compile" not in fp8["flags"]
    assert fp8["losses_against"] == "BERT-large-shaped, bf16-mixed --compile" and fp8["first_losses"]
    assert "12 of 14 Linear layers compute in float8" in next((tmp_path / "runs").glob("*fp8*.log")).read_text()
    decoder = measured[gpu_check.DECODER_LORA_ROW]["results"]  # a decoder as a classifier, its adapters only trained
    assert decoder["precision"] == "bf16-mixed" and 0 < decoder["trainable_params"] < decoder["total_params"] / 2
    table = (tmp_path / "gpu_check.md").read_text()
    assert f"- torch: {torch.__version__}" in table and "- deepspeed: " in table
    assert "| samples/s, steady | tokens/s | MFU | MFU, padded | GPU busy | kernels/step | syncs/step | recompiles |" \
        in table
    lines = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| row |")]
    assert len(lines) == len(rows)
    assert "| n/a (cpu) |" in lines[[row["name"] for row in rows].index("bf16-mixed")]
    for row, line in zip(rows, lines):
        assert line.startswith(f"| {row['name']} | {row['status']} |")
        assert row["status"] == "measured" or row["reason"] in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_a_gpu_it_asks_for_one_or_the_dry_run(tmp_path, gpu_check, capsys):
    with pytest.raises(SystemExit) as exited:
        gpu_check.main(["--out", str(tmp_path)])
    assert exited.value.code == 2
    assert "no CUDA GPU here: run it on a GPU machine, or --dry-run" in capsys.readouterr().err.splitlines()[-1]
    assert not list(tmp_path.iterdir()) and not (REPO / "gpu_check.md").exists()


def test_a_row_that_fails_is_reported_with_its_last_line_and_its_log(tmp_path, gpu_check):
    row = gpu_check.Row("one GPU", "bad flag", ["--demo", "--epochs", "0"])
    gpu_check.run_row(row, tmp_path, subprocess_env())
    assert (row.status, row.ok) == ("failed", False)
    assert row.reason == ("exit 2: error: argument --epochs: must be a positive integer, got 0 "
                          "(log: runs/one_GPU-bad_flag.log)")
    assert "must be a positive integer" in (tmp_path / "runs" / "one_GPU-bad_flag.log").read_text()  # the whole log
