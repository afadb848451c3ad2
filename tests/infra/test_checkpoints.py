"""What --resume auto trusts: each checkpoint records its files and their sizes, a damaged newest one is skipped for
the newest whole one (with a line naming it), and --keep-last never deletes the checkpoint just written."""

import errno
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fabric_utils import checkpoint, checkpoint_io
from fabric_utils.checkpoint import save_checkpoint, wait_for_save
from fabric_utils import resume
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


def test_a_disk_that_cannot_hold_the_next_checkpoint_stops_before_it_is_written(tmp_path, monkeypatch):
    save_steps(tmp_path, (5,))
    size = sum(p.stat().st_size for p in (tmp_path / "step-000005").iterdir())
    monkeypatch.setattr(checkpoint_io.shutil, "disk_usage", lambda path: SimpleNamespace(free=1000))
    with pytest.raises(UserError, match=rf"the disk under {tmp_path} has 1.0 kB free, less than the 1\d\.\d kB "
                                        rf"checkpoint step-000010 needs: it was not written, and the checkpoints "
                                        rf"already there are untouched"):
        save_steps(tmp_path, (10,))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000005"]
    assert sum(p.stat().st_size for p in (tmp_path / "step-000005").iterdir()) == size


def test_a_background_save_is_a_resume_point_only_once_its_last_file_has_landed(tmp_path, monkeypatch):
    """The state written in a thread: until it lands, the folder is a .tmp-* that --resume auto skips (what a kill -9
    leaves), with no manifest; the run's next wait returns once it is whole."""
    save_steps(tmp_path, (5,))
    release, writing, save = threading.Event(), threading.Event(), torch.save

    def slow_save(obj, path):
        writing.set()
        release.wait(60)
        save(obj, path)
    monkeypatch.setattr(checkpoint_io.torch, "save", slow_save)
    fabric = build_fabric(accelerator="cpu", devices="1", precision="32-true")
    model = torch.nn.Linear(64, 64)
    save_checkpoint(fabric, tmp_path, "step-000010", {"model": model, "step": 10}, background=True)
    assert writing.wait(60)
    with torch.no_grad():
        model.weight.zero_()  # training goes on: the checkpoint holds the weights as they were when it was saved
    assert not (tmp_path / "step-000010").exists() and not (tmp_path / ".tmp-step-000010" / "manifest.json").exists()
    assert find_resume_checkpoint("auto", tmp_path) == tmp_path / "step-000005"
    release.set()
    wait_for_save(fabric)
    assert find_resume_checkpoint("auto", tmp_path) == tmp_path / "step-000010"
    written = torch.load(tmp_path / "step-000010" / "state", weights_only=True)["model"]["weight"]
    assert written.abs().sum() > 0


def test_a_checkpoint_leaves_out_frozen_parameters(tmp_path):
    """A frozen body and a small trained head: the checkpoint holds the head (and the optimizer's moments of it), a
    few times its bytes, not the body's; a resume loads it on the body as built."""
    fabric = build_fabric(accelerator="cpu", devices="1", precision="32-true")
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 2))
    model[0].requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model(torch.randn(4, 512)).sum().backward()
    optimizer.step()
    save_checkpoint(fabric, tmp_path, "step-000001", {"model": model, "optimizer": optimizer, "step": 1})
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    saved = (tmp_path / "step-000001" / "state").stat().st_size
    assert saved < 4 * trained + 20_000  # weights, two moments and the pickle's framing: no 1 MB frozen matrix
    assert checkpoint.holds_trained_only(tmp_path / "step-000001")

    rebuilt = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 2))
    rebuilt[0].load_state_dict(model[0].state_dict())  # the base, from its source
    rebuilt[0].requires_grad_(False)
    state = {"model": rebuilt, "optimizer": torch.optim.AdamW([p for p in rebuilt.parameters() if p.requires_grad]),
             "step": 0}
    resume.load_checkpoint(fabric, tmp_path / "step-000001", state)
    assert state["step"] == 1
    for ours, theirs in zip(rebuilt.state_dict().values(), model.state_dict().values()):
        torch.testing.assert_close(ours, theirs)
