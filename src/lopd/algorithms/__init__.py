"""Training algorithms, found by name.

A method is a subclass of :class:`lopd.algorithms.base.Algorithm` decorated with :func:`register`;
its config section (``config_class``, reached as ``cfg.<name>``) is declared next to it. The
registry of method names and config sections lives in :mod:`lopd.config` (the bottom layer, which
imports nothing of lopd): :func:`register` records the class here and registers its name and
section there (:func:`lopd.config.register_method`). Config loading, ``lopd config``,
``lopd train --algo`` and ``compare`` read that registry, so a new method is one module and its
test. Methods outside this package register by being imported, or through the ``lopd.algorithms``
entry-point group of an installed package (``name = "module"``); :mod:`lopd.config` imports the
methods shipped with lopd and those of the group by module name on first use.
"""

from __future__ import annotations

from lopd.config import (
    ConfigError,
    check_method_name,
    load_methods,
    method_names,
    method_sections,
    register_method,
    unregister_method,
)

_REGISTRY: dict[str, type] = {}


def register(cls: type) -> type:
    """Class decorator: make ``cls`` (an Algorithm with a ``name``) available under its name."""
    name = getattr(cls, "name", "")
    check_method_name(name, f"algorithm {cls.__name__}")
    existing = _REGISTRY.get(name)
    if existing is not None and existing.__qualname__ != cls.__qualname__:
        raise ConfigError(f"two algorithms named {name!r}: {existing.__module__}."
                          f"{existing.__qualname__} and {cls.__module__}.{cls.__qualname__}")
    if existing is not None:
        unregister_method(name)     # the same class again (a re-import): its section may change
    register_method(name, getattr(cls, "config_class", None))
    _REGISTRY[name] = cls
    return cls


def unregister(name: str) -> None:
    """Remove a registered method (tests that register throw-away methods clean up with it)."""
    _REGISTRY.pop(name, None)
    unregister_method(name)


def algorithm_names() -> list[str]:
    """Every registered method, sorted."""
    return method_names()


def get_algorithm(name: str) -> type:
    load_methods()
    if name not in _REGISTRY:
        raise ConfigError(f"unknown algorithm {name!r}; choose one of {algorithm_names()}")
    return _REGISTRY[name]


def config_sections() -> dict[str, type]:
    """name -> config dataclass of every registered method that declares one."""
    return method_sections()
