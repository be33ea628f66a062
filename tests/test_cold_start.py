import copy

import pytest
import torch

from lopd import agent, models, policies
from lopd.algorithms import cold_start as cs
from lopd.composer import Composer
from lopd.config import ColdStartConfig, ComposerConfig
from lopd.embedding import EmbedderSpec, load_embedder
from lopd.envs import get_env
from lopd.experience import ExperienceBank, retrieve_traces
from lopd.latent import ReferenceFormat, insert_reference
from lopd.teacher import LatentContext

SPEC = ComposerConfig(num_latents=4, depth=2, num_heads=4, max_experience_tokens=96)


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    """The embedded base, oracle successes of 40 training tasks, and a bank holding them."""
    model, tokenizer = models.load_model("toolworld-1m")
    env = get_env("toolworld", seed=0, sizes={"eval": 4, "train": 40, "pretrain": 0})
    tasks = env.tasks("train")
    rollouts = agent.run_episodes(env, tasks, policies.OraclePolicy(), tokenizer, max_turns=8,
                                  max_new_tokens=96, batch_size=40)
    bank = ExperienceBank.create(tmp_path_factory.mktemp("bank"),
                                 load_embedder(EmbedderSpec(kind="policy", path="toolworld-1m")))
    bank.add_rollouts(rollouts, {t.task_id: t for t in tasks}, source="oracle")
    return model, tokenizer, bank, rollouts


def test_retrieval_for_cold_start_is_leave_one_out(setting):
    _, _, bank, rollouts = setting
    traces = retrieve_traces(bank, rollouts[:5], n_ret=3)
    own = {r.task_id: r.compact_trace(bank.max_observation_chars) for r in rollouts}
    for rollout, found in zip(rollouts[:5], traces):
        assert len(found) == 3 and own[rollout.task_id] not in found
    with pytest.raises(ValueError, match="fewer than n_ret=100"):
        retrieve_traces(bank, rollouts[:1], n_ret=100)


def _plain_action_logprobs(model, ids, mask, inputs_embeds=None):
    """Log-probs of the tokens at ``mask == 1`` of one sequence under ``model``'s own forward."""
    ids = torch.tensor([ids])
    out = model(input_ids=ids) if inputs_embeds is None else model(inputs_embeds=inputs_embeds)
    picked = out.logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return picked[torch.tensor(mask[1:], dtype=torch.bool)]


def test_teacher_is_the_base_without_adapter_even_with_a_trained_adapter(setting):
    """LoRA B starts at 0, so an adapter left on is invisible on a fresh composer: here B is
    random, the encoder (adapter on) differs from θ0, and every teacher pass still equals the
    plain base — with no reference (``teacher_nll``) and with latents spliced in, right after the
    composer encoded them with the adapter on."""
    model, tokenizer, bank, rollouts = setting
    composer = Composer(copy.deepcopy(model).eval(), tokenizer, SPEC)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in composer.encoder.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    fmt = ReferenceFormat.for_tokenizer(tokenizer)
    sample = rollouts[:2]
    ids = torch.tensor([sample[0].input_ids])
    with torch.no_grad():
        adapted = composer.base.get_decoder()(input_ids=ids).last_hidden_state
        with composer.teacher() as teacher:
            plain = teacher.get_decoder()(input_ids=ids).last_hidden_state
        assert torch.equal(plain, model.get_decoder()(input_ids=ids).last_hidden_state)
        assert (adapted - plain).abs().max() > 1e-2

        nll = cs.teacher_nll(composer, sample, fmt, None, "none")
        for value, r in zip(nll, sample):
            reference = -_plain_action_logprobs(model, r.input_ids, r.action_mask).mean()
            assert value.item() == pytest.approx(reference.item(), abs=1e-6)

        traces = retrieve_traces(bank, sample, n_ret=2)
        scored, extras = LatentContext(composer, fmt).score(sample, traces)
        rows = []
        for r, z in zip(sample, extras["latents"]):
            block = fmt.latent_block(z.size(0))
            with_block, at = insert_reference(r.input_ids, block, fmt)
            mask = [*r.action_mask[:at], *[0] * len(block), *r.action_mask[at:]]
            embeds = model.get_input_embeddings()(torch.tensor([with_block])).clone()
            embeds[0, torch.tensor(with_block) == fmt.latent_id] = z
            rows.append(_plain_action_logprobs(model, with_block, mask, inputs_embeds=embeds))
        assert (scored.token_logprobs() - torch.cat(rows)).abs().max() < 1e-5


def test_cold_start_lowers_the_teacher_nll_and_leaves_the_base_alone(setting):
    model, tokenizer, bank, rollouts = setting
    base = copy.deepcopy(model).eval()
    frozen = {k: v.clone() for k, v in base.state_dict().items()}
    composer = Composer(base, tokenizer, SPEC)
    before = cs.latent_information(composer, bank, rollouts[:8], n_ret=2)
    cfg = ColdStartConfig(learning_rate=3e-3, batch_size=8, epochs=12)
    history = cs.cold_start(composer, bank, rollouts[:8], cfg, n_ret=2, progress=False)
    after = cs.latent_information(composer, bank, rollouts[:8], n_ret=2)
    assert len(history) == 12 and all(torch.isfinite(torch.tensor(h["nll"])) for h in history)
    key = "retrieved latents"
    assert after[key] < before[key]
    # The plain-teacher conditions do not depend on φ at all.
    assert after["no reference"] == pytest.approx(before["no reference"], abs=1e-6)
    assert after["retrieved traces as text"] == pytest.approx(before["retrieved traces as text"], abs=1e-6)
    with composer.teacher() as teacher:
        state = teacher.state_dict()
    for name, value in frozen.items():
        peft_name = next(k for k in state if k.endswith(name.replace(".weight", ".base_layer.weight"))
                         or k == name)
        assert torch.equal(state[peft_name], value), name


def test_base_plus_composer_agent_acts_with_latents(setting):
    from lopd.chat import LATENT_TOKEN
    from lopd.composer import ComposerPolicy
    from lopd.rollout import SamplingParams, TransformersEngine

    model, tokenizer, bank, rollouts = setting
    composer = Composer(copy.deepcopy(model).eval(), tokenizer, SPEC)
    env = get_env("toolworld", seed=0, sizes={"eval": 4, "train": 40, "pretrain": 0})
    tasks = env.tasks("eval")
    policy = ComposerPolicy(TransformersEngine(composer.base, tokenizer), composer, bank,
                            SamplingParams(temperature=0.0), n_ret=2)
    episodes = agent.run_episodes(env, tasks, policy, tokenizer, max_turns=3, max_new_tokens=48,
                                  batch_size=4)
    latent_id = tokenizer.convert_tokens_to_ids(LATENT_TOKEN)
    assert len(episodes) == 4 and all(latent_id not in r.input_ids for r in episodes)
    assert sum(r.generated_tokens for r in episodes) > 0
    # Latents are composed once per task and reused at every turn.
    assert set(policy._latents) == {t.task_id for t in tasks}
