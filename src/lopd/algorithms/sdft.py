"""SDFT: on-policy self-distillation from an EMA teacher that reads the task's oracle demonstration.

Self-Distillation Fine-Tuning (Shenfeld et al., 2026) as the LOPD paper runs it as a baseline
(DESIGN §3, "Baselines"). For the step's student rollouts:

1. context: the oracle trajectory of each rollout's task — the environment's reference solution
   replayed and rendered as the compact trace the experience bank stores
   (:meth:`lopd.envs.environment.Environment.oracle_trace`) — as a textual demonstration in a
   block at the start of the teacher's first user message (``sdft.placement``); the student's
   prompt never holds it;
2. teacher: an EMA copy of the student (:class:`lopd.teacher.EMATeacher`), starting as the base
   model, scoring the student's own tokens with that context, without gradient;
3. student update: forward KL(teacher ‖ student) over the teacher's top-M tokens plus a tail
   bucket, mean over the step's action tokens;
4. teacher update: θ_T ← (1 − α) θ_T + α θ_S with α = ``sdft.ema_rate`` (0.01, the paper's).

Settings and where they come from:

* Forward KL: the LOPD paper's description of this baseline. SDFT's own paper minimises the reverse
  KL(student ‖ teacher); set by the comparison being reproduced, not by SDFT's release.
* Top-M + tail, M = ``sdft.top_m`` = 20: neither paper gives this baseline's support; M is LOPD's
  so that both distillation losses see supports of the same size (M ≥ the vocabulary is the full
  forward KL).
* The EMA moves after each student update that was applied; an update skipped as non-finite
  leaves the teacher where it was too (SDPO's release does the same with its EMA teacher).
* The oracle traces of all training tasks are rendered at start-up: an environment without oracle
  trajectories, or a training set holding a task that may not give its oracle out, fails there.
  A validation-mode run's validation tasks are not training tasks; they are never asked for.
* Oracle replays are not model rollouts: :meth:`setup_rollouts` is 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

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
from lopd.config import knob
from lopd.envs.environment import OracleTraces
from lopd.teacher import text_view

DEMONSTRATION_PREFIX = "A correct solution of this task, as a demonstration:\n"
"""Framing of the demonstration block (followed by the oracle's compact trace)."""


@dataclass
class SDFTConfig:
    """SDFT: an EMA self-teacher conditioned on the task's oracle trajectory, forward KL."""

    ema_rate: float = knob(0.01, "α_EMA: after each student update the teacher moves by "
                           "θ_T ← (1 − α) θ_T + α θ_S (the paper's 0.01).", gt=0.0, le=1.0)
    top_m: int = knob(20, "M: the teacher's most likely tokens kept per position in the forward "
                      "KL; the rest is one tail bucket (LOPD's M; no paper gives SDFT's).", ge=1)
    placement: Literal["user", "system"] = knob(
        "user", "Where the demonstration goes in the teacher's prompt: 'user' a block at the "
        "start of the first user message (a textual demonstration), 'system' the end of the "
        "system message.")


@register
class SDFT(EMATeacherMethod, Algorithm):
    name = "sdft"
    config_class = SDFTConfig

    def __init__(self, ctx, checkpoint: Path | None):
        super().__init__(ctx, checkpoint)
        self.spec = ctx.cfg.sdft
        self.oracle = OracleTraces(ctx.env, ctx.train_tasks.values(), self.name,
                                   ctx.cfg.bank.max_observation_chars)
        ema = self.init_ema(self.spec.ema_rate, checkpoint)
        self.teacher = text_view(ema.model, ctx.tokenizer, self.spec.placement, DEMONSTRATION_PREFIX)

    def before_step(self, batch: StepBatch) -> dict:
        return {"teacher_context": [[trace] for trace in self.oracle(batch.tasks)],
                "ema_mark": self.ema_mark()}

    def loss(self, micro: MicroBatch, scores: Scores, state: dict, totals: Totals) -> LossTerms:
        top_m = self.spec.top_m
        return distillation_loss(
            lambda student, teacher: losses.forward_kl_top_m(student, teacher, top_m),
            scores, totals)

    def after_update(self, batch: StepBatch, state: dict, figures: dict) -> dict:
        return self.ema_follow(state["ema_mark"])

    def panels(self) -> list[Panel]:
        return [Panel("forward KL(teacher ‖ student), top-M + tail", ("kl",)),
                Panel("teacher's gain on the actions (nats/token)", ("teacher_gain",))]

