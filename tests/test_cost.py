"""The cost table of a comparison: step and run seconds, and seconds to GRPO's final reward."""

import json

import pytest

from lopd.experiments import cost


def _run(folder, step_seconds, rewards, eval_seconds=5.0):
    """A run of len(step_seconds) steps evaluated at step 0 and every 2 steps."""
    folder.mkdir(parents=True)
    metrics = [{"step": 0, "generations": 0, "eval/mean_reward": rewards[0]}]
    evals = [{"step": 0, "seconds": eval_seconds, "mean_reward": rewards[0]}]
    for step, seconds in enumerate(step_seconds, start=1):
        record = {"step": step, "generations": 8 * step, "time/step": seconds}
        if step % 2 == 0:
            record["eval/mean_reward"] = rewards[step // 2]
            evals.append({"step": step, "seconds": eval_seconds, "mean_reward": rewards[step // 2]})
        metrics.append(record)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    (folder / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))


@pytest.fixture
def compared(tmp_path):
    out = tmp_path / "cmp"
    # GRPO: 10 s steps, reward 0.5 -> 0.6 -> 0.7 in both seeds: target 0.7 at 40 s of training.
    _run(out / "grpo" / "seed0", [10, 10, 10, 10], [0.5, 0.6, 0.7])
    _run(out / "grpo" / "seed1", [10, 10, 10, 10], [0.5, 0.6, 0.7])
    # LOPD: 20 s and 30 s steps; seed means 0.5 @ 0 s, 0.65 @ 50 s, 0.8 @ 100 s.
    _run(out / "lopd" / "seed0", [20, 20, 20, 20], [0.5, 0.6, 0.8])
    _run(out / "lopd" / "seed1", [30, 30, 30, 30], [0.5, 0.7, 0.8])
    # SDFT never gets there.
    _run(out / "sdft" / "seed0", [5, 5, 5, 5], [0.5, 0.5, 0.55])
    _run(out / "sdft" / "seed1", [5, 5, 5, 5], [0.5, 0.6, 0.65])
    per_seed = {a: {} for a in ("base", "grpo", "sdft", "lopd")}
    (out / "results.json").write_text(json.dumps({"seeds": 2, "per_seed": per_seed}))
    return out


def test_cost_reads_seconds_and_the_crossing_of_grpos_final_reward(compared):
    report = cost.cost(compared, {"lopd": 100.0})
    assert report["target_reward"] == pytest.approx(0.7)
    grpo, lopd, sdft = (report["methods"][a] for a in ("grpo", "lopd", "sdft"))
    assert "base" not in report["methods"]
    assert grpo["step_seconds_median"] == 10
    assert grpo["training_seconds"] == (40, 0)
    assert lopd["step_seconds_median"] == 25
    assert lopd["training_seconds"] == (100, 20)  # 80 and 120 s
    assert lopd["eval_seconds"] == (15, 0)
    assert lopd["curve"] == [(0, 0.5), (50, pytest.approx(0.65)), (100, pytest.approx(0.8))]
    # 0.65 -> 0.8 between 50 and 100 s: 0.7 at 50 + 50 / 3 s.
    assert lopd["seconds_to_grpo_reward"] == pytest.approx(50 + 50 / 3)
    assert lopd["seconds_to_grpo_reward_with_setup"] == pytest.approx(150 + 50 / 3)
    assert lopd["time_ratio_to_grpo"] == pytest.approx((50 + 50 / 3) / 40)
    assert lopd["time_ratio_to_grpo_with_setup"] == pytest.approx((150 + 50 / 3) / 40)
    assert grpo["seconds_to_grpo_reward"] == pytest.approx(40)
    assert sdft["seconds_to_grpo_reward"] is None and sdft["time_ratio_to_grpo"] is None
    text = cost.cost_markdown(report)
    assert "not reached" in text and "| lopd | 25.0 | 100 ± 20 |" in text


def test_cost_cli_writes_its_table_and_figure_and_names_a_bad_setup(compared, tmp_path, capsys):
    out = tmp_path / "cost"
    assert cost.main(["--compare", str(compared), "--setup-seconds", "lopd=100",
                      "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == {"cost.md", "cost.json", "cost.png"}
    for bad, named in (("lopd", "expected ALGO=SECONDS"), ("ppo=3", "ppo, not a method")):
        with pytest.raises(SystemExit):
            cost.main(["--compare", str(compared), "--setup-seconds", bad, "--out", str(out)])
        assert named in capsys.readouterr().err
