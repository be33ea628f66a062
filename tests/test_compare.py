"""lopd compare: the crossing and both rollout ratios by hand, a comparison read from hand-written
run folders, and a whole (tiny) comparison with reuse of finished runs."""

import json
import re

import pytest

from lopd.experiments import compare as cmp


def curve(points, setup=None):
    extra = {} if setup is None else {"setup_generations": setup}
    return [{"step": i, "generations": g, "mean_reward": r, "success_rate": r / 2, **extra}
            for i, (g, r) in enumerate(points)]


def test_crossing_is_interpolated_between_the_bracketing_evaluations():
    # 0.68 lies halfway from 0.66 (at 320) to 0.70 (at 640).
    assert cmp.crossing_generations([(0, 0.60), (320, 0.66), (640, 0.70)], 0.68) == \
        pytest.approx(480.0)
    # A curve that dips after the crossing: the first crossing counts, a quarter of 0.04 up.
    assert cmp.crossing_generations([(0, 0.60), (100, 0.64), (200, 0.80), (300, 0.5)], 0.68) == \
        pytest.approx(125.0)
    # Landing exactly on the target is reaching it.
    assert cmp.crossing_generations([(0, 0.5), (100, 0.7)], 0.7) == pytest.approx(100.0)


def test_crossing_at_the_start_or_never():
    assert cmp.crossing_generations([(0, 0.70), (320, 0.60)], 0.68) == 0.0
    assert cmp.crossing_generations([(64, 0.68), (128, 0.90)], 0.68) == 64.0
    assert cmp.crossing_generations([(0, 0.60), (320, 0.66), (640, 0.67)], 0.68) is None


def test_rollout_ratios_with_and_without_setup():
    # Crossing at 480 of GRPO's 1920 training rollouts; LOPD spent 320 building its bank.
    assert cmp.rollout_ratios(480.0, 1920, lopd_setup=320, grpo_setup=0) == \
        pytest.approx((0.25, 800 / 1920))
    # GRPO's own setup (if it had any) enlarges the denominator of the charged ratio only.
    assert cmp.rollout_ratios(480.0, 1920, lopd_setup=320, grpo_setup=80) == \
        pytest.approx((0.25, 0.4))
    assert cmp.rollout_ratios(None, 1920, lopd_setup=320) == (None, None)


def test_rollout_ratio_uses_the_seed_mean_curves():
    grpo = [curve([(0, 0.5), (100, 0.6), (200, 0.7)]), curve([(0, 0.5), (100, 0.6), (200, 0.8)])]
    # GRPO's final seed-mean is 0.75 at 200 rollouts. LOPD's seed-mean curve is 0.5, 0.7, 0.75:
    # one seed touches 0.76 at 100 but the mean reaches 0.75 only there, from 0.7 at 50.
    lopd = [curve([(0, 0.5), (50, 0.7), (100, 0.76)]), curve([(0, 0.5), (50, 0.7), (100, 0.74)])]
    ratio = cmp.rollout_ratio({"grpo": grpo, "lopd": lopd}, {"grpo": 0, "lopd": 100})
    assert ratio["target_reward"] == pytest.approx(0.75)
    assert ratio["lopd_crossing_generations"] == pytest.approx(100.0)
    assert ratio["training_only"] == pytest.approx(0.5)
    assert ratio["with_setup"] == pytest.approx((100 + 100) / 200)
    # Seed-mean 0.5, 0.7, 0.8: 0.75 is crossed halfway between 50 and 100.
    higher = [curve([(0, 0.5), (50, 0.7), (100, 0.8)])]
    ratio = cmp.rollout_ratio({"grpo": grpo, "lopd": higher}, {"grpo": 0, "lopd": 100})
    assert ratio["lopd_crossing_generations"] == pytest.approx(75.0)
    assert (ratio["training_only"], ratio["with_setup"]) == pytest.approx((0.375, 0.875))
    never = [curve([(0, 0.5), (100, 0.6)])]
    ratio = cmp.rollout_ratio({"grpo": grpo, "lopd": never}, {"grpo": 0, "lopd": 100})
    assert ratio["training_only"] is None and ratio["with_setup"] is None
    assert ratio["target_reward"] == pytest.approx(0.75)
    assert set(cmp.rollout_ratio({"lopd": lopd}, {"lopd": 0}).values()) == {None}


def test_markdown_table_states_mean_spread_and_rollouts():
    table = {"base": {"mean_reward": (0.75, 0.0), "success_rate": (0.6, 0.0), "generations": 0,
                      "setup_generations": 0, "charged_generations": 0, "learning_rate": None},
             "lopd": {"mean_reward": (0.8, 0.01), "success_rate": (0.65, 0.02),
                      "generations": 64, "setup_generations": 40, "charged_generations": 104,
                      "learning_rate": 1e-4}}
    unrun = cmp.rollout_ratio({}, {})
    text = cmp.markdown(table, 3, unrun)
    assert "| training rollouts | setup rollouts | charged | lr |" in text
    assert "| lopd | 0.8000 ± 0.0100 | 0.6500 ± 0.0200 | 64 | 40 | 104 | 0.0001 |" in text
    assert "over 3 seeds" in text and "Rollout ratio: None" in text and "not both run" in text
    grpo = [curve([(0, 0.5), (100, 0.6), (200, 0.75)])]
    never = cmp.rollout_ratio({"grpo": grpo, "lopd": [curve([(0, 0.5), (100, 0.6)])]},
                              {"grpo": 0, "lopd": 40})
    text = cmp.markdown(table, 3, never, ["lopd: setup rollouts differ"])
    assert "never reached GRPO's final seed-mean reward (0.7500)" in text
    assert "training rollouts only = None" in text and "with setup rollouts = None" in text
    assert "not reached" in text and "Note: lopd: setup rollouts differ." in text


def test_compare_charges_setup_rollouts_from_the_run_folders(tmp_path, monkeypatch):
    """Finished run folders written by hand: compare reads them, trains nothing, and reports both
    ratios, the setup column and a note on setups that differ across seeds."""
    from lopd import pipeline
    from lopd.trainer import CONFIG_FILE, EVAL_FILE, write_config

    sets = ["train.max_steps=2", "train.eval_every=1"]
    out = tmp_path / "cmp"
    # GRPO (records from before the field existed: setup 0) ends at a seed-mean 0.68 after 640;
    # LOPD's seed-mean curve is 0.60, 0.66, 0.70, so it crosses 0.68 at 480; its two seeds state
    # setups of 320 and 256, and the larger is charged.
    runs = {("grpo", 0): curve([(0, 0.60), (320, 0.62), (640, 0.66)]),
            ("grpo", 1): curve([(0, 0.60), (320, 0.64), (640, 0.70)]),
            ("lopd", 0): curve([(0, 0.60), (320, 0.64), (640, 0.68)], setup=320),
            ("lopd", 1): curve([(0, 0.60), (320, 0.68), (640, 0.72)], setup=256)}
    for (algo, seed), evals in runs.items():
        run_dir = out / algo / f"seed{seed}"
        run_dir.mkdir(parents=True)
        write_config(cmp.run_config("tiny", sets, algo, seed, {}), run_dir / CONFIG_FILE)
        (run_dir / EVAL_FILE).write_text("".join(json.dumps(r) + "\n" for r in evals))
    (out / "base").mkdir()
    (out / "base" / "eval.json").write_text(json.dumps({"mean_reward": 0.6, "success_rate": 0.3}))
    monkeypatch.setattr(pipeline, "train", lambda *a, **k: pytest.fail("should reuse the runs"))

    report = cmp.compare("tiny", sets, ["base", "grpo", "lopd"], 2, out)
    summary = report["summary"]
    assert [summary[a]["generations"] for a in ("base", "grpo", "lopd")] == [0, 640, 640]
    assert [summary[a]["setup_generations"] for a in ("base", "grpo", "lopd")] == [0, 0, 320]
    assert [summary[a]["charged_generations"] for a in ("base", "grpo", "lopd")] == [0, 640, 960]
    assert report["per_seed"]["lopd"]["setup_generations_per_seed"] == [320, 256]
    ratio = report["rollout_ratio"]
    assert ratio["lopd_crossing_generations"] == pytest.approx(480.0)
    assert ratio["training_only"] == pytest.approx(480 / 640)
    assert ratio["with_setup"] == pytest.approx((320 + 480) / 640)
    saved = json.loads((out / "results.json").read_text())
    assert saved["rollout_ratio"] == report["rollout_ratio"]
    assert saved["summary"]["lopd"]["charged_generations"] == 960
    assert report["notes"] == ["lopd: setup rollouts differ across seeds ([320, 256]); the "
                               "largest, 320, is charged"]
    text = (out / "results.md").read_text()
    assert "| lopd | 0.7000 ± 0.0200 | 0.3500 ± 0.0100 | 640 | 320 | 960 | 0.0001 |" in text
    assert "| grpo | 0.6800 ± 0.0200 | 0.3400 ± 0.0100 | 640 | 0 | 640 | 0.0001 |" in text
    assert "at 480.0 training rollouts" in text
    assert "training rollouts only = 0.750" in text and "with setup rollouts = 1.250" in text
    assert "differ across seeds" in text
    assert (out / "reward_vs_generations.png").stat().st_size > 0


def test_unknown_algorithms_seeds_and_jobs_are_refused_before_any_run(tmp_path):
    with pytest.raises(ValueError, match=re.escape(
            "algorithms base,nope: choose from ['base', 'grpo', 'lopd', 'opsd', 'sdft', 'sdpo', "
            "'skill_sd']")):
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
    for row in report["summary"].values():
        assert row["charged_generations"] == row["generations"] + row["setup_generations"]
    assert report["summary"]["grpo"]["setup_generations"] == 0
    assert report["summary"]["base"]["mean_reward"][1] == 0.0
    for name in ("results.json", "results.md", "reward_vs_generations.png"):
        assert (out / name).exists()
    # The same comparison with runs trained two at a time in subprocesses gives the same numbers.
    parallel = cmp.compare("tiny", sets, ["base", "grpo", "lopd"], 2, tmp_path / "par",
                           {"grpo": 3e-4}, jobs=2)
    for algo in ("grpo", "lopd"):
        for key in ("mean_reward", "success_rate"):
            assert parallel["per_seed"][algo][key] == pytest.approx(report["per_seed"][algo][key])
    from lopd import pipeline, stages

    monkeypatch.setattr(pipeline, "train",
                        lambda *a, **k: pytest.fail("should reuse the finished run"))
    # --isolate trains even one run at a time in a process of its own (this process trains
    # nothing), with the same numbers as the in-process run.
    isolated = cmp.compare("tiny", sets, ["grpo"], 1, tmp_path / "iso", {"grpo": 3e-4},
                           isolate=True)
    assert isolated["per_seed"]["grpo"]["mean_reward"] == \
        pytest.approx(report["per_seed"]["grpo"]["mean_reward"][:1])
    assert not (tmp_path / "iso" / "grpo" / "seed0.log").exists()  # printed, not logged
    # A second compare reuses every finished run instead of training again.
    again = cmp.compare("tiny", sets, ["base", "grpo", "lopd"], 2, out, {"grpo": 3e-4})
    assert again["per_seed"] == json.loads((out / "results.json").read_text())["per_seed"]
    # --transfer scores the base and every final student on another environment's eval split:
    # the last checkpoint's student of each run, cached next to the run, one column in the table.
    scored = []
    real = stages.evaluate_agent

    def spy(cfg, agent, model_path, split, *a, **k):
        scored.append((cfg.env.name, str(model_path), split))
        return real(cfg, agent, model_path, split, *a, **k)

    monkeypatch.setattr(stages, "evaluate_agent", spy)
    moved = cmp.compare("tiny", sets, ["base", "grpo", "lopd"], 2, out, {"grpo": 3e-4},
                        transfer=["codeworld"])
    students = [str(out / a / f"seed{s}" / "checkpoints" / "step-000002" / "student")
                for a in ("grpo", "lopd") for s in (0, 1)]
    assert scored == [("codeworld", "toolworld-1m", "eval")] + \
        [("codeworld", path, "eval") for path in students]
    for algo in ("grpo", "lopd"):
        for seed in (0, 1):
            cached = json.loads((out / algo / f"seed{seed}" / "transfer-codeworld.json").read_text())
            assert cached["metric"] == "pass@1" and cached["tasks"] == 4
            assert moved["per_seed"][algo]["transfer"]["codeworld"][seed] == cached["score"]
    assert "| codeworld pass@1 |" in (out / "results.md").read_text()
    assert moved["per_seed"]["grpo"]["mean_reward"] == again["per_seed"]["grpo"]["mean_reward"]
    # Scored once: a re-run reads the caches; a cache of another model is scored again.
    stale = out / "grpo" / "seed0" / "transfer-codeworld.json"
    stale.write_text(json.dumps({**json.loads(stale.read_text()), "model": "elsewhere"}))
    scored.clear()
    cmp.compare("tiny", sets, ["base", "grpo", "lopd"], 2, out, {"grpo": 3e-4},
                transfer=["codeworld"])
    assert scored == [("codeworld", students[0], "eval")]
    monkeypatch.setattr(stages, "evaluate_agent", lambda *a, **k: pytest.fail("cached"))
    cmp.compare("tiny", sets, ["base", "grpo", "lopd"], 2, out, {"grpo": 3e-4},
                transfer=["codeworld"])
    # --transfer-tasks: only the first N tasks; a cache of another task count is scored again.
    monkeypatch.setattr(stages, "evaluate_agent", spy)
    scored.clear()
    few = cmp.compare("tiny", sets, ["base", "grpo", "lopd"], 2, out, {"grpo": 3e-4},
                      transfer=["codeworld"], transfer_tasks=2)
    assert len(scored) == 5 and few["transfer_tasks"] == 2
    assert json.loads(stale.read_text())["tasks"] == 2
    # A finished run kept without its checkpoints (records copied from another machine) is read
    # from its cache; asked for another task count, the missing checkpoint is named.
    import shutil

    shutil.rmtree(out / "grpo" / "seed0" / "checkpoints")
    monkeypatch.setattr(stages, "evaluate_agent", lambda *a, **k: pytest.fail("cached"))
    kept = cmp.compare("tiny", sets, ["base", "grpo", "lopd"], 2, out, {"grpo": 3e-4},
                       transfer=["codeworld"], transfer_tasks=2)
    assert kept["per_seed"]["grpo"]["transfer"] == few["per_seed"]["grpo"]["transfer"]
    with pytest.raises(FileNotFoundError, match=r"seed0 has no checkpoint .* no cached codeworld "
                       r"score on its first 3 tasks: move the folder away"):
        cmp.compare("tiny", sets, ["grpo"], 2, out, {"grpo": 3e-4}, transfer=["codeworld"],
                    transfer_tasks=3)
    with pytest.raises(ValueError, match="transfer_tasks must be >= 0"):
        cmp.compare("tiny", sets, ["base"], 1, out, transfer=["codeworld"], transfer_tasks=-1)
    with pytest.raises(ValueError, match="transfer environments nope: choose from"):
        cmp.compare("tiny", sets, ["base"], 1, out, transfer=["nope"])


def test_a_run_made_before_a_setting_existed_is_reused_at_that_settings_default(tmp_path):
    """A saved config without a section added later (here sdpo's) is the same run when the wanted
    config holds that section's defaults; a non-default value or a changed value is refused, and
    the error names the keys."""
    import yaml

    from lopd.experiments.runs import check_reusable
    from lopd.trainer import CONFIG_FILE, write_config

    cfg = cmp.run_config("tiny", ["train.max_steps=2"], "grpo", 0, {})
    run = tmp_path / "run"
    run.mkdir()
    write_config(cfg, run / CONFIG_FILE)
    saved = yaml.safe_load((run / CONFIG_FILE).read_text())
    del saved["sdpo"]
    (run / CONFIG_FILE).write_text(yaml.safe_dump(saved, sort_keys=False))
    check_reusable(cfg, run)  # sdpo at its defaults: the old run behaved the same
    with pytest.raises(ValueError, match=re.escape("(sdpo.alpha)")):
        check_reusable(cmp.run_config("tiny", ["train.max_steps=2", "sdpo.alpha=0.9"], "grpo", 0,
                                      {}), run)
    with pytest.raises(ValueError, match=re.escape("(train.max_steps)")):
        check_reusable(cmp.run_config("tiny", ["train.max_steps=3"], "grpo", 0, {}), run)


def test_a_sweep_scores_each_rate_once_at_its_end_on_validation_tasks(tmp_path):
    from lopd.experiments.sweep import sweep
    from lopd.trainer import EVAL_FILE, read_jsonl

    sets = [f"{k}={v}" for k, v in {
        "env.train_size": 40, "env.eval_size": 4, "env.pretrain_size": 0,
        "train.rollouts_per_step": 4, "train.save_every": 2, "rollout.max_turns": 2,
        "rollout.max_completion_length": 32, "rollout.batch_size": 4,
        "grpo.num_generations": 2}.items()]
    report = sweep("tiny", sets, "grpo", [1e-4, 3e-4], 2, 3, tmp_path / "sweep")
    assert [r["learning_rate"] for r in report["runs"]] == [1e-4, 3e-4]
    for rate in ("1e-04", "0.0003"):
        evals = read_jsonl(tmp_path / "sweep" / f"grpo-lr{float(rate):g}" / EVAL_FILE)
        # No evaluation of the untrained student: the sweep reads only the final one.
        assert [(r["step"], r["episodes"]) for r in evals] == [(2, 3)]
    best = max(report["runs"], key=lambda r: r["validation_mean_reward"])
    assert report["best_learning_rate"] == best["learning_rate"]


def test_a_sweep_tie_goes_to_the_first_rate_listed_and_is_named():
    from lopd.experiments.sweep import best_rate

    def rows(*scores):
        return [{"learning_rate": rate, "validation_mean_reward": score}
                for rate, score in zip((3e-5, 1e-4, 3e-4), scores)]

    assert best_rate(rows(0.49, 0.52, 0.50)) == (1e-4, [])
    # Two rates whose runs collapse to the same policy score exactly the same.
    assert best_rate(rows(0.5221, 0.5221, 0.40)) == (3e-5, [3e-5, 1e-4])
    assert best_rate(rows(0.30, 0.5221, 0.5221)) == (1e-4, [1e-4, 3e-4])
