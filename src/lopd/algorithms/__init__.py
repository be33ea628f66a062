"""Training algorithms; each plugs into :mod:`lopd.trainer` under its name."""

from __future__ import annotations

import importlib

# name -> "module:class"; imported on use, so `lopd --help` does not load torch.
ALGORITHMS = {
    "lopd": "lopd.algorithms.lopd:LOPD",
    "grpo": "lopd.algorithms.grpo:GRPO",
}


def get_algorithm(name: str) -> type:
    from lopd.config import ConfigError

    if name not in ALGORITHMS:
        raise ConfigError(f"unknown algorithm {name!r}; choose one of {sorted(ALGORITHMS)}")
    module, cls = ALGORITHMS[name].split(":")
    return getattr(importlib.import_module(module), cls)
