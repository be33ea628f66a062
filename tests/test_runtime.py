import random

import numpy as np
import pytest
import torch

from lopd import runtime
from lopd.config import RunConfig


def _draws():
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_seed_applies_to_python_numpy_and_torch():
    runtime.set_seed(11)
    first = _draws()
    runtime.set_seed(11)
    assert _draws() == first
    runtime.set_seed(12)
    assert _draws() != first


def test_setup_applies_threads_and_seed():
    device = runtime.setup(RunConfig(seed=5, num_threads=1, device="cpu"))
    assert device == torch.device("cpu") and torch.get_num_threads() == 1
    import faiss
    assert faiss.omp_get_max_threads() == 1


def test_bad_thread_count_and_missing_cuda_are_clear():
    with pytest.raises(ValueError, match="num_threads"):
        runtime.set_threads(0)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="run.device is 'cuda'"):
            runtime.resolve_device("cuda")


def test_auto_dtype_is_float32_on_cpu():
    assert runtime.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert runtime.resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
