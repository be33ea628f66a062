"""The environment protocol shared by every environment (toolworld, codeworld, BFCL, HumanEval).

An :class:`Environment` owns a fixed, seeded set of :class:`Task` s per split. ``reset(task)``
starts an independent :class:`Episode` (its own state), so a batch of episodes can run side by
side in the rollout engine. The agent loop parses the model's text into an :class:`Action` and
calls ``episode.step(action)``; the episode answers with a :class:`StepResult`. When the episode is
over, ``episode.verify()`` scores the final state.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any

FINAL_MARKER = "Task Completed"


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call of a tool that exists, with arguments that match its schema."""

    name: str
    arguments: dict[str, Any]

    def to_text(self) -> str:
        """The assistant text for this call, in the Hermes/Qwen format."""
        return "<tool_call>" + json.dumps({"name": self.name, "arguments": self.arguments}) + "</tool_call>"


@dataclass(frozen=True)
class FinalAnswer:
    """Text without a tool call that contains the final marker: the episode ends."""

    text: str


@dataclass(frozen=True)
class Malformed:
    """Anything else the model wrote; ``error`` is shown to the model as the observation."""

    text: str
    error: str


Action = ToolCall | FinalAnswer | Malformed


@dataclass(frozen=True)
class Task:
    """One task instance. Everything is JSON-serialisable (``to_dict`` / ``from_dict``)."""

    task_id: str
    env: str
    split: str
    domain: str
    instruction: str
    tools: list[dict]
    """Tool schemas in the Hugging Face / OpenAI function format:
    ``{"type": "function", "function": {"name", "description", "parameters": {JSON schema}}}``."""
    oracle: list[dict]
    """The oracle solution: assistant actions in order, each ``{"name": ..., "arguments": ...}`` for a
    tool call or ``{"answer": text}`` for the final answer (always last)."""
    meta: dict = field(default_factory=dict)
    """Environment-specific, JSON-serialisable data needed to rebuild the initial state and checks
    (template name, entity ids, seed, ...)."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Task:
        return cls(**data)

    def oracle_texts(self) -> list[str]:
        """The oracle's assistant messages, as the model would write them."""
        return [ToolCall(a["name"], a["arguments"]).to_text() if "name" in a else a["answer"]
                for a in self.oracle]


@dataclass
class StepResult:
    observation: str | None
    """Content of the tool message returned to the agent; None once the episode is done."""
    reward: float
    """0.0 until the episode is done; then the verifier's reward."""
    done: bool
    info: dict = field(default_factory=dict)


@dataclass
class Verdict:
    reward: float
    """Fraction of checks that hold on the final state, in [0, 1]."""
    success: bool
    """All checks hold."""
    checks: list[tuple[str, bool]]
    """(description, passed) for every check, for traces and debugging."""


class Episode(ABC):
    """One running task with its own state."""

    task: Task

    @property
    def tools(self) -> list[dict]:
        """The tools the agent may call now (the task's, unless the environment changes them
        mid-episode, as BFCL does with its held-back functions)."""
        return self.task.tools

    @abstractmethod
    def messages(self) -> list[dict]:
        """The initial conversation: ``[{"role": "system", ...}, {"role": "user", ...}]``."""

    @abstractmethod
    def step(self, action: Action) -> StepResult:
        """Apply one agent action. Tool errors (a failed precondition, an unknown id) and malformed
        actions come back as observations; this never raises on bad agent output."""

    @abstractmethod
    def verify(self) -> Verdict:
        """Score the current state against the task's checklist."""


class Environment(ABC):
    """A seeded family of tasks and the means to run them."""

    name: str
    splits: tuple[str, ...]
    max_episode_turns: int = 0
    """Actions an episode may need at most (multi-turn benchmarks: user turns × actions per turn);
    episode runners allow at least this many. 0 = the config's rollout.max_turns decides."""

    @abstractmethod
    def tasks(self, split: str) -> list[Task]:
        """All tasks of ``split``, in a fixed order; the same seed gives the same tasks."""

    @abstractmethod
    def reset(self, task: Task) -> Episode:
        """A fresh episode of ``task`` in its initial state."""

    def for_transcripts(self) -> Environment:
        """The environment to run when only the oracle's token sequences are wanted (building the
        base model's training data), not their scores. Environments whose scoring is costly (the
        code sandbox) return a view that skips it; the rest return themselves."""
        return self
