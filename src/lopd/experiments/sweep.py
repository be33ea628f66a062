"""The fair-tuning sweep: one run per learning rate, judged on training tasks held out as validation.

Each run trains ``steps`` steps and is evaluated only at its end on the last ``validation_tasks``
training tasks (``train.eval_split=validation``: they are left out of training), never on the eval
split; the best final validation mean reward wins. Give every algorithm of a comparison the same
grid, steps and validation tasks. Runs live in ``OUT/ALGO-lrRATE`` and are reused or resumed; the
table is written to ``OUT/sweep-ALGO.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

from lopd.config import load_config
from lopd.experiments.runs import read_evals, train_or_reuse


def sweep(config: str | Path, overrides: list[str], algo: str, learning_rates: list[float],
          steps: int, validation_tasks: int, out: Path) -> dict:
    """See the module docstring; returns the runs' final validation figures and the best rate."""
    if not learning_rates:
        raise ValueError("a sweep needs at least one learning rate")
    load_config(config, [*overrides, f"train.algorithm={algo}"])  # a bad key fails before any run
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for rate in learning_rates:
        sets = [*overrides, f"train.algorithm={algo}", f"train.learning_rate={rate}",
                f"train.max_steps={steps}", f"train.eval_every={steps}", "train.eval_at_start=false",
                "train.eval_split=validation", f"train.eval_tasks={validation_tasks}"]
        cfg = load_config(config, sets)
        run_dir = out / f"{algo}-lr{rate:g}"
        train_or_reuse(cfg, run_dir, algo)
        final = read_evals(run_dir)[-1]
        rows.append({"learning_rate": rate, "validation_mean_reward": final["mean_reward"],
                     "validation_success_rate": final["success_rate"]})
    best = max(rows, key=lambda r: r["validation_mean_reward"])
    report = {"algo": algo, "steps": steps, "validation_tasks": validation_tasks, "runs": rows,
              "best_learning_rate": best["learning_rate"]}
    (out / f"sweep-{algo}.json").write_text(json.dumps(report, indent=1))
    return report
