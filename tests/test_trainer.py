"""The shared loop's pieces that need no model: task sampling, the updater, the run folder."""

import re
import shutil

import pytest
import torch

from conftest import GRPO_RUN, cut
from lopd import stages, trainer
from lopd.algorithms import get_algorithm
from lopd.algorithms.base import Algorithm, Updater
from lopd.config import load_config
from lopd.envs import get_env


@pytest.fixture(scope="module")
def tasks():
    return get_env("toolworld", seed=0, sizes={"train": 50, "eval": 4, "pretrain": 0}).tasks("train")


def test_each_epoch_visits_every_task_once_and_steps_are_reproducible(tasks):
    per_step = 10
    first_epoch = [t.task_id for s in range(1, 6) for t in trainer.tasks_for_step(tasks, 3, s, per_step)]
    assert sorted(first_epoch) == sorted(t.task_id for t in tasks)
    again = [t.task_id for s in range(1, 6) for t in trainer.tasks_for_step(tasks, 3, s, per_step)]
    assert again == first_epoch
    other_seed = [t.task_id for t in trainer.tasks_for_step(tasks, 4, 1, per_step)]
    assert other_seed != first_epoch[:per_step]
    second_epoch = [t.task_id for s in range(6, 11) for t in trainer.tasks_for_step(tasks, 3, s, per_step)]
    assert sorted(second_epoch) == sorted(first_epoch) and second_epoch != first_epoch


def test_updater_skips_and_counts_non_finite_updates():
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 1)
    updater = Updater(layer.parameters(), learning_rate=0.1, max_grad_norm=1.0)
    before = [p.detach().clone() for p in layer.parameters()]
    out = updater.apply(layer(torch.tensor([[float("nan"), 1.0, 1.0]])).sum())
    assert out["skipped"] == 1.0 and updater.skipped == 1
    assert all(torch.equal(a, b) for a, b in zip(before, layer.parameters()))
    assert not updater.optimizer.state  # AdamW's moments were never touched
    out = updater.apply(layer(torch.ones(1, 3)).sum())
    assert out["skipped"] == 0.0 and updater.skipped == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, layer.parameters()))
    # The clip bounds the step: grad norm of sum(Wx + b) at x = 1 is 2 > 1.
    assert out["grad_norm"] == pytest.approx(2.0)


def test_updater_needs_trainable_parameters():
    layer = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="nothing to optimise"):
        Updater(layer.parameters(), 0.1, 1.0)


def test_half_written_checkpoints_are_never_listed(tmp_path):
    folder = tmp_path / trainer.CHECKPOINTS
    (folder / "step-000002").mkdir(parents=True)
    (folder / ".step-000004.tmp").mkdir()
    (folder / "step-000003").mkdir()
    assert [p.name for p in trainer.checkpoints(tmp_path)] == ["step-000002", "step-000003"]


def test_a_run_folder_is_never_overwritten_and_resume_needs_a_checkpoint(tmp_path):
    from lopd.algorithms import get_algorithm

    cfg = load_config("tiny")
    (tmp_path / "run").mkdir()
    trainer.write_config(cfg, tmp_path / "run" / trainer.CONFIG_FILE)
    with pytest.raises(trainer.RunError, match="already holds a run"):
        trainer.Trainer(cfg, tmp_path / "run", get_algorithm("lopd"))
    with pytest.raises(trainer.RunError, match="no complete checkpoint"):
        trainer.Trainer(cfg, tmp_path / "run", get_algorithm("lopd"), resume=True)
    with pytest.raises(trainer.RunError, match="not a training run"):
        trainer.read_config(tmp_path)


def test_unknown_algorithm_is_named():
    from lopd.algorithms import get_algorithm
    from lopd.config import ConfigError

    with pytest.raises(ConfigError, match="unknown algorithm 'ppo'.*lopd"):
        get_algorithm("ppo")


def test_lopd_without_composer_or_bank_fails_before_training(tmp_path):
    from lopd.algorithms import get_algorithm

    cfg = load_config("tiny", ["env.train_size=20", "env.eval_size=2", "env.pretrain_size=0"])
    with pytest.raises(ValueError, match="--composer DIR and --bank DIR"):
        trainer.Trainer(cfg, tmp_path / "run", get_algorithm("lopd"), progress=False)
    cfg = load_config("tiny", ["env.train_size=20", "env.eval_size=2", "env.pretrain_size=0",
                               f"lopd.composer={tmp_path / 'nope'}", f"lopd.bank={tmp_path / 'nope'}"])
    with pytest.raises(FileNotFoundError, match="lopd.composer"):
        trainer.Trainer(cfg, tmp_path / "run2", get_algorithm("lopd"), progress=False)


def test_validation_split_is_left_out_of_training(tmp_path, monkeypatch):
    cfg = load_config("tiny", ["env.train_size=30", "env.eval_size=2", "env.pretrain_size=0",
                               "train.eval_split=validation", "train.eval_tasks=5"])

    class Stop(Exception):
        pass

    def stop(self, ctx, checkpoint):
        raise Stop

    monkeypatch.setattr(Algorithm, "__init__", stop)

    class Probe(Algorithm):
        def step(self, batch):
            return {}

    captured = {}
    original = trainer.Trainer._load_student

    def spy(self, checkpoint):
        captured["train"], captured["eval"] = list(self.train_tasks), list(self.eval_tasks)
        return original(self, checkpoint)

    monkeypatch.setattr(trainer.Trainer, "_load_student", spy)
    with pytest.raises(Stop):
        trainer.Trainer(cfg, tmp_path / "run", Probe, progress=False)
    train_ids = {t.task_id for t in captured["train"]}
    eval_ids = {t.task_id for t in captured["eval"]}
    assert len(train_ids) == 25 and len(eval_ids) == 5 and not train_ids & eval_ids
    assert all(t.split == "train" for t in captured["eval"])


def test_the_engine_gets_the_students_weights_after_every_update(tmp_path, monkeypatch):

    pushed = []
    monkeypatch.setattr(stages, "sync_engine", lambda engine, model: pushed.append(
        (engine, {k: v.clone() for k, v in model.state_dict().items()})))
    cfg = load_config("tiny", ["env.train_size=20", "env.eval_size=2", "env.pretrain_size=0",
                               "train.rollouts_per_step=4", "train.eval_tasks=2",
                               "train.max_steps=2", "rollout.max_turns=2",
                               "rollout.max_completion_length=32", "train.algorithm=grpo",
                               "grpo.num_generations=2", "train.learning_rate=1e-3"])
    t = trainer.Trainer(cfg, tmp_path / "run", get_algorithm("grpo"), progress=False)
    t.run()
    assert len(pushed) == 2 and all(engine is t.engine for engine, _ in pushed)
    final = t.ctx.student.state_dict()
    assert all(torch.equal(v, final[k]) for k, v in pushed[-1][1].items())


def test_the_engine_sleeps_from_the_rollouts_to_the_weight_push(tmp_path, monkeypatch):
    """rollout.vllm_sleep's place in the loop: the engine sleeps after each step's rollouts, the
    update runs, then the push of the new weights wakes it before any further generation."""
    from lopd import stages

    cfg = load_config("tiny", ["env.train_size=20", "env.eval_size=2", "env.pretrain_size=0",
                               "train.rollouts_per_step=4", "train.eval_tasks=2",
                               "train.max_steps=2", "rollout.max_turns=2",
                               "rollout.max_completion_length=16", "train.algorithm=grpo",
                               "grpo.num_generations=2"])
    t = trainer.Trainer(cfg, tmp_path / "run", get_algorithm("grpo"), progress=False)
    events = []

    def record(name, fn):
        return lambda *args, **kwargs: events.append(name) or fn(*args, **kwargs)

    monkeypatch.setattr(t.engine, "generate", record("generate", t.engine.generate))
    monkeypatch.setattr(t.engine, "sleep", record("sleep", t.engine.sleep))
    monkeypatch.setattr(t.algorithm, "step", record("update", t.algorithm.step))
    monkeypatch.setattr(stages, "sync_engine", record("push", stages.sync_engine))
    t.run()
    runs = [e for i, e in enumerate(events) if i == 0 or e != events[i - 1]]
    assert runs == ["generate", "sleep", "update", "push"] * 2 + ["generate"]


# ----------------------------------------------------------------------------------------------
# Damaged run folders and refused starts: one line naming the file or key, nothing saved lost.


def test_resume_skips_a_checkpoint_whose_student_weights_are_cut(finished_run, tmp_path,
                                                                 capsys):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    weights = run / "checkpoints" / "step-000004" / "student" / "model.safetensors"
    cut(weights)
    checkpoint, state = trainer.resume_point(run)
    assert checkpoint.name == "step-000002" and state["step"] == 2
    assert capsys.readouterr().err == (
        f"note: resuming {run} from step-000002, its newest whole checkpoint; skipped "
        f"step-000004: {weights} is unreadable (SafetensorError: Error while deserializing "
        "header: incomplete metadata, file not fully covered)\n")
    assert weights.exists()  # left for the resumed run to write again, not deleted


def test_a_checkpoint_is_read_whole_or_refused_naming_the_file(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    folder = run / "checkpoints" / "step-000004"
    assert trainer.read_checkpoint(folder)["step"] == 4
    (folder / "student" / "config.json").write_text('{"model_type": ')
    with pytest.raises(trainer.RunError, match=re.escape(
            f"{folder / 'student' / 'config.json'} is unreadable (JSONDecodeError: Expecting "
            "value: line 1 column 16 (char 15))")):
        trainer.read_checkpoint(folder)
    (folder / trainer.STATE_FILE).write_bytes(b"")
    with pytest.raises(trainer.RunError, match=re.escape(
            f"{folder / trainer.STATE_FILE} is unreadable (EOFError: Ran out of input)")):
        trainer.read_checkpoint(folder)


def test_a_torn_last_record_is_left_out_and_any_other_bad_line_is_named(tmp_path):
    path = tmp_path / trainer.METRICS_FILE
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "loss": 0.')
    assert trainer.read_jsonl(path) == [{"step": 0}, {"step": 1}]
    path.write_text('{"step": 0}\n{"step": 1\n{"step": 2}\n')
    with pytest.raises(trainer.RunError) as err:
        trainer.read_jsonl(path)
    assert str(err.value) == (f"{path}:2: not a JSON record (Expecting ',' delimiter: line 1 "
                              "column 11 (char 10))")
    path.write_text('{"step": 0}\n{"step": 1}')  # whole, only its newline missing
    assert trainer.read_jsonl(path) == [{"step": 0}, {"step": 1}]
    path.write_text('{"step": 0}\n[1, 2]\n')
    with pytest.raises(trainer.RunError, match=re.escape(f"{path}:2: not a JSON record (a list)")):
        trainer.read_jsonl(path)


@pytest.mark.parametrize("algo, sets, world, message", [
    ("grpo", ["grpo.num_generations=3"], (1, "ddp"),
     "train.rollouts_per_step=4 must be a multiple of grpo's group size 3"),
    ("grpo", [], (4, "ddp"), "train.rollouts_per_step=4 is 2 task groups of 2, which do not split "
     "evenly over 4 processes: make the groups a multiple of 4"),
    ("sdft", [], (2, "fsdp2"), "sdft keeps a full EMA copy of the student next to the student, "
     "which train.parallel=fsdp2 shards; use train.parallel=ddp"),
    ("skill_sd", ["skill_sd.num_generations=2"], (2, "fsdp2"),
     "skill_sd keeps a teacher that scores with the student's full weights next to the student, "
     "which train.parallel=fsdp2 shards; use train.parallel=ddp"),
    ("grpo", ["train.student=lora"], (2, "fsdp2"), "train.parallel=fsdp2 shards a full student; "
     "a LoRA student (train.student=lora) trains with train.parallel=ddp"),
    ("grpo", ["model.name_or_path=/no/such/model"], (1, "ddp"), "model /no/such/model: no such "
     "folder, and not an embedded model (embedded: toolworld-1m, toolworld-1m-plain, "
     "codeworld-1m)"),
    ("lopd", [], (1, "ddp"), "LOPD needs a cold-started composer and a bank: pass --composer DIR "
     "and --bank DIR (or set lopd.composer and lopd.bank)"),
], ids=["group", "processes", "ema-fsdp2", "skill-fsdp2", "lora-fsdp2", "model", "lopd-inputs"])
def test_every_start_the_config_rules_out_is_refused_before_anything_is_built(
        algo, sets, world, message):
    from lopd.distributed import World

    cfg = load_config("tiny", [*GRPO_RUN, f"train.algorithm={algo}", *sets])
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        trainer.check_start(cfg, get_algorithm(algo), World(size=world[0], parallel=world[1]),
                            fresh=True)
    assert str(err.value) == message


def test_a_start_that_fails_while_loading_leaves_the_folder_reusable(tmp_path):
    """Config checks pass, the model's weights are cut: no config.yaml is written, so the same
    folder takes a corrected start."""
    from lopd import models

    broken = tmp_path / "broken-model"
    shutil.copytree(models.EMBEDDED_DIR, broken)
    cut(broken / "model.safetensors")
    cfg = load_config("tiny", [*GRPO_RUN, f"model.name_or_path={broken}"])
    with pytest.raises(Exception, match="model.safetensors|deserializing header"):
        trainer.Trainer(cfg, tmp_path / "run", get_algorithm("grpo"), progress=False)
    assert not (tmp_path / "run" / trainer.CONFIG_FILE).exists()
    t = trainer.Trainer(load_config("tiny", GRPO_RUN), tmp_path / "run", get_algorithm("grpo"),
                        progress=False)
    assert (tmp_path / "run" / trainer.CONFIG_FILE).is_file() and t.start_step == 0
