"""The loaders' samplers, for any task: every training row once per epoch on every number of ranks, length grouping
that resumes mid-epoch, and evaluation that scores each row exactly once with the same number of batches on every
rank."""

import pytest
import torch

from fabric_utils.loaders import EvalBatchSampler, TrainBatchSampler


def test_train_sampler_covers_every_row_once_per_epoch_on_two_ranks():
    lengths = [(i * 37) % 101 + 1 for i in range(203)]  # odd count: one row is repeated to share evenly
    epochs = []
    for epoch in range(2):
        per_rank = []
        for rank in range(2):
            sampler = TrainBatchSampler(lengths, batch_size=8, num_replicas=2, rank=rank, seed=5)
            sampler.set_epoch(epoch)
            per_rank.append([i for batch in sampler for i in batch])
            assert len(list(sampler)) == len(sampler)
        assert len(per_rank[0]) == len(per_rank[1]) == 102  # equal work, so no rank waits in an all-reduce
        seen = per_rank[0] + per_rank[1]
        assert set(seen) == set(range(203)) and len(seen) == 204
        assert len(set(per_rank[0]) & set(per_rank[1])) <= 1  # each rank different rows but the one pad
        epochs.append(seen)
    assert epochs[0] != epochs[1]  # reshuffled every epoch


def test_length_grouping_cuts_padding_and_resumes_mid_epoch():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 500, (2000,), generator=g).tolist()

    def padded_tokens(group):
        sampler = TrainBatchSampler(lengths, batch_size=16, seed=1, group_by_length=group)
        return sum(len(b) * max(lengths[i] for i in b) for b in sampler)
    assert padded_tokens(True) < 0.6 * padded_tokens(False)
    sampler = TrainBatchSampler(lengths, batch_size=16, seed=1)
    sampler.set_epoch(3)
    full = list(sampler)
    sampler.set_epoch(3, start_batch=40)
    assert list(sampler) == full[40:] and len(sampler) == len(full) - 40


@pytest.mark.parametrize("group_by_length", [True, False])
def test_each_optimizer_step_sees_the_same_rows_on_any_number_of_ranks(group_by_length):
    """32 rows per optimizer step as 4 ranks x 8, 2 ranks x 8 x 2 micro-batches, or 1 x 8 x 4: the same rows in each
    step, so a run resumed on another number of devices goes on with the same steps (the epoch's last step too, whose
    rows here divide among the ranks)."""
    lengths = [(i * 37) % 101 + 1 for i in range(500)]

    def steps(world_size, grad_accum):
        batches = [[] for _ in range(len(TrainBatchSampler(lengths, 8, world_size)))]
        for rank in range(world_size):
            sampler = TrainBatchSampler(lengths, batch_size=8, num_replicas=world_size, rank=rank, seed=3,
                                        group_by_length=group_by_length, grad_accum=grad_accum)
            sampler.set_epoch(2)
            for batch, rows in zip(batches, sampler):
                batch += rows
        return [sorted(i for batch in batches[s:s + grad_accum] for i in batch)
                for s in range(0, len(batches), grad_accum)]

    assert steps(4, 1) == steps(2, 2) == steps(1, 4)
    assert len(steps(1, 4)) == 16 and len(steps(1, 4)[-1]) == 500 - 15 * 32  # the short step is the last


def test_eval_sampler_scores_every_row_exactly_once_on_two_ranks():
    lengths = [(i * 13) % 50 + 1 for i in range(101)]
    samplers = [EvalBatchSampler(lengths, batch_size=8, num_replicas=2, rank=r) for r in range(2)]
    assert len(samplers[0]) == len(samplers[1])  # same number of batches: sharded forwards stay in step
    real = [s.indices[:s.num_real] for s in samplers]
    assert sorted(real[0] + real[1]) == list(range(101))
    assert samplers[1].num_real == 50 and all(len(b) == 8 for s in samplers for b in s)  # repeats fill each batch


@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_eval_sampler_gives_every_rank_the_same_batches_even_with_fewer_rows_than_ranks(rows):
    samplers = [EvalBatchSampler([1] * rows, batch_size=2, num_replicas=4, rank=r) for r in range(4)]
    assert len({len(list(s)) for s in samplers}) == 1 and len(list(samplers[0])) == len(samplers[0]) >= 1
    assert sorted(i for s in samplers for i in s.indices[:s.num_real]) == list(range(rows))
