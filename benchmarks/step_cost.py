"""The cost of one training step of every method, measured side by side in one process.

    python benchmarks/step_cost.py --steps 6 --json runs/step_cost.json

One trainer per method (GRPO, LOPD and the four self-distillation baselines) on the same config,
base, task stream and ``train.rollouts_per_step``; their steps are interleaved (step 1 of every
method, then step 2, ...), so a machine that slows down or speeds up does so for all of them alike.
Step 1 is warm-up and not counted. For each method: min / median / max seconds of the measured
steps, the median of each phase (rollout, before the step — retrieval, contexts —, student
forward, teacher pass — for LOPD with its parts, the composer's Z_φ and the anchor's Z_φ0 —,
backward, optimiser, after the update — dual variable, bank add, EMA), and
the largest resident memory seen at the end of its steps (one process holds every trainer, so this
is the process's, not the method's; on a GPU the method's own peak CUDA allocation is given). The
LOPD/GRPO ratio of the medians is printed last.

LOPD uses the embedded cold-started composer and bank (``--composer``/``--bank`` for others); on a
real model (``--model DIR``, e.g. the SmolLM2 folder ``make smollm2`` prepares, on the
``smollm2-135m`` preset) an untrained composer over the model itself and a bank of one oracle
episode per training task, built first: the step's cost, not its learning, is measured. SDFT
and OPSD read the environment's oracle; no evaluation or checkpoint is made.

    python benchmarks/step_cost.py --model runs/models/smollm2-135m --methods grpo,lopd
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lopd import agent, policies, runtime, stages
from lopd.algorithms import get_algorithm
from lopd.algorithms.base import StepBatch
from lopd.composer import Composer
from lopd.config import load_config
from lopd.embedding import EmbedderSpec, load_embedder
from lopd.experience import ExperienceBank
from lopd.tables import format_table, write_json
from lopd.trainer import Trainer, step_seed

METHODS = ("grpo", "lopd", "sdft", "opsd", "sdpo", "skill_sd")
PHASES = ("rollout", "before_step", "student_forward", "teacher", "composer", "anchor", "backward",
          "optimizer", "after_update")


def resident_mb() -> float:
    """The process's resident memory now, in MiB."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096 / 2**20


def one_step(trainer: Trainer, step: int) -> dict:
    """One training step of ``trainer``, as its loop runs it, without evaluation or checkpoint."""
    cfg = trainer.cfg
    seed = step_seed(cfg.run.seed, step)
    runtime.set_seed(seed)
    tasks = trainer.step_tasks(step)
    device = trainer.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    rollouts = trainer.rollouts(tasks, cfg.rollout.temperature, seed)
    rollout = time.perf_counter() - started
    trainer.ctx.student.train()
    figures = trainer.algorithm.step(StepBatch(step, tasks, rollouts))
    stages.sync_engine(trainer.engine, trainer.ctx.student)
    record = {"time/step": time.perf_counter() - started, "time/rollout": rollout,
              **{k: v for k, v in figures.items() if k.startswith("time/")},
              "memory/resident_mb": resident_mb()}
    if device.type == "cuda":
        record["memory/cuda_peak_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return record


def lopd_inputs(cfg, work: Path) -> tuple[Path, Path]:
    """(composer, bank) for LOPD: the embedded cold-started ones for the embedded 1M model;
    otherwise, as gpu_check.py builds them, an untrained composer over the model itself (seed 0)
    and a bank of one oracle episode per training task."""
    if (cfg.model.name_or_path, cfg.env.name) == stages.EMBEDDED_FOR:
        return stages.embedded_assets(cfg)
    env = stages.get_env(cfg)
    tasks = env.tasks("train")
    base, tokenizer = stages.load_model(cfg, device=torch.device("cpu"))
    gold = agent.run_episodes(env, tasks, policies.OraclePolicy(), tokenizer, 8, 96, len(tasks))
    embedder = load_embedder(EmbedderSpec(kind=cfg.bank.embedder), device=torch.device("cpu"))
    with ExperienceBank.create(work / "bank", embedder) as bank:
        bank.add_rollouts(gold, {t.task_id: t for t in tasks}, source="oracle")
    torch.manual_seed(0)
    Composer(base, tokenizer, cfg.composer).save(work / "composer")
    return work / "composer", work / "bank"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="steps per method (the first is "
                        "warm-up)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--model", help="a prepared real model folder (e.g. the one `make smollm2` "
                        "writes); the config then defaults to smollm2-135m")
    parser.add_argument("--config", help="the preset (default: tiny; smollm2-135m with --model)")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--composer", help="LOPD's composer (default: the embedded one)")
    parser.add_argument("--bank", help="LOPD's bank (default: the embedded one)")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if args.steps < 6:
        parser.error("--steps must be >= 6: one warm-up step and at least five measured")
    unknown = [m for m in methods if m not in METHODS]
    if unknown or "grpo" not in methods or "lopd" not in methods:
        parser.error(f"--methods: choose from {','.join(METHODS)}, grpo and lopd included")

    args.config = args.config or ("smollm2-135m" if args.model else "tiny")
    if args.model:
        args.overrides = [f"model.name_or_path={args.model}", *args.overrides]
    cfg = load_config(args.config, args.overrides)
    records: dict[str, list[dict]] = {m: [] for m in methods}
    with tempfile.TemporaryDirectory() as tmp:
        composer, bank = (args.composer, args.bank) if args.composer and args.bank else \
            lopd_inputs(cfg, Path(tmp))
        sets = [*args.overrides, f"lopd.composer={composer}", f"lopd.bank={bank}",
                f"train.max_steps={args.steps}"]
        trainers = {m: Trainer(load_config(args.config, [*sets, f"train.algorithm={m}"]),
                               Path(tmp) / m, get_algorithm(m), progress=False)
                    for m in methods}
        for step in range(1, args.steps + 1):
            for method, trainer in trainers.items():
                record = one_step(trainer, step)
                if step > 1:
                    records[method].append(record)
                print(f"step {step} {method}: {record['time/step']:.2f} s", flush=True)
        device = str(next(iter(trainers.values())).device)
    summary = {}
    for method, steps in records.items():
        times = [r["time/step"] for r in steps]
        summary[method] = {
            "min": min(times), "median": statistics.median(times), "max": max(times),
            "phases": {p: statistics.median(r.get(f"time/{p}", 0.0) for r in steps)
                       for p in PHASES},
            "resident_mb": max(r["memory/resident_mb"] for r in steps),
            **({"cuda_peak_mb": max(r["memory/cuda_peak_mb"] for r in steps)}
               if "memory/cuda_peak_mb" in steps[0] else {})}
    rows = [[m, s["min"], s["median"], s["max"], *(s["phases"][p] for p in PHASES),
             s.get("cuda_peak_mb", s["resident_mb"])] for m, s in summary.items()]
    memory = "CUDA peak MiB" if device.startswith("cuda") else "resident MiB (process)"
    print(format_table(["method", "min s", "median s", "max s", *PHASES, memory], rows,
                       title=f"one step of each method on {device}: "
                       f"{cfg.train.rollouts_per_step} rollouts, steps 2-{args.steps} "
                       f"interleaved, {torch.get_num_threads()} thread(s); phases: medians"))
    ratio = summary["lopd"]["median"] / summary["grpo"]["median"]
    print(f"\nLOPD/GRPO step time (medians): {ratio:.2f}")
    write_json(args.json_path, {"device": device, "steps": args.steps,
                                "rollouts_per_step": cfg.train.rollouts_per_step,
                                "methods": summary, "lopd_over_grpo": ratio,
                                "per_step": records})


if __name__ == "__main__":
    main()
