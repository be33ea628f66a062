"""The agent: the multi-turn rollout loop with its action masks, the rollout it records, and the
check that a tokenizer's chat template does what the loop needs. The policies that write the
assistant's turns are in :mod:`lopd.policies`; the chat format and the parsing of a model's text
into an action in :mod:`lopd.chat`; what an episode's turns are, as a record and as a compact
trace, in :mod:`lopd.envs.environment`.

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
``<|eot_id|>``, Tulu/OLMo's eos; :func:`lopd.chat.turn_end_token`); Qwen3-style templates that
rewrite past turns, e.g. to add or drop reasoning, differ only in those rewritten turns.
:func:`check_chat_template` tells whether a tokenizer's template does what the loop needs.

What an environment says (the opening's system and user messages, every observation) is text to
the model, never a special token: the text of the tokenizer's special and added tokens in it is
quoted (:func:`lopd.chat.quote_special_tokens`) before it is rendered, and the messages keep it
quoted, so the invariant holds with them.
"""

from __future__ import annotations

import itertools
import json
import weakref
from collections import Counter, OrderedDict, deque
from dataclasses import asdict, dataclass

from tqdm.auto import tqdm

from lopd.chat import (
    LATENT_TOKEN,
    PROBE_TOOLS,
    Action,
    FinalAnswer,
    ToolCall,
    parse_action,
    quote_special_tokens,
    render,
    turn_end_token,
)
from lopd.envs.environment import (
    Environment,
    Episode,
    StepResult,
    Task,
    Verdict,
    compact_trace,
    safe_step,
    turn_record,
)
from lopd.latent import find_subsequence, user_header
from lopd.policies import OraclePolicy, Policy, TurnContext
from lopd.rollout.engine import Generation

FINISH_REASONS = ("answer", "max_turns", "max_length", "env_done")
"""Why an episode ended: the agent answered; it used its last turn; the next turn would not fit the
model's context; the environment ended it after a tool call."""


# ----------------------------------------------------------------------------------------------
# The rollout record


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
    message holds it with special-token text quoted (:func:`lopd.chat.quote_special_tokens`)."""
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
        result = safe_step(self.episode, action)
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
