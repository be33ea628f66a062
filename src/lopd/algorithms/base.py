"""The algorithm interface and the shared step every method runs on.

A method declares three things and nothing else:

(a) its **teacher view** (:attr:`Algorithm.teacher`): how a teacher sees the student's rollout —
    ``None`` (no teacher: GRPO), a latent context (LOPD), a text context, or other weights (a frozen
    reference, an EMA copy); see :mod:`lopd.teacher`;
(b) its **loss** (:meth:`Algorithm.loss`) on the action-token scores of one micro-batch, returned
    as each optimiser's share of its loss (:class:`LossTerms`);
(c) **hooks**: :meth:`Algorithm.before_step` (e.g. retrieval, advantages) and
    :meth:`Algorithm.after_update` (e.g. a dual variable, bank growth, an EMA update).

The shared :meth:`SharedStep.step` does the rest once: it splits the step's rollouts into
micro-batches of ``per_device_train_batch_size``, scores the student and the teacher on each,
back-propagates each micro-batch's share of the loss (gradients accumulate), then clips and steps
every optimiser (skipping non-finite updates) and sums the metrics. Losses are normalised by the
*step's* totals (:class:`Totals`: action tokens, rollouts), never by a micro-batch's, so any
micro-batch size gives the same update as one pass over the whole step.
"""

from __future__ import annotations

import contextlib
import time
from abc import abstractmethod
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from lopd.agent import Rollout
from lopd.config import ConfigError
from lopd.distributed import SINGLE
from lopd.envs.environment import Task
from lopd.runtime import autocast
from lopd.teacher import (
    DEFAULT_CHUNK_TOKENS,
    ActionLogits,
    EMATeacher,
    TeacherView,
    action_logits,
    per_token,
    scoring_batch,
)


@dataclass
class StepBatch:
    """One step's on-policy data: ``rollouts[i]`` is the student's episode on ``tasks[i]``."""

    step: int
    tasks: list[Task]
    rollouts: list[Rollout]
    context: list | None = None
    """Per-rollout privileged context a caller prepared (the cold start's retrieved traces)."""

    @property
    def rewards(self) -> torch.Tensor:
        return torch.tensor([r.reward for r in self.rollouts], dtype=torch.float32)


@dataclass(frozen=True)
class Totals:
    """The whole step's counts, by which every micro-batch's loss share is divided."""

    action_tokens: int
    rollouts: int
    rollouts_with_actions: int

    @classmethod
    def of(cls, rollouts: Sequence[Rollout]) -> Totals:
        tokens = [sum(r.action_mask) for r in rollouts]
        return cls(sum(tokens), len(rollouts), sum(1 for t in tokens if t > 0))


@dataclass
class MicroBatch:
    """A slice of the step: ``rollouts`` are the step's rows ``indices``."""

    index: int
    indices: list[int]
    rollouts: list[Rollout]

    def take(self, values: Sequence | torch.Tensor) -> list | torch.Tensor:
        """The entries of a per-rollout sequence (or tensor) that belong to this micro-batch."""
        if isinstance(values, torch.Tensor):
            return values[self.indices[0]:self.indices[-1] + 1]
        return [values[i] for i in self.indices]


@dataclass
class Scores:
    """One micro-batch scored at its action tokens: the student (with its graph) and the teacher
    view's scores (``extras``: whatever the view computed on the way, e.g. LOPD's latents)."""

    student: ActionLogits | None
    teacher: ActionLogits | None
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass
class LossTerms:
    """A micro-batch's contribution: per optimiser (by name, see :meth:`SharedStep.updaters`) its
    share of that optimiser's loss, already divided by the step's totals; and metrics, each this
    micro-batch's share of the step's figure (the shared step sums them)."""

    losses: dict[str, torch.Tensor]
    metrics: dict[str, float | torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class Panel:
    """One panel of the run's plot: metric keys drawn against generations, and optional guide."""

    title: str
    keys: tuple[str, ...]
    hline: float | None = None
    hline_label: str = ""


class Updater:
    """One AdamW optimiser over some parameters: gradients accumulate over micro-batches, then
    :meth:`finish` clips and steps.

    An update whose loss or gradient norm is not finite is skipped (weights and optimiser state
    untouched) and counted in :attr:`skipped`. An updater with a ``gate`` (another updater of the
    same step) is also skipped when its gate's update of the step was: LOPD's composer follows the
    student, whose skipped update leaves no consistent student side for the composer's loss.
    """

    def __init__(self, params, learning_rate: float, max_grad_norm: float, weight_decay: float = 0.0,
                 gate: Updater | None = None):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("nothing to optimise: no parameter requires a gradient")
        self.optimizer = torch.optim.AdamW(self.params, lr=learning_rate, weight_decay=weight_decay)
        self.max_grad_norm = max_grad_norm
        self.gate = gate
        self.skipped = 0
        self.last_skipped = False
        """Whether the latest :meth:`finish` skipped its update."""
        self.wrapped = False
        """True when a DDP / FSDP2 wrapper synchronises these gradients in backward; otherwise the
        distributed step sums them over ranks itself (:meth:`lopd.distributed.World.sum_grads`)."""
        self.grad_filters: list = []
        """Callables run on the synchronised gradients before clipping (FSDP2's frozen rows)."""

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def finish(self, loss: float) -> dict[str, float]:
        """Clip the accumulated gradient and step, unless ``loss`` or the norm is not finite."""
        for fn in self.grad_filters:
            fn()
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor
            norm = norm.full_tensor()
        gated = self.gate is not None and self.gate.last_skipped
        self.last_skipped = gated or not (torch.isfinite(norm) and torch.isfinite(torch.tensor(loss)))
        if self.last_skipped:
            self.zero_grad()
            self.skipped += 1
            return {"grad_norm": float(norm), "skipped": 1.0}
        self.optimizer.step()
        return {"grad_norm": float(norm), "skipped": 0.0}

    def apply(self, loss: torch.Tensor) -> dict[str, float]:
        """One whole update from one loss: zero, backward, clip, step."""
        self.zero_grad()
        loss.backward()
        return self.finish(loss.item())

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.skipped = state["skipped"]


def micro_batches(rollouts: Sequence[Rollout], size: int) -> list[MicroBatch]:
    """Consecutive slices of ``size`` rollouts (0 = one slice holding all)."""
    size = size or len(rollouts)
    return [MicroBatch(k, list(range(i, min(i + size, len(rollouts)))),
                       list(rollouts[i:i + size]))
            for k, i in enumerate(range(0, len(rollouts), size))]


class SharedStep:
    """The default step: micro-batched scoring, accumulated gradients, one update per optimiser.

    Subclasses set :attr:`student` (a model scored on the rollouts, or None), :attr:`teacher`,
    :attr:`micro_batch_size`, :attr:`device`, :attr:`pad_id` and implement :meth:`updaters` and
    :meth:`loss`.
    """

    teacher: TeacherView | None = None
    student: torch.nn.Module | None = None
    micro_batch_size: int = 0
    precision: str = "fp32"
    """'fp32' or 'bf16-mixed': scoring and losses run under bf16 autocast in the latter."""
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    """Action tokens whose vocabulary-sized log-probs are computed at once (train.loss_chunk_tokens)."""
    passes: int = 1
    """Update passes over the same batch (GRPO's μ); each pass is a full micro-batched update."""
    world = SINGLE
    """The training processes (:mod:`lopd.distributed`); one process unless torchrun started more."""
    wrapped = None
    """The student's wrapped scoring module (:class:`lopd.distributed.Wrapped`) under DDP / FSDP2."""

    def updaters(self) -> dict[str, Updater]:
        raise NotImplementedError

    def before_step(self, batch: StepBatch) -> dict[str, Any]:
        """Work done once per step before scoring (retrieval, advantages); returns the step state
        handed to :meth:`score`, :meth:`loss` and :meth:`after_update`."""
        return {}

    @abstractmethod
    def loss(self, micro: MicroBatch, scores: Scores, state: dict[str, Any],
             totals: Totals) -> LossTerms:
        """This micro-batch's share of each optimiser's loss (see :class:`LossTerms`)."""

    def after_update(self, batch: StepBatch, state: dict[str, Any],
                     figures: dict[str, float]) -> dict[str, float]:
        """Work after the optimisers stepped (dual variable, bank, EMA); returns extra metrics."""
        return {}

    def score(self, micro: MicroBatch, state: dict[str, Any]) -> Scores:
        """The student's scores (with graph) and the teacher view's on one micro-batch."""
        rollouts = micro.rollouts
        clock = time.perf_counter()
        student = None
        if self.student is not None:
            batch = scoring_batch([r.input_ids for r in rollouts], [r.action_mask for r in rollouts],
                                  self.pad_id).to(self.device)
            student = action_logits(self.student, batch, chunk_tokens=self.chunk_tokens,
                                    scorer=self.wrapped)
        state["_times"]["time/student_forward"] += time.perf_counter() - clock
        clock = time.perf_counter()
        teacher, extras = None, {}
        if self.teacher is not None:
            cache = state.setdefault("_teacher_cache", {})
            if self.teacher.frozen and micro.index in cache:
                teacher, extras = cache[micro.index]
            else:
                context = state.get("teacher_context")
                teacher, extras = self.teacher.score(
                    rollouts, micro.take(context) if context is not None else None)
                # A view's own timings (its parts of the teacher phase) go to the step's times.
                for key in [k for k in extras if k.startswith("time/")]:
                    state["_times"][key] += extras.pop(key)
                if self.teacher.frozen:
                    cache[micro.index] = (teacher, extras)
            if student is not None and not torch.equal(student.targets, teacher.targets):
                raise RuntimeError("teacher and student action tokens do not line up")
            teacher.chunk_tokens = self.chunk_tokens
        state["_times"]["time/teacher"] += time.perf_counter() - clock
        return Scores(student, teacher, extras)

    def step(self, batch: StepBatch) -> dict[str, float]:
        """One update of every optimiser from ``batch``; returns the step's metrics."""
        clock = time.perf_counter()
        state = self.before_step(batch)
        times = state["_times"] = defaultdict(float)
        times["time/before_step"] = time.perf_counter() - clock
        totals = Totals.of(batch.rollouts)
        if self.world.enabled:
            # Every rank divides by the global batch's totals (its rollouts are a shard of it).
            totals = Totals(**{k: int(round(v)) for k, v in self.world.sum(vars(totals)).items()})
        updaters = self.updaters()
        figures: dict[str, float] = {}
        for state["pass"] in range(self.passes):
            figures = self._update(batch, state, totals, updaters)
        clock = time.perf_counter()
        after = self.after_update(batch, state, figures)
        # Identical figures stay identical; per-rollout means of equal shards become global means.
        figures.update(self.world.mean(after) if self.world.enabled else after)
        times["time/after_update"] = time.perf_counter() - clock
        micro = self.micro_batch_size or len(batch.rollouts)
        return {**figures, "action_tokens": totals.action_tokens,
                "micro_batches": -(-len(batch.rollouts) // micro), **dict(times)}

    def _update(self, batch: StepBatch, state: dict, totals: Totals,
                updaters: dict[str, Updater]) -> dict[str, float]:
        for updater in updaters.values():
            updater.zero_grad()
        loss_values: dict[str, float] = defaultdict(float)
        metrics: dict[str, float] = defaultdict(float)
        micros = micro_batches(batch.rollouts, self.micro_batch_size)
        world = self.world
        for micro in micros:
            with autocast(self.precision, self.device):
                scores = self.score(micro, state)
                terms = self.loss(micro, scores, state, totals)
            unknown = set(terms.losses) - set(updaters)
            if unknown:
                raise RuntimeError(f"{type(self).__name__}.loss returned losses for "
                                   f"{sorted(unknown)}, which have no optimiser")
            clock = time.perf_counter()
            # A wrapper averages its gradients over ranks: scale its loss so that they sum.
            graph = [t * world.grad_scale if world.enabled and updaters[name].wrapped else t
                     for name, t in terms.losses.items() if t.requires_grad]
            if graph:
                sync = self.wrapped.no_sync(micro is not micros[-1]) if self.wrapped is not None \
                    else contextlib.nullcontext()
                with sync:
                    torch.stack([t.reshape(()) for t in graph]).sum().backward()
            state["_times"]["time/backward"] += time.perf_counter() - clock
            for name, value in terms.losses.items():
                loss_values[name] += value.item()
            for name, value in terms.metrics.items():
                metrics[name] += float(value)
        clock = time.perf_counter()
        if world.enabled:
            # Shares of the global figures: their sums over ranks are the step's figures.
            metrics = world.sum(metrics)
            loss_values = defaultdict(float, world.sum(loss_values))
            for updater in updaters.values():
                if not updater.wrapped:
                    world.sum_grads(updater.params)
        figures = dict(metrics)
        # Gated updaters finish after the others: their gate's verdict on this step must be in.
        for name, updater in sorted(updaters.items(), key=lambda item: item[1].gate is not None):
            result = updater.finish(loss_values[name])
            figures[f"{name}/grad_norm"] = result["grad_norm"]
            figures[f"{name}/skipped_updates"] = updater.skipped
        state["_times"]["time/optimizer"] += time.perf_counter() - clock
        return figures


class Algorithm(SharedStep):
    """A training method on the shared loop (:mod:`lopd.trainer`); see the module docstring."""

    name: ClassVar[str] = ""
    config_class: ClassVar[type | None] = None
    """Dataclass of the method's config section (``cfg.<name>``), or None for none."""
    group_size: int = 1
    """Rollouts per task in one step (GRPO-style groups; 1 = every rollout a different task); a
    method whose group size is a setting overrides :meth:`group_size_in`."""

    @classmethod
    def group_size_in(cls, cfg) -> int:
        """The group size this method has under ``cfg``, known before anything is built (the
        trainer checks ``train.rollouts_per_step`` against it before writing the run folder)."""
        return cls.group_size

    @classmethod
    def check_config(cls, cfg, world, fresh: bool) -> None:
        """Refuse a config this method cannot start from, before anything is built or written:
        checks of the config and of the paths it names, never of a loaded model. The trainer
        calls it before the run folder is touched, so a refused ``lopd train --out DIR`` leaves
        DIR as it was; ``__init__`` may take it as passed. ``world``: the training processes;
        ``fresh``: a new run (a resumed one reads its inputs from the checkpoint)."""

    def __init__(self, ctx, checkpoint: Path | None):
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.group_size = self.group_size_in(ctx.cfg)
        self.student = ctx.student
        self.device = ctx.device
        self.pad_id = ctx.tokenizer.pad_token_id
        self.micro_batch_size = ctx.cfg.train.per_device_train_batch_size
        self.precision = ctx.precision
        self.chunk_tokens = ctx.cfg.train.loss_chunk_tokens
        self.world = getattr(ctx, "world", SINGLE)
        self.wrapped = getattr(ctx, "wrapped", None)

    def updaters(self) -> dict[str, Updater]:
        return {"student": self.ctx.student_updater}

    def setup_rollouts(self) -> int:
        """Rollouts this method consumed before training (building a bank, sampling for a cold
        start, a skill library...): charged with the training rollouts in every comparison."""
        return 0

    def panels(self) -> list[Panel]:
        """Extra plot panels for this method's metrics."""
        return []

    def state_dict(self) -> dict:
        """Tensors and numbers to resume from (optimisers, dual variables, ...)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def save(self, folder: Path) -> None:
        """Write artefacts that are not plain state (a composer, a bank) into ``folder``."""


# ----------------------------------------------------------------------------------------------
# Pieces the self-distillation methods share


def distillation_loss(divergence, scores: Scores, totals: Totals,
                      token_weights: torch.Tensor | None = None,
                      denominator: int | None = None) -> LossTerms:
    """The student's share of a distillation loss: ``divergence(student_logprobs,
    teacher_logprobs)`` per action token (full-vocabulary log-probs, chunked by
    :func:`lopd.teacher.per_token`; the teacher detached), times ``token_weights`` (N,) when
    given (0 for tokens without a teacher signal, importance weights...), summed over this
    micro-batch and divided by ``denominator`` (default: the step's action tokens; pass the step's
    count of weighted tokens for a mean over those). Metrics: ``kl`` (that loss) and
    ``teacher_gain``, the mean of log π_T(a) − log π_S(a) over all actions taken: how much more the
    teacher, with its privileged context, expects what the student did."""

    def terms(student_lp, teacher_lp, targets):
        picked = targets.unsqueeze(-1)
        return (divergence(student_lp, teacher_lp.detach()),
                (teacher_lp.gather(-1, picked) - student_lp.detach().gather(-1, picked)).squeeze(-1))

    per_token_loss, gain = per_token(terms, scores.student, scores.teacher)
    if token_weights is not None:
        per_token_loss = per_token_loss * token_weights.detach().to(per_token_loss.dtype)
    loss = per_token_loss.sum() / max(1, totals.action_tokens if denominator is None
                                      else denominator)
    return LossTerms({"student": loss}, {"kl": loss.detach(),
                                         "teacher_gain": gain.sum() / max(1, totals.action_tokens)})


def require_unsharded(name: str, world, what: str) -> None:
    """Refuse FSDP2 at start-up (from :meth:`Algorithm.check_config`) for method ``name`` that
    keeps ``what`` (e.g. an EMA copy) beside the student: the copy would need the full, unsharded
    weights on every rank."""
    if world.enabled and world.parallel == "fsdp2":
        raise ConfigError(f"{name} keeps {what} next to the student, which "
                          "train.parallel=fsdp2 shards; use train.parallel=ddp")


class EMATeacherMethod:
    """For a method whose teacher is an EMA copy of the student (SDFT, SDPO); mix in before
    :class:`Algorithm`. :meth:`init_ema` makes the copy (or restores it from the checkpoint);
    :meth:`ema_follow` moves it after a student update that was applied (a skipped, non-finite
    update moves neither); its weights and update count are part of every checkpoint."""

    EMA_DIR = "ema_teacher"

    @classmethod
    def check_config(cls, cfg, world, fresh: bool) -> None:
        require_unsharded(cls.name, world, "a full EMA copy of the student")
        super().check_config(cfg, world, fresh)

    def init_ema(self, rate: float, checkpoint: Path | None):
        # The student as loaded: the base model at step 0, the checkpoint's student on resume,
        # whose EMA then comes from the checkpoint.
        self.ema = EMATeacher(self.ctx.student, rate)
        if checkpoint is not None:
            self.ema.load(checkpoint / self.EMA_DIR)
        self.ema_updates = 0
        return self.ema

    def ema_mark(self) -> int:
        """Taken in ``before_step``: the student updater's skip count before the update."""
        return self.ctx.student_updater.skipped

    def ema_follow(self, mark: int) -> dict:
        """In ``after_update``: one EMA step if the student's update was applied."""
        if self.ctx.student_updater.skipped == mark:
            self.ema.update()
            self.ema_updates += 1
        return {"ema/updates": self.ema_updates}

    def state_dict(self) -> dict:
        return {"ema_updates": self.ema_updates}

    def load_state_dict(self, state: dict) -> None:
        self.ema_updates = state["ema_updates"]

    def save(self, folder: Path) -> None:
        self.ema.save(folder / self.EMA_DIR)
