"""Shared test set-up: one CPU thread (far faster than two on shared cores) and tiny fixtures."""

import pytest
import torch

from lopd import models
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
    from lopd.envs import get_env
    from lopd.experience import EmbedderSpec, ExperienceBank, load_embedder

    model, tokenizer = models.load_model("toolworld-1m")
    env = get_env("toolworld", seed=0, sizes={"train": 40, "eval": 4, "pretrain": 0})
    tasks = env.tasks("train")
    rollouts = agent.run_episodes(env, tasks, agent.OraclePolicy(), tokenizer, max_turns=8,
                                  max_new_tokens=96, batch_size=40)
    with ExperienceBank.create(root / "bank", load_embedder(EmbedderSpec(kind="policy",
                                                                         path="toolworld-1m"))) as bank:
        bank.add_rollouts(rollouts, {t.task_id: t for t in tasks}, source="oracle")
    torch.manual_seed(0)
    Composer(model.eval(), tokenizer, LOPD_SPEC).save(root / "composer")
    return root
