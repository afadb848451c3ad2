"""Predictions of a trained run's model for the rows of any file, read as the run read its data.

    .venv/bin/python predict.py RUN_FOLDER FILE                  # writes RUN_FOLDER/predictions.csv

The columns are those of the run's test_predictions.csv but the label (the row's index in FILE, the prediction and
its name, its score and each class's): FILE needs no labels; ``--text-column`` names its text column if the run's is
not there. The task (``task.predict``) says how its exported model reads a file.
"""

from pathlib import Path

import task
from fabric_utils.args import Parser, build_parser, positive_int
from fabric_utils.config_file import load_config
from fabric_utils.errors import UserError, exit_on_user_error


def run_flag_parser():
    """train.py's flags, the task's among them: what a run's config.yaml holds."""
    parser = build_parser(description="")
    task.add_args(parser)
    return parser


@exit_on_user_error
def main(argv=None) -> Path:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a finished run's folder: its model/ and config.yaml")
    parser.add_argument("file", type=Path, help="the rows to predict, in a format --dataset reads")
    parser.add_argument("--out", type=Path, help="the CSV to write (default: RUN_FOLDER/predictions.csv)")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="rows per forward pass")
    parser.add_argument("--text-column", help="FILE's text column (default: the run's --text-column)")
    parser.add_argument("--text-pair-column", help="FILE's second text column, for a run on pairs (default: the "
                        "run's --text-pair-column)")
    args = parser.parse_args(argv)
    if not hasattr(task, "predict"):
        raise UserError("this task.py has no predict(): the run's test_predictions.csv holds its test split's")
    for needed in (args.run / "model", args.run / "config.yaml"):
        if not needed.exists():
            raise UserError(f"{needed} does not exist: pass the folder of a run that finished (it exports model/)")
    out = args.out or args.run / "predictions.csv"
    if not out.parent.is_dir() or out.is_dir():  # said now, not after the model has run
        raise UserError(f"--out {out}: {out if out.is_dir() else out.parent} is not a folder a file can be written "
                        f"into; pass a file path in an existing folder")
    # the run's first segment: how it read its data, each value checked by its flag's own type as --config is
    flags = load_config(str(args.run / "config.yaml"), run_flag_parser())
    flags.update({name: value for name in ("text_column", "text_pair_column") if (value := getattr(args, name))})
    # here: the libraries load only for a valid command
    from fabric_utils.progress import silence_libraries
    from fabric_utils.run_folder import write_predictions

    silence_libraries()
    columns = task.predict(args.run / "model", args.file, flags, batch_size=args.batch_size)
    write_predictions(out, columns)
    print(f"{len(columns['row'])} predictions in {out}")
    return out


if __name__ == "__main__":
    main()
