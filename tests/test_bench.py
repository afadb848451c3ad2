"""The benchmark scripts' own logic: the Trainer row's model settings and schedule, a study continued after a stop."""

import sys
from pathlib import Path

import pytest
import torch
from transformers import get_scheduler

from conftest import SMALL_DEMO
from data.demo import prepare_demo

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench import hf_trainer  # noqa: E402
from train import build_scheduler, flag_parser  # noqa: E402


def test_hf_trainer_builds_the_templates_model_settings():
    _, model_dir = prepare_demo(Path.home() / ".cache" / "fabric-template" / "demo")
    template = flag_parser().parse_args([])
    args = hf_trainer.parse_args(["--dataset", "unused", "--model", str(model_dir), "--out-dir", "unused"])
    model = hf_trainer.build_model(args.model, ["neg", "pos"], args.attention_dropout, args.hidden_dropout)
    own = type(model.config).from_pretrained(model_dir)
    assert own.attention_probs_dropout_prob != template.attention_dropout  # else this test could not fail
    assert model.config.attention_probs_dropout_prob == template.attention_dropout
    assert model.config.hidden_dropout_prob == own.hidden_dropout_prob  # the template keeps the model's ('model')
    for flag in ("lr", "warmup", "scheduler", "min_lr_rate", "batch_size", "weight_decay", "grad_clip", "max_length",
                 "epochs"):
        assert getattr(args, flag) == getattr(template, flag), flag


@pytest.mark.parametrize("name", list(hf_trainer.HF_SCHEDULERS))
def test_hf_trainer_schedules_as_train_py_does(name):
    """The Trainer row's schedule (what its Trainer hands get_scheduler) is train.py's, step by step, at the
    default floor."""
    min_lr_rate, lr, warmup, steps = flag_parser().get_default("min_lr_rate"), 2.0, 3, 40
    assert min_lr_rate > 0  # else the floor's arguments would not be checked
    theirs, kwargs = hf_trainer.HF_SCHEDULERS[name]
    trainer = get_scheduler(theirs, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr),
                            num_warmup_steps=warmup, num_training_steps=steps,
                            scheduler_specific_kwargs=kwargs(lr, min_lr_rate))
    ours = build_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr), name, lr=lr,
                           max_steps=steps, warmup=warmup, min_lr_rate=min_lr_rate)
    for _ in range(steps):
        assert ours.get_last_lr() == pytest.approx(trainer.get_last_lr(), abs=1e-12)
        for scheduler in (ours, trainer):
            scheduler.optimizer.step()
            scheduler.step()


def test_a_study_reruns_a_run_its_stop_cut_short(tmp_path, monkeypatch):
    """A study continued after a stop runs the run it cut short again, in a cleared folder: train.py refuses a
    folder that holds a run (a checkpoint, no results.json)."""
    from bench import study
    args = study.parse_args(["--configs", "default", "--runs-dir", str(tmp_path), "--model", "unused"])
    out_dir = study.run_dir("default", 1, 1, 600, args)
    (out_dir / "checkpoints").mkdir(parents=True)
    folders_at_start = []
    monkeypatch.setattr(study, "run_process",
                        lambda cmd, out: folders_at_start.append(sorted(out.glob("*"))) or {"failed": 1})
    assert study.run_one("default", 1, 1, 600, args) == {"failed": 1}
    assert folders_at_start == [[]]


def test_reading_list_counts_the_code_lines_a_run_imports_and_those_it_runs(tmp_path):
    """The files a run's process imported, listed at its exit: the package's ``__init__.py``, a module reached through
    another, and a module behind a flag only when the flag is given; a module nothing imports is not read. Code lines
    leave out blank, comment and docstring lines; those the run executed leave out the bodies it never entered."""
    from bench.reading_list import code_lines, imported_files, ran_lines

    package = tmp_path / "fabric_utils"
    package.mkdir()
    (tmp_path / "train.py").write_text("import sys\nimport torch\nfrom fabric_utils import loaders\n"
                                       "if '--fp8' in sys.argv:\n    from fabric_utils import fp8\n"
                                       "    loaders.rows()\n")
    (package / "__init__.py").write_text("")
    (package / "loaders.py").write_text('"""A docstring\n\nover lines."""\n\n# a comment\nfrom . import errors\n\n\n'
                                        'def rows():\n    """One line."""\n    try:\n        return (1 +\n'
                                        '                2)  # a comment after code\n    except KeyError:\n'
                                        '        return 0\n')
    for name in ("errors", "fp8", "unused"):
        (package / f"{name}.py").write_text("")

    def imported(flags):
        files = imported_files(tmp_path, flags, lines=True)
        return (sorted(path.relative_to(tmp_path).as_posix() for path in files),
                ran_lines(package / "loaders.py", files[package / "loaders.py"]))
    assert imported([]) == (["fabric_utils/__init__.py", "fabric_utils/errors.py", "fabric_utils/loaders.py",
                             "train.py"], 2)  # the import and the def
    assert imported(["--fp8"]) == (["fabric_utils/__init__.py", "fabric_utils/errors.py", "fabric_utils/fp8.py",
                                    "fabric_utils/loaders.py", "train.py"], 5)  # and the try, whole return, no except
    assert code_lines(package / "loaders.py") == 7


OPTIONAL = {"batch_size", "compiling", "config_file", "deepspeed_engine", "fabric_run", "flops", "fp8",
            "other_launchers", "resume", "trackers"}


def test_a_run_imports_a_flags_module_only_when_the_flag_asks(tmp_path):
    """A default run loads none of the modules behind a flag; --resume and --peak-tflops (MFU on a CPU) load theirs."""
    from bench.reading_list import imported_files

    def optional(*flags):
        files = imported_files(REPO, [*SMALL_DEMO, "--max-steps", "2", *flags])
        return {path.stem for path in files if path.parent.name == "fabric_utils"} & OPTIONAL
    assert optional() == set()
    assert optional("--resume", "auto", "--peak-tflops", "1") == {"flops", "resume"}
