"""torchrun set-up, the student's DDP / FSDP2 wrapper, rank-aware reductions and sharded checkpoints.

``torchrun --nproc_per_node N [--nnodes M ...] -m lopd train ...`` runs the same ``lopd train`` in
every process; :func:`init` reads torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``)
and joins the process group: gloo on CPU, NCCL on GPU (one device per process, ``cuda:LOCAL_RANK``).
Without torchrun (or with one process) nothing here does anything and the trainer runs exactly as a
single process.

How one step is split (DESIGN §5; the trainer and :mod:`lopd.algorithms.base` use these pieces):

* the step's tasks (whole groups) are split contiguously by rank (:meth:`World.shard`); each rank
  rolls out its share, seeded per shard (:func:`shard_seed`), so the global batch stays
  ``train.rollouts_per_step``;
* every loss is divided by the step's **all-reduced** totals; the student's gradient is averaged
  over ranks by its wrapper (DDP all-reduce, FSDP2 reduce-scatter), so its loss is multiplied by the
  world size for backward (:attr:`World.grad_scale`): the summed gradient is then the one-process
  gradient of the global batch. Optimisers that are not wrapped (LOPD's composer) have their
  gradients summed over ranks after backward (:meth:`World.sum_grads`);
* metrics are each micro-batch's share of the step's figure: their sums are all-reduced, so every
  rank holds the same figures (and LOPD's dual update reads the same Δ).

The student is scored through one wrapped :class:`lopd.teacher.ActionScorer` (:func:`wrap_student`),
the module whose ``forward`` reaches every parameter: DDP around it, or FSDP2's ``fully_shard`` on
every decoder layer and then on it (the root). Generation calls the bare model, so under FSDP2 every
sharded module is unsharded (and kept so) for the duration (:func:`generation`): ranks generating
different numbers of tokens would otherwise wait on each other's all-gathers forever.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from lopd.models import _token_row_tensors
from lopd.runtime import launched
from lopd.teacher import ActionScorer

PARALLEL = ("ddp", "fsdp2")


@dataclass(frozen=True)
class World:
    """This process's place among the training processes (one process: rank 0 of 1)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    parallel: str = "ddp"
    device: torch.device = torch.device("cpu")
    """Where collective tensors live: cpu for gloo, this rank's GPU for NCCL."""

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def grad_scale(self) -> float:
        """Factor on a wrapped model's loss: the wrapper averages gradients over ranks."""
        return float(self.size)

    # -- splitting work -----------------------------------------------------------------------

    def shard(self, items: list, even: bool = True) -> list:
        """This rank's contiguous share of ``items``; ``even`` requires equal shares."""
        if not self.enabled:
            return list(items)
        if even and len(items) % self.size:
            raise ValueError(f"{len(items)} items do not split evenly over {self.size} processes")
        base, extra = divmod(len(items), self.size)
        start = self.rank * base + min(self.rank, extra)
        return list(items[start:start + base + (self.rank < extra)])

    # -- collectives (no-ops in one process) --------------------------------------------------

    def barrier(self) -> None:
        if self.enabled:
            torch.distributed.barrier()

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        """Every key summed over ranks (float64); every rank gets the same dict."""
        if not self.enabled or not values:
            return dict(values)
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t)
        return dict(zip(keys, t.tolist()))

    def mean(self, values: dict) -> dict:
        """Every numeric key averaged over ranks (equal local counts: the global mean); other
        values are kept as they are."""
        if not self.enabled:
            return dict(values)
        numbers = {k: v for k, v in values.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        return {**values, **{k: v / self.size for k, v in self.sum(numbers).items()}}

    def gather(self, items: list) -> list:
        """Every rank's ``items`` concatenated in rank order (picklable objects)."""
        if not self.enabled:
            return list(items)
        out: list = [None] * self.size
        torch.distributed.all_gather_object(out, list(items))
        return [x for part in out for x in part]

    def sum_grads(self, params) -> None:
        """Sum the gradients of ``params`` over ranks (one flat all-reduce); a gradient that is None
        on every rank stays None, one that exists somewhere is zero-filled elsewhere."""
        if not self.enabled:
            return
        params = list(params)
        present = torch.tensor([p.grad is not None for p in params], dtype=torch.float64,
                               device=self.device)
        torch.distributed.all_reduce(present)
        live = [p for p, n in zip(params, present.tolist()) if n > 0]
        if not live:
            return
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          .to(self.device, torch.float32) for p in live])
        torch.distributed.all_reduce(flat)
        offset = 0
        for p in live:
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p).to(p.device, p.dtype).clone()
            offset += n

    def close(self, wrapped: Wrapped | None = None) -> None:
        """Leave the process group (after every rank got here). Gloo's worker threads drop the
        tensors of the last collectives under the GIL; a process group destroyed at interpreter
        exit (by the last reference, DDP's reducer) joins those threads while holding the GIL and
        can deadlock. So: barrier, let the threads go idle, drop DDP, then destroy the group."""
        if not (self.enabled and torch.distributed.is_initialized()):
            return
        import gc
        import time

        torch.distributed.barrier()
        time.sleep(0.2)  # releases the GIL to gloo's threads
        if wrapped is not None:
            wrapped.module = None
            gc.collect()
        torch.distributed.destroy_process_group()


SINGLE = World()


def init(device: torch.device, parallel: str = "ddp") -> tuple[World, torch.device]:
    """(this process's World, its device): joins the process group when torchrun launched several
    processes (gloo on cpu, NCCL on cuda with ``cuda:LOCAL_RANK``); a single process gets
    :data:`SINGLE` and ``device`` unchanged."""
    if parallel not in PARALLEL:
        raise ValueError(f"train.parallel={parallel!r}; allowed: {', '.join(PARALLEL)}")
    if not launched():
        return World(parallel=parallel), device
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        backend = "nccl"
    elif device.type == "cpu":
        backend = "gloo"
    else:
        raise ValueError(f"run.device={device.type}: distributed training runs on cpu (gloo) or "
                         "cuda (NCCL)")
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend)
    return World(rank, size, local, parallel, device if backend == "nccl" else torch.device("cpu")), \
        device


def shard_seed(seed: int, shard: int) -> int:
    """Sampling seed of shard ``shard`` of a step whose seed is ``seed`` (shard 0 keeps it, so one
    process samples exactly as before)."""
    return seed if shard == 0 else (seed * 1_000_003 + shard * 104_729) % (2**63)


# ----------------------------------------------------------------------------------------------
# The student's wrapper


def decoder_layers(model) -> list[torch.nn.Module]:
    """The transformer blocks of a causal LM (the first ModuleList named ``layers``/``h``/``blocks``)."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] in (
                "layers", "h", "blocks"):
            return list(module)
    raise ValueError(f"{type(model).__name__}: no decoder layers found to shard")


@dataclass
class Wrapped:
    """The student's scoring module as the step calls it (``module``: DDP or the FSDP2 root) and
    the bare :class:`~lopd.teacher.ActionScorer` inside (``scorer``: its output head, state dicts)."""

    module: torch.nn.Module
    scorer: torch.nn.Module
    parallel: str

    @contextlib.contextmanager
    def no_sync(self, skip: bool):
        """DDP: skip the gradient all-reduce of this backward (all micro-batches but the last)."""
        if skip and self.parallel == "ddp":
            with self.module.no_sync():
                yield
        else:
            yield


def wrap_student(model, world: World) -> Wrapped:
    """One wrapped scoring module over ``model`` for the whole run (the optimiser must be built
    on ``model.parameters()`` after this: FSDP2 replaces them by sharded ones)."""
    scorer = ActionScorer(model)
    if world.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [world.device.index] if world.device.type == "cuda" else None
        return Wrapped(DistributedDataParallel(scorer, device_ids=ids), scorer, "ddp")
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(scorer)
    # The root must be initialised before any layer runs on its own (generation calls the model,
    # not the scorer): FSDP2 takes the first module to run forward as the root.
    scorer._get_fsdp_state()._lazy_init()
    return Wrapped(scorer, scorer, "fsdp2")


@contextlib.contextmanager
def generation(wrapped: Wrapped | None):
    """Generation with the bare model: under FSDP2 all parameters gathered (and kept gathered
    after each forward) for the duration, then resharded; nothing to do otherwise."""
    if wrapped is None or wrapped.parallel != "fsdp2":
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in wrapped.module.modules() if isinstance(m, FSDPModule)]
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in modules:
            m.reshard()
            # Layers reshard after forward (the default); the root never does (FSDP2's choice for
            # the root, which the scoring head outside its forward relies on).
            m.set_reshard_after_forward(m is not wrapped.module, recurse=False)


def row_masks(model, token_ids) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(sharded parameter, 0/1 mask) for the token-row tensors of ``model`` under FSDP2: gradient
    hooks on the original parameters do not survive sharding, so the rows of ``token_ids`` are
    zeroed in the synchronised gradient instead (:func:`apply_row_masks`)."""
    from torch.distributed.tensor import DTensor, distribute_tensor


    out = []
    for p in _token_row_tensors(model):
        if not p.requires_grad or not token_ids:
            continue
        if isinstance(p, DTensor):
            full = torch.ones(p.shape, dtype=p.dtype, device=p.to_local().device)
            full[list(token_ids)] = 0
            mask = distribute_tensor(full, p.device_mesh, p.placements)
        else:
            mask = torch.ones_like(p)
            mask[list(token_ids)] = 0
        out.append((p, mask))
    return out


def apply_row_masks(masks) -> None:
    for p, mask in masks:
        if p.grad is not None:
            p.grad.mul_(mask)


# ----------------------------------------------------------------------------------------------
# Checkpoints


def full_state_dict(wrapped: Wrapped, world: World) -> dict | None:
    """The student's full (unsharded) state dict, HF key names, on rank 0 (None elsewhere); a
    collective under FSDP2."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if wrapped.parallel == "fsdp2":
        state = get_model_state_dict(wrapped.scorer, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))
    else:
        state = wrapped.scorer.state_dict() if world.is_main else None
    if not world.is_main:
        return None
    # A tied weight (output head = input embedding) comes once, under its first name, as the
    # model's own state dict gives it to save_pretrained.
    every = {n for n, _ in wrapped.scorer.named_parameters(remove_duplicate=False)}
    tied = every - {n for n, _ in wrapped.scorer.named_parameters()}
    return {k.removeprefix("model."): v for k, v in state.items() if k not in tied}


def save_optimizer(wrapped: Wrapped, optimizer, folder: Path) -> None:
    """The student's optimiser state through torch.distributed.checkpoint (every rank writes its
    shard; replicated DDP state is written once)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = {"optimizer": get_optimizer_state_dict(wrapped.scorer, optimizer)}
    dcp.save(state, checkpoint_id=str(folder))


def load_optimizer(scorer, optimizer, folder: Path) -> None:
    """Load what :func:`save_optimizer` wrote into ``optimizer`` (over ``scorer``'s parameters),
    resharded to this world size when it differs."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    state = {"optimizer": get_optimizer_state_dict(scorer, optimizer)}
    dcp.load(state, checkpoint_id=str(folder))
    set_optimizer_state_dict(scorer, optimizer, optim_state_dict=state["optimizer"])
