"""Process-wide knobs: seeds, CPU threads, device and dtype."""

from __future__ import annotations

import contextlib
import os
import random

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


def resolve_precision(precision: str, device: torch.device) -> str:
    """``run.precision`` made concrete: 'bf16-mixed' on cuda for 'auto', 'fp32' elsewhere."""
    if precision == "auto":
        return "bf16-mixed" if device.type == "cuda" else "fp32"
    return precision


def resolve_dtype(dtype: str, device: torch.device, precision: str = "auto") -> torch.dtype:
    """Storage dtype of frozen and inference-only weights (``run.dtype``)."""
    if dtype == "auto":
        mixed = resolve_precision(precision, device) == "bf16-mixed"
        return torch.bfloat16 if mixed else torch.float32
    return getattr(torch, dtype)


def autocast(precision: str, device: torch.device):
    """The forward-pass context of ``precision``: bfloat16 autocast for 'bf16-mixed' (cuda, or
    cpu where torch supports it), nothing for 'fp32'."""
    if resolve_precision(precision, device) == "bf16-mixed":
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
