"""Fine-tune a Hugging Face transformer for text classification with Lightning Fabric.

    python train.py --demo                                        # offline, CPU, about a minute
    python train.py --dataset ../shared/data/imdb --model PATH --devices 2
    fabric run --devices 4 --strategy deepspeed_stage_2 train.py --dataset stanfordnlp/imdb

Fabric launches the processes, places model, optimizer and batches, and runs backward; everything else is the
plain PyTorch loop below, meant to be edited. It reads top to bottom in the order it runs:
setup() -> main() -> fit() -> validate() -> finish(). What makes the job text classification (data, model, loss,
metrics, export) is in task.py.
"""

import json
import math
import time
from pathlib import Path

import torch
from torchmetrics import MeanMetric, SumMetric

import task
from data.batching import make_collator, make_dataloaders
from fabric_utils.args import build_parser, parse_flags
from fabric_utils.batch_size import find_batch_size
from fabric_utils.checkpoint import agreed_resume_checkpoint, load_checkpoint, save_checkpoint
from fabric_utils.errors import UserError, exit_on_user_error
from fabric_utils.export import export_model
from fabric_utils.launcher import (build_fabric, clips_in_loop, launch, strategy_checkpoints_blocks,
                                   offloads_optimizer, scales_loss, warn_if_updates_vanish)
from fabric_utils.loggers import finalize_loggers, make_loggers, plot_metrics, save_tracker_ids, saved_tracker_ids
from fabric_utils.optim import build_optimizer, build_scheduler, count_parameters, count_warmup_steps
from fabric_utils.preemption import Preemption
from fabric_utils.progress import Progress
from fabric_utils.sharding import setup_model_and_optimizer
from fabric_utils.run_folder import environment_report, prepare_out_dir, save_config
from fabric_utils.speed import (Throughput, compile_model, configure_backends, default_num_workers, peak_memory_mb, training_flops_fn,
                                warm_up)


def flag_parser():
    """Every flag: the loop's (launch, optimization, speed, checkpoints, logging) and the task's (data, model)."""
    parser = build_parser(description=__doc__.splitlines()[0])
    task.add_args(parser)
    return parser


def parse_args(argv=None):
    return parse_flags(flag_parser(), argv, presets={"demo": task.DEMO_DEFAULTS, "lora_r": task.LORA_DEFAULTS})


@exit_on_user_error
def setup(argv=None) -> dict:
    args = parse_args(argv)
    out_dir = prepare_out_dir(args.out_dir)
    loggers = make_loggers(args.logger, out_dir, project=args.tracker_project,  # a resume continues tracked runs
                           resume_ids=saved_tracker_ids(out_dir) if args.resume else None)
    fabric = build_fabric(accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes,
                          strategy=args.strategy, precision=args.precision, grad_clip=args.grad_clip,
                          grad_checkpointing=args.grad_checkpointing,
                          loggers=loggers)                                                   # Fabric step 1
    warn_if_updates_vanish(fabric.strategy.precision, lr=args.lr)
    launch(fabric)                                                                           # Fabric step 2
    out_dir = Path(fabric.broadcast(str(out_dir)))  # ranks started apart in time agree on rank 0's folder
    return main(fabric, args, out_dir)


def main(fabric, args, out_dir: Path) -> dict:
    fabric.seed_everything(args.seed)
    task.quiet_libraries(args.quiet or not fabric.is_global_zero)
    preemption = Preemption()  # from here on, SIGTERM/SIGUSR1 lead to a checkpoint, not a lost run
    configure_backends(fabric.device)
    env = environment_report(fabric)
    if fabric.is_global_zero and not args.quiet:
        fabric.print(json.dumps(env, indent=1))

    data = load_data(fabric, args)
    objective = task.Objective(data.problem_type, num_labels=len(data.label_names))
    model = task.build_model(data.model_source, data.label_names, data.problem_type,
                             attention_dropout=args.attention_dropout, hidden_dropout=args.hidden_dropout,
                             # FSDP and FSDP2 checkpoint the blocks they shard themselves
                             grad_checkpointing=args.grad_checkpointing
                             and not strategy_checkpoints_blocks(fabric.strategy),
                             lora_r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                             lora_target_modules=args.lora_target_modules)
    params = count_parameters(model)  # now, while every rank holds every weight (no strategy has sharded them)
    save_config(fabric, args, out_dir)  # only now: bad data or model must leave the folder untouched
    save_tracker_ids(fabric, out_dir)  # starts the tracked runs (MLflow, W&B) and keeps their ids for a resume

    def dummy_batch(rows: int, length: int = args.max_length, device=fabric.device) -> dict:
        return objective.dummy_batch(rows, length, vocab_size=len(data.tokenizer), device=device)
    flops_of = training_flops_fn(  # FLOPs of forward and backward, for MFU
        model, lambda m, n: objective.step_loss(m, dummy_batch(1, n, device="meta")), max_length=args.max_length)
    if args.compile:
        model = compile_model(model, mode=args.compile_mode)
    model, optimizer, torch_optimizer = setup_model_and_optimizer(                              # Fabric step 3
        fabric, model, lambda module, shapes: build_optimizer(module, name=args.optimizer, lr=args.lr,
                                                              weight_decay=args.weight_decay, device=fabric.device,
                                                              offload=offloads_optimizer(fabric),
                                                              loss_scaling=scales_loss(fabric), shapes=shapes))
    if args.batch_size == "auto":  # probed on the model and optimizer as set up: wrapped, sharded, with state
        args.batch_size = find_batch_size(fabric, model, optimizer, make_batch=dummy_batch,
                                          loss_fn=objective.step_loss)
    loaders = make_loaders(fabric, args, data)
    max_steps = args.max_steps or args.epochs * math.ceil(len(loaders["train"]) / args.grad_accum)
    scheduler = build_scheduler(torch_optimizer, args.scheduler, lr=args.lr, max_steps=max_steps,
                                warmup_steps=count_warmup_steps(args.warmup, max_steps))

    meta = {"model": data.model_source, "labels": data.label_names, "problem_type": data.problem_type}
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0, "epoch": 0,
             "batch_in_epoch": 0, "best_val": {}, "meta": meta, "config": vars(args)}
    resume_from = agreed_resume_checkpoint(fabric, args.resume, out_dir / "checkpoints")
    if resume_from:
        load_checkpoint(fabric, resume_from, state, expected_meta=meta)
        fabric.print(f"resumed from {resume_from} at step {state['step']}")

    if fit(fabric, args, state, loaders=loaders, preemption=preemption, ckpt_dir=out_dir / "checkpoints",
           max_steps=max_steps, flops_of=flops_of, objective=objective):
        finalize_loggers(fabric.loggers, status="preempted")  # this segment's metrics stay on disk
        fabric.print(f"preempted: saved a checkpoint at step {state['step']}; rerun with --resume auto")
        preemption.exit(fabric)  # status EXIT_PREEMPTED (75)
    return finish(fabric, args, state, loaders=loaders, out_dir=out_dir, data=data, objective=objective,
                  report={**params, "environment": env})


def load_data(fabric, args) -> task.TaskData:
    with fabric.rank_zero_first(local=True):  # rank 0 of each node tokenizes first; the others read its cache
        data = task.load_data(dataset=args.dataset, model=args.model, demo=args.demo, text_column=args.text_column,
                              label_column=args.label_column, max_length=args.max_length, seed=args.seed,
                              train_size=args.train_size, val_size=args.val_size, test_size=args.test_size,
                              problem_type=args.problem_type, label_separator=args.label_separator,
                              drop_invalid=args.drop_invalid)
    for note in data.notes:
        fabric.print(note)
    args.problem_type = data.problem_type  # config.yaml records what auto chose
    return data


def make_loaders(fabric, args, data: task.TaskData) -> dict:
    loaders = make_dataloaders(
        data.splits, make_collator(data.tokenizer, args.pad_to_max_length, args.max_length, args.pad_to_multiple_of),
        batch_size=args.batch_size, eval_batch_size=args.eval_batch_size or 2 * args.batch_size,
        world_size=fabric.world_size, rank=fabric.global_rank, seed=args.seed, group_by_length=args.group_by_length,
        num_workers=default_num_workers(fabric) if args.num_workers is None else args.num_workers,
        pin_memory=fabric.device.type == "cuda")
    # the samplers already shard rows across ranks, so Fabric only moves batches to the device
    return dict(zip(loaders, fabric.setup_dataloaders(*loaders.values(), use_distributed_sampler=False)))


def micro_batches(loader, grad_accum: int, start: int):
    """Yields ``(batch, group_size, is_last)`` for the rest of the epoch from batch ``start`` on: how many micro-batches
    the batch's optimizer step averages (the epoch's last group may be short), and whether it is the group's last."""
    epoch_batches = start + len(loader)
    for position, batch in enumerate(loader, start=start):
        group_size = min(grad_accum, epoch_batches - (position - position % grad_accum))
        yield batch, group_size, (position + 1) % grad_accum == 0 or position + 1 == epoch_batches


def fit(fabric, args, state, loaders, preemption, ckpt_dir, max_steps, flops_of, objective) -> bool:
    """Trains until ``max_steps``, early stopping or preemption; returns whether it was preempted."""
    model, optimizer, scheduler, train_loader = state["model"], state["optimizer"], state["scheduler"], loaders["train"]
    progress = Progress(fabric, max_steps, args.quiet, metrics=objective.make_metrics())
    monitor = Throughput(fabric, args.peak_tflops, flops_of)
    if args.compile:
        warm_up(fabric, model, optimizer, batch=next(iter(train_loader)), loss_fn=objective.step_loss)
    fabric.barrier()
    monitor.start(state["step"])
    stale, preempted, stop = 0, False, False
    while state["step"] < max_steps and not stop:
        train_loader.batch_sampler.set_epoch(state["epoch"], start_batch=state["batch_in_epoch"])
        epoch_batches = state["batch_in_epoch"] + len(train_loader)  # the sampler skips what a resume has done
        for batch, group_size, is_last in micro_batches(train_loader, args.grad_accum, state["batch_in_epoch"]):
            state["batch_in_epoch"] += 1
            with fabric.no_backward_sync(model, enabled=not is_last):  # DDP all-reduces only on the last
                logits = task.forward(model, batch)
                loss = objective.loss(logits, batch)
                fabric.backward(loss / group_size)                                           # Fabric step 4
            progress.update(loss, logits, batch["labels"])
            monitor.count(task.row_lengths(batch))
            if not is_last:
                continue
            if args.grad_clip and clips_in_loop(fabric):  # DeepSpeed clips inside optimizer.step()
                # no error on a non-finite norm: checking it is a sync, and 16-mixed's scaler skips those steps
                fabric.clip_gradients(model, optimizer, max_norm=args.grad_clip, error_if_nonfinite=False)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            state["step"] += 1
            step = state["step"]

            if step % args.log_every == 0 or step == max_steps:  # the only host-device syncs of the hot loop
                log_step(fabric, progress, monitor, step, lr=scheduler.get_last_lr()[0], max_lr=args.lr)
            preempted = preemption.agreed(fabric)
            epoch_ends = state["batch_in_epoch"] == epoch_batches
            if epoch_ends or (args.val_every and step % args.val_every == 0) or step == max_steps:
                with monitor.paused():  # the throughput clock counts training time only
                    val = validate(fabric, model, loaders["validation"], objective=objective, step=step)
                    if objective.is_better(val[objective.best_metric], state["best_val"].get(objective.best_metric)):
                        state["best_val"], stale = val, 0  # the best model so far is kept as checkpoints/best
                        save_checkpoint(fabric, ckpt_dir, "best", {"model": model, "meta": state["meta"], "step": step})
                    else:
                        stale += 1
            stop = preempted or bool(args.early_stop and stale >= args.early_stop)
            if epoch_ends:
                state["epoch"], state["batch_in_epoch"] = state["epoch"] + 1, 0
            if (args.save_every and step % args.save_every == 0) or epoch_ends or stop:
                with monitor.paused():
                    save_checkpoint(fabric, ckpt_dir, f"step-{step:06d}", state, args.keep_last)
                    for logger in fabric.loggers:
                        logger.save()  # the metrics up to this checkpoint survive a kill
            if stop or step >= max_steps:
                break
    state["throughput"] = monitor.stop()
    return preempted


def log_step(fabric, progress, monitor, step, lr, max_lr) -> None:
    logged = progress.log(step, lr)
    # every rank sees the same loss, so all stop here together. Under 16-mixed too: the loss scaler skips steps whose
    # gradients overflow, but the loss itself stays finite then; a non-finite loss means the run diverged
    if not math.isfinite(logged["train/loss"]):
        raise UserError(f"the training loss became {logged['train/loss']} by step {step}: lower --lr (now {max_lr}), "
                        f"keep --grad-clip on, or use --precision bf16-mixed/32-true")
    progress.show(monitor.log(step))


def validate(fabric, model, loader, objective, step) -> dict:
    """Evaluates on the validation split and logs the result."""
    val = evaluate(fabric, model, loader, objective=objective)
    fabric.log_dict({f"val/{name}": value for name, value in val.items() if name != "examples"}, step=step)
    fabric.print(f"step {step}: " + ", ".join(f"val {k} {v:.4f}" for k, v in val.items() if k != "examples"))
    return val


@torch.no_grad()
def evaluate(fabric, model, loader, objective) -> dict:
    """Loss and the task's metrics over every row of the split exactly once, summed over all ranks."""
    model.eval()
    mean_loss, rows = MeanMetric().to(fabric.device), SumMetric().to(fabric.device)
    metrics = objective.make_metrics().to(fabric.device)
    remaining = loader.batch_sampler.num_real  # the rest repeat a row so all ranks run the same number of batches
    for batch in loader:
        real = min(len(batch["labels"]), remaining)
        remaining -= real
        if real == 0:
            continue
        batch = {name: value[:real] for name, value in batch.items()}
        logits = task.forward(model, batch)
        mean_loss.update(objective.loss(logits, batch, reduction="none"))
        metrics.update(logits, batch["labels"])
        rows.update(real)
    model.train()
    return {"loss": mean_loss.compute().item(), **{k: v.item() for k, v in metrics.compute().items()},
            "examples": int(rows.compute().item())}


def finish(fabric, args, state, loaders, out_dir, data, objective, report) -> dict:
    """Tests the best model, exports it and writes results.json (with ``report``: what else the run knows)."""
    model, best = state["model"], out_dir / "checkpoints" / "best" / "state"
    fabric.load(best, {"model": model})
    test = evaluate(fabric, model, loaders["test"], objective=objective)
    export_model(fabric, best, out_dir / "model",
                 write=lambda weights, folder: task.export(weights, model, data.tokenizer, folder))
    results = {
        **{f"val_{k}": v for k, v in state["best_val"].items()}, **{f"test_{k}": v for k, v in test.items()},
        "train_examples": len(data.splits["train"]), "steps": state["step"],
        "epochs": state["epoch"] + (state["batch_in_epoch"] > 0), "world_size": fabric.world_size,
        "precision": fabric.strategy.precision.precision, "strategy": type(fabric.strategy).__name__,
        **state["throughput"], "peak_memory_mb": peak_memory_mb(fabric.device), **report, "config": vars(args),
    }
    finalize_loggers(fabric.loggers)  # flushes metrics.csv, which the plots read; ends the tracked runs
    if fabric.is_global_zero:
        (out_dir / "results.json").write_text(json.dumps(results, indent=2))
        plot_metrics(out_dir)
    fabric.print(f"test {objective.best_metric} {test[objective.best_metric]:.4f} on {test['examples']} rows; "
                 f"results in {out_dir}/results.json")
    return results


if __name__ == "__main__":
    setup()
