"""``--config FILE`` (and a resumed run's ``config.yaml``): flag values read as plain YAML, checked by the parser as
the same flags given on the command line; loaded only where a run reads one."""

import argparse
import copy
import os
from pathlib import Path

import yaml

from fabric_utils.errors import UserError

MAX_CONFIG_BYTES = 1 << 20  # a config of flags is a few KB


def load_config(path: str, parser: argparse.ArgumentParser) -> dict:
    """The flag values in YAML file ``path``, checked and converted by ``parser`` as the same flags given to it."""
    config = read_yaml(path)
    if not isinstance(config, dict):
        raise UserError(f"config file {path} must map flag names to values (as config.yaml does)")
    actions = {a.dest: a for a in parser._actions}
    if unknown := sorted(set(config) - set(actions)):
        raise UserError(f"config file {path} has unknown keys {unknown}")
    config.pop("config", None)
    flags = []  # as the command line gives them, for argparse to check and convert
    for name, value in config.items():
        options, nargs = actions[name].option_strings, actions[name].nargs
        if nargs == 0 and isinstance(value, bool):  # a switch: on, or off (--no-X where it has one)
            flags += options[:1] if value else options[1:]
        elif isinstance(value, list) and nargs in ("+", "*"):
            flags += [options[0], *map(str, value)]
        elif isinstance(value, (list, dict)):
            raise UserError(f"config file {path}: {name} holds a {type(value).__name__}; it takes one value")
        elif value is not None:
            flags.append(f"{options[0]}={value}")
    checker = copy.copy(parser)
    checker.exit_on_error = False  # raised, to be said with the file's name
    try:
        parsed = checker.parse_args(flags)
    except argparse.ArgumentError as err:
        raise UserError(f"config file {path}: {err}") from err
    return {name: None if value is None else getattr(parsed, name) for name, value in config.items()}


class PlainLoader(yaml.SafeLoader):
    """``yaml.safe_load``'s plain values without anchors and aliases: a few bytes of nested aliases expand to
    gigabytes wherever the value is printed or copied."""

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            raise yaml.composer.ComposerError(None, None, "an anchor or alias (& or *); write each value out",
                                              event.start_mark)
        return super().compose_node(parent, index)


def read_yaml(path: str):
    """The plain values of YAML file ``path``: one line naming it where it is missing, too big or not plain YAML."""
    if not os.path.isfile(path):
        raise UserError(f"config file {path} does not exist")
    if (size := os.path.getsize(path)) > MAX_CONFIG_BYTES:
        raise UserError(f"config file {path} has {size} bytes; a config of flags has a few thousand")
    try:
        return yaml.load(Path(path).read_text(), Loader=PlainLoader) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        where = f" line {err.problem_mark.line + 1}" if getattr(err, "problem_mark", None) else ""
        raise UserError(f"config file {path}{where}: not valid YAML ({getattr(err, 'problem', None) or err})") from err
