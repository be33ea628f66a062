"""lopd experiment: each of the paper's experiments on tiny runs (arms that differ only in the named
setting, the tables' rows, reuse of finished runs), and the figures they are made of by hand."""

import json
import re

import pytest
import yaml

from conftest import LOPD_SPEC, lopd_config, make_lopd_inputs
from lopd import trainer
from lopd.experiments.common import verdict
from lopd.experiments.internalisation import internalisation
from lopd.experiments.joint_optimisation import joint_optimisation
from lopd.experiments.latent_decoding import CONDITIONS, PROJECTIONS, latent_decoding, procedure
from lopd.experiments.random_latent import random_latent
from lopd.experiments.sample_efficiency import read_off, reward_at, sample_efficiency
from lopd.experiments.sensitivity import sensitivity

STEPS = [f"{k}={v}" for k, v in {"train.max_steps": 1, "train.eval_every": 1,
                                 "train.save_every": 1}.items()]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = make_lopd_inputs(tmp_path_factory.mktemp("experiment-inputs"))
    trainer.write_config(lopd_config(root), root / "base.yaml")
    return root


def saved(run_dir):
    return yaml.safe_load((run_dir / "config.yaml").read_text())


def test_reward_read_off_between_evaluations_and_outside_the_curve():
    curve = [(0, 0.5), (160, 0.6), (320, 0.7), (480, 0.66)]
    assert reward_at(curve, 320) == pytest.approx(0.7)
    assert reward_at(curve, 400) == pytest.approx(0.68)  # halfway from 0.7 to 0.66
    assert reward_at(curve, 40) == pytest.approx(0.525)
    assert reward_at(curve, 0) == pytest.approx(0.5)
    assert reward_at(curve, 480) == pytest.approx(0.66)
    assert reward_at(curve, 481) is None and reward_at(curve, -1) is None


def test_read_off_by_rollouts_charged_shifts_each_curve_by_its_setup():
    curves = [[(0, 0.5), (100, 0.7)], [(0, 0.5), (100, 0.5)]]
    assert read_off(curves, [50])["50"]["per_seed"] == pytest.approx([0.6, 0.5])
    charged = read_off(curves, [50, 150, 250], setup=100)
    assert charged["50"] is None  # the setup alone exceeds 50 rollouts
    assert charged["150"]["per_seed"] == pytest.approx([0.6, 0.5])
    assert charged["150"]["stats"] == pytest.approx((0.55, 0.05))
    assert charged["250"] is None


def test_procedure_is_tool_names_and_argument_keys_without_values():
    trace = ("Task: Reroute shipment S408 of client C516 to Berlin.\n"
             '1. find_client({"client_id": "C516"}) -> {"client_id":"C516"}\n'
             '2. reroute_shipment({"shipment_id": "S408", "city": "Berlin"}) -> ok\n'
             "3. answer: Task Completed")
    assert procedure(trace) == ["find_client", "client_id", "reroute_shipment", "shipment_id",
                                "city"]
    assert procedure("Task: x\n1. answer: done") == []


def test_verdict_is_the_method_tables_rule():
    assert verdict((0.70, 0.01), (0.65, 0.02)) == "above"  # 0.05 > 0.03
    assert verdict((0.65, 0.02), (0.70, 0.01)) == "below"
    assert verdict((0.70, 0.03), (0.67, 0.01)) == "within"  # 0.03 is not > 0.04


def test_joint_optimisation_arms_differ_only_in_the_composer_update_and_margin(inputs, tmp_path):
    out = tmp_path / "joint"
    report = joint_optimisation(inputs / "base.yaml", STEPS, out, seeds=1, margins=[0.0, 0.05])
    arms = report["arms"]
    assert list(arms) == ["frozen", "margin-0", "margin-0.05"]
    assert arms["frozen"]["differs_from_first_arm_in"] == []
    assert arms["margin-0"]["differs_from_first_arm_in"] == ["lopd.margin", "lopd.update_composer"]
    assert arms["margin-0.05"]["differs_from_first_arm_in"] == ["lopd.update_composer"]
    assert saved(out / "frozen" / "seed0")["lopd"]["update_composer"] is False
    assert saved(out / "margin-0" / "seed0")["lopd"]["margin"] == 0.0
    assert arms["frozen"]["vs_frozen"] == "reference"
    assert {arms[a]["vs_frozen"] for a in ("margin-0", "margin-0.05")} <= {"above", "below",
                                                                            "within"}
    for arm, row in arms.items():
        evals = trainer.read_jsonl(out / arm / "seed0" / "eval.jsonl")
        assert row["mean_reward"] == [evals[-1]["mean_reward"]] and row["generations"] == 4
        assert evals[0]["mean_reward"] == report["base_mean_reward"]  # the untrained student
    # The frozen arm's β never moves from its start; the jointly trained arms log theirs.
    assert arms["frozen"]["final"]["beta"] == 0.0
    table = (out / "joint-optimisation.md").read_text()
    for label in ("| base (untrained) |", "| frozen φ0 | `lopd.update_composer=false` |",
                  "| joint, m = 0 | `lopd.margin=0.0` |",
                  "| joint, m = 0.05 | `lopd.margin=0.05` |",
                  "- joint, m = 0: `lopd.margin`, `lopd.update_composer`"):
        assert label in table
    assert (out / "joint-optimisation.png").stat().st_size > 0
    assert json.loads((out / "joint-optimisation.json").read_text())["arms"].keys() == arms.keys()
    mtime = (out / "margin-0" / "seed0" / "eval.jsonl").stat().st_mtime
    joint_optimisation(inputs / "base.yaml", STEPS, out, seeds=1, margins=[0.0, 0.05])
    assert (out / "margin-0" / "seed0" / "eval.jsonl").stat().st_mtime == mtime  # reused


def test_random_latent_arms_differ_only_in_what_the_composer_reads(inputs, tmp_path):
    report = random_latent(inputs / "base.yaml", STEPS, tmp_path / "rl", seeds=1)
    assert list(report["arms"]) == ["retrieved", "random"]
    assert report["arms"]["random"]["differs_from_first_arm_in"] == ["lopd.retrieval"]
    assert "| random experiences | `lopd.retrieval=random` |" in \
        (tmp_path / "rl" / "random-latent.md").read_text()


def test_sensitivity_gives_each_k_its_own_cold_start_and_shares_the_configured_one(inputs,
                                                                                  tmp_path):
    out = tmp_path / "sens"
    cold = ["cold_start.epochs=1", "cold_start.validation_tasks=0"]
    report = sensitivity(inputs / "base.yaml", STEPS, out, seeds=1, n_ret=[1, 2],
                         latents=[LOPD_SPEC.num_latents, 2], cold_start_sets=cold)
    arms = report["arms"]
    # K 4 is the configured composer's: with n_ret 2 (configured) it is the n_ret-2 arm itself.
    assert list(arms) == ["n_ret-1", "n_ret-2", "K-2"] and report["shared_arm"] == "n_ret-2"
    assert report["reference"] == "n_ret-2"
    assert arms["n_ret-2"]["differs_from_first_arm_in"] == ["bank.n_ret"]
    assert arms["K-2"]["differs_from_first_arm_in"] == ["bank.n_ret", "composer.num_latents",
                                                        "lopd.composer"]
    folder = out / "cold-start" / "K-2"
    assert saved(out / "K-2" / "seed0")["lopd"]["composer"] == str(folder)
    assert json.loads((folder / "composer.json").read_text())["spec"]["num_latents"] == 2
    assert report["latent_tokens"] == {"n_ret-1": 4, "n_ret-2": 8, "K-2": 4}
    # The cold-start settings reach the cold start only, not the LOPD runs.
    assert json.loads((folder / "cold_start.json").read_text())["config"]["cold_start"][
        "epochs"] == 1
    assert saved(out / "K-2" / "seed0")["cold_start"]["epochs"] != 1
    made = (folder / "composer.json").stat().st_mtime
    again = sensitivity(inputs / "base.yaml", STEPS, out, seeds=1, n_ret=[1, 2],
                        latents=[LOPD_SPEC.num_latents, 2], cold_start_sets=cold)
    assert (folder / "composer.json").stat().st_mtime == made  # the same cold start, reused
    assert again["arms"]["K-2"]["mean_reward"] == arms["K-2"]["mean_reward"]
    text = (out / "sensitivity.md").read_text()
    assert "n_ret = 2, K = 4: 8" in text and "is the arm n_ret = 2, K = 4: the same run" in text
    with pytest.raises(ValueError, match=re.escape("holds a cold start with another config than "
                                                   "this experiment asks for (cold_start.epochs)")):
        sensitivity(inputs / "base.yaml", STEPS, out, seeds=1, n_ret=[], latents=[2],
                    cold_start_sets=["cold_start.epochs=2", "cold_start.validation_tasks=0"])
    with pytest.raises(ValueError, match="needs n_ret or K values"):
        sensitivity(inputs / "base.yaml", STEPS, out, n_ret=[], latents=[])
    with pytest.raises(ValueError, match=re.escape("composer.num_latents=8 but the composer in")):
        sensitivity(inputs / "base.yaml", [*STEPS, "composer.num_latents=8"], out,
                    n_ret=[], latents=[8])


def test_internalisation_scores_every_agent_on_the_same_tasks(inputs, tmp_path):
    out = tmp_path / "int"
    report = internalisation(inputs / "base.yaml", STEPS, out, seeds=1)
    rows = report["rows"]
    assert list(rows) == ["vanilla", "base+composer", "base+lopd-composer", "lopd"]
    assert [rows[r]["latents"] for r in rows] == [False, True, True, False]
    evals = trainer.read_jsonl(out / "lopd" / "seed0" / "eval.jsonl")
    # Vanilla is scored by the same evaluation as the trainer's step 0 (the untrained student).
    assert rows["vanilla"]["mean_reward"] == [evals[0]["mean_reward"]]
    assert rows["lopd"]["mean_reward"] == [evals[-1]["mean_reward"]]
    cold = json.loads((out / "base+composer" / "eval.json").read_text())
    assert cold["composer"] == str(inputs / "composer") and cold["episodes"] == 2
    final = json.loads((out / "lopd" / "seed0" / "eval-base+composer.json").read_text())
    assert final["composer"].endswith("step-000001/composer")
    assert report["composer_gain"] == pytest.approx(cold["mean_reward"] - evals[0]["mean_reward"])
    assert "| LOPD student | no |" in (out / "internalisation.md").read_text()
    # A cache made for another agent (here: another composer) is scored again, not trusted.
    stale = out / "lopd" / "seed0" / "eval-base+composer.json"
    stale.write_text(json.dumps({**final, "composer": "elsewhere", "mean_reward": -1.0}))
    again = internalisation(inputs / "base.yaml", STEPS, out, seeds=1)
    assert again["rows"]["base+lopd-composer"]["mean_reward"] == [final["mean_reward"]]


def test_sample_efficiency_reads_off_training_and_charged_rollouts(inputs, tmp_path):
    out = tmp_path / "se"
    sets = ["train.max_steps=2", "train.eval_every=1", "train.save_every=2"]
    report = sample_efficiency(inputs / "base.yaml", sets, out, ["grpo"], seeds=1, at=[4, 6, 12])
    assert list(report["methods"]) == ["grpo", "lopd"]
    for algo, row in report["methods"].items():
        evals = trainer.read_jsonl(out / algo / "seed0" / "eval.jsonl")
        assert [e["generations"] for e in evals] == [0, 4, 8]
        assert row["training"]["4"]["per_seed"] == [pytest.approx(evals[1]["mean_reward"])]
        assert row["training"]["6"]["per_seed"] == [pytest.approx(
            (evals[1]["mean_reward"] + evals[2]["mean_reward"]) / 2)]
        assert row["training"]["12"] is None  # past the last evaluation
        # This bank was written without sampling (an oracle's): no setup rollouts to charge.
        assert row["setup_generations"] == 0 and row["charged"] == row["training"]
    table = (out / "sample-efficiency.md").read_text()
    assert "| reward at 4 training rollouts | reward at 6 training rollouts |" in table
    assert "not reached" in table and (out / "sample-efficiency.png").stat().st_size > 0


def test_latent_decoding_reports_projections_of_related_retrievals(inputs, tmp_path):
    from lopd.embedding import EmbedderSpec, load_embedder
    from lopd.experience import ExperienceBank

    # The inputs' bank embeds with the tiny policy, whose nearest entries rarely share a task's
    # template; the same successes embedded by MiniLM (the tiny preset's embedder) do.
    with ExperienceBank.open(inputs / "bank") as source, ExperienceBank.create(
            tmp_path / "bank", load_embedder(EmbedderSpec(kind="minilm"))) as bank:
        bank.add(source.entries)
    out = tmp_path / "ld"
    report = latent_decoding(inputs / "base.yaml", [f"lopd.bank={tmp_path / 'bank'}"], out,
                             tasks=3, top=2)
    assert 1 <= report["tasks"] <= 3 and report["latents_per_experience"] == LOPD_SPEC.num_latents
    assert set(report["summary"]) == {f"{p}/{c}" for p in PROJECTIONS for c in CONDITIONS}
    for row in report["per_task"]:
        assert row["task_id"].startswith("toolworld/") and "/train/" in row["task_id"]
        for key, tokens in row["top_tokens"].items():
            assert len(tokens) == 2 * LOPD_SPEC.num_latents  # n_ret · K latents
            assert all(len(latent) == 2 for latent in tokens)
            assert 0.0 <= row["procedure_recall"][key] <= 1.0
            assert 0.0 <= row["specific_recall"][key] <= 1.0
            assert 0.0 < row["chance"][key] <= 2 * LOPD_SPEC.num_latents / report["vocabulary"]
    text = (out / "latent-decoding.md").read_text()
    assert "| centred | retrieved experience only |" in text and "## Examples" in text
    assert (out / "latent-decoding.png").stat().st_size > 0


def test_the_command_refuses_bad_values_in_one_line(inputs, tmp_path, capsys):
    from lopd.cli import main

    code = main(["experiment", "joint-optimisation", "--config", str(inputs / "base.yaml"),
                 "--margins", "0,x", "--out", str(tmp_path / "x")])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err == "lopd experiment: error: '0,x': expected comma-separated numbers"
    code = main(["experiment", "sensitivity", "--config", str(inputs / "base.yaml"),
                 "--n-ret", "", "--out", str(tmp_path / "x")])
    assert code == 2 and "sensitivity needs n_ret or K values" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
