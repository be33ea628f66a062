"""codeworld: verified Python function problems with hidden tests, scored in the sandbox.

A task asks for one function: a statement, one worked example and the signature (the problem
templates are in :mod:`lopd.envs.codeworld.problems`). The agent answers with the function (a fenced
block, as the oracle does); the answer runs in :mod:`lopd.envs.sandbox` against ``call`` tests
judged in the parent, so a program cannot fake a pass.

**What is scored**: the problem's hidden tests — every stored test but the worked example, which
the prompt shows and which therefore earns nothing (an answer that only returns the example's
output scores 0). Reward is the fraction of hidden tests passed (``reward="binary"``: 1 only when
all pass), except that an answer returning one same value on every hidden test scores 0 (it
ignores its input: ``return True`` would otherwise earn the share of tests expecting ``True``);
success = all pass. Single-turn by default; ``attempts > 1`` answers a failing answer
with feedback (:meth:`lopd.envs.codegen.CodeEpisode.feedback`: the example with its expected
value, the hidden tests only as a count) and lets the agent try again.

Splits: ``eval`` (500), ``train`` (7,000, the paper's count of verified training problems) and
``pretrain`` (20,000: the supervised pool of the code base model). **Statements are split, not just
instances**: a statement (template + drawn parameters, e.g. "keep the numbers divisible by 3")
belongs to one split, chosen by a seeded hash (a quarter to eval, a quarter to train, half to
pretrain). So neither an evaluation problem nor a training problem asks for a function the base
model was fine-tuned on: solving them needs reading the parameters out of the statement, not
recall, and the base's validation on training problems (which stops its fine-tuning) measures the
same skill as the evaluation. A template with few statements can fall wholly into one split;
:meth:`CodeWorld.stats` names the evaluation templates without training or pre-training
problems.

Every problem is verified when its split is built: the reference solutions of a split run against
their tests in the sandbox (batched, a few hundred problems per child process) and a problem
whose reference does not pass is dropped and counted.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
import textwrap
from collections import Counter

from lopd.envs.codegen import REWARDS, CodeEpisode, extract_code, fence
from lopd.envs.codeworld.problems import TEMPLATES, Problem
from lopd.envs.environment import Environment, Task
from lopd.envs.sandbox import Limits, run_many

DEFAULT_SIZES = {"pretrain": 20_000, "train": 7_000, "eval": 500}
GENERATION_ORDER = ("eval", "train", "pretrain")
SIDES = ("eval", "train", "pretrain", "pretrain")
"""The split of a statement is SIDES[hash % 4]."""
SYSTEM_PROMPT = "You write Python functions. Answer with the function in a ```python block."
EVAL_TEMPLATE_SHARE = 2
MAX_DRAWS_PER_PROBLEM = 40
"""A template that yields no new problem for its split in this many draws in a row is used up."""
VERIFY_CHUNK = 250


def call_text(entry_point: str, args: list) -> str:
    """The Python call of ``entry_point`` on JSON arguments (``repr`` writes Python literals)."""
    return f"{entry_point}({', '.join(repr(a) for a in args)})"


def hidden_tests(callee: str, tests: list[dict]) -> list[dict]:
    """The sandbox's ``call`` tests of a problem's stored tests, calling ``callee``."""
    return [{"call": call_text(callee, t["args"]), "expected": t["expected"]} for t in tests]


def example_and_hidden(tests: list[dict]) -> tuple[dict, list[dict]]:
    """(the worked example the prompt shows, the hidden tests that are scored)."""
    return tests[-1], tests[:-1]


def prompt(problem_or_meta) -> str:
    meta = problem_or_meta if isinstance(problem_or_meta, dict) else vars(problem_or_meta)
    example = example_and_hidden(meta["tests"])[0]
    return (f"{meta['statement']}\nExample: {call_text(meta['entry_point'], example['args'])} "
            f"returns {example['expected']!r}.\n{meta['signature']}")


def assemble(code: str, entry_point: str, signature: str) -> str:
    """The program to run: the answer's code, or, when it does not define the function (a bare
    body), the signature with the answer as its body."""
    if f"def {entry_point}(" in code:
        return code
    return signature + "\n" + textwrap.indent(code, "    ")


def statement_split(seed: int, template: str, statement: str) -> str:
    """The one split a statement belongs to (a seeded hash, so it never depends on sizes)."""
    digest = hashlib.sha256(f"{seed}|{template}|{statement}".encode()).digest()
    return SIDES[int.from_bytes(digest[:8], "big") % len(SIDES)]


class CodeWorld(Environment):
    name = "codeworld"
    splits = ("pretrain", "train", "eval")
    oracle_splits = ("train",)

    def __init__(self, seed: int = 0, sizes: dict[str, int] | None = None,
                 reward: str = "fraction", attempts: int = 1, limits: Limits | None = None,
                 verify: bool = True):
        sizes = {**DEFAULT_SIZES, **(sizes or {})}
        unknown = set(sizes) - set(self.splits)
        if unknown:
            raise ValueError(f"unknown codeworld split(s) {sorted(unknown)}; splits are "
                             f"{', '.join(self.splits)}")
        if reward not in REWARDS:
            raise ValueError(f"codeworld reward must be one of {REWARDS}, got {reward!r}")
        if attempts < 1:
            raise ValueError(f"codeworld attempts must be >= 1, got {attempts}")
        self.seed, self.sizes, self.reward, self.attempts = seed, sizes, reward, attempts
        self.limits = limits or Limits(wall_seconds=10.0, test_seconds=2.0, cpu_seconds=10,
                                       memory_mb=512)
        self.verify = verify
        self.score = True
        self.max_episode_turns = attempts
        self._tasks: dict[str, list[Task]] = {}
        self._keys: set[str] = set()
        self.dropped: dict[str, int] = {}

    # -- generation ------------------------------------------------------------------------------

    def tasks(self, split: str) -> list[Task]:
        if split not in self.splits:
            raise ValueError(f"unknown codeworld split {split!r}; splits are "
                             f"{', '.join(self.splits)}")
        for earlier in GENERATION_ORDER[:GENERATION_ORDER.index(split) + 1]:
            if earlier not in self._tasks:
                self._generate(earlier)
        return self._tasks[split]

    def _generate(self, split: str) -> None:
        want = self.sizes[split]
        problems: list[tuple[Problem, int]] = []
        # eval first asks for a new statement each time, then (when a template's evaluation
        # statements run out) for new instances of them; no template takes more than
        # EVAL_TEMPLATE_SHARE times its fair share, so big families do not crowd out the others.
        cap = EVAL_TEMPLATE_SHARE * want // len(TEMPLATES) + 1
        passes = (("statement", cap), ("instance", cap)) if split == "eval" \
            else (("instance", want),)
        draw = 0
        for distinct, cap in passes:
            live = list(range(len(TEMPLATES)))
            misses, taken = Counter(), Counter(p.template for p, _ in problems)
            seen = {(p.template, p.statement) for p, _ in problems}
            while len(problems) < want and live:
                t = live[draw % len(live)]
                seed = int.from_bytes(hashlib.sha256(
                    f"{self.seed}|{split}|{TEMPLATES[t].name}|{draw}".encode()).digest()[:8],
                    "big")
                draw += 1
                problem = TEMPLATES[t].make(random.Random(seed))
                key = json.dumps([problem.template, problem.statement, problem.tests])
                new = (key not in self._keys and (
                    distinct == "instance" or (problem.template, problem.statement) not in seen))
                if new and statement_split(self.seed, problem.template,
                                           problem.statement) == split:
                    self._keys.add(key)
                    seen.add((problem.template, problem.statement))
                    problems.append((problem, seed))
                    taken[problem.template] += 1
                    misses[t] = 0
                else:
                    misses[t] += 1
                if misses[t] >= MAX_DRAWS_PER_PROBLEM or taken[problem.template] >= cap:
                    live.remove(t)
        if self.verify:
            problems = self._verified(split, problems)
        self._tasks[split] = [self._task(split, i, p, s) for i, (p, s) in enumerate(problems)]

    def _verified(self, split: str, problems: list[tuple[Problem, int]]):
        """Run every reference solution against its tests in the sandbox; keep those that pass."""
        jobs = []
        for start in range(0, len(problems), VERIFY_CHUNK):
            chunk = problems[start:start + VERIFY_CHUNK]
            program = "".join(f"_p{i} = {{}}\nexec({p.solution!r}, _p{i})\n"
                              for i, (p, _) in enumerate(chunk))
            tests = [test for i, (p, _) in enumerate(chunk)
                     for test in hidden_tests(f"_p{i}[{p.entry_point!r}]", p.tests)]
            jobs.append((program, tests))
        reports = run_many(jobs, Limits(wall_seconds=120, test_seconds=5, cpu_seconds=120))
        kept = []
        for start, report in zip(range(0, len(problems), VERIFY_CHUNK), reports):
            outcomes = iter(report.outcomes)
            for problem, seed in problems[start:start + VERIFY_CHUNK]:
                # A list, not a generator: every outcome of this problem must be consumed.
                if all([next(outcomes).passed for _ in problem.tests]):  # noqa: C419
                    kept.append((problem, seed))
        self.dropped[split] = len(problems) - len(kept)
        return kept

    def _task(self, split: str, i: int, problem: Problem, seed: int) -> Task:
        meta = {"template": problem.template, "seed": seed, "entry_point": problem.entry_point,
                "signature": problem.signature, "statement": problem.statement,
                "tests": problem.tests, "params": problem.params}
        return Task(task_id=f"codeworld-{split}-{i:05d}", env=self.name, split=split,
                    domain=problem.category, instruction=prompt(meta), tools=[],
                    oracle=[{"answer": fence(problem.solution)}], meta=meta)

    # -- episodes --------------------------------------------------------------------------------

    def reset(self, task: Task) -> CodeEpisode:
        meta = task.meta
        example, hidden = example_and_hidden(meta["tests"])
        messages = [{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": task.instruction}]
        return CodeEpisode(task, messages,
                           lambda code: assemble(code, meta["entry_point"], meta["signature"]),
                           hidden_tests(meta["entry_point"], hidden), self.limits, self.reward,
                           self.attempts, self.score,
                           examples=hidden_tests(meta["entry_point"], [example]))

    def for_transcripts(self) -> CodeWorld:
        """This environment without scoring: the references were verified when the splits were
        built, and running 20,000 of them again would only cost time."""
        view = copy.copy(self)
        view.score = False
        return view

    def stats(self, split: str) -> dict:
        tasks = self.tasks(split)
        templates = Counter(t.meta["template"] for t in tasks)
        stats = {"tasks": len(tasks), "domains": dict(sorted(Counter(
            t.domain for t in tasks).items())), "templates": len(templates),
            "statements": len({(t.meta["template"], t.meta["statement"]) for t in tasks}),
            "dropped_by_verification": self.dropped.get(split, 0)}
        if split == "eval":
            for other in ("train", "pretrain"):
                seen = {t.meta["template"] for t in self.tasks(other)}
                stats[f"templates_without_{other}_problems"] = sorted(set(templates) - seen)
        return stats

    def transcript(self, task: Task) -> list[dict]:
        """The oracle's conversation, for supervised training of the base model."""
        episode = self.reset(task)
        return episode.messages() + [{"role": "assistant", "content": task.oracle_texts()[0]}]

    def transcripts(self, tasks, n: int | None = None) -> list[list[dict]]:
        tasks = self.tasks(tasks) if isinstance(tasks, str) else tasks
        return [self.transcript(t) for t in tasks[:n]]


__all__ = ["CodeWorld", "assemble", "call_text", "example_and_hidden", "extract_code",
           "hidden_tests", "prompt"]
