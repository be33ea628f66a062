"""One GRPO step and one LOPD step on a Qwen3-4B-shaped model with random weights (or on a
prepared real model, ``--model DIR``), in the GPU precision mode, with the time split, peak
memory, tokens/s and MFU of the update phases.

Nothing is downloaded: the model is built from the checkpoint's shape (``lopd.models.REAL_SHAPES``)
with the embedded toolworld tokenizer, and the batch is toolworld rollouts of the oracle and of a
random agent (gold and junk, so GRPO's advantages are non-zero), 4 per task. Each method runs
``--steps`` steps on that batch; the figures are the last step's (the first warms up).

    python benchmarks/gpu_check.py                                   # a GPU: the full shape
    python benchmarks/gpu_check.py --model runs/models/smollm2-135m  # real weights (any device)
    python benchmarks/gpu_check.py --width 64 --layers 2 --vocab 4096 --rollouts 8   # CPU, reduced
    .venv-vllm/bin/python benchmarks/gpu_check.py --width 1024 --layers 1 --vocab 4096 \
        --rollouts 8 --engine vllm --precision bf16-mixed       # CPU, vLLM serving bf16

(vLLM's CPU attention has no kernel for head size 16, that of every reduced width up to 512; 1024
has 32.) The last line under ``.venv-vllm/bin/torchrun --nproc_per_node 2`` with ``--parallel ddp``
runs two DDP ranks on gloo, each with its own engine. ``benchmarks/gpu_check.sh`` wraps the first
line with vLLM colocated on the GPU (``--engine vllm --vllm-sleep``): it prints the share of the
GPU vLLM was given (``rollout.vllm_gpu_memory_utilization``, 'auto' unless ``--vllm-memory``),
puts vLLM to sleep during each update as the trainer does, checks that vLLM serves bf16 under
bf16-mixed and that it generates again after waking; on a machine with two GPUs it then runs two
DDP ranks, each with its own engine. MFU counts 6·params·tokens for the student's forward and
backward over the real (unpadded) tokens of the batch, against ``--peak-tflops`` (default: 989, an
H100/H200's dense bf16 peak; none is printed on a CPU unless given).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lopd import agent, distributed, models, policies, runtime, stages, trainer
from lopd.algorithms import get_algorithm
from lopd.algorithms.base import StepBatch
from lopd.composer import Composer
from lopd.config import load_config
from lopd.embedding import EmbedderSpec, load_embedder
from lopd.envs import get_env
from lopd.experience import ExperienceBank
from lopd.tables import format_table

PHASES = ("before_step", "student_forward", "teacher", "backward", "optimizer", "after_update")


class PeakRSS:
    """Peak resident memory above the level at entry, sampled every 2 ms (CPU runs: a step's
    allocations are not visible to torch's CUDA counters, and ru_maxrss never resets)."""

    def __enter__(self):
        import os
        import threading

        self._page = os.sysconf("SC_PAGE_SIZE")
        self.start = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _watch(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def gib(self) -> float:
        return (self.peak - self.start) / 2**30


def batch_of(env, tasks, tokenizer, per_task: int) -> tuple[list, list]:
    """``per_task`` rollouts of each task, gold and junk alternating."""
    gold = agent.run_episodes(env, tasks, policies.OraclePolicy(), tokenizer, 8, 96, len(tasks))
    junk = agent.run_episodes(env, tasks, policies.RandomPolicy(seed=0), tokenizer, 3, 64, len(tasks))
    rollouts, order = [], []
    for i, task in enumerate(tasks):
        for j in range(per_task):
            rollouts.append(gold[i] if j % 2 else junk[i])
            order.append(task)
    return order, rollouts


def generation_throughput(t, rollouts, new_tokens: int) -> dict:
    """Tokens/s of the run's rollout engine (``rollout.engine``) sampling ``new_tokens`` tokens
    after each rollout's first prompt, all in one batch (the student under its training wrapper:
    FSDP2 unshards it for the duration)."""
    from lopd.rollout import SamplingParams

    prompts = [r.input_ids[:r.prompt_length] for r in rollouts]
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=0)
    t.ctx.student.eval()
    if t.device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    with torch.no_grad(), runtime.autocast(t.precision, t.device), \
            distributed.generation(t.wrapped):
        out = t.engine.generate(prompts, params)
    if t.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    tokens = sum(len(g.token_ids) for g in out)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds}


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    # Under torchrun rank 0 writes the inputs, in a folder all ranks read.
    world, device = distributed.init(runtime.resolve_device(args.device), args.parallel)
    work = [Path(tempfile.mkdtemp(prefix="gpu-check-")) if world.is_main else None]
    if world.enabled:
        torch.distributed.broadcast_object_list(work, src=0)
    work = work[0]
    clock = time.perf_counter()
    reduce = {k: v for k, v in (("width", args.width), ("layers", args.layers),
                                ("vocab_size", args.vocab)) if v is not None}
    if args.model:
        # Real weights: the prepared folder is read as it is (the student loads it in float32).
        model_dir = Path(models.resolve_model_path(args.model))
        tokenizer = models.load_tokenizer(model_dir)
        shape = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            params = models.count_parameters(AutoModelForCausalLM.from_config(shape))
        hidden = shape.hidden_size
        reduce = {}
    else:
        model_dir = work / "model"
        tokenizer = models.load_tokenizer(models.resolve_model_path("toolworld-1m"))
        model = models.build_shaped_model(args.architecture, tokenizer, seed=0, **reduce)
        params, hidden = models.count_parameters(model), model.config.hidden_size
    precision = runtime.resolve_precision(args.precision, device, hidden)
    if not args.model:
        if world.is_main:
            models.save_model(model.to(torch.bfloat16 if precision == "bf16-mixed" else torch.float32),
                              tokenizer, model_dir)
        del model
    build_seconds = time.perf_counter() - clock
    heads = args.composer_heads or (shape.num_attention_heads if args.model else 4)
    if hidden % heads:
        raise SystemExit(f"--composer-heads {heads} does not divide the model's hidden size {hidden}")

    env = get_env("toolworld", seed=0, sizes={"train": 64, "eval": 4, "pretrain": 0})
    tasks = env.tasks("train")[: args.rollouts // 4]
    order, rollouts = batch_of(env, tasks, tokenizer, 4)
    real_tokens = sum(len(r.input_ids) for r in rollouts)
    action_tokens = sum(sum(r.action_mask) for r in rollouts)

    if world.is_main:
        embedder = load_embedder(EmbedderSpec(kind="minilm"), device=device)
        with ExperienceBank.create(work / "bank", embedder) as bank:
            gold = agent.run_episodes(env, env.tasks("train"), policies.OraclePolicy(), tokenizer,
                                      8, 96, 64)
            bank.add_rollouts(gold, {t.task_id: t for t in env.tasks("train")}, source="oracle")
    sets = [f"model.name_or_path={model_dir}", f"run.device={device.type}",
            f"run.precision={precision}", f"train.rollouts_per_step={len(rollouts)}",
            f"train.per_device_train_batch_size={args.micro_batch}",
            f"train.loss_chunk_tokens={args.loss_chunk_tokens}",
            f"train.gradient_checkpointing={str(args.gradient_checkpointing).lower()}",
            "env.train_size=64", "env.eval_size=4", "env.pretrain_size=0", "train.eval_tasks=4",
            f"composer.num_latents={args.latents}", f"composer.num_heads={heads}",
            f"lopd.composer={work / 'composer'}", f"lopd.bank={work / 'bank'}",
            "lopd.add_successes=false", f"run.num_threads={args.threads}",
            f"train.parallel={args.parallel}", f"rollout.engine={args.engine}",
            f"rollout.vllm_sleep={str(args.vllm_sleep).lower()}",
            f"rollout.vllm_gpu_memory_utilization={args.vllm_memory}"]
    if world.is_main:
        base, _ = models.load_model(model_dir, device=device,
                                    dtype=runtime.resolve_dtype("auto", device, precision))
        torch.manual_seed(0)
        Composer(base.eval(), tokenizer, load_config("tiny", sets).composer).save(work / "composer")
        del base
    world.barrier()

    results = {}
    for algo in ("grpo", "lopd"):
        cfg = load_config("tiny", [*sets, f"train.algorithm={algo}"])
        t = trainer.Trainer(cfg, work / f"run-{algo}", get_algorithm(algo), progress=False)
        batch = StepBatch(1, order, rollouts)
        if args.engine == "vllm":
            engine = {"dtype": str(t.engine.dtype).removeprefix("torch."),
                      "gpu_memory_utilization": t.engine.gpu_memory_utilization,
                      "sleep": t.engine.sleep_mode}
            if precision == "bf16-mixed":  # rollout.vllm_dtype=auto: never the fp32 master copy
                assert t.engine.dtype == torch.bfloat16, t.engine.dtype
        if algo == "grpo":
            generation = generation_throughput(t, rollouts, args.new_tokens)
        t.ctx.student.train()
        for _ in range(args.steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(device)
            started = time.perf_counter()
            t.engine.sleep()  # as the trainer does: a no-op unless rollout.vllm_sleep
            with PeakRSS() as rss:
                figures = t.algorithm.step(batch)
            stages.sync_engine(t.engine, t.ctx.student)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - started
        update = figures["time/student_forward"] + figures["time/backward"]
        results[algo] = {"seconds": seconds, **{p: figures.get(f"time/{p}", 0.0) for p in PHASES},
                         "tokens_per_second": real_tokens / seconds,
                         # GPU: peak allocation during the step; CPU: peak RSS above the step's start
                         "peak_memory_gb": (torch.cuda.max_memory_allocated(device) / 2**30
                                            if device.type == "cuda" else rss.gib),
                         "student_update_tflops": 6 * params * real_tokens / max(update, 1e-9) / 1e12}
        # The engine generates again after the update (woken from sleep, with the new weights).
        results[algo]["tokens_after_update"] = generation_throughput(t, rollouts[:4], 8)["tokens"]
        assert results[algo]["tokens_after_update"] > 0
        # The engine's memory back before the next method's engine is sized. Over several ranks
        # vLLM's shutdown would also tear down the process group it shares with lopd: there the
        # engine stays, asleep where rollout.vllm_sleep is on.
        if args.engine == "vllm" and t.world.enabled:
            t.engine.sleep()
        elif args.engine == "vllm":
            t.engine.close()
        del t
        if device.type == "cuda":
            torch.cuda.empty_cache()
    peak = args.peak_tflops if args.peak_tflops is not None else (989.0 if device.type == "cuda" else None)
    for r in results.values():
        r["mfu"] = r["student_update_tflops"] / peak if peak else None
    return {"architecture": args.model or args.architecture, "parameters": params, "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "precision": precision, "rollouts": len(rollouts), "tokens": real_tokens,
            "action_tokens": action_tokens, "micro_batch": args.micro_batch,
            "loss_chunk_tokens": args.loss_chunk_tokens, "vocab_size": reduce.get("vocab_size"),
            "model_build_seconds": round(build_seconds, 1), "peak_tflops": peak,
            "parallel": args.parallel, "engine": args.engine, "generation": generation,
            **({"vllm": engine} if args.engine == "vllm" else {}), **results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--architecture", default="qwen3-4b", choices=sorted(models.REAL_SHAPES))
    parser.add_argument("--width", type=int, help="reduce the hidden width to this (CPU runs)")
    parser.add_argument("--layers", type=int, help="reduce the decoder layers to this")
    parser.add_argument("--vocab", type=int, help="vocabulary rows (default: the shape's)")
    parser.add_argument("--rollouts", type=int, default=32, help="rollouts in the batch (4 per task)")
    parser.add_argument("--micro-batch", type=int, default=4, help="train.per_device_train_batch_size")
    parser.add_argument("--loss-chunk-tokens", type=int, default=1024,
                        help="train.loss_chunk_tokens (0: all of a micro-batch at once)")
    parser.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--latents", type=int, default=32, help="composer K")
    parser.add_argument("--composer-heads", type=int,
                        help="composer.num_heads (default: 4; the model's own heads with --model)")
    parser.add_argument("--model", help="a prepared model folder: real weights and tokenizer "
                        "instead of a random model of --architecture's shape (--width, --layers, "
                        "--vocab do not apply)")
    parser.add_argument("--steps", type=int, default=2, help="steps per method; the last is reported")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--engine", default="transformers", choices=["transformers", "vllm"],
                        help="rollout.engine for the generation throughput and weight pushes")
    parser.add_argument("--vllm-sleep", action=argparse.BooleanOptionalAction, default=False,
                        help="rollout.vllm_sleep: vLLM sleeps during each update (CUDA only)")
    parser.add_argument("--vllm-memory", default="auto",
                        help="rollout.vllm_gpu_memory_utilization: 'auto' or a share of the GPU")
    parser.add_argument("--parallel", default="ddp", choices=["ddp", "fsdp2"],
                        help="train.parallel; takes effect under torchrun (one process is enough)")
    parser.add_argument("--new-tokens", type=int, default=64,
                        help="tokens sampled per prompt for the generation throughput")
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16-mixed"])
    parser.add_argument("--peak-tflops", type=float, help="the device's peak, for MFU")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    if args.rollouts % 4:
        parser.error("--rollouts must be a multiple of 4")
    out = run(args)
    rows = [[p, *(round(out[a][p], 3) for a in ("grpo", "lopd"))] for p in (*PHASES, "seconds")]
    rows += [["tokens/s", *(round(out[a]["tokens_per_second"]) for a in ("grpo", "lopd"))],
             ["peak step memory GiB", *(round(out[a]["peak_memory_gb"], 2) for a in ("grpo", "lopd"))],
             ["student update TFLOP/s", *(round(out[a]["student_update_tflops"], 3)
                                          for a in ("grpo", "lopd"))]]
    rows.append(["generation tokens/s", round(out["generation"]["tokens_per_second"]), ""])
    if "vllm" in out:
        rows.append(["vLLM dtype, GPU share, sleep", f"{out['vllm']['dtype']}, "
                     f"{out['vllm']['gpu_memory_utilization']}, {out['vllm']['sleep']}", ""])
    if out["peak_tflops"]:
        rows.append(["MFU (student update)", *(f"{out[a]['mfu']:.1%}" for a in ("grpo", "lopd"))])
    print(format_table(["phase (s)", "GRPO", "LOPD"], rows,
                       title=f"{out['architecture']} ({out['parameters']:,} parameters) on "
                       f"{out['device_name']}, {out['precision']}, {out['rollouts']} rollouts, "
                       f"{out['tokens']} tokens ({out['action_tokens']} action), micro-batch "
                       f"{out['micro_batch']}, engine {out['engine']}, {out['parallel']}"))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
