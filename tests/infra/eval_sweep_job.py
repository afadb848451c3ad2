"""Evaluation of whatever task.py is, on the processes of a job, for many split sizes and evaluation batch sizes:
``train.evaluate`` on the first N validation rows through the loop's own loaders, with every batch size, under one
strategy. Writes OUT (JSON) with each result.

    python tests/infra/eval_sweep_job.py STRATEGY OUT

Ranks that hold one row fewer repeat a row, and a rank whose last batch holds only that row must still run its
forward: under fsdp, fsdp2 and ZeRO-3 a forward is a collective, so a skipped one hangs the job."""

import json
import sys
from pathlib import Path

from torch.utils.data import Subset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import task  # noqa: E402
from fabric_utils.launcher import build_fabric, end_job  # noqa: E402
from fabric_utils.loaders import make_dataloaders  # noqa: E402
from train import build, evaluate, parse_args  # noqa: E402

ROWS = (1, 2, 3, 5, 8, 13)
BATCHES = (1, 2, 3, 7, 50)


def main():
    strategy, out = sys.argv[1], Path(sys.argv[2])
    fabric = build_fabric(accelerator="cpu", devices="2", strategy=strategy, precision="32-true")
    fabric.launch()
    fabric.seed_everything(0)
    args = parse_args([*task.TEST_FLAGS, "--quiet"])
    with fabric.rank_zero_first(local=True):
        job = task.setup(args, verbose=False)
    loss_fn = lambda model, batch: job.objective.loss(job.objective.forward(model, batch), batch)  # noqa: E731
    model = build(fabric, args, job, loss_fn, fresh=True)[0]  # as the loop builds and sets it up
    found = []
    for rows in ROWS:
        splits = dict.fromkeys(("train", "validation", "test"), Subset(job.datasets["validation"], range(rows)))
        sizes = dict.fromkeys(splits, list(job.lengths.per_split["validation"])[:rows]) if job.lengths else None
        for batch in BATCHES:
            loaders = make_dataloaders(splits, job.collate, sizes, batch_size=batch, eval_batch_size=batch,
                                       world_size=fabric.world_size, rank=fabric.global_rank, seed=0,
                                       group_by_length=False, num_workers=0, pin_memory=False)
            loader = fabric.setup_dataloaders(loaders["validation"], use_distributed_sampler=False)
            found.append({"rows": rows, "batch": batch, **evaluate(fabric, model, loader, objective=job.objective)})
    if fabric.is_global_zero:
        out.write_text(json.dumps(found))
    end_job(fabric)


if __name__ == "__main__":
    main()
