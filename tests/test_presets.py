"""The real-model presets load and validate, keep the paper's values, and their architectures run an
LOPD step on CPU at reduced width; the prepared GPU check runs at reduced width."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lopd import agent, models, policies, trainer
from lopd.cli import main
from lopd.composer import Composer
from lopd.config import load_config
from lopd.embedding import EmbedderSpec, load_embedder
from lopd.envs import get_env
from lopd.experience import ExperienceBank

PRESETS = {"qwen3-4b": 2, "qwen3-8b": 2, "olmo3-7b": 4}
"""Preset -> decoder layers of its reduced model (OLMo's fourth layer is its full-attention one)."""


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_loads_validates_and_keeps_the_paper_values(preset, capsys):
    assert main(["config", "--config", preset]) == 0
    assert f"config {preset}" in capsys.readouterr().out
    cfg = load_config(preset)
    paper = {"train.learning_rate": 1e-5, "lopd.composer_learning_rate": 1e-5,
             "train.rollouts_per_step": 32, "grpo.num_generations": 4,
             "composer.num_latents": 32, "bank.n_ret": 3, "lopd.top_m": 20, "lopd.margin": 0.05,
             "lopd.anchor_weight": 0.2, "lopd.dual_lr": 0.5, "cold_start.batch_size": 8, "cold_start.max_grad_norm": 3.0}
    values = cfg.to_dict()
    for key, expected in paper.items():
        section, name = key.split(".")
        assert values[section][name] == pytest.approx(expected), key
    assert cfg.model.architecture == preset and cfg.run.precision == "auto"
    hidden = models.shaped_config(preset).hidden_size
    assert hidden % cfg.composer.num_heads == 0


def test_the_smollm2_preset_marks_every_value_and_keeps_the_paper_ones():
    text = (Path(__file__).resolve().parents[1] / "configs" / "smollm2-135m.yaml").read_text()
    values = [line for line in text.splitlines()
              if ":" in line and line.startswith("  ") and not line.lstrip().startswith("#")]
    assert values and all("# paper" in line or "# choice" in line for line in values)
    cfg = load_config("smollm2-135m")
    paper = {"train.learning_rate": 1e-5, "lopd.composer_learning_rate": 1e-5,
             "grpo.num_generations": 4, "bank.n_ret": 3, "lopd.top_m": 20, "lopd.margin": 0.05,
             "lopd.anchor_weight": 0.2, "lopd.dual_lr": 0.5, "cold_start.batch_size": 8, "cold_start.max_grad_norm": 3.0,
             "composer.lora_r": 8, "composer.lora_alpha": 16}
    got = cfg.to_dict()
    for key, expected in paper.items():
        section, name = key.split(".")
        assert got[section][name] == pytest.approx(expected), key
    assert cfg.model.name_or_path == "runs/models/smollm2-135m" and cfg.run.precision == "auto"
    # A choice, not the paper's 1e-5: the compressor starts from random weights (as the tiny one).
    assert cfg.cold_start.learning_rate == pytest.approx(3e-4)
    assert 576 % cfg.composer.num_heads == 0            # SmolLM2's hidden size
    assert cfg.train.rollouts_per_step % cfg.grpo.num_generations == 0


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_reduced_model_of_each_preset_runs_one_lopd_step(preset, tmp_path):
    tokenizer = models.load_tokenizer(models.resolve_model_path("toolworld-1m"))
    model = models.build_shaped_model(preset, tokenizer, width=64, layers=PRESETS[preset],
                                      vocab_size=len(tokenizer))
    models.save_model(model, tokenizer, tmp_path / "model")
    env = get_env("toolworld", seed=0, sizes={"train": 24, "eval": 2, "pretrain": 0})
    tasks = env.tasks("train")
    gold = agent.run_episodes(env, tasks, policies.OraclePolicy(), tokenizer, 8, 96, len(tasks))
    with ExperienceBank.create(tmp_path / "bank", load_embedder(EmbedderSpec(kind="minilm"))) as bank:
        bank.add_rollouts(gold, {t.task_id: t for t in tasks}, source="oracle")
    sets = [f"model.name_or_path={tmp_path / 'model'}", "env.train_size=24", "env.eval_size=2",
            "env.pretrain_size=0", "train.rollouts_per_step=4", "train.eval_tasks=2",
            "train.max_steps=1", "train.per_device_train_batch_size=2", "rollout.max_turns=2",
            "rollout.max_completion_length=16", "rollout.batch_size=4", "composer.num_latents=4",
            "composer.num_heads=4", "composer.depth=2", f"lopd.composer={tmp_path / 'composer'}",
            f"lopd.bank={tmp_path / 'bank'}", "run.device=cpu"]
    cfg = load_config(preset, sets)
    assert cfg.train.gradient_checkpointing          # the preset's setting is exercised too
    torch.manual_seed(0)
    Composer(model.eval(), tokenizer, cfg.composer).save(tmp_path / "composer")
    last = trainer.train(cfg, tmp_path / "run", "lopd", progress=False)
    assert last["step"] == 1 and last["action_tokens"] > 0 and last["micro_batches"] == 2
    assert last["student/skipped_updates"] == 0 and last["composer/skipped_updates"] == 0


def test_the_gpu_check_runs_on_cpu_at_reduced_width(tmp_path):
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
    out = tmp_path / "check.json"
    run = subprocess.run([sys.executable, str(script), "--width", "64", "--layers", "2",
                          "--vocab", "4096", "--rollouts", "8", "--latents", "4", "--steps", "1",
                          "--device", "cpu", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "GRPO" in run.stdout and "LOPD" in run.stdout and "tokens/s" in run.stdout
    figures = json.loads(out.read_text())
    assert figures["rollouts"] == 8 and figures["precision"] == "fp32"
    for algo in ("grpo", "lopd"):
        assert figures[algo]["seconds"] > 0 and figures[algo]["tokens_per_second"] > 0
