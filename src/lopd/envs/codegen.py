"""What the code environments share: reading code out of an answer, the episode that scores it in
the sandbox, and the unbiased pass@k estimator.

codeworld and HumanEval tasks have no tools: the agent's message *is* the answer. Whatever it
writes (a fenced block, bare code, or text around it) is read by :func:`extract_code`, joined to the
task's preamble and run against the task's tests in :mod:`lopd.envs.sandbox`. Single-turn by
default; with ``attempts > 1`` a failing answer is answered with test feedback (as a user message)
and the agent may try again, the last answer being scored.

Feedback shows what a grader shows a contestant: the visible examples (the ones in the prompt,
never scored) with the answer's value and the expected one, and of the hidden, scored tests only
how many passed — never their inputs or expected values, which an answer that computes nothing
could copy into its next attempt. It is capped at :data:`FEEDBACK_CHARS`.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable

from lopd.chat import Action, ToolCall
from lopd.envs.environment import Episode, StepResult, Task, Verdict
from lopd.envs.sandbox import Limits, Report, TestOutcome, canonical, run

_FENCE = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
REWARDS = ("fraction", "binary")
FEEDBACK_CHARS = 1000
"""The most characters one feedback message may have (values in it are cut to 200)."""


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
    """One code task: each answer is run against the scored ``tests`` (and the visible
    ``examples``, which are not scored); the episode ends when all scored tests pass or the
    attempts are used up."""

    code_answers = True

    def __init__(self, task: Task, messages: list[dict], program: Callable[[str], str],
                 tests: list[dict], limits: Limits, reward: str = "fraction", attempts: int = 1,
                 score: bool = True, examples: list[dict] | None = None):
        if reward not in REWARDS:
            raise ValueError(f"reward must be one of {REWARDS}, got {reward!r}")
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {attempts}")
        if not tests:
            raise ValueError(f"task {task.task_id} has no scored test")
        self.task = task
        self._messages = messages
        self._program = program
        self.tests = tests
        self.examples = list(examples or [])
        self.limits = limits
        self.reward = reward
        self.attempts = attempts
        self.score = score
        self.report: Report | None = None
        self.outcomes: list[TestOutcome] = []
        """The scored tests' outcomes of the last answer."""
        self.answers = 0

    def messages(self) -> list[dict]:
        return [dict(m) for m in self._messages]

    def step(self, action: Action) -> StepResult:
        text = action.to_text() if isinstance(action, ToolCall) else action.text
        self.answers += 1
        if not self.score:
            return StepResult(None, 0.0, True, {"status": "not scored"})
        self.report = run(self._program(extract_code(text)), self.examples + self.tests,
                          self.limits)
        self.outcomes = self.report.outcomes[len(self.examples):]
        if all(o.passed for o in self.outcomes) or self.answers >= self.attempts:
            return StepResult(None, self.verify().reward, True,
                              {"status": self.report.status})
        return StepResult(self.feedback(), 0.0, False,
                          {"role": "user", "status": self.report.status})

    def feedback(self) -> str:
        """The last answer's feedback: the scored tests as a count, the examples in full."""
        report = self.report
        passed = sum(o.passed for o in self.outcomes)
        lines = [f"{passed}/{len(self.outcomes)} hidden tests passed" + (
            "" if report.status == "completed" else f" ({report.status})") + "."]
        for test, outcome in zip(self.examples, report.outcomes):
            what = _cut(test.get("call") or "the example", 200)
            if outcome.passed:
                lines.append(f"Example {what} passed.")
            elif outcome.error == "wrong value":
                lines.append(f"Example {what} returned {_cut(outcome.value or '', 200)}, "
                             f"expected {_cut(repr(test['expected']), 200)}.")
            else:
                lines.append(f"Example {what} failed: {_cut(outcome.error, 120)}.")
        return _cut("\n".join(lines), FEEDBACK_CHARS)

    def verify(self) -> Verdict:
        if self.report is None:
            return Verdict(0.0, False, [("answered", False)])
        checks = [(test.get("call") or f"test {i}", o.passed)
                  for i, (test, o) in enumerate(zip(self.tests, self.outcomes))]
        success = bool(self.outcomes) and all(o.passed for o in self.outcomes)
        fraction = sum(o.passed for o in self.outcomes) / len(self.tests)
        if self.reward == "binary" or (not success and self.ignores_its_input()):
            return Verdict(float(success), success, checks)
        return Verdict(fraction, success, checks)

    def ignores_its_input(self) -> bool:
        """Whether the last answer returned one same value on every scored test it answered (at
        least two) while their expected values differ: it does not depend on its input, so the
        tests it passes, it passes by coincidence (``return True``, ``return []``). The
        ``fraction`` reward gives such an answer 0."""
        keys = [o.key for o in self.outcomes if o.key is not None]
        return len(keys) >= 2 and len(set(keys)) == 1 and len(self._expected) > 1

    @functools.cached_property
    def _expected(self) -> set[str]:
        return {canonical(t["expected"]) for t in self.tests if "call" in t}


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."
