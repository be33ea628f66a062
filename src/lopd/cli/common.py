"""What every command shares: the common options, declared once, and the config they load.

A command is declared with :func:`add_command`, naming the shared option groups it takes
(:data:`CONFIG`, :data:`JSON`, :data:`LOPD_INPUTS`); its own options follow. Each command module
then only parses, calls :mod:`lopd.pipeline` (or an experiment) and prints.
"""

from __future__ import annotations

import argparse

from lopd.config import load_config
from lopd.stages import CODE_ENVS


def _group(title: str, add) -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    add(parent.add_argument_group(title))
    return parent


def _config_args(group) -> None:
    group.add_argument("--config", default="tiny",
                       help="preset name (tiny) or path to a YAML config (default: tiny)")
    group.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="SECTION.KEY=VALUE",
                       help="override one config value; repeatable, e.g. "
                       "--set train.learning_rate=3e-4")


def _json_args(group) -> None:
    group.add_argument("--json", dest="json_path", metavar="PATH",
                       help="also write the printed figures to PATH as JSON")


def _lopd_input_args(group) -> None:
    group.add_argument("--composer", help="cold-started composer folder (LOPD; sets lopd.composer)")
    group.add_argument("--bank", help="experience bank folder (LOPD; sets lopd.bank)")


CONFIG, JSON, LOPD_INPUTS = "config", "json", "lopd inputs"
_PARENTS = {CONFIG: _group("config", _config_args), JSON: _group("output", _json_args),
            LOPD_INPUTS: _group("LOPD inputs", _lopd_input_args)}


def add_command(sub, name: str, func, help: str, description: str,
                shared: tuple[str, ...] = (CONFIG, JSON)) -> argparse.ArgumentParser:
    """A subcommand running ``func(args)``, with the ``shared`` option groups."""
    parser = sub.add_parser(name, help=help, description=description,
                            parents=[_PARENTS[s] for s in shared])
    parser.set_defaults(func=func)
    return parser


def add_env_arg(parser, help: str = "environment (default: toolworld)",
                default: str | None = "toolworld") -> None:
    parser.add_argument("--env", default=default, help=help)


def load(args, extra: list[str] | None = None):
    """The config of ``--config`` with ``extra`` overrides, then the ``--set`` ones."""
    return load_config(args.config, [*(extra or []), *args.overrides])


def lopd_input_overrides(args) -> list[str]:
    """``--composer`` / ``--bank`` as config overrides, followed by the ``--set`` ones."""
    sets = []
    if args.composer:
        sets.append(f"lopd.composer={args.composer}")
    if args.bank:
        sets.append(f"lopd.bank={args.bank}")
    return sets + list(args.overrides)


def config_for_env(args):
    """The config for ``--env``: the code environments use the tiny-code preset (the code model)
    unless ``--config`` names another."""
    name = "tiny-code" if args.env in CODE_ENVS and args.config == "tiny" else args.config
    env = [f"env.name={args.env}"] if args.env else []
    return load_config(name, [*env, *args.overrides])
