"""Oracle trajectories in the environment protocol: the replayed oracle is the bank's compact trace
of the oracle's own rollout (toolworld; codeworld, whose reference function is kept whole);
toolworld traces are unchanged by the code-answer rule; evaluation tasks and environments without
oracle trajectories refuse in one line."""

import pytest

from lopd import agent, models, policies
from lopd.envs import environment, get_env
from lopd.envs.codeworld import CodeWorld
from lopd.envs.environment import OracleError


@pytest.fixture(scope="module")
def toolworld():
    return get_env("toolworld", seed=0, sizes={"train": 12, "eval": 3, "pretrain": 0})


def test_toolworld_oracle_trace_is_the_compact_trace_of_the_oracles_rollout(toolworld):
    _, tokenizer = models.load_model("toolworld-1m")
    tasks = toolworld.tasks("train")
    rollouts = agent.run_episodes(toolworld, tasks, policies.OraclePolicy(), tokenizer, max_turns=8,
                                  max_new_tokens=96, batch_size=12)
    assert all(r.success for r in rollouts)
    for chars in (80, 20):
        for task, rollout in zip(tasks, rollouts):
            assert toolworld.oracle_trace(task, chars) == rollout.compact_trace(chars)
    trace = toolworld.oracle_trace(tasks[0])
    # The task line, one line per oracle action with the real tool results, the final answer.
    lines = trace.splitlines()
    assert lines[0] == f"Task: {tasks[0].instruction}" and len(lines) == 1 + len(tasks[0].oracle)
    assert lines[-1].endswith("answer: Task Completed")
    assert all(f"{a['name']}(" in line for a, line in zip(tasks[0].oracle[:-1], lines[1:]))
    assert " -> " in lines[1]


def test_codeworld_oracle_trace_is_the_compact_trace_of_the_reference_answer():
    world = CodeWorld(sizes={"train": 6, "eval": 2, "pretrain": 0}, verify=False)
    _, tokenizer = models.load_model("codeworld-1m")
    tasks = world.tasks("train")
    rollouts = agent.run_episodes(world.for_transcripts(), tasks, policies.OraclePolicy(), tokenizer,
                                  max_turns=1, max_new_tokens=200, batch_size=6)
    for task, rollout in zip(tasks, rollouts):
        assert world.oracle_trace(task, 1000) == rollout.compact_trace(1000)
        assert world.oracle_trace(task) == rollout.compact_trace(80)
    # At the bank's 80 characters the whole reference function is in the trace, verbatim (lines
    # and indentation kept), as the answer, not as a malformed action.
    for task in tasks:
        answer = task.oracle_texts()[0]
        assert len(answer) > 80 and answer.count("\n") >= 3
        assert world.oracle_trace(task) == f"Task: {task.instruction}\n1. answer:\n{answer}"
        assert "malformed" not in world.oracle_trace(task)
    # A failed attempt with test feedback (two attempts): the code whole, the feedback on its own
    # line, cut like any observation.
    retry = CodeWorld(sizes={"train": 6, "eval": 2, "pretrain": 0}, verify=False, attempts=2)
    task = retry.tasks("train")[0]
    wrong = "```python\ndef nothing():\n    return None\n```"
    turns = environment.replay_turns(retry, task, [wrong, task.oracle_texts()[0]])
    assert [t["kind"] for t in turns] == ["code", "code"]
    trace = environment.compact_trace(task.instruction, turns, 30)
    assert trace.startswith(f"Task: {task.instruction}\n1. answer:\n")
    lines = trace[len(f"Task: {task.instruction}\n"):].split("\n")
    assert lines[:5] == ["1. answer:", "```python", "def nothing():", "    return None", "```"]
    assert lines[5].startswith("-> ") and len(lines[5]) <= len("-> ") + 33
    assert "\n".join(lines[6:]) == "2. answer:\n" + task.oracle_texts()[0]


def test_toolworld_traces_are_byte_identical_to_the_traces_before_code_answers():
    """The code-answer rule leaves every toolworld trace as it was: oracle traces, and sampled
    traces with tool calls, answers and malformed actions, at two observation lengths (digest
    of the traces written by the code before the rule existed)."""
    import hashlib

    env = get_env("toolworld", seed=0, sizes={"train": 8, "eval": 2, "pretrain": 0})
    tasks = env.tasks("train")
    _, tok = models.load_model("toolworld-1m")
    junk = agent.run_episodes(env, tasks, policies.RandomPolicy(seed=0), tok, 3, 48, 8)
    chatter = "I think the order is fine, nothing to do here at all really, so I will stop now."
    junk += agent.run_episodes(env, tasks, policies.FixedTextPolicy(chatter), tok, 2, 48, 8)
    assert {t["kind"] for r in junk for t in r.turns} == {"answer", "malformed", "tool_call"}
    traces = ([env.oracle_trace(t) for t in tasks] + [r.compact_trace(80) for r in junk]
              + [r.compact_trace(20) for r in junk])
    assert traces[0] == (
        'Task: Cancel order O226 of customer C384.\n'
        '1. cancel_order({"order_id": "O226"}) -> Error: order O226 is already shipped and '
        'cannot be cancelled\n'
        '2. open_ticket({"order_id": "O226", "reason": "already_shipped"}) -> '
        '{"ticket_id":"T1","order_id":"O226","reason":"already_shipped"}\n'
        '3. answer: Task Completed')
    assert hashlib.sha256("\n\n".join(traces).encode()).hexdigest() == \
        "28d8f67025d4a0cb90ddefe67a8670cff525ccdfc47056d673a4b943725e37b3"


def test_an_eval_task_never_gives_out_its_oracle(toolworld):
    task = toolworld.tasks("eval")[0]
    with pytest.raises(OracleError) as err:
        toolworld.oracle_trace(task)
    message = str(err.value)
    assert task.task_id in message and "eval split" in message and "train" in message
    assert len(message.splitlines()) == 1
    codeworld = CodeWorld(sizes={"train": 2, "eval": 2, "pretrain": 2}, verify=False)
    for split in ("eval", "pretrain"):
        with pytest.raises(OracleError, match=f"in the {split} split"):
            codeworld.oracle_trace(codeworld.tasks(split)[0])


def test_an_environment_without_oracle_trajectories_refuses_naming_itself(toolworld):
    humaneval = get_env("humaneval")
    with pytest.raises(OracleError, match="sdft needs oracle trajectories.*humaneval"):
        humaneval.require_oracle("sdft")
    with pytest.raises(OracleError, match="environment humaneval has no oracle trajectories"):
        humaneval.oracle_trace(humaneval.tasks("eval")[0])
    toolworld.require_oracle("sdft")            # has them: no error
    other = get_env("codeworld", sizes={"train": 1, "eval": 1, "pretrain": 0}, verify=False)
    with pytest.raises(OracleError, match="belongs to environment toolworld"):
        other.oracle_trace(toolworld.tasks("train")[0])
