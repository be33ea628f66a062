"""Cold start of the composer: teach φ to write latents the frozen teacher can use.

Before any on-policy training, the composer is fitted alone: for every successful trajectory τ_i in
the bank, retrieve n_ret *other* experiences (leave-one-out), compose their latents Z, and minimise
the frozen teacher's negative log-likelihood of τ_i's action tokens given Z. The base never
changes; only the LoRA adapter ψ and the compressor χ learn. Each update runs on the shared
micro-batched step (:class:`ColdStart`, :mod:`lopd.algorithms.base`).

:func:`latent_information` then measures whether the latents carry information, on held-out
successes: the teacher's NLL per action token with no reference, with retrieved latents, with
latents of random experiences, and with the retrieved traces as plain text. The held-out successes
come from validation tasks carved out of the training split (``cold_start.validation_tasks``),
withheld from the bank, never from the eval split: the table chooses the preset's epochs.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from lopd.agent import Rollout
from lopd.algorithms.base import (
    LossTerms,
    MicroBatch,
    Scores,
    SharedStep,
    StepBatch,
    Totals,
    Updater,
)
from lopd.composer import Composer
from lopd.experience import random_traces, retrieve_traces
from lopd.latent import ReferenceFormat
from lopd.losses import per_row_mean
from lopd.teacher import LatentContext, TextContext, teacher_pass


def teacher_nll(composer: Composer, rollouts: Sequence[Rollout], fmt: ReferenceFormat,
                traces: Sequence[Sequence[str]] | None, mode: str) -> torch.Tensor:
    """Per-rollout mean NLL of the action tokens under the frozen teacher (differentiable in φ).

    ``mode``: ``"none"`` (no reference), ``"latent"`` (composed latents of ``traces``) or
    ``"text"`` (the traces themselves as text in the reference block).
    """
    views = {"latent": LatentContext, "text": TextContext}
    if mode == "none":
        scored = teacher_pass(composer, rollouts, fmt)
    elif mode in views:
        scored, _ = views[mode](composer, fmt).score(rollouts, traces)
    else:
        raise ValueError(f"unknown reference mode {mode!r}; modes: none, latent, text")
    return per_row_mean(-scored.token_logprobs(), scored.rows, len(rollouts))[0]


class ColdStart(SharedStep):
    """One cold-start update on the shared step: the frozen teacher (adapter off) reads latents of
    each success's retrieved experiences; the loss is its NLL of the success's action tokens,
    mean per trajectory, then over the batch. Only φ (LoRA ψ + compressor χ) learns."""

    def __init__(self, composer: Composer, cfg, micro_batch_size: int = 0, precision: str = "fp32"):
        self.composer = composer
        self.precision = precision
        self.teacher = LatentContext(composer, ReferenceFormat.for_tokenizer(composer.tokenizer))
        self.micro_batch_size = micro_batch_size
        self.device = composer.base.device
        self.pad_id = composer.tokenizer.pad_token_id
        self.updater = Updater(composer.trainable_parameters(), cfg.learning_rate,
                               cfg.max_grad_norm, cfg.weight_decay)

    def updaters(self) -> dict[str, Updater]:
        return {"composer": self.updater}

    def before_step(self, batch: StepBatch) -> dict:
        return {"teacher_context": batch.context}

    def loss(self, micro: MicroBatch, scores: Scores, state: dict, totals: Totals) -> LossTerms:
        teacher = scores.teacher
        nll = per_row_mean(-teacher.token_logprobs(), teacher.rows, len(micro.rollouts))[0]
        share = nll.sum() / totals.rollouts
        return LossTerms({"composer": share}, {"nll": share.detach()})


def cold_start(composer: Composer, bank, successes: Sequence[Rollout], cfg, n_ret: int,
               seed: int = 0, progress: bool = True, micro_batch_size: int = 0,
               precision: str = "fp32", on_epoch: Callable[[int], None] | None = None) -> list[dict]:
    """Fit φ on ``successes`` (training-split rollouts); returns the per-step history.

    ``micro_batch_size`` splits each batch of ``cold_start.batch_size`` successes into passes of
    that many (gradients accumulated; the same update); ``precision`` is 'fp32' or 'bf16-mixed'
    (the composer's weights stay float32 either way). ``on_epoch(epoch)`` runs after every
    completed epoch (1-based), with the composer in eval mode.
    """
    if not successes:
        raise ValueError("cold start needs successful rollouts; build the bank first")
    traces = retrieve_traces(bank, successes, n_ret)
    step_fn = ColdStart(composer, cfg, micro_batch_size, precision)
    rng = random.Random(seed)
    order = list(range(len(successes)))
    steps_per_epoch = -(-len(order) // cfg.batch_size)
    total = cfg.epochs * steps_per_epoch
    if cfg.max_steps:
        total = min(cfg.max_steps, total)
    history = []
    composer.train()
    start = time.perf_counter()
    bar = tqdm(total=total, desc="cold start", disable=not progress)
    step = 0
    while step < total:
        rng.shuffle(order)
        for i in range(0, len(order), cfg.batch_size):
            if step >= total:
                break
            idx = order[i:i + cfg.batch_size]
            figures = step_fn.step(StepBatch(step + 1, [], [successes[j] for j in idx],
                                             context=[traces[j] for j in idx]))
            step += 1
            history.append({"step": step, "nll": figures["nll"],
                            "grad_norm": figures["composer/grad_norm"],
                            "seconds": round(time.perf_counter() - start, 2)})
            bar.update(1)
            bar.set_postfix(nll=f"{history[-1]['nll']:.4f}")
        if on_epoch is not None and step % steps_per_epoch == 0:
            composer.eval()
            on_epoch(step // steps_per_epoch)
            composer.train()
    bar.close()
    composer.eval()
    return history


@torch.no_grad()
def latent_information(composer: Composer, bank, rollouts: Sequence[Rollout], n_ret: int,
                       batch_size: int = 8, seed: int = 0) -> dict[str, float]:
    """Teacher NLL per action token on ``rollouts`` under each kind of reference.

    "empty reference block" is the framing alone (the block's header text, no content): the
    difference between it and "no reference" is what merely inserting a block costs the teacher,
    the difference between it and the latent conditions is what the latents add.

    The mean is over all action tokens of all rollouts (token-weighted), so longer trajectories
    count in proportion to their length.
    """
    fmt = ReferenceFormat.for_tokenizer(composer.tokenizer)
    retrieved = retrieve_traces(bank, rollouts, n_ret)
    shuffled = random_traces(bank, rollouts, n_ret, seed)
    conditions = {
        "no reference": (None, "none"),
        "retrieved latents": (retrieved, "latent"),
        "random experiences' latents": (shuffled, "latent"),
        "retrieved traces as text": (retrieved, "text"),
        "empty reference block": ([[] for _ in rollouts], "text"),
    }
    composer.eval()
    return {name: mean_teacher_nll(composer, rollouts, fmt, traces, mode, batch_size)
            for name, (traces, mode) in conditions.items()}


@torch.no_grad()
def mean_teacher_nll(composer: Composer, rollouts: Sequence[Rollout], fmt: ReferenceFormat,
                     traces: Sequence[Sequence[str]] | None, mode: str,
                     batch_size: int = 8) -> float:
    """:func:`teacher_nll` over all action tokens of ``rollouts`` (token-weighted), in batches."""
    tokens = torch.tensor([sum(r.action_mask) for r in rollouts], dtype=torch.float64)
    per_row = []
    for i in range(0, len(rollouts), batch_size):
        part = traces[i:i + batch_size] if traces is not None else None
        per_row.append(teacher_nll(composer, rollouts[i:i + batch_size], fmt, part, mode)
                       .double().cpu())
    return float((torch.cat(per_row) * tokens).sum() / tokens.sum())


def save_history(history: list[dict], folder: Path, extra: dict) -> None:
    """``cold_start.json`` (config + per-step history) and ``cold_start.png`` (NLL curve)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (folder / "cold_start.json").write_text(json.dumps({**extra, "history": history}, indent=1))
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [h["step"] for h in history]
    values = [h["nll"] for h in history]
    ax.plot(steps, values, lw=0.6, alpha=0.4, label="batch NLL")
    window = max(1, len(values) // 30)
    smooth = [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
              for i in range(len(values))]
    ax.plot(steps, smooth, lw=1.5, label=f"moving mean ({window} steps)")
    ax.set_xlabel("step")
    ax.set_ylabel("teacher NLL per action token")
    ax.set_title("composer cold start")
    ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "cold_start.png", dpi=120)
    plt.close(fig)

