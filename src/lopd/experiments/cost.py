"""What each method of a comparison cost in wall-clock time, and when it reached GRPO's reward.

Reads an ``lopd compare`` folder (no training). For every trained method: the seconds of one
training step (median over every step of every seed; ``time/step`` of the run's metrics, which
counts the step's rollouts and update but not its evaluations or checkpoints), the training and
evaluation seconds of a run (mean ± population std over seeds), and the *seconds to GRPO's reward*:
the training seconds at which the method's seed-mean held-out reward curve first reaches GRPO's
final seed-mean reward, interpolated linearly between the two evaluations that bracket it (the
same rule as the comparison's rollout ratio, with seconds in place of rollouts). Each evaluation
sits at the seed-mean training seconds spent up to its step.

Setup time (LOPD: building the bank and cold-starting the composer) is not in the runs' records;
it is given per method (``--setup-seconds lopd=SECONDS``, the measured wall-clock of those
commands) and added to the figures "with setup". A method with no setup time given is charged 0.

    python -m lopd.experiments.cost --compare runs/smollm2-compare \\
        --setup-seconds lopd=1588 --out docs/results/smollm2/cost
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from lopd.experiments.common import plot_seed_band, write_report
from lopd.experiments.compare import BASE, crossing_generations
from lopd.experiments.method_table import read
from lopd.trainer import EVAL_FILE, METRICS_FILE, read_jsonl


def _stats(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.pstdev(values) if len(values) > 1 else 0.0


def run_seconds(run_dir: Path) -> dict:
    """One run's step seconds, its training and evaluation seconds, and its held-out reward at
    each evaluation against the training seconds spent up to that step."""
    records = read_jsonl(Path(run_dir) / METRICS_FILE)
    if not records:
        raise FileNotFoundError(f"{run_dir} has no {METRICS_FILE}: not a training run")
    steps, elapsed, curve, evaluated = [], 0.0, [], 0.0
    for record in records:
        if "time/step" in record:
            steps.append(record["time/step"])
            elapsed += record["time/step"]
        if "eval/mean_reward" in record:
            curve.append((elapsed, record["eval/mean_reward"]))
    for record in read_jsonl(Path(run_dir) / EVAL_FILE):
        evaluated += record.get("seconds", 0.0)
    return {"step_seconds": steps, "training_seconds": elapsed, "eval_seconds": evaluated,
            "curve": curve}


def mean_curve(curves: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """Seed-mean (seconds, reward) at each evaluation the seeds share."""
    length = min(len(c) for c in curves)
    return [(statistics.fmean(c[i][0] for c in curves), statistics.fmean(c[i][1] for c in curves))
            for i in range(length)]


def cost(compare_dir: Path, setup_seconds: dict[str, float] | None = None) -> dict:
    """Every trained method's cost in seconds (see the module docstring)."""
    compare_dir = Path(compare_dir)
    report = read(compare_dir)
    setup_seconds = setup_seconds or {}
    unknown = sorted(set(setup_seconds) - set(report["per_seed"]))
    if unknown:
        raise ValueError(f"--setup-seconds names {', '.join(unknown)}, not a method of "
                         f"{compare_dir} (its methods: {', '.join(report['per_seed'])})")
    seeds = report["seeds"]
    methods = {}
    for algo in report["per_seed"]:
        if algo == BASE:
            continue
        runs = [run_seconds(compare_dir / algo / f"seed{s}") for s in range(seeds)]
        curve = mean_curve([r["curve"] for r in runs])
        methods[algo] = {
            "step_seconds_median": statistics.median(s for r in runs for s in r["step_seconds"]),
            "steps_per_run": len(runs[0]["step_seconds"]),
            "training_seconds": _stats([r["training_seconds"] for r in runs]),
            "eval_seconds": _stats([r["eval_seconds"] for r in runs]),
            "setup_seconds": float(setup_seconds.get(algo, 0.0)),
            "curve": curve, "curves": [r["curve"] for r in runs],
            "final_reward": curve[-1][1]}
    target = methods["grpo"]["final_reward"] if "grpo" in methods else None
    for row in methods.values():
        crossing = None if target is None else crossing_generations(row["curve"], target)
        row["seconds_to_grpo_reward"] = crossing
        row["seconds_to_grpo_reward_with_setup"] = (None if crossing is None
                                                    else crossing + row["setup_seconds"])
    if "grpo" in methods:
        grpo = methods["grpo"]
        spent = grpo["training_seconds"][0]
        for row in methods.values():
            reached = row["seconds_to_grpo_reward"]
            row["time_ratio_to_grpo"] = None if reached is None else reached / spent
            row["time_ratio_to_grpo_with_setup"] = (
                None if reached is None
                else (reached + row["setup_seconds"]) / (spent + grpo["setup_seconds"]))
    out = {"experiment": "cost", "compare": str(compare_dir), "seeds": seeds,
           "target_reward": target, "methods": methods}
    return out


def cost_markdown(report: dict) -> str:
    def seconds(value):
        return "not reached" if value is None else f"{value:,.0f}"

    def ratio(value):
        return "-" if value is None else f"{value:.2f}"

    head = ["method", "s / step (median)", "training s / run", "evaluation s / run",
            "setup s", "s to GRPO's reward", "with setup", "÷ GRPO's training s",
            "÷ GRPO's, with setup"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for algo, row in report["methods"].items():
        (t, ts), (e, es) = row["training_seconds"], row["eval_seconds"]
        lines.append("| " + " | ".join([
            algo, f"{row['step_seconds_median']:.1f}", f"{t:,.0f} ± {ts:,.0f}",
            f"{e:,.0f} ± {es:,.0f}", f"{row['setup_seconds']:,.0f}",
            seconds(row["seconds_to_grpo_reward"]),
            seconds(row["seconds_to_grpo_reward_with_setup"]),
            ratio(row.get("time_ratio_to_grpo")),
            ratio(row.get("time_ratio_to_grpo_with_setup"))]) + " |")
    target = report["target_reward"]
    lines += ["", f"{report['seeds']} seeds; mean ± population std. GRPO's final seed-mean "
              "held-out reward " + ("(no GRPO run)" if target is None else f"{target:.4f}")
              + " is the target; a method reaches it where its seed-mean curve, each "
              "evaluation placed at the seed-mean training seconds before it, first gets there "
              "(linear between evaluations; *not reached* if it never does). Training seconds "
              "count rollouts and updates, not evaluations or checkpoints; setup seconds are the "
              "measured wall-clock of the method's setup commands (bank, cold start)."]
    return "\n".join(lines) + "\n"


def plot_cost(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for algo, row in report["methods"].items():
        curves = row["curves"]
        length = min(len(c) for c in curves)
        xs = [x / 60 for x, _ in row["curve"]]
        values = [[c[i][1] for c in curves] for i in range(length)]
        for ax, shift in zip(axes, (0.0, row["setup_seconds"] / 60)):
            plot_seed_band(ax, [x + shift for x in xs], [y for _, y in row["curve"]], values,
                           algo)
    for ax, title in zip(axes, ("training minutes", "minutes with setup (bank, cold start)")):
        if report["target_reward"] is not None:
            ax.axhline(report["target_reward"], color="k", ls=":", lw=0.8,
                       label="GRPO's final reward")
        ax.set_xlabel(title)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("held-out mean reward")
    fig.suptitle("held-out reward against wall-clock: seed mean, min-max band")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _setup(items: list[str]) -> dict[str, float]:
    setup = {}
    for item in items:
        algo, sep, value = item.partition("=")
        try:
            setup[algo.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep or not algo.strip():
            raise ValueError(f"--setup-seconds {item!r}: expected ALGO=SECONDS, e.g. lopd=1588")
    return setup


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lopd.experiments.cost",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", type=Path, required=True, help="lopd compare folder")
    parser.add_argument("--setup-seconds", action="append", default=[], metavar="ALGO=SECONDS",
                        help="measured setup wall-clock of one method (repeatable)")
    parser.add_argument("--out", type=Path, required=True, help="folder for cost.md/json/png")
    args = parser.parse_args(argv)
    try:
        report = cost(args.compare, _setup(args.setup_seconds))
    except (ValueError, FileNotFoundError) as error:
        parser.exit(2, f"error: {error}\n")
    args.out.mkdir(parents=True, exist_ok=True)
    plot_cost(report, args.out / "cost.png")
    write_report(args.out, "cost", report, cost_markdown(report))
    print((args.out / "cost.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
