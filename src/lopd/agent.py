"""The agent: tool-call parsing, policies, and the multi-turn rollout loop with its action masks.

An episode is one growing token sequence: the chat-template prompt, then for every turn the
model's generated tokens followed by the template pieces that carry the tool's answer. The loop
keeps three aligned lists over that sequence — ``input_ids``, ``action_mask`` (1 exactly on tokens
the model generated) and the sampling policy's ``logprobs`` — so every trainer scores the very
tokens the model saw and chose, never a re-tokenisation of the text.

Invariant: ``tokenizer.decode(rollout.input_ids)`` equals
``tokenizer.apply_chat_template(rollout.messages, tools=task.tools, tokenize=False)`` (no
generation prompt), whatever way the episode ended. The template pieces between turns are cut out
of the template's own rendering, so this holds for any template that renders message content
verbatim and closes assistant turns with a special token (ChatML's ``<|im_end|>``, Llama 3's
``<|eot_id|>``, Tulu/OLMo's eos; :func:`lopd.models.turn_end_token`); Qwen3-style templates that
rewrite past turns, e.g. to add or drop reasoning, differ only in those rewritten turns.
:func:`check_chat_template` tells whether a tokenizer's template does what the loop needs.

What an environment says (the opening's system and user messages, every observation) is text to
the model, never a special token: the text of the tokenizer's special and added tokens in it is
quoted (:func:`lopd.models.quote_special_tokens`) before it is rendered, and the messages keep it
quoted, so the invariant holds with them.
"""

from __future__ import annotations

import itertools
import json
import random
import re
import string
import weakref
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict, deque
from dataclasses import asdict, dataclass, replace
from typing import Any

from tqdm.auto import tqdm

from lopd.envs.environment import (FINAL_MARKER, Action, Environment, Episode, FinalAnswer, Malformed,
                            StepResult, Task, ToolCall, Verdict)
from lopd.latent import find_subsequence, user_header
from lopd.models import (LATENT_TOKEN, PROBE_TOOLS, TOOL_CALL_END, TOOL_CALL_START,
                         quote_special_tokens, render, turn_end_token)
from lopd.rollout.engine import Generation, RolloutEngine, SamplingParams

FINISH_REASONS = ("answer", "max_turns", "max_length", "env_done")
"""Why an episode ended: the agent answered; it used its last turn; the next turn would not fit the
model's context; the environment ended it after a tool call."""

# ----------------------------------------------------------------------------------------------
# Parsing the model's text into an action

_TYPE_NAMES = {"string": "a string", "integer": "an integer", "number": "a number",
               "boolean": "a boolean", "array": "an array", "object": "an object", "null": "null"}


def _short(text: str, limit: int = 40) -> str:
    """``text`` on one line, cut after ``limit`` characters (marked with "...")."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def _function(tool: dict) -> dict:
    """The function part of a tool schema, in the HF/OpenAI wrapper format or bare."""
    return tool.get("function", tool) if isinstance(tool, dict) else {}


def _has_type(value: Any, type_name: str) -> bool:
    # bool is a subclass of int in Python but not an integer or number in JSON schema.
    if type_name == "string":
        return isinstance(value, str)
    if type_name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if type_name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if type_name == "boolean":
        return isinstance(value, bool)
    if type_name == "array":
        return isinstance(value, list)
    if type_name == "object":
        return isinstance(value, dict)
    if type_name == "null":
        return value is None
    return True  # a type this checker does not know is not held against the model


def _value_error(value: Any, schema: Any, name: str) -> str | None:
    """Why ``value`` does not match ``schema`` (type, enum, array items, nested object), or None."""
    if not isinstance(schema, dict):
        return None
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else [t for t in types if isinstance(t, str)]
        if names and not any(_has_type(value, t) for t in names):
            return f"argument '{name}' must be " + " or ".join(_TYPE_NAMES.get(t, t) for t in names)
    enum = schema.get("enum")
    # Compared as JSON values: true is not 1 and 1 is not "1".
    if isinstance(enum, list) and not any(
            value == v and isinstance(value, bool) == isinstance(v, bool) for v in enum):
        return f"argument '{name}' must be one of " + ", ".join(json.dumps(v) for v in enum)
    if isinstance(value, list):
        for i, item in enumerate(value):
            error = _value_error(item, schema.get("items"), f"{name}[{i}]")
            if error:
                return error
    if isinstance(value, dict) and isinstance(schema.get("properties"), dict):
        return _object_error(value, schema, prefix=f"{name}.")
    return None


def _object_error(arguments: dict, schema: dict, prefix: str = "") -> str | None:
    """Why ``arguments`` do not match an object schema: unknown, missing or ill-typed keys."""
    properties = schema.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    if schema.get("additionalProperties") is not True:
        for key in arguments:
            if key not in properties:
                return f"unknown argument '{prefix}{_short(key)}'"
    required = schema.get("required")
    for key in required if isinstance(required, list) else []:
        if key not in arguments:
            return f"missing argument '{prefix}{key}'"
    for key, value in arguments.items():
        error = _value_error(value, properties.get(key), f"{prefix}{key}")
        if error:
            return error
    return None


def parse_action(text: str, tools: list[dict]) -> Action:
    """Read one assistant message as a tool call, the final answer, or a malformed action.

    A tool call is exactly one ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (text
    before it is allowed, text after it is not) whose name is one of ``tools`` and whose arguments
    satisfy that tool's JSON schema. A message without a tool call is the final answer when it
    contains "Task Completed". Everything else is :class:`Malformed` with a short, specific error
    meant to be shown to the model. Never raises.
    """
    if TOOL_CALL_START not in text:
        if FINAL_MARKER in text:
            return FinalAnswer(text)
        return Malformed(text, f"no tool call and no '{FINAL_MARKER}'")
    after_start = text.split(TOOL_CALL_START, 1)[1]
    if TOOL_CALL_START in after_start:
        return Malformed(text, "more than one tool call; write exactly one")
    if TOOL_CALL_END not in after_start:
        return Malformed(text, f"missing {TOOL_CALL_END} closing tag")
    body, rest = after_start.split(TOOL_CALL_END, 1)
    if rest.strip():
        return Malformed(text, f"text after {TOOL_CALL_END}")
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: absurdly nested brackets
        return Malformed(text, "invalid JSON in tool call")
    if not isinstance(call, dict):
        return Malformed(text, "tool call must be a JSON object with 'name' and 'arguments'")
    name = call.get("name")
    if not isinstance(name, str):
        return Malformed(text, "tool call needs a string 'name'")
    schemas = {_function(t).get("name"): _function(t).get("parameters") or {} for t in tools}
    if name not in schemas:
        return Malformed(text, f"unknown tool '{_short(name)}'")
    if "arguments" not in call:
        return Malformed(text, "tool call needs an 'arguments' object")
    arguments = call["arguments"]
    if not isinstance(arguments, dict):
        return Malformed(text, "'arguments' must be a JSON object")
    error = _object_error(arguments, schemas[name])
    if error:
        return Malformed(text, error)
    return ToolCall(name, arguments)


# ----------------------------------------------------------------------------------------------
# The rollout record


def _action_kind(action: Action) -> str:
    if isinstance(action, ToolCall):
        return "tool_call"
    return "answer" if isinstance(action, FinalAnswer) else "malformed"


# What a chat message must not carry to the template: control characters other than newline and
# tab (NUL among them), and lone surrogates.
_UNSAFE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def chat_safe(text: str | None) -> str | None:
    """``text`` with every control character but newline and tab, and every lone surrogate,
    written as its JSON escape (NUL as ``\\u0000``, a lone high surrogate as ``\\ud800``);
    anything else unchanged, None as None.

    Tool results and error messages quote the model's *parsed* JSON, which holds what decoded model
    text never does: ``json.loads('"\\ud800"')`` is a lone surrogate, which no tokenizer can
    encode, so echoing it crashed the rollout. Escaping control characters too means no text that
    reaches the model from an environment holds a NUL, so none can contain the loop's NUL-delimited
    :data:`_CONTENT_PLACEHOLDER`. JSON's escape is what the model wrote to get the character, and
    the mapping is deterministic, so replays and batches see the same text."""
    if text is None or not _UNSAFE.search(text):
        return text
    return _UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _step(episode: Episode, action: Action) -> StepResult:
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
            action = "answer: " + _short(turn["action"], max_observation_chars)
        else:
            action = "malformed: " + _short(turn["action"], max_observation_chars)
        if turn["observation"] is not None:
            action += arrow + _short(turn["observation"], max_observation_chars)
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
        result = _step(episode, action)
        turns.append(turn_record(text, action, result, episode.code_answers))
        if result.done or (isinstance(action, FinalAnswer) and result.observation is None):
            break
    return turns


@dataclass
class Rollout:
    """One finished episode: the token sequence for training, the chat for people and retrieval."""

    task_id: str
    domain: str
    instruction: str
    input_ids: list[int]
    """The whole conversation as the model saw it: prompt, then every turn and tool message."""
    action_mask: list[int]
    """1 exactly on tokens the model generated (its closing end-of-turn token, ``<|im_end|>`` in
    ChatML, included when it produced it, and so is another stop token it ended the turn with,
    e.g. Qwen3's ``<|endoftext|>``, then followed by the end-of-turn token); 0 on the prompt, tool
    messages and template tokens, among them an end-of-turn token closed for the model."""
    logprobs: list[float]
    """Aligned with ``input_ids``: the sampling policy's log-prob on action tokens, else 0.0."""
    prompt_length: int
    """Number of leading tokens that render the initial messages (system + user), without the
    generation prompt: ``input_ids[prompt_length:]`` is the agent's trajectory."""
    reward: float
    success: bool
    checks: list[tuple[str, bool]]
    num_turns: int
    messages: list[dict]
    """The full chat: initial messages, then assistant and tool messages."""
    turns: list[dict]
    """Per assistant turn: ``{"action": text, "kind": "tool_call" | "answer" | "malformed" | "code",
    "call": {"name", "arguments"} or None, "observation": tool text or None}``. The observation is
    the environment's own text (as :func:`replay_turns` records it, without a tokenizer); its
    message holds it with special-token text quoted (:func:`lopd.models.quote_special_tokens`)."""
    finish_reason: str
    """One of :data:`FINISH_REASONS`."""

    @property
    def generated_tokens(self) -> int:
        return sum(self.action_mask)

    def compact_trace(self, max_observation_chars: int = 80) -> str:
        """The task and one line per action, observations cut to ``max_observation_chars``.

        This is the document the experience bank embeds and the composer reads: the decisions in
        full, the verbose tool output only as a short summary.
        """
        return compact_trace(self.instruction, self.turns, max_observation_chars)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Rollout:
        data = dict(data)
        data["checks"] = [(str(name), bool(passed)) for name, passed in data["checks"]]
        return cls(**data)


# ----------------------------------------------------------------------------------------------
# Policies


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
        (:func:`lopd.models.turn_end_token`) when the turn was closed."""

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
        function = _function(rng.choice(context.task.tools))
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


# ----------------------------------------------------------------------------------------------
# The rollout loop

# Stands in for an assistant message's content so that the template piece after the turn can be
# cut out of a rendering exactly, whatever the content is. Only the tool message renders after the
# stand-in, and it holds no NUL (observations are chat_safe), so the stand-in's last occurrence is
# the cut: earlier messages may hold the same text (the model's decoded text can) but render before.
_CONTENT_PLACEHOLDER = "\x00lopd-assistant-content\x00"

# Every episode run gets its own session id: turns of one episode share it, no two episodes do.
_SESSIONS = itertools.count()

# The chat template is rendered as little as the loop can: an episode's opening once per distinct
# (template, tools, messages) — the episodes of one task open alike (a GRPO group) —, and the
# piece after an assistant turn from the text a tool message's content sits between, found once
# per (template, tools, role) with stand-in contents and checked against a full rendering on each
# episode's first tool message; a template that does not render the content verbatim (or whose
# check fails once) is rendered in full at every turn. ``FAST_TEMPLATE = False`` always renders.
# Both are kept per tokenizer object (and its template text): they hold its token ids.
FAST_TEMPLATE = True
_TEMPLATE_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_OPENINGS_KEPT = 1024


def _template_memo(tokenizer) -> dict:
    """The tokenizer's remembered openings and piece forms (created on first use)."""
    memo = _TEMPLATE_MEMO.get(tokenizer)
    if memo is None:
        memo = _TEMPLATE_MEMO[tokenizer] = {"openings": OrderedDict(), "forms": {}}
    return memo
_STAND_INS = ("\x00lopd-tool-content\x00", " \x00other \"tool\" content\x00\n")


class _EpisodeRun:
    """One episode in flight: the environment episode and the growing token sequence."""

    def __init__(self, index: int, episode: Episode, tokenizer):
        self.index = index
        self.session = next(_SESSIONS)
        self.episode = episode
        self.task = episode.task
        self.tokenizer = tokenizer
        self.turn_end = turn_end_token(tokenizer)
        self.turn_end_id = tokenizer.convert_tokens_to_ids(self.turn_end)
        # Quoted before the opening's cache key is taken. An assistant message in the opening is
        # a turn, not what the environment says.
        self.messages = [dict(m) if m["role"] == "assistant" else
                         {**m, "content": quote_special_tokens(m["content"], tokenizer)}
                         for m in episode.messages()]
        template = tokenizer.chat_template
        self._template_key = (template if isinstance(template, str) else repr(template),
                              json.dumps(self.task.tools, sort_keys=True))
        memo = _template_memo(tokenizer)
        openings, self._forms = memo["openings"], memo["forms"]
        self._forms_checked: set[str] = set()
        key = (*self._template_key, json.dumps(self.messages, sort_keys=True))
        opening = openings.get(key) if FAST_TEMPLATE else None
        if opening is None:
            opening = (self._template(self.messages, add_generation_prompt=True, tokenize=True),
                       self._template(self.messages, add_generation_prompt=False, tokenize=True))
            if FAST_TEMPLATE:
                openings[key] = opening
                while len(openings) > _OPENINGS_KEPT:
                    openings.popitem(last=False)
        else:
            openings.move_to_end(key)
        with_prompt, without = opening
        if with_prompt[:len(without)] != without:
            raise ValueError("the chat template's generation prompt does not extend the prompt's "
                             "tokens; the agent loop needs an append-only template")
        self.generation_prompt = with_prompt[len(without):]
        self.input_ids: list[int] = list(without)
        self.action_mask = [0] * len(without)
        self.logprobs = [0.0] * len(without)
        self.prompt_length = len(without)
        self.turns: list[dict] = []

    def _template(self, messages: list[dict], add_generation_prompt: bool, tokenize: bool):
        return render(self.tokenizer, messages, self.task.tools, add_generation_prompt, tokenize)

    def _extend(self, ids: list[int], mask: int, logprobs: list[float] | None = None) -> None:
        self.input_ids += ids
        self.action_mask += [mask] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)

    def _piece_text(self, tool_message: dict | None) -> str:
        """What the template renders after the last assistant turn's end-of-turn token: the
        turn's closing text and, when given, the tool message (no generation prompt)."""
        messages = self.messages[:-1] + [{"role": "assistant", "content": _CONTENT_PLACEHOLDER}]
        if tool_message is not None:
            messages.append(tool_message)
        rendered = self._template(messages, add_generation_prompt=False, tokenize=False)
        marker = _CONTENT_PLACEHOLDER + self.turn_end
        at = rendered.rfind(marker)
        if at < 0:
            raise ValueError(f"the chat template does not end assistant turns with {self.turn_end}")
        return rendered[at + len(marker):]

    def _piece_form(self, role: str) -> tuple[str, str] | None:
        """(text before, text after) a ``role`` message's content in the piece, or None when the
        stand-in contents are not rendered verbatim between the same two texts."""
        forms = set()
        for stand_in in _STAND_INS:
            text = self._piece_text({"role": role, "content": stand_in})
            if text.count(stand_in) != 1:
                return None
            before, after = text.split(stand_in)
            forms.add((before, after))
        return forms.pop() if len(forms) == 1 else None

    def _piece_after_assistant(self, tool_message: dict | None) -> list[int]:
        """Token ids of :meth:`_piece_text`."""
        form = None
        if FAST_TEMPLATE and tool_message is not None:
            key = (*self._template_key, tool_message["role"])
            if key not in self._forms:
                self._forms[key] = self._piece_form(tool_message["role"])
            form = self._forms[key]
        if form is not None and tool_message["role"] in self._forms_checked:
            text = form[0] + tool_message["content"] + form[1]
        else:
            text = self._piece_text(tool_message)
            if form is not None:
                self._forms_checked.add(tool_message["role"])
                if text != form[0] + tool_message["content"] + form[1]:
                    self._forms[key] = None
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def fits_next_turn(self, max_new_tokens: int, max_length: int | None) -> bool:
        return (max_length is None
                or len(self.input_ids) + len(self.generation_prompt) + max_new_tokens <= max_length)

    def context(self) -> TurnContext:
        return TurnContext(self.task, len(self.turns), self.input_ids + self.generation_prompt,
                           self.session)

    def advance(self, generation: Generation, max_turns: int, max_length: int | None) -> str | None:
        """Record one generated turn, step the environment; the finish reason once it is over."""
        ids, logprobs = list(generation.token_ids), list(generation.logprobs)
        # A turn always ends with the end-of-turn token: the model's own (an action token), or one
        # closed for it (mask 0) when it was cut off or stopped on another stop token (Qwen3's
        # <|endoftext|> beside <|im_end|>). That other stop token was sampled like any other: it
        # stays an action token, so the trainer scores it, and the closing token follows it.
        stopped = bool(ids) and generation.finished
        closed = stopped and ids[-1] == self.turn_end_id
        # The action is what the model wrote before its stop token; the message holds every
        # generated token before the turn end, so that it renders to the very sequence.
        text = self._decode(ids[:-1] if stopped else ids)
        content = self._decode(ids) if stopped and not closed else text
        self._extend(self.generation_prompt, 0)
        self._extend(ids, 1, logprobs)
        if not closed:
            self._extend([self.turn_end_id], 0)
        self.messages.append({"role": "assistant", "content": content})

        action = parse_action(text, self.episode.tools)
        result = _step(self.episode, action)
        self.turns.append(turn_record(text, action, result, self.episode.code_answers))

        if result.done:
            reason = "answer" if isinstance(action, FinalAnswer) else "env_done"
        elif isinstance(action, FinalAnswer) and result.observation is None:
            reason = "answer"
        elif len(self.turns) >= max_turns:
            reason = "max_turns"
        else:
            reason = None
        if result.observation is None:
            self._extend(self._piece_after_assistant(None), 0)
            return reason
        # Environments with several user turns answer a final answer with the next user message.
        tool_message = {"role": result.info.get("role", "tool"),
                        "content": quote_special_tokens(result.observation, self.tokenizer)}
        piece = self._piece_after_assistant(tool_message)
        if max_length is not None and len(self.input_ids) + len(piece) > max_length:
            # The tool's answer does not fit the context: the sequence ends with the agent's turn.
            self._extend(self._piece_after_assistant(None), 0)
            return "max_length"
        self._extend(piece, 0)
        self.messages.append(tool_message)
        return reason

    def finish(self, reason: str) -> Rollout:
        verdict = self.episode.verify()
        return Rollout(
            task_id=self.task.task_id, domain=self.task.domain, instruction=self.task.instruction,
            input_ids=self.input_ids, action_mask=self.action_mask, logprobs=self.logprobs,
            prompt_length=self.prompt_length, reward=float(verdict.reward),
            success=bool(verdict.success), checks=[(str(d), bool(p)) for d, p in verdict.checks],
            num_turns=len(self.turns), messages=self.messages, turns=self.turns,
            finish_reason=reason)


def run_episodes(env: Environment, tasks: list[Task], policy: Policy, tokenizer, max_turns: int,
                 max_new_tokens: int, batch_size: int, progress: bool = False,
                 max_length: int | None = None) -> list[Rollout]:
    """Run one episode per task and return the rollouts in the order of ``tasks``.

    Up to ``batch_size`` episodes run side by side; every turn the policy acts for all of them in
    one call. An episode that ends leaves the batch and the next task takes its place, so the
    batch stays full until the queue is empty. An episode ends when the agent answers, after
    ``max_turns`` turns, or when its next turn would not fit ``max_length`` tokens (default: the
    policy's context length); its reward comes from ``episode.verify()`` in every case.
    """
    if max_turns < 1 or max_new_tokens < 1 or batch_size < 1:
        raise ValueError("max_turns, max_new_tokens and batch_size must all be >= 1")
    max_length = max_length if max_length is not None else policy.max_length
    results: list[Rollout | None] = [None] * len(tasks)
    queue = deque(enumerate(tasks))
    active: list[_EpisodeRun] = []
    with tqdm(total=len(tasks), disable=not progress, desc="episodes", unit="ep") as bar:
        def done(run: _EpisodeRun, reason: str) -> None:
            results[run.index] = run.finish(reason)
            bar.update(1)

        try:
            while queue or active:
                while queue and len(active) < batch_size:
                    index, task = queue.popleft()
                    run = _EpisodeRun(index, env.reset(task), tokenizer)
                    if run.fits_next_turn(max_new_tokens, max_length):
                        active.append(run)
                    else:
                        done(run, "max_length")
                if not active:
                    continue
                generations = policy.act([run.context() for run in active], max_new_tokens, tokenizer)
                still_active = []
                for run, generation in zip(active, generations, strict=True):
                    reason = run.advance(generation, max_turns, max_length)
                    if reason is None and not run.fits_next_turn(max_new_tokens, max_length):
                        reason = "max_length"
                    if reason is None:
                        still_active.append(run)
                    else:
                        done(run, reason)
                active = still_active
        finally:
            policy.release()
    return results


def rollout_episodes(env: Environment, tasks: list[Task], policy: Policy, tokenizer, rollout,
                     batch_size: int | None = None, progress: bool = False) -> list[Rollout]:
    """:func:`run_episodes` with a config's ``rollout`` settings (turns, tokens per turn, batch),
    allowing at least the environment's own turn budget (multi-turn benchmarks, code attempts)."""
    return run_episodes(env, tasks, policy, tokenizer,
                        max_turns=max(rollout.max_turns, env.max_episode_turns),
                        max_new_tokens=rollout.max_completion_length,
                        batch_size=batch_size or rollout.batch_size, progress=progress)


def summarize(rollouts: list[Rollout]) -> dict:
    """Headline figures of a set of rollouts, overall and per domain (what ``lopd eval`` prints)."""
    if not rollouts:
        raise ValueError("no rollouts to summarize")

    def figures(group: list[Rollout]) -> dict:
        n = len(group)
        return {
            "episodes": n,
            "mean_reward": sum(r.reward for r in group) / n,
            "success_rate": sum(r.success for r in group) / n,
            "mean_turns": sum(r.num_turns for r in group) / n,
            "generated_tokens": sum(r.generated_tokens for r in group),
        }

    by_domain: dict[str, list[Rollout]] = {}
    for rollout in rollouts:
        by_domain.setdefault(rollout.domain, []).append(rollout)
    summary = figures(rollouts)
    summary["finish_reasons"] = dict(Counter(r.finish_reason for r in rollouts))
    summary["per_domain"] = {domain: figures(group) for domain, group in sorted(by_domain.items())}
    return summary


# ----------------------------------------------------------------------------------------------
# What the loop and the teacher need from a chat template

_PROBE_SYSTEM = "You are an agent. Use the tools, then say Task Completed."
_PROBE_USER = "Where is order O1?"
_PROBE_RESULT = '{"order_id": "O1", "status": "shipped"}'
_PROBE_TASK = Task("probe-0", "probe", "train", "probe", _PROBE_USER, PROBE_TOOLS,
                   [{"name": "get_order", "arguments": {"order_id": "O1"}},
                    {"answer": "Shipped. Task Completed"}])


class _ProbeEpisode(Episode):
    """The episode of :data:`_PROBE_TASK`: any tool call gets the order's status as its result."""

    def __init__(self, task: Task):
        self.task = task

    def messages(self) -> list[dict]:
        return [{"role": "system", "content": _PROBE_SYSTEM},
                {"role": "user", "content": _PROBE_USER}]

    def step(self, action: Action) -> StepResult:
        if isinstance(action, ToolCall):
            return StepResult(_PROBE_RESULT, 0.0, False)
        return StepResult(None, 1.0, True)

    def verify(self) -> Verdict:
        return Verdict(1.0, True, [])


class _ProbeEnvironment(Environment):
    name = "probe"
    splits = ("train",)

    def tasks(self, split: str) -> list[Task]:
        return [_PROBE_TASK]

    def reset(self, task: Task) -> Episode:
        return _ProbeEpisode(task)


def probe_rollout(tokenizer) -> Rollout:
    """The oracle's episode of a one-tool probe task through the real loop: a system message with
    tools, the user's request, a tool call, its result, the final answer."""
    return run_episodes(_ProbeEnvironment(), [_PROBE_TASK], OraclePolicy(), tokenizer, max_turns=2,
                        max_new_tokens=64, batch_size=1)[0]


def check_chat_template(tokenizer) -> list[dict]:
    """What lopd needs from ``tokenizer`` and its chat template, checked one by one: each
    ``{"check", "ok", "required", "detail"}``. A failed required check means the agent loop or the
    teacher cannot run on this tokenizer as it is (``lopd model prepare`` refuses it); the one
    optional check tells whether rollouts decode to the template's own rendering (Qwen3-style
    templates that rewrite past turns do not)."""
    def decode(ids) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    checks: list[dict] = []
    rollout: list[Rollout] = []

    def check(name: str, probe, required: bool = True) -> None:
        try:
            ok, detail = probe()
        except ValueError as exc:
            ok, detail = False, str(exc)
        checks.append({"check": name, "ok": bool(ok), "required": required, "detail": detail})

    opening = _ProbeEpisode(_PROBE_TASK).messages()
    call = ToolCall("get_order", {"order_id": "O1"}).to_text()
    with_call = opening + [{"role": "assistant", "content": call}]

    def rendered(messages: list[dict], *needles: str) -> tuple[bool, str]:
        # A JSON-escaped rendering counts (Llama 3.1 writes tool results as JSON strings): the
        # loop takes whatever the template renders, it only needs the content to be there.
        text = render(tokenizer, messages, PROBE_TOOLS, tokenize=False)
        missing = [n for n in needles if n not in text and json.dumps(n)[1:-1] not in text]
        return not missing, f"missing {missing[0]!r}" if missing else "rendered"

    def latent_token() -> tuple[bool, str]:
        if LATENT_TOKEN not in tokenizer.get_vocab():
            return False, "absent: `lopd model prepare` adds it"
        ids = tokenizer.encode(LATENT_TOKEN, add_special_tokens=False)
        return len(ids) == 1, f"id {ids[0]}" if len(ids) == 1 else f"split into {len(ids)} tokens"

    def episode() -> tuple[bool, str]:
        rollout.append(probe_rollout(tokenizer))
        r = rollout[0]
        return (r.num_turns == 2 and r.reward == 1.0,
                f"{len(r.input_ids)} tokens, {r.generated_tokens} action tokens, turns end with "
                f"{turn_end_token(tokenizer)}")

    def reference() -> tuple[bool, str]:
        if not rollout:
            return False, "needs the probe episode"
        ids = rollout[0].input_ids
        header = user_header(tokenizer)
        found = find_subsequence(ids, header)
        if found < 0:
            return False, f"the user header {decode(header)!r} is not in the rollout"
        at = found + len(header)
        before, after = decode(ids[:at]), decode(ids[at:])
        content = after.find(_PROBE_USER)
        ok = (_PROBE_SYSTEM in before and _PROBE_USER not in before and content >= 0
              and turn_end_token(tokenizer) not in after[:content])
        where = f"after {decode(header)!r}"
        return ok, where + (" at the start of the first user message" if ok else
                            ", not at the start of the first user message")

    def same_text() -> tuple[bool, str]:
        if not rollout:
            return False, "needs the probe episode"
        r = rollout[0]
        same = decode(r.input_ids) == render(tokenizer, r.messages, PROBE_TOOLS, tokenize=False)
        return same, ("identical" if same else
                      "differs (the template rewrites past turns); training is unaffected")

    check("system message with tools", lambda: rendered(opening, _PROBE_SYSTEM, "get_order"))
    check("tool-call assistant turn", lambda: rendered(with_call, call))
    check("tool result message", lambda: rendered(
        with_call + [{"role": "tool", "content": _PROBE_RESULT}], _PROBE_RESULT))
    check("agent episode", episode)
    check("reference block placement", reference)
    check(f"{LATENT_TOKEN} token", latent_token)
    check("rollout text equals the template's", same_text, required=False)
    return checks
