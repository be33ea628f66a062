"""What the code environments share: reading code out of an answer, the episode that scores it in
the sandbox, and the unbiased pass@k estimator.

codeworld and HumanEval tasks have no tools: the agent's message *is* the answer. Whatever it
writes (a fenced block, bare code, or text around it) is read by :func:`extract_code`, joined to the
task's preamble and run against the task's tests in :mod:`lopd.envs.sandbox`. Single-turn by
default; with ``attempts > 1`` a failing answer is answered with test feedback (as a user message)
and the agent may try again, the last answer being scored.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from lopd.envs.environment import Action, Episode, StepResult, Task, ToolCall, Verdict
from lopd.envs.sandbox import Limits, Report, run

_FENCE = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
REWARDS = ("fraction", "binary")


def extract_code(text: str) -> str:
    """The code in a model's answer: the first fenced block (an unclosed fence runs to the end),
    else the whole text."""
    match = _FENCE.search(text)
    return (match.group(1) if match else text).rstrip() + "\n"


def fence(code: str) -> str:
    """``code`` as a fenced Python block: the answer format the models are taught."""
    return "```python\n" + code.rstrip("\n") + "\n```"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` passed: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    # The product form avoids huge binomials.
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


class CodeEpisode(Episode):
    """One code task: each answer is run against the tests; the episode ends when all pass or the
    attempts are used up."""

    code_answers = True

    def __init__(self, task: Task, messages: list[dict], program: Callable[[str], str],
                 tests: list[dict], limits: Limits, reward: str = "fraction", attempts: int = 1,
                 score: bool = True):
        if reward not in REWARDS:
            raise ValueError(f"reward must be one of {REWARDS}, got {reward!r}")
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {attempts}")
        self.task = task
        self._messages = messages
        self._program = program
        self.tests = tests
        self.limits = limits
        self.reward = reward
        self.attempts = attempts
        self.score = score
        self.report: Report | None = None
        self.answers = 0

    def messages(self) -> list[dict]:
        return [dict(m) for m in self._messages]

    def step(self, action: Action) -> StepResult:
        text = action.to_text() if isinstance(action, ToolCall) else action.text
        self.answers += 1
        if not self.score:
            return StepResult(None, 0.0, True, {"status": "not scored"})
        self.report = run(self._program(extract_code(text)), self.tests, self.limits)
        if self.report.all_passed or self.answers >= self.attempts:
            return StepResult(None, self.verify().reward, True,
                              {"status": self.report.status})
        return StepResult(self.report.feedback(self.tests), 0.0, False,
                          {"role": "user", "status": self.report.status})

    def verify(self) -> Verdict:
        if self.report is None:
            return Verdict(0.0, False, [("answered", False)])
        outcomes = self.report.outcomes
        checks = [(test.get("call") or f"test {i}", o.passed)
                  for i, (test, o) in enumerate(zip(self.tests, outcomes))]
        success = self.report.all_passed
        reward = float(success) if self.reward == "binary" else self.report.fraction
        return Verdict(reward, success, checks)
