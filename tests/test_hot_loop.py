"""What the training loop does between log steps (no host-device syncs, non-blocking batch copies), what it logs
(throughput, MFU), and how its ranks stop together."""

import ast
import inspect
import os
import pickle
import signal
import sys
import textwrap
import traceback

import pytest
import torch
import torch.multiprocessing as mp
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch.overrides import TorchFunctionMode
from transformers import AutoConfig, AutoModelForSequenceClassification, DataCollatorWithPadding
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

import train
from conftest import REPO, SMALL_DEMO, logged, run, train as train_run
from data.tokenize import make_collator
from task import ClassifierObjective

# Tensor methods that read a value back to the host: on a GPU each one waits for every queued kernel
HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
              torch.Tensor.__int__, torch.Tensor.numpy, torch.Tensor.cpu}
# where the loop may sync: its log step, the preemption vote (at log steps), validation and checkpoints
ALLOWED = {"log_step", "agreed", "validate", "evaluate", "save_checkpoint"}
# work on host tensors, which on a CPU look like everything else: the DataLoader building the next batch before
# Fabric moves it, and optimizers reading their step counters (CPU tensors unless capturable)
HOST_SIDE = {("dataloader.py", "_next_data"), ("dataloader.py", "__iter__"), ("optimizer.py", "_get_value")}


def _training_loop_lines(function) -> tuple[int, int]:
    """First and last line of the training loop: the outermost ``while`` or ``for`` statement of ``function``."""
    source, first = inspect.getsourcelines(function)
    loop = next(node for node in ast.walk(ast.parse(textwrap.dedent("".join(source))))
                if isinstance(node, (ast.While, ast.For)))
    return first + loop.lineno - 1, first + loop.end_lineno - 1


LOOP_FILE, LOOP_LINES = inspect.getsourcefile(train.fit), _training_loop_lines(train.fit)


class SyncRecorder(TorchFunctionMode):
    """Records host reads and blocking device copies made inside the training loop but outside its sync points."""

    def __init__(self):
        super().__init__()
        self.found = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        stack = traceback.extract_stack()
        # a copy to a device is a sync unless non-blocking; libraries' own copies are device to device (no sync)
        blocking_copy = (func is torch.Tensor.to and _names_device(args[1:], kwargs) and not kwargs.get("non_blocking")
                         and _is_project_file(stack[-2].filename))
        if func in HOST_READS or blocking_copy:
            in_loop = any(f.filename == LOOP_FILE and LOOP_LINES[0] <= f.lineno <= LOOP_LINES[1] for f in stack)
            host_side = any((f.filename.rsplit("/", 1)[-1], f.name) in HOST_SIDE for f in stack)
            from_fabric_loader = any(f.filename.endswith("apply_func.py") for f in stack)  # checked separately
            if in_loop and not (host_side or from_fabric_loader or ALLOWED & {f.name for f in stack}):
                self.found.append(f"{func.__qualname__} at " + " <- ".join(
                    f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in reversed(stack[-6:-1])))
        return func(*args, **kwargs)


def _is_project_file(path: str) -> bool:
    return path.startswith(str(REPO)) and "site-packages" not in path  # a .venv may live inside the repository


def _names_device(args, kwargs) -> bool:
    return "device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args)


def test_no_host_device_sync_between_log_steps(tmp_path, monkeypatch):
    """Six steps logged every third: any value read back or blocking copy in the loop outside the log step, the
    preemption vote, validation or checkpointing, transformers' forward and backward included, is a GPU stall per
    step (torch.cuda.set_sync_debug_mode shows the same on a GPU)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    recorder = SyncRecorder()
    try:
        with recorder:
            train.setup(["--accelerator", "cpu", "--precision", "32-true", *SMALL_DEMO, "--max-steps", "6",
                        "--log-every", "3", "--out-dir", str(tmp_path)])
    finally:  # the run installed its preemption handlers in this process: put pytest's back
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert not recorder.found, "\n".join(recorder.found[:10])


class HostReads(TorchFunctionMode):
    """Every value read back to the host, wherever it is made, and the inputs of each SDPA call."""

    def __init__(self):
        super().__init__()
        self.found, self.attention = [], []  # and what each SDPA call was given

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            self.found.append(" <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}"
                                          for f in reversed(traceback.extract_stack()[-6:-1])))
        if func is torch.nn.functional.scaled_dot_product_attention:
            given = {**dict(zip(("query", "key", "value", "attn_mask"), args)), **(kwargs or {})}
            self.attention.append({"mask": given.get("attn_mask") is not None, "causal": given.get("is_causal"),
                                   "kv_heads": given["key"].shape[1]})
        return func(*args, **(kwargs or {}))


SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
FAMILIES = {"bert": SMALL, "roberta": SMALL, "distilbert": dict(dim=32, n_layers=2, n_heads=2, hidden_dim=64),
            # a sliding window shorter than the rows: its layers' masks are built apart from the global ones
            "modernbert": {**SMALL, "local_attention": 8, "global_attn_every_n_layers": 2},
            "gpt2": dict(n_embd=32, n_layer=2, n_head=2), "llama": {**SMALL, "num_key_value_heads": 1},
            "qwen2": {**SMALL, "num_key_value_heads": 1}}


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_masks_are_decided_on_the_host_at_equal_logits(family, demo_tokenizer, monkeypatch):
    """A batch without padding reaches the model with no mask (SDPA may take its fused kernel), one with padding
    with a mask transformers applies unchecked: no value is read back in the forward, encoders and decoders, and the
    logits are those of transformers' own path, which checks every mask."""
    tokenizer = demo_tokenizer
    config = AutoConfig.for_model(family, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, num_labels=3,
                                  bos_token_id=None, eos_token_id=None, cls_token_id=None, sep_token_id=None,
                                  **FAMILIES[family])
    if hasattr(config, "use_cache"):  # as task.build_model makes a classifier: no cache, whose path reads no mask
        config.use_cache = False
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config).eval()
    objective = ClassifierObjective("single_label", num_labels=3)
    # the template's collator has transformers apply the masks it gives unchecked
    ours, theirs = make_collator(tokenizer, False, 64, 8), DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
    for lengths in ([5, 13, 20], [16, 16]):
        rows = [{"input_ids": torch.randint(5, len(tokenizer), (n,)), "attention_mask": torch.ones(n, dtype=torch.long),
                 "labels": torch.tensor(0)} for n in lengths]
        batch, reads = ours(rows), HostReads()
        assert ("attention_mask" in batch) == (len(set(lengths)) > 1)
        with reads, torch.no_grad():
            logits = objective.forward(model, batch)
        assert not reads.found, reads.found
        # what SDPA is given: no mask, the one input flash attention refuses, where the batch has no padding
        # (ModernBERT's sliding-window layers keep their window's); decoders causal, their K/V heads not repeated
        padded, layers = "attention_mask" in batch, config.num_hidden_layers
        masked = [padded or (family == "modernbert" and layer % 2 == 1) for layer in range(layers)]
        assert [call["mask"] for call in reads.attention] == masked, reads.attention
        if family in ("gpt2", "llama", "qwen2"):
            kv_heads = getattr(config, "num_key_value_heads", config.num_attention_heads)
            assert all(call["causal"] and call["kv_heads"] == kv_heads for call in reads.attention if not padded), \
                reads.attention
        with monkeypatch.context() as stock, torch.no_grad():
            stock.setattr(ALL_MASK_ATTENTION_FUNCTIONS, "_local_mapping", {})
            expected = model(**{k: v for k, v in theirs(rows).items() if k != "labels"}).logits
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_batches_are_plain_dicts_that_fabric_copies_without_blocking(demo_tokenizer, monkeypatch):
    """Fabric passes non_blocking=True for each tensor of a dict; a BatchEncoding's own .to() would block."""
    rows = [{"input_ids": [2, 7, 3], "attention_mask": [1, 1, 1], "labels": 0}]
    batch = make_collator(demo_tokenizer, False, 64, 8)(rows)
    assert type(batch) is dict
    pickle.dumps(make_collator(demo_tokenizer, False, 64, 8))  # DataLoader workers started by "spawn" need this
    calls = []
    to = torch.Tensor.to

    def recording_to(self, *args, **kwargs):
        calls.append(kwargs.get("non_blocking", False))
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    move_data_to_device(batch, torch.device("meta"))  # any non-CPU device takes the GPU's path
    assert calls and all(calls), calls


def test_logged_mfu_agrees_with_results(tmp_path):
    """ThroughputMonitor takes the FLOPs since its previous update; passing a running total made the logged MFU
    grow with every log step (0.209 logged against 0.016 in results.json)."""
    results = train_run([*SMALL_DEMO, "--accelerator", "cpu", "--precision", "32-true", "--max-steps", "25",
                         "--log-every", "2", "--peak-tflops", "0.1"], tmp_path)
    mfu = list(logged(tmp_path, "device/mfu").values())
    assert len(mfu) >= 5, mfu
    assert results["mfu_padded"] > results["mfu"] > 0  # the demo's batches pad their rows to a bucket
    # the logged values are windows of 5 log steps, results.json the whole loop (validation included)
    assert 0.5 < sum(mfu) / len(mfu) / results["mfu"] < 2.5, (mfu, results["mfu"])
    assert mfu[-1] < 3 * mfu[0], mfu  # does not grow with the step count


def _log_on_rank(rank: int, port: int, results):
    import os

    from lightning.fabric import Fabric

    from fabric_utils.launcher import end_job
    from fabric_utils.progress import Progress
    from task import ClassifierObjective

    # as torchrun would start it: Fabric joins the job instead of starting processes
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    progress = Progress(fabric, total_steps=1, quiet=True, steps_per_epoch=1, rows_per_step=8,
                        metrics=ClassifierObjective("single_label", num_labels=2).make_metrics())
    loss = torch.tensor(float("nan") if rank == 1 else 0.5)  # only rank 1 diverged
    progress.update(loss, torch.zeros(4, 2), torch.zeros(4, dtype=torch.long))
    results[rank] = progress.log(step=1, lr=1e-3)["train/loss"]
    end_job(fabric)


def test_a_loss_gone_non_finite_on_one_rank_is_seen_by_every_rank(tmp_path):
    """The loop raises on a non-finite loss; if only the diverged rank saw it, the others would hang in the next
    collective. The logged loss is summed over ranks, so all of them see the same value and stop together."""
    results = mp.Manager().dict()
    port = 29700 + os.getpid() % 1000
    mp.start_processes(_log_on_rank, args=(port, results), nprocs=2, start_method="spawn")
    assert all(torch.isnan(torch.tensor(results[r])) for r in (0, 1)), dict(results)



def test_a_run_that_never_leaves_chance_level_is_said_to_be_stuck(tmp_path):
    """At a far too high learning rate the loss stays where a model that ignores its inputs is: one line says so at
    the run's end, and names --lr; bench/stuck_line.py, judging the run from its logs, agrees. The demo, which
    learns, never says it (test_train.py)."""
    done = run([sys.executable, "train.py", *SMALL_DEMO, "--lr", "1", "--max-steps", "24", "--log-every", "4",
                "--out-dir", str(tmp_path)])
    said = [line for line in done.stdout.splitlines() if "chance level" in line]
    assert len(said) == 1 and "up to step 24:" in said[0] and "lower --lr (now 1)" in said[0], said
    judged = run([sys.executable, "bench/stuck_line.py", str(tmp_path)]).stdout  # the same rule, from the run's logs
    assert f"| {tmp_path} |" in judged and judged.rstrip().endswith("| yes |"), judged


def test_a_run_is_stuck_only_if_its_validation_loss_ends_at_chance_too():
    """A training loss at chance over the last quarter is not enough: a run whose validation loss left chance has
    learned a little, and is not told it did not. One whose validation loss did not is stuck, even if it fits its
    own rows a little; one that fits them well is not stuck. Judged once, at the last step."""
    from lightning.fabric import Fabric

    from fabric_utils.progress import Progress
    from task import ClassifierObjective

    def progress_at(loss: float) -> Progress:
        progress = Progress(Fabric(accelerator="cpu", devices=1), total_steps=8, quiet=True, steps_per_epoch=8,
                            rows_per_step=4, metrics=ClassifierObjective("single_label", num_labels=2).make_metrics(),
                            chance_loss={"train": 0.693, "validation": 0.690})
        for step in range(1, 9):
            assert not progress.warn_if_stuck(val_loss=0.69, max_lr=1e-3)  # not before the end
            progress.update(torch.tensor(loss), torch.zeros(4, 2), torch.zeros(4, dtype=torch.long))
            progress.log(step, lr=1e-3)
        return progress

    at_chance = progress_at(0.693)
    assert at_chance.warn_if_stuck(val_loss=0.69, max_lr=1e-3) and not at_chance.warn_if_stuck(0.65, max_lr=1e-3)
    assert progress_at(0.67).warn_if_stuck(val_loss=0.69, max_lr=1e-3)  # just under chance: a stalled run
    assert not progress_at(0.6).warn_if_stuck(val_loss=0.69, max_lr=1e-3)  # the training loss left chance
