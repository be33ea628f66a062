"""Skill-SD: the skill summary of a compact trace by hand, UCB1 against a hand-worked sequence, the
sampled-token reverse KL by hand, the teacher reads exactly the chosen skill and the student never
does (token ids), the clipped loss and the clip fractions against a hand computation (both stds),
every pass at μ = 2 distils from the first pass's teacher, a step moves the student the expected
way (PPO on advantages; the distillation term towards the teacher), reward feedback and library
growth, micro-batched = one pass, exact resume of library and statistics, validation tasks never
enter the library. (G = 1 refused, CLI and config: test_sdpo.py.)"""

import math

import pytest
import torch

from conftest import scored_length, small_config
from lopd import losses, trainer
from lopd.algorithms import get_algorithm
from lopd.algorithms.base import StepBatch, Totals
from lopd.algorithms.skill_sd import SKILL_PREFIX, SkillLibrary, skill_summary
from test_algorithms import assert_same, snapshot
from test_sdpo import group_batch, scored
from test_step_checks import plain_action_logprobs
from test_teacher_views import ids_of, index_of, rows


def build(run_dir, resume=False, **sets):
    cfg = small_config(**{"train.algorithm": "skill_sd", "train.rollouts_per_step": 8, **sets})
    return trainer.Trainer(cfg, run_dir, get_algorithm("skill_sd"), resume=resume, progress=False)


def test_the_skill_summary_of_a_compact_trace_by_hand():
    trace = ('Task: Cancel order O226 of customer C384.\n'
             '1. cancel_order({"order_id": "O226"}) -> Error: order O226 is already shipped\n'
             '2. malformed: <tool_call>{"name": oops -> Error: invalid JSON in tool call\n'
             '3. open_ticket({"order_id": "O226", "reason": "already_shipped", "n": 2}) -> '
             '{"ticket_id":"T1"}\n'
             '4. answer: Done. Task Completed')
    assert skill_summary(trace) == (
        '- workflow: cancel_order -> open_ticket -> answer\n'
        '- key values: order_id=O226; reason=already_shipped; n=2\n'
        '- failed on the way (avoid): cancel_order(order_id=O226): Error: order O226 is already '
        'shipped | malformed: <tool_call>{"name": oops\n'
        '- final answer: Done. Task Completed')
    # A code answer (codeworld): whole, with its lines; an instruction holding "1. " lines and a
    # type hint's " -> " do not confuse the steps; a failed attempt's feedback is left out.
    code = "```python\ndef f(x: int) -> int:\n    return x + 1\n```"
    trace = (f"Task: Write f.\n1. it takes an int\n2. it adds one\n1. answer:\n```python\n"
             f"def f(x):\n    return x\n```\n-> 0 of 3 tests passed\n2. answer:\n{code}")
    assert skill_summary(trace) == f"- workflow: answer -> answer\n- final answer:\n{code}"
    assert skill_summary("Task: nothing happened") == "- workflow: (none)"


def test_ucb1_chooses_by_a_hand_worked_sequence():
    library = SkillLibrary(c=2.0)
    assert library.choose("t") is None
    for text in "ABC":
        assert library.add("t", text)
    assert not library.add("t", "B") and len(library) == 3          # a held skill is not re-added
    feedback = [1.0, 0.0, 0.5, 0.0, 1.0, 0.0, 0.25, 0.0]
    chosen = []
    for reward in feedback:
        chosen.append(library.choose("t"))
        library.record("t", chosen[-1], reward)
    # 0, 1, 2: each untried skill once, oldest first. Then mean + 2·sqrt(ln N / n):
    # N=3: A 1 + 2·1.048 = 3.096, B 2.096, C 2.596                        -> A
    # N=4: A .5 + 2·sqrt(1.386/2) = 2.165, B 2·1.177 = 2.355, C 2.855      -> C
    # N=5: A .5 + 1.794 = 2.294, B 2.537, C .75 + 1.794 = 2.544            -> C
    # N=6: A .5 + 1.893 = 2.393, B 2.677, C .5 + 2·sqrt(1.792/3) = 2.046   -> B
    # N=7: A .5 + 1.973 = 2.473, B .125 + 1.973 = 2.098, C .5 + 1.611 = 2.111 -> A
    assert chosen == [0, 1, 2, 0, 2, 2, 1, 0]
    stats = [(s.pulls, s.reward_sum) for s in library.skills["t"]]
    assert stats == [(3, 1.0), (2, 0.25), (3, 1.5)]
    # N=8: A 1/3 + 1.665 = 1.998, B .125 + 2.039 = 2.164, C .5 + 1.665 = 2.165 -> C
    assert library.choose("t") == 2
    library.add("t", "D")
    assert library.choose("t") == 3          # a new skill is tried first
    tie = SkillLibrary(c=0.0)
    tie.add("u", "x"), tie.add("u", "y")
    tie.record("u", 0, 0.5), tie.record("u", 1, 0.5)
    assert tie.choose("u") == 0              # equal scores: the oldest
    copy = SkillLibrary(c=2.0)
    copy.load_state_dict(library.state_dict())
    assert copy.state_dict() == library.state_dict()


def test_the_sampled_reverse_kl_by_hand():
    logprobs = torch.tensor([-0.5, -2.0, -1.0], requires_grad=True)
    old = torch.tensor([-0.5, -1.5, -1.2])
    teacher = torch.tensor([-1.0, -1.0, -1.0])
    values = losses.sampled_reverse_kl(logprobs, old, teacher)
    rho = [1.0, math.exp(-0.5), math.exp(0.2)]
    gap = [0.5, -1.0, 0.0]
    assert values.tolist() == pytest.approx([r * g for r, g in zip(rho, gap)], rel=1e-6)
    values.sum().backward()
    # d/dlogπ [ρ · sg(gap)] = ρ · gap: the reverse KL's score-function gradient.
    assert logprobs.grad.tolist() == pytest.approx([r * g for r, g in zip(rho, gap)], rel=1e-6)


def prefill(alg, batch, group=0):
    """The library holding, for the task of ``group``, the skill of that group's first success."""
    g = alg.group_size
    task = batch.tasks[group * g]
    gold = next(r for r in batch.rollouts[group * g:(group + 1) * g] if r.success)
    text = skill_summary(gold.compact_trace(alg.max_observation_chars))
    alg.library.add(alg.pool_of(task), text, task.task_id)
    return text


def test_the_teacher_reads_the_chosen_skill_and_the_student_never_does(tmp_path):
    t = build(tmp_path / "run", **{"skill_sd.pool": "task"})
    alg, tok = t.algorithm, t.ctx.tokenizer
    batch = group_batch(t, ["jgjj", "gjjj"])
    task0 = batch.tasks[0].task_id
    alg.library.add(task0, "- workflow: nothing useful")
    alg.library.record(task0, 0, 0.0)
    skill = prefill(alg, batch)                 # untried: UCB1 takes it
    state, _, scores = scored(alg, batch)
    assert state["chosen"] == [1] * 4 + [None] * 4
    assert state["teacher_context"] == [[skill]] * 4 + [[]] * 4
    assert alg.teacher.teacher is t.ctx.student      # synchronised: the student's own weights
    header = ids_of(tok, "<|im_start|>user\n")
    teacher_rows = rows(alg.teacher.batch(batch.rollouts, state["teacher_context"]))
    for i, (rollout, (ids, mask)) in enumerate(zip(batch.rollouts, teacher_rows)):
        assert SKILL_PREFIX not in tok.decode(rollout.input_ids)
        if i >= 4:
            end = scored_length(rollout.action_mask)
            assert ids == rollout.input_ids[:end] and mask == rollout.action_mask[:end]
            continue
        at = index_of(rollout.input_ids, header) + len(header)
        block = ids_of(tok, SKILL_PREFIX) + ids_of(tok, skill) + ids_of(tok, "\n\n")
        end = len(block) + scored_length(rollout.action_mask)
        assert ids == (rollout.input_ids[:at] + block + rollout.input_ids[at:])[:end]
    teacher = torch.cat([plain_action_logprobs(t.ctx.student, ids, mask)
                         for ids, mask in teacher_rows])
    assert torch.allclose(scores.teacher.token_logprobs(), teacher, rtol=1e-5, atol=1e-5)
    gap = (scores.teacher.token_logprobs() - scores.student.token_logprobs()).abs()
    assert gap[scores.student.rows >= 4].max() < 1e-5 and gap[scores.student.rows < 4].max() > 1e-3


@pytest.mark.parametrize("std", ["sample", "population"])
def test_the_clipped_loss_equals_a_hand_computation(tmp_path, std):
    # 'sample' is the default: Bessel's correction, n − 1, as TRL's GRPO.
    t = build(tmp_path / "run", **{"skill_sd.sdl_coef": 0.3,
                                   **({} if std == "sample" else {"skill_sd.std": std})})
    alg = t.algorithm
    batch = group_batch(t, ["jgjg", "gjjj"])
    prefill(alg, batch)
    state, micro, scores = scored(alg, batch)
    new = scores.student.token_logprobs().detach()
    # A made-up π_old that puts ratios on both sides of both clip bounds.
    offsets = torch.tensor([0.5, -0.5, 0.1, -0.1, 0.0, 0.3, -0.3])
    old = new - offsets.repeat(new.numel() // 7 + 1)[:new.numel()]
    state["old"] = {0: old}
    terms = alg.loss(micro, scores, state, Totals.of(batch.rollouts))
    rows_ = scores.student.rows.tolist()
    teacher = scores.teacher.token_logprobs().tolist()
    rewards = batch.rewards.tolist()
    advantages = []
    for g in range(2):
        group = rewards[4 * g:4 * g + 4]
        mean = sum(group) / 4
        std_ = math.sqrt(sum((r - mean) ** 2 for r in group) / (3 if std == "sample" else 4))
        advantages += [(r - mean) / (std_ + 1e-4) for r in group]
    ppo = sdl = low = high = 0.0
    for lp, lo, lt, row in zip(new.tolist(), old.tolist(), teacher, rows_):
        ratio, a = math.exp(lp - lo), advantages[row]
        ppo -= min(ratio * a, min(max(ratio, 0.8), 1.28) * a)
        low += ratio < 0.8 and a < 0       # where the clip binds: TRL's clip_ratio/low, /high
        high += ratio > 1.28 and a > 0
        sdl += ratio * (lp - lt) if row < 4 else 0.0
    n, n_skill = len(rows_), sum(1 for row in rows_ if row < 4)
    expected = ppo / n + 0.3 * sdl / n_skill
    assert 0 < low < n and 0 < high < n and abs(sdl) > 1e-3
    assert terms.metrics["ppo_loss"].item() == pytest.approx(ppo / n, rel=1e-5)
    assert terms.metrics["sdl"].item() == pytest.approx(sdl / n_skill, rel=1e-5)
    assert terms.losses["student"].item() == pytest.approx(expected, rel=1e-5)
    assert terms.metrics["clip_fraction/low"].item() == pytest.approx(low / n)
    assert terms.metrics["clip_fraction/high"].item() == pytest.approx(high / n)
    assert terms.metrics["clip_fraction"].item() == pytest.approx((low + high) / n)


def test_every_pass_distils_from_the_first_passs_teacher(tmp_path, monkeypatch):
    # μ = 2: the teacher is the student's weights at the start of the step. The shared step keeps
    # the teacher's hidden states from pass 0, but the output head is the live student's, moved by
    # pass 0's update: pass 1 must reuse pass 0's teacher log-probs, not re-apply the new head.
    t = build(tmp_path / "run", **{"train.learning_rate": 1e-3, "skill_sd.sdl_coef": 1.0,
                                   "skill_sd.num_iterations": 2})
    alg = t.algorithm
    batch = group_batch(t, ["jgjg", "gjjj"])
    prefill(alg, batch)
    _, _, before = scored(alg, batch)
    start = before.teacher.token_logprobs()
    calls = []
    kl = losses.sampled_reverse_kl

    def recording(logprobs, old, teacher):
        calls.append((logprobs.detach().clone(), old.clone(), teacher.detach().clone()))
        return kl(logprobs, old, teacher)

    monkeypatch.setattr(losses, "sampled_reverse_kl", recording)
    figures = alg.step(batch)
    assert len(calls) == 2 and figures["student/skipped_updates"] == 0
    assert torch.allclose(calls[0][2], start, rtol=0, atol=1e-6)
    assert torch.equal(calls[1][2], calls[0][2])
    # The test means something: the student (and so the live teacher) moved between the passes.
    _, _, after = scored(alg, batch)
    assert (after.teacher.token_logprobs() - start).abs().max() > 1e-3
    assert (calls[1][0] - calls[0][0]).abs().max() > 1e-3
    # Pass 1's figure is ρ · (log π − log π_T) over the skill tokens with pass 0's teacher.
    lp, old, _ = calls[1]
    skill = before.student.rows < 4
    sdl = (torch.exp(lp - old) * (lp - start))[skill].sum() / skill.sum()
    assert figures["sdl"] == pytest.approx(sdl.item(), rel=1e-5)


def mean_logprob(model, rollout):
    with torch.no_grad():
        return plain_action_logprobs(model, rollout.input_ids, rollout.action_mask).mean().item()


def test_the_ppo_term_raises_successes_and_lowers_failures(tmp_path):
    t = build(tmp_path / "run", **{"train.learning_rate": 1e-4, "skill_sd.sdl_coef": 0.0})
    batch = group_batch(t, ["jgjg", "gjjj"])
    before = [mean_logprob(t.ctx.student, r) for r in batch.rollouts]
    assert t.algorithm.step(batch)["student/skipped_updates"] == 0
    after = [mean_logprob(t.ctx.student, r) for r in batch.rollouts]
    for r, b, a in zip(batch.rollouts, before, after):
        assert (a > b) if r.success else (a < b), (r.success, b, a)


def test_the_distillation_term_moves_the_student_towards_the_skill_teacher(tmp_path):
    # One failure four times over: equal rewards, every advantage 0, only λ_sdl · reverse KL acts;
    # the teacher reads the skill of the task's oracle success.
    t = build(tmp_path / "run", **{"train.learning_rate": 1e-4, "skill_sd.sdl_coef": 1.0,
                                   "train.rollouts_per_step": 4})
    alg = t.algorithm
    source = group_batch(t, ["jg"])
    junk, gold = source.rollouts
    alg.library.add(alg.pool_of(source.tasks[0]), skill_summary(gold.compact_trace(80)),
                    source.tasks[0].task_id)
    batch = StepBatch(1, [source.tasks[0]] * 4, [junk] * 4)
    state, _, scores = scored(alg, batch)
    old = scores.student.token_logprobs()
    gap = old - scores.teacher.token_logprobs()          # log π − log π_T before the step
    figures = alg.step(batch)
    assert figures["ppo_loss"] == 0 and figures["sdl"] == pytest.approx(gap.mean().item(), rel=1e-5)
    _, _, after = scored(alg, batch)
    moved = after.student.token_logprobs() - old
    # Tokens the teacher finds less likely lose probability, the others gain it.
    assert (gap * moved).sum() < 0
    assert moved[gap > 0.05].mean() < 0 < moved[gap < -0.05].mean()


def test_rewards_update_the_chosen_skill_and_successes_enter_the_library(tmp_path):
    t = build(tmp_path / "run", **{"skill_sd.pool": "task"})
    alg = t.algorithm
    batch = group_batch(t, ["jgjg", "gjjj"])
    skill = prefill(alg, batch)
    task0, task1 = batch.tasks[0].task_id, batch.tasks[4].task_id
    figures = alg.step(batch)
    (held,) = alg.library.skills[task0]          # the group's success was the skill already
    assert held.text == skill and held.pulls == 4
    assert held.reward_sum == pytest.approx(sum(r.reward for r in batch.rollouts[:4]))
    (new,) = alg.library.skills[task1]
    assert new.text == skill_summary(batch.rollouts[4].compact_trace(alg.max_observation_chars))
    assert new.pulls == 0
    assert figures["skill_sd/without_skill"] == 0.5 and figures["skill_sd/added"] == 1
    assert figures["skill_sd/skills"] == 2 and figures["sdl"] != 0


def test_micro_batched_skill_sd_step_equals_the_one_batch_step(tmp_path):
    batch, runs = {}, []
    for name, micro in (("whole", 0), ("parts", 3)):
        t = build(tmp_path / name, **{"train.learning_rate": 1e-5, "skill_sd.sdl_coef": 0.5,
                                      "skill_sd.num_iterations": 2,
                                      "train.per_device_train_batch_size": micro})
        batch.setdefault("b", group_batch(t, ["jgjg", "gjjg"]))
        prefill(t.algorithm, batch["b"])
        runs.append((t, t.algorithm.step(batch["b"])))
    (whole, f_whole), (parts, f_parts) = runs
    assert f_whole["micro_batches"] == 1 and f_parts["micro_batches"] == 3
    assert f_whole["sdl"] != 0 and f_whole["clip_fraction"] >= 0
    for key in ("loss", "ppo_loss", "sdl", "clip_fraction", "clip_fraction/low",
                "clip_fraction/high", "student/grad_norm"):
        # The gradient norm sums every parameter's squares in another order per micro-batch
        # split: on an AMD EPYC CPU that is 1.5e-6 of a norm near 1 (fp32 noise), hence relative.
        tol = {"rel": 1e-5} if key == "student/grad_norm" else {"rel": 0, "abs": 1e-6}
        assert f_parts[key] == pytest.approx(f_whole[key], **tol), key
    assert_same(snapshot(whole.ctx.student.parameters()), snapshot(parts.ctx.student.parameters()),
                "student")
    assert whole.algorithm.library.state_dict() == parts.algorithm.library.state_dict()


def test_a_resumed_run_has_the_uninterrupted_runs_library_and_statistics(tmp_path):
    sets = {"env.train_size": 4, "train.eval_every": 100, "train.save_every": 3,
            "train.learning_rate": 1e-3}
    whole = build(tmp_path / "whole", **{"train.max_steps": 6, **sets})
    whole.run()
    build(tmp_path / "cut", **{"train.max_steps": 3, **sets}).run()
    resumed = build(tmp_path / "cut", resume=True, **{"train.max_steps": 6, **sets})
    restored = resumed.algorithm.library.state_dict()
    assert restored and any(s["pulls"] > 0 for skills in restored.values() for s in skills)
    resumed.run()
    assert resumed.algorithm.library.state_dict() == whole.algorithm.library.state_dict()
    for a, b in zip(whole.ctx.student.parameters(), resumed.ctx.student.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)
    a = {r["step"]: r for r in trainer.read_jsonl(tmp_path / "whole" / trainer.METRICS_FILE)}
    b = {r["step"]: r for r in trainer.read_jsonl(tmp_path / "cut" / trainer.METRICS_FILE)}
    assert any(a[s]["sdl"] != 0 for s in (4, 5, 6))
    for step in (4, 5, 6):
        for key in ("loss", "sdl", "skill_sd/skills", "skill_sd/without_skill",
                    "train/mean_reward"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5, abs=1e-7), (step, key)


def test_validation_tasks_never_enter_the_library(tmp_path):
    t = build(tmp_path / "run", **{"train.eval_split": "validation", "train.max_steps": 2,
                                   "train.eval_every": 100, "env.train_size": 8})
    validation = {task.task_id for task in t.eval_tasks}
    assert validation and t.algorithm.library.withheld == validation
    with pytest.raises(ValueError, match="withheld for validation"):
        t.algorithm.library.add("ecommerce", "- workflow: answer", sorted(validation)[0])
    t.run()
    sources = {s.source for skills in t.algorithm.library.skills.values() for s in skills}
    assert sources and not sources & validation


def test_a_task_draws_the_skills_of_its_domain_never_of_another(tmp_path):
    """pool 'domain' (the default): a task met for the first time gets a skill made from another
    task of its domain; a task of another domain gets none; successes enter their domain's pool
    with their source task; pool 'task' gives the first-met task nothing."""
    t = build(tmp_path / "run")
    alg = t.algorithm
    assert alg.spec.pool == "domain"
    tasks = t.train_tasks
    first = tasks[0]
    same = next(x for x in tasks[1:] if x.domain == first.domain)
    other = next(x for x in tasks[1:] if x.domain != first.domain)
    alg.library.add(alg.pool_of(first), "- workflow: lookup -> answer", first.task_id)
    batch = group_batch(t, ["jjjj", "jjjj"], tasks=[same, other])
    state = alg.before_step(batch)
    assert state["chosen"] == [0] * 4 + [None] * 4
    assert state["teacher_context"][:4] == [["- workflow: lookup -> answer"]] * 4
    assert state["teacher_context"][4:] == [[]] * 4
    alg.after_update(batch, state, {})
    (skill,) = alg.library.skills[first.domain]
    assert skill.source == first.task_id and skill.pulls == 4
    per_task = build(tmp_path / "task", **{"skill_sd.pool": "task"}).algorithm
    per_task.library.add(first.task_id, "- workflow: lookup -> answer")
    assert per_task.pool_of(same) == same.task_id and per_task.library.choose(same.task_id) is None
