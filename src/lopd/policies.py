"""Policies: who writes the assistant's turns in the agent loop (:mod:`lopd.agent`).

A :class:`Policy` answers a batch of :class:`TurnContext` s (the token ids of each episode's
context) with one :class:`lopd.rollout.engine.Generation` each. :class:`ModelPolicy` samples from a
model through a rollout engine; the scripted policies write text by rule for harness checks
(:class:`OraclePolicy` replays gold solutions, :class:`FixedTextPolicy` writes one text,
:class:`RandomPolicy` makes schema-valid random tool calls).
"""

from __future__ import annotations

import random
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any

from lopd.chat import FINAL_MARKER, ToolCall, tool_function, turn_end_token
from lopd.envs.environment import Task
from lopd.rollout.engine import Generation, RolloutEngine, SamplingParams


@dataclass(frozen=True)
class TurnContext:
    """What a policy sees when it is asked for one assistant turn."""

    task: Task
    turn: int
    """0-based index of this assistant turn in the episode."""
    prompt_ids: list[int]
    """The conversation so far, ending with the generation prompt."""
    session: int | None = None
    """The episode's identity, the same at every turn (an engine keeps its KV cache by it)."""


class Policy(ABC):
    """Produces the next assistant turn for a batch of episodes."""

    max_length: int | None = None
    """Longest sequence the policy can read (the model's context); None when unbounded."""

    @abstractmethod
    def act(self, contexts: list[TurnContext], max_new_tokens: int, tokenizer) -> list[Generation]:
        """One generation per context, in order. Generated ids end with the end-of-turn token
        (:func:`lopd.chat.turn_end_token`) when the turn was closed."""

    def release(self) -> None:
        """The episodes are over: drop what was kept for them between turns (KV caches)."""


class ModelPolicy(Policy):
    """The model acting through a rollout engine: one ``engine.generate`` call per turn and batch.

    ``params.max_new_tokens`` is replaced by the loop's per-turn limit. With ``params.seed`` set,
    each call gets the next seed of a stream drawn from it, so turns do not reuse the same random
    numbers while a whole run stays reproducible.
    """

    def __init__(self, engine: RolloutEngine, tokenizer, params: SamplingParams):
        turn_end = turn_end_token(tokenizer)
        turn_end_id = tokenizer.convert_tokens_to_ids(turn_end)
        if turn_end_id not in engine.stop_token_ids:
            raise ValueError(f"the engine must stop at {turn_end} (id {turn_end_id}) to end "
                             f"assistant turns; its stop ids are {sorted(engine.stop_token_ids)} "
                             "(`lopd model prepare` adds it to the model's generation eos ids)")
        self.engine = engine
        self.params = params
        self.max_length = engine.max_length
        self._seeds = random.Random(params.seed) if params.seed is not None else None

    def act(self, contexts: list[TurnContext], max_new_tokens: int, tokenizer) -> list[Generation]:
        seed = self._seeds.getrandbits(63) if self._seeds is not None else None
        params = replace(self.params, max_new_tokens=max_new_tokens, seed=seed)
        return self.engine.generate([c.prompt_ids for c in contexts], params,
                                    sessions=[c.session for c in contexts])

    def release(self) -> None:
        self.engine.release()


class ScriptedPolicy(Policy):
    """A policy that writes text by rule, for harness checks (gold replays, junk baselines).

    Its token ids are ``tokenizer(text)`` plus the end-of-turn token with log-prob 0, so its
    rollouts have the same shape as the model's. Scripted text is not cut to ``max_new_tokens``.
    """

    @abstractmethod
    def text(self, context: TurnContext) -> str:
        """The assistant message for this turn."""

    def act(self, contexts: list[TurnContext], max_new_tokens: int, tokenizer) -> list[Generation]:
        turn_end = tokenizer.convert_tokens_to_ids(turn_end_token(tokenizer))
        generations = []
        for context in contexts:
            ids = tokenizer(self.text(context), add_special_tokens=False)["input_ids"] + [turn_end]
            generations.append(Generation(token_ids=ids, logprobs=[0.0] * len(ids), finished=True))
        return generations


class OraclePolicy(ScriptedPolicy):
    """Replays the task's oracle solution turn by turn (must score 1.0 on a correct harness)."""

    def text(self, context: TurnContext) -> str:
        texts = context.task.oracle_texts()
        return texts[min(context.turn, len(texts) - 1)]


class FixedTextPolicy(ScriptedPolicy):
    """Writes the same text every turn (e.g. "Task Completed" to score the untouched state)."""

    def __init__(self, text: str):
        self.fixed_text = text

    def text(self, context: TurnContext) -> str:
        return self.fixed_text


class RandomPolicy(ScriptedPolicy):
    """Calls a random tool with random, schema-valid arguments; answers with small probability.

    The choice depends only on (seed, task, turn), so batching never changes what it does.
    """

    def __init__(self, seed: int = 0, answer_probability: float = 0.1):
        if not 0 <= answer_probability <= 1:
            raise ValueError(f"answer_probability must be in [0, 1], got {answer_probability}")
        self.seed = seed
        self.answer_probability = answer_probability

    def text(self, context: TurnContext) -> str:
        rng = random.Random(f"{self.seed}/{context.task.task_id}/{context.turn}")
        if not context.task.tools or rng.random() < self.answer_probability:
            return FINAL_MARKER
        function = tool_function(rng.choice(context.task.tools))
        arguments = _random_object(function.get("parameters") or {}, rng)
        return ToolCall(function["name"], arguments).to_text()


def _random_object(schema: dict, rng: random.Random) -> dict:
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    return {key: _random_value(sub, rng) for key, sub in properties.items()
            if key in required or rng.random() < 0.5}


def _random_value(schema: dict, rng: random.Random) -> Any:
    if schema.get("enum"):
        return rng.choice(schema["enum"])
    kind = schema.get("type", "string")
    kind = kind if isinstance(kind, str) else rng.choice(kind)
    if kind == "integer":
        return rng.randint(schema.get("minimum", 0), schema.get("maximum", 20))
    if kind == "number":
        return round(rng.uniform(schema.get("minimum", 0), schema.get("maximum", 100)), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        return [_random_value(schema.get("items") or {}, rng) for _ in range(rng.randint(0, 2))]
    if kind == "object":
        return _random_object(schema, rng)
    if kind == "null":
        return None
    return "".join(rng.choices(string.ascii_uppercase + string.digits, k=rng.randint(1, 6)))
