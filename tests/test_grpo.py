"""GRPO's knobs: the two loss averages, the three reward scalings and the two stds against
hand-computed numbers, the clip fractions (low, high) by hand, micro-batched steps equal to one-pass
steps for each loss type, and the refusal of training rollouts sampled from another policy than
the one the loss scores."""

import dataclasses
import itertools
import math

import pytest
import torch

from conftest import small_config
from lopd import losses
from lopd.algorithms.base import MicroBatch, Scores, Totals
from lopd.algorithms.grpo import GRPO, GRPOConfig
from lopd.config import ConfigError, RolloutConfig
from lopd.rollout.engine import check_sampling
from test_algorithms import LR, assert_same, inputs, mixed_batch, run_step, snapshot  # noqa: F401 (fixture)

EPS = 1e-4


class FixedScores:
    """The student's side of :class:`Scores` with given per-token log-probs."""

    def __init__(self, logprobs, rows):
        self.logprobs = logprobs
        self.rows = torch.tensor(rows)

    def token_logprobs(self):
        return self.logprobs


def grpo_with(**spec):
    """A GRPO method holding only its config (enough for :meth:`GRPO.loss` and ``before_step``)."""
    algo = object.__new__(GRPO)
    algo.spec = GRPOConfig(**spec)
    algo.group_size = algo.spec.num_generations
    algo.device = torch.device("cpu")
    return algo


# Two rollouts of one task, rewards 1 and 0: advantages ±a (the sample std of 1 and 0 is √0.5).
# Rollout 0 has 2 action tokens, rollout 1 has 3. Their ratios π/π_old (as on a later pass, μ > 1)
# are chosen so that the clip (0.2) acts on one token of each rollout.
A = 0.5 / (math.sqrt(0.5) + EPS)
RATIOS = [1.0, 1.5, 1.0, 0.5, 1.1]
ROWS = [0, 0, 1, 1, 1]
# −min(ρA, clip(ρ, 0.8, 1.2)·A) by hand: A > 0 at ρ = 1.5 takes 1.2·A (no gradient); A < 0 at
# ρ = 0.5 takes 0.8·A (no gradient); the others take ρ·A.
TOKEN_LOSS = [-A, -1.2 * A, A, 0.8 * A, 1.1 * A]
# d(token loss)/d(log π) = −ρ·A where the unclipped term is taken, 0 where the clipped one is.
TOKEN_GRAD = [-A, 0.0, A, 0.0, 1.1 * A]
EXPECTED = {
    # dapo: the sum over the step's 5 action tokens / 5 = 0.14·A.
    "dapo": (sum(TOKEN_LOSS) / 5, [g / 5 for g in TOKEN_GRAD]),
    # grpo: each rollout's token mean, then the mean over the 2 rollouts = (−1.1 + 2.9/3)/2 · A.
    "grpo": (((TOKEN_LOSS[0] + TOKEN_LOSS[1]) / 2 + sum(TOKEN_LOSS[2:]) / 3) / 2,
             [g / (2 * 2) for g in TOKEN_GRAD[:2]] + [g / (2 * 3) for g in TOKEN_GRAD[2:]]),
}


def loss_on(loss_type, parts):
    """The loss value and d loss / d log π per token, accumulated over ``parts`` (lists of rollout
    indices, consecutive) like the shared step does, each normalised by the step's totals."""
    algo = grpo_with(num_generations=2, loss_type=loss_type)
    state = algo.before_step(type("Batch", (), {"rewards": torch.tensor([1.0, 0.0])})())
    totals = Totals(action_tokens=5, rollouts=2, rollouts_with_actions=2)
    old_all = torch.zeros(5)
    logprobs = torch.tensor([math.log(r) for r in RATIOS], requires_grad=True)
    total = torch.zeros(())
    for index, indices in enumerate(parts):
        tokens = [t for t, row in enumerate(ROWS) if row in indices]
        state["old"][index] = old_all[tokens]
        rows = [ROWS[t] - indices[0] for t in tokens]
        micro = MicroBatch(index, indices, [None] * len(indices))
        terms = algo.loss(micro, Scores(FixedScores(logprobs[tokens], rows), None), state, totals)
        total = total + terms.losses["student"]
        assert terms.metrics["kl_ref"] == 0
    total.backward()
    return total.item(), logprobs.grad.tolist()


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
@pytest.mark.parametrize("parts", [[[0, 1]], [[0], [1]]], ids=["one pass", "two micro-batches"])
def test_loss_types_hand_computed(loss_type, parts):
    value, grad = loss_on(loss_type, parts)
    want_value, want_grad = EXPECTED[loss_type]
    assert value == pytest.approx(want_value, rel=1e-6)
    assert grad == pytest.approx(want_grad, rel=1e-6, abs=1e-7)


def test_loss_type_grpo_leaves_rollouts_without_action_tokens_out():
    # Rollout 1 of 3 has no action token: the mean runs over rollouts 0 and 2 only.
    algo = grpo_with(num_generations=3, loss_type="grpo")
    state = {"advantages": torch.tensor([1.0, 5.0, -2.0]), "old": {}}
    logprobs = torch.zeros(3, requires_grad=True)
    micro = MicroBatch(0, [0, 1, 2], [None] * 3)
    terms = algo.loss(micro, Scores(FixedScores(logprobs, [0, 0, 2]), None), state,
                      Totals(action_tokens=3, rollouts=3, rollouts_with_actions=2))
    # μ = 1: ratio 1, token losses −A: rollout 0 → −1, rollout 2 → 2; (−1 + 2) / 2.
    assert terms.losses["student"].item() == pytest.approx(0.5)


REWARDS = [1.0, 0.0, 0.5, 1.0]   # two groups of two


def test_scale_rewards_group_batch_none_hand_computed():
    rewards = torch.tensor(REWARDS)
    centred = [0.5, -0.5, -0.25, 0.25]   # minus the group means 0.5 and 0.75
    group_std = [math.sqrt(0.5)] * 2 + [math.sqrt(0.125)] * 2   # sample stds: Σ dev² / (2 - 1)
    mean = sum(REWARDS) / 4
    batch_std = math.sqrt(sum((r - mean) ** 2 for r in REWARDS) / 3)
    assert batch_std == pytest.approx(math.sqrt(0.6875 / 3))
    cases = {"group": [c / (s + EPS) for c, s in zip(centred, group_std)],
             "batch": [c / (batch_std + EPS) for c in centred],
             "none": centred}
    for scale, want in cases.items():
        got = losses.group_advantages(rewards, 2, scale_rewards=scale)
        assert got.tolist() == pytest.approx(want, rel=1e-6), scale
    assert torch.equal(losses.group_advantages(rewards, 2), losses.group_advantages(
        rewards, 2, scale_rewards="group"))
    with pytest.raises(ValueError, match="'group', 'batch' or 'none'"):
        losses.group_advantages(rewards, 2, scale_rewards="true")


def test_the_group_std_is_the_sample_std_unless_population_is_asked_for():
    # G = 4, rewards (1, 0, 0, 0): mean 1/4, deviations (3/4, -1/4, -1/4, -1/4), Σ dev² = 3/4;
    # sample std sqrt(3/4 / 3) = 1/2 (TRL's), population std sqrt(3/4 / 4) = √3/4.
    batch = type("Batch", (), {"rewards": torch.tensor([1.0, 0.0, 0.0, 0.0])})()
    for spec, spread in (({}, 0.5), ({"std": "sample"}, 0.5),
                         ({"std": "population"}, math.sqrt(3) / 4)):
        state = grpo_with(num_generations=4, **spec).before_step(batch)
        want = [d / (spread + EPS) for d in (0.75, -0.25, -0.25, -0.25)]
        assert state["advantages"].tolist() == pytest.approx(want, rel=1e-6), spec
    # 'batch' divides by the same std of the whole step: rewards (1, 0, 0, 0, 1, 1, 0, 0), mean
    # 3/8, Σ dev² = 3 · (5/8)² + 5 · (3/8)² = 15/8.
    batch = type("Batch", (), {"rewards": torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0])})()
    centred = [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]
    for std, n in (("sample", 7), ("population", 8)):
        algo = grpo_with(num_generations=4, scale_rewards="batch", std=std)
        want = [c / (math.sqrt(15 / 8 / n) + EPS) for c in centred]
        assert algo.before_step(batch)["advantages"].tolist() == pytest.approx(want, rel=1e-6)
    with pytest.raises(ConfigError, match="grpo.std"):
        small_config(**{"grpo.std": "unbiased"})


def test_groups_without_signal_counts_groups_of_equal_rewards():
    for size, rewards, share in ((4, [1.0, 0, 0, 0, 0.5, 0.5, 0.5, 0.5], 0.5),
                                 (2, [1.0, 1.0, 0.0, 0.0, 0.0, 1.0], 2 / 3),
                                 (1, [1.0, 0.0], 1.0)):
        algo = grpo_with(num_generations=size)
        batch = type("Batch", (), {"rewards": torch.tensor(rewards)})()
        state = algo.before_step(batch)
        assert not state["advantages"].isnan().any()
        assert algo.after_update(batch, state, {})["groups_without_signal"] == pytest.approx(share)


def test_clip_fractions_low_and_high_follow_the_advantages_sign():
    # ε_lo = 0.2, ε_hi = 0.28. Rollout 0 (A > 0): 1.5 is clipped high, 1.25 is inside, 0.5 is below
    # the range but A > 0 takes the unclipped term. Rollout 1 (A < 0): 0.5 and 0.79 are clipped
    # low, 1.5 is above but unclipped. Rollout 2 (A = 0): nothing is clipped.
    algo = grpo_with(num_generations=3, epsilon=0.2, epsilon_high=0.28)
    ratios = [1.5, 1.25, 0.5, 0.5, 0.79, 1.5, 0.5, 1.5]
    rows = [0, 0, 0, 1, 1, 1, 2, 2]
    state = {"advantages": torch.tensor([1.0, -1.0, 0.0]), "old": {0: torch.zeros(8)}}
    logprobs = torch.log(torch.tensor(ratios))
    terms = algo.loss(MicroBatch(0, [0, 1, 2], [None] * 3),
                      Scores(FixedScores(logprobs, rows), None), state,
                      Totals(action_tokens=8, rollouts=3, rollouts_with_actions=3))
    metrics = {k: float(v) for k, v in terms.metrics.items()}
    assert metrics["clip_fraction/low"] == pytest.approx(2 / 8)
    assert metrics["clip_fraction/high"] == pytest.approx(1 / 8)
    assert metrics["clip_fraction"] == pytest.approx(3 / 8)   # the sum, TRL's region mean


class TwoRanks:
    """Rank 1 of 2 processes; the other rank holds ``others``."""

    enabled, rank = True, 1

    def __init__(self, others):
        self.others = others

    def gather(self, items):
        return list(self.others) + list(items)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_each_process_scales_by_the_whole_steps_batch_std(scale):
    algo = grpo_with(num_generations=2, scale_rewards=scale)
    algo.world = TwoRanks(REWARDS[:2])
    state = algo.before_step(type("Batch", (), {"rewards": torch.tensor(REWARDS[2:])})())
    whole = losses.group_advantages(torch.tensor(REWARDS), 2, scale_rewards=scale)
    assert torch.allclose(state["advantages"], whole[2:], rtol=0, atol=1e-6)


@pytest.mark.parametrize("sets", [
    {"grpo.loss_type": "dapo", "grpo.scale_rewards": "batch"},
    {"grpo.loss_type": "grpo", "grpo.beta": 0.1, "grpo.num_iterations": 2},
    {"grpo.loss_type": "grpo", "grpo.scale_rewards": "none"},
], ids=["dapo-batch", "grpo-kl-mu2", "grpo-none"])
def test_micro_batched_step_equals_the_one_pass_step(inputs, tmp_path, sets):  # noqa: F811
    batch = {}

    def batch_of(t):
        if "b" not in batch:
            batch["b"] = mixed_batch(t, 2)
        return batch["b"]

    sets = {"train.learning_rate": LR, "grpo.num_generations": 3, **sets}
    whole, f_whole = run_step(inputs, tmp_path / "whole", "grpo", 0, batch_of, **sets)
    parts, f_parts = run_step(inputs, tmp_path / "parts", "grpo", 4, batch_of, **sets)
    assert f_whole["micro_batches"] == 1 and f_parts["micro_batches"] == 2
    assert f_whole["loss"] != 0
    for key in ("loss", "kl_ref", "clip_fraction", "clip_fraction/low", "clip_fraction/high",
                "student/grad_norm", "advantage_abs"):
        # The gradient norm sums every parameter's squares in another order per micro-batch
        # split: on an AMD EPYC CPU that is 1.5e-6 of a norm near 1 (fp32 noise), hence relative.
        tol = {"rel": 1e-5} if key == "student/grad_norm" else {"rel": 0, "abs": 1e-6}
        assert f_parts[key] == pytest.approx(f_whole[key], **tol), key
    assert_same(snapshot(whole.ctx.student.parameters()), snapshot(parts.ctx.student.parameters()),
                "student")


def test_the_loss_type_changes_the_step(inputs, tmp_path):  # noqa: F811
    batch = {}

    def batch_of(t):
        if "b" not in batch:
            batch["b"] = mixed_batch(t, 2)
        return batch["b"]

    figures = {kind: run_step(inputs, tmp_path / kind, "grpo", 0, batch_of,
                              **{"grpo.num_generations": 3, "grpo.loss_type": kind})[1]
               for kind in ("dapo", "grpo")}
    assert abs(figures["grpo"]["loss"] - figures["dapo"]["loss"]) > 1e-4


BAD = {"temperature": 0.7, "top_p": 0.9, "top_k": 5}


@pytest.mark.parametrize("keys", [c for n in range(4) for c in itertools.combinations(BAD, n)],
                         ids=lambda keys: "+".join(keys) or "default")
def test_check_sampling_refuses_every_key_that_changes_the_sampling_policy(keys):
    cfg = dataclasses.replace(RolloutConfig(), **{k: BAD[k] for k in keys})
    if not keys:
        check_sampling(cfg)
        return
    with pytest.raises(ConfigError) as caught:
        check_sampling(cfg)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("training rollouts must sample what the training forward scores")
    for key, value in BAD.items():
        assert (f"rollout.{key}={value}" in message) == (key in keys), key
    assert message.count("rollout.") == len(keys) + 1   # + rollout.eval_temperature
    assert (" is refused" if len(keys) == 1 else " are refused") in message


def test_check_sampling_refuses_greedy_training_but_not_greedy_evaluation():
    check_sampling(RolloutConfig(eval_temperature=0.0))
    with pytest.raises(ConfigError, match=r"rollout\.temperature=0\.0 is refused"):
        check_sampling(RolloutConfig(temperature=0.0))
