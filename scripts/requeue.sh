#!/usr/bin/env bash
# Whether scripts/slurm.sbatch requeues its job: exit 0 (requeue) or 1 (do not).
# Usage: scripts/requeue.sh STATUS OUT_DIR   (STATUS: srun's exit status; OUT_DIR: the run's --out-dir)
# 75: every task saved the checkpoint and stopped (preempted, or out of time). Any other failure still requeues if
# the run wrote OUT_DIR/preempted.txt, that is, the checkpoint was saved and a task failed only on its way out.
# 0 is a finished run; other failures without that file are errors to look at, not to repeat.
set -u
status=$1 out_dir=$2
[ "$status" -ne 0 ] && { [ "$status" -eq 75 ] || [ -f "$out_dir/preempted.txt" ]; }
