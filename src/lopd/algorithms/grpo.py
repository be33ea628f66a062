"""GRPO: group-normalised advantages and token-level PPO-clip, from rewards only (no teacher).

The trainer runs ``grpo.num_generations`` (G) rollouts of each task side by side; each rollout's
advantage is its reward minus the group's mean, divided by the group's std (``grpo.scale_rewards``:
or the batch's, or nothing; ``grpo.std``: the sample std by default, as TRL's), given to every
action token of the rollout. The student minimises the PPO-clip loss (ε_lo = ``grpo.epsilon``,
ε_hi = ``grpo.epsilon_high``), ``grpo.num_iterations`` (μ) times per batch, averaged as
``grpo.loss_type`` says: over all action tokens of the step ("dapo", the default) or per rollout,
then over rollouts ("grpo", the paper's 1/G Σ_i 1/|o_i| Σ_t).

With μ = 1 the "old" policy is the current one: the ratio π/π_old is exactly 1, the clip never
acts, and the loss's gradient is that of −A·log π averaged the same way (a token mean over the step
with the default "dapo"). With μ > 1 the old log-probs are those of the first pass, kept fixed, and
the clip bounds the later passes; the shares of action tokens it cuts off are logged as TRL's:
``clip_fraction/low`` (ratio below 1 − ε_lo, advantage < 0), ``clip_fraction/high`` (ratio above
1 + ε_hi, advantage > 0), ``clip_fraction`` their sum. ``grpo.beta`` > 0 adds the k3 estimate of
KL(π ‖ π_ref) to the frozen base, per token and averaged like the PPO term: the reference is this
method's teacher view (other weights, no gradient).

Every average divides by the *step's* totals (:class:`~lopd.algorithms.base.Totals`), so any
``train.per_device_train_batch_size`` gives the same update as one pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

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
    loss_type: Literal["dapo", "grpo"] = knob(
        "dapo", "How the per-token losses (PPO-clip and the KL penalty) are averaged; TRL's names. "
        "'dapo' (default, the behaviour before this knob existed): the sum over every action token "
        "of the step divided by the step's action tokens, all micro-batches and processes "
        "together, as TRL's 'dapo' divides by the active tokens of the global accumulated batch. "
        "'grpo': each rollout's token mean, then the mean over the step's rollouts that have "
        "action tokens (the GRPO paper; a token of a short rollout weighs more than one of a long "
        "one; TRL counts a rollout without tokens as a 0 in that mean, here it is left out). "
        "TRL's 'bnpo' (a token mean per micro-batch) is not offered: it would make the update "
        "depend on train.per_device_train_batch_size.")
    scale_rewards: Literal["group", "batch", "none"] = knob(
        "group", "What each rollout's reward minus its group's mean is divided by; TRL's name and "
        "values (strings only): 'group' (default) the group's reward std, 'batch' the std of all "
        "the step's rewards (every process's), 'none' nothing (Dr. GRPO). The std is grpo.std's, "
        "plus 1e-4.")
    std: Literal["sample", "population"] = knob(
        "sample", "Which std scale_rewards divides by: 'sample' (default; Bessel's correction, "
        "divides the squared deviations by n - 1, as TRL does) or 'population' (by n: with G = 4 "
        "the advantages are 1.155 times the sample std's).")


@register
class GRPO(Algorithm):
    name = "grpo"
    config_class = GRPOConfig

    @classmethod
    def group_size_in(cls, cfg) -> int:
        return cfg.grpo.num_generations

    def __init__(self, ctx, checkpoint: Path | None):
        super().__init__(ctx, checkpoint)
        spec = self.spec = ctx.cfg.grpo
        self.passes = spec.num_iterations
        if spec.beta > 0:
            from lopd import stages

            reference, _ = stages.load_model(ctx.cfg, device=ctx.device)
            self.teacher = OtherWeights(reference.requires_grad_(False), self.pad_id)

    def before_step(self, batch: StepBatch) -> dict:
        scale, world = self.spec.scale_rewards, self.world
        rewards = batch.rewards
        share = slice(0, rewards.numel())
        if scale == "batch" and world.enabled:
            # The batch std is the whole step's: scale every rank's rewards by it, then keep this
            # rank's share (equal contiguous shards in rank order, as the trainer deals them).
            share = slice(world.rank * rewards.numel(), (world.rank + 1) * rewards.numel())
            rewards = torch.tensor(world.gather(rewards.tolist()), dtype=rewards.dtype)
        advantages = losses.group_advantages(rewards.to(self.device), self.group_size,
                                             scale_rewards=scale, std=self.spec.std)
        return {"advantages": advantages[share], "old": {}}

    def loss(self, micro: MicroBatch, scores: Scores, state: dict, totals: Totals) -> LossTerms:
        spec = self.spec
        logprobs = scores.student.token_logprobs()
        rows = scores.student.rows
        old = state["old"].setdefault(micro.index, logprobs.detach())
        token_adv = micro.take(state["advantages"])[rows]
        per_token = losses.ppo_clip(logprobs, old, token_adv, spec.epsilon, spec.epsilon_high)
        n = totals.action_tokens

        def average(values: torch.Tensor) -> torch.Tensor:
            """This micro-batch's share of the step's average of per-token ``values``."""
            if spec.loss_type == "dapo":
                return values.sum() / n
            means, _ = losses.per_row_mean(values, rows, len(micro.rollouts))
            return means.sum() / totals.rollouts_with_actions

        kl = torch.zeros((), device=logprobs.device)
        if scores.teacher is not None:
            log_ratio = scores.teacher.token_logprobs() - logprobs
            kl = average(torch.exp(log_ratio) - log_ratio - 1)
        loss = average(per_token) + spec.beta * kl
        low, high = losses.ppo_clipped(logprobs, old, token_adv, spec.epsilon, spec.epsilon_high)
        low, high = low.float().sum() / n, high.float().sum() / n
        return LossTerms({"student": loss}, {"loss": loss.detach(), "kl_ref": kl.detach(),
                                             "clip_fraction": low + high,
                                             "clip_fraction/low": low, "clip_fraction/high": high})

    def after_update(self, batch: StepBatch, state: dict, figures: dict) -> dict:
        groups = batch.rewards.view(-1, self.group_size)
        return {"advantage_abs": state["advantages"].abs().mean().item(),
                "groups_without_signal": float((groups == groups[:, :1]).all(dim=1).float().mean())}

    def panels(self) -> list[Panel]:
        return [Panel("PPO-clip loss", ("loss",)),
                Panel("share of groups with identical rewards", ("groups_without_signal",)),
                Panel("clip fraction: total, low (A < 0), high (A > 0)",
                      ("clip_fraction", "clip_fraction/low", "clip_fraction/high"))]
