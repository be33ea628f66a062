"""Oracle trajectories in the environment protocol: the replayed oracle is the bank's compact trace
of the oracle's own rollout (toolworld, codeworld); evaluation tasks and environments without
oracle trajectories refuse in one line."""

import pytest

from lopd import agent, models
from lopd.envs import get_env
from lopd.envs.codeworld import CodeWorld
from lopd.envs.environment import OracleError


@pytest.fixture(scope="module")
def toolworld():
    return get_env("toolworld", seed=0, sizes={"train": 12, "eval": 3, "pretrain": 0})


def test_toolworld_oracle_trace_is_the_compact_trace_of_the_oracles_rollout(toolworld):
    _, tokenizer = models.load_model("toolworld-1m")
    tasks = toolworld.tasks("train")
    rollouts = agent.run_episodes(toolworld, tasks, agent.OraclePolicy(), tokenizer, max_turns=8,
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
    rollouts = agent.run_episodes(world.for_transcripts(), tasks, agent.OraclePolicy(), tokenizer,
                                  max_turns=1, max_new_tokens=200, batch_size=6)
    for task, rollout in zip(tasks, rollouts):
        assert world.oracle_trace(task, 1000) == rollout.compact_trace(1000)
        assert world.oracle_trace(task) == rollout.compact_trace(80)
    # With room for it, the whole reference function is in the trace (whitespace collapsed, as
    # the bank stores answers).
    code = " ".join(tasks[0].oracle_texts()[0].split())
    assert code in world.oracle_trace(tasks[0], 10_000)


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
