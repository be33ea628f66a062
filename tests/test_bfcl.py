"""BFCL-v3 multi-turn through our agent loop: gold replay, junk, rejection, isolation."""

import os

import pytest

pytest.importorskip("bfcl", reason="BFCL needs nvidia-bfcl (installed by make)")

from lopd import agent, chat, models, policies  # noqa: E402
from lopd.chat import ToolCall
from lopd.envs import get_env  # noqa: E402
from lopd.envs.bfcl import SUBSETS  # noqa: E402


@pytest.fixture(scope="module")
def env():
    return get_env("bfcl")


@pytest.fixture(scope="module")
def tokenizer():
    return models.load_tokenizer(models.resolve_model_path("toolworld-1m"))


def run(env, tasks, policy, tokenizer):
    return agent.run_episodes(env, tasks, policy, tokenizer, max_turns=env.max_episode_turns,
                              max_new_tokens=64, batch_size=16)


def test_four_subsets_of_200():
    env = get_env("bfcl")
    assert [len(env.tasks(s)) for s in SUBSETS] == [200] * 4
    assert len({t.task_id for t in env.tasks("eval")}) == 800
    # Interleaved: any first 4k tasks hold k of each subset.
    assert [t.domain for t in env.tasks("eval")[:8]] == [*SUBSETS, *SUBSETS]
    with pytest.raises(ValueError, match="no split 'train'"):
        env.tasks("train")


def test_ground_truth_replay_scores_800_of_800(env, tokenizer):
    rollouts = run(env, env.tasks("eval"), policies.OraclePolicy(), tokenizer)
    failed = [(r.task_id, r.checks) for r in rollouts if not r.success]
    assert not failed
    assert len(rollouts) == 800


def test_an_agent_that_only_answers_text_scores_zero(env, tokenizer):
    tasks = [t for s in SUBSETS for t in env.tasks(s)[:10]]
    rollouts = run(env, tasks, policies.FixedTextPolicy("Task Completed"), tokenizer)
    assert sum(r.success for r in rollouts) == 0


def test_wrong_actions_are_rejected_and_held_back_docs_are_hidden(env):
    task = env.tasks("miss_func")[0]
    hidden = {"sort"}  # held back until turn 3 in this task
    assert not hidden & {t["function"]["name"] for t in task.tools}
    episode = env.reset(task)
    try:
        names = {t["function"]["name"] for t in episode.tools}
        bad = chat.parse_action('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
                                 episode.tools)
        assert "unknown tool" in episode.step(bad).observation
        missing = chat.parse_action('<tool_call>{"name": "mv", "arguments": {"source": "a"}}'
                                     '</tool_call>', episode.tools)
        assert "missing argument 'destination'" in episode.step(missing).observation
        assert "cd" in names
        result = episode.step(ToolCall("cd", {"folder": "no_such_dir"}))
        assert "No such" in result.observation or "rror" in result.observation
    finally:
        episode.verify()


def test_model_text_never_runs_as_code_and_a_dying_worker_cannot_hurt_the_parent(env, tmp_path):
    marker = tmp_path / "pwned"
    task = env.tasks("base")[0]
    episode = env.reset(task)
    try:
        payload = f"__import__('os').system('touch {marker}')"
        # As an argument value it is a string literal, executed by nobody.
        episode.step(ToolCall("cd", {"folder": payload}))
        # As a tool name it is not a tool.
        action = chat.parse_action('<tool_call>{"name": "__import__", "arguments": {}}'
                                    '</tool_call>', episode.tools)
        assert "unknown tool" in episode.step(action).observation
        assert not marker.exists()
        # Even code that does run in the worker (our own raw request, never model text) stays
        # there: the worker exits, the episode reports it, the parent carries on.
        parent = os.getpid()
        with pytest.raises(RuntimeError, match="worker"):
            episode._ask("exec", "__import__('os')._exit(3)")
        assert os.getpid() == parent
        verdict = episode.verify()
        assert not verdict.success and "checker" in verdict.checks[0][0]
    finally:
        episode.close()
