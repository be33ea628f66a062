"""The per-run table of an experiment, read from the runs' kept records alone."""

import json

import pytest

from lopd.experiments import run_table


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _run(folder, rewards, step_seconds, backward, train_success, endings, turns, bfcl=None,
         eval_every=2):
    """A run evaluated at step 0 and every ``eval_every`` steps; its last evaluation's episodes
    ended as ``endings`` says."""
    folder.mkdir(parents=True)
    evals = []
    for i, (reward, success) in enumerate(rewards):
        evals.append({"step": i * eval_every, "seconds": 3.0, "episodes": 4, "mean_reward": reward,
                      "success_rate": success, "mean_turns": 2.0,
                      "finish_reasons": {"answer": 4}})
    evals[-1].update(mean_turns=turns, finish_reasons=endings)
    metrics = [{"step": 0, "generations": 0, "eval/mean_reward": rewards[0][0]}]
    for step, (seconds, back, success) in enumerate(zip(step_seconds, backward, train_success), 1):
        metrics.append({"step": step, "generations": 8 * step, "time/step": seconds,
                        "time/backward": back, "train/success_rate": success})
    _write(folder / "eval.jsonl", evals)
    _write(folder / "metrics.jsonl", metrics)
    if bfcl is not None:
        (folder / "transfer-bfcl.json").write_text(json.dumps(
            {"env": "bfcl", "limit": 8, "score": bfcl[0], "mean_reward": bfcl[0], "seconds": bfcl[1]}))


@pytest.fixture
def compared(tmp_path):
    out = tmp_path / "cmp"
    (out / "base").mkdir(parents=True)
    (out / "base" / "eval.json").write_text(json.dumps(
        {"episodes": 4, "mean_reward": 0.5, "success_rate": 0.25, "mean_turns": 5.25,
         "finish_reasons": {"answer": 2, "max_turns": 2}}))
    (out / "base" / "transfer-bfcl.json").write_text(json.dumps({"score": 0.0, "seconds": 256.0}))
    # LOPD first on disk, and seed10 after seed2: the table orders methods and seeds itself.
    _run(out / "lopd" / "seed0", [(0.5, 0.25), (0.4, 0.0), (0.45, 0.25)], [100, 120, 90, 110],
         [60, 70, 50, 65], [0.0, 0.125, 0.0, 0.0], {"max_turns": 4}, 8.0, bfcl=(0.0, 263.0))
    _run(out / "grpo" / "seed10", [(0.5, 0.25), (0.6, 0.5), (0.55, 0.5)], [20, 30, 40, 50],
         [10, 12, 14, 16], [0.5, 0.0, 0.25, 0.25], {"answer": 3, "max_length": 1}, 1.55,
         bfcl=(0.25, 15.8))
    _run(out / "grpo" / "seed2", [(0.5, 0.25), (0.5, 0.0), (0.5, 0.0)], [10, 10, 30],
         [5, 5, 7], [0.0, 0.0, 0.0], {"answer": 1, "env_done": 2, "odd": 1}, 3.0)
    (out / "results.json").write_text("{}")
    return out


def test_rows_carry_each_runs_figures_in_method_and_seed_order(compared):
    report = run_table.run_table(compared)
    assert [r["run"] for r in report["runs"]] == ["base", "grpo/seed2", "grpo/seed10", "lopd/seed0"]
    base, grpo2, grpo10, lopd = report["runs"]
    assert base["trained"] is False and base["evaluations"] == [
        {"step": 0, "mean_reward": 0.5, "success_rate": 0.25}]
    assert base["transfer"] == {"bfcl": {"score": 0.0, "seconds": 256.0}}
    # Medians of 4 steps: (30 + 40) / 2 and (12 + 14) / 2; of 3 steps: the middle one.
    assert grpo10["median_step_seconds"] == 35.0 and grpo10["median_backward_seconds"] == 13.0
    assert grpo2["median_step_seconds"] == 10 and grpo2["median_backward_seconds"] == 5
    # Training success: the mean over steps, and the steps with any success.
    assert grpo10["training_success"] == pytest.approx(0.25) and grpo10["steps_with_success"] == 3
    assert lopd["training_success"] == pytest.approx(0.03125) and lopd["steps_with_success"] == 1
    assert grpo2["steps_with_success"] == 0 and grpo2["steps"] == 3
    assert [e["step"] for e in lopd["evaluations"]] == [0, 2, 4]
    assert lopd["last_evaluation"] == {"episodes": 4, "mean_turns": 8.0,
                                       "finish_reasons": {"max_turns": 4}}
    assert grpo2["transfer"] == {}


def test_markdown_cells_name_endings_steps_and_transfer_scores(compared):
    lines = run_table.table_markdown(run_table.run_table(compared)).splitlines()
    assert lines[0] == ("| run | held-out mean reward (success) at steps 0 / 2 / 4 | episodes of the "
                        "last evaluation | training success (steps with any) | median step "
                        "(backward) | bfcl mean reward (scoring time) |")
    assert lines[1] == "|" + " --- |" * 6
    assert lines[2] == ("| base | 0.5000 (0.25), untrained | 5.2 turns: 2 answers, 2 at the turn "
                        "limit | - | - | 0.0000 (256.0 s) |")
    assert lines[3] == ("| grpo/seed2 | 0.5000 (0.25) / 0.5000 (0.00) / **0.5000 (0.00)** | 3.0 "
                        "turns: 1 answer, 2 environment done, 1 odd | 0.000 (0 of 3) | 10.0 s "
                        "(5.0 s) | - |")
    assert lines[4] == ("| grpo/seed10 | 0.5000 (0.25) / 0.6000 (0.50) / **0.5500 (0.50)** | 1.6 "
                        "turns: 3 answers, 1 at the context limit | 0.250 (3 of 4) | 35.0 s "
                        "(13.0 s) | 0.2500 (15.8 s) |")
    assert lines[5].startswith("| lopd/seed0 | 0.5000 (0.25) / 0.4000 (0.00) / **0.4500 (0.25)** "
                               "| 8.0 turns: 4 at the turn limit | 0.031 (1 of 4) | 105.0 s")


def test_runs_evaluated_at_other_steps_name_the_step_in_each_cell(tmp_path):
    out = tmp_path / "exp"
    _run(out / "a" / "seed0", [(0.5, 0.0), (0.6, 0.0)], [1, 1], [1, 1], [0, 0], {"answer": 4}, 2.0)
    _run(out / "b" / "seed0", [(0.5, 0.0), (0.7, 0.0), (0.8, 0.25)], [1, 1, 1, 1], [1, 1, 1, 1],
         [0, 0, 0, 0], {"answer": 4}, 2.0)
    text = run_table.table_markdown(run_table.run_table(out))
    assert "at each evaluation (step: figure)" in text
    assert "| a/seed0 | 0: 0.5000 (0.00) / **2: 0.6000 (0.00)** |" in text
    # A sweep's folders (ALGO-lrRATE) go in the method table's order; one evaluation is a step.
    sweep = tmp_path / "sweep"
    for name in ("lopd-lr3e-05", "grpo-lr3e-05", "sdft-lr3e-05"):
        _run(sweep / name, [(0.5, 0.0)], [1], [1], [0], {"answer": 4}, 2.0, eval_every=8)
    text = run_table.table_markdown(run_table.run_table(sweep))
    assert "held-out mean reward (success) at step 0 |" in text
    assert [line.split(" | ")[0] for line in text.splitlines()[2:]] == [
        "| grpo-lr3e-05", "| sdft-lr3e-05", "| lopd-lr3e-05"]
    # One run folder alone is a table of one row.
    single = run_table.run_table(out / "b" / "seed0")
    assert [r["run"] for r in single["runs"]] == ["seed0"]


def test_cli_writes_the_table_and_names_what_is_wrong(compared, tmp_path, capsys):
    assert run_table.main([str(compared), "--out", str(tmp_path / "report")]) == 0
    printed = capsys.readouterr().out
    assert (tmp_path / "report" / "runs.md").read_text() == printed
    saved = json.loads((tmp_path / "report" / "runs.json").read_text())
    assert [r["run"] for r in saved["runs"]][-1] == "lopd/seed0"

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit) as exit_:
        run_table.main([str(empty)])
    assert exit_.value.code == 2
    assert "holds no run records" in capsys.readouterr().err

    damaged = compared / "grpo" / "seed2" / "eval.jsonl"
    damaged.write_text("{not json}\n" + damaged.read_text())
    with pytest.raises(SystemExit):
        run_table.main([str(compared)])
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "seed2/eval.jsonl:1: not a JSON record" in error

    damaged.write_text(json.dumps({"step": 0, "mean_reward": 0.5}) + "\n")
    with pytest.raises(SystemExit):
        run_table.main([str(compared)])
    assert "a record without 'success_rate'" in capsys.readouterr().err
