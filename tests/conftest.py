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
    return models.build_model(tiny_tokenizer, preset="tiny", seed=0).eval()
