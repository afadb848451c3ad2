"""What --resume auto trusts: each checkpoint records its files and their sizes, a damaged newest one is skipped for
the newest whole one (with a line naming it), and --keep-last never deletes the checkpoint just written."""

import errno
from pathlib import Path

import pytest
import torch

from fabric_utils import checkpoint
from fabric_utils.checkpoint import save_checkpoint
from fabric_utils.resume import find_resume_checkpoint
from fabric_utils.errors import UserError
from fabric_utils.launcher import build_fabric


def save_steps(root: Path, steps, keep_last=None) -> None:
    fabric = build_fabric(accelerator="cpu", devices="1", precision="32-true")
    model = torch.nn.Linear(64, 64)
    for step in steps:
        save_checkpoint(fabric, root, f"step-{step:06d}", {"model": model, "step": step}, keep_last)


def test_resume_auto_skips_a_damaged_newest_checkpoint_and_names_it(tmp_path):
    save_steps(tmp_path, (5, 10))
    state = tmp_path / "step-000010" / "state"
    state.write_bytes(state.read_bytes()[:100])  # a disk or a copy cut it short
    said = []
    assert find_resume_checkpoint("auto", tmp_path, report=said.append) == tmp_path / "step-000005"
    assert said == [f"skipping damaged checkpoint {tmp_path / 'step-000010'}: state has 100 bytes, not the "
                    f"{(tmp_path / 'step-000005' / 'state').stat().st_size} written"]
    (tmp_path / "step-000005" / "rng-rank0.pt").unlink()
    assert find_resume_checkpoint("auto", tmp_path, report=said.append) is None
    assert f"skipping damaged checkpoint {tmp_path / 'step-000005'}: rng-rank0.pt is missing" in said


def test_keep_last_never_deletes_the_checkpoint_just_written(tmp_path):
    save_steps(tmp_path, (500,))  # another run's, numbered higher
    save_steps(tmp_path, (10,), keep_last=1)
    assert (tmp_path / "step-000010" / "state").is_file()


def test_a_full_disk_is_one_line_that_names_the_intact_checkpoint(tmp_path, monkeypatch):
    save_steps(tmp_path, (5,))

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(checkpoint.torch, "save", no_space)
    with pytest.raises(UserError, match=f"the disk under {tmp_path} is full: checkpoint step-000010 was not written; "
                                        f"the newest intact one is {tmp_path / 'step-000005'}"):
        save_steps(tmp_path, (10,))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000005"]
