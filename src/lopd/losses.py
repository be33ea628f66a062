"""The losses of on-policy self-distillation, as pure tensor functions.

Every function takes log-probabilities over the vocabulary at action positions, flattened over the
batch: ``(N, V)`` for N action tokens. Which side is detached is the caller's choice: the student
update detaches the teacher, the composer update detaches the student.

Top-M + tail (DESIGN §3). The support S_t is one side's M most likely tokens at position t (the
teacher's for LOPD's and SDFT's KLs, the student's for SDPO's JSD, as its release does). Each
distribution is reduced to M + 1 cells: its probability on each token of S_t, then one *tail* cell
holding the rest of its mass. The tail is the log-sum-exp of the log-probs *outside* S_t, not
``log(1 - sum)`` (SDPO's release computes ``log(-expm1(logsumexp(top)))`` with a clamp): when the
support holds nearly all the mass, ``1 - sum`` cancels catastrophically in fp32 (a tail of 1e-9
rounds to 0 and its log to -inf), while the log-sum-exp of the outside values keeps it exact.

Directions, named from the teacher's side as the distillation literature does:

* forward KL  = KL(p_T ‖ p_S) = Σ p_T (log p_T − log p_S): mass-covering (SDFT, OPSD);
* reverse KL  = KL(p_S ‖ p_T) = Σ p_S (log p_S − log p_T): mode-seeking (LOPD);
* generalised JSD_α, α ∈ [0, 1], with the mixture m = (1 − α) p_S + α p_T:
  (1 − α) KL(p_S ‖ m) + α KL(p_T ‖ m); α = 0 is forward KL and α = 1 reverse KL *by definition*
  (SDPO's convention), since the mixture formula itself goes to 0 at both ends (≈ α·KL(p_T ‖ p_S)
  near 0): the values are continuous in α only inside (0, 1).

Every divergence returns one value per row (action token), in nats, no reduction over tokens: the
caller averages over the step's action tokens. The full-vocabulary ones take (c, V) log-probs and run
unchanged inside :func:`lopd.teacher.per_token`, which feeds them a chunk of c tokens at a time.
"""

from __future__ import annotations

import math

import torch


def top_support(logprobs: torch.Tensor, top_m: int) -> torch.Tensor:
    """(N, M) indices of the ``top_m`` most likely tokens of ``logprobs`` (no gradient): the
    support S_t of a top-M + tail reduction."""
    if top_m < 1:
        raise ValueError(f"top_m must be >= 1, got {top_m}")
    return logprobs.detach().topk(min(top_m, logprobs.size(-1)), dim=-1).indices


def top_m_tail(logprobs: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """(N, M + 1) log-probs: the M support tokens, then the tail (all other tokens together).

    With M = V the tail is empty and its log-prob is -inf (probability exactly 0).
    """
    picked = logprobs.gather(-1, support)
    if support.size(-1) >= logprobs.size(-1):
        tail = torch.full_like(picked[..., :1], float("-inf"))
    else:
        outside = logprobs.scatter(-1, support, float("-inf"))
        tail = torch.logsumexp(outside, dim=-1, keepdim=True)
    return torch.cat([picked, tail], dim=-1)


def kl(p_logprobs: torch.Tensor, q_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) over the last dimension, one value per row; cells where p = 0 contribute 0.

    Written so that empty cells (log-prob -inf on both sides) give neither NaN values nor NaN
    gradients.
    """
    p = p_logprobs.exp()
    diff = torch.where(p > 0, p_logprobs - q_logprobs, torch.zeros_like(p_logprobs))
    return (p * diff).sum(-1)


def reverse_kl_top_m(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                     top_m: int) -> torch.Tensor:
    """(N,) KL(p̃_S ‖ p̃_T) on the teacher's top-M support plus tail: the LOPD distillation loss
    per action token (DESIGN §3, "Distillation loss")."""
    support = top_support(teacher_logprobs, top_m)
    return kl(top_m_tail(student_logprobs, support), top_m_tail(teacher_logprobs, support))


def forward_kl_top_m(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                     top_m: int) -> torch.Tensor:
    """(N,) KL(p̃_T ‖ p̃_S) on the teacher's top-M support plus tail (SDFT's loss)."""
    support = top_support(teacher_logprobs, top_m)
    return kl(top_m_tail(teacher_logprobs, support), top_m_tail(student_logprobs, support))


def forward_kl_full(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """(N,) KL(p_T ‖ p_S) over the whole vocabulary (OPSD's loss); chunk it with
    :func:`lopd.teacher.per_token`, which never holds more than one chunk's (c, V) tensors."""
    return kl(teacher_logprobs, student_logprobs)


def generalized_jsd(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                    alpha: float) -> torch.Tensor:
    """(N,) generalised Jensen-Shannon divergence over the last dimension (full vocabulary, or the
    cells of a top-k + tail reduction): ``(1 − α) KL(p_S ‖ m) + α KL(p_T ‖ m)`` with
    ``m = (1 − α) p_S + α p_T``; α = 0 is forward KL(p_T ‖ p_S), α = 1 reverse KL(p_S ‖ p_T)
    (SDPO's interpolation coefficient; see the module docstring)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if alpha == 0.0:
        return kl(teacher_logprobs, student_logprobs)
    if alpha == 1.0:
        return kl(student_logprobs, teacher_logprobs)
    # log m by log-sum-exp of the weighted log-probs: exact where either side is tiny.
    mixture = torch.logaddexp(student_logprobs + math.log(1 - alpha),
                              teacher_logprobs + math.log(alpha))
    return (1 - alpha) * kl(student_logprobs, mixture) + alpha * kl(teacher_logprobs, mixture)


def jsd_top_k(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, alpha: float,
              top_k: int, support_from: str = "student") -> torch.Tensor:
    """(N,) :func:`generalized_jsd` between the top-k + tail reductions of both sides; the support
    is the ``support_from`` side's top-k (``"student"``, as SDPO's release does, or
    ``"teacher"``). With k ≥ V the reduction is the full distribution (no empty tail cell)."""
    if support_from not in ("student", "teacher"):
        raise ValueError(f"support_from must be 'student' or 'teacher', got {support_from!r}")
    if top_k >= student_logprobs.size(-1):
        return generalized_jsd(student_logprobs, teacher_logprobs, alpha)
    support = top_support(student_logprobs if support_from == "student" else teacher_logprobs,
                          top_k)
    return generalized_jsd(top_m_tail(student_logprobs, support),
                           top_m_tail(teacher_logprobs, support), alpha)


def masked_mean(values: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is true (all of them when no mask); 0 when none is."""
    if mask is None:
        return values.mean() if values.numel() else values.sum()
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1)


def per_row_mean(values: torch.Tensor, rows: torch.Tensor, n_rows: int) -> tuple[torch.Tensor,
                                                                                   torch.Tensor]:
    """Mean of ``values`` (N,) grouped by ``rows`` (N,) into ``n_rows`` groups, and each group's
    count. Groups without values get mean 0."""
    sums = values.new_zeros(n_rows).index_add(0, rows, values)
    counts = values.new_zeros(n_rows).index_add(0, rows, torch.ones_like(values))
    return sums / counts.clamp_min(1), counts


def privileged_margin(teacher_token_logprobs: torch.Tensor, student_token_logprobs: torch.Tensor,
                      rows: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """Δ = mean over rollouts of (2r − 1) · mean_t [log π_T(a_t) − log π_S(a_t)].

    ``*_token_logprobs`` (N,): each side's log-prob of the action token actually taken; ``rows``
    (N,): the rollout each token belongs to; ``rewards`` (R,) in [0, 1]. The teacher's privilege on
    what the student did, counted for successes and against failures. Rollouts without action
    tokens are left out of the mean.
    """
    gap, counts = per_row_mean(teacher_token_logprobs - student_token_logprobs, rows, rewards.numel())
    signed = (2 * rewards.to(gap.dtype) - 1) * gap
    return masked_mean(signed, counts > 0)


def anchor_loss(latents: torch.Tensor, anchor_latents: torch.Tensor) -> torch.Tensor:
    """mean((Z_φ − Z_φ0)²): keeps the composer near its cold start."""
    return (latents - anchor_latents.detach()).pow(2).mean()


def dual_update(beta: float, margin: float, delta: float, lr: float) -> float:
    """β ← max(0, β + η_β (m − Δ̄)): rises while the teacher's privilege is below the margin."""
    return max(0.0, beta + lr * (margin - delta))


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4,
                     scale_rewards: str = "group", std: str = "sample") -> torch.Tensor:
    """GRPO's advantages: each reward minus its group's mean, divided as ``scale_rewards`` says
    (TRL's values): ``"group"`` by the group's std (+ ``eps``), ``"batch"`` by the std of all of
    ``rewards`` (+ ``eps``), ``"none"`` by nothing (Dr. GRPO: the std weights easy and hard tasks
    unequally). ``std``: ``"sample"`` (Bessel's correction, n − 1; TRL's) or ``"population"`` (n);
    the sample std of a single value is taken as 0, as TRL does.

    ``rewards`` (R,) holds consecutive groups of ``group_size`` rollouts of the same task; a group
    whose rewards are all equal gets advantage 0 everywhere.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if std not in ("sample", "population"):
        raise ValueError(f"std must be 'sample' or 'population', got {std!r}")
    groups = rewards.view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    bessel = int(std == "sample")
    if scale_rewards == "group":
        spread = groups.std(dim=1, keepdim=True, correction=bessel if group_size > 1 else 0)
        return (centred / (spread + eps)).view(-1)
    if scale_rewards == "batch":
        spread = rewards.std(correction=bessel if rewards.numel() > 1 else 0)
        return (centred / (spread + eps)).view(-1)
    if scale_rewards == "none":
        return centred.view(-1)
    raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}")


def ppo_clip(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
             epsilon: float, epsilon_high: float) -> torch.Tensor:
    """(N,) token-level PPO-clip loss: −min(ρ·A, clip(ρ, 1 − ε_lo, 1 + ε_hi)·A), ρ = π/π_old."""
    ratio = torch.exp(logprobs - old_logprobs.detach())
    clipped = ratio.clamp(1 - epsilon, 1 + epsilon_high)
    return -torch.minimum(ratio * advantages, clipped * advantages)


def ppo_clipped(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                epsilon: float, epsilon_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) bool masks (low, high) of the tokens where :func:`ppo_clip`'s clip binds, so that the
    token gives no gradient; TRL's ``clip_ratio/low`` and ``clip_ratio/high``: low where
    ρ < 1 − ε_lo and A < 0, high where ρ > 1 + ε_hi and A > 0. A ratio outside the range on the
    other side of the advantage is not clipped (the unclipped term is the smaller one)."""
    ratio = torch.exp(logprobs.detach() - old_logprobs.detach())
    return (ratio < 1 - epsilon) & (advantages < 0), (ratio > 1 + epsilon_high) & (advantages > 0)


def sampled_reverse_kl(logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                       teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """(N,) importance-weighted sampled-token reverse KL: ρ · sg[log π(a) − log π_T(a)] per
    action token a, with ρ = π(a) / π_old(a) carrying the gradient (Skill-SD's distillation
    term). The tokens were sampled by π_old; ``logprobs`` is the current policy's log-prob of each,
    ``teacher_logprobs`` the teacher's (detached).

    Its value is the importance-sampled estimate of KL(π ‖ π_T) at each visited prefix, and its
    gradient ρ · (log π(a) − log π_T(a)) · ∇ log π(a) is the score-function estimate of that KL's
    gradient (the term E[∇ log π] = 0 dropped): the student lowers the log-prob of tokens the
    teacher finds less likely than it does and raises the others. On-policy (π = π_old) ρ is 1.
    """
    ratio = torch.exp(logprobs - old_logprobs.detach())
    return ratio * (logprobs - teacher_logprobs).detach()


MARGIN_WEIGHTS = ("signed_reward", "success", "advantage")


def margin_weights(rewards: torch.Tensor, successes: torch.Tensor, kind: str,
                   batch_rewards: torch.Tensor | None = None, eps: float = 1e-4) -> torch.Tensor:
    """w(r) of the privileged margin Δ (DESIGN §3), one weight per rollout.

    ``signed_reward``: 2r − 1 (the paper's release; right for a binary reward). ``success``: +1 for
    a success, −1 otherwise, whatever the fractional reward. ``advantage``: (r − mean) / (std +
    ``eps``) over ``batch_rewards`` (default: ``rewards``; the whole step's when a process holds a
    share of it), population std, so all-equal rewards give 0 everywhere.
    """
    rewards = rewards.to(torch.float32)
    if kind == "signed_reward":
        return 2 * rewards - 1
    if kind == "success":
        return successes.to(torch.float32) * 2 - 1
    if kind == "advantage":
        batch = rewards if batch_rewards is None else batch_rewards.to(torch.float32)
        return (rewards - batch.mean()) / (batch.std(unbiased=False) + eps)
    raise ValueError(f"unknown margin weight {kind!r}; choose from {', '.join(MARGIN_WEIGHTS)}")
