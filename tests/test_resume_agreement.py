"""--resume auto on several ranks: every rank resumes from the checkpoint rank 0 picked."""

from types import SimpleNamespace

import pytest
import torch

from fabric_utils.checkpoint import agreed_resume_checkpoint, write_manifest
from fabric_utils.errors import UserError


def write_checkpoint(root, step: int):
    folder = root / f"step-{step:06d}"
    folder.mkdir(parents=True)
    torch.save({"step": step}, folder / "state")  # rank 0 checks its pickles before any rank loads it
    torch.save({}, folder / "rng-rank0.pt")
    (folder / "record.json").write_text('{"world_size": 2, "fingerprint": null}')
    write_manifest(folder)
    return folder


def rank_1(rank_0_picked):
    """Rank 1 of 2, whose broadcast hands it rank 0's pick (and that rank 0 did not refuse it)."""
    return SimpleNamespace(is_global_zero=False, global_rank=1, broadcast=lambda obj: (rank_0_picked, None))


def test_every_rank_resumes_from_rank_0s_pick(tmp_path):
    """Rank 0's file system showed step 10 as the newest (step 20 not yet there, or on another node's disk): rank 1,
    which sees step 20, used to resume from it, another step than rank 0's."""
    picked = write_checkpoint(tmp_path, 10)
    write_checkpoint(tmp_path, 20)
    assert agreed_resume_checkpoint(rank_1(str(picked)), "auto", tmp_path) == picked
    assert agreed_resume_checkpoint(rank_1(None), "auto", tmp_path) is None  # rank 0 found none: a fresh start


def test_a_rank_that_cannot_see_rank_0s_pick_stops_with_one_line(tmp_path):
    with pytest.raises(UserError, match="rank 1 does not see whole; give every node the same --out-dir"):
        agreed_resume_checkpoint(rank_1(str(tmp_path / "step-000030")), "auto", tmp_path)


def test_rank_0_picks_the_newest_complete_checkpoint(tmp_path):
    write_checkpoint(tmp_path, 10)
    newest = write_checkpoint(tmp_path, 20)
    rank_0 = SimpleNamespace(is_global_zero=True, global_rank=0, broadcast=lambda obj: obj)
    assert agreed_resume_checkpoint(rank_0, "auto", tmp_path) == newest
