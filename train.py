"""Fine-tune a Hugging Face transformer for text classification with Lightning Fabric.

    python train.py --demo                                        # offline, CPU, under two minutes
    python train.py --dataset ../shared/data/imdb --model PATH --devices 2
    fabric run --devices 4 --strategy deepspeed_stage_2 train.py --dataset stanfordnlp/imdb

Fabric launches the processes, places model, optimizer and batches, and runs backward; everything else is the
plain PyTorch loop below, meant to be edited. Read it top to bottom: setup -> data -> model -> fit -> test.
"""

import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric, SumMetric
from torchmetrics.classification import MulticlassAccuracy

from data.batching import make_collator, make_dataloaders
from data.demo import prepare_demo
from data.sources import load_splits
from data.tokenize import tokenize_splits
from fabric_utils.args import parse_args
from fabric_utils.batch_size import find_batch_size
from fabric_utils.checkpoint import find_resume_checkpoint, load_checkpoint, save_checkpoint
from fabric_utils.errors import UserError, exit_on_user_error
from fabric_utils.export import export_model
from fabric_utils.launcher import build_fabric, clips_in_loop, launch, offloads_optimizer
from fabric_utils.modeling import load_model, load_tokenizer
from fabric_utils.observe import (Progress, environment_report, make_loggers, plot_metrics, prepare_out_dir,
                                  quiet_libraries, save_config)
from fabric_utils.optim import build_optimizer, build_scheduler, count_warmup_steps
from fabric_utils.preemption import Preemption
from fabric_utils.speed import (configure_backends, default_num_workers, make_throughput_monitor, mfu, peak_memory_mb,
                                training_flops_fn, warm_up)


@exit_on_user_error
def main(argv=None):
    # ---- setup -------------------------------------------------------------------------------------------------
    args = parse_args(argv)
    out_dir = prepare_out_dir(args.out_dir)
    fabric = build_fabric(args, loggers=make_loggers(args.logger, out_dir))  # Fabric step 1: configure
    launch(fabric)                                                            # Fabric step 2: start processes
    out_dir = Path(fabric.broadcast(str(out_dir)))  # ranks started apart in time agree on rank 0's folder
    fabric.seed_everything(args.seed)
    quiet_libraries(fabric, args.quiet)
    preemption = Preemption()  # from here on, SIGTERM/SIGUSR1 lead to a checkpoint, not a lost run
    configure_backends(fabric.device)
    env = environment_report(fabric)
    if fabric.is_global_zero and not args.quiet:
        fabric.print(json.dumps(env, indent=1))

    # ---- data: rank 0 of each node loads and tokenizes first; the others then read its cache ---------------------
    with fabric.rank_zero_first(local=True):
        if args.demo:
            args.dataset, args.model = map(str, prepare_demo(Path.home() / ".cache" / "fabric-template" / "demo"))
        data = load_splits(args.dataset, args.text_column, args.label_column, args.seed,
                           args.train_size, args.val_size, args.test_size)
        tokenizer = load_tokenizer(args.model)
        tokenized = tokenize_splits(data.splits, tokenizer, args.text_column, args.max_length)
    num_labels = len(data.label_names)

    # ---- model and optimizer -------------------------------------------------------------------------------------
    model = load_model(args, data.label_names)
    meta = {"model": args.model, "labels": data.label_names}
    save_config(fabric, args, out_dir)  # only now: bad data or model must leave the folder untouched
    if args.batch_size == "auto":
        args.batch_size = find_batch_size(fabric, args, model, tokenizer)
    collator = make_collator(tokenizer, args.pad_to_max_length, args.max_length, args.pad_to_multiple_of)
    train_loader, val_loader, test_loader = make_dataloaders(
        tokenized, collator, args.batch_size, args.eval_batch_size or 2 * args.batch_size, fabric.world_size,
        fabric.global_rank, args.seed, args.group_by_length,
        args.num_workers if args.num_workers is not None else default_num_workers(fabric),
        pin_memory=fabric.device.type == "cuda")
    train_sampler = train_loader.batch_sampler
    steps_per_epoch = math.ceil(len(train_loader) / args.grad_accum)
    max_steps = args.max_steps or args.epochs * steps_per_epoch

    optimizer = build_optimizer(model, args, fabric.device, offload=offloads_optimizer(fabric))
    # on the plain optimizer: DeepSpeed's wrapper is no torch Optimizer, but steps the same parameter groups
    scheduler = build_scheduler(optimizer, args.scheduler, args.lr, max_steps,
                                count_warmup_steps(args.warmup, max_steps))
    model, optimizer = fabric.setup(model, optimizer)                               # Fabric step 3: wrap
    # the samplers already shard rows across ranks, so Fabric only moves batches to the device
    train_loader, val_loader, test_loader = fabric.setup_dataloaders(
        train_loader, val_loader, test_loader, use_distributed_sampler=False)

    # ---- resume ------------------------------------------------------------------------------------------------------
    ckpt_dir = out_dir / "checkpoints"
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0, "epoch": 0,
             "batch_in_epoch": 0, "best_val_acc": -1.0, "meta": meta, "config": vars(args)}
    resume_from = find_resume_checkpoint(args.resume, ckpt_dir)
    if resume_from:
        load_checkpoint(fabric, resume_from, state, expected_meta=meta)
        fabric.print(f"resumed from {resume_from} at step {state['step']}")

    # ---- fit ---------------------------------------------------------------------------------------------------------
    progress = Progress(fabric, max_steps, args.quiet)
    throughput = make_throughput_monitor(fabric, args.peak_tflops)
    flops_of = training_flops_fn(model.module.config, args.max_length)
    check_finite = fabric.strategy.precision.precision != "16-mixed"  # the loss scaler skips non-finite steps itself
    model.train()  # from_pretrained returns the model in eval mode: dropout would stay off
    if args.compile:
        warm_up(fabric, model, optimizer, train_loader)
    fabric.barrier()
    train_start, start_step = time.perf_counter(), state["step"]
    samples = tokens = flops = 0.0  # this process's counts since it started (a resume starts them again)
    val = {}
    stop = False
    while state["step"] < max_steps and not stop:
        train_sampler.set_epoch(state["epoch"], start_batch=state["batch_in_epoch"])
        batches_left = len(train_loader)
        for batch in train_loader:
            # a group of grad_accum micro-batches makes one optimizer step; DDP all-reduces only on the last
            group_size = min(args.grad_accum, batches_left + state["batch_in_epoch"] % args.grad_accum)
            batches_left -= 1
            state["batch_in_epoch"] += 1
            is_accumulating = state["batch_in_epoch"] % args.grad_accum != 0 and batches_left > 0
            with fabric.no_backward_sync(model, enabled=is_accumulating):
                outputs = model(**batch)
                fabric.backward(outputs.loss / group_size)                    # Fabric step 4: backward
            progress.accumulate(outputs.loss.detach(), outputs.logits.detach(), batch["labels"])
            lengths = batch["attention_mask"].sum(dim=1)
            samples, tokens, flops = samples + len(lengths), tokens + lengths.sum(), flops + flops_of(lengths)
            if is_accumulating:
                continue
            if args.grad_clip and clips_in_loop(fabric):  # DeepSpeed clips inside optimizer.step()
                fabric.clip_gradients(model, optimizer, max_norm=args.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            state["step"] += 1
            step = state["step"]

            if step % args.log_every == 0 or step == max_steps:  # the only host-device syncs of the hot loop
                metrics = progress.log(step, scheduler.get_last_lr()[0])
                if check_finite and not math.isfinite(metrics["train/loss"]):
                    raise UserError(f"the training loss became {metrics['train/loss']} by step {step}: lower --lr "
                                    f"(now {args.lr}), keep --grad-clip on, or use --precision bf16-mixed/32-true")
                elapsed = time.perf_counter() - train_start
                throughput.update(time=elapsed, batches=step - start_step, samples=int(samples), lengths=int(tokens),
                                  flops=float(flops))
                progress.show(throughput.compute_and_log(step=step))
            stop = preemption.agreed(fabric, check_now=step % args.log_every == 0)
            if args.val_every and step % args.val_every == 0:
                val = validate(fabric, model, val_loader, num_labels, state, ckpt_dir, step)
            if args.save_every and step % args.save_every == 0 or stop:
                save_checkpoint(fabric, ckpt_dir, f"step-{step:06d}", state, args.keep_last)
            if stop or step >= max_steps:
                break
        else:  # the epoch ran to its end
            state["epoch"] += 1
            state["batch_in_epoch"] = 0
            if val.get("step") != state["step"]:  # not just validated by --val-every
                val = validate(fabric, model, val_loader, num_labels, state, ckpt_dir, state["step"])
            save_checkpoint(fabric, ckpt_dir, f"step-{state['step']:06d}", state, args.keep_last)
    if stop:
        fabric.print(f"preempted: saved a checkpoint at step {state['step']}; rerun with --resume auto")
        preemption.exit(fabric)  # status EXIT_PREEMPTED (75)
    if not val or val.get("step") != state["step"]:  # the last step fell inside an epoch: validate the final model
        val = validate(fabric, model, val_loader, num_labels, state, ckpt_dir, state["step"])
    train_time = time.perf_counter() - train_start

    # ---- test the best model -----------------------------------------------------------------------------------------
    fabric.load(ckpt_dir / "best" / "state", {"model": model})
    test = evaluate(model, test_loader, num_labels, fabric.device)
    export_model(fabric, ckpt_dir / "best" / "state", model.module.config, tokenizer, out_dir / "model")
    results = {
        "val_acc": state["best_val_acc"], "val_loss": val["loss"], "test_acc": test["acc"], "test_loss": test["loss"],
        "test_examples": test["examples"], "val_examples": val["examples"], "train_examples": len(tokenized["train"]),
        "steps": state["step"], "epochs": state["epoch"] + (state["batch_in_epoch"] > 0),
        "world_size": fabric.world_size, "precision": fabric.strategy.precision.precision,
        "strategy": type(fabric.strategy).__name__, "train_time_s": train_time,
        "train_samples_per_s": sum_over_ranks(fabric, samples) / train_time,
        "train_tokens_per_s": sum_over_ranks(fabric, tokens) / train_time,
        "mfu": mfu(throughput, fabric, flops, train_time),
        "peak_memory_mb": peak_memory_mb(fabric.device),
        "environment": env, "config": vars(args),
    }
    for logger in fabric.loggers:
        logger.finalize("success")  # flushes metrics.csv, which the plots read
    if fabric.is_global_zero:
        (out_dir / "results.json").write_text(json.dumps(results, indent=2))
        plot_metrics(out_dir)
    fabric.print(f"test accuracy {test['acc']:.4f} on {test['examples']} rows; results in {out_dir}/results.json")
    return results


def sum_over_ranks(fabric, value) -> float:
    return float(fabric.all_reduce(torch.as_tensor(value, dtype=torch.float64, device=fabric.device), reduce_op="sum"))


def validate(fabric, model, val_loader, num_labels, state, ckpt_dir, step):
    """Evaluates on the validation split, logs it, and keeps the best model so far as checkpoints/best."""
    val = evaluate(model, val_loader, num_labels, fabric.device)
    val["step"] = step
    fabric.log_dict({"val/loss": val["loss"], "val/acc": val["acc"]}, step=step)
    fabric.print(f"step {step}: val loss {val['loss']:.4f}, val acc {val['acc']:.4f}")
    if val["acc"] > state["best_val_acc"]:
        state["best_val_acc"] = val["acc"]
        save_checkpoint(fabric, ckpt_dir, "best", {"model": model, "meta": state["meta"], "step": step})
    return val


@torch.no_grad()
def evaluate(model, loader, num_labels, device) -> dict:
    """Loss and accuracy over every row of the split exactly once, summed over all ranks."""
    model.eval()
    loss, acc, count = (m.to(device) for m in (MeanMetric(), MulticlassAccuracy(num_labels, average="micro"),
                                                SumMetric()))
    remaining = loader.batch_sampler.num_real
    for batch in loader:
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
        real = min(len(logits), remaining)  # the rest repeat a row so all ranks run the same number of batches
        remaining -= real
        if real == 0:
            continue
        logits, labels = logits[:real], batch["labels"][:real]
        loss.update(F.cross_entropy(logits, labels, reduction="none"))
        acc.update(logits, labels)
        count.update(real)
    model.train()
    return {"loss": loss.compute().item(), "acc": acc.compute().item(), "examples": int(count.compute().item())}


if __name__ == "__main__":
    main()
