"""GRPO: group-normalised advantages and token-level PPO-clip, from rewards only (no teacher).

The trainer runs ``train.num_generations`` (G) rollouts of each task side by side; each rollout's
advantage is its reward minus the group's mean over the group's std, given to every action token of
the rollout. The student minimises the PPO-clip loss (ε_lo = ``train.epsilon``, ε_hi =
``train.epsilon_high``) averaged over all action tokens of the batch, ``train.num_iterations``
times per batch. With one iteration the "old" policy is the current one (ratio 1, gradient of
A·log π); with more, the old log-probs are those of the first pass, kept fixed. ``train.beta`` > 0
adds the k3 estimate of KL(π ‖ π_ref) to the frozen base, per token.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from lopd import losses, models
from lopd.teacher import action_logits, scoring_batch
from lopd.trainer import Algorithm, Panel, StepBatch, TrainContext


class GRPO(Algorithm):
    name = "grpo"

    def __init__(self, ctx: TrainContext, checkpoint: Path | None):
        super().__init__(ctx, checkpoint)
        self.group_size = ctx.cfg.train.num_generations
        self.reference = None
        if ctx.cfg.train.beta > 0:
            self.reference, _ = models.load_model(ctx.cfg.model.name_or_path, device=ctx.device,
                                                  dtype=ctx.dtype)
            self.reference.eval().requires_grad_(False)

    def _token_logprobs(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        scored = action_logits(model, batch)
        return scored.token_logprobs(), scored.rows

    def step(self, batch: StepBatch) -> dict[str, float]:
        ctx, cfg = self.ctx, self.ctx.cfg.train
        clock = time.perf_counter()
        rollouts = batch.rollouts
        scoring = scoring_batch([r.input_ids for r in rollouts], [r.action_mask for r in rollouts],
                                ctx.tokenizer.pad_token_id).to(ctx.device)
        advantages = losses.group_advantages(batch.rewards.to(ctx.device), self.group_size)
        reference = None
        if self.reference is not None:
            with torch.no_grad():
                reference, _ = self._token_logprobs(self.reference, scoring)
        old = None
        figures: dict[str, float] = {}
        for iteration in range(cfg.num_iterations):
            logprobs, rows = self._token_logprobs(ctx.student, scoring)
            if old is None:
                old = logprobs.detach()
            token_adv = advantages[rows]
            per_token = losses.ppo_clip(logprobs, old, token_adv, cfg.epsilon, cfg.epsilon_high)
            kl = torch.zeros((), device=ctx.device)
            if reference is not None:
                log_ratio = reference - logprobs
                kl = (torch.exp(log_ratio) - log_ratio - 1).mean()
            loss = per_token.mean() + cfg.beta * kl
            update = ctx.student_updater.apply(loss)
            ratio = torch.exp(logprobs.detach() - old)
            clipped = ((ratio < 1 - cfg.epsilon) | (ratio > 1 + cfg.epsilon_high)).float().mean()
            figures = {"loss": loss.item(), "kl_ref": kl.item(), "clip_fraction": clipped.item(),
                       "student/grad_norm": update["grad_norm"]}
        groups = batch.rewards.view(-1, self.group_size)
        return {**figures,
                "advantage_abs": advantages.abs().mean().item(),
                "groups_without_signal": float((groups.std(dim=1) == 0).float().mean()),
                "action_tokens": int(old.numel()),
                "time/student_update": time.perf_counter() - clock}

    def panels(self) -> list[Panel]:
        return [Panel("PPO-clip loss", ("loss",)),
                Panel("share of groups with identical rewards", ("groups_without_signal",)),
                Panel("clip fraction", ("clip_fraction",))]
