"""LOPD on the embedded tiny base: the dual variable, the collapse the margin prevents, resume after
a kill (what one step changes, and what it must not, is in test_step_checks.py)."""

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict

import pytest
import torch
import yaml

from conftest import lopd_config, make_lopd_inputs
from lopd import agent, models, policies, trainer
from lopd.algorithms.base import StepBatch, micro_batches


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return make_lopd_inputs(tmp_path_factory.mktemp("lopd-inputs"))


def config(inputs, **sets):
    return lopd_config(inputs, **sets)


def build(inputs, run_dir, **sets):
    from lopd.algorithms import get_algorithm

    return trainer.Trainer(config(inputs, **sets), run_dir, get_algorithm("lopd"), progress=False)


def one_batch(t, step=1):
    tasks = trainer.tasks_for_step(t.train_tasks, 0, step, 4)
    return StepBatch(step, tasks, t.rollouts(tasks, 1.0, seed=step))


def test_beta_rises_below_the_margin_and_falls_to_zero_above_it(inputs, tmp_path):
    t = build(inputs, tmp_path / "run", **{"lopd.margin": 10.0, "lopd.add_successes": False})
    alg = t.algorithm
    batch = one_batch(t)
    betas = [alg.beta]
    for _ in range(2):
        alg.step(batch)
        betas.append(alg.beta)
    assert betas[0] == 0.0 and betas[0] < betas[1] < betas[2]
    alg.spec.margin = -10.0
    for _ in range(4):
        figures = alg.step(batch)
        assert figures["delta"] > -10.0
        betas.append(alg.beta)
    falling = betas[2:]
    assert all(a > b or a == b == 0.0 for a, b in zip(falling, falling[1:]))
    assert falling[-1] == 0.0


def _deltas_on_a_fixed_batch(inputs, run_dir, steps, **sets):
    """Δ over repeated LOPD steps on one batch of oracle successes, with a random-init student (so
    the teacher starts far ahead: Δ ≈ 7 nats) that barely moves (learning rate 1e-9)."""
    t = build(inputs, run_dir, **{"lopd.anchor_weight": 0.0, "lopd.add_successes": False,
                                  "lopd.composer_learning_rate": 1e-2, "train.learning_rate": 1e-9,
                                  **sets})
    tasks = trainer.tasks_for_step(t.train_tasks, 0, 1, 4)
    rollouts = agent.run_episodes(t.env, tasks, policies.OraclePolicy(), t.ctx.tokenizer, 8, 96, 4)
    t.ctx.student.load_state_dict(models.build_model(t.ctx.tokenizer, "qwen3-1m", seed=1).state_dict())
    batch = StepBatch(1, tasks, rollouts)
    return [t.algorithm.step(batch)["delta"] for _ in range(steps)]


def test_without_the_margin_the_teacher_collapses_onto_the_student(inputs, tmp_path):
    free = _deltas_on_a_fixed_batch(inputs, tmp_path / "free", 10,
                                    **{"lopd.dual_lr": 0.0, "lopd.dual_init": 0.0})
    held = _deltas_on_a_fixed_batch(inputs, tmp_path / "held", 10,
                                    **{"lopd.dual_lr": 0.5, "lopd.dual_init": 5.0,
                                       "lopd.margin": 8.0})
    assert free[0] == pytest.approx(held[0]) and free[0] > 5
    late, late_held = sum(free[-3:]) / 3, sum(held[-3:]) / 3
    # KL_φ alone pulls the teacher onto the student: the privilege shrinks ...
    assert late < free[0] - 0.5
    # ... while the margin term (Δ < m, so β > 0) holds it where it started. (It cannot climb
    # much: the teacher already gives the oracle's actions nearly all its mass, so Δ is close to
    # its ceiling, −log π_S of the random student.)
    assert late_held > held[0] - 0.2 and late_held > late + 0.5


def _metrics(run_dir):
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def _cli(*args):
    return [sys.executable, "-m", "lopd", "train", *args]


def test_resume_after_kill_repeats_the_uninterrupted_run(inputs, tmp_path):
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(config(inputs).to_dict()))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    subprocess.run(_cli("--config", str(cfg_path), "--out", str(whole)), check=True, env=env,
                   capture_output=True, timeout=600)
    proc = subprocess.Popen(_cli("--config", str(cfg_path), "--out", str(broken)), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while time.time() < deadline:
        if (broken / "metrics.jsonl").exists() and 3 in _metrics(broken):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert [c.name for c in trainer.checkpoints(broken)][-1] == "step-000002"
    subprocess.run(_cli("--resume", str(broken)), check=True, env=env, capture_output=True,
                   timeout=600)
    a, b = _metrics(whole), _metrics(broken)
    assert sorted(a) == sorted(b) == [0, 1, 2, 3, 4]
    for step in (3, 4):
        for key in ("train/mean_reward", "kl", "kl_composer", "delta", "beta", "anchor",
                    "action_tokens", "bank/size", "generations"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-4, abs=1e-6), (step, key)
    assert b[4]["eval/mean_reward"] == pytest.approx(a[4]["eval/mean_reward"])
    assert (broken / "training.png").exists() and any((broken / "tensorboard").iterdir())


def test_lora_student_trains_only_its_adapter_and_checkpoints_a_loadable_model(inputs, tmp_path):
    from transformers import AutoModelForCausalLM

    t = build(inputs, tmp_path / "run", **{"train.student": "lora", "train.learning_rate": 1e-3})
    named = dict(t.ctx.student.named_parameters())
    trainable = {k for k, p in named.items() if p.requires_grad}
    assert trainable and all("lora_" in k for k in trainable)
    before = {k: p.detach().clone() for k, p in named.items()}
    t.algorithm.step(one_batch(t))
    changed = {k for k, p in t.ctx.student.named_parameters() if not torch.equal(p, before[k])}
    assert changed and changed <= trainable
    folder = t.save_checkpoint(1)
    merged = AutoModelForCausalLM.from_pretrained(folder / "student")
    ids = torch.tensor([t.algorithm.fmt.header])
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, t.ctx.student(input_ids=ids).logits,
                              atol=1e-5)


def test_grpo_step_changes_the_student_from_rewards_alone(inputs, tmp_path):
    from lopd.algorithms import get_algorithm

    cfg = config(inputs, **{"train.algorithm": "grpo", "train.learning_rate": 1e-3,
                            "grpo.num_generations": 2, "grpo.num_iterations": 2,
                            "grpo.beta": 0.1})
    t = trainer.Trainer(cfg, tmp_path / "run", get_algorithm("grpo"), progress=False)
    assert t.algorithm.group_size == 2
    pair = trainer.tasks_for_step(t.train_tasks, 0, 1, 2)
    # Each group: a junk rollout and the gold one, so the advantages are +-1.
    junk = agent.run_episodes(t.env, pair, policies.RandomPolicy(seed=0), t.ctx.tokenizer, 3, 48, 2)
    gold = agent.run_episodes(t.env, pair, policies.OraclePolicy(), t.ctx.tokenizer, 8, 96, 2)
    batch = StepBatch(1, [pair[0], pair[0], pair[1], pair[1]],
                              [junk[0], gold[0], junk[1], gold[1]])
    assert [r.success for r in batch.rollouts] == [False, True, False, True]
    before = {k: v.clone() for k, v in t.ctx.student.state_dict().items()}
    figures = t.algorithm.step(batch)
    assert figures["action_tokens"] > 0 and figures["kl_ref"] >= 0
    assert any(not torch.equal(v, t.ctx.student.state_dict()[k]) for k, v in before.items())


def test_the_anchor_cache_gives_the_uncached_steps(inputs, tmp_path):
    """φ0's latents served from the cache (the same batch twice: the second step's anchor inputs
    are all cached) give the steps of a run that re-encodes them."""
    runs = {}
    for name, mb in (("cached", 256.0), ("uncached", 0.0)):
        t = build(inputs, tmp_path / name, **{"lopd.anchor_cache_mb": mb,
                                               "lopd.add_successes": False})
        batch = one_batch(t)
        torch.manual_seed(0)
        runs[name] = (t, [t.algorithm.step(batch) for _ in range(2)])
    cached, uncached = runs["cached"][1], runs["uncached"][1]
    assert len(runs["cached"][0].algorithm.composer._anchor_cache) > 0
    assert runs["uncached"][0].algorithm.composer._anchor_cache is None
    for a, b in zip(cached, uncached):
        for key in ("kl", "kl_composer", "delta", "anchor", "loss_composer"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    assert cached[1]["anchor"] > 0                  # φ moved away from φ0 after one step


def test_a_frozen_composer_builds_no_graph_and_no_anchor(inputs, tmp_path):
    t = build(inputs, tmp_path / "frozen", **{"lopd.update_composer": False})
    alg = t.algorithm
    batch = one_batch(t)
    state = alg.before_step(batch)
    state["_times"] = defaultdict(float)
    scores = alg.score(micro_batches(batch.rollouts, 0)[0], state)
    assert not scores.extras["latents"].requires_grad
    assert scores.extras["anchor_latents"] is scores.extras["latents"]
    figures = alg.step(batch)
    assert figures["anchor"] == 0.0 and "composer/grad_norm" not in figures


def test_the_release_preset_is_tiny_with_self_retrieval_and_a_static_bank(inputs, tmp_path):
    """``lopd-release``: the tiny default with exactly the release's two retrieval choices; a step
    under them reads a task's own stored success and leaves the bank as built."""
    import dataclasses

    from lopd.config import load_config
    from lopd.experience import retrieve

    def flat(node, prefix=""):
        if not isinstance(node, dict):
            return {prefix: node}
        return {k: v for key, value in node.items() for k, v in flat(value, f"{prefix}.{key}").items()}

    release, tiny = (flat(dataclasses.asdict(load_config(name))) for name in ("lopd-release", "tiny"))
    differ = {key for key in tiny if release[key] != tiny[key]}
    assert set(release) == set(tiny)
    assert differ == {".bank.allow_self_retrieval", ".methods.lopd.add_successes"}
    assert release[".bank.allow_self_retrieval"] is True
    assert release[".methods.lopd.add_successes"] is False
    t = build(inputs, tmp_path / "run", **{"bank.allow_self_retrieval": True,
                                           "lopd.add_successes": False})
    alg = t.algorithm
    batch = one_batch(t)
    size = len(alg.bank)
    context = alg.before_step(batch)["teacher_context"]
    own = [[h.entry.trace for h in hits]
           for hits in retrieve(alg.bank, batch.rollouts, alg.n_ret, leave_one_out=False)]
    others = [[h.entry.trace for h in hits]
              for hits in retrieve(alg.bank, batch.rollouts, alg.n_ret, leave_one_out=True)]
    assert context == own and context != others
    figures = alg.step(batch)
    assert figures["bank/added"] == 0 and len(alg.bank) == size
