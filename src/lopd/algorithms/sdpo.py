"""SDPO: self-distillation from an EMA teacher that reads a successful sibling of the same group.

Self-Distillation Policy Optimization ("Reinforcement Learning via Self-Distillation", Hübotter et
al., 2026, arXiv 2601.20802) as the LOPD paper runs it as a
baseline (DESIGN §3, "Baselines"). The trainer rolls out G = ``sdpo.num_generations`` rollouts of
each task side by side (a GRPO-style group). For the step's rollouts:

1. context: for each rollout, the compact trace (the bank's format,
   :meth:`lopd.agent.Rollout.compact_trace`) of the first *other* successful rollout of its group
   (:func:`sibling_sources`), as a demonstration block at the start of the teacher's first user
   message (``sdpo.placement``); the student's prompt never holds it. A rollout whose group has
   no other success gets no teacher signal (its tokens weigh 0) and is counted in
   ``sdpo/without_sibling``;
2. teacher: an EMA copy of the student (:class:`lopd.teacher.EMATeacher`), starting as the base
   model, scoring the student's own tokens with that context, without gradient;
3. student update: the generalised Jensen-Shannon divergence JSD_α between the student's and the
   teacher's top-k + tail reductions, per action token, averaged over the action tokens that have
   a teacher signal, all micro-batches and processes together;
4. teacher update: θ_T ← (1 − r) θ_T + r θ_S with r = ``sdpo.ema_rate``, once per training step,
   after the step's student update (one optimiser step: SDPO makes one pass over its batch) and
   only when that update was applied (``after_update``). So the teacher that scores step t's
   rollouts is the average of the students up to step t − 1: it never includes the update its
   own scores drive.

Settings taken from SDPO's public release (github.com/lasgroup/SDPO, read at commit 0e6d510:
``verl/trainer/config/actor/actor.yaml`` → ``self_distillation``, ``verl/trainer/config/sdpo.yaml``,
``verl/trainer/ppo/core_algos.py::compute_self_distillation_loss``,
``verl/trainer/ppo/ray_trainer.py::_get_solution``, ``verl/workers/actor/dp_actor.py``,
``experiments/generalization/run_sdpo_all.sh``):

* α = 0.5 (``sdpo.alpha``): ``alpha: 0.5`` in the actor config and ``ALPHAS=(0.5)`` in its sweep
  scripts, with its convention 0 = forward KL(teacher ‖ student), 1 = reverse KL, in between the
  generalised JSD with mixture (1 − α) p_S + α p_T (:func:`lopd.losses.generalized_jsd`, the same
  convention).
* top-k = 100 with a tail bucket (``sdpo.top_k``): ``distillation_topk: 100``,
  ``distillation_add_tail: True``. The support is the *student's* top-k (its actor computes the
  student's top-k indices and gathers the teacher's log-probs at them), so
  :func:`lopd.losses.jsd_top_k` runs with ``support_from="student"``. Its tail is
  log(1 − Σ top-k) with a clamp; ours is the log-sum-exp of the tokens outside the support, the
  same quantity without the cancellation (:mod:`lopd.losses`).
* EMA rate 0.05 (``teacher_regularization: ema``, ``teacher_update_rate: 0.05``), the teacher a
  separate copy. The release moves it once per policy update, not per optimiser step:
  ``dp_actor.update_policy`` scores with the teacher as it is, runs its mini-batch optimiser
  steps, and calls ``_update_teacher()`` once at the end when at least one step had a finite
  gradient norm. With ``train_batch_size`` = ``ppo_mini_batch_size`` = 32 and one epoch there is
  one optimiser step per batch, and lopd follows that: one move per training step, after its one
  update, none when the update was skipped as non-finite.
* Success filter: its ``success_reward_threshold: 0.5`` on rewards that are 0 or 1, i.e. a
  solved task. Here the environment's success (every check / every test passes) decides, not a
  reward threshold: toolworld's fractional reward gives a random agent 0.53, which a 0.5
  threshold would count as solved.
* The sibling excludes the rollout itself (``dont_reprompt_on_self_success: True``) and is the
  *first* other success of the group in rollout order, as ``_get_solution`` takes
  ``solution_idxs[0]``: the rollouts of a group are independent samples, so the first is as good as
  a random one, and it is deterministic. (Not the best reward: every success has reward 1.)
* Loss averaging: token mean over the tokens with a teacher signal (its ``loss_agg_mode:
  token-mean`` over ``response_mask · self_distillation_mask``).
* The IS weight (``is_clip: 2``): the release multiplies each token's loss by
  min(π_θ / π_old, 2), detached, with π_old the policy that scored the batch before the update.
  It runs one update per batch of rollouts (``ppo_mini_batch_size`` = the batch), where that
  ratio is exactly 1, and so does this baseline: the weight is 1 and is left out. The trainer's
  rollout-correction weights (``rollout_is: token``) correct a sampler that is not the trainer's
  policy; lopd's engines sample from the student itself at T = 1 (refused otherwise at start-up).
* Not taken: the release's environment-feedback reprompting (``include_environment_feedback``),
  since the comparison gives SDPO successful siblings only ("a group with no success gives no
  teacher signal", DESIGN §3), and its prompt layout, which appends the solution after the
  question with "Correctly solve the original question."; here the demonstration sits in the
  block every text teacher of this library uses (:func:`lopd.teacher.text_view`).

The siblings are the step's own training rollouts: SDPO samples nothing else, so
:meth:`setup_rollouts` is 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from lopd import losses
from lopd.algorithms import register
from lopd.algorithms.base import (
    Algorithm,
    EMATeacherMethod,
    LossTerms,
    MicroBatch,
    Panel,
    Scores,
    StepBatch,
    Totals,
    distillation_loss,
)
from lopd.config import ConfigError, knob
from lopd.teacher import text_view

SIBLING_PREFIX = "A successful attempt at this task, as a demonstration:\n"
"""Framing of the sibling's trace in the teacher's prompt."""


@dataclass
class SDPOConfig:
    """SDPO: an EMA self-teacher conditioned on a successful sibling rollout of the same group,
    generalised JSD over the student's top-k + tail."""

    num_generations: int = knob(4, "Rollouts per task in one step (the group size G, the paper's "
                                "4); a rollout's teacher reads another success of its group, so "
                                "G must be at least 2.", ge=1)
    ema_rate: float = knob(0.05, "After each applied student update the teacher moves by "
                           "θ_T ← (1 − r) θ_T + r θ_S (SDPO's teacher_update_rate 0.05).",
                           gt=0.0, le=1.0)
    alpha: float = knob(0.5, "α of the generalised JSD: 0 forward KL(teacher ‖ student), 1 reverse "
                        "KL, in between the JSD with mixture (1 − α) p_S + α p_T (SDPO's 0.5).",
                        ge=0.0, le=1.0)
    top_k: int = knob(100, "The student's most likely tokens kept per position, the rest one tail "
                      "bucket (SDPO's distillation_topk 100 with its tail).", ge=1)
    placement: Literal["user", "system"] = knob(
        "user", "Where the sibling's trace goes in the teacher's prompt: 'user' a block at the "
        "start of the first user message, 'system' the end of the system message.")

    def __post_init__(self) -> None:
        if self.num_generations < 2:
            raise ConfigError(f"sdpo.num_generations: got {self.num_generations}; SDPO's teacher "
                              "reads another successful rollout of the same group, so it needs at "
                              "least 2 rollouts per task")


def sibling_sources(successes: Sequence[bool], group_size: int) -> list[int | None]:
    """For each rollout, the index of the rollout whose trace its teacher reads: the first
    successful rollout of its group (consecutive runs of ``group_size``) other than itself, or
    None when its group has no other success."""
    if len(successes) % group_size:
        raise ValueError(f"{len(successes)} rollouts do not split into groups of {group_size}")
    sources: list[int | None] = []
    for i in range(len(successes)):
        start = i - i % group_size
        others = [j for j in range(start, start + group_size) if j != i and successes[j]]
        sources.append(others[0] if others else None)
    return sources


@register
class SDPO(EMATeacherMethod, Algorithm):
    name = "sdpo"
    config_class = SDPOConfig

    @classmethod
    def group_size_in(cls, cfg) -> int:
        return cfg.sdpo.num_generations

    def __init__(self, ctx, checkpoint: Path | None):
        super().__init__(ctx, checkpoint)
        self.spec = ctx.cfg.sdpo
        self.max_observation_chars = ctx.cfg.bank.max_observation_chars
        ema = self.init_ema(self.spec.ema_rate, checkpoint)
        self.teacher = text_view(ema.model, ctx.tokenizer, self.spec.placement, SIBLING_PREFIX)

    def before_step(self, batch: StepBatch) -> dict:
        size = self.group_size
        for start in range(0, len(batch.tasks), size):
            if len({t.task_id for t in batch.tasks[start:start + size]}) != 1:
                raise RuntimeError(f"sdpo: rollouts {start}..{start + size - 1} are not one group "
                                   "of the same task")
        rollouts = batch.rollouts
        sources = sibling_sources([r.success for r in rollouts], size)
        context = [[rollouts[j].compact_trace(self.max_observation_chars)] if j is not None else []
                   for j in sources]
        signal = torch.tensor([j is not None for j in sources], dtype=torch.float32)
        tokens = {"signal_tokens": float(sum(sum(r.action_mask)
                                             for r, j in zip(rollouts, sources) if j is not None))}
        if self.world.enabled:
            tokens = self.world.sum(tokens)
        return {"teacher_context": context, "signal": signal.to(self.device),
                "signal_tokens": int(round(tokens["signal_tokens"])),
                "without_sibling": 1.0 - signal.mean().item(), "ema_mark": self.ema_mark()}

    def loss(self, micro: MicroBatch, scores: Scores, state: dict, totals: Totals) -> LossTerms:
        alpha, top_k = self.spec.alpha, self.spec.top_k
        weights = micro.take(state["signal"])[scores.student.rows]
        return distillation_loss(
            lambda student, teacher: losses.jsd_top_k(student, teacher, alpha, top_k, "student"),
            scores, totals, token_weights=weights, denominator=state["signal_tokens"])

    def after_update(self, batch: StepBatch, state: dict, figures: dict) -> dict:
        return {**self.ema_follow(state["ema_mark"]),
                "sdpo/without_sibling": state["without_sibling"]}

    def panels(self) -> list[Panel]:
        return [Panel("JSD_α(student, teacher), top-k + tail", ("kl",)),
                Panel("share of rollouts without a successful sibling",
                      ("sdpo/without_sibling",)),
                Panel("teacher's gain on the actions (nats/token)", ("teacher_gain",))]
