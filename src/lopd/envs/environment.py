"""The environment protocol shared by every environment (toolworld, codeworld, BFCL, HumanEval).

An :class:`Environment` owns a fixed, seeded set of :class:`Task` s per split. ``reset(task)``
starts an independent :class:`Episode` (its own state), so a batch of episodes can run side by
side in the rollout engine. The agent loop parses the model's text into an :class:`Action` and
calls ``episode.step(action)``; the episode answers with a :class:`StepResult`. When the episode is
over, ``episode.verify()`` scores the final state.

Oracle trajectories: an environment that has reference solutions for its training tasks names
those splits in :attr:`Environment.oracle_splits`; :meth:`Environment.oracle_trace` replays a
task's oracle through a fresh episode and renders it as the compact trace the experience bank
stores, the privileged text of the methods that show their teacher a reference solution (SDFT,
OPSD). Evaluation tasks never give theirs out, and a benchmark without training tasks has none.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field, replace

from lopd.chat import Action, FinalAnswer, ToolCall, chat_safe, one_line, parse_action


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
    """Content of the tool message returned to the agent; None once the episode is done. It may
    quote the model's arguments verbatim: the agent loop escapes control characters and lone
    surrogates before it reaches the chat (:func:`lopd.chat.chat_safe`), and breaks the text of
    special tokens so that it tokenizes as text (:func:`lopd.chat.quote_special_tokens`)."""
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
    code_answers: bool = False
    """True when every assistant message is a program the episode runs as its answer (the code
    environments: no tools, no final marker); the agent records such turns as ``"code"`` and
    compact traces keep them whole (:func:`compact_trace`)."""

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


class OracleError(ValueError):
    """An oracle trajectory was asked of an environment or a task that does not give one out."""


class Environment(ABC):
    """A seeded family of tasks and the means to run them."""

    name: str
    splits: tuple[str, ...]
    max_episode_turns: int = 0
    """Actions an episode may need at most (multi-turn benchmarks: user turns × actions per turn);
    episode runners allow at least this many. 0 = the config's rollout.max_turns decides."""
    oracle_splits: tuple[str, ...] = ()
    """Splits whose tasks' oracle trajectories a training method may read (:meth:`oracle_trace`);
    empty for an environment without oracle trajectories for training (the benchmarks)."""

    def require_oracle(self, method: str) -> None:
        """Fail (at a method's start-up) unless this environment gives out oracle trajectories."""
        if not self.oracle_splits:
            raise OracleError(f"{method} needs oracle trajectories, but environment {self.name} "
                              "has none for training (it offers no oracle_splits)")

    def oracle_trace(self, task: Task, max_observation_chars: int = 80) -> str:
        """The reference solution of training task ``task`` as the experience bank stores a
        rollout: the compact trace (:meth:`lopd.agent.Rollout.compact_trace`) of the oracle's
        actions replayed through a fresh episode, observations cut to ``max_observation_chars``.

        Only tasks of :attr:`oracle_splits` give one out: an evaluation task's solution must never
        reach a training method."""
        if not self.oracle_splits:
            raise OracleError(f"environment {self.name} has no oracle trajectories for training")
        if task.env != self.name:
            raise OracleError(f"task {task.task_id} belongs to environment {task.env}, not "
                              f"{self.name}")
        if task.split not in self.oracle_splits:
            raise OracleError(f"task {task.task_id} is in the {task.split} split: {self.name} gives "
                              f"oracle trajectories for {', '.join(self.oracle_splits)} tasks only")
        turns = replay_turns(self.for_transcripts(), task, task.oracle_texts())
        return compact_trace(task.instruction, turns, max_observation_chars)

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


class OracleTraces:
    """The oracle traces of a run's training tasks, rendered (and so checked) once at start-up:
    a method that reads them fails before training when the environment has none or a task may
    not give its out. ``traces(tasks)`` is one trace per task, in order."""

    def __init__(self, env: Environment, tasks, method: str, max_observation_chars: int = 80):
        env.require_oracle(method)
        self.method = method
        self.by_task = {t.task_id: env.oracle_trace(t, max_observation_chars) for t in tasks}

    def __call__(self, tasks) -> list[str]:
        for task in tasks:
            if task.task_id not in self.by_task:
                raise OracleError(f"{self.method}: task {task.task_id} is not a training task of "
                                  "this run; its oracle trajectory is not given out")
        return [self.by_task[t.task_id] for t in tasks]


# ----------------------------------------------------------------------------------------------
# Traces: what an episode's turns are, and their compact text


def _action_kind(action: Action) -> str:
    if isinstance(action, ToolCall):
        return "tool_call"
    return "answer" if isinstance(action, FinalAnswer) else "malformed"


def safe_step(episode: Episode, action: Action) -> StepResult:
    """``episode.step(action)`` with its observation made :func:`chat_safe`: every environment's
    text reaches the chat (and the rollout record) through here, whatever the environment quotes."""
    result = episode.step(action)
    return replace(result, observation=chat_safe(result.observation))


def turn_record(text: str, action: Action, result: StepResult, code: bool = False) -> dict:
    """One entry of :attr:`Rollout.turns`: the assistant's text, what it parsed to, the answer.
    ``code``: the episode takes every message as a program (:attr:`Episode.code_answers`), so the
    turn is a ``"code"`` answer whatever the tool-call parser made of it."""
    return {"action": text, "kind": "code" if code else _action_kind(action),
            "call": {"name": action.name, "arguments": action.arguments}
            if isinstance(action, ToolCall) else None,
            "observation": result.observation}


def compact_trace(instruction: str, turns: list[dict], max_observation_chars: int = 80) -> str:
    """The compact trace of an episode's ``turns`` (see :meth:`Rollout.compact_trace`).

    A ``"code"`` turn (a code environment's answer) is the decision itself, like a tool call's
    arguments: it is kept whole and verbatim on the lines after ``answer:`` (cut or re-spaced,
    code means nothing), and its feedback, if any, follows on a line of its own."""
    lines = [f"Task: {instruction}"]
    for n, turn in enumerate(turns, 1):
        arrow = " -> "
        if turn["kind"] == "tool_call":
            call = turn["call"]
            action = f"{call['name']}({json.dumps(call['arguments'])})"
        elif turn["kind"] == "code":
            action = "answer:\n" + turn["action"].strip("\n")
            arrow = "\n-> "
        elif turn["kind"] == "answer":
            action = "answer: " + one_line(turn["action"], max_observation_chars)
        else:
            action = "malformed: " + one_line(turn["action"], max_observation_chars)
        if turn["observation"] is not None:
            action += arrow + one_line(turn["observation"], max_observation_chars)
        lines.append(f"{n}. {action}")
    return "\n".join(lines)


def replay_turns(env: Environment, task: Task, texts: list[str]) -> list[dict]:
    """The turns the agent loop records when the assistant writes ``texts`` in order on a fresh
    episode of ``task`` (parsed and answered exactly as in :func:`run_episodes`), until the
    episode ends or the texts run out. No tokenizer: only the chat-level record."""
    episode = env.reset(task)
    turns = []
    for text in texts:
        action = parse_action(text, episode.tools)
        result = safe_step(episode, action)
        turns.append(turn_record(text, action, result, episode.code_answers))
        if result.done or (isinstance(action, FinalAnswer) and result.observation is None):
            break
    return turns
