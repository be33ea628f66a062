"""What the paper's controlled experiments (``lopd experiment NAME``) share.

Each experiment has its own module — :mod:`~lopd.experiments.joint_optimisation`,
:mod:`~lopd.experiments.random_latent`, :mod:`~lopd.experiments.sensitivity`,
:mod:`~lopd.experiments.internalisation`, :mod:`~lopd.experiments.sample_efficiency` and
:mod:`~lopd.experiments.latent_decoding` — and trains (or reuses, or resumes) its runs in
``OUT/ARM/seedS`` with the machinery of :mod:`lopd.experiments.ablation` and
:mod:`lopd.experiments.compare`, so an interrupted experiment continues where it stopped, and writes
``OUT/NAME.md`` (the table, the settings, the keys in which the arms' saved configs differ),
``OUT/NAME.json`` (every figure per seed) and ``OUT/NAME.png``. Every student is scored as
deployed: greedy, on the held-out tasks, without retrieval, composer or latents (the trainer's
evaluation); only the internalisation experiment also scores agents that act with latents, and says
so per row.

Here: the per-step metrics every arm experiment follows (:data:`TRACK`), the verdict of an arm
against the reference, the report writer, and :func:`run_arms` with its table and figure — the
experiment made of LOPD arms that differ in named settings (joint-optimisation, random-latent,
sensitivity).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from lopd.config import load_config
from lopd.experiments.ablation import _mean_std as _stats
from lopd.experiments.ablation import train_arms
from lopd.experiments.method_table import beats

TRACK = ["delta", "beta", "kl"]
"""Per-step LOPD metrics every arm experiment follows: the teacher's privileged margin Δ, the dual
variable β and the student's distillation KL."""


def verdict(method: tuple[float, float], reference: tuple[float, float]) -> str:
    """``above`` / ``below`` when the means differ by more than the sum of the two spreads (the
    method table's rule), else ``within``."""
    if beats(method, reference):
        return "above"
    if beats(reference, method):
        return "below"
    return "within"


def _flat(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def arm_differences(out: Path, arms: list[str]) -> dict[str, list[str]]:
    """For every arm, the config keys in which its saved seed-0 run differs from the first arm's
    (read from the runs' ``config.yaml``: what was trained, not what was asked for). A key a run's
    config lacks (a setting added to lopd after the run was made) is taken at its default, as run
    reuse does."""
    import yaml

    from lopd.trainer import CONFIG_FILE

    defaults = _flat(yaml.safe_load(yaml.safe_dump(load_config(None).to_dict())))
    configs = {arm: {**defaults,
                     **_flat(yaml.safe_load((out / arm / "seed0" / CONFIG_FILE).read_text()))}
               for arm in arms}
    reference = configs[arms[0]]
    return {arm: sorted(k for k in {*cfg, *reference} if cfg.get(k) != reference.get(k))
            for arm, cfg in configs.items()}


def plot_seed_band(ax, xs: list[float], means: list[float], values: list[list[float]],
                   label: str) -> None:
    """One method's seed-mean curve on ``ax`` with the min-max band of its seeds' ``values``
    (one list of per-seed figures per point)."""
    line, = ax.plot(xs, means, marker="o", ms=3, label=label)
    ax.fill_between(xs, [min(v) for v in values], [max(v) for v in values], alpha=0.2,
                    color=line.get_color())


def write_report(out: Path, name: str, report: dict, text: str) -> dict:
    """Write an experiment's numbers (``OUT/NAME.json``) and table (``OUT/NAME.md``); return
    ``report``."""
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    (out / f"{name}.md").write_text(text)
    return report


# ----------------------------------------------------------------------------------------------
# Arms of LOPD that differ in named settings


def run_arms(name: str, config, overrides: list[str], arms: dict[str, list[str]], seeds: int,
             out: Path, jobs: int, reference: str, labels: dict[str, str] | None = None,
             extra: dict | None = None) -> dict:
    """Train the LOPD ``arms`` (name → settings), compare each with the ``reference`` arm and
    write the experiment's table, figure and numbers."""
    out.mkdir(parents=True, exist_ok=True)
    raw = train_arms(config, overrides, "lopd", arms, seeds, out, TRACK, jobs)
    differ = arm_differences(out, list(arms))
    ref = _stats(raw["arms"][reference]["mean_reward"])
    rows = {}
    for arm, row in raw["arms"].items():
        reward = _stats(row["mean_reward"])
        rows[arm] = {
            "label": (labels or {}).get(arm, arm), "settings": row["settings"],
            "differs_from_first_arm_in": [k for k in differ[arm] if k != "run.seed"],
            "mean_reward": row["mean_reward"], "mean_reward_stats": reward,
            "success_rate": row["success_rate"],
            "success_rate_stats": _stats(row["success_rate"]),
            "generations": row["generations"],
            f"vs_{reference}": "reference" if arm == reference else verdict(reward, ref),
            "difference_to_reference": reward[0] - ref[0],
            "mean_per_step": {key: statistics.fmean(p["mean"] for p in row["tracked"][key])
                              if row["tracked"][key] else None for key in TRACK},
            "final": {key: statistics.fmean(v) if v else None
                      for key, v in row["tracked_final"].items()},
            "tracked": row["tracked"], "evals": row["evals"]}
    base = raw["arms"][reference]["start_reward"][0]
    report = {"experiment": name, "seeds": seeds, "config": str(config), "overrides": overrides,
              "split": raw["split"], "reference": reference, "base_mean_reward": base,
              "arms": rows, **(extra or {})}
    plot_arms(report, out / f"{name}.png")
    return write_report(out, name, report, arms_markdown(report))


def arms_markdown(report: dict) -> str:
    ref = report["reference"]
    seeds = report["seeds"]
    where = "validation" if report["split"] == "validation" else "held-out"
    head = ["arm", "settings", f"{where} mean reward (seeds 0..{seeds - 1})", "mean ± std",
            "success rate", f"vs {report['arms'][ref]['label']}", "mean Δ per step",
            "mean KL per step", "final β"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head),
             f"| base (untrained) | - | {report['base_mean_reward']:.4f} | "
             f"{report['base_mean_reward']:.4f} | - | - | - | - | - |"]

    def num(value, digits=4):
        return "-" if value is None else f"{value:.{digits}f}"

    for arm, row in report["arms"].items():
        (m, s), (sm, ss) = row["mean_reward_stats"], row["success_rate_stats"]
        versus = row[f"vs_{ref}"]
        if versus != "reference":
            versus = f"{versus} ({row['difference_to_reference']:+.4f})"
        lines.append("| " + " | ".join([
            row["label"], ", ".join(f"`{s}`" for s in row["settings"]) or "(as configured)",
            ", ".join(f"{v:.4f}" for v in row["mean_reward"]), f"{m:.4f} ± {s:.4f}",
            f"{sm:.3f} ± {ss:.3f}", versus, num(row["mean_per_step"]["delta"]),
            num(row["mean_per_step"]["kl"]), num(row["final"]["beta"], 3)]) + " |")
    lines += ["", f"LOPD, {seeds} seeds (run.seed 0..{seeds - 1}); mean ± population std over "
              f"seeds; students scored greedily on the {report['split']} split without retrieval, "
              "composer or latents. *above* / *below*: the means differ by more than the sum of "
              "the two spreads; *within* otherwise. Δ is the teacher's privileged margin per "
              "action token, KL the student's distillation loss, β the dual variable.", "",
              "Config keys in which each arm's saved run differs from the first arm's:", ""]
    for arm, row in report["arms"].items():
        keys = row["differs_from_first_arm_in"]
        lines.append(f"- {row['label']}: {', '.join(f'`{k}`' for k in keys) or 'none'}")
    lines += ["", f"Config: `{report['config']}` with "
              + (", ".join(f"`{o}`" for o in report["overrides"]) or "no overrides") + "."]
    return "\n".join(lines) + "\n"


def plot_arms(report: dict, path: Path) -> None:
    """Held-out reward against training rollouts per arm (seed mean, min-max band), the tracked
    metrics per step, and the final reward per arm with each seed's point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = report["arms"]
    colors = {arm: f"C{i}" for i, arm in enumerate(arms)}
    fig = plt.figure(figsize=(4.3 * len(TRACK), 7.4))
    grid = fig.add_gridspec(2, len(TRACK))
    ax = fig.add_subplot(grid[0, :-1])
    for arm, row in arms.items():
        length = min(len(e) for e in row["evals"])
        xs = [row["evals"][0][i]["generations"] for i in range(length)]
        values = [[e[i]["mean_reward"] for e in row["evals"]] for i in range(length)]
        ax.plot(xs, [statistics.fmean(v) for v in values], marker="o", ms=3,
                label=row["label"], color=colors[arm])
        ax.fill_between(xs, [min(v) for v in values], [max(v) for v in values], alpha=0.15,
                        color=colors[arm])
    ax.axhline(report["base_mean_reward"], color="grey", ls="--", lw=1, label="base")
    ax.set_xlabel("training rollouts")
    ax.set_title("held-out mean reward")
    ax.legend(fontsize=7)
    for i, key in enumerate(TRACK):
        ax = fig.add_subplot(grid[1, i])
        for arm, row in arms.items():
            curve = row["tracked"][key]
            if curve:
                xs = [p["generations"] for p in curve]
                ax.plot(xs, [p["mean"] for p in curve], label=row["label"], color=colors[arm])
                ax.fill_between(xs, [p["min"] for p in curve], [p["max"] for p in curve],
                                alpha=0.15, color=colors[arm])
        ax.set_title(f"{key} per step (seed mean, min-max band)")
        ax.set_xlabel("training rollouts")
    ax = fig.add_subplot(grid[0, -1])
    for i, (arm, row) in enumerate(arms.items()):
        ax.bar(i, row["mean_reward_stats"][0], alpha=0.5, color=colors[arm])
        ax.scatter([i] * len(row["mean_reward"]), row["mean_reward"], color="k", s=10, zorder=3)
    ax.set_xticks(range(len(arms)), [r["label"] for r in arms.values()], rotation=25, fontsize=8)
    ax.axhline(report["base_mean_reward"], color="grey", ls="--", lw=1)
    values = [report["base_mean_reward"], *(v for r in arms.values() for v in r["mean_reward"])]
    pad = max(0.01, (max(values) - min(values)) * 0.4)
    ax.set_ylim(min(values) - pad, max(values) + pad)
    ax.set_title("final held-out reward (bar: seed mean)")
    fig.suptitle(f"{report['experiment']}: LOPD, {report['seeds']} seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
