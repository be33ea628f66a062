"""GRPO: group-normalised advantages and token-level PPO-clip, from rewards only (no teacher).

The trainer runs ``grpo.num_generations`` (G) rollouts of each task side by side; each rollout's
advantage is its reward minus the group's mean over the group's std, given to every action token of
the rollout. The student minimises the PPO-clip loss (ε_lo = ``grpo.epsilon``, ε_hi =
``grpo.epsilon_high``) averaged over all action tokens of the batch, ``grpo.num_iterations`` (μ)
times per batch. With one iteration the "old" policy is the current one (ratio 1, gradient of
A·log π); with more, the old log-probs are those of the first pass, kept fixed. ``grpo.beta`` > 0
adds the k3 estimate of KL(π ‖ π_ref) to the frozen base, per token: the reference is this
method's teacher view (other weights, no gradient).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from lopd import losses
from lopd.algorithms import register
from lopd.algorithms.base import Algorithm, LossTerms, MicroBatch, Panel, Scores, StepBatch, Totals
from lopd.config import knob
from lopd.teacher import OtherWeights


@dataclass
class GRPOConfig:
    """GRPO's knobs (TRL's names)."""

    num_generations: int = knob(4, "Rollouts per task in one step (the group size G).", ge=1)
    beta: float = knob(0.0, "Coefficient of the KL-to-reference penalty (0 disables it).", ge=0.0)
    num_iterations: int = knob(1, "Policy updates per batch of rollouts (μ); > 1 keeps the first "
                               "pass's log-probs as the old policy.", ge=1)
    epsilon: float = knob(0.2, "Lower PPO clip range: ratios below 1 - epsilon are clipped.",
                          gt=0.0, lt=1.0)
    epsilon_high: float = knob(0.2, "Upper PPO clip range: ratios above 1 + epsilon_high are "
                               "clipped.", gt=0.0)


@register
class GRPO(Algorithm):
    name = "grpo"
    config_class = GRPOConfig

    def __init__(self, ctx, checkpoint: Path | None):
        super().__init__(ctx, checkpoint)
        spec = self.spec = ctx.cfg.grpo
        self.group_size = spec.num_generations
        self.passes = spec.num_iterations
        if spec.beta > 0:
            from lopd import pipeline

            reference, _ = pipeline.load_model(ctx.cfg, device=ctx.device)
            self.teacher = OtherWeights(reference.requires_grad_(False), self.pad_id)

    def before_step(self, batch: StepBatch) -> dict:
        rewards = batch.rewards.to(self.device)
        return {"advantages": losses.group_advantages(rewards, self.group_size), "old": {}}

    def loss(self, micro: MicroBatch, scores: Scores, state: dict, totals: Totals) -> LossTerms:
        spec = self.spec
        logprobs = scores.student.token_logprobs()
        old = state["old"].setdefault(micro.index, logprobs.detach())
        token_adv = micro.take(state["advantages"])[scores.student.rows]
        per_token = losses.ppo_clip(logprobs, old, token_adv, spec.epsilon, spec.epsilon_high)
        n = totals.action_tokens
        kl = torch.zeros((), device=logprobs.device)
        if scores.teacher is not None:
            log_ratio = scores.teacher.token_logprobs() - logprobs
            kl = (torch.exp(log_ratio) - log_ratio - 1).sum() / n
        loss = per_token.sum() / n + spec.beta * kl
        ratio = torch.exp(logprobs.detach() - old)
        clipped = ((ratio < 1 - spec.epsilon) | (ratio > 1 + spec.epsilon_high)).float().sum() / n
        return LossTerms({"student": loss}, {"loss": loss.detach(), "kl_ref": kl.detach(),
                                             "clip_fraction": clipped})

    def after_update(self, batch: StepBatch, state: dict, figures: dict) -> dict:
        groups = batch.rewards.view(-1, self.group_size)
        return {"advantage_abs": state["advantages"].abs().mean().item(),
                "groups_without_signal": float((groups.std(dim=1) == 0).float().mean())}

    def panels(self) -> list[Panel]:
        return [Panel("PPO-clip loss", ("loss",)),
                Panel("share of groups with identical rewards", ("groups_without_signal",)),
                Panel("clip fraction", ("clip_fraction",))]
