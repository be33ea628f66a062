"""Methods side by side: every algorithm × seed on the same task stream, budget and evaluation.

``base`` is the untrained model, evaluated once on the held-out tasks (evaluation is greedy, so
every seed gives the same figure; its spread is 0 by construction). Every other algorithm trains
one run per seed in ``OUT/ALGO/seedS`` with the same config apart from ``run.seed`` and
``train.algorithm`` (and a per-algorithm learning rate when given); finished runs are reused and
interrupted ones resumed, so an interrupted compare continues where it stopped.

Outputs in ``OUT``: ``results.json``, ``results.md`` (final held-out mean reward and success rate,
mean ± std over seeds) and ``reward_vs_generations.png`` (held-out reward against rollouts used,
mean over seeds with the min-max band). The *rollout ratio* is the generations LOPD needs before its
seed-mean held-out reward first reaches GRPO's final seed-mean, divided by GRPO's total generations
(the paper reports < 0.30); it is None when LOPD never reaches it.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from lopd import pipeline
from lopd.config import Config, load_config
from lopd.experiments.runs import check_reusable, finished, read_evals, train_or_reuse
from lopd.trainer import checkpoints, write_config

BASE = "base"
"""The untrained model's row of a comparison (no training)."""


def check_algos(algos: list[str], allowed: list[str] | None = None) -> None:
    """Refuse an empty list or a name that is neither ``base`` nor a registered method."""
    from lopd.algorithms import algorithm_names

    allowed = sorted({BASE, *algorithm_names()}) if allowed is None else sorted(allowed)
    unknown = [a for a in algos if a not in allowed]
    if not algos or unknown:
        raise ValueError(f"algorithms {','.join(algos) or '(none)'}: choose from {allowed}")


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.pstdev(values) if len(values) > 1 else 0.0


def _train_in_parallel(jobs: list[tuple[Config, Path, str]], workers: int) -> None:
    """Run the unfinished ``(config, run_dir, algo)`` jobs as ``lopd train`` processes, ``workers``
    at a time (each with the config's thread count); a failed run stops the comparison."""
    import shutil
    import subprocess
    import sys
    import tempfile
    import time

    pending = []
    for cfg, run_dir, algo in jobs:
        check_reusable(cfg, run_dir)
        if not finished(run_dir, cfg.train.max_steps):
            pending.append((cfg, run_dir, algo))
    running: list[tuple[subprocess.Popen, Path, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        while pending or running:
            while pending and len(running) < workers:
                cfg, run_dir, algo = pending.pop(0)
                run_dir.parent.mkdir(parents=True, exist_ok=True)
                if checkpoints(run_dir):
                    args = ["--resume", str(run_dir)]
                else:  # stopped before its first checkpoint: nothing to resume
                    shutil.rmtree(run_dir, ignore_errors=True)
                    config = Path(tmp) / f"{algo}-{run_dir.name}.yaml"
                    write_config(cfg, config)
                    args = ["--config", str(config), "--out", str(run_dir), "--algo", algo]
                log = open(run_dir.parent / f"{run_dir.name}.log", "w")
                proc = subprocess.Popen([sys.executable, "-m", "lopd", "train", *args],
                                        stdout=log, stderr=subprocess.STDOUT)
                running.append((proc, run_dir, log))
            time.sleep(1.0)
            for item in list(running):
                proc, run_dir, log = item
                if proc.poll() is None:
                    continue
                log.close()
                running.remove(item)
                if proc.returncode != 0:
                    for other, _, other_log in running:
                        other.kill()
                        other_log.close()
                    raise RuntimeError(f"training {run_dir} failed (exit {proc.returncode}); see "
                                       f"{run_dir.parent / (run_dir.name + '.log')}")


def run_config(config: str | Path, overrides: list[str], algo: str, seed: int,
               learning_rates: dict[str, float]) -> Config:
    sets = [*overrides, f"run.seed={seed}", f"train.algorithm={algo}"]
    if algo in learning_rates:
        sets.append(f"train.learning_rate={learning_rates[algo]}")
    return load_config(config, sets)


def evaluate_base(cfg: Config, out: Path) -> dict:
    """Held-out evaluation of the untrained model (cached in ``out/base/eval.json``)."""
    from lopd import runtime

    path = out / BASE / "eval.json"
    if path.exists():
        return json.loads(path.read_text())
    device = runtime.setup(cfg.run)
    env = pipeline.get_env(cfg)
    policy, tokenizer = pipeline.make_policy(cfg, "model", device=device)
    summary, _ = pipeline.evaluate(cfg, env, pipeline.held_out_tasks(cfg, env)[1], policy,
                                   tokenizer)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1))
    return summary


def compare(config: str | Path, overrides: list[str], algos: list[str], seeds: int, out: Path,
            learning_rates: dict[str, float] | None = None, jobs: int = 1) -> dict:
    """See the module docstring; ``jobs`` > 1 trains that many runs at once in subprocesses."""
    check_algos(algos)
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    load_config(config, overrides)  # a bad key fails before any run starts
    learning_rates = learning_rates or {}
    out.mkdir(parents=True, exist_ok=True)
    if jobs > 1:
        _train_in_parallel([(run_config(config, overrides, algo, seed, learning_rates),
                             out / algo / f"seed{seed}", algo)
                            for algo in algos if algo != BASE for seed in range(seeds)], jobs)
    results: dict[str, dict] = {}
    curves: dict[str, list[list[dict]]] = {}
    for algo in algos:
        if algo == BASE:
            summary = evaluate_base(run_config(config, overrides, "lopd", 0, {}), out)
            results[BASE] = {"mean_reward": [summary["mean_reward"]] * seeds,
                             "success_rate": [summary["success_rate"]] * seeds,
                             "generations": 0}
            continue
        per_seed = []
        for seed in range(seeds):
            cfg = run_config(config, overrides, algo, seed, learning_rates)
            run_dir = out / algo / f"seed{seed}"
            train_or_reuse(cfg, run_dir, algo)
            per_seed.append(read_evals(run_dir))
        curves[algo] = per_seed
        finals = [evals[-1] for evals in per_seed]
        results[algo] = {"mean_reward": [f["mean_reward"] for f in finals],
                         "success_rate": [f["success_rate"] for f in finals],
                         "generations": finals[0]["generations"],
                         "learning_rate": run_config(config, overrides, algo, 0,
                                                     learning_rates).train.learning_rate}
    table = {algo: {"mean_reward": _mean_std(r["mean_reward"]),
                    "success_rate": _mean_std(r["success_rate"]),
                    "generations": r["generations"], "learning_rate": r.get("learning_rate")}
             for algo, r in results.items()}
    ratio = rollout_ratio(curves)
    report = {"seeds": seeds, "algos": algos, "per_seed": results, "summary": table,
              "rollout_ratio": ratio, "config": str(config), "overrides": overrides}
    (out / "results.json").write_text(json.dumps(report, indent=1))
    (out / "results.md").write_text(markdown(table, seeds, ratio))
    plot(curves, results, out / "reward_vs_generations.png")
    return report


def _mean_curve(per_seed: list[list[dict]]) -> list[tuple[int, float]]:
    """Seed-mean held-out reward at each evaluation (all seeds share the schedule)."""
    length = min(len(evals) for evals in per_seed)
    return [(per_seed[0][i]["generations"],
             statistics.fmean(evals[i]["mean_reward"] for evals in per_seed)) for i in range(length)]


def rollout_ratio(curves: dict[str, list[list[dict]]]) -> float | None:
    if "lopd" not in curves or "grpo" not in curves:
        return None
    grpo = _mean_curve(curves["grpo"])
    target, total = grpo[-1][1], grpo[-1][0]
    for generations, reward in _mean_curve(curves["lopd"]):
        if reward >= target:
            return generations / total
    return None


def markdown(table: dict, seeds: int, ratio: float | None) -> str:
    lines = ["| method | held-out mean reward | held-out success rate | rollouts | lr |",
             "| --- | --- | --- | --- | --- |"]
    for algo, row in table.items():
        (rm, rs), (sm, ss) = row["mean_reward"], row["success_rate"]
        lr = f"{row['learning_rate']:g}" if row["learning_rate"] else "-"
        lines.append(f"| {algo} | {rm:.4f} ± {rs:.4f} | {sm:.4f} ± {ss:.4f} | "
                     f"{row['generations']} | {lr} |")
    lines.append("")
    lines.append(f"Mean ± population std over {seeds} seeds (base: greedy, identical per seed).")
    if ratio is not None:
        lines.append(f"Rollout ratio (LOPD generations to reach GRPO's final reward / GRPO's "
                     f"generations): {ratio:.3f}")
    else:
        lines.append("Rollout ratio: not defined (LOPD never reached GRPO's final reward, or one "
                     "of them was not run).")
    return "\n".join(lines) + "\n"


def plot(curves: dict[str, list[list[dict]]], results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for algo, per_seed in curves.items():
        length = min(len(e) for e in per_seed)
        xs = [per_seed[0][i]["generations"] for i in range(length)]
        values = [[e[i]["mean_reward"] for e in per_seed] for i in range(length)]
        ax.plot(xs, [statistics.fmean(v) for v in values], marker="o", ms=3, label=algo)
        ax.fill_between(xs, [min(v) for v in values], [max(v) for v in values], alpha=0.2)
    if BASE in results:
        ax.axhline(results[BASE]["mean_reward"][0], color="grey", ls="--", label="base")
    ax.set_xlabel("generations (training rollouts)")
    ax.set_ylabel("held-out mean reward")
    ax.set_title("held-out reward vs. rollouts (mean over seeds, min-max band)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
