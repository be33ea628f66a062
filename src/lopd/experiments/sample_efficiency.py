"""The sample-efficiency experiment (``lopd experiment sample-efficiency``).

Held-out reward against rollouts for LOPD and the chosen baselines (a comparison, ``lopd
compare``, the base included), every seed's curve read off at given rollout counts (320 and 576 by
default, the paper's), by training rollouts and by rollouts charged (setup included). Reported in
``docs/results/sample-efficiency.md``.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from lopd.experiments.ablation import _mean_std as _stats
from lopd.experiments.common import plot_seed_band, write_report

READ_OFF = (320, 576)


def reward_at(curve: list[tuple[float, float]], x: float) -> float | None:
    """The ``(rollouts, reward)`` curve's reward at ``x`` rollouts, linear between the two
    evaluations that bracket it; None outside the curve."""
    for (x0, r0), (x1, r1) in zip(curve, curve[1:]):
        if x0 <= x <= x1:
            return r0 if x1 == x0 else r0 + (x - x0) / (x1 - x0) * (r1 - r0)
    if curve and curve[-1][0] == x:
        return curve[-1][1]
    return None


def read_off(curves: list[list[tuple[float, float]]], at, setup: int = 0) -> dict:
    """Every seed's reward at each count in ``at`` (as a string key), its curve shifted right by
    ``setup`` rollouts: ``{"per_seed", "stats"}``, or None where a seed's curve does not reach."""
    read = {}
    for x in at:
        values = [reward_at(c, x - setup) for c in curves]
        read[str(x)] = (None if any(v is None for v in values)
                        else {"per_seed": values, "stats": _stats(values)})
    return read


def sample_efficiency(config, overrides: list[str], out: Path, algos: list[str], seeds: int = 3,
                      jobs: int = 1, learning_rates: dict[str, float] | None = None,
                      at=READ_OFF) -> dict:
    """LOPD and ``algos`` compared (``lopd compare``, the base included), then every seed's reward
    read off at each count in ``at``, by training rollouts and by rollouts charged."""
    from lopd.experiments.compare import BASE, compare

    methods = [a for a in algos if a not in (BASE, "lopd")] + ["lopd"]
    compared = compare(config, overrides, [BASE, *methods], seeds, out, learning_rates, jobs)
    from lopd.experiments.runs import read_evals, setup_generations

    rows = {}
    for algo in methods:
        per_seed = [read_evals(out / algo / f"seed{s}") for s in range(seeds)]
        setup = max(setup_generations(e) for e in per_seed)
        curves = [[(r["generations"], r["mean_reward"]) for r in e] for e in per_seed]
        rows[algo] = {"setup_generations": setup, "curves": curves,
                      "charged_generations": compared["per_seed"][algo]["charged_generations"],
                      "final": _stats([c[-1][1] for c in curves]),
                      "training": read_off(curves, at), "charged": read_off(curves, at, setup)}
    base = compared["per_seed"][BASE]["mean_reward"][0]
    report = {"experiment": "sample-efficiency", "seeds": seeds, "config": str(config),
              "overrides": overrides, "read_off": list(at), "base_mean_reward": base,
              "methods": rows, "learning_rates": {a: compared["per_seed"][a]["learning_rate"]
                                                  for a in methods},
              "rollout_ratio": compared["rollout_ratio"]}
    plot_sample_efficiency(report, out / "sample-efficiency.png")
    return write_report(out, "sample-efficiency", report, sample_efficiency_markdown(report))


def sample_efficiency_markdown(report: dict) -> str:
    at = report["read_off"]

    def cell(value):
        if value is None:
            return "not reached"
        m, s = value["stats"]
        return f"{m:.4f} ± {s:.4f}"

    head = ["method", *(f"reward at {x} training rollouts" for x in at),
            *(f"reward at {x} rollouts charged" for x in at), "final reward",
            "setup rollouts", "rollouts charged", "lr"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for algo, row in report["methods"].items():
        m, s = row["final"]
        lr = report["learning_rates"].get(algo)
        lines.append("| " + " | ".join([
            algo, *(cell(row["training"][str(x)]) for x in at),
            *(cell(row["charged"][str(x)]) for x in at), f"{m:.4f} ± {s:.4f}",
            str(row["setup_generations"]), str(row["charged_generations"]),
            f"{lr:g}" if lr else "-"]) + " |")
    lines += ["", f"Mean ± population std over {report['seeds']} seeds of the held-out reward, "
              "each seed's curve read linearly between the two evaluations that bracket the "
              "count. *Charged* counts every rollout the method consumed, setup (bank building, "
              "cold-start sampling) included, so a method whose setup alone exceeds a count has "
              "no reward there (*not reached*). Base (untrained): "
              f"{report['base_mean_reward']:.4f}.",
              "", f"Config: `{report['config']}` with "
              + (", ".join(f"`{o}`" for o in report["overrides"]) or "no overrides") + "."]
    return "\n".join(lines) + "\n"


def plot_sample_efficiency(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for algo, row in report["methods"].items():
        curves = row["curves"]
        length = min(len(c) for c in curves)
        xs = [curves[0][i][0] for i in range(length)]
        values = [[c[i][1] for c in curves] for i in range(length)]
        for ax, shift in zip(axes, (0, row["setup_generations"])):
            plot_seed_band(ax, [x + shift for x in xs], [statistics.fmean(v) for v in values],
                           values, algo)
    for ax, title in zip(axes, ("training rollouts", "rollouts charged (setup included)")):
        ax.axhline(report["base_mean_reward"], color="grey", ls="--", lw=1, label="base")
        for x in report["read_off"]:
            ax.axvline(x, color="k", ls=":", lw=0.8)
        ax.set_xlabel(title)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("held-out mean reward")
    fig.suptitle("sample efficiency: seed mean, min-max band; dotted: the read-off counts "
                 + ", ".join(str(x) for x in report["read_off"]))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
