"""Training precision: float32 trainable weights under bf16 autocast actually move at lr 1e-5, pure
bf16 weights mostly do not, and the composer trains in float32 on a bfloat16 base."""

import copy

import pytest
import torch

from lopd import agent, models, policies, runtime, trainer
from lopd.algorithms import get_algorithm
from lopd.algorithms.base import StepBatch
from lopd.composer import Composer
from lopd.config import ComposerConfig, load_config


def grpo_trainer(tmp_path, precision):
    sets = ["env.train_size=20", "env.eval_size=2", "env.pretrain_size=0",
            "train.rollouts_per_step=4", "train.eval_tasks=2", "train.learning_rate=1e-5",
            "grpo.num_generations=2", "train.algorithm=grpo", f"run.precision={precision}"]
    return trainer.Trainer(load_config("tiny", sets), tmp_path, get_algorithm("grpo"),
                           progress=False)


def gold_and_junk(t):
    """Two groups, each a random (failing) rollout and the gold one: advantages ±1."""
    pair = trainer.tasks_for_step(t.train_tasks, 0, 1, 2)
    junk = agent.run_episodes(t.env, pair, policies.RandomPolicy(seed=0), t.ctx.tokenizer, 3, 48, 2)
    gold = agent.run_episodes(t.env, pair, policies.OraclePolicy(), t.ctx.tokenizer, 8, 96, 2)
    return StepBatch(1, [pair[0], pair[0], pair[1], pair[1]], [junk[0], gold[0], junk[1], gold[1]])


def changed_share(before, params):
    """Share of the elements with a non-zero gradient whose value changed."""
    moved = total = 0
    for old, p in zip(before, params):
        touched = p.grad != 0
        moved += int((old != p.detach())[touched].sum())
        total += int(touched.sum())
    assert total > 0
    return moved / total


def test_bf16_mixed_moves_every_weight_pure_bf16_does_not(tmp_path):
    t = grpo_trainer(tmp_path / "run", "bf16-mixed")
    student = t.ctx.student
    assert t.precision == "bf16-mixed" and all(p.dtype == torch.float32 for p in student.parameters())
    seen = []
    hook = student.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda module, args, out: seen.append(out.dtype))
    batch = gold_and_junk(t)
    before = [p.detach().clone() for p in student.parameters()]
    t.ctx.student.train()
    figures = t.algorithm.step(batch)
    hook.remove()
    assert seen and all(d == torch.bfloat16 for d in seen)   # the forward ran under autocast
    assert figures["student/skipped_updates"] == 0
    assert changed_share(before, list(student.parameters())) >= 0.99

    # The same gradients applied by plain AdamW to bfloat16 weights: most updates round away.
    pure = copy.deepcopy(student).to(torch.bfloat16)
    pure_params = list(pure.parameters())
    for p, q, old in zip(pure_params, student.parameters(), before):
        p.data.copy_(old.to(torch.bfloat16))
        p.grad = q.grad.to(torch.bfloat16)
    start = [p.detach().clone() for p in pure_params]
    torch.optim.AdamW(pure_params, lr=1e-5, weight_decay=0.0).step()
    assert changed_share(start, pure_params) < 0.5


def test_the_cpu_bf16_units_are_read_from_the_cpu_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n")
    assert runtime.cpu_bf16_units(str(info)) == ("AVX-512 BF16", f"flag avx512_bf16 in {info}")
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16 amx_tile amx_bf16\n")
    assert runtime.cpu_bf16_units(str(info)) == ("AMX-BF16", f"flag amx_bf16 in {info}")
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2\n")
    assert runtime.cpu_bf16_units(str(info))[0] is None
    assert runtime.cpu_bf16_units(str(tmp_path / "absent"))[0] is None


def test_auto_is_bf16_mixed_on_cuda_and_on_bf16_cpus_for_wide_models_only(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert runtime.resolve_precision("auto", cuda) == "bf16-mixed"
    assert runtime.resolve_dtype("auto", cuda, "auto") == torch.bfloat16
    assert runtime.resolve_dtype("auto", cuda, "fp32") == torch.float32
    assert runtime.resolve_precision("fp32", cuda) == "fp32"
    monkeypatch.setattr(runtime, "cpu_bf16_units", lambda: ("AMX-BF16", "flag amx_bf16 in X"))
    precision, why = runtime.choose_precision("auto", cpu, 576)
    assert precision == "bf16-mixed" and "AMX-BF16" in why and "amx_bf16" in why
    assert runtime.resolve_dtype("auto", cpu, "auto", 576) == torch.bfloat16
    assert runtime.resolve_precision("auto", cpu, runtime.CPU_BF16_MIN_HIDDEN - 1) == "fp32"
    assert runtime.resolve_precision("auto", cpu) == "fp32"          # width unknown
    monkeypatch.setattr(runtime, "cpu_bf16_units", lambda: (None, "no flag"))
    precision, why = runtime.choose_precision("auto", cpu, 4096)
    assert precision == "fp32" and "no bfloat16 matrix unit" in why
    assert runtime.resolve_precision("bf16-mixed", cpu, 64) == "bf16-mixed"   # asked for: given
    with pytest.raises(ValueError, match="resolved precision"):
        runtime.autocast("auto", cpu)


def test_the_tiny_model_trains_in_float32_under_auto_even_with_bf16_units(tmp_path, monkeypatch):
    monkeypatch.setattr(runtime, "cpu_bf16_units", lambda: ("AMX-BF16", "flag amx_bf16 in X"))
    t = grpo_trainer(tmp_path / "run", "auto")
    assert t.precision == "fp32" and t.dtype == torch.float32


def test_the_composer_trains_in_float32_on_a_bfloat16_base():
    base, tokenizer = models.load_model("toolworld-1m", dtype=torch.bfloat16)
    composer = Composer(base.eval(), tokenizer, ComposerConfig(num_latents=4, depth=2))
    trainable = composer.trainable_parameters()
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    assert all(p.dtype == torch.float32 for p in composer.compressor.parameters())
    assert any("lora_" in n for n, p in composer.named_parameters() if p.requires_grad)
    assert composer.base.get_input_embeddings().weight.dtype == torch.bfloat16
    with runtime.autocast("bf16-mixed", torch.device("cpu")):
        z = composer.encode(["Cancel order O1."], [["1. cancel_order -> ok", "1. a -> b"]])
    assert z.shape == (1, 8, base.config.hidden_size) and torch.isfinite(z.float()).all()
    z.float().pow(2).mean().backward()
    grads = [p.grad for p in trainable if p.grad is not None]
    assert grads and all(g.dtype == torch.float32 for g in grads)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_a_whole_lopd_training_step_runs_in_each_precision(tmp_path, precision):
    from conftest import LOPD_SPEC as SPEC
    from conftest import make_lopd_inputs

    inputs = make_lopd_inputs(tmp_path / "inputs")
    sets = ["env.train_size=40", "env.eval_size=2", "env.pretrain_size=0",
            "train.rollouts_per_step=4", "train.eval_tasks=2", "train.max_steps=1",
            "rollout.max_turns=3", "rollout.max_completion_length=48", "rollout.batch_size=4",
            f"composer.num_latents={SPEC.num_latents}", f"composer.depth={SPEC.depth}",
            f"composer.max_experience_tokens={SPEC.max_experience_tokens}", "bank.n_ret=2",
            f"lopd.composer={inputs / 'composer'}", f"lopd.bank={inputs / 'bank'}",
            f"run.precision={precision}"]
    last = trainer.train(load_config("tiny", sets), tmp_path / "run", "lopd", progress=False)
    assert last["step"] == 1 and last["kl"] >= 0 and last["student/skipped_updates"] == 0


def weight_casts(model, tokenizer, n_tokens: int) -> tuple[int, int]:
    """(tokens generated, casts of a 2-D weight) for one greedy call under bf16 autocast."""
    from torch.profiler import ProfilerActivity, profile

    from lopd.rollout import SamplingParams, TransformersEngine

    engine = TransformersEngine(model, tokenizer)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "find order 7"}],
                                           add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        got = engine.generate([prompt] * 2, SamplingParams(temperature=0, max_new_tokens=n_tokens))
    casts = sum(1 for e in prof.events() if e.name == "aten::_to_copy" and e.input_shapes
                and tuple(e.input_shapes[0]) in shapes)
    return len(got[0].token_ids), casts


def test_generation_under_bf16_autocast_casts_each_weight_once_not_once_per_token():
    model, tokenizer = models.load_model("toolworld-1m")
    weights = sum(1 for p in model.parameters() if p.dim() == 2)
    tokens, casts = weight_casts(model, tokenizer, 12)
    assert tokens > 4
    assert casts == weights
