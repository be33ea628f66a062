"""lopd compare: the rollout ratio by hand, and a whole (tiny) comparison with reuse of finished runs."""

import json

import pytest

from lopd.experiments import compare as cmp


def curve(points):
    return [{"generations": g, "mean_reward": r} for g, r in points]


def test_rollout_ratio_by_hand():
    grpo = [curve([(0, 0.5), (100, 0.6), (200, 0.7)]), curve([(0, 0.5), (100, 0.6), (200, 0.8)])]
    # GRPO's final seed-mean is 0.75 at 200 rollouts; LOPD's seed-mean first reaches it at 100.
    lopd = [curve([(0, 0.5), (50, 0.7), (100, 0.76)]), curve([(0, 0.5), (50, 0.7), (100, 0.74)])]
    assert cmp.rollout_ratio({"grpo": grpo, "lopd": lopd}) == pytest.approx(0.5)
    never = [curve([(0, 0.5), (100, 0.6)])]
    assert cmp.rollout_ratio({"grpo": grpo, "lopd": never}) is None
    assert cmp.rollout_ratio({"lopd": lopd}) is None


def test_markdown_table_states_mean_and_spread():
    table = {"base": {"mean_reward": (0.75, 0.0), "success_rate": (0.6, 0.0), "generations": 0,
                      "learning_rate": None},
             "lopd": {"mean_reward": (0.8, 0.01), "success_rate": (0.65, 0.02),
                      "generations": 64, "learning_rate": 1e-4}}
    text = cmp.markdown(table, 3, None)
    assert "| lopd | 0.8000 ± 0.0100 | 0.6500 ± 0.0200 | 64 | 0.0001 |" in text
    assert "over 3 seeds" in text and "not defined" in text


def test_unknown_algorithms_seeds_and_jobs_are_refused_before_any_run(tmp_path):
    with pytest.raises(ValueError, match=r"nope: choose from \['base', 'grpo', 'lopd'\]"):
        cmp.compare("tiny", [], ["base", "nope"], 1, tmp_path / "a")
    with pytest.raises(ValueError, match="seeds must be >= 1"):
        cmp.compare("tiny", [], ["base"], 0, tmp_path / "b")
    with pytest.raises(ValueError, match="unknown key"):
        cmp.compare("tiny", ["train.nope=1"], ["base"], 1, tmp_path / "c")
    assert not any(tmp_path.iterdir())


def test_a_tiny_comparison_runs_and_reuses_finished_runs(tmp_path, monkeypatch):
    from conftest import make_lopd_inputs

    inputs = make_lopd_inputs(tmp_path)
    sets = [f"{k}={v}" for k, v in {
        "env.train_size": 40, "env.eval_size": 4, "env.pretrain_size": 0,
        "train.rollouts_per_step": 4, "train.eval_tasks": 2, "train.max_steps": 2,
        "train.eval_every": 1, "train.save_every": 2, "rollout.max_turns": 2,
        "rollout.max_completion_length": 32, "rollout.batch_size": 4,
        "composer.num_latents": 4, "composer.depth": 2, "composer.max_experience_tokens": 96,
        "bank.n_ret": 2, "grpo.num_generations": 2,
        "lopd.composer": inputs / "composer", "lopd.bank": inputs / "bank"}.items()]
    out = tmp_path / "cmp"
    report = cmp.compare("tiny", sets, ["base", "grpo", "lopd"], 2, out, {"grpo": 3e-4})
    assert set(report["summary"]) == {"base", "grpo", "lopd"}
    assert report["summary"]["grpo"]["learning_rate"] == pytest.approx(3e-4)
    assert report["summary"]["lopd"]["generations"] == 8
    assert report["summary"]["base"]["mean_reward"][1] == 0.0
    for name in ("results.json", "results.md", "reward_vs_generations.png"):
        assert (out / name).exists()
    # The same comparison with runs trained two at a time in subprocesses gives the same numbers.
    parallel = cmp.compare("tiny", sets, ["base", "grpo", "lopd"], 2, tmp_path / "par",
                           {"grpo": 3e-4}, jobs=2)
    for algo in ("grpo", "lopd"):
        for key in ("mean_reward", "success_rate"):
            assert parallel["per_seed"][algo][key] == pytest.approx(report["per_seed"][algo][key])
    # A second compare reuses every finished run instead of training again.
    from lopd import pipeline

    monkeypatch.setattr(pipeline, "train",
                        lambda *a, **k: pytest.fail("should reuse the finished run"))
    again = cmp.compare("tiny", sets, ["base", "grpo", "lopd"], 2, out, {"grpo": 3e-4})
    assert again["per_seed"] == json.loads((out / "results.json").read_text())["per_seed"]
