"""The comparison protocol (DESIGN §3b) as the code keeps it: validation tasks withheld by the bank,
the margin's outcome weights, setup rollouts charged, the cold start's validation carve-out."""

import re

import pytest
import torch

from conftest import lopd_config, make_lopd_inputs
from lopd import losses, pipeline, stages, trainer
from lopd.algorithms import get_algorithm
from lopd.experience import BankError, ExperienceBank


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return make_lopd_inputs(tmp_path_factory.mktemp("protocol-inputs"))


def task_ids(bank):
    return {e.task_id for e in bank.entries}


def test_withheld_tasks_are_invisible_refused_and_kept_by_every_copy(inputs, tmp_path):
    with ExperienceBank.open(inputs / "bank") as source:
        copy = source.snapshot(tmp_path / "copy")
        every = task_ids(source)
        n = len(source)
    held = sorted(every)[:3]
    with ExperienceBank.open(copy) as bank:
        stored = {e.task_id: e for e in bank.entries}
        per_task = {t: sum(e.task_id == t for e in bank.entries) for t in stored}
        queries = [stored[t].task for t in held]
        # Before: searching the whole bank finds the tasks to withhold, so the searches below
        # would fail if withholding were ignored.
        before = bank.search(queries, len(bank), allow_self_retrieval=True)
        assert {h.entry.task_id for hits in before for h in hits} >= set(held)
        bank.withhold(held)
        assert bank.withheld == frozenset(held)
        assert task_ids(bank) == every - set(held)
        assert len(bank) == n - sum(stored_count for t, stored_count in per_task.items()
                                    if t in held)
        assert len(bank.embeddings()) == len(bank)
        found = bank.search(queries, n, allow_self_retrieval=True)
        assert all(h.entry.task_id not in held for hits in found for h in hits)
        assert all(len(hits) == len(bank) for hits in found)
        assert not {r.task_id for r in bank.stored_rollouts()} & set(held)
        with pytest.raises(BankError, match=re.escape(
                f"task {held[0]} is withheld from {copy} (a validation task): it may not enter "
                "the bank")):
            bank.add([stored[held[0]]])
        assert bank.stats()["withheld_tasks"] == 3
    # Stored in the bank: a reopened copy and a snapshot of it still withhold them.
    with ExperienceBank.open(copy) as bank:
        assert bank.withheld == frozenset(held)
        again = bank.snapshot(tmp_path / "again")
    with ExperienceBank.open(again) as bank:
        assert task_ids(bank) == every - set(held)
    with ExperienceBank.open(inputs / "bank") as source:  # the original is untouched
        assert source.withheld == frozenset() and len(source) == n


def test_charged_rollouts_add_up_and_travel_with_the_bank(inputs, tmp_path):
    with ExperienceBank.open(inputs / "bank") as source:
        copy = source.snapshot(tmp_path / "copy")
    with ExperienceBank.open(copy) as bank:
        assert bank.rollouts_sampled == 0
        bank.charge(100)
        bank.charge(23)
        with pytest.raises(ValueError, match=re.escape("rollouts must be >= 0, got -1")):
            bank.charge(-1)
        snap = bank.snapshot(tmp_path / "snap")
    with ExperienceBank.open(snap) as bank:
        assert bank.rollouts_sampled == 123 and bank.stats()["rollouts_sampled"] == 123


def test_margin_weights_by_hand():
    rewards = torch.tensor([1.0, 0.75, 0.25, 0.0])
    successes = torch.tensor([True, False, False, False])
    assert losses.margin_weights(rewards, successes, "signed_reward").tolist() == \
        [1.0, 0.5, -0.5, -1.0]
    # A 0.75 failure counts against the teacher under "success", for it under "signed_reward".
    assert losses.margin_weights(rewards, successes, "success").tolist() == [1.0, -1.0, -1.0, -1.0]
    # mean 0.5, population std sqrt((0.25 + 0.0625) * 2 / 4) = 0.395285
    expected = [(r - 0.5) / (0.3952847 + 1e-4) for r in (1.0, 0.75, 0.25, 0.0)]
    assert losses.margin_weights(rewards, successes, "advantage").tolist() == \
        pytest.approx(expected, abs=1e-6)
    # Normalised over the whole step when given it (a process holding half of the step).
    half = losses.margin_weights(rewards[:2], successes[:2], "advantage", batch_rewards=rewards)
    assert half.tolist() == pytest.approx(expected[:2], abs=1e-6)
    assert losses.margin_weights(torch.full((3,), 0.5), torch.zeros(3, dtype=torch.bool),
                                 "advantage").tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match=re.escape(
            "unknown margin weight 'reward'; choose from signed_reward, success, advantage")):
        losses.margin_weights(rewards, successes, "reward")


def test_lopd_step_uses_the_configured_margin_weight(inputs, tmp_path):
    from conftest import junk_and_gold_batch

    seen = {}
    for kind in ("signed_reward", "success", "advantage"):
        t = trainer.Trainer(lopd_config(inputs, **{"lopd.margin_weight": kind}),
                            tmp_path / kind, get_algorithm("lopd"), progress=False)
        batch = junk_and_gold_batch(t, 2)
        state = t.algorithm.before_step(batch)
        rewards = batch.rewards
        successes = torch.tensor([r.success for r in batch.rollouts])
        assert torch.allclose(state["margin_weights"].cpu(),
                              losses.margin_weights(rewards, successes, kind))
        seen[kind] = state["margin_weights"].tolist()
    assert seen["signed_reward"] != seen["success"] != seen["advantage"]


def test_random_retrieval_draws_other_tasks_entries_reproducibly(inputs, tmp_path):
    """lopd.retrieval random (the control): n_ret entries per rollout, never of its own task, not
    the nearest ones, the same draw for the same seed, step and task (so resume and a split batch
    draw the same), another draw at another step."""
    from conftest import junk_and_gold_batch
    from lopd.experience import random_entries, retrieve

    near = trainer.Trainer(lopd_config(inputs), tmp_path / "near", get_algorithm("lopd"),
                           progress=False)
    rand = trainer.Trainer(lopd_config(inputs, **{"lopd.retrieval": "random"}), tmp_path / "rand",
                           get_algorithm("lopd"), progress=False)
    batch = junk_and_gold_batch(rand, 4)
    state = rand.algorithm.before_step(batch)
    bank = rand.algorithm.bank
    by_trace = {e.trace: e for e in bank.entries}
    nearest = [[h.entry.trace for h in hits] for hits in retrieve(bank, batch.rollouts, 2)]
    assert near.algorithm.before_step(batch)["teacher_context"] == nearest
    assert state["teacher_context"] != nearest
    for rollout, traces in zip(batch.rollouts, state["teacher_context"]):
        assert len(traces) == 2 and all(by_trace[t].task_id != rollout.task_id for t in traces)
    again = random_entries(bank, batch.rollouts[::-1], 2, f"{rand.ctx.cfg.run.seed}:1")
    assert [[e.trace for e in x] for x in again[::-1]] == state["teacher_context"]
    later = random_entries(bank, batch.rollouts, 2, f"{rand.ctx.cfg.run.seed}:2")
    assert [[e.trace for e in x] for x in later] != state["teacher_context"]


def test_validation_run_never_retrieves_validation_tasks_and_charges_setup(inputs, tmp_path):
    cfg = lopd_config(inputs, **{"train.eval_split": "validation", "train.eval_tasks": 6,
                                 "train.max_steps": 3, "train.eval_every": 3})
    t = trainer.Trainer(cfg, tmp_path / "run", get_algorithm("lopd"), progress=False)
    validation = {task.task_id for task in t.eval_tasks}
    assert t.ctx.validation_task_ids == validation and len(validation) == 6
    with ExperienceBank.open(inputs / "bank") as source:
        # The source bank holds the validation tasks' successes: without withholding they would
        # be retrievable.
        assert validation <= task_ids(source)
        setup = source.rollouts_sampled
    assert t.algorithm.bank.withheld == validation
    assert not task_ids(t.algorithm.bank) & validation
    t.run()
    records = trainer.read_jsonl(tmp_path / "run" / trainer.METRICS_FILE)
    steps = [r for r in records if r["step"] > 0]
    assert len(steps) == 3 and all(r["retrieval/validation_hits"] == 0 for r in steps)
    evals = trainer.read_jsonl(tmp_path / "run" / trainer.EVAL_FILE)
    assert [e["setup_generations"] for e in evals] == [setup] * len(evals)
    # The checkpointed bank still withholds them (a resumed run keeps the rule).
    last = trainer.checkpoints(tmp_path / "run")[-1]
    with ExperienceBank.open(last / "bank") as bank:
        assert bank.withheld == validation


def test_lopd_charges_the_bank_and_the_cold_start_samples(inputs, tmp_path):
    import json
    import shutil

    root = tmp_path / "charged"
    shutil.copytree(inputs, root)
    with ExperienceBank.open(root / "bank") as bank:
        bank.charge(500)
    (root / "composer" / "cold_start.json").write_text(json.dumps(
        {"figures": {"rollouts_sampled": 40}, "history": []}))
    t = trainer.Trainer(lopd_config(root), tmp_path / "run", get_algorithm("lopd"), progress=False)
    assert t.algorithm.setup_rollouts() == 540 and t.setup_generations == 540
    g = trainer.Trainer(lopd_config(root, **{"train.algorithm": "grpo"}), tmp_path / "grpo",
                        get_algorithm("grpo"), progress=False)
    assert g.setup_generations == 0


def test_cold_start_validation_carve_out_is_withheld_and_measured_per_epoch(inputs, tmp_path):
    cfg = lopd_config(inputs, **{"cold_start.epochs": 2, "cold_start.batch_size": 8,
                                 "cold_start.validation_tasks": 4,
                                 "cold_start.validation_samples": 2, "rollout.temperature": 1.0})
    validation = {t.task_id for t in stages.get_env(cfg).tasks("train")[-4:]}
    with ExperienceBank.open(inputs / "bank") as source:
        n = len(source)
        kept = len([e for e in source.entries if e.task_id not in validation])
    figures = pipeline.cold_start(cfg, inputs / "bank", tmp_path / "composer", progress=False)
    assert figures["validation_tasks"] == 4 and figures["rollouts_sampled"] == 8
    assert figures["successes"] == kept < n
    steps_per_epoch = -(-kept // 8)
    assert figures["steps"] == 2 * steps_per_epoch
    assert figures["held_out_successes"] > 0
    assert [r["epoch"] for r in figures["per_epoch"]] == [1, 2]
    assert (tmp_path / "composer" / "epochs" / "epoch-1" / "composer.json").is_file()
    # Each epoch's snapshot carries the cold start's record: a run on it is charged the samples.
    import json

    snapshot = json.loads((tmp_path / "composer" / "epochs" / "epoch-1" / "cold_start.json")
                          .read_text())
    assert snapshot["snapshot_epoch"] == 1 and snapshot["figures"]["rollouts_sampled"] == 8
    assert figures["best_epoch_by_retrieved_nll"] in (1, 2)
    with ExperienceBank.open(inputs / "bank") as source:  # the user's bank is unchanged
        assert len(source) == n and source.withheld == frozenset()


def test_training_at_another_temperature_is_refused_before_the_run_folder_is_written(inputs,
                                                                                     tmp_path):
    from lopd.config import ConfigError

    cfg = lopd_config(inputs, **{"rollout.temperature": 0.7, "rollout.top_k": 5})
    with pytest.raises(ConfigError, match=re.escape(
            "training rollouts must sample what the training forward scores (temperature 1, no "
            "truncation): rollout.temperature=0.7, rollout.top_k=5 are refused; evaluation keeps "
            "rollout.eval_temperature")):
        trainer.Trainer(cfg, tmp_path / "run", get_algorithm("lopd"), progress=False)
    assert not (tmp_path / "run").exists()


def test_an_ablation_trains_arms_that_differ_only_in_their_settings(inputs, tmp_path, monkeypatch):
    import yaml

    from lopd import pipeline
    from lopd.experiments.ablation import ablation, parse_arm

    assert parse_arm("success:lopd.margin_weight=success, lopd.margin=0.1") == \
        ("success", ["lopd.margin_weight=success", "lopd.margin=0.1"])
    with pytest.raises(ValueError, match=re.escape(
            "--arm 'success': expected NAME:SECTION.KEY=VALUE[,SECTION.KEY=VALUE...], e.g. "
            "success:lopd.margin_weight=success")):
        parse_arm("success")
    sets = [f"{k}={v}" for k, v in {"train.max_steps": 1, "train.eval_every": 1,
                                    "train.save_every": 1, "train.eval_split": "validation",
                                    "train.eval_tasks": 4}.items()]
    base = lopd_config(inputs)
    path = tmp_path / "base.yaml"
    trainer.write_config(base, path)
    arms = {"signed": ["lopd.margin_weight=signed_reward"], "success": ["lopd.margin_weight=success"]}
    # --isolate: each arm's run is trained by a `lopd train` process of its own, not this one.
    with monkeypatch.context() as patch:
        patch.setattr(pipeline, "train", lambda *a, **k: pytest.fail("trained in this process"))
        report = ablation(path, sets, "lopd", arms, 1, tmp_path / "abl", ["delta", "beta"],
                          isolate=True)
    configs = {a: yaml.safe_load((tmp_path / "abl" / a / "seed0" / "config.yaml").read_text())
               for a in arms}
    differ = {(section, key) for section in configs["signed"]
              for key in configs["signed"][section]
              if configs["signed"][section][key] != configs["success"][section][key]}
    assert differ == {("lopd", "margin_weight")}
    assert set(report["arms"]) == set(arms) and report["split"] == "validation"
    for row in report["arms"].values():
        assert len(row["mean_reward"]) == 1 and row["generations"] == 4
        assert len(row["tracked"]["delta"]) == 1 and row["tracked_final"]["beta"] == [0.0]
    table = (tmp_path / "abl" / "results.md").read_text()
    assert "| signed | `lopd.margin_weight=signed_reward` |" in table
    assert "| success | `lopd.margin_weight=success` |" in table
    assert (tmp_path / "abl" / "ablation.png").stat().st_size > 0
    # A finished ablation is read back, not trained again.
    mtime = (tmp_path / "abl" / "signed" / "seed0" / "eval.jsonl").stat().st_mtime
    ablation(path, sets, "lopd", arms, 1, tmp_path / "abl", ["delta", "beta"])
    assert (tmp_path / "abl" / "signed" / "seed0" / "eval.jsonl").stat().st_mtime == mtime


def test_a_frozen_composer_is_never_updated_and_the_student_loss_is_the_same(inputs, tmp_path):
    """lopd.update_composer false (the joint-optimisation ablation's frozen φ0): after a step the
    composer's weights and β are exactly the cold start's, while the student moves; the student's
    loss equals the joint run's on the same batch, and the joint run does update its composer."""
    from conftest import junk_and_gold_batch

    def weights(alg):
        return [p.detach().clone() for p in alg.composer.trainable_parameters()]

    runs = {}
    for name, update in (("joint", True), ("frozen", False)):
        t = trainer.Trainer(lopd_config(inputs, **{"lopd.update_composer": update,
                                                   "lopd.dual_init": 0.3,
                                                   "train.learning_rate": 1e-3}),
                            tmp_path / name, get_algorithm("lopd"), progress=False)
        batch = runs.get("batch") or junk_and_gold_batch(t, 2)
        runs["batch"] = batch
        before = weights(t.algorithm)
        student = [p.detach().clone() for p in t.ctx.student.parameters()]
        figures = t.algorithm.step(batch)
        changed = [not torch.equal(a, b) for a, b in zip(before, weights(t.algorithm))]
        moved = any(not torch.equal(a, b) for a, b in zip(student, t.ctx.student.parameters()))
        runs[name] = (figures, any(changed), moved, t.algorithm.beta)
    (joint, joint_changed, joint_moved, joint_beta) = runs["joint"]
    (frozen, frozen_changed, frozen_moved, frozen_beta) = runs["frozen"]
    assert not frozen_changed and frozen_beta == 0.3 and frozen_moved
    assert "composer/grad_norm" not in frozen
    assert joint_changed and joint_moved and joint_beta != 0.3
    assert frozen["kl"] == pytest.approx(joint["kl"], rel=1e-6)
