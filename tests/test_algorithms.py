"""The algorithm interface: micro-batched steps equal one-batch steps, and a method registered from
outside the package is picked up by the config, the CLI and the trainer without other edits."""

from dataclasses import dataclass

import pytest
import torch

from conftest import lopd_config, make_lopd_inputs
from lopd import agent, policies, trainer
from lopd.algorithms import algorithm_names, get_algorithm, register, unregister
from lopd.algorithms.base import Algorithm, LossTerms, StepBatch, micro_batches
from lopd.algorithms.cold_start import ColdStart
from lopd.config import ColdStartConfig, knob, load_config


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return make_lopd_inputs(tmp_path_factory.mktemp("algo-inputs"))


def config(inputs, **sets):
    return lopd_config(inputs, **{"train.rollouts_per_step": 6, "train.max_steps": 2,
                                  "rollout.batch_size": 6, "lopd.add_successes": False,
                                  "train.learning_rate": 1e-3,
                                  "lopd.composer_learning_rate": 1e-3, **sets})


def mixed_batch(t, n_tasks):
    """Sampled, junk and gold rollouts of different lengths: rewards and token counts differ."""
    tasks = trainer.tasks_for_step(t.train_tasks, 0, 1, n_tasks)
    tok = t.ctx.tokenizer
    gold = agent.run_episodes(t.env, tasks, policies.OraclePolicy(), tok, 8, 96, n_tasks)
    junk = agent.run_episodes(t.env, tasks, policies.RandomPolicy(seed=0), tok, 3, 48, n_tasks)
    sampled = t.rollouts(tasks, 1.0, seed=1)
    rollouts = [r for triple in zip(sampled, junk, gold) for r in triple]
    return StepBatch(1, [task for task in tasks for _ in range(3)], rollouts)


def snapshot(params):
    return [(p.detach().clone(), None if p.grad is None else p.grad.detach().clone())
            for p in params]


def assert_same(a, b, what):
    assert len(a) == len(b)
    for (wa, ga), (wb, gb) in zip(a, b):
        # Adam's first step divides each gradient by its own magnitude, so a parameter whose
        # gradient is near zero moves by an amount that float rounding (other padding widths,
        # other groupings of the composer's inputs) shifts by ~1e-6.
        # On an AVX2-only CPU a gradient within rounding of zero can change sign between the two
        # orders of summation, and Adam's first step moves such a weight by ~lr either way: a
        # handful of elements (well under 0.1%) may differ by up to 2·lr per step; all others
        # must agree to 2e-6.
        gap = (wa - wb).abs()
        off = gap > 2e-6
        assert off.float().mean() < 1e-3 and gap.max() < 1e-4, \
            f"{what}: weights differ ({int(off.sum())} of {gap.numel()}, largest {gap.max():.2e})"
        assert (ga is None) == (gb is None), f"{what}: gradient presence differs"
        if ga is not None:
            # Gradients up to ~1e-2 summed in another order per micro-batch split differ by
            # float32 rounding of their size (1e-5 relative on an AVX2-only AMD EPYC).
            assert torch.allclose(ga, gb, rtol=1e-4, atol=1e-6), f"{what}: gradients differ"


def run_step(inputs, run_dir, algo, micro, batch_of, **sets):
    cfg = config(inputs, **{"train.algorithm": algo, "train.per_device_train_batch_size": micro,
                            **sets})
    t = trainer.Trainer(cfg, run_dir, get_algorithm(algo), progress=False)
    torch.manual_seed(0)
    batch = batch_of(t)
    t.ctx.student.train()
    figures = t.algorithm.step(batch)
    return t, figures


# The paper's rate. Adam's first step moves a weight by lr·g/(|g| + eps): where a gradient is zero
# analytically but not numerically (the compressor's key bias: softmax ignores a shift shared by all
# keys) fp32 noise of 1e-10 moves it by up to lr·1e-2 in either direction, in any code path. At
# 1e-5 that stays below the 1e-6 checked; every other weight moves by ~lr.
LR = 1e-5

KEYS = {"grpo": ("loss", "kl_ref", "clip_fraction", "student/grad_norm"),
        "lopd": ("kl", "kl_composer", "delta", "anchor", "loss_composer", "student/grad_norm",
                 "composer/grad_norm", "beta_next"),
        "sdft": ("kl", "teacher_gain", "student/grad_norm"),
        "opsd": ("kl", "teacher_gain", "student/grad_norm")}


@pytest.mark.parametrize("algo, sets", [
    ("grpo", {"grpo.num_generations": 3, "grpo.beta": 0.1}),
    ("lopd", {"lopd.dual_init": 0.7}),
    ("sdft", {"sdft.ema_rate": 0.5}),
    ("opsd", {"train.loss_chunk_tokens": 7}),
])
def test_micro_batched_step_equals_the_one_batch_step(inputs, tmp_path, algo, sets):
    batch = {}

    def batch_of(t):
        # One batch of rollouts for both runs (the second run reuses the first's).
        if "b" not in batch:
            batch["b"] = mixed_batch(t, 2)
        return batch["b"]

    sets = {"train.learning_rate": LR, "lopd.composer_learning_rate": LR, **sets}
    whole, f_whole = run_step(inputs, tmp_path / "whole", algo, 0, batch_of, **sets)
    parts, f_parts = run_step(inputs, tmp_path / "parts", algo, 4, batch_of, **sets)
    changed = [not torch.equal(a, b) for a, b in
               zip(whole.ctx.student.parameters(), trainer.Trainer(
                   whole.cfg, tmp_path / "fresh", get_algorithm(algo),
                   progress=False).ctx.student.parameters())]
    assert any(changed)
    assert f_whole["micro_batches"] == 1 and f_parts["micro_batches"] == 2   # 6 rollouts as 4 + 2
    for key in KEYS[algo]:
        assert f_parts[key] == pytest.approx(f_whole[key], rel=0, abs=1e-6), key
    assert f_parts["action_tokens"] == f_whole["action_tokens"]
    assert_same(snapshot(whole.ctx.student.parameters()), snapshot(parts.ctx.student.parameters()),
                "student")
    if algo == "lopd":
        assert_same(snapshot(whole.algorithm.composer.trainable_parameters()),
                    snapshot(parts.algorithm.composer.trainable_parameters()), "composer")
        assert f_whole["delta"] != 0 and f_whole["anchor"] >= 0
    if algo == "sdft":
        assert_same(snapshot(whole.algorithm.ema.model.parameters()),
                    snapshot(parts.algorithm.ema.model.parameters()), "EMA teacher")
    if algo in ("sdft", "opsd"):
        assert f_whole["kl"] > 0


def test_micro_batched_cold_start_step_equals_the_one_batch_step(inputs):
    import copy

    from lopd import models
    from lopd.composer import Composer
    from lopd.experience import ExperienceBank, retrieve_traces

    base, tokenizer = models.load_model("toolworld-1m")
    with ExperienceBank.open(inputs / "bank") as bank:
        successes = bank.stored_rollouts()[:5]
        traces = retrieve_traces(bank, successes, 2)
    composers = [Composer.load(inputs / "composer", copy.deepcopy(base).eval(), tokenizer)
                 for _ in range(2)]
    cfg = ColdStartConfig(learning_rate=LR)
    figures = [ColdStart(c, cfg, micro_batch_size=size).step(
        StepBatch(1, [], successes, context=traces)) for c, size in zip(composers, (0, 2))]
    assert figures[1]["micro_batches"] == 3
    assert figures[1]["nll"] == pytest.approx(figures[0]["nll"], rel=0, abs=1e-6)
    assert_same(*(snapshot(c.trainable_parameters()) for c in composers), "composer")


def test_micro_batches_are_consecutive_slices():
    slices = micro_batches(list("abcdefg"), 3)
    assert [m.rollouts for m in slices] == [list("abc"), list("def"), list("g")]
    assert [m.indices for m in slices] == [[0, 1, 2], [3, 4, 5], [6]]
    assert slices[1].take(torch.arange(7)).tolist() == [3, 4, 5]
    assert [m.indices for m in micro_batches(list("abc"), 0)] == [[0, 1, 2]]


# ----------------------------------------------------------------------------------------------
# A method from outside the package


@dataclass
class CenteredConfig:
    scale: float = knob(1.0, "Multiplier of the centred reward.", gt=0.0)


class Centered(Algorithm):
    """REINFORCE with the batch-mean baseline: −(r − r̄)·scale·log π(a), mean over action tokens."""

    name = "centered_test"
    config_class = CenteredConfig

    def before_step(self, batch):
        rewards = batch.rewards.to(self.device)
        return {"advantages": (rewards - rewards.mean()) * self.cfg.centered_test.scale}

    def loss(self, micro, scores, state, totals):
        adv = micro.take(state["advantages"])[scores.student.rows]
        loss = -(adv * scores.student.token_logprobs()).sum() / totals.action_tokens
        return LossTerms({"student": loss}, {"loss": loss.detach()})


@pytest.fixture
def registered():
    register(Centered)
    yield Centered
    unregister(Centered.name)


def test_a_method_registered_from_a_test_module_is_picked_up_everywhere(registered, tmp_path,
                                                                        capsys):
    from lopd.cli import build_parser, main

    assert "centered_test" in algorithm_names()
    train = next(a for a in build_parser()._subparsers._group_actions[0].choices["train"]._actions
                 if a.dest == "algo")
    assert "centered_test" in train.choices
    assert main(["config", "--set", "centered_test.scale=2.5"]) == 0
    out = capsys.readouterr().out
    assert "centered_test.scale" in out and "2.5" in out
    sets = ["env.train_size=20", "env.eval_size=2", "env.pretrain_size=0",
            "train.rollouts_per_step=4", "train.eval_tasks=2", "train.max_steps=1",
            "rollout.max_turns=2", "rollout.max_completion_length=32", "rollout.batch_size=4"]
    args = ["train", "--algo", "centered_test", "--out", str(tmp_path / "run")]
    assert main([*args, *[x for s in sets for x in ("--set", s)]]) == 0
    records = trainer.read_jsonl(tmp_path / "run" / trainer.METRICS_FILE)
    assert [r["step"] for r in records] == [0, 1] and "loss" in records[1]
    saved = load_config(tmp_path / "run" / trainer.CONFIG_FILE)
    assert saved.train.algorithm == "centered_test" and saved.centered_test.scale == 1.0


def test_register_records_the_method_in_config_and_unregister_removes_it():
    from lopd.algorithms import config_sections
    from lopd.config import method_names, method_sections

    register(Centered)
    try:
        assert get_algorithm("centered_test") is Centered
        assert method_sections()["centered_test"] is CenteredConfig
        assert config_sections()["centered_test"] is CenteredConfig
        assert "centered_test" in method_names()
        assert register(Centered) is Centered       # the same class again is fine
    finally:
        unregister(Centered.name)
    assert "centered_test" not in algorithm_names() and "centered_test" not in method_names()
    assert "centered_test" not in method_sections() and "centered_test" not in config_sections()
    with pytest.raises(Exception, match="unknown algorithm 'centered_test'; choose one of"):
        get_algorithm("centered_test")


def test_register_refuses_bad_names_and_a_second_class_under_a_name():
    from lopd.config import ConfigError, method_names

    def named(name):
        return type("Odd", (Algorithm,), {"name": name, "loss": lambda *a: None})

    for name, message in [
            ("Odd", "algorithm Odd: name must be a lower-case identifier, got 'Odd'"),
            ("", "algorithm Odd: name must be a lower-case identifier, got ''"),
            ("train", "algorithm name 'train' is taken by a config section or 'base'"),
            ("base", "algorithm name 'base' is taken by a config section or 'base'")]:
        with pytest.raises(ConfigError) as info:
            register(named(name))
        assert str(info.value) == message
    with pytest.raises(ConfigError) as info:
        register(named("grpo"))
    assert str(info.value) == ("two algorithms named 'grpo': lopd.algorithms.grpo.GRPO and "
                               f"{__name__}.Odd")
    assert get_algorithm("grpo").__qualname__ == "GRPO" and "odd" not in method_names()


def test_an_unregistered_method_name_is_refused_naming_the_key():
    from lopd.config import ConfigError

    with pytest.raises(ConfigError, match="train.algorithm: got 'nope'.*'grpo'.*'lopd'"):
        load_config("tiny", ["train.algorithm=nope"])
    with pytest.raises(ConfigError, match="unknown key 'centered_test'"):
        load_config("tiny", ["centered_test.scale=2"])


def test_rollout_engine_without_an_engine_fails_at_start_up(tmp_path, capsys):
    from lopd.cli import main

    out = tmp_path / "run"
    assert main(["train", "--algo", "grpo", "--out", str(out), "--set", "rollout.engine=vllm"]) == 2
    err = capsys.readouterr().err
    assert "rollout.engine" in err and "vllm" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
