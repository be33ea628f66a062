"""The transformers engine generating from a bfloat16 copy of a float32 model (bf16-mixed
training's rollouts): the same samples as the model loaded in bfloat16, refreshed whenever the
model's weights change, and chosen or refused by ``rollout.generation_weights``."""

import pytest
import torch

from lopd import models, stages, trainer
from lopd.algorithms import get_algorithm
from lopd.config import ConfigError, load_config
from lopd.rollout import SamplingParams, TransformersEngine

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=10, seed=5)


def prompts(tokenizer):
    texts = ["Find the weather in Paris.", "Convert 3 km to miles, please.", "Hello"]
    return [tokenizer(t).input_ids for t in texts]


def same(a, b):
    return ([g.token_ids for g in a] == [g.token_ids for g in b]
            and [g.logprobs for g in a] == [g.logprobs for g in b])


def bf16_load(model):
    """``model``'s weights in the model loaded in bfloat16, as lopd loads an inference-only one."""
    loaded, _ = models.load_model("toolworld-1m", dtype=torch.bfloat16)
    loaded.load_state_dict({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    return loaded.eval()


def test_the_copy_samples_what_the_model_loaded_in_bf16_samples():
    model, tokenizer = models.load_model("toolworld-1m")
    engine = TransformersEngine(model, tokenizer, weights_dtype=torch.bfloat16)
    assert engine.model is not model and engine.weights_dtype == torch.bfloat16
    assert next(model.parameters()).dtype == torch.float32  # the model itself is untouched
    reference, _ = models.load_model("toolworld-1m", dtype=torch.bfloat16)
    expected = TransformersEngine(reference, tokenizer).generate(prompts(tokenizer), PARAMS)
    got = engine.generate(prompts(tokenizer), PARAMS)
    assert same(got, expected)
    # Under the run's bf16 autocast the copy generates the same (autocast off inside).
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert same(engine.generate(prompts(tokenizer), PARAMS), expected)
    # Tied embeddings stay tied in the copy.
    if model.config.tie_word_embeddings:
        assert engine.model.lm_head.weight is engine.model.get_input_embeddings().weight


def test_the_copy_follows_every_update_of_the_model_and_drops_kept_caches():
    model, tokenizer = models.load_model("toolworld-1m")
    engine = TransformersEngine(model, tokenizer, weights_dtype=torch.bfloat16)
    first = prompts(tokenizer)
    turn = engine.generate(first, PARAMS, sessions=[0, 1, 2])
    # An optimiser step changes the weights in place.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = model(input_ids=torch.tensor([first[0]]), labels=torch.tensor([first[0]])).loss
    loss.backward()
    optimizer.step()
    second = [p + g.token_ids + p[:3] for p, g in zip(first, turn)]
    before = engine.prefilled_tokens
    got = engine.generate(second, PARAMS, sessions=[0, 1, 2])
    # The kept caches were made with the old weights: the whole prompts are prefilled again.
    assert engine.prefilled_tokens - before == sum(map(len, second))
    reference = TransformersEngine(bf16_load(model), tokenizer)
    assert same(got, reference.generate(second, PARAMS))
    # sync_weights refreshes it as well; another model is refused.
    engine.sync_weights(model)
    assert same(engine.generate(second, PARAMS), reference.generate(second, PARAMS))
    with pytest.raises(ValueError, match="another model"):
        engine.sync_weights(reference.model)


def test_a_model_already_in_the_copys_dtype_generates_itself():
    model, tokenizer = models.load_model("toolworld-1m", dtype=torch.bfloat16)
    assert TransformersEngine(model, tokenizer, weights_dtype=torch.bfloat16).model is model


def rollout_cfg(**sets):
    return load_config("tiny", [f"rollout.{k}={v}" for k, v in sets.items()]).rollout


def test_generation_weights_choose_the_copy_on_cpu_under_bf16_mixed_only():
    model, _ = models.load_model("toolworld-1m")
    assert stages.generation_dtype(rollout_cfg(), model, "bf16-mixed") == torch.bfloat16
    assert stages.generation_dtype(rollout_cfg(generation_weights="bf16-copy"), model,
                                   "bf16-mixed") == torch.bfloat16
    assert stages.generation_dtype(rollout_cfg(generation_weights="master"), model,
                                   "bf16-mixed") is None
    assert stages.generation_dtype(rollout_cfg(), model, "fp32") is None  # auto: nothing to copy
    with pytest.raises(ConfigError, match="bf16-copy is refused: run.precision resolves to fp32"):
        stages.generation_dtype(rollout_cfg(generation_weights="bf16-copy"), model, "fp32")


def test_a_student_with_adapters_is_never_copied():
    from peft import LoraConfig, get_peft_model

    model, _ = models.load_model("toolworld-1m")
    lora = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    assert stages.generation_dtype(rollout_cfg(), lora, "bf16-mixed") is None
    with pytest.raises(ConfigError, match="LoRA adapters"):
        stages.generation_dtype(rollout_cfg(generation_weights="bf16-copy"), lora, "bf16-mixed")


def test_bf16_copy_with_vllm_is_refused():
    with pytest.raises(ConfigError, match="transformers-engine setting"):
        stages.check_engine(rollout_cfg(engine="vllm", generation_weights="bf16-copy"))


@pytest.mark.parametrize("precision,copied", [("bf16-mixed", True), ("fp32", False)])
def test_the_trainer_rolls_out_from_a_copy_under_bf16_mixed(tmp_path, precision, copied):
    sets = ["env.train_size=8", "env.eval_size=2", "env.pretrain_size=0", "train.eval_tasks=2",
            "train.algorithm=grpo", f"run.precision={precision}"]
    t = trainer.Trainer(load_config("tiny", sets), tmp_path, get_algorithm("grpo"),
                        progress=False)
    assert (t.engine.model is not t.ctx.student) == copied
