import json
import random

import numpy as np
import pytest
import torch

from lopd import base_model as base
from lopd import models
from lopd.config import BaseConfig, load_config


def test_action_token_loss_equals_the_full_logits_loss(tiny_tokenizer, tiny_model):
    seqs = [([5, 6, 7, 8, 9], [0, 0, 1, 1, 0]), ([10, 11, 12], [0, 1, 1])]
    batch = base.collate_arrays(seqs, tiny_tokenizer.pad_token_id)
    assert batch["labels"].tolist() == [[-100, -100, 7, 8, -100], [-100, 11, 12, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    loss, n_tokens = base.action_token_loss(tiny_model, batch)
    reference = tiny_model(**batch).loss     # transformers' own shifted cross-entropy
    assert n_tokens == 4
    assert loss.item() == pytest.approx(reference.item(), abs=1e-6)


def test_learning_rate_schedule():
    cfg = BaseConfig(learning_rate=1.0, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    assert base.lr_at(0, cfg) == pytest.approx(0.1)
    assert base.lr_at(9, cfg) == pytest.approx(1.0)
    assert base.lr_at(60, cfg) == pytest.approx(0.55)           # half-way down the cosine
    assert base.lr_at(110, cfg) == pytest.approx(0.1)
    assert base.lr_at(500, cfg) == pytest.approx(0.1)


def test_length_batches_cover_every_index_once():
    lengths = [random.Random(i).randint(5, 50) for i in range(103)]
    batches = base.length_batches(lengths, 8, random.Random(0))
    assert sorted(i for b in batches for i in b) == list(range(103))
    assert all(len(b) <= 8 for b in batches)
    # Batches hold similar lengths: the spread inside a batch is far below the overall spread.
    spread = np.mean([max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches])
    assert spread < 10


def test_sft_data_round_trip_and_stale_meta(tmp_path):
    class R:
        def __init__(self, ids, mask):
            self.input_ids, self.action_mask = ids, mask

    data = base.SFTData.from_rollouts([R([1, 2, 3], [0, 1, 1]), R([4, 5], [0, 1])])
    assert len(data) == 2 and data.sequence(1) == ([4, 5], [0, 1])
    data.save(tmp_path / "d.npz", {"a": 1})
    again = base.SFTData.load(tmp_path / "d.npz", {"a": 1})
    assert again.sequence(0) == ([1, 2, 3], [0, 1, 1]) and again.lengths() == [3, 2]
    assert base.SFTData.load(tmp_path / "d.npz", {"a": 2}) is None      # made with other settings


def test_build_base_end_to_end_on_a_few_tasks(tmp_path):
    torch.set_num_threads(1)
    cfg = load_config("tiny", [
        "env.pretrain_size=24", "env.train_size=30", "env.eval_size=10", "base.pretrain_tasks=24",
        "base.max_steps=3", "base.eval_every=3", "base.eval_tasks=2", "base.batch_size=8",
        "model.vocab_size=600", "rollout.max_turns=2", "rollout.max_completion_length=8"])
    result = base.build_base(cfg, tmp_path, progress=False)
    assert result["pretrain_transcripts"] == 24 and result["steps"] == 3
    saved = json.loads((tmp_path / "base_training.json").read_text())
    assert [e["step"] for e in saved["evals"]] == [3]
    assert (tmp_path / "base_training.png").stat().st_size > 0
    model, tokenizer = models.load_model(tmp_path)
    assert models.count_parameters(model) == result["parameters"]
    # A second run reuses the prepared tokenizer and transcripts.
    again = base.build_base(cfg, tmp_path, progress=False)
    assert again["prepare_seconds"] < result["prepare_seconds"] + 5
    assert again["final_loss"] == pytest.approx(result["final_loss"], rel=1e-5)


def test_pretrain_pool_too_small_is_a_clear_error(tmp_path):
    cfg = load_config("tiny", ["env.pretrain_size=5", "base.pretrain_tasks=10"])
    with pytest.raises(ValueError, match="base.pretrain_tasks=10 exceeds"):
        base.build_base(cfg, tmp_path, progress=False)


def test_reference_blocks_leave_the_action_targets_unchanged():
    from lopd.agent import run_episodes
    from lopd.envs import get_env
    from lopd.latent import REFERENCE_PREFIX
    from lopd.policies import OraclePolicy

    tokenizer = models.load_tokenizer(models.resolve_model_path("toolworld-1m"))
    env = get_env("toolworld", seed=0, sizes={"eval": 2, "train": 2, "pretrain": 60})
    tasks = env.tasks("pretrain")
    rollouts = run_episodes(env, tasks, OraclePolicy(), tokenizer, max_turns=8,
                            max_new_tokens=96, batch_size=60)
    plain = base.with_references(rollouts, tasks, tokenizer, 0.0, 3, 80, seed=0)
    assert plain == [(r.input_ids, r.action_mask) for r in rollouts]
    augmented = base.with_references(rollouts, tasks, tokenizer, 1.0, 3, 80, seed=0)
    with_block = 0
    for (ids, mask), r in zip(augmented, rollouts):
        actions = [t for t, m in zip(ids, mask) if m]
        assert actions == [t for t, m in zip(r.input_ids, r.action_mask) if m]
        text = tokenizer.decode(ids)
        if len(ids) > len(r.input_ids):
            with_block += 1
            assert f"<|im_start|>user\n{REFERENCE_PREFIX}Task: " in text
    assert with_block >= 50      # every task whose template has a peer in the pool


def test_a_time_limited_run_resumed_ends_like_an_uninterrupted_one(tmp_path):
    torch.set_num_threads(1)
    sets = ["env.pretrain_size=24", "env.train_size=30", "env.eval_size=10",
            "base.pretrain_tasks=24", "base.max_steps=6", "base.eval_every=3", "base.eval_tasks=2",
            "base.batch_size=8", "base.stop_at_success=1.0", "model.vocab_size=600",
            "rollout.max_turns=2", "rollout.max_completion_length=8"]
    whole = base.build_base(load_config("tiny", sets), tmp_path / "whole", progress=False)
    # A limit of ~0 stops after the first step, with a checkpoint.
    cut = base.build_base(load_config("tiny", [*sets, "base.time_limit_minutes=1e-9"]),
                          tmp_path / "cut", progress=False)
    assert cut["stopped"] == "time_limit" and cut["steps"] == 1
    with pytest.raises(ValueError, match="different config"):
        base.build_base(load_config("tiny", [*sets, "base.learning_rate=1e-3"]), tmp_path / "cut",
                        progress=False, resume=True)
    resumed = base.build_base(load_config("tiny", sets), tmp_path / "cut", progress=False,
                              resume=True)
    assert resumed["steps"] == 6 and resumed["stopped"] == "max_steps"
    assert resumed["final_loss"] == pytest.approx(whole["final_loss"], rel=1e-5)
    a, _ = models.load_model(tmp_path / "whole")
    b, _ = models.load_model(tmp_path / "cut")
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.allclose(x, y, atol=1e-6), name
    with pytest.raises(FileNotFoundError, match="base_checkpoint.pt"):
        base.build_base(load_config("tiny", sets), tmp_path / "none", progress=False, resume=True)


def test_a_coded_request_sees_its_references_under_its_own_code():
    from lopd.agent import run_episodes
    from lopd.envs import get_env
    from lopd.policies import OraclePolicy

    tokenizer = models.load_tokenizer(models.resolve_model_path("toolworld-1m"))
    env = get_env("toolworld", seed=0, sizes={"eval": 2, "train": 2, "pretrain": 120},
                  coded_fraction=1.0)
    tasks = env.tasks("pretrain")
    rollouts = run_episodes(env, tasks, OraclePolicy(), tokenizer, max_turns=8,
                            max_new_tokens=96, batch_size=60)
    augmented = base.with_references(rollouts, tasks, tokenizer, 1.0, 3, 80, seed=0)
    seen = {"coded": 0, "plain": 0}
    for (ids, _), task in zip(augmented, tasks):
        text = tokenizer.decode(ids)
        if "Reference from a similar task" not in text:
            continue
        block = text.split("Reference from a similar task")[1].split("<|im_end|>")[0]
        task_lines = [line for line in block.split("\n") if line.startswith("Task: ")]
        assert task_lines
        if "code" in task.meta:
            seen["coded"] += 1
            # every peer under this request's code, entities only, so the code is the link
            assert all(line.startswith(f"Task: Request {task.meta['code']}: ") for line in task_lines)
            # ... and their actions carry the values this request leaves out
            from lopd.envs.toolworld import request_parts
            for value in request_parts(task.meta["plain_instruction"])[1]:
                assert value in block
        else:
            seen["plain"] += 1
            assert not any(line.startswith("Task: Request ") for line in task_lines)
    assert seen["coded"] >= 20 and seen["plain"] >= 20


WARM_UP = ["env.pretrain_size=24", "env.train_size=30", "env.eval_size=10",
           "base.pretrain_tasks=24", "base.max_steps=4", "base.eval_every=4", "base.eval_tasks=2",
           "base.batch_size=8", "base.stop_at_success=1.0", "model.vocab_size=600",
           "rollout.max_turns=2", "rollout.max_completion_length=8"]


def test_micro_batches_and_checkpointing_give_the_loss_curve_of_one_pass(tmp_path):
    torch.set_num_threads(1)
    whole = base.build_base(load_config("tiny", WARM_UP), tmp_path / "whole", progress=False)
    micro = base.build_base(load_config("tiny", [*WARM_UP, "train.per_device_train_batch_size=3",
                                                 "train.gradient_checkpointing=true"]),
                            tmp_path / "micro", progress=False)
    curve = lambda out: [h["loss"] for h in json.loads(  # noqa: E731
        (out / "base_training.json").read_text())["history"]]
    assert curve(tmp_path / "micro") == pytest.approx(curve(tmp_path / "whole"), rel=1e-5)
    assert micro["final_loss"] == pytest.approx(whole["final_loss"], rel=1e-5)
    a, _ = models.load_model(tmp_path / "whole")
    b, _ = models.load_model(tmp_path / "micro")
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.allclose(x, y, atol=1e-6), name


def test_a_warm_up_killed_mid_run_resumes_from_its_last_checkpoint(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    whole = base.build_base(load_config("tiny", WARM_UP), tmp_path / "whole", progress=False)
    sets = [*WARM_UP, "base.save_every_minutes=1e-9"]       # a checkpoint after every step
    update, calls = base.sft_update, []

    def dies_at_the_third_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:119] DefaultCPUAllocator: not "
                               "enough memory: you tried to allocate 2147483648 bytes.")
        return update(*args, **kwargs)

    monkeypatch.setattr(base, "sft_update", dies_at_the_third_step)
    with pytest.raises(MemoryError, match=r"out of memory at warm-up step 3 .*"
                       r"train.per_device_train_batch_size.*--resume"):
        base.build_base(load_config("tiny", sets), tmp_path / "killed", progress=False)
    monkeypatch.setattr(base, "sft_update", update)
    assert torch.load(tmp_path / "killed" / base.CHECKPOINT, weights_only=False)["step"] == 2
    # Resumed with other memory settings: the same update, so the same run.
    resumed = base.build_base(load_config("tiny", [*sets, "train.per_device_train_batch_size=2"]),
                              tmp_path / "killed", progress=False, resume=True)
    assert resumed["steps"] == 4 and resumed["final_loss"] == pytest.approx(whole["final_loss"],
                                                                              rel=1e-5)
    a, _ = models.load_model(tmp_path / "whole")
    b, _ = models.load_model(tmp_path / "killed")
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.allclose(x, y, atol=1e-6), name


def test_a_warm_up_that_cannot_fit_is_refused_up_front_in_one_line(tmp_path, monkeypatch, capsys):
    from lopd.cli import main

    monkeypatch.setattr(base, "available_bytes", lambda: 2**20)
    args = ["base", "--out", str(tmp_path / "b")] + [f"--set={s}" for s in WARM_UP]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]    # after the data's progress bar
    assert err.startswith("lopd base: error: a warm-up step would need about")
    assert "train.gradient_checkpointing=true" in err
    assert not (tmp_path / "b" / base.CHECKPOINT).exists()
