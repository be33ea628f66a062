"""SDFT on the tiny base: its EMA teacher reads the task's oracle demonstration and the student never
does (token ids), the EMA moves by the hand-computed average after an applied update and not after
a skipped one, a step moves the student towards the teacher, the start-up refusals, exact resume."""

import math
from collections import defaultdict

import pytest
import torch

from conftest import junk_and_gold_batch, resume_keeps_the_ema_teacher, scored_length, small_config
from lopd import losses, models, stages, trainer
from lopd.algorithms import get_algorithm
from lopd.algorithms.base import micro_batches
from lopd.algorithms.sdft import DEMONSTRATION_PREFIX
from lopd.envs.environment import OracleError
from lopd.teacher import per_token
from test_step_checks import plain_action_logprobs
from test_teacher_views import ids_of, index_of, rows


def build(run_dir, algo="sdft", resume=False, **sets):
    cfg = small_config(**{"train.algorithm": algo, **sets})
    return trainer.Trainer(cfg, run_dir, get_algorithm(algo), resume=resume, progress=False)


def scored(alg, batch):
    state = alg.before_step(batch)
    state["_times"] = defaultdict(float)
    (micro,) = micro_batches(batch.rollouts, 0)
    with torch.no_grad():
        return state, alg.score(micro, state)


def test_the_ema_teacher_reads_the_oracle_demonstration_and_the_student_never_does(tmp_path):
    t = build(tmp_path / "run")
    alg, tok = t.algorithm, t.ctx.tokenizer
    batch = junk_and_gold_batch(t, 2)
    state, scores = scored(alg, batch)
    chars = t.cfg.bank.max_observation_chars
    demos = [t.env.oracle_trace(task, chars) for task in batch.tasks]
    assert state["teacher_context"] == [[d] for d in demos]
    assert alg.teacher.teacher is alg.ema.model
    header = ids_of(tok, "<|im_start|>user\n")
    teacher_rows = rows(alg.teacher.batch(batch.rollouts, state["teacher_context"]))
    for rollout, demo, (ids, _) in zip(batch.rollouts, demos, teacher_rows):
        at = index_of(rollout.input_ids, header) + len(header)
        block = ids_of(tok, DEMONSTRATION_PREFIX) + ids_of(tok, demo) + ids_of(tok, "\n\n")
        end = len(block) + scored_length(rollout.action_mask)
        assert ids == (rollout.input_ids[:at] + block + rollout.input_ids[at:])[:end]
    # Both sides by plain forward passes: the student on its own tokens, the EMA copy on the
    # tokens with the demonstration.
    student = torch.cat([plain_action_logprobs(t.ctx.student, r.input_ids, r.action_mask)
                         for r in batch.rollouts])
    teacher = torch.cat([plain_action_logprobs(alg.ema.model, ids, mask)
                         for ids, mask in teacher_rows])
    assert torch.equal(scores.student.targets, scores.teacher.targets)
    assert (scores.student.token_logprobs() - student).abs().max() < 1e-5
    assert (scores.teacher.token_logprobs() - teacher).abs().max() < 1e-5
    assert (teacher - student).abs().max() > 1e-3


def test_the_ema_moves_by_the_hand_computed_average_after_an_applied_update_only(tmp_path):
    t = build(tmp_path / "run", **{"train.learning_rate": 1e-3})
    alg = t.algorithm
    batch = junk_and_gold_batch(t, 2)
    before = [p.detach().double().clone() for p in alg.ema.model.parameters()]
    figures = alg.step(batch)
    assert figures["student/skipped_updates"] == 0 and figures["ema/updates"] == 1
    rate = t.cfg.sdft.ema_rate
    assert rate == 0.01
    moved = 0
    for old, mine, student in zip(before, alg.ema.model.parameters(), t.ctx.student.parameters()):
        expected = (1 - rate) * old + rate * student.detach().double()
        assert torch.allclose(mine.double(), expected, rtol=0, atol=1e-7)
        moved += not torch.equal(mine.double(), old)
    assert moved > 0
    # A non-finite update is skipped by the student's optimiser: the teacher stays too.
    with torch.no_grad():
        next(t.ctx.student.parameters()).fill_(math.nan)
    kept = [p.detach().clone() for p in alg.ema.model.parameters()]
    figures = alg.step(batch)
    assert figures["student/skipped_updates"] == 1 and figures["ema/updates"] == 1
    assert all(torch.equal(a, b) for a, b in zip(kept, alg.ema.model.parameters()))


def towards_teacher(t, batch, teacher_scores=None):
    """The student's mean log-prob of the teacher's top token at each action position, and the
    forward top-M KL, against the given (or current) teacher scores."""
    _, scores = scored(t.algorithm, batch)
    teacher = teacher_scores if teacher_scores is not None else scores.teacher
    with torch.no_grad():
        top, kl = per_token(lambda s, q, y: (s.gather(-1, q.argmax(-1, keepdim=True)).squeeze(-1),
                                             losses.forward_kl_full(s, q)),
                            scores.student, teacher)
    return top.mean().item(), kl.mean().item(), teacher


@pytest.mark.parametrize("algo", ["sdft", "opsd"])
def test_one_step_moves_the_student_towards_the_teachers_preferred_tokens(tmp_path, algo):
    t = build(tmp_path / "run", algo, **{"train.learning_rate": 1e-3})
    # A random-init student far from the teacher (the EMA copy was taken of the base at start-up).
    t.ctx.student.load_state_dict(models.build_model(t.ctx.tokenizer, "qwen3-1m",
                                                     seed=1).state_dict())
    batch = junk_and_gold_batch(t, 2)
    top0, kl0, teacher = towards_teacher(t, batch)
    figures = t.algorithm.step(batch)
    assert figures["student/skipped_updates"] == 0
    top1, kl1, _ = towards_teacher(t, batch, teacher)
    assert top1 > top0 + 0.05 and kl1 < kl0 - 0.05, (top0, top1, kl0, kl1)


@pytest.mark.parametrize("algo", ["sdft", "opsd"])
def test_an_environment_without_oracle_trajectories_fails_at_start_up(tmp_path, monkeypatch,
                                                                       capsys, algo):
    from lopd.cli import main

    real = stages.get_env

    def no_oracles(cfg):
        env = real(cfg)
        env.oracle_splits = ()
        return env

    monkeypatch.setattr(stages, "get_env", no_oracles)
    with pytest.raises(OracleError, match=f"{algo} needs oracle trajectories, but environment "
                                          "toolworld has none"):
        build(tmp_path / "run", algo)
    sets = ["env.train_size=8", "env.eval_size=2", "env.pretrain_size=0", "train.eval_tasks=2"]
    args = ["train", "--algo", algo, "--out", str(tmp_path / "cli")]
    assert main([*args, *[x for s in sets for x in ("--set", s)]]) == 2
    (error,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert f"{algo} needs oracle trajectories" in error and "toolworld" in error


@pytest.mark.parametrize("algo", ["sdft", "opsd"])
def test_an_eval_task_among_the_training_tasks_fails_at_start_up(tmp_path, monkeypatch, algo):
    real = stages.held_out_tasks

    def leaky(cfg, env):
        train, held_out = real(cfg, env)
        return [*train, held_out[0]], held_out

    monkeypatch.setattr(stages, "held_out_tasks", leaky)
    with pytest.raises(OracleError, match=r"task toolworld/\w+/eval/00000 is in the eval split"):
        build(tmp_path / "run", algo)


def test_validation_tasks_never_give_out_their_oracle(tmp_path):
    t = build(tmp_path / "run", **{"train.eval_split": "validation"})
    validation = t.eval_tasks
    assert validation and all(task.split == "train" for task in validation)
    assert not set(t.algorithm.oracle.by_task) & {task.task_id for task in validation}
    with pytest.raises(OracleError, match=f"task {validation[0].task_id} is not a training task"):
        t.algorithm.oracle(validation[:1])


def test_a_resumed_run_has_the_uninterrupted_runs_ema_teacher(tmp_path):
    sets = {"train.eval_every": 100, "train.save_every": 2, "train.learning_rate": 1e-3,
            "sdft.ema_rate": 0.2}
    a, b = resume_keeps_the_ema_teacher(build, tmp_path, sets)
    for step in (3, 4):
        for key in ("kl", "teacher_gain", "train/mean_reward", "action_tokens"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5, abs=1e-7), (step, key)
