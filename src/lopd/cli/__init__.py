"""The ``lopd`` command: one module per command group, each parse → call the pipeline → print.

Commands that measure something print a table and, with ``--json PATH``, write the same figures.
The options every command shares (``--config``/``--set``, ``--json``, the LOPD inputs) are
declared once, in :mod:`lopd.cli.common`.

Each command imports what it runs inside its handler: parsing ``lopd --help`` or a config command
then loads neither torch nor the models (these imports point downwards, as every import in lopd
does; docs/layout.md).
"""

from __future__ import annotations

import argparse
import sys

from lopd import __version__
from lopd.cli import bank, cold_start, config, env, experiment, model, quickstart, train
from lopd.config import ConfigError
from lopd.envs.sandbox import SandboxUnavailable

GROUPS = (quickstart, config, env, cold_start, train, experiment, bank, model)
"""Command modules, in the order ``lopd --help`` lists them; each has ``register(subparsers)``."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lopd", description="Latent On-Policy Self-Distillation of LLM agents.")
    parser.add_argument("--version", action="version", version=f"lopd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for group in GROUPS:
        group.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError, ValueError, MemoryError, SandboxUnavailable) as exc:
        print(f"lopd {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
