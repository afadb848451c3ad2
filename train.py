"""Train a model with Lightning Fabric; what it trains (data, model, loss, metrics, export) is the task's.

    python train.py [task flags]                                  # one device; `--help` lists every flag
    python train.py --devices 2 --strategy fsdp2 [task flags]
    fabric run --devices 4 --strategy deepspeed_stage_2 train.py [task flags]

Fabric launches the processes, places model, optimizer and batches, and runs backward; the rest is the plain PyTorch
loop below, meant to be edited, in the order it runs: setup() -> main() -> fit() -> validate() -> finish().
The task is task.py, whose setup() gives a `TaskSpec` (fabric_utils/task_spec.py): another task replaces task.py.
"""

import task
from fabric_utils.args import FP8, Config, build_parser, parse_flags
from fabric_utils.errors import UserError, exit_on_user_error


def flag_parser():
    """Every flag: the loop's (launch, optimization, speed, checkpoints, logging) and the task's (data, model)."""
    parser = build_parser(description=__doc__.splitlines()[0])
    task.add_args(parser)
    return parser


def parse_args(argv=None):
    flags = parse_flags(flag_parser(), argv, presets=getattr(task, "PRESETS", {}))
    if flags.fast_dev_run:  # N optimizer steps, CSV logs only (trackers write elsewhere), in a folder it removes
        for flag in ("out_dir", "resume"):
            if getattr(flags, flag):
                raise UserError(f"--fast-dev-run runs in a temporary folder it removes: drop "
                                f"--{flag.replace('_', '-')}")
        vars(flags).update(max_steps=flags.fast_dev_run, logger="csv", save_every=None, val_every=None)
    return flags


if __name__ == "__main__":
    # --help and a bad flag answer here, before the libraries imported below load (seconds)
    exit_on_user_error(parse_args)()

import dataclasses
import functools
import itertools
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.data import Subset
from torchmetrics import MeanMetric, SumMetric

from fabric_utils import strategy
from fabric_utils.batch_size import find_batch_size
from fabric_utils.checkpoint import (agreed_resume_checkpoint, load_checkpoint, load_weights, read_record,
                                     remove_checkpoint, save_checkpoint)
from fabric_utils.export import export_model, save_weights
from fabric_utils.launcher import build_fabric, explain_lost_peers, launch, warn_if_updates_vanish
from fabric_utils.loaders import fill_rows, first_rows, make_dataloaders
from fabric_utils.loggers import finalize_loggers, make_loggers, plot_metrics, save_tracker_ids
from fabric_utils.optim import build_optimizer, count_parameters
from fabric_utils.preemption import STATUS_FILE, Preemption
from fabric_utils.pretrained import build_model, load_pretrained
from fabric_utils.progress import Progress, Throughput, counted, say, shows_bars, silence_libraries
from fabric_utils.run_folder import (RUN_DIR_ENV, environment_report, locked_run_folder, prepare_out_dir,
                                     remove_if_unused, save_config, write_predictions)
from fabric_utils.sharding import (cast_shards, compile_in_engine, full_shapes, prepare_for_setup, recompute_blocks,
                                   shapes_by_name)
from fabric_utils.task_spec import TaskSpec
from fabric_utils.speed import (batch_kinds, compile_model, convert_to_float8, default_num_workers,
                                 peak_memory_per_rank, processes_sharing, training_flops_fn, warm_up)
from fabric_utils.threads import set_threads


@exit_on_user_error
def setup(argv=None) -> dict:
    flags = parse_args(argv)
    if not flags.verbose:
        silence_libraries()
    check_dir = None
    if flags.fast_dev_run and RUN_DIR_ENV not in os.environ:  # one temporary folder for every process this one starts
        check_dir = os.environ[RUN_DIR_ENV] = tempfile.mkdtemp(prefix="fabric-template-check-")
    out_dir, created = prepare_out_dir(flags.out_dir, resume=flags.resume)
    try:
        loggers = make_loggers(flags.logger, out_dir, project=flags.tracker_project, resume=bool(flags.resume))
        fabric = build_fabric(accelerator=flags.accelerator, devices=flags.devices, num_nodes=flags.num_nodes,
                              strategy=flags.strategy, precision=flags.precision, grad_clip=flags.grad_clip,
                              grad_checkpointing=flags.grad_checkpointing, loggers=loggers)  # Fabric step 1
        launch(fabric)                                                                        # Fabric step 2
        # nodes started apart in time agree on rank 0's folder
        with locked_run_folder(fabric, out_dir) as run_dir, explain_lost_peers(fabric):
            return main(fabric, flags, run_dir)
    finally:
        if created:  # a start that failed before writing anything leaves no folder behind
            remove_if_unused(out_dir)
        if check_dir:  # by the process that made it: the processes it started share it
            shutil.rmtree(check_dir, ignore_errors=True)
            say(f"--fast-dev-run: removed its folder {check_dir}")


def cut_splits(spec: TaskSpec, rows: dict[str, int]) -> TaskSpec:
    """``spec`` with each split cut to its first ``rows[split]`` rows (--fast-dev-run): whatever the task."""
    datasets = {name: Subset(split, range(min(len(split), rows[name]))) for name, split in spec.datasets.items()}
    lengths = spec.lengths and dataclasses.replace(spec.lengths, per_split={
        name: [lengths[i] for i in range(len(datasets[name]))] for name, lengths in spec.lengths.per_split.items()})
    # a run of a few steps is at chance by design: no line saying it did not learn
    return dataclasses.replace(spec, datasets=datasets, lengths=lengths, chance_loss=None)


def main(fabric, flags, out_dir: Path) -> dict:
    fabric.seed_everything(flags.seed)
    # before any heavy work: threads beyond the cores, this job's or another's, fight and the run crawls
    threads = set_threads(flags.num_threads, sharing=processes_sharing(fabric, os.sched_getaffinity(0)))
    preemption = Preemption()  # from here on, SIGTERM/SIGUSR1 lead to a checkpoint, not a lost run
    if fabric.device.type == "cuda":  # TF32 matrix products and cuDNN autotuning: free speed on Ampere+ GPUs
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.benchmark = True
        # cuDNN's attention builds a plan for every new batch shape, and length-grouped batches are nearly all new
        torch.backends.cuda.enable_cudnn_sdp(False)
    env = environment_report(fabric)
    if flags.verbose:
        say(json.dumps(env, indent=1))
    with fabric.rank_zero_first(local=True):  # rank 0 of each node prepares the data first; the others read its cache
        spec: TaskSpec = task.setup(flags, verbose=shows_bars(fabric, flags.quiet, flags.verbose))

    resume_from = agreed_resume_checkpoint(fabric, flags.resume, out_dir / "checkpoints", report=say)
    model, optimizer, torch_optimizer, flops_of, params = build(fabric, flags, spec, pretrained=not resume_from)
    batch_size = fitting_batch_size(fabric, flags.batch_size, spec, model, optimizer)
    # a requeued job may come back on fewer devices: it continues with the same optimizer steps
    grad_accum = keep_rows_per_step(fabric, batch_size, flags.grad_accum, read_record(resume_from)) if resume_from \
        else flags.grad_accum
    if flags.fast_dev_run:  # N batches of each split on every process
        batches = flags.fast_dev_run * fabric.world_size
        eval_rows = batches * (flags.eval_batch_size or 2 * batch_size)
        spec = cut_splits(spec, {"train": batches * batch_size * grad_accum, "validation": eval_rows,
                                 "test": eval_rows})
    loaders = make_loaders(fabric, flags, spec, batch_size=batch_size, grad_accum=grad_accum)
    steps_per_epoch = math.ceil(len(loaders["train"]) / grad_accum)
    max_steps = flags.max_steps or flags.epochs * steps_per_epoch
    # every value the run uses, read-only from here on: what the task detected, the batch size and --grad-accum
    # decided above, and the task's peak --lr for a run this long (longer runs want a lower one) where none was given
    config = Config(flags, **spec.decided_flags or {}, batch_size=batch_size, grad_accum=grad_accum,
                    lr=spec.default_lr(max_steps) if flags.lr is None else flags.lr)
    warn_if_updates_vanish(fabric.strategy.precision, lr=config.lr)
    scheduler = build_scheduler(torch_optimizer, config.scheduler, lr=config.lr, max_steps=max_steps,
                                warmup=config.warmup, min_lr_rate=config.min_lr_rate)
    rule = best_rule(spec.objective, config.best_metric)
    state = restore(fabric, config, spec, model, optimizer, scheduler, max_steps, checkpoint=resume_from)
    # only now: bad data, model or checkpoint leave the folder as it was; each resumed segment keeps its own flags
    save_config(fabric, config, out_dir, resumed_at=state.step if resume_from else None, environment=env)
    save_tracker_ids(fabric, out_dir)  # starts the tracked runs (MLflow, W&B) and keeps their ids for a resume
    if not config.quiet:
        say(header(fabric, config, spec, max_steps, steps_per_epoch, out_dir, threads, rule))

    preempted, throughput = fit(fabric, config, state, loaders=loaders, preemption=preemption,
                                ckpt_dir=out_dir / "checkpoints", max_steps=max_steps, steps_per_epoch=steps_per_epoch,
                                flops_of=flops_of, spec=spec, rule=rule)
    if preempted:
        finalize_loggers(fabric.loggers, status="preempted")  # this segment's metrics stay on disk
        say(f"preempted: saved a checkpoint at step {state.step}; rerun with --resume auto")
        preemption.exit(fabric, loaders, out_dir, step=state.step,  # status EXIT_PREEMPTED (75)
                        checkpoint=out_dir / "checkpoints" / f"step-{state.step:06d}")
    preemption.training_ended()
    results = finish(fabric, config, state, loaders=loaders, out_dir=out_dir, spec=spec,
                     report={**throughput, **params, "environment": env})
    preemption.close(fabric, loaders)  # workers, then the process group: nothing left for teardown to trip on
    return results


def fitting_batch_size(fabric, batch_size: int | str, spec: TaskSpec, model, optimizer) -> int:
    """--batch-size, or the largest that fits with ``auto`` (probed on the model and optimizer as set up: wrapped,
    sharded, with state); at most the training rows per device (the header and config.yaml say what is used)."""
    if batch_size == "auto":
        batch_size = find_batch_size(fabric, model, optimizer, loss_fn=functools.partial(training_loss, spec.objective),
                                     make_batch=lambda rows: spec.example_batch(rows, None, fabric.device))
    per_device = math.ceil(len(spec.datasets["train"]) / fabric.world_size)
    if batch_size > per_device:
        say(f"--batch-size {batch_size} is more than the {per_device:,} training rows per device: using {per_device}")
    return min(batch_size, per_device)


def build(fabric, args, spec: TaskSpec, pretrained: bool):
    """The task's model and optimizer set up by Fabric, the torch optimizer inside (for the schedule), the FLOPs per
    training step (for MFU) and parameter counts; ``pretrained`` loads the task's values (else a checkpoint will)."""
    # under fsdp, fsdp2 and ZeRO-3 already sharded, filled with the pretrained values after set-up
    model, source = build_model(fabric, spec.build_model, spec.build_skeleton, pretrained=pretrained)
    if args.grad_checkpointing and not strategy.checkpoints_blocks(fabric):
        recompute_blocks(model)  # FSDP and FSDP2 recompute the blocks they shard themselves
    params = count_parameters(model)
    step_loss = functools.partial(training_loss, spec.objective)
    flops_of = training_flops_fn(  # FLOPs of forward and backward, for MFU
        model, step_loss, lambda size: spec.example_batch(1, size, "cpu"),
        max_size=spec.lengths.longest if spec.lengths else None)
    if args.precision == FP8:  # before compiling and set-up, which wrap the float8 layers as any other
        convert_to_float8(model)
    if args.compile:  # fabric.setup recompiles it around the strategy's wrapper
        model = compile_model(model, mode=compile_mode(fabric, args.compile_mode))
    model, compiled = prepare_for_setup(fabric, model)  # fp32 weights to update; DeepSpeed compiles in its engine
    shapes = full_shapes(model)  # before FSDP flattens them: AdamW decays only the matrices

    # at rate 0: the schedule sets the peak once the run's length, on which the default depends, is known
    def new_optimizer(module):
        return build_optimizer(module, name=args.optimizer, lr=0.0, weight_decay=args.weight_decay,
                               device=fabric.device, offload=strategy.offloads_optimizer(fabric),
                               loss_scaling=strategy.scales_loss(fabric), shapes=shapes_by_name(module, shapes))

    if strategy.builds_optimizer_after_setup(fabric):  # on what set-up made: FSDP's shards, transformer-engine's layers
        model = cast_shards(fabric, fabric.setup_module(model))                                # Fabric step 3
        torch_optimizer = new_optimizer(model)
        optimizer = fabric.setup_optimizers(torch_optimizer)
    else:  # DeepSpeed's engine takes both at once
        torch_optimizer = new_optimizer(model)
        model, optimizer = fabric.setup(model, torch_optimizer)                                # Fabric step 3
        compile_in_engine(fabric, compiled)
    if source:
        load_pretrained(fabric, model, source)
    return model, optimizer, torch_optimizer, flops_of, params


def build_scheduler(optimizer, name: str, lr: float, max_steps: int, warmup: float, min_lr_rate: float = 0.0):
    """Linear warm-up from 0 to the peak ``lr`` (``warmup``: a fraction of all steps if below 1, else a step count),
    then linear, cosine or no decay to ``min_lr_rate`` x the peak, as transformers' schedules (one-cycle: PyTorch's).
    ``lr`` replaces the optimizer's rate: a default peak depends on the run's length, known only after the optimizer."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    warmup_steps = math.ceil(warmup * max_steps) if warmup < 1 else int(warmup)
    if name == "one-cycle":
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=max_steps,
                                                   pct_start=max(warmup_steps, 1) / max_steps)
    decay = {"linear": lambda progress: max(0.0, 1.0 - progress),
             "cosine": lambda progress: max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress))),
             "constant": lambda progress: 1.0}[name]

    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / max(1, warmup_steps)
        return min_lr_rate + (1.0 - min_lr_rate) * decay((step - warmup_steps) / max(1, max_steps - warmup_steps))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def compile_mode(fabric, mode: str) -> str:
    """--compile-mode, whose default on CUDA under one device or DDP is reduce-overhead: CUDA graphs launch a step's
    hundreds of kernels at once, as batches come in a few shapes (buckets); sharded strategies gather parameters
    between kernels, which a graph cannot hold."""
    return "reduce-overhead" if mode == "default" and strategy.fits_cuda_graphs(fabric) else mode


ROWS_PER_STEP = "rows per optimizer step (--batch-size x devices x --grad-accum)"


@dataclasses.dataclass
class TrainState:
    """What a step checkpoint holds (its fields, by name): the model, optimizer and schedule, and where the run is."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    fingerprint: dict  # what a resume must continue (the task's model and data, the optimization), named by flag
    config: dict
    rows_per_batch: int  # rows of one batch over all ranks: what batch_in_epoch counts
    step: int = 0  # optimizer steps taken
    epoch: int = 0
    batch_in_epoch: int = 0
    best_val: dict = dataclasses.field(default_factory=dict)  # the validation results of checkpoints/best
    train_losses: list = dataclasses.field(default_factory=list)  # every logged loss: a resumed run judges the whole


def restore(fabric, config, spec: TaskSpec, model, optimizer, scheduler, max_steps: int,
            checkpoint: Path | None) -> TrainState:
    """The training state: a fresh one, or ``checkpoint``'s if it continues this run (else a one-line error)."""
    fingerprint = {**spec.fingerprint, "--seed": config.seed, "--optimizer": config.optimizer, "--lr": config.lr,
                   "--weight-decay": config.weight_decay, "--scheduler": config.scheduler, "--warmup": config.warmup,
                   "--min-lr-rate": config.min_lr_rate, "--grad-clip": config.grad_clip,
                   "optimizer steps (--max-steps, --epochs)": max_steps,
                   ROWS_PER_STEP: config.batch_size * fabric.world_size * config.grad_accum}
    rows_per_batch = config.batch_size * fabric.world_size
    state = TrainState(model, optimizer, scheduler, fingerprint=fingerprint, config=vars(config),
                       rows_per_batch=rows_per_batch)
    if checkpoint:
        load_checkpoint(fabric, checkpoint, vars(state), expected_fingerprint=fingerprint)  # fills it in place
        # the same row of the epoch in this run's batches (other ones, if the number of devices changed)
        state.batch_in_epoch = state.batch_in_epoch * state.rows_per_batch // rows_per_batch
        state.rows_per_batch = rows_per_batch
        say(f"resumed from {checkpoint} at step {state.step}")
    return state


def best_rule(objective, choice: str | None) -> tuple[str, str, Callable[[float, float | None], bool]]:
    """The validation metric that picks checkpoints/best, its direction and its comparison: the task's, or
    ``--best-metric NAME[:max|:min]`` (the loss, or a metric whose torchmetrics class knows its direction)."""
    if choice is None:
        direction = {True: "max", False: "min"}.get(getattr(objective, "higher_is_better", None), "the task's rule")
        return objective.best_metric, direction, objective.is_better
    name, _, direction = choice.partition(":")
    metrics = objective.make_metrics()
    if name != "loss" and name not in metrics:
        raise UserError(f"--best-metric {choice}: the validation metrics are {', '.join(['loss', *metrics])}")
    if not direction:
        higher = False if name == "loss" else getattr(metrics[name], "higher_is_better", None)
        if higher is None:
            raise UserError(f"--best-metric {name}: its direction is not known; pass {name}:max or {name}:min")
        direction = "max" if higher else "min"
    if direction not in ("max", "min"):
        raise UserError(f"--best-metric {choice}: the direction is max or min, got {direction}")
    return name, direction, lambda value, best: best is None or (value > best if direction == "max" else value < best)


def improves(val: dict, best: dict, metric: str, is_better) -> bool:
    """Whether validation results ``val`` beat ``best``'s on ``metric``; a tie (an accuracy of 1.0 reached early, say)
    goes to the lower validation loss, so the export is the model that went on learning."""
    if best and val[metric] == best[metric]:
        return val["loss"] < best["loss"]
    return is_better(val[metric], best.get(metric))


def header(fabric, config, spec: TaskSpec, max_steps: int, steps_per_epoch: int, out_dir: Path, threads: str,
           rule: tuple) -> str:
    """What the run is about to do, in four lines."""
    splits = ", ".join(f"{len(rows):,} {name}" for name, rows in spec.datasets.items())
    devices, nodes = fabric.world_size, getattr(fabric.strategy, "num_nodes", 1)
    return "\n".join([
        f"data      {splits} rows",
        f"training  {max_steps:,} optimizer steps ({max_steps / steps_per_epoch:.3g} "
        f"epoch{'s' * (max_steps != steps_per_epoch)} of {steps_per_epoch:,}), "
        f"{config.batch_size * devices * config.grad_accum:,} rows each ({config.batch_size} per device x "
        f"{devices} device{'s' * (devices > 1)} x --grad-accum {config.grad_accum}), peak --lr {config.lr:.3g}",
        f"launch    {devices} {fabric.device.type} process{'es' * (devices > 1)}"
        + (f" on {nodes} nodes" if nodes > 1 else "")
        + f", {type(fabric.strategy).__name__}, precision {fabric.strategy.precision.precision}, {threads} per process",
        f"run       {out_dir} (environment.json there: versions and hardware), checkpoints/best by validation "
        f"{rule[0]} ({rule[1]})"])


def keep_rows_per_step(fabric, batch_size: int, grad_accum: int, record: dict) -> int:
    """The --grad-accum that keeps a checkpoint's rows per optimizer step (so the same rows) on this many devices."""
    written_by, rows = record["world_size"], record["fingerprint"][ROWS_PER_STEP]
    if written_by == fabric.world_size:
        return grad_accum
    rows_per_batch = batch_size * fabric.world_size
    if rows % rows_per_batch:
        fix = (f"pass a --batch-size that divides {rows // fabric.world_size}" if rows % fabric.world_size == 0
               else f"resume on a number of devices that divides {rows}")
        raise UserError(f"cannot continue {rows} rows per optimizer step on {fabric.world_size} devices with "
                        f"--batch-size {batch_size}: {fix}")
    say(f"resuming with world size {fabric.world_size} instead of {written_by}: --grad-accum "
        f"{rows // rows_per_batch} keeps {rows} rows per optimizer step")
    return rows // rows_per_batch


def make_loaders(fabric, flags, spec: TaskSpec, batch_size: int, grad_accum: int) -> dict:
    loaders = make_dataloaders(
        spec.datasets, spec.collate, spec.lengths and spec.lengths.per_split, batch_size=batch_size,
        eval_batch_size=flags.eval_batch_size or 2 * batch_size, world_size=fabric.world_size,
        rank=fabric.global_rank, seed=flags.seed, group_by_length=flags.group_by_length,
        num_workers=default_num_workers(fabric) if flags.num_workers is None else flags.num_workers,
        pin_memory=fabric.device.type == "cuda", grad_accum=grad_accum)
    # the samplers already shard rows across ranks; batches reach the loop on the host, where it counts their rows
    # and tokens without reading the device, and fabric.to_device moves them (non-blocking from pinned memory)
    return dict(zip(loaders, fabric.setup_dataloaders(*loaders.values(), use_distributed_sampler=False,
                                                      move_to_device=False)))


def training_loss(objective, model, batch: dict) -> torch.Tensor:
    return objective.loss(objective.forward(model, batch), batch)


def fit(fabric, config, state: TrainState, loaders, preemption, ckpt_dir, max_steps, steps_per_epoch, flops_of,
        spec: TaskSpec, rule: tuple) -> tuple[bool, dict]:
    """Trains until ``max_steps``, early stopping or preemption (``rule``: best_rule's, which keeps checkpoints/best);
    returns whether it was preempted, and the training throughput."""
    model, optimizer, scheduler, train_loader = state.model, state.optimizer, state.scheduler, loaders["train"]
    objective = spec.objective
    progress = Progress(fabric, max_steps, config.quiet, metrics=objective.make_metrics(),
                        steps_per_epoch=steps_per_epoch, rows_per_step=state.fingerprint[ROWS_PER_STEP],
                        start_step=state.step, chance_loss=spec.chance_loss, losses=state.train_losses)
    monitor = Throughput(fabric, config.peak_tflops, flops_of, sized=spec.lengths is not None)
    if config.compile:
        kinds = batch_kinds(itertools.chain([spec.example_batch(config.batch_size, None, "cpu")], train_loader))
        warm_up(fabric, model, optimizer, [fabric.to_device(fill_rows(batch, config.batch_size)) for batch in kinds],
                functools.partial(training_loss, objective))
    clips = config.grad_clip and strategy.clips_in_loop(fabric)  # DeepSpeed clips inside optimizer.step()
    fabric.barrier()
    monitor.start(state.step)
    stale, preempted, stop = 0, False, False
    while state.step < max_steps and not stop:
        train_loader.batch_sampler.set_epoch(state.epoch, start_batch=state.batch_in_epoch)
        epoch_batches = state.batch_in_epoch + len(train_loader)  # the sampler skips what a resume has done
        for batch in train_loader:
            rows = len(batch["labels"])
            monitor.count(rows, spec.lengths.in_batch(batch) if spec.lengths else None)
            # a short last batch takes the others' shape; its filling rows are left out of the loss
            batch = fabric.to_device(fill_rows(batch, config.batch_size))
            # the micro-batches one optimizer step averages: --grad-accum, fewer at the end of the epoch
            group_start = state.batch_in_epoch - state.batch_in_epoch % config.grad_accum
            group_size = min(config.grad_accum, epoch_batches - group_start)
            state.batch_in_epoch += 1
            is_last = state.batch_in_epoch == group_start + group_size
            with fabric.no_backward_sync(model, enabled=not is_last):  # DDP all-reduces only on the last
                logits = objective.forward(model, batch)[:rows]
                loss = objective.loss(logits, first_rows(batch, rows))
                fabric.backward(loss / group_size)                                           # Fabric step 4
            progress.update(loss, logits, batch["labels"][:rows])
            if not is_last:
                continue
            if clips:
                # no error on a non-finite norm: checking it is a sync, and 16-mixed's scaler skips those steps
                fabric.clip_gradients(model, optimizer, max_norm=config.grad_clip, error_if_nonfinite=False)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            state.step = step = state.step + 1

            if step % config.log_every == 0 or step == max_steps:  # the only host-device syncs of the hot loop
                log_step(fabric, progress, monitor, step, lr=scheduler.get_last_lr()[0], max_lr=config.lr)
            preempted = preemption.agreed(fabric)
            epoch_ends = state.batch_in_epoch == epoch_batches
            if epoch_ends or (config.val_every and step % config.val_every == 0) or step == max_steps:
                with monitor.paused():  # the throughput clock counts training time only
                    val = validate(fabric, model, loaders["validation"], objective=objective, step=step,
                                   show=progress.note, quiet=config.quiet)
                    warn_if_stuck(progress, val["loss"], step, max_lr=config.lr)
                    if improves(val, state.best_val, metric=rule[0], is_better=rule[2]):
                        state.best_val, stale = val, 0  # the best model so far is kept as checkpoints/best
                        best = {"model": model, "fingerprint": state.fingerprint, "step": step}
                        save_checkpoint(fabric, ckpt_dir, "best", best)
                    else:
                        stale += 1
            stop = preempted or bool(config.early_stop and stale >= config.early_stop)
            if epoch_ends:
                state.epoch, state.batch_in_epoch = state.epoch + 1, 0
            if (config.save_every and step % config.save_every == 0) or epoch_ends or stop:
                with monitor.paused():
                    save_checkpoint(fabric, ckpt_dir, f"step-{step:06d}", vars(state), config.keep_last)
                    for logger in fabric.loggers:
                        logger.save()  # the metrics up to this checkpoint survive a kill
            if stop or step >= max_steps:
                break
    progress.close()
    return preempted, monitor.stop()


def log_step(fabric, progress, monitor, step, lr, max_lr) -> None:
    logged = progress.log(step, lr)
    # the same loss on every rank, so all stop together; non-finite means diverged (16-mixed's overflows are left out)
    if not math.isfinite(logged["train/loss"]):
        raise UserError(f"the training loss became {logged['train/loss']} by step {step}: lower --lr (now {max_lr}), "
                        f"keep --grad-clip on, or use --precision bf16-mixed/32-true")
    monitor.log(step)  # throughput and MFU, to the loggers
    progress.show()


def warn_if_stuck(progress, val_loss, step, max_lr) -> None:
    """At the run's end: one line if its training and validation losses are where ignoring the inputs is."""
    if progress.stuck_at_chance(val_loss):
        chance = progress.chance_loss
        say(f"the training loss stayed at chance level ({chance['train']:.3g}, or just under: what a model that "
            f"ignores its inputs scores) over the last quarter of the run, and the validation loss ended there too "
            f"({val_loss:.3g} against {chance['validation']:.3g}), up to step {step}: it has not learned; try a lower "
            f"--lr (now {max_lr:g}) if the loss jumped there at once, else a higher one or more --epochs")


def validate(fabric, model, loader, objective, step, show, quiet: bool) -> dict:
    """Evaluates on the validation split, logs the result and ``show``s it."""
    val = evaluate(fabric, model, loader, objective=objective, shown_as=None if quiet else "validation")
    fabric.log_dict({f"val/{name}": value for name, value in val.items() if name != "examples"}, step=step)
    show(f"step {step}: " + ", ".join(f"val {k} {v:.4f}" for k, v in val.items() if k != "examples"))
    return val


@torch.no_grad()
def evaluate(fabric, model, loader, objective, predict: bool = False, shown_as: str | None = None) -> dict:
    """Loss and the task's metrics over every row of the split exactly once, summed over all ranks; with
    ``predict``, also ``"predictions"``: the objective's columns for every row, in the split's row order. Progress is
    shown under the name ``shown_as`` (None: not shown)."""
    model.eval()
    mean_loss, rows = MeanMetric().to(fabric.device), SumMetric().to(fabric.device)
    metrics = objective.make_metrics().to(fabric.device)
    remaining = loader.batch_sampler.num_real  # the rest repeat a row: all ranks run as many batches, of one size
    predicted = []
    for batch in counted(fabric, loader, shown_as) if shown_as else loader:
        batch = fabric.to_device(batch)
        # every rank runs every forward, repeated rows too: under fsdp, fsdp2 and ZeRO-3 a skipped one hangs the rest
        logits = objective.forward(model, batch)
        if predict:  # of every row, repeated ones too: each rank then holds as many rows, as a gather needs
            # copies: a CUDA graph (reduce-overhead) writes its next outputs where these are
            predicted.append({name: value.clone() for name, value in objective.predict(logits, batch).items()})
        real = min(len(logits), remaining)
        remaining -= real
        if real == 0:
            continue
        batch, logits = first_rows(batch, real), logits[:real]
        mean_loss.update(objective.loss(logits, batch, reduction="none"))
        metrics.update(logits, batch["labels"])
        rows.update(real)
    model.train()
    result = {"loss": mean_loss.compute().item(), **{k: v.item() for k, v in metrics.compute().items()},
              "examples": int(rows.compute().item())}
    if predict:
        result["predictions"] = gather_rows(fabric, loader.batch_sampler, predicted)
    return result


def gather_rows(fabric, sampler, columns: list[dict]) -> dict:
    """Each rank's per-row columns (a dict per batch) gathered over ranks: each real row once, in the split's order."""
    mine = {name: torch.cat([batch[name] for batch in columns]) for name in columns[0]}
    mine["row"] = torch.tensor(sampler.indices, device=fabric.device)
    mine["real"] = (torch.arange(len(sampler.indices), device=fabric.device) < sampler.num_real).int()
    every = {name: value.flatten(0, 1) if fabric.world_size > 1 else value
             for name, value in fabric.all_gather(mine).items()}
    real = every.pop("real").bool()
    order = every["row"][real].argsort()
    return {"row": every.pop("row")[real][order], **{name: value[real][order] for name, value in every.items()}}


def finish(fabric, config, state: TrainState, loaders, out_dir, spec: TaskSpec, report) -> dict:
    """Tests the best model, exports it and writes results.json (with ``report``: what else the run knows); then
    removes checkpoints/best, whose weights model/ holds, unless --keep-best-checkpoint."""
    model, best, results_file = state.model, out_dir / "checkpoints" / "best", out_dir / "results.json"
    if not best.exists() and results_file.exists():  # a resume of this finished run found no better model
        finalize_loggers(fabric.loggers)
        say(f"the best model is still {out_dir}/model, tested in results.json when the run first finished")
        return json.loads(results_file.read_text())
    if not best.exists():  # removed when the run first finished, and its results.json since
        raise UserError(f"{best} is gone (a finished run removes it: model/ holds its weights) and so is "
                        f"{results_file}: nothing is left to test; start a new --out-dir (or keep it next time with "
                        f"--keep-best-checkpoint)")
    load_weights(fabric, best / "state", model)
    objective = spec.objective
    test = evaluate(fabric, model, loaders["test"], objective=objective, predict=True,
                    shown_as=None if config.quiet else "test")
    predictions = test.pop("predictions")
    # what training and testing held on each rank, before the export gathers the whole model on rank 0's host
    peaks = peak_memory_per_rank(fabric)
    export = spec.export or functools.partial(save_weights, fingerprint=spec.fingerprint)
    export_model(fabric, best / "state", out_dir / "model",
                 write=lambda weights, folder: export(weights, model, folder))
    results = {**{f"val_{k}": v for k, v in state.best_val.items()}, **{f"test_{k}": v for k, v in test.items()},
               "train_examples": len(spec.datasets["train"]), "steps": state.step,
               "epochs": state.epoch + (state.batch_in_epoch > 0), "world_size": fabric.world_size,
               "precision": fabric.strategy.precision.precision, "strategy": type(fabric.strategy).__name__,
               "peak_memory_mb_per_rank": peaks, **report, "config": vars(config)}
    finalize_loggers(fabric.loggers)  # flushes metrics.csv, which the plots read; ends the tracked runs
    if fabric.is_global_zero:
        write_predictions(out_dir / "test_predictions.csv",
                          objective.table(predictions) if hasattr(objective, "table") else predictions)
        results_file.write_text(json.dumps(results, indent=2))
        (out_dir / STATUS_FILE).unlink(missing_ok=True)  # a resumed run that completed is no longer preempted
        if not config.keep_best_checkpoint:  # every rank has read it: export_model ends in a barrier
            remove_checkpoint(best)
        plot_metrics(out_dir)
    say(f"test {objective.best_metric} {test[objective.best_metric]:.4f} on {test['examples']} rows; results in "
        f"{out_dir}/results.json, each row's prediction in test_predictions.csv")
    return results


if __name__ == "__main__":
    setup()
