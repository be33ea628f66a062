"""The agent loop: action parsing, token bookkeeping and masks, batching invariance, policies."""

import json
from dataclasses import replace

import pytest

from lopd.agent import _CONTENT_PLACEHOLDER, Rollout, run_episodes, summarize
from lopd.chat import (
    FinalAnswer,
    Malformed,
    ToolCall,
    chat_safe,
    parse_action,
    quote_special_tokens,
    render,
)
from lopd.envs.environment import Environment, Episode, StepResult, Task, Verdict, replay_turns
from lopd.policies import (
    FixedTextPolicy,
    ModelPolicy,
    OraclePolicy,
    Policy,
    RandomPolicy,
    ScriptedPolicy,
)
from lopd.rollout import Generation, SamplingParams, TransformersEngine

# ----------------------------------------------------------------------------------------------
# A tiny fake environment: a counter and a colour label, two tools.

TOOLS = [
    {"type": "function", "function": {
        "name": "add", "description": "Add to the counter.",
        "parameters": {"type": "object", "properties": {"amount": {"type": "integer"}},
                       "required": ["amount"]}}},
    {"type": "function", "function": {
        "name": "paint", "description": "Set the label colour.",
        "parameters": {"type": "object",
                       "properties": {"colour": {"type": "string", "enum": ["red", "green"]},
                                      "note": {"type": "string"}},
                       "required": ["colour"]}}},
]


class CounterEpisode(Episode):
    def __init__(self, task: Task):
        self.task = task
        self.counter, self.colour = 0, None

    def messages(self):
        return [{"role": "system", "content": "You are an agent. Finish with Task Completed."},
                {"role": "user", "content": self.task.instruction}]

    def step(self, action):
        if isinstance(action, FinalAnswer):
            return StepResult(None, self.verify().reward, True)
        if isinstance(action, Malformed):
            return StepResult(f"Error: {action.error}", 0.0, False)
        if action.name == "add":
            self.counter += action.arguments["amount"]
        else:
            self.colour = action.arguments["colour"]
        return StepResult(json.dumps({"counter": self.counter, "colour": self.colour}), 0.0, False)

    def verify(self):
        target, colour = self.task.meta["target"], self.task.meta["colour"]
        checks = [(f"counter is {target}", self.counter == target),
                  (f"colour is {colour}", self.colour == colour)]
        passed = sum(ok for _, ok in checks)
        return Verdict(passed / len(checks), passed == len(checks), checks)


class CounterEnv(Environment):
    name = "counter"
    splits = ("train",)

    def tasks(self, split):
        out = []
        for i in range(5):
            target, colour = 3 + i, ("red", "green")[i % 2]
            out.append(Task(
                task_id=f"counter-{i}", env=self.name, split=split, domain=("a", "b")[i % 2],
                # Instructions of different lengths, so batched prompts need padding.
                instruction=f"Bring the counter to {target} and paint it {colour}." + " Now." * i,
                tools=TOOLS,
                oracle=[{"name": "add", "arguments": {"amount": target}},
                        {"name": "paint", "arguments": {"colour": colour}},
                        {"answer": "Done. Task Completed"}],
                meta={"target": target, "colour": colour}))
        return out

    def reset(self, task):
        return CounterEpisode(task)


@pytest.fixture(scope="module")
def env():
    return CounterEnv()


@pytest.fixture(scope="module")
def tasks(env):
    return env.tasks("train")


class Recording(Policy):
    """Wraps a policy and keeps every generation it returned, per task."""

    def __init__(self, inner):
        self.inner, self.generated = inner, {}
        self.max_length = inner.max_length

    def act(self, contexts, max_new_tokens, tokenizer):
        out = self.inner.act(contexts, max_new_tokens, tokenizer)
        for context, gen in zip(contexts, out):
            self.generated.setdefault(context.task.task_id, []).append(gen)
        return out


def assert_bookkeeping(rollout, tokenizer, generations=None, task_tools=TOOLS):
    """decode(input_ids) is the template's rendering of the messages; masks and log-probs align."""
    rendered = tokenizer.apply_chat_template(rollout.messages, tools=task_tools, tokenize=False)
    assert tokenizer.decode(rollout.input_ids, clean_up_tokenization_spaces=False) == rendered
    prompt = tokenizer.apply_chat_template(rollout.messages[:2], tools=task_tools, tokenize=False)
    assert tokenizer.decode(rollout.input_ids[:rollout.prompt_length]) == prompt
    assert len(rollout.input_ids) == len(rollout.action_mask) == len(rollout.logprobs)
    assert all(lp == 0.0 for lp, m in zip(rollout.logprobs, rollout.action_mask) if m == 0)
    assert sum(rollout.action_mask[:rollout.prompt_length]) == 0
    if generations is not None:
        action_ids = [t for t, m in zip(rollout.input_ids, rollout.action_mask) if m]
        action_lps = [lp for lp, m in zip(rollout.logprobs, rollout.action_mask) if m]
        assert action_ids == [t for g in generations for t in g.token_ids]
        assert action_lps == [lp for g in generations for lp in g.logprobs]
        assert rollout.generated_tokens == sum(len(g.token_ids) for g in generations)


# ----------------------------------------------------------------------------------------------
# Parsing


def call(name, arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


@pytest.mark.parametrize("text, error", [
    ("<tool_call>{\"name\": \"add\", </tool_call>", "invalid JSON in tool call"),
    (call("foo", {}), "unknown tool 'foo'"),
    (call("add", {}), "missing argument 'amount'"),
    (call("add", {"amount": "3"}), "argument 'amount' must be an integer"),
    (call("add", {"amount": True}), "argument 'amount' must be an integer"),
    (call("add", {"amount": 1.5}), "argument 'amount' must be an integer"),
    (call("paint", {"colour": "blue"}), "argument 'colour' must be one of \"red\", \"green\""),
    (call("paint", {"colour": "red", "size": 2}), "unknown argument 'size'"),
    (call("add", {"amount": 1}) + " and more", "text after </tool_call>"),
    (call("add", {"amount": 1}) * 2, "more than one tool call; write exactly one"),
    ('<tool_call>{"name": "add", "arguments": {"amount": 1}}', "missing </tool_call> closing tag"),
    ("I think I am done.", "no tool call and no 'Task Completed'"),
    ("<tool_call>[1, 2]</tool_call>",
     "tool call must be a JSON object with 'name' and 'arguments'"),
    ("<tool_call>{\"name\": 3, \"arguments\": {}}</tool_call>", "tool call needs a string 'name'"),
    ("<tool_call>{\"name\": \"add\"}</tool_call>", "tool call needs an 'arguments' object"),
    ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "'arguments' must be a JSON object"),
])
def test_parse_action_errors(text, error):
    action = parse_action(text, TOOLS)
    assert isinstance(action, Malformed) and action.error == error and action.text == text


def test_parse_action_accepts_calls_and_answers():
    text = "Let me add.\n" + call("add", {"amount": 2}) + "\n"
    assert parse_action(text, TOOLS) == ToolCall("add", {"amount": 2})
    assert parse_action(call("paint", {"colour": "green", "note": "x"}), TOOLS) == \
        ToolCall("paint", {"colour": "green", "note": "x"})
    assert parse_action("Done. Task Completed", TOOLS) == FinalAnswer("Done. Task Completed")
    # A bare (unwrapped) schema; numbers accept integers; array items are checked.
    bare = [{"name": "f", "parameters": {"properties": {
        "x": {"type": "number"}, "ids": {"type": "array", "items": {"type": "string"}}}}}]
    assert isinstance(parse_action(call("f", {"x": 2, "ids": ["a"]}), bare), ToolCall)
    error = parse_action(call("f", {"ids": ["a", 1]}), bare).error
    assert error == "argument 'ids[1]' must be a string"


@pytest.mark.parametrize("text", [
    "", "<tool_call>", "</tool_call>", "<tool_call></tool_call>", "<tool_call>null</tool_call>",
    "<tool_call>" + "[" * 100_000 + "</tool_call>",
    '<tool_call>{"name": "' + "x" * 500 + '"}</tool_call>',
    "\ud800<tool_call>\x00</tool_call>",
    '<tool_call>{"name": "add", "arguments": {"amount": NaN}}</tool_call>',
    "Task Completed</tool_call><tool_call>",
])
def test_parse_action_never_raises(text):
    action = parse_action(text, TOOLS)
    assert isinstance(action, (ToolCall, FinalAnswer, Malformed))
    if isinstance(action, Malformed):
        assert 0 < len(action.error) <= 80


# ----------------------------------------------------------------------------------------------
# The loop with scripted policies


def test_oracle_solves_every_task(env, tasks, tiny_tokenizer):
    policy = Recording(OraclePolicy())
    rollouts = run_episodes(env, tasks, policy, tiny_tokenizer, max_turns=6, max_new_tokens=64,
                            batch_size=2)
    assert [r.task_id for r in rollouts] == [t.task_id for t in tasks]
    for rollout in rollouts:
        assert rollout.reward == 1.0 and rollout.success and rollout.finish_reason == "answer"
        assert [t["kind"] for t in rollout.turns] == ["tool_call", "tool_call", "answer"]
        assert rollout.turns[-1]["observation"] is None
        assert [m["role"] for m in rollout.messages] == ["system", "user", "assistant", "tool",
                                                         "assistant", "tool", "assistant"]
        assert_bookkeeping(rollout, tiny_tokenizer, policy.generated[rollout.task_id])


def test_task_completed_ends_in_one_turn(env, tasks, tiny_tokenizer):
    rollouts = run_episodes(env, tasks[:2], FixedTextPolicy("Task Completed"), tiny_tokenizer,
                            max_turns=5, max_new_tokens=16, batch_size=4)
    for rollout in rollouts:
        assert rollout.num_turns == 1 and rollout.finish_reason == "answer"
        assert rollout.reward == 0.0 and not rollout.success
        assert [passed for _, passed in rollout.checks] == [False, False]
        assert_bookkeeping(rollout, tiny_tokenizer)


@pytest.mark.parametrize("text, error", [
    ("<tool_call>{bad json}</tool_call>", "invalid JSON in tool call"),
    (call("foo", {}), "unknown tool 'foo'"),
    (call("add", {}), "missing argument 'amount'"),
    (call("add", {"amount": "two"}), "argument 'amount' must be an integer"),
    (call("add", {"amount": 1}) + " ok?", "text after </tool_call>"),
    ("<tool_call>{\"name\": \"add\"", "missing </tool_call> closing tag"),
    ("hello there", "no tool call and no 'Task Completed'"),
])
def test_malformed_actions_become_error_observations(env, tasks, tiny_tokenizer, text, error):
    [rollout] = run_episodes(env, tasks[:1], FixedTextPolicy(text), tiny_tokenizer, max_turns=2,
                             max_new_tokens=16, batch_size=1)
    assert rollout.finish_reason == "max_turns" and rollout.num_turns == 2
    assert [t["observation"] for t in rollout.turns] == [f"Error: {error}"] * 2
    assert [t["kind"] for t in rollout.turns] == ["malformed"] * 2
    # The error names the tool-call tags: the model reads them as text, not as its tag tokens.
    observation = quote_special_tokens(f"Error: {error}", tiny_tokenizer)
    assert rollout.messages[-1] == {"role": "tool", "content": observation}
    assert_bookkeeping(rollout, tiny_tokenizer)


def test_random_policy_is_valid_and_deterministic(env, tasks, tiny_tokenizer):
    first = run_episodes(env, tasks, RandomPolicy(seed=1, answer_probability=0.2), tiny_tokenizer,
                         max_turns=4, max_new_tokens=32, batch_size=3)
    second = run_episodes(env, tasks, RandomPolicy(seed=1, answer_probability=0.2), tiny_tokenizer,
                          max_turns=4, max_new_tokens=32, batch_size=1)
    assert [r.to_dict() for r in first] == [r.to_dict() for r in second]
    kinds = {t["kind"] for r in first for t in r.turns}
    assert "malformed" not in kinds and "tool_call" in kinds


def test_rollout_serialises_and_compacts(env, tasks, tiny_tokenizer):
    [rollout] = run_episodes(env, tasks[1:2], OraclePolicy(), tiny_tokenizer, max_turns=6,
                             max_new_tokens=64, batch_size=1)
    again = Rollout.from_dict(json.loads(json.dumps(rollout.to_dict())))
    assert again == rollout
    trace = rollout.compact_trace(max_observation_chars=20)
    assert trace.splitlines() == [
        "Task: " + tasks[1].instruction,
        '1. add({"amount": 4}) -> {"counter": 4, "colo...',
        '2. paint({"colour": "green"}) -> {"counter": 4, "colo...',
        "3. answer: Done. Task Completed",
    ]


def test_summarize(env, tasks, tiny_tokenizer):
    oracle = run_episodes(env, tasks[:2], OraclePolicy(), tiny_tokenizer, 6, 64, 2)
    junk = run_episodes(env, tasks[2:5], FixedTextPolicy("Task Completed"), tiny_tokenizer,
                        6, 64, 2)
    summary = summarize(oracle + junk)
    assert summary["episodes"] == 5 and summary["mean_reward"] == pytest.approx(0.4)
    assert summary["success_rate"] == pytest.approx(0.4)
    assert summary["mean_turns"] == pytest.approx((3 * 2 + 3) / 5)
    assert summary["finish_reasons"] == {"answer": 5}
    assert {d: f["episodes"] for d, f in summary["per_domain"].items()} == {"a": 3, "b": 2}
    assert summary["per_domain"]["a"]["mean_reward"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError):
        summarize([])


# ----------------------------------------------------------------------------------------------
# The loop with the model


def test_model_rollouts_batched_equal_one_at_a_time(env, tasks, tiny_model, tiny_tokenizer):
    engine = TransformersEngine(tiny_model, tiny_tokenizer)
    params = SamplingParams(temperature=0, max_new_tokens=12)

    def run(batch_size):
        policy = Recording(ModelPolicy(engine, tiny_tokenizer, params))
        return policy, run_episodes(env, tasks[:4], policy, tiny_tokenizer, max_turns=3,
                                    max_new_tokens=12, batch_size=batch_size)

    policy, batched = run(3)
    _, alone = run(1)
    for b, a in zip(batched, alone):
        assert b.input_ids == a.input_ids and b.action_mask == a.action_mask
        assert b.messages == a.messages and b.turns == a.turns
        assert max(abs(x - y) for x, y in zip(b.logprobs, a.logprobs)) < 1e-4
        assert b.num_turns == 3 and b.finish_reason == "max_turns"
        assert_bookkeeping(b, tiny_tokenizer, policy.generated[b.task_id])


def test_model_rollouts_stop_at_max_length(env, tasks, tiny_model, tiny_tokenizer):
    engine = TransformersEngine(tiny_model, tiny_tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=0)
    policy = ModelPolicy(engine, tiny_tokenizer, params)
    prompt_len = len(tiny_tokenizer.apply_chat_template(
        CounterEpisode(tasks[0]).messages(), tools=TOOLS, add_generation_prompt=True)["input_ids"])
    max_length = prompt_len + 20
    [rollout] = run_episodes(env, tasks[:1], policy, tiny_tokenizer, max_turns=10, max_new_tokens=8,
                             batch_size=1, max_length=max_length)
    assert rollout.finish_reason == "max_length" and len(rollout.input_ids) <= max_length
    assert 1 <= rollout.num_turns < 10
    assert_bookkeeping(rollout, tiny_tokenizer)
    [cut] = run_episodes(env, tasks[:1], policy, tiny_tokenizer, max_turns=10, max_new_tokens=8,
                         batch_size=1, max_length=prompt_len + 7)
    assert cut.finish_reason == "max_length" and cut.num_turns == 0 and cut.reward == 0.0


class StopsOnEndOfText(Policy):
    """The oracle's turns as an engine with Qwen3's two eos ids returns them when the model stops
    on ``<|endoftext|>`` instead of ``<|im_end|>``: the text's tokens, then that stop token, every
    token with its own log-prob. Keeps the prompts it was given."""

    def __init__(self):
        self.generated, self.prompts = [], []

    def act(self, contexts, max_new_tokens, tokenizer):
        stop = tokenizer.convert_tokens_to_ids("<|endoftext|>")
        out = []
        for context in contexts:
            self.prompts.append(context.prompt_ids)
            text = context.task.oracle_texts()[context.turn]
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [stop]
            logprobs = [-0.01 * (i + 1) for i in range(len(ids))]
            out.append(Generation(token_ids=ids, logprobs=logprobs, finished=True))
        self.generated += out
        return out


def test_a_turn_ended_on_another_eos_keeps_that_token_as_an_action(env, tasks, tiny_tokenizer):
    """Qwen3 stops on <|im_end|> and <|endoftext|>: a turn ended on the second is that sampling
    decision, scored like any other (mask 1, its log-prob kept), and <|im_end|> is closed after it
    (mask 0). The message renders to the very sequence, the action parses without the stop token,
    and every prompt the model was given is a prefix of the sequence the trainer scores."""
    endoftext = tiny_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    im_end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert endoftext != im_end and endoftext == tiny_tokenizer.pad_token_id
    policy = StopsOnEndOfText()
    [rollout] = run_episodes(env, tasks[:1], policy, tiny_tokenizer, max_turns=6,
                             max_new_tokens=64, batch_size=1)
    assert rollout.reward == 1.0 and rollout.finish_reason == "answer"
    assert [t["kind"] for t in rollout.turns] == ["tool_call", "tool_call", "answer"]
    assert [t["action"] for t in rollout.turns] == tasks[0].oracle_texts()
    assert_bookkeeping(rollout, tiny_tokenizer, policy.generated)
    assert_same_tokens_as_the_full_rendering(rollout, tiny_tokenizer, TOOLS)
    stops = [i for i, t in enumerate(rollout.input_ids) if t == endoftext]
    assert len(stops) == 3
    for i in stops:
        assert rollout.action_mask[i] == 1 and rollout.logprobs[i] < 0
        assert rollout.input_ids[i + 1] == im_end and rollout.action_mask[i + 1] == 0
    assert [m["content"] for m in rollout.messages if m["role"] == "assistant"] == \
        [text + "<|endoftext|>" for text in tasks[0].oracle_texts()]
    for prompt in policy.prompts:
        assert rollout.input_ids[:len(prompt)] == prompt


def test_model_policy_needs_an_engine_that_stops_at_im_end(tiny_model, tiny_tokenizer):
    engine = TransformersEngine(tiny_model, tiny_tokenizer, stop_token_ids=[0])
    with pytest.raises(ValueError, match="must stop at <\\|im_end\\|>"):
        ModelPolicy(engine, tiny_tokenizer, SamplingParams())


def test_toolworld_oracle_through_the_loop(tiny_tokenizer):
    toolworld = pytest.importorskip("lopd.envs.toolworld")
    world = toolworld.ToolWorld(seed=0, sizes={"eval": 12})
    tasks = world.tasks("eval")[:12]
    policy = Recording(OraclePolicy())
    rollouts = run_episodes(world, tasks, policy, tiny_tokenizer, max_turns=8, max_new_tokens=96,
                            batch_size=5)
    assert all(r.reward == 1.0 and r.success and r.finish_reason == "answer" for r in rollouts)
    for rollout, task in zip(rollouts, tasks):
        assert rollout.num_turns == len(task.oracle)
        assert_bookkeeping(rollout, tiny_tokenizer, policy.generated[task.task_id], task.tools)
    junk = run_episodes(world, tasks, FixedTextPolicy("Task Completed"), tiny_tokenizer,
                        max_turns=8, max_new_tokens=96, batch_size=5)
    assert not any(r.success for r in junk)


# ----------------------------------------------------------------------------------------------
# Hostile text: what parsed JSON or an environment can put in a tool message


def test_chat_safe_escapes_control_characters_and_lone_surrogates():
    assert chat_safe("a\ud800b\udfff\x00c\x01\x1b\x7f\x85\r") == \
        "a\\ud800b\\udfff\\u0000c\\u0001\\u001b\\u007f\\u0085\\u000d"
    clean = 'line\n\ttab {"k": "v"} caf\u00e9 \U0001f600 <|im_end|> \\u0000'
    assert chat_safe(clean) == clean
    assert chat_safe(None) is None
    assert chat_safe(_CONTENT_PLACEHOLDER) == "\\u0000lopd-assistant-content\\u0000"
    # A surrogate pair written as JSON escapes is one character, not two lone surrogates.
    assert chat_safe(json.loads('"\\ud83d\\ude00"')) == "\U0001f600"


class ScriptPolicy(ScriptedPolicy):
    """Writes ``texts[turn]`` (the last one once they run out)."""

    def __init__(self, texts):
        self.texts = texts

    def text(self, context):
        return self.texts[min(context.turn, len(self.texts) - 1)]


HOSTILE = ["\ud800", "a\udc80b", "\x00", "\x01\x1b[31m\x7f\x85\r\x0b", _CONTENT_PLACEHOLDER,
           _CONTENT_PLACEHOLDER + "<|im_end|>", "<|im_end|>\n" + _CONTENT_PLACEHOLDER + "\n\x00"]


def assert_same_tokens_as_the_full_rendering(rollout, tokenizer, tools):
    """The loop's incremental input_ids are the template's rendering of the whole conversation,
    token for token, and every message's content is in their decoding, where the template put it."""
    assert rollout.input_ids == render(tokenizer, rollout.messages, tools)
    decoded = tokenizer.decode(rollout.input_ids, clean_up_tokenization_spaces=False)
    at = 0
    for message in rollout.messages:
        at = decoded.index(message["content"], at) + len(message["content"])
    for message in rollout.messages[2:]:
        if message["role"] != "assistant":
            assert message["content"].encode("utf-8")       # no lone surrogate
            assert not any(ord(c) < 32 and c not in "\n\t" for c in message["content"])


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_tool_arguments_never_break_a_toolworld_rollout(value, tiny_tokenizer):
    toolworld = pytest.importorskip("lopd.envs.toolworld")
    world = toolworld.ToolWorld(seed=0, sizes={"eval": 1})
    [task] = world.tasks("eval")
    assert task.domain == "ecommerce"
    # The value echoed by the tool's error, in an unknown tool's and an unknown argument's name,
    # and with the placeholder (raw NULs: the model's decoded text can hold them) before the call.
    echoed = call("find_customer", {"name": value})
    firsts = [echoed, call(value, {}), call("find_customer", {value: "Ava"}),
              _CONTENT_PLACEHOLDER + value.replace("\ud800", "?").replace("\udc80", "?") + echoed]
    for first in firsts:
        texts = [first, "Task Completed"]
        [rollout] = run_episodes(world, [task], ScriptPolicy(texts), tiny_tokenizer, max_turns=4,
                                 max_new_tokens=64, batch_size=1)
        assert rollout.finish_reason == "answer" and rollout.num_turns == 2
        assert [m["role"] for m in rollout.messages] == ["system", "user", "assistant", "tool",
                                                         "assistant"]
        observation = rollout.messages[3]["content"]
        assert quote_special_tokens(rollout.turns[0]["observation"], tiny_tokenizer) == observation
        if first == echoed:
            told = "Error: no customer named " + chat_safe(value)
            assert observation == quote_special_tokens(told, tiny_tokenizer)
        assert_bookkeeping(rollout, tiny_tokenizer, task_tools=task.tools)
        assert_same_tokens_as_the_full_rendering(rollout, tiny_tokenizer, task.tools)
        assert replay_turns(world, task, texts) == rollout.turns


class EchoEpisode(CounterEpisode):
    """Quotes a note raw, whatever it holds: first as a tool result, then as the next user turn
    (the way BFCL answers a final answer), so text an environment builds itself is covered too."""

    def step(self, action):
        note = self.task.meta["note"]
        if isinstance(action, FinalAnswer) and self.colour is None:
            self.colour = "red"
            return StepResult("Next request: " + note, 0.0, False, {"role": "user"})
        if isinstance(action, ToolCall):
            return StepResult(f"ran {action.name} on " + note, 0.0, False)
        return super().step(action)


class EchoEnv(CounterEnv):
    def tasks(self, split):
        return [replace(t, meta={**t.meta, "note": note})
                for t, note in zip(super().tasks(split), HOSTILE)]

    def reset(self, task):
        return EchoEpisode(task)


def test_hostile_environment_text_never_breaks_a_rollout(tiny_tokenizer):
    env = EchoEnv()
    tasks = env.tasks("train")
    texts = [call("add", {"amount": 1}), "Task Completed", call("paint", {"colour": "red"}),
             "Task Completed"]
    rollouts = run_episodes(env, tasks, ScriptPolicy(texts), tiny_tokenizer, max_turns=6,
                            max_new_tokens=64, batch_size=3)
    for rollout, task in zip(rollouts, tasks):
        assert rollout.finish_reason == "answer" and rollout.num_turns == 4
        assert [m["role"] for m in rollout.messages[2:]] == ["assistant", "tool", "assistant",
                                                             "user", "assistant", "tool",
                                                             "assistant"]
        assert rollout.messages[5]["content"] == quote_special_tokens(
            "Next request: " + chat_safe(task.meta["note"]), tiny_tokenizer)
        assert_bookkeeping(rollout, tiny_tokenizer)
        assert_same_tokens_as_the_full_rendering(rollout, tiny_tokenizer, TOOLS)
