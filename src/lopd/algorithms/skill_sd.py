"""Skill-SD: PPO-clip on group advantages plus distillation from a teacher that reads a skill.

Skill-Conditioned Self-Distillation (Wang et al., 2026, arXiv 2604.10674) as the LOPD paper runs it
as a baseline (DESIGN §3, "Baselines"). The trainer rolls out G = ``skill_sd.num_generations``
rollouts of each task side by side. For the step's rollouts:

1. skill: each task's group gets one skill, chosen by UCB1 from the skills of the task's pool in
   the :class:`SkillLibrary` (``skill_sd.pool``: the task's domain by default, so a task draws on
   the successes of every task of its domain; ``task``: only the task's own earlier successes); a
   skill is a structured summary (:func:`skill_summary`: the tool sequence, the key argument
   values, the calls that failed on the way, the final answer) of the compact trace of an earlier
   *successful training rollout*;
2. teacher: the student's own weights at the start of the step (the teacher is synchronised with
   the student at every step), reading the skill in a block at the start of its first user
   message (``skill_sd.placement``), without gradient; the student never sees the skill;
3. student update: PPO-clip with group-normalised advantages (``skill_sd.std``: the group's
   sample std by default, as TRL's), ε_lo = ``skill_sd.epsilon``, ε_hi = ``skill_sd.epsilon_high``,
   averaged over the step's action tokens (as GRPO's default "dapo"), plus λ_sdl =
   ``skill_sd.sdl_coef`` times the importance-weighted sampled-token reverse KL
   (:func:`lopd.losses.sampled_reverse_kl`) averaged over the action tokens of rollouts that had
   a skill; ``skill_sd.num_iterations`` (μ) passes over the batch, the first pass's log-probs
   being π_old of both terms, and the first pass's teacher log-probs the teacher's on every pass
   (the teacher is the student's weights, which the earlier passes have moved); the clip's share
   of action tokens is logged as GRPO's (``clip_fraction``, ``/low``, ``/high``);
4. feedback: each rollout's reward updates the statistics of the skill its group was trained
   with (one pull per rollout); then the step's successes enter the library as skills of their
   pools (a summary already held in the pool is not added twice).

Where the library comes from: the run's own training rollouts, starting empty. A pool has skills
only after the student has solved one of its tasks; until then its rollouts get no teacher signal
(their distillation tokens weigh 0; PPO still applies) and are counted in
``skill_sd/without_skill``. Why the pool is the domain by default: a run of 30 steps × 8 tasks on
toolworld's 2,349 training tasks meets each task about once, so with ``pool: task`` no rollout ever
has a skill and Skill-SD is exactly GRPO with G = 4 (measured: the same final rewards, seed by seed,
as GRPO in docs/results/method-table.md). "One skill per task from a library" is read as a library
shared across tasks; the domain is the coarsest grouping every environment states
(``Task.domain``), and a domain's tasks share tools and workflows.
No rollout is sampled outside the training loop, so :meth:`setup_rollouts` is 0. Evaluation
rollouts never reach the library, and a validation-mode run's validation tasks are refused by it
(:attr:`SkillLibrary.withheld`). Library and UCB statistics are part of each checkpoint and are
restored exactly; under several processes every rank applies the same gathered updates, so every
rank holds the same library.

Settings and where they come from. The LOPD paper gives UCB1 with c = 2, ε_lo = 0.2, ε_hi = 0.28,
λ_sdl = 0.001 and "importance-weighted sampled-token reverse KL"; Skill-SD's abstract adds that
completed trajectories are summarised into skills (success patterns, mistakes, workflows) that
condition only the teacher, and that the teacher is dynamically synchronised with the improving
student. Its method section was not available to us; what it would fix is chosen here:

* UCB1 score: mean reward + c·sqrt(ln N / n) with n the skill's pulls and N the sum of the pulls
  of all the skills of the task's pool (its bandit's plays; a pull is one rollout, so a group
  adds G), c multiplying the bonus (the usual "exploration constant"; c = √2 is Auer et al.'s
  UCB1); untried skills first, ties to the oldest skill; the statistics move after the step, so
  every group of a pool in one step gets the same skill;
* the distillation term ρ · sg[log π − log π_T], ρ = π / π_old unclipped: the importance-sampled
  value of the token-level reverse KL whose gradient is the score-function estimate of its
  gradient (at μ = 1, ρ ≡ 1);
* skills are made by a fixed rule (:func:`skill_summary`) from compact traces, not by an LLM
  summariser, so the baseline needs no second model and is deterministic;
* the teacher is the student's current weights (synchronised every step, no EMA);
* the pool of skills a task may draw from (``skill_sd.pool``), as above.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from lopd import losses
from lopd.algorithms import register
from lopd.algorithms.base import (
    Algorithm,
    LossTerms,
    MicroBatch,
    Panel,
    Scores,
    StepBatch,
    Totals,
    require_unsharded,
)
from lopd.config import ConfigError, knob
from lopd.teacher import text_view

SKILL_PREFIX = "A skill learned from an earlier successful attempt at this task:\n"
"""Framing of the chosen skill in the teacher's prompt."""


@dataclass
class SkillSDConfig:
    """Skill-SD: PPO-clip + λ_sdl · importance-weighted reverse KL to a skill-reading teacher."""

    num_generations: int = knob(4, "Rollouts per task in one step (the group size G, the paper's "
                                "4); the PPO term's advantages are group-normalised, so G must be "
                                "at least 2.", ge=1)
    epsilon: float = knob(0.2, "Lower PPO clip range ε_lo: ratios below 1 - epsilon are clipped "
                          "(the paper's 0.2).", gt=0.0, lt=1.0)
    epsilon_high: float = knob(0.28, "Upper PPO clip range ε_hi: ratios above 1 + epsilon_high "
                               "are clipped (the paper's 0.28).", gt=0.0)
    sdl_coef: float = knob(0.001, "λ_sdl: weight of the importance-weighted sampled-token reverse "
                           "KL to the skill-reading teacher (the paper's 0.001).", ge=0.0)
    ucb_c: float = knob(2.0, "c of UCB1's bonus c·sqrt(ln N / n) when choosing a task's skill "
                        "(the paper's 2).", ge=0.0)
    num_iterations: int = knob(1, "Policy updates per batch of rollouts (μ); > 1 keeps the first "
                               "pass's log-probs as π_old of both terms.", ge=1)
    std: Literal["sample", "population"] = knob(
        "sample", "The group std the PPO term's advantages are divided by (plus 1e-4): 'sample' "
        "(default; Bessel's correction, n - 1, as TRL's GRPO) or 'population' (n).")
    placement: Literal["user", "system"] = knob(
        "user", "Where the skill goes in the teacher's prompt: 'user' a block at the start of the "
        "first user message, 'system' the end of the system message.")
    pool: Literal["domain", "task"] = knob(
        "domain", "Which skills a task may draw: 'domain' those made from successes of any task of "
        "its domain (the task's own included), 'task' only its own earlier successes (a run that "
        "meets each task once then never has a skill).")

    def __post_init__(self) -> None:
        if self.num_generations < 2:
            raise ConfigError(f"skill_sd.num_generations: got {self.num_generations}; Skill-SD's "
                              "PPO term uses group-normalised advantages, which are 0 for a group "
                              "of one, so it needs at least 2 rollouts per task")


# ----------------------------------------------------------------------------------------------
# Skills: structured summaries of compact traces

_STEP = re.compile(r"^(\d+)\. ", re.MULTILINE)
_CALL = re.compile(r"([A-Za-z_][\w.-]*)\(")


def _steps(trace: str) -> list[str]:
    """The bodies of a compact trace's numbered steps. Steps are the last run of lines numbered
    1, 2, 3, ... (an instruction that itself holds a line "1. ..." is skipped: the run restarts
    at each "1. "); a step runs to the next step's line (a code answer spans several lines)."""
    starts: list[re.Match] = []
    for match in _STEP.finditer(trace):
        number = int(match.group(1))
        if number == 1:
            starts = [match]
        elif starts and number == len(starts) + 1:
            starts.append(match)
    ends = [m.start() - 1 for m in starts[1:]] + [len(trace)]
    return [trace[m.end():end] for m, end in zip(starts, ends)]


def _value(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def skill_summary(trace: str) -> str:
    """A skill: the structured summary of a successful episode's compact trace
    (:func:`lopd.envs.environment.compact_trace`) — the workflow (tool sequence), the key values (every
    argument value, once, in order of use), the calls that failed on the way with their error,
    and the final answer (a code answer whole). Pure: the same trace gives the same skill."""
    workflow, values, failed, answer = [], [], [], None
    for body in _steps(trace):
        call = _CALL.match(body)
        if call is not None:
            try:
                arguments, end = json.JSONDecoder().raw_decode(body, call.end())
            except ValueError:
                arguments, end = None, -1
            if isinstance(arguments, dict) and body[end:end + 1] == ")":
                pairs = [f"{key}={_value(value)}" for key, value in arguments.items()]
                workflow.append(call.group(1))
                values += [p for p in pairs if p not in values]
                result = body[end + 1:]
                if result.startswith(" -> Error"):
                    failed.append(f"{call.group(1)}({', '.join(pairs)}): {result[len(' -> '):]}")
                continue
        if body.startswith("answer:\n"):  # a code answer, whole; its feedback on its own line
            answer = body[len("answer:\n"):].split("\n-> ")[0]
            workflow.append("answer")
        elif body.startswith("answer: "):
            answer = body[len("answer: "):].split(" -> ")[0]
            workflow.append("answer")
        elif body.startswith("malformed:"):
            failed.append(body.split(" -> ")[0])
    lines = ["- workflow: " + (" -> ".join(workflow) if workflow else "(none)")]
    if values:
        lines.append("- key values: " + "; ".join(values))
    if failed:
        lines.append("- failed on the way (avoid): " + " | ".join(failed))
    if answer is not None:
        lines.append("- final answer:" + ("\n" if "\n" in answer else " ") + answer)
    return "\n".join(lines)


@dataclass
class Skill:
    """One skill of a task and its UCB1 statistics."""

    text: str
    source: str = ""
    """The task whose successful rollout the skill summarises."""
    pulls: int = 0
    """Rollouts trained with this skill."""
    reward_sum: float = 0.0
    """Sum of those rollouts' rewards."""


class SkillLibrary:
    """Per pool (a domain, or a task), its skills in the order they were added, with UCB1
    statistics; plain data, saved and restored exactly (:meth:`state_dict`). A skill made from a
    task in ``withheld`` (a validation carve-out) is refused."""

    def __init__(self, c: float, withheld: frozenset[str] = frozenset()):
        self.c = c
        self.withheld = withheld
        self.skills: dict[str, list[Skill]] = {}

    def __len__(self) -> int:
        return sum(len(s) for s in self.skills.values())

    def add(self, pool: str, text: str, source: str | None = None) -> bool:
        """Add ``text``, made from a success on task ``source`` (default: ``pool`` is the task), as
        a skill of ``pool`` unless the pool holds it already; True if new."""
        source = pool if source is None else source
        if source in self.withheld:
            raise ValueError(f"task {source} is withheld for validation; it may not enter the "
                             "skill library")
        skills = self.skills.setdefault(pool, [])
        if any(s.text == text for s in skills):
            return False
        skills.append(Skill(text, source))
        return True

    def choose(self, pool: str) -> int | None:
        """UCB1's choice among the pool's skills (an index), or None when it has none: an untried
        skill first, else the highest mean reward + c·sqrt(ln N / n), n the skill's pulls and N
        the sum of the pool's skills' pulls; ties to the oldest."""
        skills = self.skills.get(pool)
        if not skills:
            return None
        for i, skill in enumerate(skills):
            if skill.pulls == 0:
                return i
        total = sum(s.pulls for s in skills)
        scores = [s.reward_sum / s.pulls + self.c * math.sqrt(math.log(total) / s.pulls)
                  for s in skills]
        return max(range(len(skills)), key=lambda i: (scores[i], -i))

    def record(self, pool: str, index: int, reward: float) -> None:
        """One rollout trained with skill ``index`` of ``pool`` earned ``reward``."""
        skill = self.skills[pool][index]
        skill.pulls += 1
        skill.reward_sum += float(reward)

    def state_dict(self) -> dict:
        return {task: [vars(s).copy() for s in skills] for task, skills in self.skills.items()}

    def load_state_dict(self, state: dict) -> None:
        self.skills = {task: [Skill(**s) for s in skills] for task, skills in state.items()}


# ----------------------------------------------------------------------------------------------


@register
class SkillSD(Algorithm):
    name = "skill_sd"
    config_class = SkillSDConfig

    @classmethod
    def group_size_in(cls, cfg) -> int:
        return cfg.skill_sd.num_generations

    @classmethod
    def check_config(cls, cfg, world, fresh: bool) -> None:
        require_unsharded(cls.name, world, "a teacher that scores with the student's full weights")
        super().check_config(cfg, world, fresh)

    def __init__(self, ctx, checkpoint: Path | None):
        super().__init__(ctx, checkpoint)
        spec = self.spec = ctx.cfg.skill_sd
        self.passes = spec.num_iterations
        self.max_observation_chars = ctx.cfg.bank.max_observation_chars
        self.library = SkillLibrary(spec.ucb_c, frozenset(ctx.validation_task_ids))
        self.teacher = text_view(ctx.student, ctx.tokenizer, spec.placement, SKILL_PREFIX)

    def pool_of(self, task) -> str:
        """The library pool ``task`` draws its skill from (``skill_sd.pool``)."""
        return task.domain if self.spec.pool == "domain" else task.task_id

    def before_step(self, batch: StepBatch) -> dict:
        size = self.group_size
        chosen: list[int | None] = []
        for start in range(0, len(batch.tasks), size):
            ids = {t.task_id for t in batch.tasks[start:start + size]}
            if len(ids) != 1:
                raise RuntimeError(f"skill_sd: rollouts {start}..{start + size - 1} are not one "
                                   "group of the same task")
            chosen += [self.library.choose(self.pool_of(batch.tasks[start]))] * size
        context = [[self.library.skills[self.pool_of(t)][i].text] if i is not None else []
                   for t, i in zip(batch.tasks, chosen)]
        signal = torch.tensor([i is not None for i in chosen], dtype=torch.float32)
        tokens = {"skill_tokens": float(sum(sum(r.action_mask)
                                            for r, i in zip(batch.rollouts, chosen)
                                            if i is not None))}
        if self.world.enabled:
            tokens = self.world.sum(tokens)
        advantages = losses.group_advantages(batch.rewards.to(self.device), size,
                                             std=self.spec.std)
        return {"teacher_context": context, "chosen": chosen, "signal": signal.to(self.device),
                "skill_tokens": int(round(tokens["skill_tokens"])), "advantages": advantages,
                "old": {}, "teacher_old": {}}

    def loss(self, micro: MicroBatch, scores: Scores, state: dict, totals: Totals) -> LossTerms:
        spec = self.spec
        logprobs = scores.student.token_logprobs()
        rows = scores.student.rows
        old = state["old"].setdefault(micro.index, logprobs.detach())
        # The shared step keeps the frozen teacher's hidden states across passes, but its output
        # head is the student's, which the earlier passes have moved: keep pass 0's log-probs.
        kept = state["teacher_old"]
        if micro.index not in kept:
            with torch.no_grad():
                kept[micro.index] = scores.teacher.token_logprobs()
        teacher = kept[micro.index]
        advantages = micro.take(state["advantages"])[rows]
        n = max(1, totals.action_tokens)
        ppo = losses.ppo_clip(logprobs, old, advantages, spec.epsilon, spec.epsilon_high).sum() / n
        weights = micro.take(state["signal"])[rows]
        sdl = (losses.sampled_reverse_kl(logprobs, old, teacher)
               * weights).sum() / max(1, state["skill_tokens"])
        loss = ppo + spec.sdl_coef * sdl
        low, high = losses.ppo_clipped(logprobs, old, advantages, spec.epsilon, spec.epsilon_high)
        low, high = low.float().sum() / n, high.float().sum() / n
        return LossTerms({"student": loss}, {
            "loss": loss.detach(), "ppo_loss": ppo.detach(), "sdl": sdl.detach(),
            "clip_fraction": low + high, "clip_fraction/low": low, "clip_fraction/high": high})

    def after_update(self, batch: StepBatch, state: dict, figures: dict) -> dict:
        chars = self.max_observation_chars
        pulls = [(self.pool_of(t), i, r.reward)
                 for t, i, r in zip(batch.tasks, state["chosen"], batch.rollouts) if i is not None]
        wins = [(self.pool_of(t), skill_summary(r.compact_trace(chars)), t.task_id)
                for t, r in zip(batch.tasks, batch.rollouts) if r.success]
        # Every rank applies every rank's updates in rank order: the libraries stay identical.
        for pool, index, reward in self.world.gather(pulls):
            self.library.record(pool, index, reward)
        added = sum(self.library.add(pool, text, source)
                    for pool, text, source in self.world.gather(wins))
        without = sum(i is None for i in state["chosen"]) / max(1, len(state["chosen"]))
        return {"skill_sd/without_skill": without, "skill_sd/skills": float(len(self.library)),
                "skill_sd/pools_with_skills": float(len(self.library.skills)),
                "skill_sd/added": float(added)}

    def panels(self) -> list[Panel]:
        return [Panel("loss: PPO-clip + λ_sdl · reverse KL", ("loss", "ppo_loss")),
                Panel("sampled-token reverse KL to the skill teacher", ("sdl",)),
                Panel("clip fraction: total, low (A < 0), high (A > 0)",
                      ("clip_fraction", "clip_fraction/low", "clip_fraction/high")),
                Panel("share of rollouts without a skill", ("skill_sd/without_skill",)),
                Panel("skills in the library", ("skill_sd/skills",))]

    def state_dict(self) -> dict:
        return {"library": self.library.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.library.load_state_dict(state["library"])
