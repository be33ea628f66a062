"""Environments: the protocol (``base``) and a registry of the environments by name."""

from __future__ import annotations

import importlib

from lopd.envs.environment import Environment

# name -> "module:class"; imported on demand so that using one environment never imports the
# others (and their dependencies).
REGISTRY = {
    "toolworld": "lopd.envs.toolworld:ToolWorld",
    "codeworld": "lopd.envs.codeworld:CodeWorld",
    "humaneval": "lopd.envs.humaneval:HumanEval",
    "bfcl": "lopd.envs.bfcl:BFCL",
}


def get_env(name: str, **kwargs) -> Environment:
    """The environment called ``name``, built with ``kwargs`` (e.g. ``seed``, ``sizes``)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown environment {name!r}; known environments: "
                         f"{', '.join(sorted(REGISTRY))}")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)
