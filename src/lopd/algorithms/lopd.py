"""LOPD: on-policy self-distillation from a frozen self-teacher that reads learned latent context.

One step (DESIGN §2–3), for the student's rollouts of the step:

1. retrieve n_ret successful experiences per task from the bank (leave-one-out; or, with
   ``lopd.retrieval: random``, n_ret entries of other tasks drawn at random: the control);
2. the composer φ turns them into latents Z_φ (and the frozen cold-start copy φ0 into Z_φ0);
3. one teacher pass: the frozen base θ0 (adapter off) reads each rollout with Z_φ spliced into a
   reference block of its first user message; the graph to Z_φ is kept for the composer;
4. student update: reverse KL(student ‖ teacher) over the teacher's top-M tokens plus a tail
   bucket, mean over action tokens, teacher detached;
5. composer update: the same KL with the student detached, plus β·(m − Δ) and
   λ_anchor·mean((Z_φ − Z_φ0)²), where Δ is the teacher's privilege on the student's actions signed
   by outcome (the weight w is ``lopd.margin_weight``: 2r − 1, ±1 by success, or the rollout's
   reward advantage over the step's batch);
6. dual update β ← max(0, β + η_β (m − Δ̄)); successful rollouts join the bank.

Reductions, as the paper's release computes them:

* The student's KL is one mean over the step's action tokens. KL_φ is a mean over rollouts of each
  rollout's token mean; Δ in the composer's loss is a mean over rollouts of w(r)·(token mean of the
  gap). Δ̄ in the dual update weights each rollout's signed gap by its action tokens,
  Σ w_i·Δ_i·n_i / Σ n_i (logged as ``delta_tokens``, beside the rollout mean ``delta``). Rollouts
  without action tokens are left out of every mean. All are measured before the updates.
* A student update skipped as non-finite skips the composer's update and the dual update of that
  step too (the composer's :class:`~lopd.algorithms.base.Updater` is gated on the student's).

Interpretations (the spec leaves these open):

* Both log π_S in Δ and the student side of KL_φ come from the student's forward pass of this step
  (the weights that sampled the rollouts), not from the sampler's stored log-probs: they are the same
  policy, and the forward pass keeps both sides on identical numerics.
* The student and composer updates use the logits of the same forward passes (one teacher pass, one
  student pass per micro-batch); their graphs share no parameter, so one backward fills both
  optimisers' gradients and the two steps are independent.
* Every figure is a share of a whole-step figure (the step's rollouts, action tokens, latents), so
  each micro-batch contributes its share and the accumulated update equals the one-pass update. The
  ``advantage`` weight normalises over the whole step's rewards (all processes), for the same reason.
* In a validation-mode run (``train.eval_split=validation``) the run's bank withholds the
  validation tasks (:meth:`lopd.experience.ExperienceBank.withhold`): their entries, present in a
  bank built on the whole training split, are never retrieved, and each step logs how many
  retrieved entries belong to a validation task (``retrieval/validation_hits``, 0 by construction).
* The rollouts sampled to build the bank and, if the cold start sampled any, the composer are this
  method's setup cost (:meth:`LOPD.setup_rollouts`), charged in every evaluation record.

Retrieval differs from the release by default. lopd retrieves leave-one-out (a task never reads
its own stored successes: ``bank.allow_self_retrieval: false``) and adds each step's successes to
the run's bank (``lopd.add_successes: true``); the release lets a task retrieve its own entries
and keeps the bank static during training (offline retrieval). lopd's defaults keep a rollout's
privileged context from being its own earlier solution of the same task, which would turn the
margin into a memorisation signal; the preset ``lopd-release`` (``--config lopd-release``, the
tiny default with the release's two choices; on another preset ``--set
bank.allow_self_retrieval=true --set lopd.add_successes=false``) reproduces the release.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

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
    Updater,
)
from lopd.composer import Composer
from lopd.config import knob
from lopd.experience import DB_NAME, random_entries, retrieve
from lopd.latent import ReferenceFormat
from lopd.teacher import LatentContext, per_token


@dataclass
class LopdConfig:
    """LOPD: the composer's privileged-margin objective and where its inputs come from."""

    composer: str = knob("", "Cold-started composer folder (`lopd cold-start`); its φ is also the "
                         "anchor φ0.")
    bank: str = knob("", "Experience bank folder; the run trains on its own copy, the original "
                     "is never changed.")
    top_m: int = knob(20, "M: the teacher's most likely tokens kept per position; the rest is "
                      "one tail bucket.", ge=1)
    margin: float = knob(0.05, "m: the privileged margin the teacher must keep, Δ >= m.")
    anchor_weight: float = knob(0.2, "λ_anchor: weight of mean((Z_φ - Z_φ0)^2).", ge=0.0)
    dual_lr: float = knob(0.5, "η_β: step size of the dual variable β.", ge=0.0)
    dual_init: float = knob(0.0, "β_init: starting value of the dual variable.", ge=0.0)
    composer_learning_rate: float = knob(1e-5, "AdamW learning rate of φ (LoRA + compressor).",
                                         gt=0.0)
    composer_max_grad_norm: float = knob(1.0, "Gradient-norm clip of the composer update.", gt=0.0)
    margin_weight: Literal["signed_reward", "success", "advantage"] = knob(
        "signed_reward", "w(r) of the margin Δ: 'signed_reward' 2r - 1 (the paper's release), "
        "'success' +1/-1 by the environment's success, 'advantage' (r - batch mean) / batch std.")
    add_successes: bool = knob(True, "Add the step's successful rollouts to the bank.")
    anchor_cache_mb: float = knob(
        256.0, "MiB of φ0's latents kept on the device: φ0 is frozen, so an (instruction, "
        "experience) pair met again is not re-encoded for the anchor term (0 = off; off with "
        "composer.lora_dropout > 0, where every encoding is a different sample).", ge=0.0)
    update_composer: bool = knob(
        True, "Train the composer jointly with the student (the method). False keeps the "
        "cold-started φ0 frozen: no composer update and no dual update (β stays at "
        "lopd.dual_init); the student's loss is unchanged (the joint-optimisation ablation).")
    retrieval: Literal["nearest", "random"] = knob(
        "nearest", "Which experiences the composer reads per rollout: 'nearest' the bank.n_ret "
        "nearest by instruction (the method), 'random' bank.n_ret entries drawn at random, never "
        "of the rollout's own task (the control that says how much of LOPD's gain comes from "
        "retrieval; drawn from the run seed, the step and the task, so resume and several "
        "processes draw the same).")


@register
class LOPD(Algorithm):
    name = "lopd"
    config_class = LopdConfig
    group_size = 1

    BANK_DIR = "bank"
    COMPOSER_DIR = "composer"
    COLD_START_DIR = "cold_start_composer"

    @classmethod
    def check_config(cls, cfg, world, fresh: bool) -> None:
        """A new run needs its two inputs, a composer folder and a bank folder (a resumed one has
        its own copies in the checkpoint)."""
        if not fresh:
            return
        spec = cfg.lopd
        if not spec.composer or not spec.bank:
            raise ValueError("LOPD needs a cold-started composer and a bank: pass --composer "
                             "DIR and --bank DIR (or set lopd.composer and lopd.bank)")
        for path, what, marker in ((spec.composer, "composer", Composer.CONFIG_FILE),
                                   (spec.bank, "bank", DB_NAME)):
            if not Path(path).exists():
                raise FileNotFoundError(f"lopd.{what}: {path} does not exist")
            if not (Path(path) / marker).is_file():
                raise FileNotFoundError(f"lopd.{what}: {path} is not a {what} folder (no "
                                        f"{marker})")

    def __init__(self, ctx, checkpoint: Path | None):
        super().__init__(ctx, checkpoint)
        cfg = ctx.cfg
        self.spec = cfg.lopd
        run_dir = ctx.run_dir
        # The run keeps its own copies of its inputs: the cold-start composer (φ0, also the anchor)
        # and the bank it grows, so a run folder resumes without the original paths.
        cold_start = run_dir / self.COLD_START_DIR
        bank_dir = run_dir / self.BANK_DIR
        world = self.world
        if not world.is_main:
            # Several processes: every rank keeps its own replica of the bank and adds the same
            # all-gathered successes to it (after_update), so the replicas stay identical without
            # sharing database files; rank 0's is the run's bank, the one checkpoints hold.
            import atexit
            import tempfile

            bank_dir = Path(tempfile.mkdtemp(prefix=f"lopd-bank-rank{world.rank}-")) / "bank"
            atexit.register(shutil.rmtree, bank_dir.parent, True)
        if checkpoint is None:
            if world.is_main:
                shutil.rmtree(cold_start, ignore_errors=True)
                shutil.copytree(self.spec.composer, cold_start)
            shutil.rmtree(bank_dir, ignore_errors=True)
            with stages.open_bank(cfg, self.spec.bank, ctx.device) as source:
                source.snapshot(bank_dir)
        else:
            shutil.rmtree(bank_dir, ignore_errors=True)
            shutil.copytree(checkpoint / self.BANK_DIR, bank_dir)
        world.barrier()  # rank 0 has copied the cold-start composer
        self.bank = stages.open_bank(cfg, bank_dir, ctx.device)
        self.validation_ids = ctx.validation_task_ids
        self.bank.withhold(self.validation_ids)
        # The frozen base θ0: one copy serves the composer's encoder (adapter on) and the teacher.
        base, _ = stages.load_model(cfg, device=ctx.device)
        self.composer = Composer.load(cold_start, base, ctx.tokenizer)
        self.composer.freeze_anchor(cache_mb=self.spec.anchor_cache_mb)
        if checkpoint is not None:
            self.composer.load_weights(checkpoint / self.COMPOSER_DIR)
        self.fmt = ReferenceFormat.for_tokenizer(ctx.tokenizer)
        # A frozen composer (the ablation) needs no graph to its latents and no anchor: Z_φ = Z_φ0.
        self.teacher = LatentContext(self.composer, self.fmt, anchor=True,
                                     trained=self.spec.update_composer)
        self.n_ret = cfg.bank.n_ret
        # A student update skipped as non-finite skips the composer's too (the release's gate).
        self.composer_updater = Updater(self.composer.trainable_parameters(),
                                        self.spec.composer_learning_rate,
                                        self.spec.composer_max_grad_norm,
                                        gate=ctx.student_updater)
        self.beta = self.spec.dual_init

    # -- one step -----------------------------------------------------------------------------

    def updaters(self) -> dict[str, Updater]:
        if not self.spec.update_composer:
            return {"student": self.ctx.student_updater}
        return {"student": self.ctx.student_updater, "composer": self.composer_updater}

    def setup_rollouts(self) -> int:
        """The bank's sampled rollouts plus the cold start's validation samples (if any)."""
        record = self.ctx.run_dir / self.COLD_START_DIR / "cold_start.json"
        cold = json.loads(record.read_text())["figures"].get("rollouts_sampled", 0) \
            if record.is_file() else 0
        return self.bank.rollouts_sampled + cold

    def before_step(self, batch: StepBatch) -> dict:
        if self.spec.retrieval == "random":
            found = random_entries(self.bank, batch.rollouts, self.n_ret,
                                   f"{self.ctx.cfg.run.seed}:{batch.step}")
        else:
            found = [[h.entry for h in hits] for hits in retrieve(
                self.bank, batch.rollouts, self.n_ret,
                leave_one_out=not self.ctx.cfg.bank.allow_self_retrieval)]
        self.composer.train()
        rewards = batch.rewards.to(self.device)
        successes = torch.tensor([r.success for r in batch.rollouts], device=self.device)
        # The advantage weight normalises over the whole step: every process's rewards.
        every = torch.tensor(self.world.gather(batch.rewards.tolist()), device=self.device) \
            if self.spec.margin_weight == "advantage" and self.world.enabled else None
        weights = losses.margin_weights(rewards, successes, self.spec.margin_weight, every)
        return {"teacher_context": [[e.trace for e in entries] for entries in found],
                "margin_weights": weights,
                "validation_hits": sum(e.task_id in self.validation_ids
                                       for entries in found for e in entries)}

    def loss(self, micro: MicroBatch, scores: Scores, state: dict, totals: Totals) -> LossTerms:
        spec = self.spec

        def terms(student_lp, teacher_lp, targets):
            picked = targets.unsqueeze(-1)
            return (losses.reverse_kl_top_m(student_lp, teacher_lp.detach(), spec.top_m),
                    losses.reverse_kl_top_m(student_lp.detach(), teacher_lp, spec.top_m),
                    teacher_lp.gather(-1, picked).squeeze(-1)
                    - student_lp.detach().gather(-1, picked).squeeze(-1))

        kl_student, kl_composer, gap_tokens = per_token(terms, scores.student, scores.teacher)
        tokens = totals.action_tokens
        share = len(micro.rollouts) / totals.rollouts
        acting = max(1, totals.rollouts_with_actions)
        # The student's KL: one mean over the step's action tokens.
        loss_student = kl_student.sum() / tokens
        rows, n_rows = scores.teacher.rows, len(micro.rollouts)
        gap, counts = losses.per_row_mean(gap_tokens, rows, n_rows)
        weights = micro.take(state["margin_weights"]).to(gap.dtype)
        signed = weights * gap * (counts > 0)
        # Δ in the loss: a mean over rollouts; Δ̄ for β: the same rollouts weighted by their action
        # tokens (Σ Δᵢ·nᵢ / Σ nᵢ), as the release's composer phase computes both.
        delta = signed.sum() / acting
        delta_tokens = (signed * counts).sum() / max(1, tokens)
        # KL_φ: a mean over rollouts of each rollout's token mean (the release's), unlike the
        # student's global token mean.
        composer_kl = (losses.per_row_mean(kl_composer, rows, n_rows)[0] * (counts > 0)).sum() \
            / acting
        anchor = losses.anchor_loss(scores.extras["latents"], scores.extras["anchor_latents"]) * share
        loss_composer = (composer_kl + self.beta * (spec.margin * share - delta)
                         + spec.anchor_weight * anchor)
        trained = {"student": loss_student}
        if spec.update_composer:
            trained["composer"] = loss_composer
        return LossTerms(trained,
                         {"kl": loss_student.detach(), "kl_composer": composer_kl.detach(),
                          "delta": delta.detach(), "delta_tokens": delta_tokens.detach(),
                          "anchor": anchor.detach(),
                          "loss_composer": loss_composer.detach()})

    def after_update(self, batch: StepBatch, state: dict, figures: dict) -> dict:
        spec = self.spec
        beta_used = self.beta
        # β stays where it was when the student's update was skipped (the release's gate).
        if spec.update_composer and not self.ctx.student_updater.last_skipped:
            self.beta = losses.dual_update(self.beta, spec.margin, figures["delta_tokens"],
                                           spec.dual_lr)
        added = 0
        if spec.add_successes:
            # Every rank adds the successes of the whole step, in rank order (= one process's order).
            successes = self.world.gather([r for r in batch.rollouts if r.success])
            result = self.bank.add_rollouts(successes, self.ctx.train_tasks,
                                            source=f"lopd-step-{batch.step}")
            added = len(result.added)
        return {"margin": spec.margin, "beta": beta_used, "beta_next": self.beta,
                "bank/added": added, "bank/size": len(self.bank),
                "retrieval/validation_hits": int(self.world.sum(
                    {"hits": state["validation_hits"]})["hits"])}

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
