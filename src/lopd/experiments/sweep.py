"""The fair-tuning sweep: one run per learning rate, judged on training tasks held out as validation.

Each run trains ``steps`` steps and is evaluated only at its end on the last ``validation_tasks``
training tasks (``train.eval_split=validation``: they are left out of training), never on the eval
split; the best final validation mean reward wins, and of rates that tie on it the first listed
(the report names every tied rate: two runs that collapse to the same policy tie exactly). Give
every algorithm of a comparison the same grid, steps and validation tasks. Runs live in
``OUT/ALGO-lrRATE`` and are reused or resumed; the table is written to ``OUT/sweep-ALGO.json``.
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
    best, tied = best_rate(rows)
    report = {"algo": algo, "steps": steps, "validation_tasks": validation_tasks, "runs": rows,
              "best_learning_rate": best, "tied_learning_rates": tied}
    (out / f"sweep-{algo}.json").write_text(json.dumps(report, indent=1))
    return report


def best_rate(rows: list[dict]) -> tuple[float, list[float]]:
    """The rate with the highest ``validation_mean_reward`` (the first listed on a tie) and, where
    more than one rate reaches that score, every such rate in grid order (else an empty list)."""
    top = max(r["validation_mean_reward"] for r in rows)
    tied = [r["learning_rate"] for r in rows if r["validation_mean_reward"] == top]
    return tied[0], tied if len(tied) > 1 else []
