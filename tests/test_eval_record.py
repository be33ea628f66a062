"""A resumable evaluation (`lopd eval --record`): chunks appended as they finish, tasks already
recorded not run again, the summary over every recorded task equal to a one-go evaluation's."""

import json

import pytest

from lopd import stages
from lopd.cli import main
from lopd.config import load_config

SETS = ["env.train_size=20", "env.eval_size=6", "env.pretrain_size=0"]
FIGURES = ("episodes", "mean_reward", "success_rate", "mean_turns", "generated_tokens",
           "finish_reasons", "per_domain")


@pytest.fixture(scope="module")
def cfg():
    return load_config("tiny", SETS)


@pytest.fixture(scope="module")
def whole(cfg):
    """The model agent on the 6 eval tasks in one go, without a record."""
    return stages.evaluate_agent(cfg, "model", split="eval", progress=False)


def test_a_chunked_record_gives_the_one_go_figures_and_a_line_per_episode(cfg, whole, tmp_path):
    record = tmp_path / "eval.jsonl"
    summary, rollouts = stages.evaluate_agent(cfg, "model", split="eval", progress=False,
                                              record=record, chunk=4)
    assert {k: summary[k] for k in FIGURES} == {k: whole[0][k] for k in FIGURES}
    assert summary["tasks"] == 6 and len(rollouts) == 6
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert [line["task_id"] for line in lines] == [r.task_id for r in whole[1]]
    assert [line["reward"] for line in lines] == [r.reward for r in whole[1]]
    assert {line["env"] for line in lines} == {"toolworld"}
    assert {line["agent"] for line in lines} == {"model"}
    assert {line["engine"] for line in lines} == {"TransformersEngine"}
    assert {line["dtype"] for line in lines} == {"float32"}
    # The chunks' wall-clock, shared over their episodes, sums to the summary's.
    assert summary["record_seconds"] == pytest.approx(sum(line["seconds"] for line in lines),
                                                      abs=0.1)
    assert sum(summary["ran_on"].values()) == 6


def test_an_interrupted_record_resumes_where_it_stopped(cfg, whole, tmp_path, monkeypatch):
    record = tmp_path / "eval.jsonl"
    real = stages.evaluate
    calls = []

    def stop_at_the_second_chunk(*args, **kwargs):
        calls.append(len(args[2]))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(stages, "evaluate", stop_at_the_second_chunk)
    with pytest.raises(KeyboardInterrupt):
        stages.evaluate_agent(cfg, "model", split="eval", progress=False, record=record, chunk=4)
    assert len(record.read_text().splitlines()) == 4  # the finished chunk only
    monkeypatch.setattr(stages, "evaluate", real)
    summary, rollouts = stages.evaluate_agent(cfg, "model", split="eval", progress=False,
                                              record=record, chunk=4)
    assert [r.task_id for r in rollouts] == [r.task_id for r in whole[1][4:]]
    assert {k: summary[k] for k in FIGURES} == {k: whole[0][k] for k in FIGURES}
    # Complete: the figures come from the file alone, no model is loaded.
    monkeypatch.setattr(stages, "agent_policy", lambda *a, **k: pytest.fail("model loaded"))
    again, none = stages.evaluate_agent(cfg, "model", split="eval", progress=False, record=record)
    assert none == [] and {k: again[k] for k in FIGURES} == {k: whole[0][k] for k in FIGURES}
    # A smaller --limit counts only its own tasks; the other lines stay in the file.
    few, _ = stages.evaluate_agent(cfg, "model", split="eval", limit=2, progress=False,
                                   record=record)
    assert few["episodes"] == 2 and few["tasks"] == 2
    assert few["mean_reward"] == pytest.approx(sum(r.reward for r in whole[1][:2]) / 2)
    assert len(record.read_text().splitlines()) == 6


def test_a_record_of_another_evaluation_or_a_bad_line_is_refused_and_kept(cfg, tmp_path):
    record = tmp_path / "eval.jsonl"
    stages.evaluate_agent(cfg, "oracle", split="eval", limit=2, progress=False, record=record)
    kept = record.read_text()
    with pytest.raises(ValueError, match=r"eval.jsonl:1 records another evaluation: agent "
                       r"'oracle' \(here 'random'\); give another file"):
        stages.evaluate_agent(cfg, "random", split="eval", progress=False, record=record)
    with pytest.raises(ValueError, match=r"split 'eval' \(here 'train'\)"):
        stages.evaluate_agent(cfg, "oracle", split="train", progress=False, record=record)
    record.write_text(kept + "{not json\n")
    with pytest.raises(ValueError, match=r"eval.jsonl:3: not a line of a resumable evaluation"):
        stages.evaluate_agent(cfg, "oracle", split="eval", progress=False, record=record)
    assert record.read_text() == kept + "{not json\n"
    with pytest.raises(ValueError, match="chunk must be >= 1, got 0"):
        stages.evaluate_agent(cfg, "oracle", split="eval", progress=False, record=record, chunk=0)


def test_eval_record_on_the_command_line(tmp_path, capsys):
    sets = [arg for s in SETS for arg in ("--set", s)]
    record = tmp_path / "eval.jsonl"
    assert main(["eval", "--agent", "oracle", "--record", str(record), "--chunk", "4",
                 "--limit", "5", "--json", str(tmp_path / "first.json"), *sets]) == 0
    assert "5 episodes in" in capsys.readouterr().out
    assert main(["eval", "--agent", "oracle", "--record", str(record),
                 "--json", str(tmp_path / "all.json"), *sets]) == 0
    printed = capsys.readouterr().out
    assert f"6 episodes in {record} (1 run now)" in printed
    summary = json.loads((tmp_path / "all.json").read_text())
    assert summary["episodes"] == 6 and summary["mean_reward"] == 1.0
    assert main(["eval", "--agent", "oracle", "--chunk", "4", *sets]) == 2
    assert capsys.readouterr().err == ("lopd eval: error: --chunk sets the tasks per chunk of a "
                                       "resumable evaluation: give --record\n")
