"""``bench/memory.py --stage build-load``'s probe: ``PROBE_OUT=DIR python bench/build_load_probe.py [train.py flags]``,
run from the root of the checkout to measure (this one or another commit's), starts train.py with these flags and
writes each rank's anonymous memory (RssAnon: the process's own, not the page cache of a memory-mapped file) to
DIR/rank-<R>.json: at the start of the model's build (the task's data ready), its peak until the model is handed
to Fabric's set-up (built; under ZeRO-3 with a skeleton, loaded too), its peak until training would start (set up,
its pretrained values loaded; DeepSpeed's set-up adds its fp32 master weights and gradient partitions) and what the
rank holds then, sampled every millisecond. The run stops there."""

import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())  # the checkout measured, not this file's
import train  # noqa: E402

OUT = Path(os.environ["PROBE_OUT"])  # not an argument: Lightning starts the other ranks with this argv


def rss_anon_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssAnon:")) / 1024


class PeakSampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.start_mb = self.peak_mb = rss_anon_mb()
        self.running = True

    def run(self):
        while self.running:
            self.peak_mb = max(self.peak_mb, rss_anon_mb())
            time.sleep(0.001)

    def stop(self) -> dict:
        self.running = False
        self.join()
        end_mb = rss_anon_mb()
        return {"start_mb": self.start_mb, "peak_mb": max(self.peak_mb, end_mb), "end_mb": end_mb}


sampler = None
built_peak_mb = None
task_setup = train.task.setup
prepare_for_setup = train.sharding.prepare_for_setup


def probed_setup(args, verbose):
    global sampler
    job = task_setup(args, verbose)
    sampler = PeakSampler()
    sampler.start()
    return job


def probed_prepare_for_setup(*args, **kwargs):
    global built_peak_mb
    built_peak_mb = max(sampler.peak_mb, rss_anon_mb())
    return prepare_for_setup(*args, **kwargs)


def stop_before_training(fabric, *args, **kwargs):
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"rank-{fabric.global_rank}.json").write_text(json.dumps({**sampler.stop(), "built_peak_mb": built_peak_mb}))
    fabric.barrier()
    os._exit(0)  # the measurement is taken: no training, test or export


train.task.setup = probed_setup
train.sharding.prepare_for_setup = probed_prepare_for_setup
train.fit = stop_before_training

if __name__ == "__main__":
    train.setup()
