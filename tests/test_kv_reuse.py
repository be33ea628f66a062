"""Multi-turn rollouts that keep each episode's KV cache: the same rollouts as re-prefilling the
whole conversation every turn, with far fewer tokens prefilled, and never a stale cache."""

import pytest
import torch

from lopd import agent, chat, models, policies
from lopd.envs import get_env
from lopd.rollout import SamplingParams, TransformersEngine
from lopd.runtime import length_groups


@pytest.fixture(scope="module")
def toolworld():
    env = get_env("toolworld", seed=0, sizes={"train": 12, "eval": 0, "pretrain": 0})
    return env, env.tasks("train")


def episodes(model, tokenizer, env, tasks, reuse, params, batch_size=4):
    engine = TransformersEngine(model, tokenizer, reuse_cache=reuse)
    policy = policies.ModelPolicy(engine, tokenizer, params)
    rollouts = agent.run_episodes(env, tasks, policy, tokenizer, max_turns=8, max_new_tokens=48,
                                  batch_size=batch_size)
    return rollouts, engine


def largest_gap(a, b):
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra.logprobs, rb.logprobs))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0),
                                    SamplingParams(temperature=1.0, seed=3)],
                         ids=["greedy", "sampled"])
def test_kept_caches_give_the_reprefill_rollouts(toolworld, params):
    """The trained tiny base in float64 (so kernel rounding cannot hide a wrong position or a
    stale key): token for token the same episodes, the same log-probs, and far fewer tokens
    prefilled. Episodes refill the batch of 4 as others end, so kept and new rows mix."""
    env, tasks = toolworld
    model, tokenizer = models.load_model("toolworld-1m")
    model = model.double().eval()
    cached, engine = episodes(model, tokenizer, env, tasks, True, params)
    prefilled, baseline = episodes(model, tokenizer, env, tasks, False, params)
    assert sum(r.num_turns for r in cached) > 2 * len(tasks)          # multi-turn episodes
    assert [r.input_ids for r in cached] == [r.input_ids for r in prefilled]
    assert [r.action_mask for r in cached] == [r.action_mask for r in prefilled]
    assert largest_gap(cached, prefilled) <= 1e-5
    assert engine.prefilled_tokens < 0.5 * baseline.prefilled_tokens
    # A token is prefilled once: the prompt and tool tokens, and each turn's last generated token
    # (its keys are computed when the next turn starts).
    context = sum(len(r.input_ids) - sum(r.action_mask) + r.num_turns for r in cached)
    assert engine.prefilled_tokens <= context
    assert engine._kept == {}                                        # released at the end


def test_float32_kept_caches_agree_within_rounding(toolworld):
    env, tasks = toolworld
    model, tokenizer = models.load_model("toolworld-1m")
    params = SamplingParams(temperature=1.0, seed=5)
    cached, _ = episodes(model.eval(), tokenizer, env, tasks, True, params)
    prefilled, _ = episodes(model, tokenizer, env, tasks, False, params)
    assert [r.input_ids for r in cached] == [r.input_ids for r in prefilled]
    assert largest_gap(cached, prefilled) < 1e-4


def continuation(engine, tokenizer, prompt, params):
    first = engine.generate([prompt], params, sessions=["episode"])[0]
    return prompt + first.token_ids + tokenizer("\nok", add_special_tokens=False)["input_ids"]


def test_a_changed_weight_is_never_served_from_a_kept_cache(tiny_model, tiny_tokenizer):
    import copy

    model = copy.deepcopy(tiny_model)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    prompt = tiny_tokenizer(" ".join("abcdefghijklmnopqrst"), add_special_tokens=False)["input_ids"]
    assert len(prompt) > TransformersEngine.MIN_SHARED
    engine = TransformersEngine(model, tiny_tokenizer)
    extended = continuation(engine, tiny_tokenizer, prompt, params)
    before = engine.prefilled_tokens
    engine.generate([extended], params, sessions=["episode"])
    assert engine.prefilled_tokens - before < len(extended)            # the kept cache served
    extended = continuation(engine, tiny_tokenizer, prompt, params)
    with torch.no_grad():                                               # an optimiser's update
        next(model.parameters()).add_(0.5)
    before = engine.prefilled_tokens
    served = engine.generate([extended], params, sessions=["episode"])[0]
    assert engine.prefilled_tokens - before == len(extended)           # prefilled whole
    fresh = TransformersEngine(model, tiny_tokenizer, reuse_cache=False)
    assert served == fresh.generate([extended], params)[0]
    # A new session borrows the prefix it shares with a kept one; without sessions nothing is
    # reused; release() forgets everything.
    kept = continuation(engine, tiny_tokenizer, prompt, params)
    shared = len(kept) - len(tiny_tokenizer("\nok", add_special_tokens=False)["input_ids"]) - 1
    other = kept[:shared] + tiny_tokenizer(" x y", add_special_tokens=False)["input_ids"]
    before = engine.prefilled_tokens
    borrowed = engine.generate([other], params, sessions=["another"])[0]
    assert engine.prefilled_tokens - before == len(other) - shared
    alone = fresh.generate([other], params)[0]
    assert borrowed.token_ids == alone.token_ids
    assert max(abs(a - b) for a, b in zip(borrowed.logprobs, alone.logprobs)) < 1e-4
    before = engine.prefilled_tokens
    engine.generate([other], params)
    assert engine.prefilled_tokens - before == len(other)
    engine.release()
    assert engine._kept == {}


def test_kept_caches_with_latents_through_the_composer_agent(toolworld):
    """Base + Composer: the latents live in the kept cache; new episodes joining the batch splice
    theirs at prefill; other latents for the same session are never served from the cache."""
    from lopd.composer import ComposerPolicy
    from lopd.latent import ReferenceFormat, insert_reference

    env, tasks = toolworld
    composer_dir = models.ASSETS / "toolworld-1m-composer"
    model, tokenizer = models.load_model("toolworld-1m")
    from lopd.composer import Composer

    composer = Composer.load(composer_dir, model.eval(), tokenizer)
    generator = torch.Generator().manual_seed(0)
    table = {t.task_id: torch.randn(3 * composer.spec.num_latents, model.config.hidden_size,
                                    generator=generator) * 0.05 for t in tasks}
    runs = []
    for reuse in (True, False):
        policy = ComposerPolicy(TransformersEngine(composer.base, tokenizer, reuse_cache=reuse),
                                composer, None, SamplingParams(temperature=0.0), n_ret=3)
        policy._latents_for = lambda ts: torch.stack([table[t.task_id] for t in ts])
        runs.append(agent.run_episodes(env, tasks, policy, tokenizer, max_turns=8,
                                       max_new_tokens=48, batch_size=4))
    assert sum(r.num_turns for r in runs[0]) > len(tasks)
    assert [r.input_ids for r in runs[0]] == [r.input_ids for r in runs[1]]
    assert largest_gap(*runs) < 1e-4

    fmt = ReferenceFormat.for_tokenizer(tokenizer)
    block = fmt.latent_block(3 * composer.spec.num_latents)
    prompt = insert_reference(chat.render(tokenizer, env.reset(tasks[0]).messages(),
                                            tasks[0].tools, add_generation_prompt=True),
                              block, fmt)[0]
    engine = TransformersEngine(composer.base, tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    z = table[tasks[0].task_id].unsqueeze(0)
    with composer.teacher():
        first = engine.generate([prompt], params, latents=z, sessions=[0])[0]
        extended = prompt + first.token_ids
        before = engine.prefilled_tokens
        other = engine.generate([extended], params, latents=z + 1.0, sessions=[0])[0]
        assert engine.prefilled_tokens - before == len(extended)
        fresh = TransformersEngine(composer.base, tokenizer, reuse_cache=False)
        assert other == fresh.generate([extended], params, latents=z + 1.0)[0]


def test_a_call_without_latents_never_borrows_a_cache_made_with_latents():
    """A kept cache made with latents holds the latents at its <|latent|> positions: a new
    session's latent-free prompt with the same tokens must prefill whole and get what a fresh
    engine gives, not borrow those keys and values (only latent-free caches lend)."""
    model, tokenizer = models.load_model("toolworld-1m")
    model = model.double().eval()
    words = tokenizer(" ".join("abcdefghijklmnopqrst"), add_special_tokens=False)["input_ids"]
    latent_id = tokenizer.convert_tokens_to_ids(chat.LATENT_TOKEN)
    prompt = words[:4] + [latent_id] * 3 + words[4:]
    assert len(prompt) > TransformersEngine.MIN_SHARED
    z = torch.randn(1, 3, model.config.hidden_size, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    engine = TransformersEngine(model, tokenizer)
    engine.generate([prompt], params, latents=z, sessions=["with latents"])
    before = engine.prefilled_tokens
    plain = engine.generate([prompt], params, sessions=["without"])[0]
    assert engine.prefilled_tokens - before == len(prompt)              # borrowed nothing
    fresh = TransformersEngine(model, tokenizer, reuse_cache=False).generate([prompt], params)[0]
    assert plain.token_ids == fresh.token_ids
    assert max(abs(a - b) for a, b in zip(plain.logprobs, fresh.logprobs)) < 1e-9


def test_rows_are_prefilled_in_groups_of_similar_length():
    assert length_groups([5, 300, 6, 40, 290, 20]) == [[0, 2, 5], [3], [4, 1]]
    assert length_groups([]) == []
    assert length_groups([7, 7, 7]) == [[0, 1, 2]]


def test_a_prompt_given_several_times_is_prefilled_once(tiny_model, tiny_tokenizer):
    """A GRPO group's prompt: prefilled once, its copies decode from the same cache; greedy
    copies equal the prompt alone, sampled copies differ and carry their own log-probs."""
    p = tiny_tokenizer(" ".join("abcdefgh"), add_special_tokens=False)["input_ids"]
    q = tiny_tokenizer(" ".join("zyxw"), add_special_tokens=False)["input_ids"]
    engine = TransformersEngine(tiny_model, tiny_tokenizer)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    out = engine.generate([p, p, q, p], greedy)
    assert engine.prefilled_tokens == len(p) + len(q)
    alone = TransformersEngine(tiny_model, tiny_tokenizer)
    assert out[0].token_ids == out[1].token_ids == out[3].token_ids \
        == alone.generate([p], greedy)[0].token_ids
    assert out[2].token_ids == alone.generate([q], greedy)[0].token_ids
    sampled = engine.generate([p] * 4, SamplingParams(temperature=1.0, max_new_tokens=12, seed=0))
    assert len({tuple(g.token_ids) for g in sampled}) > 1
    with torch.no_grad():
        for g in sampled:
            logits = tiny_model(torch.tensor([p + g.token_ids])).logits[0].float()
            expected = torch.log_softmax(logits, -1)[len(p) - 1:-1].gather(
                -1, torch.tensor(g.token_ids).unsqueeze(1)).squeeze(1)
            assert torch.allclose(torch.tensor(g.logprobs), expected, atol=1e-4)
