"""bf16-mixed against float32 on this CPU, side by side in one process: the matmul peak, a
training step of the tiny default and of a real model, and the log-prob difference of bf16
rollouts.

    python benchmarks/precision.py --repeats 6 --json docs/results/precision/amx-precision.json

For each model (the embedded toolworld-1m and ``--model``, default the SmolLM2 folder
``make smollm2`` prepares) and each precision, the same ``--batch`` x ``--tokens`` random tokens:

- forward: one no-grad forward (bf16-mixed: float32 weights under bf16 autocast);
- step: forward + backward + AdamW of a full fine-tuning step, and of a LoRA student (rank 16 on
  the attention and MLP projections, the library's ``train.student=lora``) for the real model.

Each figure is the median of ``--repeats`` timed runs after one untimed warm-up; the precisions
alternate run by run, so a machine that slows down does so for both. The CPU's bfloat16 matrix
unit (``lopd.runtime.cpu_bf16_units``) and what ``run.precision: auto`` chooses for each model are
printed first.

``--trainer-steps N``: N whole training steps (rollouts, the update, everything a step does) of
GRPO and of LOPD on ``--trainer-config`` (default the tiny preset, on its embedded composer and
bank) in each precision, four trainers interleaved step by step: what ``auto``'s choice for the
1M models is decided on.

``--vllm-episodes N`` (in ``.venv-vllm``): N greedy episodes served by vLLM in bfloat16, its
reported log-probs against the float32 and the bf16 model's on the same tokens.

Log-prob difference: ``--episodes`` toolworld episodes sampled (T = 1) from the real model in
float32 through lopd's engine, then each sampled action token's log-prob scored by the float32
model and by the same model with bfloat16 weights (as a bf16 rollout engine serves it): mean and
largest absolute difference, and the mean signed difference.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from lopd import agent, models, policies, runtime, stages
from lopd.algorithms import get_algorithm
from lopd.config import load_config
from lopd.envs import get_env
from lopd.rollout import SamplingParams, TransformersEngine
from lopd.tables import format_table, write_json
from lopd.teacher import rollout_logprobs
from lopd.trainer import Trainer

PRECISIONS = ("fp32", "bf16-mixed")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def matmul_gflops(dtype: torch.dtype, size: int = 1024, repeats: int = 2) -> float:
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size ** 3 * repeats / (time.perf_counter() - start) / 1e9


def student(model, kind: str):
    """A trainable copy: every weight ('full') or a LoRA adapter on a frozen copy ('lora')."""
    copy_ = copy.deepcopy(model).float().train()
    if kind == "lora":
        from peft import LoraConfig

        for p in copy_.parameters():
            p.requires_grad_(False)
        copy_ = models.lora_model(copy_, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                    target_modules=LORA_TARGETS))
    return copy_


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def jobs(model, ids, kinds) -> dict:
    """name -> fn(precision): a no-grad forward and one training step per student kind."""
    device = torch.device("cpu")
    trainees = {kind: student(model, kind) for kind in kinds}
    optimisers = {kind: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-6)
                  for kind, m in trainees.items()}
    frozen = copy.deepcopy(model).float().eval()

    def forward(precision):
        with torch.no_grad(), runtime.autocast(precision, device):
            frozen(ids)

    def step(kind, precision):
        m, opt = trainees[kind], optimisers[kind]
        with runtime.autocast(precision, device):
            loss = m(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return {"forward": forward, **{f"step_{kind}": (lambda precision, k=kind: step(k, precision))
                                   for kind in kinds}}


def logprob_difference(model, tokenizer, episodes: int, seed: int) -> dict:
    """Sampled action tokens scored by float32 and by bfloat16 weights."""
    env = get_env("toolworld", seed=0, sizes={"train": 8, "eval": episodes, "pretrain": 0},
                  coded_fraction=1.0)
    engine = TransformersEngine(model, tokenizer)
    policy = policies.ModelPolicy(engine, tokenizer, SamplingParams(temperature=1.0, seed=seed))
    rollouts = agent.run_episodes(env, env.tasks("eval"), policy, tokenizer, 2, 48, episodes)
    half = copy.deepcopy(model).to(torch.bfloat16).eval()
    pad = tokenizer.pad_token_id
    d = torch.cat(rollout_logprobs(half, rollouts, pad)) - torch.cat(
        rollout_logprobs(model, rollouts, pad))
    return {"episodes": len(rollouts), "action_tokens": int(d.numel()),
            "mean_abs": float(d.abs().mean()), "max_abs": float(d.abs().max()),
            "mean_signed": float(d.mean()), "p99_abs": float(d.abs().quantile(0.99))}


def vllm_bf16_difference(model, tokenizer, episodes: int) -> dict:
    """Greedy episodes served by vLLM in bfloat16; each action token's log-prob as vLLM reports it
    against the float32 model's and the bf16 model's (torch) on the same tokens."""
    from lopd.rollout.vllm_engine import VLLMEngine

    env = get_env("toolworld", seed=0, sizes={"train": 8, "eval": episodes, "pretrain": 0},
                  coded_fraction=1.0)
    engine = VLLMEngine(model, tokenizer, dtype=torch.bfloat16)
    try:
        policy = policies.ModelPolicy(engine, tokenizer, SamplingParams(temperature=0))
        rollouts = agent.run_episodes(env, env.tasks("eval"), policy, tokenizer, 2, 24, episodes)
    finally:
        engine.close()
    half = copy.deepcopy(model).to(torch.bfloat16).eval()
    out = {"episodes": len(rollouts)}
    # Rollout.logprobs runs along input_ids (0 off the actions): the action positions.
    reported = torch.tensor([lp for r in rollouts
                             for lp, m in zip(r.logprobs[1:], r.action_mask[1:]) if m])
    for name, m in (("vs_float32", model), ("vs_torch_bf16", half)):
        d = (reported - torch.cat(rollout_logprobs(m, rollouts, tokenizer.pad_token_id))).abs()
        out[name] = {"action_tokens": int(d.numel()), "mean_abs": float(d.mean()),
                     "p95_abs": float(d.quantile(0.95)), "max_abs": float(d.max())}
    return out


def trainer_steps(config: str, steps: int, precisions: list[str]) -> dict:
    """Whole training steps (rollouts included) of GRPO and LOPD on ``config`` in each precision:
    one trainer per (method, precision), steps interleaved, the first one warm-up."""
    sys.path.insert(0, str(Path(__file__).parent))
    from step_cost import one_step

    cfg = load_config(config)
    composer, bank = stages.embedded_assets(cfg)
    times: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {}
        for method in ("grpo", "lopd"):
            for precision in precisions:
                # Rollouts from the trained weights in each precision (under bf16-mixed: float32
                # weights under autocast); the bfloat16 weight copy is measured by step_cost.py.
                sets = [f"train.algorithm={method}", f"run.precision={precision}",
                        "rollout.generation_weights=master",
                        f"lopd.composer={composer}", f"lopd.bank={bank}",
                        f"train.max_steps={steps + 1}"]
                trainers[method, precision] = Trainer(load_config(config, sets),
                                                      Path(tmp) / f"{method}-{precision}",
                                                      get_algorithm(method), progress=False)
                times.setdefault(method, {})[precision] = []
        for step in range(1, steps + 2):
            for (method, precision), trainer in trainers.items():
                seconds = one_step(trainer, step)["time/step"]
                if step > 1:
                    times[method][precision].append(seconds)
    return {"config": config, "rollouts_per_step": cfg.train.rollouts_per_step,
            "threads": cfg.run.num_threads, "runs": times,
            "seconds": {m: {p: statistics.median(v) for p, v in by.items()}
                        for m, by in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="runs/models/smollm2-135m",
                        help="a prepared real model folder (default: make smollm2's)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per forward/step")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per figure")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--episodes", type=int, default=2,
                        help="sampled episodes for the log-prob difference (0 = skip)")
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS,
                        help="the precisions to time (the speed-up column needs both)")
    parser.add_argument("--timings", action=argparse.BooleanOptionalAction, default=True,
                        help="time the forward and steps (--no-timings: the vLLM part only)")
    parser.add_argument("--vllm-episodes", type=int, default=0,
                        help="also serve the real model with vLLM in bfloat16 (.venv-vllm) for this "
                        "many greedy episodes and compare its log-probs")
    parser.add_argument("--trainer-steps", type=int, default=0,
                        help="also time this many whole GRPO and LOPD training steps (rollouts "
                        "included) of --trainer-config in each precision, interleaved")
    parser.add_argument("--trainer-config", default="tiny")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args()
    args.precisions = [p for p in PRECISIONS if p in args.precisions]   # float32 first
    runtime.set_threads(args.threads)
    torch.manual_seed(0)
    unit, found = runtime.cpu_bf16_units()
    print(f"CPU bfloat16 matrix unit: {unit or 'none'} ({found}); {args.threads} threads")
    peak = {"fp32": matmul_gflops(torch.float32), "bf16": matmul_gflops(torch.bfloat16)}
    print(f"1024x1024 matmul: float32 {peak['fp32']:.1f} GFLOP/s, bfloat16 {peak['bf16']:.1f} "
          "GFLOP/s")
    out = {"cpu_bf16_unit": unit, "detected_by": found, "threads": args.threads,
           "matmul_gflops": peak, "batch": args.batch, "tokens": args.tokens, "models": {}}
    rows = []
    timed_models = (("toolworld-1m", ("full",)), (args.model, ("full", "lora"))) \
        if args.timings else ()
    for name, kinds in timed_models:
        model, tokenizer = models.load_model(name)
        hidden = runtime.hidden_size(model)
        auto, why = runtime.choose_precision("auto", torch.device("cpu"), hidden)
        print(f"{name}: {models.count_parameters(model) / 1e6:.1f}M parameters, hidden {hidden}; "
              f"auto -> {auto} ({why})")
        ids = torch.randint(0, len(tokenizer), (args.batch, args.tokens))
        work = jobs(model, ids, kinds)
        times: dict[str, dict[str, list[float]]] = {p: {job: [] for job in work}
                                                     for p in args.precisions}
        for repeat in range(args.repeats + 1):  # precisions alternate; the first round is warm-up
            for precision in args.precisions:
                for job, fn in work.items():
                    seconds = timed(lambda: fn(precision))
                    if repeat:
                        times[precision][job].append(seconds)
        figures = {p: {job: statistics.median(v) for job, v in runs_.items()}
                   for p, runs_ in times.items()}
        entry = {"parameters": models.count_parameters(model), "hidden_size": hidden,
                 "auto": auto, "auto_reason": why, "seconds": figures, "runs": times}
        for job in work:
            got = [figures[p][job] for p in args.precisions]
            ratio = f"{got[0] / got[1]:.2f}" if len(got) == 2 else ""
            rows.append([Path(name).name, job.replace("_", " "), *(f"{g:.3f}" for g in got), ratio])
        if name == args.model and args.episodes:
            entry["logprob_difference"] = logprob_difference(model, tokenizer, args.episodes, 0)
        out["models"][name] = entry
    names = {"fp32": "float32 s", "bf16-mixed": "bf16-mixed s"}
    headers = ["model", "phase", *(names[p] for p in args.precisions)]
    if rows:
        print(format_table(headers + (["speed-up of bf16"] if len(args.precisions) == 2 else []),
                           rows))
    diff = out["models"].get(args.model, {}).get("logprob_difference")
    if diff:
        print(f"bf16 weights vs float32, log-prob of {diff['action_tokens']} sampled action tokens "
              f"({diff['episodes']} episodes): mean |d| {diff['mean_abs']:.4f}, p99 "
              f"{diff['p99_abs']:.4f}, max {diff['max_abs']:.4f}, mean d {diff['mean_signed']:+.4f}")
    if args.trainer_steps:
        got = out["trainer_steps"] = trainer_steps(args.trainer_config, args.trainer_steps,
                                                   args.precisions)
        rows = [[method, *(f"{by[p]:.3f}" for p in args.precisions),
                 *([f"{by['fp32'] / by['bf16-mixed']:.2f}"] if len(by) == 2 else [])]
                for method, by in got["seconds"].items()]
        print(format_table(["method", *(names[p] for p in args.precisions),
                            *(["speed-up of bf16"] if len(args.precisions) == 2 else [])], rows,
                           title=f"whole training steps of {args.trainer_config} "
                           f"({got['rollouts_per_step']} rollouts, {got['threads']} thread(s)), "
                           f"medians of {args.trainer_steps} after a warm-up step"))
    if args.vllm_episodes:
        model, tokenizer = models.load_model(args.model)
        got = out["vllm_bf16"] = vllm_bf16_difference(model.eval(), tokenizer, args.vllm_episodes)
        for name, d in ((k, v) for k, v in got.items() if k != "episodes"):
            print(f"vLLM serving bf16, {name.replace('_', ' ')}: {d['action_tokens']} action tokens "
                  f"({got['episodes']} greedy episodes): mean |d| {d['mean_abs']:.3f}, p95 "
                  f"{d['p95_abs']:.3f}, max {d['max_abs']:.3f}")
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
