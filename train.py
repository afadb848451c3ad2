"""Train a model with Lightning Fabric; what it trains (data, model, loss, metrics, export) is the task's.

    python train.py [task flags]                                  # one device; `--help` lists every flag
    python train.py --devices 2 --strategy fsdp2 [task flags]
    fabric run --devices 4 --strategy deepspeed_stage_2 train.py [task flags]

Fabric launches the processes, places model, optimizer and batches, and runs backward; the rest is the plain PyTorch
loop below, to edit: setup() -> main() -> fit() -> validate() -> finish(). The task is task.py (a `TaskSpec`).
"""

import task
from fabric_utils import FP8, Config, TaskSpec, build_parser, exit_on_user_error, parse_flags


def flag_parser():
    """Every flag: the loop's (launch, optimization, speed, checkpoints, logging) and the task's (data, model)."""
    parser = build_parser(description=__doc__.splitlines()[0])
    task.add_args(parser)
    return parser


def parse_args(argv=None):
    return parse_flags(flag_parser(), argv, presets=getattr(task, "PRESETS", {}))


if __name__ == "__main__":
    # --help and a bad flag answer here, before the libraries imported below load (seconds)
    exit_on_user_error(parse_args)()

import dataclasses
import itertools
import json
import math
from pathlib import Path

import torch
from torchmetrics import MeanMetric, SumMetric

from fabric_utils import (checkpoint, export, launcher, loggers, optim, pretrained, progress, run_folder, sharding,
                          speed, strategy)
from fabric_utils.loaders import at_most_rows_per_device, cut_splits, fill_rows, first_rows, make_dataloaders
from fabric_utils.preemption import Preemption
from fabric_utils.progress import say
from fabric_utils.threads import set_threads


@exit_on_user_error
def setup(argv=None) -> dict:
    flags = parse_args(argv)
    if not flags.verbose:
        progress.silence_libraries()
    with run_folder.proposed_run_folder(flags.out_dir, flags.resume, temporary=bool(flags.fast_dev_run)) as out_dir:
        fabric = launcher.build_fabric(
            accelerator=flags.accelerator, devices=flags.devices, num_nodes=flags.num_nodes, strategy=flags.strategy,
            precision=flags.precision, grad_clip=flags.grad_clip, grad_checkpointing=flags.grad_checkpointing,
            loggers=loggers.make_loggers(flags.logger, out_dir, project=flags.tracker_project,
                                         resume=bool(flags.resume)))                        # Fabric step 1
        launcher.launch(fabric)                                                              # Fabric step 2
        # nodes started apart in time agree on rank 0's folder
        with (run_folder.locked_run_folder(fabric, out_dir, flags.resume) as run_dir,
              launcher.explain_lost_peers(fabric)):
            return main(fabric, flags, run_dir)


def main(fabric, flags, out_dir: Path) -> dict:
    fabric.seed_everything(flags.seed)
    # first: threads beyond the free cores fight, and the run crawls; sharing: the processes on these CPUs
    threads, sharing = set_threads(fabric, flags.num_threads)
    preemption = Preemption()  # from here on, SIGTERM/SIGUSR1 lead to a checkpoint, not a lost run
    if fabric.device.type == "cuda":  # TF32 matrix products and cuDNN autotuning: free speed on Ampere+ GPUs
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN attention plans each new shape; flash and others don't
    env = run_folder.environment_report(fabric)
    if flags.verbose:
        say(json.dumps(env, indent=1))
    with fabric.rank_zero_first(local=True):  # rank 0 of each node prepares the data first; the others read its cache
        spec: TaskSpec = task.setup(flags, verbose=progress.shows_bars(fabric, flags.quiet, flags.verbose))

    resume_from = None
    if flags.resume:  # the checkpoint to continue, as rank 0 finds it
        from fabric_utils import resume
        resume_from = resume.agreed_resume_checkpoint(fabric, flags.resume, out_dir / "checkpoints", report=say)

    def loss_fn(model, batch: dict) -> torch.Tensor:  # a batch's training loss: to count FLOPs, probe, warm up
        return spec.objective.loss(spec.objective.forward(model, batch), batch)

    # a checkpoint of the trained part alone (LoRA's adapters) goes on the pretrained model it was trained on
    model, optimizer, torch_optimizer, flops_of, params = build(
        fabric, flags, spec, loss_fn, fresh=not resume_from or checkpoint.holds_trained_only(resume_from))
    batch_size = flags.batch_size
    if batch_size == "auto":  # the largest that fits the set-up model, found by real steps at rate 0
        from fabric_utils.batch_size import find_batch_size
        batch_size = find_batch_size(fabric, model, optimizer, loss_fn=loss_fn,
                                     make_batch=lambda rows: spec.example_batch(rows, None, fabric.device))
    batch_size = at_most_rows_per_device(batch_size, len(spec.datasets["train"]), fabric.world_size)
    grad_accum = flags.grad_accum
    if resume_from:  # the same rows per optimizer step on new devices
        grad_accum = resume.keep_rows_per_step(fabric, batch_size, flags.grad_accum, resume_from)
    if flags.fast_dev_run:  # N batches of each split on every process
        spec = cut_splits(spec, flags.fast_dev_run * fabric.world_size, train_rows=batch_size * grad_accum,
                          eval_rows=flags.eval_batch_size or 2 * batch_size)
    loaders = make_loaders(fabric, flags, spec, batch_size=batch_size, grad_accum=grad_accum, sharing=sharing)
    steps_per_epoch = math.ceil(len(loaders["train"]) / grad_accum)
    max_steps = flags.max_steps or flags.epochs * steps_per_epoch
    # every value the run uses, read-only from here on, with what the task and the lines above decided
    config = Config(flags, **spec.decided_flags or {}, batch_size=batch_size, grad_accum=grad_accum,
                    lr=spec.default_lr(max_steps) if flags.lr is None else flags.lr)
    launcher.warn_if_updates_vanish(fabric.strategy.precision, lr=config.lr)
    scheduler = build_scheduler(torch_optimizer, config.scheduler, lr=config.lr, max_steps=max_steps,
                                warmup=config.warmup, min_lr_rate=config.min_lr_rate)
    rule = checkpoint.best_rule(spec.objective, config.best_metric)
    state = restore(fabric, config, spec, model, optimizer, scheduler, max_steps, resume_from)
    # only now: bad data, model or checkpoint leave the folder as it was (a resume's flags go beside the first's)
    run_folder.save_config(fabric, config, out_dir, resumed_at=state.step if resume_from else None, environment=env)
    if not config.quiet:
        say(progress.header(fabric, config, spec, max_steps, steps_per_epoch, out_dir, threads, rule))

    preempted, throughput = fit(fabric, config, state, loaders=loaders, preemption=preemption,
                                ckpt_dir=out_dir / "checkpoints", max_steps=max_steps, steps_per_epoch=steps_per_epoch,
                                flops_of=flops_of, spec=spec, rule=rule, loss_fn=loss_fn)
    if preempted:
        loggers.finalize_loggers(fabric.loggers, status="preempted")  # this segment's metrics stay on disk
        say(f"preempted: saved a checkpoint at step {state.step}; rerun with --resume auto")
        preemption.exit(fabric, loaders, out_dir, step=state.step,  # status EXIT_PREEMPTED (75)
                        checkpoint=out_dir / "checkpoints" / f"step-{state.step:06d}")
    preemption.training_ended()
    results = finish(fabric, config, state, loaders=loaders, out_dir=out_dir, spec=spec,
                     report={**throughput, **params, "environment": env})
    preemption.close(fabric, loaders, completed=out_dir)  # workers, then the process group, before teardown
    return results


def build(fabric, args, spec: TaskSpec, loss_fn, fresh: bool):
    """The task's model and optimizer set up by Fabric, the torch optimizer inside (for the schedule), the FLOPs per
    training step (MFU) and parameter counts; ``fresh``: load the task's values (else a checkpoint will)."""
    # under fsdp, fsdp2 and ZeRO-3 already sharded, filled with the pretrained values after set-up
    model, source = pretrained.build_model(fabric, spec.build_model, spec.build_skeleton, pretrained=fresh,
                                           grad_checkpointing=args.grad_checkpointing)
    params = optim.count_parameters(model)
    flops_of = None  # FLOPs of forward and backward, for MFU, which needs the device's peak: a CPU has none
    if args.peak_tflops or fabric.device.type == "cuda":
        from fabric_utils.flops import training_flops_fn
        flops_of = training_flops_fn(model, loss_fn, lambda size: spec.example_batch(1, size, "cpu"),
                                     max_size=spec.lengths.longest if spec.lengths else None)
    if args.precision == FP8:  # before compiling and set-up, which wrap the float8 layers as any other
        from fabric_utils.fp8 import convert_to_float8
        convert_to_float8(model)
    if args.compile:  # fabric.setup recompiles it around the strategy's wrapper
        from fabric_utils import compiling
        model = compiling.compile_model(model, args.compile_mode, cuda_graphs=strategy.fits_cuda_graphs(fabric))
    # fp32 weights to update; DeepSpeed compiles in its engine
    model, compiled = sharding.prepare_for_setup(fabric, model)

    # at rate 0: the schedule sets the peak once the run's length, on which the default depends, is known
    def new_optimizer(module):
        return optim.build_optimizer(module, name=args.optimizer, lr=0.0, weight_decay=args.weight_decay,
                                     device=fabric.device, cpu_adam=strategy.cpu_optimizer(fabric),
                                     loss_scaling=strategy.scales_loss(fabric))

    if strategy.builds_optimizer_after_setup(fabric):  # on what set-up made: FSDP's shards, transformer-engine's layers
        model = sharding.cast_shards(fabric, fabric.setup_module(model))                       # Fabric step 3
        torch_optimizer = new_optimizer(model)
        optimizer = fabric.setup_optimizers(torch_optimizer)
    else:  # DeepSpeed's engine takes both at once
        torch_optimizer = new_optimizer(model)
        model, optimizer = fabric.setup(model, torch_optimizer)                                # Fabric step 3
        strategy.engine(fabric).compile_in_engine(fabric, compiled)
    if source:
        pretrained.load_pretrained(fabric, model, source)
    return model, optimizer, torch_optimizer, flops_of, params


def build_scheduler(optimizer, name: str, lr: float, max_steps: int, warmup: float, min_lr_rate: float = 0.0):
    """Linear warm-up from 0 to the peak ``lr`` (``warmup``: a fraction of all steps if below 1, else a step count),
    then linear, cosine or no decay to ``min_lr_rate`` x the peak, as transformers' schedules (one-cycle: PyTorch's)."""
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
            resume_from: Path | None) -> TrainState:
    """The training state: a fresh one, or ``resume_from``'s if it continues this run (else a one-line error)."""
    fingerprint = {**spec.fingerprint, "--seed": config.seed, "--optimizer": config.optimizer, "--lr": config.lr,
                   "--weight-decay": config.weight_decay, "--scheduler": config.scheduler, "--warmup": config.warmup,
                   "--min-lr-rate": config.min_lr_rate, "--grad-clip": config.grad_clip,
                   "optimizer steps (--max-steps, --epochs)": max_steps,
                   checkpoint.ROWS_PER_STEP: config.batch_size * fabric.world_size * config.grad_accum}
    rows_per_batch = config.batch_size * fabric.world_size
    state = TrainState(model, optimizer, scheduler, fingerprint=fingerprint, config=vars(config),
                       rows_per_batch=rows_per_batch)
    if resume_from:
        from fabric_utils import resume
        resume.load_checkpoint(fabric, resume_from, vars(state), expected_fingerprint=fingerprint)  # fills it in place
        # the same row of the epoch in this run's batches, if the number of devices changed
        state.batch_in_epoch = state.batch_in_epoch * state.rows_per_batch // rows_per_batch
        state.rows_per_batch = rows_per_batch
        say(f"resumed from {resume_from} at step {state.step}")
    return state


def make_loaders(fabric, flags, spec: TaskSpec, batch_size: int, grad_accum: int, sharing: int) -> dict:
    workers = speed.default_num_workers(fabric.device, sharing) if flags.num_workers is None else flags.num_workers
    loaders = make_dataloaders(
        spec.datasets, spec.collate, spec.lengths and spec.lengths.per_split, batch_size=batch_size,
        eval_batch_size=flags.eval_batch_size or 2 * batch_size, world_size=fabric.world_size,
        rank=fabric.global_rank, seed=flags.seed, group_by_length=flags.group_by_length, num_workers=workers,
        pin_memory=fabric.device.type == "cuda", grad_accum=grad_accum)
    # the samplers shard the rows; batches stay on the host, where the loop counts them without reading the device
    return dict(zip(loaders, fabric.setup_dataloaders(*loaders.values(), use_distributed_sampler=False,
                                                      move_to_device=False)))


def fit(fabric, config, state: TrainState, loaders, preemption, ckpt_dir, max_steps, steps_per_epoch, flops_of,
        spec: TaskSpec, rule, loss_fn) -> tuple[bool, dict]:
    """Trains until ``max_steps``, early stopping or preemption (``rule``: best_rule's, which keeps checkpoints/best);
    returns whether it was preempted, and the training throughput."""
    model, optimizer, scheduler, train_loader = state.model, state.optimizer, state.scheduler, loaders["train"]
    objective = spec.objective
    monitor = progress.Throughput(fabric, config.peak_tflops, flops_of, sized=spec.lengths is not None)
    if config.compile:
        from fabric_utils import compiling
        kinds = compiling.batch_kinds(itertools.chain([spec.example_batch(config.batch_size, None, "cpu")],
                                                      train_loader))
        compiling.warm_up(fabric, model, optimizer,
                          [fabric.to_device(fill_rows(batch, config.batch_size)) for batch in kinds], loss_fn)
    # after the warm-up: its rows/s and time left leave compiling out, as the throughput clock does
    shown = progress.Progress(fabric, max_steps, config.quiet, metrics=objective.make_metrics(),
                              steps_per_epoch=steps_per_epoch,
                              rows_per_step=state.fingerprint[checkpoint.ROWS_PER_STEP], start_step=state.step,
                              chance_loss=spec.chance_loss, losses=state.train_losses)
    clips = config.grad_clip and strategy.clips_in_loop(fabric)  # DeepSpeed clips inside optimizer.step()
    fabric.barrier()
    monitor.start(state.step)
    stale, preempted, stop = 0, False, False
    while state.step < max_steps and not stop:
        train_loader.batch_sampler.set_epoch(state.epoch, start_batch=state.batch_in_epoch)
        epoch_batches = state.batch_in_epoch + len(train_loader)  # the sampler skips what a resume has done
        for batch in train_loader:
            rows = len(batch["labels"])
            monitor.count(rows, spec.lengths and spec.lengths.in_batch(batch),
                          computed=(config.batch_size, spec.lengths and spec.lengths.padded_to(batch)))
            batch = fabric.to_device(fill_rows(batch, config.batch_size))  # one shape; filling rows get no loss
            # the micro-batches one optimizer step averages: --grad-accum, fewer at the end of the epoch
            group_start = state.batch_in_epoch - state.batch_in_epoch % config.grad_accum
            group_size = min(config.grad_accum, epoch_batches - group_start)
            state.batch_in_epoch += 1
            is_last = state.batch_in_epoch == group_start + group_size
            with fabric.no_backward_sync(model, enabled=not is_last):  # DDP all-reduces only on the last
                logits = objective.forward(model, batch)[:rows]
                loss = objective.loss(logits, first_rows(batch, rows))
                fabric.backward(loss / group_size)                                           # Fabric step 4
            shown.update(loss, logits, batch["labels"][:rows])
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
                shown.log_step(step, lr=scheduler.get_last_lr()[0], max_lr=config.lr, throughput=monitor)
            preempted = preemption.agreed(fabric)
            epoch_ends = state.batch_in_epoch == epoch_batches
            if epoch_ends or (config.val_every and step % config.val_every == 0) or step == max_steps:
                with monitor.paused():  # the throughput clock counts training time only
                    val = validate(fabric, model, loaders["validation"], objective=objective, step=step,
                                   show=shown.note, quiet=config.quiet)
                    shown.warn_if_stuck(val["loss"], max_lr=config.lr)
                    if rule.improves(val, state.best_val):
                        state.best_val, stale = val, 0  # the best model so far is kept as checkpoints/best
                        best = {"model": model, "fingerprint": state.fingerprint, "step": step}
                        checkpoint.save_checkpoint(fabric, ckpt_dir, "best", best, background=config.async_save)
                    else:
                        stale += 1
            stop = preempted or bool(config.early_stop and stale >= config.early_stop)
            if epoch_ends:
                state.epoch, state.batch_in_epoch = state.epoch + 1, 0
            if (config.save_every and step % config.save_every == 0) or epoch_ends or stop:
                with monitor.paused():
                    checkpoint.save_checkpoint(fabric, ckpt_dir, f"step-{step:06d}", vars(state), config.keep_last,
                                               background=config.async_save)  # training goes on as it is written
                    for logger in fabric.loggers:
                        logger.save()  # the metrics up to this checkpoint survive a kill
            if stop or step >= max_steps:
                break
    checkpoint.wait_for_save(fabric)  # the last checkpoint on disk before a preempted run exits or the best is tested
    shown.close()
    return preempted, monitor.stop()


def validate(fabric, model, loader, objective, step, show, quiet: bool) -> dict:
    """Evaluates on the validation split, logs the result and ``show``s it."""
    val = evaluate(fabric, model, loader, objective=objective, shown_as=None if quiet else "validation")
    fabric.log_dict({f"val/{name}": value for name, value in val.items() if name != "examples"}, step=step)
    for logger in fabric.loggers:
        logger.save()  # on disk now: a sweep prunes on it, a kill keeps it
    show(f"step {step}: " + ", ".join(f"val {k} {v:.4f}" for k, v in val.items() if k != "examples"))
    return val


@torch.no_grad()
def evaluate(fabric, model, loader, objective, predict: bool = False, shown_as: str | None = None) -> dict:
    """Loss and the task's metrics over every row of the split exactly once, summed over all ranks, shown as
    ``shown_as``; with ``predict``, also ``"predictions"``: the objective's columns per row, in the split's order."""
    model.eval()
    mean_loss, rows = MeanMetric().to(fabric.device), SumMetric().to(fabric.device)
    metrics = objective.make_metrics().to(fabric.device)
    remaining = loader.batch_sampler.num_real  # the rest repeat a row: all ranks run as many batches, of one size
    predicted = []
    for batch in progress.counted(fabric, loader, shown_as) if shown_as else loader:
        batch = fabric.to_device(batch)
        # every rank runs every forward, repeated rows too: under fsdp, fsdp2 and ZeRO-3 a skipped one hangs the rest
        logits = objective.forward(model, batch)
        if predict:  # repeated rows too, as a gather needs; copies, as a CUDA graph reuses its outputs' memory
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
        result["predictions"] = loader.batch_sampler.gather(fabric, predicted)
    return result


def finish(fabric, config, state: TrainState, loaders, out_dir, spec: TaskSpec, report) -> dict:
    """Tests the best model, exports it and writes results.json (with ``report``: what else the run knows); then
    removes checkpoints/best, whose weights model/ holds, unless --keep-best-checkpoint."""
    model, results_file, objective = state.model, out_dir / "results.json", spec.objective
    best = checkpoint.load_best(fabric, out_dir, model)
    if best is None:  # a resume of this finished run found no better model
        loggers.finalize_loggers(fabric.loggers)
        say(f"the best model is still {out_dir}/model, tested in results.json when the run first finished")
        return json.loads(results_file.read_text())
    test = evaluate(fabric, model, loaders["test"], objective=objective, predict=True,
                    shown_as=None if config.quiet else "test")
    predictions = test.pop("predictions")
    # training's and testing's, before the export gathers the model on rank 0
    peaks = speed.peak_memory_per_rank(fabric)
    export.export_model(fabric, best / "state", out_dir / "model", model, spec.fingerprint, write=spec.export)
    results = {**{f"val_{k}": v for k, v in state.best_val.items()}, **{f"test_{k}": v for k, v in test.items()},
               "train_examples": len(spec.datasets["train"]), "steps": state.step,
               "epochs": state.epoch + (state.batch_in_epoch > 0), "world_size": fabric.world_size,
               "precision": strategy.precision_name(fabric, config.precision),
               "strategy": type(fabric.strategy).__name__,
               "peak_memory_mb_per_rank": peaks, **report, "config": vars(config)}
    loggers.finalize_loggers(fabric.loggers)  # flushes metrics.csv, which the plots read; ends the tracked runs
    if fabric.is_global_zero:
        run_folder.write_predictions(out_dir / "test_predictions.csv",
                                     objective.table(predictions) if hasattr(objective, "table") else predictions)
        results_file.write_text(json.dumps(results, indent=2))
        if not config.keep_best_checkpoint:  # every rank has read it: export_model ends in a barrier
            checkpoint.remove_checkpoint(best)
        loggers.plot_metrics(out_dir)
    say(f"test {objective.best_metric} {test[objective.best_metric]:.4f} on {test['examples']} rows; results in "
        f"{out_dir}/results.json, each row's prediction in test_predictions.csv")
    return results


if __name__ == "__main__":
    setup()
