"""DeepSpeed checkpoints on 2 CPU processes under the test-only shim: the best model (weights only) and its export,
with frozen weights as LoRA leaves them. tests/shims/zero_checkpoint_probe.py trains and saves a small model."""

import functools
import json
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import run


@functools.cache
def probe(strategy: str) -> dict:
    """One 2-process run of zero_checkpoint_probe.py per strategy, shared by the tests that read it."""
    out = Path(tempfile.mkdtemp()) / "probe.json"
    run([sys.executable, "tests/shims/zero_checkpoint_probe.py", strategy, str(out)], deepspeed_cpu=True)
    return json.loads(out.read_text())


def test_zero_1_export_includes_the_frozen_weights():
    """ZeRO-1 leaves frozen weights out of its shards; export used to miss them (a crash under --lora-r)."""
    found = probe("deepspeed_stage_1")
    assert found["missing"] == [] and found["export_matches"]


@pytest.mark.parametrize("strategy", ["deepspeed_stage_1", "deepspeed_stage_3"])
def test_best_checkpoint_holds_the_weights_without_the_optimizer_moments(strategy):
    """checkpoints/best is rewritten at every improvement: it used to hold Adam's two moments too (4 bytes each per
    trained weight). It still loads back into the engine and exports the trained weights."""
    found = probe(strategy)
    assert found["bytes"]["step-000002"] - found["bytes"]["best"] >= 2 * 4 * found["trainable"]
    assert found["reloaded_matches"] and found["export_matches"] and found["missing"] == []
