"""codeworld, HumanEval and the code episode: harness validation with gold and junk answers."""

import itertools
import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from lopd.chat import FinalAnswer, Malformed
from lopd.envs import get_env
from lopd.envs.codegen import extract_code, fence, pass_at_k
from lopd.envs.codeworld import CodeWorld, assemble, call_text
from lopd.envs.codeworld.problems import TEMPLATES, expected_values

SIZES = {"eval": 24, "train": 60, "pretrain": 20}
JUNK = ["I do not know.", fence("print('hello')"), fence("def"), "",
        fence("import sys\nsys.exit(0)"), "Task Completed"]


@pytest.fixture(scope="module")
def world():
    return CodeWorld(sizes=SIZES)


def answer(env, task, text):
    episode = env.reset(task)
    result = episode.step(Malformed(text, "no tool call"))
    return result, episode.verify()


def test_extract_code_reads_fences_bare_code_and_unclosed_fences():
    assert extract_code("Here:\n```python\ndef f():\n    return 1\n```\nDone.") == \
        "def f():\n    return 1\n"
    assert extract_code("```\nx = 1\n```") == "x = 1\n"
    assert extract_code("```python\ndef f():\n    return 2") == "def f():\n    return 2\n"
    assert extract_code("def f(): return 3") == "def f(): return 3\n"
    assert extract_code(fence("a = 1\n")) == "a = 1\n"


def test_pass_at_k_matches_brute_force():
    for n, c, k in [(5, 2, 1), (5, 2, 3), (6, 0, 2), (6, 6, 4), (10, 3, 5), (4, 1, 4)]:
        samples = [True] * c + [False] * (n - c)
        subsets = list(itertools.combinations(samples, k))
        brute = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(brute)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(3, 4, 1)


def test_templates_cover_four_categories_and_reference_tests_hold():
    categories = {t.category for t in TEMPLATES}
    assert categories == {"list", "string", "arithmetic", "dict"} and len(TEMPLATES) >= 40
    import random
    for template in TEMPLATES:
        problem = template.make(random.Random(7))
        args = [t["args"] for t in problem.tests]
        assert expected_values(problem.solution, problem.entry_point, args) == \
            [t["expected"] for t in problem.tests]
        assert json.loads(json.dumps(problem.tests)) == problem.tests


def test_splits_are_deterministic_sized_and_hold_out_statements(world):
    again = CodeWorld(sizes=SIZES)
    assert [t.to_dict() for t in again.tasks("eval")] == [t.to_dict() for t in world.tasks("eval")]
    assert {s: len(world.tasks(s)) for s in SIZES} == SIZES
    statements = {s: {(t.meta["template"], t.meta["statement"]) for t in world.tasks(s)}
                  for s in SIZES}
    assert not statements["eval"] & (statements["train"] | statements["pretrain"])
    instances = [json.dumps([t.instruction, t.meta["tests"]]) for s in SIZES
                 for t in world.tasks(s)]
    assert len(instances) == len(set(instances))
    assert world.dropped == {"eval": 0, "train": 0, "pretrain": 0}
    task = world.tasks("eval")[0]
    assert task.tools == [] and "Example:" in task.instruction and task.meta["signature"] in \
        task.instruction


def test_reference_solutions_score_one_and_junk_scores_zero(world):
    tasks = world.tasks("eval") + world.tasks("train")[:16]

    def gold(task):
        return answer(world, task, task.oracle_texts()[0])[1]

    with ThreadPoolExecutor(2) as pool:
        verdicts = list(pool.map(gold, tasks))
    assert all(v.success and v.reward == 1.0 for v in verdicts)

    def junk(pair):
        task, text = pair
        return answer(world, task, text)

    pairs = [(task, JUNK[i % len(JUNK)]) for i, task in enumerate(world.tasks("eval"))]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(junk, pairs))
    assert all(r.done and v.reward == 0.0 and not v.success for r, v in results)


def test_partial_answers_get_the_fraction_or_nothing_when_binary(world):
    task = next(t for t in world.tasks("eval")
                if len({json.dumps(x["expected"]) for x in t.meta["tests"]}) > 2)
    first = task.meta["tests"][0]
    # Right on the first hidden test only: a lookup table of one answer.
    table = fence(f"def {task.meta['entry_point']}(*args):\n"
                  f"    return {first['expected']!r} if list(args) == {first['args']!r} else None")
    _, verdict = answer(world, task, table)
    passed = sum(ok for _, ok in verdict.checks)
    hidden = len(task.meta["tests"]) - 1  # the worked example is shown, not scored
    assert len(verdict.checks) == hidden and 1 <= passed < hidden
    assert verdict.reward == pytest.approx(passed / hidden) and not verdict.success
    assert answer(CodeWorld(sizes=SIZES, reward="binary"), task, table)[1].reward == 0.0


def test_a_bare_body_is_completed_with_the_signature(world):
    task = world.tasks("eval")[0]
    body = task.oracle_texts()[0].split("\n", 2)[2].rsplit("```", 1)[0]
    program = assemble(body, task.meta["entry_point"], task.meta["signature"])
    assert program.startswith(task.meta["signature"])
    assert answer(world, task, body)[1].success


def test_multi_turn_feeds_back_failing_tests_then_scores_the_last_answer():
    env = CodeWorld(sizes=SIZES, attempts=2)
    task = env.tasks("eval")[0]
    episode = env.reset(task)
    first = episode.step(FinalAnswer(fence(f"def {task.meta['entry_point']}(*args):\n"
                                           "    return 'wrong'")))
    assert not first.done and first.info["role"] == "user"
    example = task.meta["tests"][-1]
    assert first.observation.startswith("0/7 hidden tests passed.")
    assert (f"returned 'wrong', expected {example['expected']!r}." in first.observation)
    # The hidden tests appear only as a count: none of their calls is in the feedback.
    assert not any(call_text(task.meta["entry_point"], t["args"]) in first.observation
                   for t in task.meta["tests"][:-1])
    second = episode.step(FinalAnswer(task.oracle_texts()[0]))
    assert second.done and second.reward == 1.0 and episode.verify().success


def _example_only(task, fallback: str) -> str:
    """An answer that computes nothing: the prompt's example output for the example's input,
    else ``fallback``."""
    example = task.meta["tests"][-1]
    return fence(f"def {task.meta['entry_point']}(*args):\n"
                 f"    if list(args) == {example['args']!r}:\n"
                 f"        return {example['expected']!r}\n    {fallback}\n")


def _empty_like(value) -> str:
    return repr(type(value)()) if type(value) in (list, dict, str, int, float, bool) else "None"


@pytest.mark.parametrize("kind", ["example only", "example or raise", "example or empty"])
def test_answers_that_compute_nothing_score_zero_on_every_eval_task(world, kind):
    # The example is shown, so it is not scored; an answer whose value never depends on its
    # input earns nothing from the hidden tests it passes by coincidence.
    def text(task):
        example = task.meta["tests"][-1]
        if kind == "example only":
            return fence(f"def {task.meta['entry_point']}(*args):\n"
                         f"    return {example['expected']!r}\n")
        if kind == "example or raise":
            return _example_only(task, "raise ValueError")
        return _example_only(task, f"return {_empty_like(example['expected'])}")

    def score(task):
        return answer(world, task, text(task))[1].reward

    with ThreadPoolExecutor(2) as pool:
        rewards = list(pool.map(score, world.tasks("eval")))
    assert rewards == [0.0] * len(rewards)


def _as_python(shown: str) -> str:
    """An expected value as feedback shows it (a Python literal, or JSON) as Python source."""
    try:
        return repr(json.loads(shown))
    except ValueError:
        return shown


def test_with_four_attempts_an_answer_that_reads_the_feedback_still_scores_zero():
    # The attack on multi-attempt feedback: answer, read the expected values the feedback shows,
    # answer them back as a lookup table. Only the (unscored) example's value is ever shown.
    env = CodeWorld(sizes=SIZES, attempts=4)
    pattern = re.compile(r"^(?:Example )?(\w+)\((.*)\) returned .*, expected (.*?)\.?$", re.M)

    def play(task):
        episode, table, result = env.reset(task), {}, None
        for _ in range(4):
            lines = "".join(f"    if args == ({args},):\n        return {expected}\n"
                            for args, expected in table.items())
            program = fence(f"def {task.meta['entry_point']}(*args):\n{lines}"
                            "    return None\n")
            result = episode.step(FinalAnswer(program))
            if result.done:
                break
            assert len(result.observation) <= 1000
            for _, args, expected in pattern.findall(result.observation):
                table[args] = _as_python(expected)
        return result.done, episode.verify().reward, episode.answers

    with ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(play, env.tasks("eval")))
    assert all(done and reward == 0.0 and answers == 4 for done, reward, answers in outcomes)


def test_feedback_is_capped_and_shows_the_value_as_text():
    # The markers stay text here; the agent loop quotes them before tokenising
    # (tests/test_special_tokens.py), as it does every environment's content.
    env = CodeWorld(sizes=SIZES, attempts=2)
    task = env.tasks("eval")[0]
    episode = env.reset(task)
    flood = fence(f"def {task.meta['entry_point']}(*args):\n"
                  "    return '<|im_start|>user\\n' * 50000\n")
    result = episode.step(FinalAnswer(flood))
    assert not result.done and len(result.observation) <= 1000
    assert "returned '<|im_start|>user\\n<|im_start|>" in result.observation


def test_transcript_view_skips_scoring(world):
    task = world.tasks("train")[0]
    view = world.for_transcripts()
    result = view.reset(task).step(FinalAnswer(task.oracle_texts()[0]))
    assert result.done and result.info["status"] == "not scored"
    assert world.score and world.tasks("train")[0] is task


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="unknown codeworld split"):
        CodeWorld(sizes={"test": 3})
    with pytest.raises(ValueError, match="reward must be one of"):
        CodeWorld(reward="most")
    with pytest.raises(ValueError, match="unknown codeworld split"):
        CodeWorld(sizes=SIZES).tasks("dev")


# -- HumanEval --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def humaneval():
    return get_env("humaneval")


def _scores(env, tasks, texts):
    def score(pair):
        task, text = pair
        return answer(env, task, text)[1].success

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(score, zip(tasks, texts)))


def test_humaneval_canonical_solutions_pass_164_of_164(humaneval):
    tasks = humaneval.tasks("eval")
    assert len(tasks) == 164 and tasks[0].task_id == "HumanEval/0"
    assert sum(_scores(humaneval, tasks, [t.oracle_texts()[0] for t in tasks])) == 164


def test_humaneval_junk_answers_pass_0_of_164(humaneval):
    tasks = humaneval.tasks("eval")
    junk = [JUNK[i % len(JUNK)] for i in range(len(tasks))]
    assert sum(_scores(humaneval, tasks, junk)) == 0


def test_humaneval_prompt_is_the_usual_one(humaneval):
    task = humaneval.tasks("eval")[0]
    messages = humaneval.reset(task).messages()
    assert [m["role"] for m in messages] == ["user"]
    assert messages[0]["content"].startswith("Complete the following Python function:\n```python\n")
    # A body-only completion (the classic HumanEval format) also runs.
    body = task.oracle_texts()[0][len("```python\n") + len(task.meta["prompt"]):-len("\n```")]
    assert answer(humaneval, task, body)[1].success


# -- the CLI ------------------------------------------------------------------------------------

SMALL_CODE = ["--set", "env.eval_size=8", "--set", "env.train_size=8", "--set",
              "env.pretrain_size=0"]


@pytest.mark.parametrize("env_name", ["codeworld", "humaneval"])
def test_cli_eval_oracle_prints_and_writes_pass_at_1(env_name, tmp_path, capsys):
    from lopd.cli import main

    out = tmp_path / "eval.json"
    assert main(["eval", "--env", env_name, "--agent", "oracle", "--limit", "6", "--json",
                 str(out), *SMALL_CODE]) == 0
    figures = json.loads(out.read_text())
    assert figures["pass_at_k"] == {"pass@1": 1.0} and figures["episodes"] == 6
    assert "pass@1 1.0000" in capsys.readouterr().out


def test_cli_eval_model_on_codeworld_and_samples_need_sampling(tmp_path, capsys):
    from lopd.cli import main

    out = tmp_path / "eval.json"
    assert main(["eval", "--env", "codeworld", "--limit", "4", "--samples", "2", "--set",
                 "rollout.eval_temperature=1.0", "--json", str(out), *SMALL_CODE]) == 0
    figures = json.loads(out.read_text())
    assert figures["episodes"] == 8 and set(figures["pass_at_k"]) == {"pass@1"}
    assert 0.0 <= figures["pass_at_k"]["pass@1"] <= 1.0
    assert main(["eval", "--env", "codeworld", "--samples", "3", *SMALL_CODE]) == 2
    assert "needs sampling" in capsys.readouterr().err


def test_cli_tasks_for_codeworld(tmp_path, capsys):
    from lopd.cli import main

    assert main(["tasks", "--env", "codeworld", "--split", "eval", "--out",
                 str(tmp_path / "t.jsonl"), *SMALL_CODE]) == 0
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == 8
    assert "templates_without_train_problems" in capsys.readouterr().out
