"""SDPO on the tiny base: sibling selection by hand (groups with 0, 1 and several successes), the
EMA teacher reads exactly the sibling's trace and the student never does (token ids), the loss is the
top-k + tail JSD over the signalled tokens by hand, a step moves the student towards the teacher,
micro-batched = one pass, exact resume of the EMA teacher, G = 1 refused at start-up naming the
key, and SDPO / Skill-SD reach the CLI and the config."""

from collections import defaultdict

import pytest
import torch

from conftest import resume_keeps_the_ema_teacher, small_config
from lopd import agent, losses, models, policies, trainer
from lopd.algorithms import get_algorithm
from lopd.algorithms.base import StepBatch, Totals, micro_batches
from lopd.algorithms.sdpo import SIBLING_PREFIX, sibling_sources
from lopd.config import ConfigError, load_config
from test_algorithms import assert_same, snapshot
from test_opsd import full_logprobs
from test_step_checks import plain_action_logprobs
from test_teacher_views import ids_of, index_of, rows


def build(run_dir, algo="sdpo", resume=False, **sets):
    cfg = small_config(**{"train.algorithm": algo, "train.rollouts_per_step": 8, **sets})
    return trainer.Trainer(cfg, run_dir, get_algorithm(algo), resume=resume, progress=False)


def group_batch(t, patterns, step=1, tasks=None):
    """A step of one group per pattern: for the step's i-th task (or ``tasks[i]``), a rollout per
    letter of ``patterns[i]`` — ``g`` the oracle's (a success), ``j`` a random policy's (a failure;
    the k-th junk of a group uses seed k, so junk rollouts differ)."""
    tasks = tasks or trainer.tasks_for_step(t.train_tasks, 0, step, len(patterns))
    tok = t.ctx.tokenizer
    gold = agent.run_episodes(t.env, tasks, policies.OraclePolicy(), tok, 8, 96, len(tasks))
    junk = [agent.run_episodes(t.env, tasks, policies.RandomPolicy(seed=k), tok, 3, 48, len(tasks))
            for k in range(max(p.count("j") for p in patterns))]
    out_tasks, rollouts = [], []
    for i, (task, pattern) in enumerate(zip(tasks, patterns)):
        k = 0
        for letter in pattern:
            if letter == "g":
                rollouts.append(gold[i])
            else:
                rollouts.append(junk[k][i])
                k += 1
            out_tasks.append(task)
    assert [r.success for r in rollouts] == [c == "g" for c in "".join(patterns)]
    return StepBatch(step, out_tasks, rollouts)


def scored(alg, batch, micro_size=0):
    state = alg.before_step(batch)
    state["_times"] = defaultdict(float)
    (micro,) = micro_batches(batch.rollouts, micro_size)
    with torch.no_grad():
        return state, micro, alg.score(micro, state)


def test_the_sibling_is_the_first_other_success_of_the_group_by_hand():
    F, T = False, True
    successes = [F, F, F, F,      # no success: nobody has a teacher signal
                 T, F, F, F,      # one: the failures read it, the success itself reads nothing
                 F, T, T, F,      # two: each success reads the other, the failures the first
                 T, T, T, T]      # all: each reads the first success that is not itself
    assert sibling_sources(successes, 4) == [None, None, None, None,
                                             None, 4, 4, 4,
                                             9, 10, 9, 9,
                                             13, 12, 12, 12]
    assert sibling_sources([T, T], 2) == [1, 0] and sibling_sources([T, F], 2) == [None, 0]
    with pytest.raises(ValueError, match="groups of 4"):
        sibling_sources([T] * 6, 4)


def test_the_ema_teacher_reads_the_siblings_trace_and_the_student_never_does(tmp_path):
    t = build(tmp_path / "run")
    alg, tok = t.algorithm, t.ctx.tokenizer
    assert alg.group_size == 4 and t.cfg.sdpo.ema_rate == 0.05
    batch = group_batch(t, ["jgjj", "ggjj"])
    state, _, scores = scored(alg, batch)
    chars = t.cfg.bank.max_observation_chars
    r = batch.rollouts
    sibling = {0: 1, 2: 1, 3: 1, 4: 5, 5: 4, 6: 4, 7: 4}   # rollout 1: its group's only success
    assert state["teacher_context"] == [[r[sibling[i]].compact_trace(chars)] if i in sibling else []
                                        for i in range(8)]
    assert state["signal"].tolist() == [1, 0, 1, 1, 1, 1, 1, 1]
    assert state["signal_tokens"] == sum(sum(x.action_mask) for i, x in enumerate(r) if i != 1)
    assert alg.teacher.teacher is alg.ema.model
    header = ids_of(tok, "<|im_start|>user\n")
    teacher_rows = rows(alg.teacher.batch(r, state["teacher_context"]))
    for i, (rollout, (ids, mask)) in enumerate(zip(r, teacher_rows)):
        # A scored row ends at its last action token.
        end = max(j for j, m in enumerate(rollout.action_mask) if m) + 1
        if i not in sibling:      # no sibling: the teacher reads the rollout as the student did
            assert ids == rollout.input_ids[:end] and mask == rollout.action_mask[:end]
            continue
        at = index_of(rollout.input_ids, header) + len(header)
        block = (ids_of(tok, SIBLING_PREFIX) + ids_of(tok, r[sibling[i]].compact_trace(chars))
                 + ids_of(tok, "\n\n"))
        assert ids == (rollout.input_ids[:at] + block + rollout.input_ids[at:])[:len(block) + end]
        assert SIBLING_PREFIX not in tok.decode(rollout.input_ids)
    student = torch.cat([plain_action_logprobs(t.ctx.student, x.input_ids, x.action_mask)
                         for x in r])
    teacher = torch.cat([plain_action_logprobs(alg.ema.model, ids, mask)
                         for ids, mask in teacher_rows])
    assert torch.equal(scores.student.targets, scores.teacher.targets)
    # Padded batch against one-sequence passes: fp32 agreement, relative at large |log p|.
    assert torch.allclose(scores.student.token_logprobs(), student, rtol=1e-5, atol=1e-5)
    assert torch.allclose(scores.teacher.token_logprobs(), teacher, rtol=1e-5, atol=1e-5)


def test_the_loss_is_the_top_k_jsd_over_the_signalled_tokens_by_hand(tmp_path):
    t = build(tmp_path / "run", **{"sdpo.top_k": 7, "train.loss_chunk_tokens": 5})
    alg = t.algorithm
    t.ctx.student.load_state_dict(models.build_model(t.ctx.tokenizer, "qwen3-1m",
                                                     seed=1).state_dict())
    batch = group_batch(t, ["jgjj", "jjjj"])     # the second group has no success at all
    state, _, scores = scored(alg, batch)
    context = state["teacher_context"]
    per_rollout = []
    for i, (rollout, (ids, mask)) in enumerate(zip(batch.rollouts, rows(
            alg.teacher.batch(batch.rollouts, context)))):
        s = full_logprobs(t.ctx.student, rollout.input_ids, rollout.action_mask).double()
        q = full_logprobs(alg.ema.model, ids, mask).double()
        # By hand: the student's top 7, the tail as 1 − their mass, mixture at α = 0.5.
        top = s.topk(7, dim=-1).indices
        ps, pt = s.exp().gather(-1, top), q.exp().gather(-1, top)
        ps = torch.cat([ps, 1 - ps.sum(-1, keepdim=True)], -1)
        pt = torch.cat([pt, 1 - pt.sum(-1, keepdim=True)], -1)
        m = 0.5 * ps + 0.5 * pt
        jsd = 0.5 * (ps * (ps / m).log()).sum(-1) + 0.5 * (pt * (pt / m).log()).sum(-1)
        per_rollout.append(jsd if context[i] else None)
    kept = torch.cat([j for j in per_rollout if j is not None])
    assert sum(j is not None for j in per_rollout) == 3 and kept.mean() > 1e-3
    terms = alg.loss(micro_batches(batch.rollouts, 0)[0], scores, state, Totals.of(batch.rollouts))
    assert terms.losses["student"].item() == pytest.approx(kept.mean().item(), rel=1e-4)
    figures = alg.step(batch)
    assert figures["kl"] == pytest.approx(kept.mean().item(), rel=1e-4)
    assert figures["sdpo/without_sibling"] == pytest.approx(5 / 8)


def test_one_step_moves_the_student_towards_the_siblings_teacher(tmp_path):
    # The base student and its EMA copy differ only by the sibling's trace. (A random-init student
    # is no test here: its top-k support moves with each step, so the JSD measured on the new
    # support need not fall even when the step lowered it on the old one.)
    t = build(tmp_path / "run", **{"train.learning_rate": 1e-4})
    alg = t.algorithm
    batch = group_batch(t, ["jgjj", "ggjj"])

    def towards(teacher=None):
        state, _, scores = scored(alg, batch)
        teacher = teacher if teacher is not None else scores.teacher
        with torch.no_grad():
            from lopd.teacher import per_token

            top, jsd = per_token(lambda s, q, y: (s.gather(-1, q.argmax(-1, keepdim=True))
                                                  .squeeze(-1), losses.jsd_top_k(s, q, 0.5, 100)),
                                 scores.student, teacher)
        w = state["signal"][scores.student.rows]
        return (top * w).sum().item() / w.sum().item(), (jsd * w).sum().item() / w.sum().item(), \
            teacher

    top0, jsd0, teacher = towards()
    assert alg.step(batch)["student/skipped_updates"] == 0
    top1, jsd1, _ = towards(teacher)
    assert top1 > top0 + 1e-3 and jsd1 < 0.8 * jsd0 and jsd0 > 1e-3, (top0, top1, jsd0, jsd1)


def test_micro_batched_sdpo_step_equals_the_one_batch_step(tmp_path):
    batch = {}
    runs = []
    for name, micro in (("whole", 0), ("parts", 3)):
        t = build(tmp_path / name, **{"train.learning_rate": 1e-5, "sdpo.ema_rate": 0.5,
                                      "train.per_device_train_batch_size": micro})
        batch.setdefault("b", group_batch(t, ["jgjj", "ggjg"]))
        runs.append((t, t.algorithm.step(batch["b"])))
    (whole, f_whole), (parts, f_parts) = runs
    assert f_whole["micro_batches"] == 1 and f_parts["micro_batches"] == 3
    assert f_whole["kl"] > 0
    for key in ("kl", "teacher_gain", "student/grad_norm", "sdpo/without_sibling"):
        assert f_parts[key] == pytest.approx(f_whole[key], rel=0, abs=1e-6), key
    assert_same(snapshot(whole.ctx.student.parameters()), snapshot(parts.ctx.student.parameters()),
                "student")
    assert_same(snapshot(whole.algorithm.ema.model.parameters()),
                snapshot(parts.algorithm.ema.model.parameters()), "EMA teacher")


def test_a_resumed_run_has_the_uninterrupted_runs_ema_teacher(tmp_path):
    sets = {"train.eval_every": 100, "train.save_every": 2, "train.learning_rate": 1e-3,
            "sdpo.ema_rate": 0.2, "env.train_size": 4}
    a, b = resume_keeps_the_ema_teacher(build, tmp_path, sets)
    assert any(a[s]["kl"] > 0 for s in (3, 4))
    for step in (3, 4):
        for key in ("kl", "teacher_gain", "sdpo/without_sibling", "train/mean_reward"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5, abs=1e-7), (step, key)


@pytest.mark.parametrize("algo", ["sdpo", "skill_sd"])
def test_a_group_of_one_fails_at_start_up_naming_the_key(tmp_path, capsys, algo):
    from lopd.cli import main

    with pytest.raises(ConfigError, match=f"^{algo}.num_generations: got 1; "):
        load_config("tiny", [f"train.algorithm={algo}", f"{algo}.num_generations=1"])
    sets = ["env.train_size=8", "env.eval_size=2", "env.pretrain_size=0", "train.eval_tasks=2",
            f"{algo}.num_generations=1"]
    args = ["train", "--algo", algo, "--out", str(tmp_path / "cli")]
    assert main([*args, *[x for s in sets for x in ("--set", s)]]) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if "num_generations" in x]
    assert f"{algo}.num_generations: got 1" in line and "at least 2 rollouts per task" in line
    assert not (tmp_path / "cli").exists()


def test_sdpo_and_skill_sd_reach_the_cli_and_the_config(capsys):
    from lopd.cli import build_parser, main

    train = next(a for a in build_parser()._subparsers._group_actions[0].choices["train"]._actions
                 if a.dest == "algo")
    assert {"sdpo", "skill_sd"} <= set(train.choices)
    from lopd.experiments.compare import check_algos

    check_algos(["base", "grpo", "sdpo", "skill_sd"])     # `lopd compare --algos` takes them
    assert main(["config", "--set", "sdpo.alpha=0.25", "--set", "skill_sd.ucb_c=1.5"]) == 0
    out = capsys.readouterr().out
    assert "sdpo.alpha" in out and "0.25" in out and "skill_sd.ucb_c" in out and "1.5" in out
    cfg = load_config("tiny", ["train.algorithm=sdpo"])
    assert (cfg.sdpo.num_generations, cfg.sdpo.ema_rate, cfg.sdpo.alpha, cfg.sdpo.top_k,
            cfg.sdpo.placement) == (4, 0.05, 0.5, 100, "user")
    s = cfg.skill_sd
    assert (s.num_generations, s.epsilon, s.epsilon_high, s.sdl_coef, s.ucb_c, s.num_iterations,
            s.placement) == (4, 0.2, 0.28, 0.001, 2.0, 1, "user")
    with pytest.raises(ConfigError, match="sdpo.alpha"):
        load_config("tiny", ["sdpo.alpha=1.5"])
    with pytest.raises(ConfigError, match="skill_sd.epsilon_high"):
        load_config("tiny", ["skill_sd.epsilon_high=0"])
