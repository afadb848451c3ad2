"""Memory that scales with the number of ranks, on 2 CPU processes, where a rank's memory is its
process's peak resident memory (results.json's peak_memory_mb_per_rank, taken before rank 0 gathers the model for
the export): each rank of fsdp2 and of ZeRO-3 (under the test-only DeepSpeed CPU shim) peaks under 0.8x the same
rank of ddp on the same job, for a model saved in bf16, as most large models ship. The job trains LoRA adapters on
the frozen model: the frozen weights are then most of what a rank holds, so a whole copy of them shows (under full
fine-tuning the gradients and Adam's state dominate). What it catches, held whole on every rank: under fsdp2 a
fp32 copy before sharding; under ZeRO-3 a fp32 copy before DeepSpeed cast it to bf16, every gathered weight after the
first step (DeepSpeed's reuse distance), and, to reload the best model, the whole fp32 model."""

import sys
from pathlib import Path

import pytest
import torch

from conftest import train

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.memory import JOB, save_models  # noqa: E402
from data.demo import prepare_demo  # noqa: E402

# glibc hands a freed block above its mmap threshold back to the system at once, but raises the threshold to the
# size of each such block it frees: FSDP2's all-gather buffers, freed every step, then stay in its heap and count in
# the rank's peak. A fixed threshold keeps the peaks to what each rank holds
ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}
# JOB with 2 rows of 8 tokens a batch, for 2 steps (the second gathers again what the first freed): the peaks are the
# weights' (bf16 autocast is emulated, slowly, on most CPUs)
SHORT = {"--batch-size": "2", "--max-length": "8", "--val-size": "4", "--test-size": "4", "--max-steps": "2"}
SHORT_JOB = [SHORT.get(flag, value) for flag, value in zip(["", *JOB], JOB)]  # each value after its flag


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """Each strategy's run folder and results: a 12-layer, 768-wide BERT (110M parameters, 440 MB in fp32) of
    random weights, saved in bf16; a few steps of SHORT_JOB with LoRA."""
    folder = tmp_path_factory.mktemp("memory")
    model = save_models(folder, hidden=768, layers=12, saved=["bf16"])["bf16"]
    data, _ = prepare_demo(Path.home() / ".cache" / "fabric-template" / "demo")
    with pytest.MonkeyPatch.context() as patch:
        for name, value in ALLOCATOR.items():
            patch.setenv(name, value)
        # the best checkpoint kept: the fp32 test reads it
        return {strategy: (folder / strategy, train([*SHORT_JOB, "--dataset", data, "--model", model, "--strategy",
                                                     strategy, "--lora-r", "8", "--keep-best-checkpoint"],
                                                    folder / strategy, deepspeed_cpu=strategy.startswith("deepspeed")))
                for strategy in ("ddp", "fsdp2", "deepspeed_stage_3")}


@pytest.mark.parametrize("strategy", ["fsdp2", "deepspeed_stage_3"])
def test_a_sharded_rank_peaks_under_four_fifths_of_a_ddp_rank(runs, strategy):
    peaks, ddp = (runs[name][1]["peak_memory_mb_per_rank"] for name in (strategy, "ddp"))
    ratios = [ours / theirs for ours, theirs in zip(peaks, ddp)]
    assert len(ratios) == 2 and max(ratios) < 0.8, f"{strategy} peaks at {peaks} MB per rank, ddp at {ddp} MB"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_bf16_file_trains_fp32_weights(runs, strategy):
    """Mixed precision computes in bf16 but must update fp32 weights: the model is loaded in
    the file's dtype and cast (after sharding, under fsdp2), and the checkpoint holds what was trained (the frozen
    weights come from the model's folder): the adapters, and the head, loaded in bf16 like the rest."""
    from lightning.fabric.utilities.load import _load_distributed_checkpoint

    state = runs[strategy][0] / "checkpoints" / "best" / "state"
    weights = (torch.load(state, mmap=True, weights_only=True) if state.is_file()
               else _load_distributed_checkpoint(state))["model"]
    assert any(".modules_to_save.default." in name for name in weights), weights.keys()
    assert {str(weight.dtype) for weight in weights.values() if weight.is_floating_point()} == {"torch.float32"}
