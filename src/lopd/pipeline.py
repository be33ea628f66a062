"""The stages every entry point shares: engines, policies, held-out evaluation, bank, cold start, train.

The CLI, the quickstart, ``compare`` / ``sweep`` and the benchmarks call these functions; none of
them builds an engine, a policy or an evaluation of its own. Each stage takes a :class:`Config`
and returns plain figures (dicts) that the caller prints or writes.
"""

from __future__ import annotations

from collections.abc import Sequence

from lopd.config import Config, ConfigError

# ----------------------------------------------------------------------------------------------
# Engines and policies

ENGINES = ("transformers",)
"""Rollout engines that exist; ``rollout.engine`` accepts these and refuses any other."""


def check_engine(rollout_cfg) -> None:
    """Refuse, at start-up, a ``rollout.engine`` no engine implements."""
    if rollout_cfg.engine not in ENGINES:
        raise ConfigError(f"rollout.engine={rollout_cfg.engine!r} is not available: lopd has no "
                          f"{rollout_cfg.engine} engine yet; available: {', '.join(ENGINES)}")


def make_engine(rollout_cfg, model, tokenizer):
    """The rollout engine named by ``rollout.engine`` over ``model`` (kept resident)."""
    check_engine(rollout_cfg)
    from lopd.rollout import TransformersEngine

    return TransformersEngine(model, tokenizer)


def sampling(cfg: Config, temperature: float | None = None, seed: int | None = None):
    """Sampling settings of the config's rollout section; ``temperature`` defaults to the
    evaluation temperature and ``seed`` to ``run.seed``."""
    from lopd.rollout import SamplingParams

    temperature = cfg.rollout.eval_temperature if temperature is None else temperature
    return SamplingParams.from_config(cfg.rollout, temperature,
                                      cfg.run.seed if seed is None else seed)


def load_model(cfg: Config, model_path: str | None = None, device=None):
    """(model in eval mode, tokenizer) of ``model_path`` (default ``model.name_or_path``) with the
    run's device and dtype."""
    from lopd import models, runtime

    device = device if device is not None else runtime.resolve_device(cfg.run.device)
    model, tokenizer = models.load_model(model_path or cfg.model.name_or_path, device=device,
                                         dtype=runtime.resolve_dtype(cfg.run.dtype, device),
                                         trust_remote_code=cfg.model.trust_remote_code)
    return model.eval(), tokenizer


def model_policy(cfg: Config, model, tokenizer, temperature: float | None = None,
                 seed: int | None = None, engine=None):
    """The model acting through the configured engine (``engine`` reuses one already built)."""
    from lopd.agent import ModelPolicy

    engine = engine if engine is not None else make_engine(cfg.rollout, model, tokenizer)
    return ModelPolicy(engine, tokenizer, sampling(cfg, temperature, seed))


def make_policy(cfg: Config, agent: str = "model", model_path: str | None = None, device=None,
                temperature: float | None = None):
    """(policy, tokenizer) for ``agent``: ``model`` (the model at ``model_path``), ``oracle``
    (the gold solution) or ``random`` (random valid tool calls). The tokenizer counts tokens."""
    from lopd import agent as agents
    from lopd import models

    path = model_path or cfg.model.name_or_path
    if agent in ("oracle", "random"):
        tokenizer = models.load_tokenizer(models.resolve_model_path(path),
                                          trust_remote_code=cfg.model.trust_remote_code)
        if agent == "oracle":
            return agents.OraclePolicy(), tokenizer
        return agents.RandomPolicy(seed=cfg.run.seed), tokenizer
    if agent != "model":
        raise ValueError(f"unknown agent {agent!r}; agents: model, oracle, random")
    model, tokenizer = load_model(cfg, path, device)
    return model_policy(cfg, model, tokenizer, temperature), tokenizer


# ----------------------------------------------------------------------------------------------
# Held-out evaluation


def held_out_tasks(cfg: Config, env) -> tuple[list, list]:
    """(training tasks, held-out tasks) as ``train.eval_split`` says: the eval split's first
    ``train.eval_tasks``, or a validation carve-out of the last ``train.eval_tasks`` training tasks
    (then left out of training)."""
    train_tasks = env.tasks("train")
    n = cfg.train.eval_tasks
    if cfg.train.eval_split == "validation":
        n = n or 200
        if n >= len(train_tasks):
            raise ConfigError(f"train.eval_tasks={n} validation tasks leave no training task of "
                              f"{len(train_tasks)}")
        return train_tasks[:-n], train_tasks[-n:]
    return train_tasks, env.tasks("eval")[: n or None]


def run_episodes(cfg: Config, env, tasks: Sequence, policy, tokenizer, progress: bool = True):
    """Every task's episode under ``policy`` with the config's episode limits."""
    from lopd.agent import rollout_episodes

    return rollout_episodes(env, list(tasks), policy, tokenizer, cfg.rollout, progress=progress)


def evaluate(cfg: Config, env, tasks: Sequence, policy, tokenizer, progress: bool = True):
    """(summary, rollouts) of ``policy`` on ``tasks``: mean reward, success rate, per domain.

    The one held-out evaluation of lopd: `lopd eval`, the trainer's periodic evaluation, the
    quickstart and ``compare``'s base row all come through here.
    """
    import torch

    from lopd.agent import summarize

    with torch.no_grad():
        rollouts = run_episodes(cfg, env, tasks, policy, tokenizer, progress)
    return summarize(rollouts), rollouts


def get_env(cfg: Config):
    """The configured environment."""
    from lopd.envs import get_env as build

    return build(cfg.env.name, **cfg.env.kwargs())


# ----------------------------------------------------------------------------------------------
# Training


def train(cfg: Config, run_dir, algorithm: str | None = None, resume: bool = False,
          progress: bool = True) -> dict:
    """Run (or resume) ``algorithm`` (default ``train.algorithm``); the last step's metrics."""
    from lopd import trainer

    return trainer.train(cfg, run_dir, algorithm or cfg.train.algorithm, resume=resume,
                         progress=progress)
