"""Shared test set-up: one CPU thread (far faster than two on shared cores) and tiny fixtures."""

import pytest
import torch

from lopd import models, policies
from lopd.corpus import synthetic_transcripts

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return models.train_tokenizer(synthetic_transcripts(n=200, seed=0), vocab_size=600)


@pytest.fixture(scope="session")
def tiny_model(tiny_tokenizer):
    return models.build_model(tiny_tokenizer, preset="qwen3-1m", seed=0).eval()


from lopd.config import ComposerConfig  # noqa: E402

LOPD_SPEC = ComposerConfig(num_latents=4, depth=2, num_heads=4, max_experience_tokens=96)


def make_lopd_inputs(root):
    """A bank of oracle successes on 40 training tasks and an (untrained) composer folder under
    ``root``: the inputs of a tiny LOPD run."""
    from lopd import agent
    from lopd.composer import Composer
    from lopd.embedding import EmbedderSpec, load_embedder
    from lopd.envs import get_env
    from lopd.experience import ExperienceBank

    model, tokenizer = models.load_model("toolworld-1m")
    # The tiny preset's environment (coded requests), so the bank holds the instructions its runs see.
    env = get_env("toolworld", seed=0, sizes={"train": 40, "eval": 4, "pretrain": 0},
                  coded_fraction=1.0)
    tasks = env.tasks("train")
    rollouts = agent.run_episodes(env, tasks, policies.OraclePolicy(), tokenizer, max_turns=8,
                                  max_new_tokens=96, batch_size=40)
    with ExperienceBank.create(root / "bank", load_embedder(EmbedderSpec(kind="policy",
                                                                         path="toolworld-1m"))) as bank:
        bank.add_rollouts(rollouts, {t.task_id: t for t in tasks}, source="oracle")
    torch.manual_seed(0)
    Composer(model.eval(), tokenizer, LOPD_SPEC).save(root / "composer")
    return root


def small_config(**sets):
    """The ``tiny`` preset scaled down to a few steps of 4 rollouts on 40 training tasks (every
    method); ``sets`` (``"section.key": value``) override it."""
    from lopd.config import load_config

    values = {"env.train_size": 40, "env.eval_size": 4, "env.pretrain_size": 0,
              "train.rollouts_per_step": 4, "train.eval_tasks": 2, "train.max_steps": 4,
              "train.eval_every": 2, "train.save_every": 2, "rollout.max_turns": 3,
              "rollout.max_completion_length": 48, "rollout.batch_size": 4, **sets}
    return load_config("tiny", [f"{k}={v}" for k, v in values.items()])


def lopd_config(inputs, **sets):
    """:func:`small_config` for a LOPD run on ``make_lopd_inputs(inputs)``."""
    return small_config(**{
        "composer.num_latents": LOPD_SPEC.num_latents, "composer.depth": LOPD_SPEC.depth,
        "composer.max_experience_tokens": LOPD_SPEC.max_experience_tokens, "bank.n_ret": 2,
        "lopd.composer": str(inputs / "composer"), "lopd.bank": str(inputs / "bank"), **sets})


def junk_and_gold_batch(t, n_tasks, step=1):
    """A step of ``n_tasks`` training tasks of trainer ``t`` in groups of two: a random-policy
    rollout (a failure) and the oracle's (a success) of each task, so GRPO's group advantages are
    −1 and +1 and a LOPD step sees both outcomes."""
    from lopd import agent, trainer
    from lopd.algorithms.base import StepBatch

    tasks = trainer.tasks_for_step(t.train_tasks, 0, step, n_tasks)
    tok = t.ctx.tokenizer
    junk = agent.run_episodes(t.env, tasks, policies.RandomPolicy(seed=0), tok, 3, 48, n_tasks)
    gold = agent.run_episodes(t.env, tasks, policies.OraclePolicy(), tok, 8, 96, n_tasks)
    return StepBatch(step, [task for task in tasks for _ in range(2)],
                     [r for pair in zip(junk, gold) for r in pair])


def resume_keeps_the_ema_teacher(build, tmp_path, sets):
    """Train 4 steps whole and 2 + resume to 4 with ``build(run_dir, resume=..., **sets)``; assert
    the resumed run restored its EMA teacher (not a copy of the resumed student) and ends with the
    uninterrupted run's EMA weights and update count. Returns (whole, cut) metrics by step."""
    from lopd import trainer

    whole = build(tmp_path / "whole", **{"train.max_steps": 4, **sets})
    whole.run()
    build(tmp_path / "cut", **{"train.max_steps": 2, **sets}).run()
    resumed = build(tmp_path / "cut", resume=True, **{"train.max_steps": 4, **sets})
    # Restored, not rebuilt from the resumed student.
    assert any(not torch.equal(a, b) for a, b in zip(resumed.algorithm.ema.model.parameters(),
                                                     resumed.ctx.student.parameters()))
    resumed.run()
    for a, b in zip(whole.algorithm.ema.model.parameters(),
                    resumed.algorithm.ema.model.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-7)
    assert resumed.algorithm.ema_updates == whole.algorithm.ema_updates == 4
    return tuple({r["step"]: r for r in trainer.read_jsonl(tmp_path / name / trainer.METRICS_FILE)}
                 for name in ("whole", "cut"))



GRPO_RUN = ["env.train_size=20", "env.eval_size=2", "env.pretrain_size=0",
            "train.rollouts_per_step=4", "train.eval_tasks=2", "train.max_steps=4",
            "train.save_every=2", "train.eval_every=2", "rollout.max_turns=2",
            "rollout.max_completion_length=32", "train.algorithm=grpo", "grpo.num_generations=2",
            "train.learning_rate=1e-3"]
"""Overrides of the tiny preset for a 4-step GRPO run that takes seconds."""


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory):
    """A finished 4-step GRPO run (:data:`GRPO_RUN`) with its two kept checkpoints, step-000002
    and step-000004. Never changed: tests damage copies of it."""
    from lopd import trainer
    from lopd.algorithms import get_algorithm
    from lopd.config import load_config

    run = tmp_path_factory.mktemp("finished") / "run"
    trainer.Trainer(load_config("tiny", GRPO_RUN), run, get_algorithm("grpo"),
                    progress=False).run()
    assert [c.name for c in trainer.checkpoints(run)] == ["step-000002", "step-000004"]
    return run


def cut(path, keep=0.5):
    """Truncate ``path`` to ``keep`` of its bytes, as a full disk or an interrupted copy does."""
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def snapshot(folder):
    """Every file under ``folder`` with its bytes (to assert that nothing saved changed)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def scored_length(action_mask) -> int:
    """How much of a sequence scoring reads: up to its last action token (the whole sequence when
    it has none)."""
    return max((i for i, m in enumerate(action_mask) if m), default=len(action_mask) - 1) + 1
