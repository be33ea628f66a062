"""The transformers rollout engine: exact greedy decoding, batching invariance, sampling rules."""

import pytest
import torch

from lopd.corpus import synthetic_transcripts
from lopd.rollout import Generation, SamplingParams, TransformersEngine
from lopd.rollout.transformers_engine import sample_next


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    """Four prompts of different lengths (so the batch needs left padding)."""
    texts = synthetic_transcripts(n=4, seed=1)
    ids = [tiny_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    return [p[:n] for p, n in zip(ids, (31, 7, 52, 18))]


def teacher_forced_logprobs(model, prompt, generated, temperature=1.0):
    """log_softmax(logits / T) of one plain full-sequence forward pass, at the generated tokens."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return [logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(generated)]


def test_sampling_params_validate():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy


def test_default_stop_is_im_end(tiny_model, tiny_tokenizer):
    engine = TransformersEngine(tiny_model, tiny_tokenizer)
    assert tiny_tokenizer.convert_tokens_to_ids("<|im_end|>") in engine.stop_token_ids
    assert tiny_tokenizer.eos_token_id in engine.stop_token_ids
    assert engine.max_length == tiny_model.config.max_position_embeddings


def test_greedy_matches_full_forward_pass(tiny_model, tiny_tokenizer, prompts):
    engine = TransformersEngine(tiny_model, tiny_tokenizer)
    generations = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=16))
    for prompt, gen in zip(prompts, generations):
        assert len(gen.token_ids) == len(gen.logprobs) == 16 and not gen.finished
        reference = teacher_forced_logprobs(tiny_model, prompt, gen.token_ids)
        assert max(abs(a - b) for a, b in zip(reference, gen.logprobs)) < 1e-4
        # Greedy: each token is the argmax of the teacher-forced distribution.
        with torch.no_grad():
            logits = tiny_model(torch.tensor([prompt + gen.token_ids])).logits[0]
        assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == gen.token_ids


def test_batched_equals_one_at_a_time_with_early_stops(tiny_model, tiny_tokenizer, prompts):
    free = TransformersEngine(tiny_model, tiny_tokenizer).generate(
        prompts, SamplingParams(temperature=0, max_new_tokens=12))
    # Stop on a token that one row produces mid-way, so rows leave the batch at different steps.
    stop = free[0].token_ids[5]
    engine = TransformersEngine(tiny_model, tiny_tokenizer, stop_token_ids=[stop])
    params = SamplingParams(temperature=0, max_new_tokens=12)
    batched = engine.generate(prompts, params)
    alone = [engine.generate([p], params)[0] for p in prompts]
    assert [g.token_ids for g in batched] == [g.token_ids for g in alone]
    for b, a, f in zip(batched, alone, free):
        assert max(abs(x - y) for x, y in zip(b.logprobs, a.logprobs)) < 1e-4
        if stop in f.token_ids:
            cut = f.token_ids.index(stop) + 1
            assert b.finished and b.token_ids == f.token_ids[:cut]
        else:
            assert not b.finished and b.token_ids == f.token_ids
    assert batched[0].finished and len(batched[0].token_ids) <= 6


def test_sampling_is_seeded_and_logprobs_use_the_temperature(tiny_model, tiny_tokenizer, prompts):
    engine = TransformersEngine(tiny_model, tiny_tokenizer)
    params = SamplingParams(temperature=0.7, max_new_tokens=10, seed=3)
    first = engine.generate(prompts, params)
    again = engine.generate(prompts, params)
    other = engine.generate(prompts, SamplingParams(temperature=0.7, max_new_tokens=10, seed=4))
    assert [g.token_ids for g in first] == [g.token_ids for g in again]
    assert [g.token_ids for g in first] != [g.token_ids for g in other]
    for prompt, gen in zip(prompts, first):
        reference = teacher_forced_logprobs(tiny_model, prompt, gen.token_ids, temperature=0.7)
        assert max(abs(a - b) for a, b in zip(reference, gen.logprobs)) < 1e-4


def test_top_k_one_and_tiny_top_p_are_greedy(tiny_model, tiny_tokenizer, prompts):
    engine = TransformersEngine(tiny_model, tiny_tokenizer)
    greedy = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=8))
    top_k = engine.generate(prompts, SamplingParams(top_k=1, max_new_tokens=8, seed=0))
    top_p = engine.generate(prompts, SamplingParams(top_p=1e-6, max_new_tokens=8, seed=0))
    assert [g.token_ids for g in top_k] == [g.token_ids for g in greedy]
    assert [g.token_ids for g in top_p] == [g.token_ids for g in greedy]


def test_sample_next_truncation_rules():
    # Probabilities 0.5, 0.3, 0.15, 0.05.
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(2000, 1)
    generator = torch.Generator().manual_seed(0)
    tokens, logprobs = sample_next(logits, SamplingParams(top_p=0.7), generator)
    assert set(tokens.tolist()) == {0, 1}  # 0.5 < 0.7, so the second token is still needed
    expected = torch.tensor([0.5, 0.3]).log()
    assert torch.allclose(logprobs, expected[tokens])  # log-probs before truncation
    tokens, _ = sample_next(logits, SamplingParams(top_k=3), generator)
    assert set(tokens.tolist()) == {0, 1, 2}
    tokens, _ = sample_next(logits, SamplingParams(), generator)
    counts = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert torch.allclose(counts, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.04)
    tokens, logprobs = sample_next(logits[:1], SamplingParams(temperature=0), None)
    assert tokens.tolist() == [0] and abs(logprobs.item() - torch.tensor(0.5).log().item()) < 1e-6


def test_draws_follow_the_distribution_and_never_pick_a_zero():
    from lopd.rollout.transformers_engine import _draw

    probs = torch.tensor([[0.0, 0.6, 0.0, 0.4, 0.0]]).repeat(20000, 1)
    tokens = _draw(probs, torch.Generator().manual_seed(1))
    counts = torch.bincount(tokens, minlength=5).float() / len(tokens)
    assert counts[0] == counts[2] == counts[4] == 0
    assert abs(counts[1].item() - 0.6) < 0.02
    # A draw at the very top of the range (rounding) gives the last token that can be drawn.
    top = torch.tensor([[0.3, 0.7, 0.0]])
    ones = torch.Generator().manual_seed(0)
    original = torch.rand
    try:
        torch.rand = lambda *a, **k: torch.ones(1, 1, dtype=torch.float64)
        assert _draw(top, ones).tolist() == [1]
    finally:
        torch.rand = original


def test_generate_keeps_training_mode_and_handles_empty(tiny_model, tiny_tokenizer, prompts):
    engine = TransformersEngine(tiny_model, tiny_tokenizer)
    assert engine.generate([], SamplingParams()) == []
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[]], SamplingParams())
    tiny_model.train()
    try:
        out = engine.generate(prompts[:1], SamplingParams(max_new_tokens=3, seed=0))
        assert tiny_model.training and isinstance(out[0], Generation)
    finally:
        tiny_model.eval()


def test_rollout_engine_vllm_without_vllm_says_how_to_install(monkeypatch):
    from lopd import stages
    from lopd.config import ConfigError, RolloutConfig

    monkeypatch.setattr(stages, "ENGINES", ("transformers",))
    with pytest.raises(ConfigError, match=r"needs vLLM.*make test-vllm.*\[vllm\]"):
        stages.check_engine(RolloutConfig(engine="vllm"))
    stages.check_engine(RolloutConfig(engine="transformers"))


def test_rollout_engine_auto_takes_vllm_where_installed_and_supported(monkeypatch):
    from lopd import stages
    from lopd.config import RolloutConfig

    auto = RolloutConfig(engine="auto")
    monkeypatch.setattr(stages, "ENGINES", ("transformers",))
    assert stages.engine_name(auto) == ("transformers", "auto: vLLM is not installed here")
    stages.check_engine(auto)
    monkeypatch.setattr(stages, "ENGINES", ("transformers", "vllm"))
    assert stages.engine_name(auto) == ("vllm", "auto: vLLM is installed")
    name, why = stages.engine_name(auto, fsdp2=True)
    assert name == "transformers" and "fsdp2" in why
    copy = RolloutConfig(engine="auto", generation_weights="bf16-copy")
    assert stages.engine_name(copy)[0] == "transformers"
    stages.check_engine(copy)
    # An explicit choice is kept as it is.
    assert stages.engine_name(RolloutConfig(engine="transformers")) == (
        "transformers", "rollout.engine=transformers")


def test_vllm_weights_of_plain_injected_and_peft_models(tiny_model):
    """What the vLLM engine serves (lopd.rollout.vllm_engine.hf_weights, no vLLM needed): a plain
    model's weights with the tied head; a bare model with an injected adapter as its base (the
    composer's base acting with the adapter off); a PeftModel with its adapter merged in."""
    import copy

    from peft import LoraConfig, get_peft_model

    from lopd.rollout.vllm_engine import hf_weights

    plain = hf_weights(tiny_model)
    assert torch.equal(plain["lm_head.weight"], plain["model.embed_tokens.weight"])
    base = copy.deepcopy(tiny_model)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                 init_lora_weights=False))
    injected = hf_weights(base)
    assert injected.keys() == plain.keys()
    assert all(torch.equal(injected[k], plain[k]) for k in plain)
    merged = hf_weights(peft_model)
    assert merged.keys() == plain.keys()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q], plain[q])
    layer = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(3, tiny_model.config.hidden_size)
    with torch.no_grad():
        assert torch.allclose(layer(x), x @ merged[q].T, atol=1e-5)


def test_vllm_serves_bf16_under_bf16_mixed_training():
    from lopd.rollout.vllm_engine import serving_dtype

    fp32, bf16 = torch.float32, torch.bfloat16
    assert serving_dtype("auto", "bf16-mixed", fp32) == bf16   # not the fp32 master weights
    assert serving_dtype("auto", "fp32", fp32) == fp32
    assert serving_dtype("auto", "fp32", bf16) == bf16          # a model stored in bf16 (eval)
    assert serving_dtype("float32", "bf16-mixed", fp32) == fp32
    assert serving_dtype("bfloat16", "fp32", fp32) == bf16


def test_auto_gpu_memory_utilization_leaves_the_update_its_memory():
    from lopd.rollout.vllm_engine import auto_gpu_memory_utilization

    gib = 2**30
    # An H200 (140 GiB) with 100 GiB free once the models are resident, an 8 GiB student's
    # update still to allocate 24 GiB: (100 - 24 - 14) / 140 = 0.443, rounded down.
    share = auto_gpu_memory_utilization(100 * gib, 140 * gib, 24 * gib, 16 * gib)
    assert share == 0.44
    # vLLM starts only if share x total is free; the update and the 10% margin stay free.
    assert share * 140 * gib <= 100 * gib - 24 * gib - 14 * gib
    # Asleep during the update, vLLM may take all but the margin.
    assert auto_gpu_memory_utilization(100 * gib, 140 * gib, 0, 16 * gib) == 0.61
    with pytest.raises(ValueError, match=r"rollout.vllm_gpu_memory_utilization=auto: 40.0 GiB "
                       r"of the GPU's 140.0 GiB is free .* set rollout.vllm_sleep=true"):
        auto_gpu_memory_utilization(40 * gib, 140 * gib, 24 * gib, 16 * gib)


def test_a_sleeping_vllm_engine_takes_the_new_weights_before_its_kv_cache(tiny_model):
    """rollout.vllm_sleep's protocol on a stand-in for vllm.LLM (sleep mode needs a GPU): sleep
    frees weights and KV cache (level 2); the sync after the update maps the weights back, loads
    the update in the served dtype, then wakes the rest; a generate on a sleeping engine first
    pushes the model's weights."""
    from lopd.rollout.vllm_engine import VLLMEngine

    class StandIn:
        def __init__(self):
            self.calls = []

        def sleep(self, level):
            self.calls.append(f"sleep {level}")

        def wake_up(self, tags=None):
            self.calls.append(f"wake_up {tags}")

        def collective_rpc(self, method, kwargs):
            dtypes = {value.dtype for _, value in kwargs["weights_iterator"]}
            self.calls.append(f"{method} {dtypes}")

        def reset_prefix_cache(self):
            self.calls.append("reset_prefix_cache")

    engine = object.__new__(VLLMEngine)
    engine.model, engine.dtype, engine.llm = tiny_model, torch.bfloat16, StandIn()
    engine.sleep_mode, engine._asleep = True, False
    engine.sleep()
    engine.sleep()  # asleep already: nothing more
    engine.sync_weights(tiny_model)
    assert engine.llm.calls == ["sleep 2", "wake_up ['weights']",
                                "reload_weights {torch.bfloat16}", "wake_up None",
                                "reset_prefix_cache"]
    engine.llm.calls.clear()
    engine.sleep()
    engine._sampling_params = lambda *args: None
    engine._check_cache_room = lambda *args: None  # the stand-in has no KV cache to size
    engine.llm.generate = lambda *args, **kwargs: engine.llm.calls.append("generate") or []
    engine.generate([[1, 2]], SamplingParams(temperature=0, max_new_tokens=2))
    assert engine.llm.calls[1:] == ["wake_up ['weights']", "reload_weights {torch.bfloat16}",
                                    "wake_up None", "reset_prefix_cache", "generate"]
    engine.llm.calls.clear()
    engine.sleep_mode = False  # an engine built without rollout.vllm_sleep never sleeps
    engine.sleep()
    assert engine.llm.calls == []
