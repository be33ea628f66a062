"""LOPD: on-policy self-distillation from a frozen self-teacher that reads learned latent context.

One step (DESIGN §2–3), for the student's rollouts of the step:

1. retrieve n_ret successful experiences per task from the bank (leave-one-out);
2. the composer φ turns them into latents Z_φ (and the frozen cold-start copy φ0 into Z_φ0);
3. one teacher pass: the frozen base θ0 (adapter off) reads each rollout with Z_φ spliced into a
   reference block of its first user message; the graph to Z_φ is kept for the composer;
4. student update: reverse KL(student ‖ teacher) over the teacher's top-M tokens plus a tail
   bucket, mean over action tokens, teacher detached;
5. composer update: the same KL with the student detached, plus β·(m − Δ) and
   λ_anchor·mean((Z_φ − Z_φ0)²), where Δ is the teacher's privilege on the student's actions signed
   by outcome;
6. dual update β ← max(0, β + η_β (m − Δ̄)); successful rollouts join the bank.

Interpretations (the spec leaves these open):

* Δ̄ in the dual update is the Δ of the step's batch, measured before the updates.
* Both log π_S in Δ and the student side of KL_φ come from the student's forward pass of this step
  (the weights that sampled the rollouts), not from the sampler's stored log-probs: they are the same
  policy, and the forward pass keeps both sides on identical numerics.
* The student and composer updates use the logits of the same forward passes (one teacher pass, one
  student pass); their graphs share no parameter, so they are two independent optimiser steps.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch

from lopd import losses, models
from lopd.algorithms.cold_start import retrieve_traces, teacher_pass
from lopd.composer import Composer
from lopd.experience import ExperienceBank
from lopd.latent import ReferenceFormat
from lopd.teacher import action_logits, scoring_batch
from lopd.trainer import Algorithm, Panel, StepBatch, TrainContext, Updater


class LOPD(Algorithm):
    name = "lopd"
    group_size = 1

    BANK_DIR = "bank"
    COMPOSER_DIR = "composer"
    COLD_START_DIR = "cold_start_composer"

    def __init__(self, ctx: TrainContext, checkpoint: Path | None):
        super().__init__(ctx, checkpoint)
        cfg = ctx.cfg
        self.spec = cfg.lopd
        run_dir = ctx.run_dir
        # The run keeps its own copies of its inputs: the cold-start composer (φ0, also the anchor)
        # and the bank it grows, so a run folder resumes without the original paths.
        cold_start = run_dir / self.COLD_START_DIR
        bank_dir = run_dir / self.BANK_DIR
        if checkpoint is None:
            if not self.spec.composer or not self.spec.bank:
                raise ValueError("LOPD needs a cold-started composer and a bank: pass --composer "
                                 "DIR and --bank DIR (or set lopd.composer and lopd.bank)")
            for path, what in ((self.spec.composer, "composer"), (self.spec.bank, "bank")):
                if not Path(path).exists():
                    raise FileNotFoundError(f"lopd.{what}: {path} does not exist")
            shutil.rmtree(cold_start, ignore_errors=True)
            shutil.copytree(self.spec.composer, cold_start)
            shutil.rmtree(bank_dir, ignore_errors=True)
            with ExperienceBank.open(self.spec.bank, batch_size=cfg.bank.embed_batch_size,
                                     device=ctx.device) as source:
                source.snapshot(bank_dir)
        else:
            shutil.rmtree(bank_dir, ignore_errors=True)
            shutil.copytree(checkpoint / self.BANK_DIR, bank_dir)
        self.bank = ExperienceBank.open(bank_dir, batch_size=cfg.bank.embed_batch_size,
                                        device=ctx.device)
        # The frozen base θ0: one copy serves the composer's encoder (adapter on) and the teacher.
        base, _ = models.load_model(cfg.model.name_or_path, device=ctx.device, dtype=ctx.dtype,
                                    trust_remote_code=cfg.model.trust_remote_code)
        self.composer = Composer.load(cold_start, base.eval(), ctx.tokenizer)
        self.composer.freeze_anchor()
        if checkpoint is not None:
            self.composer.load_weights(checkpoint / self.COMPOSER_DIR)
        self.fmt = ReferenceFormat.for_tokenizer(ctx.tokenizer)
        self.n_ret = cfg.bank.n_ret
        self.composer_updater = Updater(self.composer.trainable_parameters(),
                                        self.spec.composer_learning_rate,
                                        self.spec.composer_max_grad_norm)
        self.beta = self.spec.dual_init

    # -- one step -----------------------------------------------------------------------------

    def step(self, batch: StepBatch) -> dict[str, float]:
        spec, ctx = self.spec, self.ctx
        rollouts = batch.rollouts
        times = {}
        clock = time.perf_counter()

        traces = retrieve_traces(self.bank, rollouts, self.n_ret,
                                 leave_one_out=not ctx.cfg.bank.allow_self_retrieval)
        times["time/retrieval"] = time.perf_counter() - clock
        clock = time.perf_counter()

        self.composer.train()
        instructions = [r.instruction for r in rollouts]
        latents = self.composer.encode(instructions, traces)
        with torch.no_grad():
            anchor_latents = self.composer.encode(instructions, traces, anchor=True)
        times["time/composer"] = time.perf_counter() - clock
        clock = time.perf_counter()

        scored_t = teacher_pass(self.composer, rollouts, self.fmt, latents=latents)
        teacher_lp = torch.log_softmax(scored_t.logits.float(), dim=-1)
        times["time/teacher"] = time.perf_counter() - clock
        clock = time.perf_counter()

        plain = scoring_batch([r.input_ids for r in rollouts], [r.action_mask for r in rollouts],
                              ctx.tokenizer.pad_token_id)
        scored_s = action_logits(ctx.student, plain.to(ctx.device))
        if not torch.equal(scored_s.targets, scored_t.targets):
            raise RuntimeError("teacher and student action tokens do not line up")
        student_lp = torch.log_softmax(scored_s.logits.float(), dim=-1)
        student_kl = losses.reverse_kl_top_m(student_lp, teacher_lp.detach(), spec.top_m)
        loss_student = student_kl.mean()
        student_step = ctx.student_updater.apply(loss_student)
        times["time/student_update"] = time.perf_counter() - clock
        clock = time.perf_counter()

        rewards = batch.rewards.to(ctx.device)
        targets = scored_t.targets.unsqueeze(-1)
        delta = losses.privileged_margin(teacher_lp.gather(-1, targets).squeeze(-1),
                                         student_lp.detach().gather(-1, targets).squeeze(-1),
                                         scored_t.rows, rewards)
        composer_kl = losses.reverse_kl_top_m(student_lp.detach(), teacher_lp, spec.top_m).mean()
        anchor = losses.anchor_loss(latents, anchor_latents)
        loss_composer = composer_kl + self.beta * (spec.margin - delta) + spec.anchor_weight * anchor
        composer_step = self.composer_updater.apply(loss_composer)
        times["time/composer_update"] = time.perf_counter() - clock
        clock = time.perf_counter()

        beta_used = self.beta
        self.beta = losses.dual_update(self.beta, spec.margin, delta.item(), spec.dual_lr)
        added = 0
        if spec.add_successes:
            result = self.bank.add_rollouts([r for r in rollouts if r.success], ctx.train_tasks,
                                            source=f"lopd-step-{batch.step}")
            added = len(result.added)
        times["time/bank_add"] = time.perf_counter() - clock
        return {"kl": loss_student.item(), "kl_composer": composer_kl.item(),
                "delta": delta.item(), "margin": spec.margin, "beta": beta_used,
                "beta_next": self.beta, "anchor": anchor.item(),
                "loss_composer": loss_composer.item(),
                "student/grad_norm": student_step["grad_norm"],
                "composer/grad_norm": composer_step["grad_norm"],
                "composer/skipped_updates": self.composer_updater.skipped,
                "action_tokens": int(scored_s.targets.numel()),
                "bank/added": added, "bank/size": len(self.bank), **times}

    def panels(self) -> list[Panel]:
        return [Panel("KL(student ‖ teacher), top-M + tail", ("kl", "kl_composer")),
                Panel("privileged margin Δ", ("delta",), self.spec.margin, "m"),
                Panel("dual variable β", ("beta",)),
                Panel("anchor mean((Z − Z0)²)", ("anchor",))]

    # -- persistence --------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"beta": self.beta, "composer_updater": self.composer_updater.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.beta = state["beta"]
        self.composer_updater.load_state_dict(state["composer_updater"])

    def save(self, folder: Path) -> None:
        self.composer.save(folder / self.COMPOSER_DIR)
        self.bank.snapshot(folder / self.BANK_DIR)
