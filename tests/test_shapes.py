"""Shapes that repeat: batches padded to a few lengths (buckets) and of one size, a short last batch filled with rows
that the loss leaves out, so compiled graphs and CUDA graphs are reused instead of rebuilt."""

import itertools
import math

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

from data.tokenize import length_buckets, make_collator
from fabric_utils.loaders import fill_rows, first_rows, make_dataloaders
from task import ClassifierObjective


def imdb_like_lengths(rows: int, max_length: int) -> list[int]:
    """Token counts distributed as IMDB's reviews under a BERT tokenizer: log-normal, median ~230, mean ~300, about
    one in seven cut at 512."""
    g = torch.Generator().manual_seed(0)
    drawn = torch.exp(math.log(230) + 0.73 * torch.randn(rows, generator=g)).round()
    return drawn.clamp(10, max_length).int().tolist()


def test_an_epoch_of_imdb_length_rows_has_few_shapes_and_little_padding(demo_tokenizer):
    lengths = imdb_like_lengths(4000, 512)
    rows = [{"input_ids": torch.full((n,), 7), "attention_mask": torch.ones(n, dtype=torch.long), "labels": 0}
            for n in lengths]
    buckets = length_buckets(512, 8)
    assert len(buckets) <= 24 and buckets[-1] == 512
    for batch_size in (16, 32):
        loader = make_dataloaders({"train": rows, "validation": rows, "test": rows},
                                  make_collator(demo_tokenizer, False, 512, 8), dict.fromkeys(("train", "validation",
                                  "test"), lengths), batch_size=batch_size, eval_batch_size=batch_size, world_size=1,
                                  rank=0, seed=0, group_by_length=True, num_workers=0, pin_memory=False)["train"]
        shapes, computed = set(), 0
        for batch in loader:
            batch = fill_rows(batch, batch_size)
            shapes.add(tuple(batch["input_ids"].shape))
            computed += batch["input_ids"].numel()
        assert len(shapes) <= len(buckets) and {rows for rows, _ in shapes} == {batch_size}, shapes
        assert computed <= 1.10 * sum(lengths), computed / sum(lengths)


def test_a_short_last_batch_filled_to_the_fixed_size_trains_as_the_short_batch(demo_tokenizer):
    """The filling rows run forward and backward but are left out of the loss: the same gradient as the short batch."""
    config = AutoConfig.for_model("bert", vocab_size=len(demo_tokenizer), hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64, num_labels=2)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config).eval()  # no dropout: the two passes compare
    objective = ClassifierObjective("single_label", num_labels=2)
    rows = [{"input_ids": torch.randint(5, len(demo_tokenizer), (n,)), "attention_mask": torch.ones(n, dtype=torch.long),
             "labels": n % 2} for n in (9, 14, 5)]
    short = make_collator(demo_tokenizer, False, 64, 8)(rows)

    def gradients(batch, real):
        model.zero_grad()
        objective.loss(objective.forward(model, batch)[:real], first_rows(batch, real)).backward()
        return [p.grad.clone() for p in model.parameters()]

    filled = fill_rows(short, 8)
    assert filled["input_ids"].shape == (8, 16) and torch.equal(filled["labels"][3:], short["labels"][-1:].repeat(5))
    for expected, got in zip(gradients(short, 3), gradients(filled, 3)):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def test_after_warm_up_an_epoch_of_bucketed_batches_compiles_nothing(demo_tokenizer):
    """The model compiled as train.py's --compile does, with Inductor as on a GPU, warmed up, in training and
    evaluation, on a batch of each kind among the first ones (padded or not) and the task's unpadded example batch: an
    epoch of bucketed, filled batches of every bucket, padded and not, then evaluation, reuse its graphs and kernels.
    Compiling happens in the warm-up, before train.py starts its clocks, and not once in the epoch after it."""
    import time

    from lightning.fabric import Fabric
    from torch._dynamo.utils import counters

    from fabric_utils.speed import batch_kinds, compile_model, warm_up

    config = AutoConfig.for_model("bert", vocab_size=len(demo_tokenizer), hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32, num_labels=2)
    torch.manual_seed(0)
    model = compile_model(AutoModelForSequenceClassification.from_config(config))
    objective = ClassifierObjective("single_label", num_labels=2)
    lengths = [5 + (i * 37) % 60 for i in range(203)] + [64] * 24  # some batches of full rows: no padding
    rows = [{"input_ids": torch.randint(5, len(demo_tokenizer), (n,)), "attention_mask": torch.ones(n, dtype=torch.long),
             "labels": n % 2} for n in lengths]
    loaders = make_dataloaders({"train": rows, "validation": rows, "test": rows},
                               make_collator(demo_tokenizer, False, 64, 8), dict.fromkeys(("train", "validation",
                               "test"), lengths), batch_size=8, eval_batch_size=16, world_size=1, rank=0, seed=0,
                               group_by_length=True, num_workers=0, pin_memory=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def loss_fn(module, batch, rows=None):
        return objective.loss(objective.forward(module, batch)[:rows], first_rows(batch, rows))

    example = {"input_ids": torch.randint(5, len(demo_tokenizer), (8, 64)), "labels": torch.zeros(8, dtype=torch.long)}
    started = time.perf_counter()
    warm_up(Fabric(accelerator="cpu", devices=1), model, optimizer,
            [fill_rows(batch, 8) for batch in batch_kinds(itertools.chain([example], loaders["train"]))], loss_fn)
    warm_up_s = time.perf_counter() - started

    def compiled():  # graphs dynamo captured, AOTAutograd's forward and backward, Inductor's builds (or cache hits)
        return (counters["stats"]["unique_graphs"], counters["aot_autograd"]["total"],
                counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_hit"])

    warmed, shapes, steps_s = compiled(), set(), []
    assert min(warmed) > 0, warmed  # Inductor built the graphs (train and evaluation, padded and not)
    for batch in loaders["train"]:
        shapes.add((tuple(batch["input_ids"].shape), "attention_mask" in batch))
        started = time.perf_counter()
        loss_fn(model, fill_rows(batch, 8), rows=len(batch["labels"])).backward()
        optimizer.step()
        optimizer.zero_grad()
        steps_s.append(time.perf_counter() - started)
    with torch.no_grad():
        model.eval()
        for batch in loaders["validation"]:
            loss_fn(model, batch)
    assert {length for (rows, length), padded in shapes} == set(length_buckets(64, 8))  # every bucket
    assert {padded for shape, padded in shapes} == {True, False} and len(loaders["train"]) > 25
    assert compiled() == warmed  # 0 recompiles after the warm-up, counted
    assert max(steps_s) < warm_up_s / 10, (max(steps_s), warm_up_s)  # no step pays for compiling
