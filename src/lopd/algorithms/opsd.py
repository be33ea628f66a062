"""OPSD: on-policy self-distillation from the frozen base reading the oracle trajectory as
system-message privileged context.

On-Policy Self-Distillation as the LOPD paper runs it as a baseline (DESIGN §3, "Baselines"). For
the step's student rollouts:

1. context: the oracle trajectory of each rollout's task (the environment's reference solution as
   the compact trace the bank stores, :meth:`lopd.envs.environment.Environment.oracle_trace`),
   appended to the teacher's system message (``opsd.placement``); the student never sees it;
2. teacher: the frozen base model θ0 (loaded once, never updated), scoring the student's own
   tokens with that context, without gradient;
3. student update: forward KL(teacher ‖ student) over the *full* vocabulary, computed
   ``train.loss_chunk_tokens`` action tokens at a time (:func:`lopd.teacher.per_token`), mean over
   the step's action tokens.

This follows the LOPD paper's OPSD baseline (DESIGN §3: "frozen teacher with the oracle
trajectory as system-message privileged context; forward KL over the full vocabulary"), not the
defaults of OPSD's own release (github.com/siyan-zhao/OPSD, read at commit 590ec26:
``scripts/run_opsd.sh``, ``opsd_trainer.py::generalized_jsd_loss``, ``data_collator.py``). The
release also keeps the teacher frozen (the base with the LoRA adapter off, ``--fixed_teacher``) and
distils over the full vocabulary, but with the generalised JSD at β = 0.5 (``--beta 0.5``; mixture
(1 − β) p_S + β p_T) and with the reference solution written into the teacher's one user message,
after the problem. Its β = 0 is exactly the loss here (:func:`lopd.losses.forward_kl_full`, the
convention of :func:`lopd.losses.generalized_jsd`). Why the paper's form: lopd reproduces the
paper's comparison, so the baseline is the one the paper reports, and every text teacher of this
library carries its context in the same block (:func:`lopd.teacher.text_view`);
``opsd.placement=user`` moves that block into the first user message, the release's message
(there at its start, where the release writes the solution after the problem).

The teacher never changes, so its scores are computed once per micro-batch and step. Oracle traces
of every training task are rendered at start-up (an environment without them fails there, as in
SDFT); replays are not model rollouts, so :meth:`setup_rollouts` is 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from lopd import losses, stages
from lopd.algorithms import register
from lopd.algorithms.base import (
    Algorithm,
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

PRIVILEGED_PREFIX = "Privileged information — a reference solution of the user's task:\n"
"""Framing of the privileged context (followed by the oracle's compact trace)."""


@dataclass
class OPSDConfig:
    """OPSD: the frozen base conditioned on the oracle trajectory, full-vocabulary forward KL."""

    placement: Literal["system", "user"] = knob(
        "system", "Where the oracle trajectory goes in the teacher's prompt: 'system' the end of "
        "the system message (the paper's privileged system context), 'user' a block at the start "
        "of the first user message.")


@register
class OPSD(Algorithm):
    name = "opsd"
    config_class = OPSDConfig

    def __init__(self, ctx, checkpoint: Path | None):
        super().__init__(ctx, checkpoint)
        self.spec = ctx.cfg.opsd
        self.oracle = OracleTraces(ctx.env, ctx.train_tasks.values(), self.name,
                                   ctx.cfg.bank.max_observation_chars)
        # θ0: the configured base model, not the (possibly resumed) student.
        base, _ = stages.load_model(ctx.cfg, device=ctx.device)
        self.teacher = text_view(base.requires_grad_(False), ctx.tokenizer, self.spec.placement,
                                 PRIVILEGED_PREFIX)

    def before_step(self, batch: StepBatch) -> dict:
        return {"teacher_context": [[trace] for trace in self.oracle(batch.tasks)]}

    def loss(self, micro: MicroBatch, scores: Scores, state: dict, totals: Totals) -> LossTerms:
        return distillation_loss(losses.forward_kl_full, scores, totals)

    def panels(self) -> list[Panel]:
        return [Panel("forward KL(teacher ‖ student), full vocabulary", ("kl",)),
                Panel("teacher's gain on the actions (nats/token)", ("teacher_gain",))]
