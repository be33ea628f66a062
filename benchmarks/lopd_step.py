"""Where the time of one LOPD step goes, and the peak memory.

Runs ``--steps`` LOPD steps of the real trainer (``train.rollouts_per_step`` rollouts each) on the
embedded tiny base, then prints the mean seconds per phase of the shared step
(:mod:`lopd.algorithms.base`) — rollout, before the step (retrieval), student forward, teacher pass
(the composer encodes φ and φ0, the frozen teacher reads the latents), backward (student and
composer in one pass), optimiser steps, after the update (dual variable, bank add) — over the steps
after the first (warm-up), their share of the step, and the peak resident memory (and peak CUDA
allocation on a GPU).

Without ``--bank``/``--composer`` it builds its own inputs first: a bank of oracle successes on
``--bank-tasks`` training tasks and an untrained composer (the timing of a step does not depend on
what φ has learned). Set-up time is not counted.

    python benchmarks/lopd_step.py --steps 4 --json runs/lopd_step.json
    python benchmarks/lopd_step.py --bank runs/bank-tiny --composer runs/composer-tiny
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from lopd import pipeline, stages
from lopd.algorithms import get_algorithm
from lopd.composer import Composer
from lopd.config import load_config
from lopd.tables import format_table, write_json
from lopd.trainer import METRICS_FILE, Trainer

PHASES = ("rollout", "before_step", "student_forward", "teacher", "backward", "optimizer",
          "after_update")


def build_inputs(cfg, folder: Path, n_tasks: int) -> tuple[Path, Path]:
    pipeline.build_bank(cfg, folder / "bank", agent="oracle", limit=n_tasks, progress=False)
    model, tokenizer = stages.load_model(cfg)
    Composer(model, tokenizer, cfg.composer).save(folder / "composer")
    return folder / "bank", folder / "composer"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="LOPD steps (the first is warm-up)")
    parser.add_argument("--bank", help="experience bank folder (default: built here)")
    parser.add_argument("--composer", help="composer folder (default: an untrained one)")
    parser.add_argument("--bank-tasks", type=int, default=300,
                        help="training tasks whose oracle successes fill the bank built here")
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step is warm-up)")

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cfg = load_config(args.config, args.overrides)
        if args.bank and args.composer:
            bank, composer = Path(args.bank), Path(args.composer)
        else:
            bank, composer = build_inputs(cfg, tmp, args.bank_tasks)
        cfg = load_config(args.config, [*args.overrides, f"lopd.bank={bank}",
                                        f"lopd.composer={composer}", f"train.max_steps={args.steps}",
                                        f"train.eval_every={args.steps + 1}",
                                        f"train.save_every={args.steps + 1}", "train.eval_tasks=1"])
        trainer = Trainer(cfg, tmp / "run", get_algorithm("lopd"))
        trainer.run()
        records = [json.loads(line) for line in (tmp / "run" / METRICS_FILE).read_text().splitlines()]
    steps = [r for r in records if r["step"] >= 2]
    mean = {phase: sum(r[f"time/{phase}"] for r in steps) / len(steps) for phase in PHASES}
    step_time = sum(r["time/step"] for r in steps) / len(steps)
    rows = [[phase, seconds, 100 * seconds / step_time] for phase, seconds in mean.items()]
    rows.append(["whole step", step_time, 100.0])
    device = trainer.device
    memory = {k: v for k, v in records[-1].items() if k.startswith("memory/")}
    print(format_table(["phase", "seconds", "% of step"], rows,
                       title=f"LOPD step on {device} ({cfg.train.rollouts_per_step} rollouts, "
                       f"K={cfg.composer.num_latents}, n_ret={cfg.bank.n_ret}, mean of steps 2-{args.steps}, "
                       f"{torch.get_num_threads()} thread(s))"))
    print()
    print(format_table(["memory", "MiB"], [[k.split("/")[1], v] for k, v in memory.items()]))
    write_json(args.json_path, {"device": str(device), "rollouts_per_step": cfg.train.rollouts_per_step,
                                "seconds": mean, "step_seconds": step_time,
                                "action_tokens": sum(r["action_tokens"] for r in steps) / len(steps),
                                **memory})


if __name__ == "__main__":
    main()
