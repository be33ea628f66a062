"""Process-wide knobs: seeds, CPU threads, device and dtype."""

from __future__ import annotations

import contextlib
import os
import random
from pathlib import Path

import numpy as np
import torch


def set_seed(seed: int) -> None:
    """Seed Python's random, numpy and torch (all devices); faiss draws from numpy's state."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)


def set_threads(num_threads: int) -> None:
    """Use ``num_threads`` CPU threads in torch and faiss (1 is often fastest on shared cores)."""
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    torch.set_num_threads(num_threads)
    try:
        import faiss
    except ImportError:
        return
    faiss.omp_set_num_threads(num_threads)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("run.device is 'cuda' but torch sees no CUDA device; use 'cpu' or 'auto'")
    return torch.device(device)


# On a CPU, bf16 autocast pays only where the CPU multiplies bfloat16 in hardware (without such a
# unit it is 4-20x slower than float32). With one, `auto` gives bf16-mixed to models at least this
# wide (SmolLM2-135M, hidden 576: a training step 1.6x faster on AMX-BF16) and keeps narrower
# ones, the 1M-parameter models (hidden 128), in float32: there bf16 changes GRPO's whole step by
# 0.96x and speeds LOPD's 1.5x (docs/results/precision.md), and float32 keeps their published
# figures and the tests' numbers the same on every CPU. `run.precision: bf16-mixed` takes the gain.
CPU_BF16_MIN_HIDDEN = 512

# /proc/cpuinfo flags of the CPU units that multiply bfloat16 matrices, best first.
CPU_BF16_FLAGS = (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX-512 BF16"))


def cpu_bf16_units(cpuinfo: str = "/proc/cpuinfo") -> tuple[str | None, str]:
    """This CPU's bfloat16 matrix unit ('AMX-BF16', 'AVX-512 BF16' or None) and how that was
    found out (the flag read from ``cpuinfo``, or why nothing could be read)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None, f"{cpuinfo} is not readable here"
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    for flag, name in CPU_BF16_FLAGS:
        if flag in flags:
            return name, f"flag {flag} in {cpuinfo}"
    return None, f"neither {' nor '.join(f for f, _ in CPU_BF16_FLAGS)} in {cpuinfo}"


def choose_precision(precision: str, device: torch.device,
                     hidden_size: int | None = None) -> tuple[str, str]:
    """``run.precision`` made concrete, with the reason in words. 'auto' is bf16-mixed on cuda,
    and on a CPU with bfloat16 matrix units (:func:`cpu_bf16_units`) for a model at least
    :data:`CPU_BF16_MIN_HIDDEN` wide (``hidden_size``; unknown counts as narrow); fp32 elsewhere."""
    if precision != "auto":
        return precision, "run.precision"
    if device.type == "cuda":
        return "bf16-mixed", "auto: cuda"
    if device.type != "cpu":
        return "fp32", f"auto: {device.type}"
    unit, found = cpu_bf16_units()
    if unit is None:
        return "fp32", f"auto: no bfloat16 matrix unit on this CPU ({found})"
    if hidden_size is None or hidden_size < CPU_BF16_MIN_HIDDEN:
        width = "unknown" if hidden_size is None else hidden_size
        return "fp32", (f"auto: this CPU has {unit} ({found}), but the model's hidden size "
                        f"({width}) is under {CPU_BF16_MIN_HIDDEN}: narrow models stay float32, "
                        "the same on every CPU")
    return "bf16-mixed", f"auto: this CPU has {unit} ({found}); hidden size {hidden_size}"


def resolve_precision(precision: str, device: torch.device, hidden_size: int | None = None) -> str:
    """``run.precision`` made concrete: 'fp32' or 'bf16-mixed' (:func:`choose_precision`)."""
    return choose_precision(precision, device, hidden_size)[0]


def hidden_size(model) -> int | None:
    """The hidden size of a Hugging Face model (its config's ``hidden_size``), None if it has none."""
    return getattr(getattr(model, "config", None), "hidden_size", None)


def resolve_dtype(dtype: str, device: torch.device, precision: str = "auto",
                  hidden_size: int | None = None) -> torch.dtype:
    """Storage dtype of frozen and inference-only weights (``run.dtype``)."""
    if dtype == "auto":
        mixed = resolve_precision(precision, device, hidden_size) == "bf16-mixed"
        return torch.bfloat16 if mixed else torch.float32
    return getattr(torch, dtype)


def autocast(precision: str, device: torch.device):
    """The forward-pass context of a resolved ``precision``: bfloat16 autocast for 'bf16-mixed'
    (cuda, or cpu), nothing for 'fp32'."""
    if precision == "auto":
        raise ValueError("autocast needs a resolved precision (runtime.resolve_precision)")
    if precision == "bf16-mixed":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def setup(run_cfg) -> torch.device:
    """Apply a :class:`lopd.config.RunConfig`: threads and seed; returns the device to use."""
    set_threads(run_cfg.num_threads)
    set_seed(run_cfg.seed)
    return resolve_device(run_cfg.device)


def length_groups(lengths: list[int], slack: float = 1.5, floor: int = 16) -> list[list[int]]:
    """Indices of sequences grouped so that padding each group to its longest wastes little:
    sorted by length, a new group starts at a sequence longer than ``slack`` times (and ``floor``
    tokens more than) the group's shortest. Sequences that do not interact (prompts prefilled
    together, experiences encoded together) give the same results in any grouping."""
    groups: list[list[int]] = []
    shortest = None
    for index in sorted(range(len(lengths)), key=lengths.__getitem__):
        if shortest is None or lengths[index] > max(slack * shortest, shortest + floor):
            groups.append([])
            shortest = lengths[index]
        groups[-1].append(index)
    return groups


def launched() -> bool:
    """True when torchrun started this process (one of several, or one alone; one process alone
    trains unwrapped, as without torchrun)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
