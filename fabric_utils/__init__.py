"""The task-free helpers train.py calls, vendored (``copier update`` brings their fixes), listed by module below; each
loads when first used (PEP 562), so ``--help`` and a bad flag answer before torch does. ``strategy`` alone looks at
the type of the strategy in use, to answer what it can do."""

from fabric_utils.args import FP8, Config, build_parser, parse_flags  # the flags, then the run's read-only config
from fabric_utils.errors import UserError, exit_on_user_error  # bad input: one line saying what to change
from fabric_utils.task_spec import TaskSpec  # what a task gives the loop

PUBLIC = {
    "launcher": ("build_fabric", "launch", "explain_lost_peers",  # Fabric from the flags, its processes, lost peers
                 "warn_if_updates_vanish"),  # bf16-true weights round small updates away
    "run_folder": ("proposed_run_folder", "locked_run_folder",  # one run per folder; a failed start undoes its own
                   "environment_report", "save_config", "write_predictions"),  # what the run records
    "loggers": ("make_loggers", "finalize_loggers", "plot_metrics"),  # CSV and the trackers, flushed; the plots
    "threads": ("set_threads",),  # CPU threads per process: the idle CPUs, shared by the node's processes
    "preemption": ("Preemption",),  # SIGTERM/SIGUSR1/Ctrl-C: a checkpoint, then exit 75 for a requeue
    "pretrained": ("build_model", "load_pretrained"),  # the task's model, sharded at build where the strategy shards
    "sharding": ("prepare_for_setup", "cast_shards", "compile_in_engine",  # what strategies need around fabric.setup
                 "full_shapes"),  # parameter shapes from before a strategy flattened them
    "optim": ("build_optimizer", "count_parameters"),  # AdamW, fused, no decay on biases and norms
    "batch_size": ("fitting_batch_size",),  # --batch-size, or with auto the largest that fits
    "loaders": ("make_dataloaders", "cut_splits", "fill_rows", "first_rows"),  # length-grouped batches, sharded
    "speed": ("default_num_workers", "training_flops_fn", "convert_to_float8", "compile_model", "batch_kinds",
              "warm_up", "peak_memory_per_rank"),  # workers, MFU's FLOPs, fp8, torch.compile and its warm-up, memory
    "checkpoint": ("agreed_resume_checkpoint", "keep_rows_per_step", "ROWS_PER_STEP",  # what a resume continues
                   "load_checkpoint", "save_checkpoint", "remove_checkpoint",  # atomic, verified before loading
                   "wait_for_save", "holds_trained_only",  # saves in the background; without the frozen base
                   "best_rule", "load_best"),  # which validation result makes checkpoints/best, loaded
    "export": ("export_model",),  # the best model's full weights, written by the task
    "progress": ("say", "silence_libraries", "shows_bars", "header", "counted",  # what a run prints, rank 0 only
                 "Progress", "Throughput"),  # loss, metrics, rows/s and MFU as it trains
}
_MODULE_OF = {name: module for module, names in PUBLIC.items() for name in names}


def __getattr__(name: str):
    if name not in _MODULE_OF:  # submodules too: the import system loads them
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from fabric_utils import (batch_size, checkpoint, export, launcher, loaders, loggers, optim, preemption,  # noqa
                              pretrained, progress, run_folder, sharding, speed, threads)  # the loop uses them all
    return getattr(globals()[_MODULE_OF[name]], name)
