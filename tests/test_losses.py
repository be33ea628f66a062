"""Each loss against a brute-force or hand-computed reference."""

import math

import pytest
import torch

from lopd import losses


def brute_top_m_kl(p_probs, q_probs, support, reverse=True):
    """KL between the (M + 1)-cell reductions, one row at a time, in float64."""
    out = []
    for row in range(p_probs.size(0)):
        s = support[row].tolist()
        p = [p_probs[row, i].item() for i in s]
        q = [q_probs[row, i].item() for i in s]
        p.append(1 - sum(p))
        q.append(1 - sum(q))
        a, b = (p, q) if reverse else (q, p)
        out.append(sum(x * (math.log(x) - math.log(y)) for x, y in zip(a, b) if x > 0))
    return torch.tensor(out, dtype=torch.float64)


def random_logprobs(n, v, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(n, v, generator=g, dtype=torch.float64) * scale, -1)


def test_top_m_tail_cells_are_support_probs_then_the_rest():
    lp = torch.log(torch.tensor([[0.5, 0.2, 0.2, 0.1]], dtype=torch.float64))
    cells = losses.top_m_tail(lp, torch.tensor([[2, 0]])).exp()
    assert torch.allclose(cells, torch.tensor([[0.2, 0.5, 0.3]], dtype=torch.float64))


def test_hand_computed_two_token_case():
    # Vocabulary of 3, M = 1. Teacher (0.7, 0.2, 0.1): support {0}. Student (0.4, 0.4, 0.2).
    teacher = torch.log(torch.tensor([[0.7, 0.2, 0.1]], dtype=torch.float64))
    student = torch.log(torch.tensor([[0.4, 0.4, 0.2]], dtype=torch.float64))
    reverse = 0.4 * math.log(0.4 / 0.7) + 0.6 * math.log(0.6 / 0.3)
    forward = 0.7 * math.log(0.7 / 0.4) + 0.3 * math.log(0.3 / 0.6)
    assert losses.reverse_kl_top_m(student, teacher, 1).item() == pytest.approx(reverse, abs=1e-12)
    assert losses.forward_kl_top_m(student, teacher, 1).item() == pytest.approx(forward, abs=1e-12)


@pytest.mark.parametrize("top_m", [1, 5, 20])
def test_top_m_kl_matches_brute_force(top_m):
    student, teacher = random_logprobs(6, 50, 0), random_logprobs(6, 50, 1)
    support = teacher.topk(top_m, -1).indices
    ref = brute_top_m_kl(student.exp(), teacher.exp(), support)
    assert torch.allclose(losses.reverse_kl_top_m(student, teacher, top_m), ref, atol=1e-10)
    ref = brute_top_m_kl(student.exp(), teacher.exp(), support, reverse=False)
    assert torch.allclose(losses.forward_kl_top_m(student, teacher, top_m), ref, atol=1e-10)


def test_m_equal_to_vocab_is_the_full_kl_with_finite_gradients():
    student = random_logprobs(4, 12, 2).float().requires_grad_(True)
    teacher = random_logprobs(4, 12, 3).float()
    full = (student.exp() * (student - teacher)).sum(-1)
    got = losses.reverse_kl_top_m(student, teacher, 12)
    assert torch.allclose(got, full, atol=1e-6)
    assert torch.allclose(losses.reverse_kl_top_m(student, teacher, 100), full, atol=1e-6)
    got.sum().backward()
    assert torch.isfinite(student.grad).all()


def test_vanishing_tail_stays_exact_and_finite_in_fp32():
    # The support holds all but ~1e-12 of the mass: 1 - sum(...) would round to 0 in fp32.
    logits = torch.tensor([[30.0, 30.0, 2.0, 1.0]], dtype=torch.float32)
    teacher = torch.log_softmax(logits, -1)
    student = torch.log_softmax(logits * 0.5, -1).requires_grad_(True)
    cells = losses.top_m_tail(teacher, torch.tensor([[0, 1]]))
    exact = torch.log_softmax(logits.double(), -1)[0, 2:].exp().sum().log()
    assert cells[0, 2].item() == pytest.approx(exact.item(), rel=1e-5)
    assert math.isfinite(cells[0, 2].item())
    value = losses.reverse_kl_top_m(student, teacher, 2)
    value.sum().backward()
    assert torch.isfinite(value).all() and torch.isfinite(student.grad).all()
    assert value.item() >= 0


def test_kl_is_zero_for_identical_distributions_and_gradient_flows_to_the_live_side():
    lp = random_logprobs(3, 30, 4).float()
    assert torch.allclose(losses.reverse_kl_top_m(lp, lp, 5), torch.zeros(3), atol=1e-7)
    teacher = random_logprobs(3, 30, 5).float().requires_grad_(True)
    student = lp.clone().requires_grad_(True)
    losses.reverse_kl_top_m(student, teacher.detach(), 5).sum().backward()
    assert student.grad.abs().sum() > 0 and teacher.grad is None


def test_forward_kl_full_matches_definition():
    student, teacher = random_logprobs(5, 40, 6), random_logprobs(5, 40, 7)
    ref = (teacher.exp() * (teacher - student)).sum(-1)
    assert torch.allclose(losses.forward_kl_full(student, teacher), ref, atol=1e-12)


def test_masked_mean_ignores_masked_tokens():
    values = torch.tensor([1.0, 100.0, 3.0, float("nan")])
    mask = torch.tensor([True, False, True, False])
    assert losses.masked_mean(values.nan_to_num(0.0), mask).item() == pytest.approx(2.0)
    assert losses.masked_mean(torch.tensor([2.0, 4.0])).item() == pytest.approx(3.0)
    assert losses.masked_mean(values[:0], mask[:0]).item() == 0.0


def test_privileged_margin_hand_computed():
    # Rollout 0 (reward 1): gaps 0.2, 0.4 -> mean 0.3, sign +1.
    # Rollout 1 (reward 0): gap -0.1 -> sign -1 -> +0.1.
    # Rollout 2 (reward 0.5): sign 0. Rollout 3: no tokens, left out.
    teacher = torch.tensor([0.2, 0.4, -0.1, 5.0])
    student = torch.zeros(4)
    rows = torch.tensor([0, 0, 1, 2])
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0])
    delta = losses.privileged_margin(teacher, student, rows, rewards)
    assert delta.item() == pytest.approx((0.3 + 0.1 + 0.0) / 3)


def test_anchor_loss_and_dual_update():
    z = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    z0 = torch.tensor([[1.0, 0.0], [3.0, 2.0]])
    loss = losses.anchor_loss(z, z0)
    assert loss.item() == pytest.approx((0 + 4 + 0 + 4) / 4)
    loss.backward()
    assert torch.allclose(z.grad, torch.tensor([[0.0, 1.0], [0.0, 1.0]]))
    assert losses.dual_update(0.0, 0.05, 0.0, 0.5) == pytest.approx(0.025)
    assert losses.dual_update(0.1, 0.05, 0.5, 0.5) == 0.0
    assert losses.dual_update(0.3, 0.05, 0.15, 0.5) == pytest.approx(0.25)


def test_group_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    # Group 1: mean 0.5, squared deviations 4 · 0.25: sample std sqrt(1 / 3) (the default, TRL's),
    # population std sqrt(1 / 4) = 0.5 -> +-0.5 / (std + 1e-4). Group 2: identical -> 0.
    for std, spread in (("sample", math.sqrt(1 / 3)), ("population", 0.5)):
        one = 0.5 / (spread + 1e-4)
        want = torch.tensor([one, -one, -one, one, 0.0, 0.0, 0.0, 0.0])
        assert torch.allclose(losses.group_advantages(rewards, 4, std=std), want), std
    assert torch.equal(losses.group_advantages(rewards, 4),
                       losses.group_advantages(rewards, 4, std="sample"))
    # One rollout per group: its sample std is taken as 0 (TRL's), so the advantage is 0, not NaN.
    assert losses.group_advantages(rewards, 1).tolist() == [0.0] * 8
    assert losses.group_advantages(rewards[:1], 1, scale_rewards="batch").tolist() == [0.0]
    with pytest.raises(ValueError, match="groups of 3"):
        losses.group_advantages(rewards, 3)
    with pytest.raises(ValueError, match="'sample' or 'population'"):
        losses.group_advantages(rewards, 4, std="unbiased")


def test_ppo_clip_inside_and_outside_the_range():
    old = torch.zeros(4)
    # ratios 1.1 (inside), 1.5 (above), 0.5 (below), 0.5 (below, negative advantage)
    new = torch.log(torch.tensor([1.1, 1.5, 0.5, 0.5]))
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0])
    loss = losses.ppo_clip(new, old, adv, 0.2, 0.2)
    # -min(r*A, clip(r)*A): 1.1 -> -1.1; 1.5 -> -1.2 (clipped); 0.5, A=1 -> -0.5 (unclipped is
    # smaller); 0.5, A=-1 -> min(-0.5, -0.8) = -0.8 -> +0.8 (pessimistic clip).
    assert torch.allclose(loss, torch.tensor([-1.1, -1.2, -0.5, 0.8]))
    live = new.clone().requires_grad_(True)
    losses.ppo_clip(live, old, adv, 0.2, 0.2).sum().backward()
    # Clipped terms give no gradient.
    assert live.grad[1] == 0 and live.grad[3] == 0 and live.grad[0] != 0 and live.grad[2] != 0


def test_ppo_clipped_counts_a_clip_only_where_it_binds():
    # (ratio, advantage), ε_lo = 0.2, ε_hi = 0.28: the clip binds (no gradient) below 0.8 with
    # A < 0 (low) and above 1.28 with A > 0 (high), TRL's clip_ratio/low and /high.
    cases = [(0.5, -1.0, "low"), (0.79, -2.0, "low"), (0.5, 1.0, None), (0.79, 0.0, None),
             (1.5, 1.0, "high"), (1.29, 0.5, "high"), (1.25, 1.0, None), (1.5, -1.0, None),
             (1.5, 0.0, None), (1.0, 1.0, None), (0.85, -1.0, None)]
    new = torch.log(torch.tensor([r for r, _, _ in cases])).requires_grad_(True)
    adv = torch.tensor([a for _, a, _ in cases])
    low, high = losses.ppo_clipped(new, torch.zeros(len(cases)), adv, 0.2, 0.28)
    assert low.tolist() == [side == "low" for _, _, side in cases]
    assert high.tolist() == [side == "high" for _, _, side in cases]
    # Exactly the tokens whose PPO-clip gradient is 0 while their advantage is not.
    losses.ppo_clip(new, torch.zeros(len(cases)), adv, 0.2, 0.28).sum().backward()
    assert ((new.grad == 0) & (adv != 0)).tolist() == (low | high).tolist()


# ----------------------------------------------------------------------------------------------
# Forward KL over the full vocabulary and the generalised JSD, against python loops


def brute_kl(p, q):
    return sum(x * (math.log(x) - math.log(y)) for x, y in zip(p, q) if x > 0)


def brute_jsd(s, t, alpha):
    """SDPO's definition on plain lists of probabilities: the end points are the two KLs."""
    if alpha == 0:
        return brute_kl(t, s)
    if alpha == 1:
        return brute_kl(s, t)
    m = [(1 - alpha) * x + alpha * y for x, y in zip(s, t)]
    return (1 - alpha) * brute_kl(s, m) + alpha * brute_kl(t, m)


def rows(logprobs):
    return [[v.item() for v in row.exp()] for row in logprobs]


def cells(probs, support):
    picked = [probs[i] for i in support]
    return picked + [sum(probs) - sum(picked)]


def test_forward_kl_full_matches_a_python_loop():
    student, teacher = random_logprobs(5, 40, 8), random_logprobs(5, 40, 9)
    ref = [brute_kl(t, s) for s, t in zip(rows(student), rows(teacher))]
    assert torch.allclose(losses.forward_kl_full(student, teacher),
                          torch.tensor(ref, dtype=torch.float64), atol=1e-10)


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_generalized_jsd_over_the_full_vocabulary_matches_a_python_loop(alpha):
    student, teacher = random_logprobs(5, 30, 10), random_logprobs(5, 30, 11)
    ref = [brute_jsd(s, t, alpha) for s, t in zip(rows(student), rows(teacher))]
    got = losses.generalized_jsd(student, teacher, alpha)
    assert torch.allclose(got, torch.tensor(ref, dtype=torch.float64), atol=1e-10)
    assert (got >= 0).all()


def test_generalized_jsd_end_points_and_symmetry():
    student, teacher = random_logprobs(4, 25, 12), random_logprobs(4, 25, 13)
    assert torch.equal(losses.generalized_jsd(student, teacher, 0.0),
                       losses.forward_kl_full(student, teacher))
    assert torch.equal(losses.generalized_jsd(student, teacher, 1.0),
                       losses.kl(student, teacher))
    # Swapping the sides and α ↦ 1 − α gives the same divergence (the mixture is the same).
    assert torch.allclose(losses.generalized_jsd(student, teacher, 0.3),
                          losses.generalized_jsd(teacher, student, 0.7), atol=1e-12)
    # Near α = 0 the mixture formula is ≈ α·KL(p_T ‖ p_S), not KL itself: why the end points are
    # defined as the plain KLs.
    alpha = 1e-7
    assert torch.allclose(losses.generalized_jsd(student, teacher, alpha) / alpha,
                          losses.forward_kl_full(student, teacher), rtol=1e-2)
    with pytest.raises(ValueError, match="alpha"):
        losses.generalized_jsd(student, teacher, 1.5)


@pytest.mark.parametrize("support_from", ["student", "teacher"])
@pytest.mark.parametrize("alpha, top_k", [(0.0, 3), (0.5, 3), (0.5, 10), (0.8, 1), (1.0, 5)])
def test_jsd_top_k_matches_a_python_loop(alpha, top_k, support_from):
    student, teacher = random_logprobs(6, 20, 14), random_logprobs(6, 20, 15)
    side = student if support_from == "student" else teacher
    ref = []
    for s, t, ranked in zip(rows(student), rows(teacher), rows(side)):
        support = sorted(range(len(ranked)), key=lambda i: -ranked[i])[:top_k]
        ref.append(brute_jsd(cells(s, support), cells(t, support), alpha))
    got = losses.jsd_top_k(student, teacher, alpha, top_k, support_from)
    assert torch.allclose(got, torch.tensor(ref, dtype=torch.float64), atol=1e-10)


def test_jsd_top_k_with_k_at_least_the_vocabulary_is_the_full_jsd_with_finite_gradients():
    student = random_logprobs(3, 12, 16).float().requires_grad_(True)
    teacher = random_logprobs(3, 12, 17).float()
    got = losses.jsd_top_k(student, teacher, 0.5, 12)
    assert torch.allclose(got, losses.generalized_jsd(student, teacher, 0.5), atol=1e-7)
    got.sum().backward()
    assert torch.isfinite(student.grad).all()


def test_jsd_with_a_vanishing_tail_stays_finite_in_fp32():
    logits = torch.tensor([[30.0, 30.0, 2.0, 1.0]], dtype=torch.float32)
    teacher = torch.log_softmax(logits, -1)
    student = torch.log_softmax(logits * 0.5, -1).requires_grad_(True)
    value = losses.jsd_top_k(student, teacher, 0.5, 2)
    value.sum().backward()
    assert torch.isfinite(value).all() and torch.isfinite(student.grad).all() and value.item() >= 0
