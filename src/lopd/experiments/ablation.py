"""An ablation: arms of one method that differ only in named settings, each trained for several seeds.

Every arm is the same config plus its own ``--set`` values (and ``run.seed``); runs live in
``OUT/ARM/seedS`` and are reused or resumed (:mod:`lopd.experiments.runs`), so an interrupted
ablation continues where it stopped. What is read back, per arm, is the final held-out (or
validation, with ``train.eval_split=validation``) mean reward and success rate over seeds, and the
per-step trajectory of each tracked metric (``delta``, ``beta``, ...) averaged over seeds.

Outputs in ``OUT``: ``results.json`` (every figure per seed), ``results.md`` (the table, with each
arm's settings) and ``ablation.png`` (one panel per tracked metric against training rollouts, seed
mean with the min-max band, then the final reward per arm with each seed's point and the step-0
evaluation as a dashed line).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from lopd.config import load_config
from lopd.experiments.runs import check_reusable, read_evals, train_or_reuse
from lopd.trainer import METRICS_FILE, read_jsonl


def parse_arm(text: str) -> tuple[str, list[str]]:
    """``NAME:SECTION.KEY=VALUE[,SECTION.KEY=VALUE...]`` as (name, settings)."""
    name, sep, rest = text.partition(":")
    sets = [s.strip() for s in rest.split(",") if s.strip()]
    if not sep or not name.strip() or not sets or any("=" not in s for s in sets):
        raise ValueError(f"--arm {text!r}: expected NAME:SECTION.KEY=VALUE[,SECTION.KEY=VALUE...], "
                         "e.g. success:lopd.margin_weight=success")
    return name.strip(), sets


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.pstdev(values) if len(values) > 1 else 0.0


def ablation(config: str | Path, overrides: list[str], algo: str, arms: dict[str, list[str]],
             seeds: int, out: Path, track: list[str], jobs: int = 1, isolate: bool = False) -> dict:
    """See the module docstring; ``jobs`` > 1 trains that many runs at once in subprocesses, and
    ``isolate`` every run in a subprocess of its own even one at a time."""
    report = train_arms(config, overrides, algo, arms, seeds, out, track, jobs, isolate)
    (out / "results.json").write_text(json.dumps(report, indent=1))
    (out / "results.md").write_text(markdown(report, track))
    plot(report, track, out / "ablation.png")
    return report


def train_arms(config: str | Path, overrides: list[str], algo: str, arms: dict[str, list[str]],
               seeds: int, out: Path, track: list[str], jobs: int = 1,
               isolate: bool = False) -> dict:
    """Train (or reuse) every arm × seed in ``OUT/ARM/seedS`` and read the runs back: the report
    :func:`ablation` writes, without writing it. An arm's settings may be empty (the config as
    given). Each arm's row also holds every seed's held-out curve (``evals``: generations and
    mean reward per evaluation)."""
    from lopd.experiments.compare import _train_in_parallel

    if len(arms) < 1:
        raise ValueError("an ablation needs at least one --arm")
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    configs = {(arm, seed): load_config(config, [*overrides, *sets, f"train.algorithm={algo}",
                                                 f"run.seed={seed}"])
               for arm, sets in arms.items() for seed in range(seeds)}  # bad keys fail here
    out.mkdir(parents=True, exist_ok=True)
    for (arm, seed), cfg in configs.items():
        check_reusable(cfg, out / arm / f"seed{seed}")
    if jobs > 1 or isolate:
        _train_in_parallel([(cfg, out / arm / f"seed{seed}", algo)
                            for (arm, seed), cfg in configs.items()], jobs)
    per_arm = {}
    for arm, sets in arms.items():
        finals, starts, curves = [], [], {key: [] for key in track}
        for seed in range(seeds):
            run_dir = out / arm / f"seed{seed}"
            train_or_reuse(configs[arm, seed], run_dir, algo)
            evals = read_evals(run_dir)
            finals.append(evals[-1])
            starts.append(evals[0]["mean_reward"])
            metrics = [r for r in read_jsonl(run_dir / METRICS_FILE) if r["step"] > 0]
            for key in track:
                curves[key].append([(r["generations"], r[key]) for r in metrics if key in r])
        per_arm[arm] = {
            "settings": sets,
            "mean_reward": [f["mean_reward"] for f in finals],
            "success_rate": [f["success_rate"] for f in finals],
            "generations": finals[0]["generations"],
            "start_reward": starts,
            "tracked": {key: _seed_mean(curves[key]) for key in track},
            "tracked_final": {key: [c[-1][1] for c in curves[key] if c] for key in track},
            "evals": [[{"generations": r["generations"], "mean_reward": r["mean_reward"]}
                       for r in read_evals(out / arm / f"seed{seed}")] for seed in range(seeds)],
        }
    split = configs[next(iter(configs))].train.eval_split
    return {"algo": algo, "seeds": seeds, "split": split, "config": str(config),
            "overrides": overrides, "arms": per_arm}


def _seed_mean(curves: list[list[tuple[int, float]]]) -> list[dict]:
    """Per step: generations, seed mean, min and max (all seeds share the schedule)."""
    length = min((len(c) for c in curves), default=0)
    rows = []
    for i in range(length):
        values = [c[i][1] for c in curves]
        rows.append({"generations": curves[0][i][0], "mean": statistics.fmean(values),
                     "min": min(values), "max": max(values)})
    return rows


def markdown(report: dict, track: list[str]) -> str:
    where = "validation" if report["split"] == "validation" else "held-out"
    head = ["arm", "settings", f"{where} mean reward", f"{where} success rate", "rollouts",
            *(f"{key}: first → last (seed mean)" for key in track)]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for arm, row in report["arms"].items():
        (rm, rs), (sm, ss) = _mean_std(row["mean_reward"]), _mean_std(row["success_rate"])
        cells = [arm, ", ".join(f"`{s}`" for s in row["settings"]), f"{rm:.4f} ± {rs:.4f}",
                 f"{sm:.4f} ± {ss:.4f}", str(row["generations"])]
        for key in track:
            curve = row["tracked"][key]
            cells.append(f"{curve[0]['mean']:.4g} → {curve[-1]['mean']:.4g}" if curve else "-")
        lines.append("| " + " | ".join(cells) + " |")
    start = next(iter(report["arms"].values()))["start_reward"][0]
    lines.append("")
    lines.append(f"{report['algo']}; mean ± population std over {report['seeds']} seeds "
                 f"(run.seed 0..{report['seeds'] - 1}); evaluation on the {report['split']} split; "
                 f"before training (step 0) the mean reward is {start:.4f}.")
    return "\n".join(lines) + "\n"


def plot(report: dict, track: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = report["arms"]
    fig, axes = plt.subplots(1, len(track) + 1, figsize=(4.4 * (len(track) + 1), 3.6),
                             squeeze=False)
    for ax, key in zip(axes[0], track):
        for arm, row in arms.items():
            curve = row["tracked"][key]
            if not curve:
                continue
            xs = [p["generations"] for p in curve]
            ax.plot(xs, [p["mean"] for p in curve], label=arm)
            ax.fill_between(xs, [p["min"] for p in curve], [p["max"] for p in curve], alpha=0.2)
        ax.set_title(key)
        ax.set_xlabel("training rollouts")
        ax.legend(fontsize=7)
    ax = axes[0][-1]
    for i, (arm, row) in enumerate(arms.items()):
        ax.bar(i, statistics.fmean(row["mean_reward"]), alpha=0.5)
        ax.scatter([i] * len(row["mean_reward"]), row["mean_reward"], color="k", s=10, zorder=3)
    ax.set_xticks(range(len(arms)), list(arms), rotation=20, fontsize=8)
    start = next(iter(arms.values()))["start_reward"][0]
    ax.axhline(start, color="grey", ls="--", lw=1, label="before training (step 0)")
    ax.legend(fontsize=7)
    values = [start, *(v for row in arms.values() for v in row["mean_reward"])]
    pad = max(0.01, (max(values) - min(values)) * 0.5)
    ax.set_ylim(min(values) - pad, max(values) + pad)
    where = "validation" if report["split"] == "validation" else "held-out"
    ax.set_title(f"final {where} mean reward (bar: seed mean)")
    fig.suptitle(f"{report['algo']} ablation, {report['seeds']} seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
