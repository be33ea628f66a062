"""Training algorithms, found by name.

A method is a subclass of :class:`lopd.algorithms.base.Algorithm` decorated with :func:`register`;
its config section (``config_class``, reached as ``cfg.<name>``) is declared next to it. Config
loading, ``lopd config``, ``lopd train --algo`` and ``compare`` read this registry, so a new method
is one module and its test. Methods outside this package register by being imported, or through
the ``lopd.algorithms`` entry-point group of an installed package (``name = "module"``).
"""

from __future__ import annotations

import importlib

BUILTIN = ("lopd.algorithms.lopd", "lopd.algorithms.grpo", "lopd.algorithms.sdft",
           "lopd.algorithms.opsd", "lopd.algorithms.sdpo", "lopd.algorithms.skill_sd")
"""Modules of the methods shipped with lopd; each registers its class on import."""

ENTRY_POINTS = "lopd.algorithms"

_REGISTRY: dict[str, type] = {}
_loaded = False


def register(cls: type) -> type:
    """Class decorator: make ``cls`` (an Algorithm with a ``name``) available under its name."""
    from lopd.config import ConfigError, core_sections

    name = getattr(cls, "name", "")
    if not name or not name.replace("_", "").isalnum() or name != name.lower():
        raise ConfigError(f"algorithm {cls.__name__}: name must be a lower-case identifier, got "
                          f"{name!r}")
    if name in core_sections() or name == "base":
        raise ConfigError(f"algorithm name {name!r} is taken by a config section or 'base'")
    existing = _REGISTRY.get(name)
    if existing is not None and existing.__qualname__ != cls.__qualname__:
        raise ConfigError(f"two algorithms named {name!r}: {existing.__module__}."
                          f"{existing.__qualname__} and {cls.__module__}.{cls.__qualname__}")
    _REGISTRY[name] = cls
    return cls


def unregister(name: str) -> None:
    """Remove a registered method (tests that register throw-away methods clean up with it)."""
    _REGISTRY.pop(name, None)


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module in BUILTIN:
        importlib.import_module(module)
    from importlib.metadata import entry_points

    for point in entry_points(group=ENTRY_POINTS):
        importlib.import_module(point.value.split(":")[0])


def algorithm_names() -> list[str]:
    """Every registered method, sorted."""
    _load()
    return sorted(_REGISTRY)


def get_algorithm(name: str) -> type:
    from lopd.config import ConfigError

    _load()
    if name not in _REGISTRY:
        raise ConfigError(f"unknown algorithm {name!r}; choose one of {algorithm_names()}")
    return _REGISTRY[name]


def config_sections() -> dict[str, type]:
    """name -> config dataclass of every registered method that declares one."""
    _load()
    return {name: cls.config_class for name, cls in sorted(_REGISTRY.items())
            if getattr(cls, "config_class", None) is not None}
