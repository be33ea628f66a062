"""Methods side by side: every algorithm × seed on the same task stream, budget and evaluation.

``base`` is the untrained model, evaluated once on the held-out tasks (evaluation is greedy, so
every seed gives the same figure; its spread is 0 by construction). Every other algorithm trains
one run per seed in ``OUT/ALGO/seedS`` with the same config apart from ``run.seed`` and
``train.algorithm`` (and a per-algorithm learning rate when given); finished runs are reused and
interrupted ones resumed, so an interrupted compare continues where it stopped.

Every rollout is charged (DESIGN §3b): a method's *training rollouts* are the generations its
training loop sampled; its *setup rollouts* are those it consumed before training (LOPD: the
bank-building rollouts and any cold-start sampling; GRPO: none), read from its eval records (0 for
runs written before they carried the field) and the same for every seed (if not, the largest is
charged and ``results.json`` says so); *charged* is their sum.

Outputs in ``OUT``: ``results.json`` (also each seed's final mean reward per domain),
``results.md`` (final held-out mean reward and success rate, mean ± population std over seeds, and
the three rollout counts) and ``reward_vs_generations.png``
(held-out reward, mean over seeds with the min-max band, against training rollouts on the left and
against charged rollouts on the right, where each curve starts at its setup rollouts).

The *rollout ratio* (the paper reports < 0.30) compares LOPD with GRPO at GRPO's final seed-mean
held-out reward. LOPD's *crossing* is the training rollouts at which its seed-mean curve first
reaches that reward, interpolated linearly between the two evaluations that bracket it (a single
noisy seed touching it does not count). It is reported two ways: training rollouts only, crossing /
GRPO's training rollouts; and with setup, (LOPD's setup + crossing) / (GRPO's setup + training
rollouts). Both are None when LOPD never reaches the reward or one of the two methods was not run.

``transfer`` names other environments (e.g. ``humaneval`` after training on codeworld): the base
and every run's final student are also scored, greedy, on each one's eval split (pass@1 for code
environments, mean reward otherwise) and the table gains a column per environment. The scores are
cached next to each run (``transfer-ENV.json``), so a re-run only scores what is new;
``transfer_tasks`` scores only the first that many tasks of each (BFCL's 800 multi-turn tasks take
hours per model on a CPU). A finished run whose records were copied without its checkpoints is
reused with its cached transfer scores.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from lopd import stages
from lopd.config import Config, load_config
from lopd.experiments.runs import (
    check_reusable,
    finished,
    read_evals,
    setup_generations,
    train_or_reuse,
)
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
    at a time (each with the config's thread count); a failed run stops the comparison. Several
    workers write to a log beside each run (``seedS.log``); one worker's run prints to the
    console, so its progress shows as an in-process run's would."""
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
                command = [sys.executable, "-m", "lopd", "train", *args]
                if workers == 1:
                    print(f"training {run_dir} in its own process", flush=True)
                    running.append((subprocess.Popen(command), run_dir, None))
                    continue
                log = open(run_dir.parent / f"{run_dir.name}.log", "w")
                proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
                running.append((proc, run_dir, log))
            time.sleep(1.0)
            for item in list(running):
                proc, run_dir, log = item
                if proc.poll() is None:
                    continue
                if log is not None:
                    log.close()
                running.remove(item)
                if proc.returncode != 0:
                    for other, _, other_log in running:
                        other.kill()
                        other_log.close()
                    where = ("its output is above" if log is None else
                             f"see {run_dir.parent / (run_dir.name + '.log')}")
                    raise RuntimeError(f"training {run_dir} failed (exit {proc.returncode}); "
                                       f"{where}")


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
    env = stages.get_env(cfg)
    policy, tokenizer = stages.make_policy(cfg, "model", device=device)
    try:
        summary, _ = stages.evaluate(cfg, env, stages.held_out_tasks(cfg, env)[1], policy,
                                       tokenizer)
    finally:
        stages.close_policy(policy)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1))
    return summary


def check_transfer(envs: list[str]) -> None:
    """Refuse an environment name that is not registered, before any run starts."""
    from lopd.envs import REGISTRY

    unknown = [e for e in envs if e not in REGISTRY]
    if unknown:
        raise ValueError(f"transfer environments {','.join(unknown)}: choose from "
                         f"{sorted(REGISTRY)}")


def _cached_transfer(cache: Path, limit: int, model_path: str | Path | None = None) -> dict | None:
    """The cached transfer score in ``cache`` when it was scored on ``limit`` tasks (and of
    ``model_path``, when given); else None."""
    if not cache.exists():
        return None
    cached = json.loads(cache.read_text())
    if cached.get("limit", 0) != limit:
        return None
    if model_path is not None and cached.get("model") != str(model_path):
        return None
    return cached


def transfer_metric(env_name: str) -> str:
    """What a transfer score of ``env_name`` is: pass@1 for a code environment, else the mean
    reward."""
    return "pass@1" if env_name in stages.CODE_ENVS else "mean reward"


def transfer_score(config: str | Path, overrides: list[str], model_path: str | Path,
                   env_name: str, cache: Path, limit: int = 0) -> dict:
    """Greedy score of the model at ``model_path`` on the first ``limit`` tasks (0 = all) of
    ``env_name``'s eval split, under the comparison's config with ``env.name`` replaced (cached in
    ``cache``, and scored again when the cache holds another model or task count, e.g. after the
    run was continued): ``score`` is pass@1 for code environments and the mean reward otherwise."""
    cached = _cached_transfer(cache, limit, model_path)
    if cached is not None:
        return cached
    cfg = load_config(config, [*overrides, f"env.name={env_name}"])
    summary, _ = stages.evaluate_agent(cfg, "model", str(model_path), "eval", limit=limit)
    metric = transfer_metric(env_name)
    record = {"env": env_name, "model": str(model_path), "limit": limit, "metric": metric,
              "score": (summary["pass_at_k"]["pass@1"] if metric == "pass@1"
                        else summary["mean_reward"]),
              "mean_reward": summary["mean_reward"], "tasks": summary["tasks"],
              "seconds": summary["seconds"]}
    cache.write_text(json.dumps(record, indent=1))
    return record


def final_student(run_dir: Path) -> Path:
    """The student folder of a finished run's last checkpoint."""
    done = checkpoints(run_dir)
    if not done:
        raise FileNotFoundError(f"{run_dir} has no checkpoint: it cannot be scored elsewhere")
    return done[-1] / "student"


def run_transfer_score(config: str | Path, overrides: list[str], run_dir: Path, env_name: str,
                       limit: int = 0) -> dict:
    """:func:`transfer_score` of a run's final student. A run kept without its checkpoints (its
    records copied from another machine) is read from its cache, which must hold the same task
    count; otherwise the error names the missing checkpoint and how to train the run anew."""
    cache = run_dir / f"transfer-{env_name}.json"
    if not checkpoints(run_dir):
        cached = _cached_transfer(cache, limit)
        if cached is not None:
            return cached
        tasks = f"its first {limit} tasks" if limit else "all its tasks"
        raise FileNotFoundError(
            f"{run_dir} has no checkpoint (its records were kept without its weights) and no cached "
            f"{env_name} score on {tasks}: move the folder away and run the comparison again to "
            "train it anew (a fresh process draws the same rollouts on the same kind of CPU), or "
            "score it where its checkpoints are")
    return transfer_score(config, overrides, final_student(run_dir), env_name, cache, limit)


def compare(config: str | Path, overrides: list[str], algos: list[str], seeds: int, out: Path,
            learning_rates: dict[str, float] | None = None, jobs: int = 1,
            transfer: list[str] = (), transfer_tasks: int = 0, isolate: bool = False) -> dict:
    """See the module docstring; ``jobs`` > 1 trains that many runs at once in subprocesses, and
    ``isolate`` trains every run in a subprocess of its own even one at a time (a long-lived
    process running a real model's runs one after another slows down run after run);
    ``transfer_tasks`` > 0 scores only the first that many tasks of each transfer environment."""
    check_algos(algos)
    check_transfer(list(transfer))
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if transfer_tasks < 0:
        raise ValueError(f"transfer_tasks must be >= 0, got {transfer_tasks}")
    load_config(config, overrides)  # a bad key fails before any run starts
    learning_rates = learning_rates or {}
    out.mkdir(parents=True, exist_ok=True)
    if jobs > 1 or isolate:
        _train_in_parallel([(run_config(config, overrides, algo, seed, learning_rates),
                             out / algo / f"seed{seed}", algo)
                            for algo in algos if algo != BASE for seed in range(seeds)], jobs)
    results: dict[str, dict] = {}
    curves: dict[str, list[list[dict]]] = {}
    notes: list[str] = []
    for algo in algos:
        if algo == BASE:
            base_cfg = run_config(config, overrides, "lopd", 0, {})
            summary = evaluate_base(base_cfg, out)
            results[BASE] = {"mean_reward": [summary["mean_reward"]] * seeds,
                             "success_rate": [summary["success_rate"]] * seeds,
                             "generations": 0, "setup_generations": 0, "charged_generations": 0}
            results[BASE]["per_domain"] = {
                domain: [row["mean_reward"]] * seeds
                for domain, row in summary.get("per_domain", {}).items()}
            results[BASE]["transfer"] = {
                env: [transfer_score(config, overrides, base_cfg.model.name_or_path, env,
                                     out / BASE / f"transfer-{env}.json",
                                     transfer_tasks)["score"]] * seeds
                for env in transfer}
            continue
        per_seed = []
        for seed in range(seeds):
            cfg = run_config(config, overrides, algo, seed, learning_rates)
            run_dir = out / algo / f"seed{seed}"
            train_or_reuse(cfg, run_dir, algo)
            per_seed.append(read_evals(run_dir))
        curves[algo] = per_seed
        finals = [evals[-1] for evals in per_seed]
        setups = [setup_generations(evals) for evals in per_seed]
        if len(set(setups)) > 1:
            notes.append(f"{algo}: setup rollouts differ across seeds ({setups}); the largest, "
                         f"{max(setups)}, is charged")
        results[algo] = {"mean_reward": [f["mean_reward"] for f in finals],
                         "success_rate": [f["success_rate"] for f in finals],
                         "generations": finals[0]["generations"],
                         "setup_generations": max(setups),
                         "setup_generations_per_seed": setups,
                         "charged_generations": max(setups) + finals[0]["generations"],
                         "learning_rate": run_config(config, overrides, algo, 0,
                                                     learning_rates).train.learning_rate}
        results[algo]["per_domain"] = {
            domain: [f.get("per_domain", {}).get(domain, {}).get("mean_reward") for f in finals]
            for domain in finals[0].get("per_domain", {})}
        results[algo]["transfer"] = {
            env: [run_transfer_score(config, overrides, run_dir, env, transfer_tasks)["score"]
                  for run_dir in (out / algo / f"seed{seed}" for seed in range(seeds))]
            for env in transfer}
    table = {algo: {"mean_reward": _mean_std(r["mean_reward"]),
                    "success_rate": _mean_std(r["success_rate"]),
                    "generations": r["generations"], "setup_generations": r["setup_generations"],
                    "charged_generations": r["charged_generations"],
                    "learning_rate": r.get("learning_rate"),
                    "transfer": {env: _mean_std(v) for env, v in r.get("transfer", {}).items()}}
             for algo, r in results.items()}
    ratio = rollout_ratio(curves, {a: r["setup_generations"] for a, r in results.items()})
    report = {"seeds": seeds, "algos": algos, "per_seed": results, "summary": table,
              "rollout_ratio": ratio, "notes": notes, "config": str(config),
              "overrides": overrides, "transfer": list(transfer),
              "transfer_tasks": transfer_tasks}
    (out / "results.json").write_text(json.dumps(report, indent=1))
    (out / "results.md").write_text(markdown(table, seeds, ratio, notes))
    plot(curves, results, ratio, out / "reward_vs_generations.png")
    return report


def _mean_curve(per_seed: list[list[dict]]) -> list[tuple[int, float]]:
    """Seed-mean held-out reward at each evaluation (all seeds share the schedule)."""
    length = min(len(evals) for evals in per_seed)
    return [(per_seed[0][i]["generations"],
             statistics.fmean(evals[i]["mean_reward"] for evals in per_seed)) for i in range(length)]


def crossing_generations(curve: list[tuple[float, float]], target: float) -> float | None:
    """The generations at which the ``(generations, reward)`` curve first reaches ``target``,
    interpolated linearly between the two points that bracket it; the first point's generations
    when the curve starts at or above it, None when it never gets there."""
    previous = None
    for generations, reward in curve:
        if reward >= target:
            if previous is None:
                return float(generations)
            (g0, r0) = previous  # r0 < target <= reward, so the slope is positive
            return g0 + (target - r0) / (reward - r0) * (generations - g0)
        previous = (generations, reward)
    return None


def rollout_ratios(crossing: float | None, grpo_generations: float, lopd_setup: float = 0,
                   grpo_setup: float = 0) -> tuple[float | None, float | None]:
    """``(training only, with setup)``: LOPD's crossing over GRPO's training rollouts, and LOPD's
    setup + crossing over GRPO's setup + training rollouts; None where there is no crossing (or
    nothing to divide by)."""
    if crossing is None:
        return None, None
    training = crossing / grpo_generations if grpo_generations > 0 else None
    charged = grpo_setup + grpo_generations
    return training, (lopd_setup + crossing) / charged if charged > 0 else None


def rollout_ratio(curves: dict[str, list[list[dict]]], setup: dict[str, int]) -> dict:
    """Both rollout ratios of LOPD against GRPO with the figures they are made of (all None when
    either method was not run); ``setup`` holds each method's setup rollouts."""
    ratio = dict.fromkeys(("training_only", "with_setup", "target_reward",
                           "lopd_crossing_generations", "lopd_setup_generations",
                           "grpo_generations", "grpo_setup_generations"))
    if "lopd" not in curves or "grpo" not in curves:
        return ratio
    grpo_generations, target = _mean_curve(curves["grpo"])[-1]
    crossing = crossing_generations(_mean_curve(curves["lopd"]), target)
    training, with_setup = rollout_ratios(crossing, grpo_generations, setup["lopd"], setup["grpo"])
    ratio.update(training_only=training, with_setup=with_setup, target_reward=target,
                 lopd_crossing_generations=crossing, lopd_setup_generations=setup["lopd"],
                 grpo_generations=grpo_generations, grpo_setup_generations=setup["grpo"])
    return ratio


def _number(value: float | None, digits: int = 3) -> str:
    return "None" if value is None else f"{value:.{digits}f}"


def markdown(table: dict, seeds: int, ratio: dict, notes: list[str] = ()) -> str:
    envs = list(next(iter(table.values()), {}).get("transfer", {}))
    columns = [f"{env} {transfer_metric(env)}" for env in envs]
    lines = ["| " + " | ".join(["method", "held-out mean reward", "held-out success rate",
                                *columns, "training rollouts", "setup rollouts", "charged",
                                "lr"]) + " |",
             "|" + " --- |" * (7 + len(columns))]
    for algo, row in table.items():
        (rm, rs), (sm, ss) = row["mean_reward"], row["success_rate"]
        lr = f"{row['learning_rate']:g}" if row["learning_rate"] else "-"
        moved = "".join(f" {m:.4f} ± {sd:.4f} |" for m, sd in
                        (row.get("transfer", {})[env] for env in envs))
        lines.append(f"| {algo} | {rm:.4f} ± {rs:.4f} | {sm:.4f} ± {ss:.4f} |{moved} "
                     f"{row['generations']} | {row['setup_generations']} | "
                     f"{row['charged_generations']} | {lr} |")
    lines.append("")
    lines.append(f"Mean ± population std over {seeds} seeds (base: greedy, identical per seed). "
                 "Training rollouts: sampled by the training loop; setup rollouts: consumed before "
                 "training (bank building, cold-start sampling); charged: their sum.")
    lines.extend(f"Note: {note}." for note in notes)
    lines.append("")
    if ratio["target_reward"] is None:
        lines.append("Rollout ratio: None, both ways (LOPD and GRPO were not both run).")
        return "\n".join(lines) + "\n"
    target, crossing = ratio["target_reward"], ratio["lopd_crossing_generations"]
    if crossing is None:
        lines.append(f"LOPD's seed-mean held-out reward never reached GRPO's final seed-mean "
                     f"reward ({target:.4f}), so LOPD has no crossing point.")
    else:
        lines.append(f"LOPD's seed-mean held-out reward first reaches GRPO's final seed-mean "
                     f"reward ({target:.4f}) at {crossing:.1f} training rollouts (interpolated "
                     f"linearly between the two evaluations that bracket it).")
    lines.append("")
    lines.append(f"- Rollout ratio, training rollouts only = {_number(ratio['training_only'])}: "
                 f"LOPD's crossing / GRPO's training rollouts = {_number(crossing, 1)} / "
                 f"{ratio['grpo_generations']}.")
    lines.append(f"- Rollout ratio with setup rollouts = {_number(ratio['with_setup'])}: (LOPD's "
                 f"setup rollouts + crossing) / (GRPO's setup rollouts + training rollouts) = "
                 f"({ratio['lopd_setup_generations']} + {_number(crossing, 1)}) / "
                 f"({ratio['grpo_setup_generations']} + {ratio['grpo_generations']}).")
    if crossing is None:
        lines.append("")
        lines.append("Both ratios are None: not reached.")
    return "\n".join(lines) + "\n"


def plot(curves: dict[str, list[list[dict]]], results: dict, ratio: dict, path: Path) -> None:
    """Held-out reward against training rollouts (left, with LOPD's crossing) and against charged
    rollouts (right: each curve shifted right by its method's setup rollouts)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for algo, per_seed in curves.items():
        length = min(len(e) for e in per_seed)
        xs = [per_seed[0][i]["generations"] for i in range(length)]
        values = [[e[i]["mean_reward"] for e in per_seed] for i in range(length)]
        means = [statistics.fmean(v) for v in values]
        shift = results[algo]["setup_generations"]
        for ax, offset in ((left, 0), (right, shift)):
            line, = ax.plot([x + offset for x in xs], means, marker="o", ms=3, label=algo)
            ax.fill_between([x + offset for x in xs], [min(v) for v in values],
                            [max(v) for v in values], alpha=0.2, color=line.get_color())
    for ax in (left, right):
        if BASE in results:
            ax.axhline(results[BASE]["mean_reward"][0], color="grey", ls="--", label="base")
    if ratio["lopd_crossing_generations"] is not None:
        left.plot([ratio["lopd_crossing_generations"]], [ratio["target_reward"]], marker="*",
                  ms=12, color="black", ls="none",
                  label=f"LOPD reaches GRPO's final (ratio {ratio['training_only']:.2f})")
    left.set_xlabel("training rollouts")
    right.set_xlabel("rollouts charged, setup included")
    left.set_ylabel("held-out mean reward")
    left.set_title("against training rollouts")
    right.set_title("against all rollouts charged")
    fig.suptitle("held-out reward vs. rollouts (mean over seeds, min-max band)")
    left.legend()
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
