"""The internalisation experiment (``lopd experiment internalisation``).

The base (Vanilla), the base acting with retrieved latents of the cold-started composer (Base +
Composer) and of each LOPD run's final composer, and the LOPD student acting alone, under one
inference setting (greedy, the same held-out tasks, the same rollout limits): how much of the gain
the composer's latents give the base the student keeps without them. Reported in
``docs/results/internalisation.md``.
"""

from __future__ import annotations

import json
from pathlib import Path

from lopd.config import load_config
from lopd.experiments.ablation import _mean_std as _stats
from lopd.experiments.ablation import train_arms
from lopd.experiments.common import TRACK, write_report


def _held_out_eval(cfg, cache: Path, composer: str | Path | None = None,
                   bank: str | Path | None = None, model_path: str | None = None) -> dict:
    """Greedy score on the trainer's held-out tasks (``train.eval_split``, ``train.eval_tasks``) of
    the model, or of the model acting with the latents of ``composer`` over ``bank``; cached, and
    scored again when the cache holds another agent (e.g. a run continued to a later step)."""
    from lopd import runtime, stages

    agent = {"model": model_path or cfg.model.name_or_path,
             "composer": str(composer) if composer else None, "bank": str(bank) if bank else None}
    if cache.exists():
        cached = json.loads(cache.read_text())
        if all(cached.get(k) == v for k, v in agent.items()):
            return cached
    device = runtime.setup(cfg.run)
    env = stages.get_env(cfg)
    policy, tokenizer, opened = stages.agent_policy(cfg, "model", model_path, composer, bank,
                                                      device)
    try:
        summary, _ = stages.evaluate(cfg, env, stages.held_out_tasks(cfg, env)[1], policy,
                                       tokenizer)
    finally:
        stages.close_policy(policy)
        if opened is not None:
            opened.close()
    summary.update(agent)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(summary, indent=1))
    return summary


def internalisation(config, overrides: list[str], out: Path, seeds: int = 3,
                    jobs: int = 1) -> dict:
    """Vanilla, Base + Composer (cold-started, and each LOPD run's final composer) and the LOPD
    student, under one inference setting (see the module docstring)."""
    from lopd.trainer import checkpoints

    cfg = load_config(config, overrides)
    if not cfg.lopd.composer or not cfg.lopd.bank:
        raise ValueError("internalisation needs the cold-started composer and its bank: set "
                         "lopd.composer and lopd.bank (--composer, --bank)")
    out.mkdir(parents=True, exist_ok=True)
    raw = train_arms(config, overrides, "lopd", {"lopd": []}, seeds, out, TRACK, jobs)["arms"]
    vanilla = _held_out_eval(cfg, out / "vanilla" / "eval.json")
    cold = _held_out_eval(cfg, out / "base+composer" / "eval.json", cfg.lopd.composer,
                          cfg.lopd.bank)
    trained = []
    for seed in range(seeds):
        last = checkpoints(out / "lopd" / f"seed{seed}")[-1]
        trained.append(_held_out_eval(cfg, out / "lopd" / f"seed{seed}" / "eval-base+composer.json",
                                      last / "composer", last / "bank"))
    rows = {
        "vanilla": {"label": "Vanilla (the base)", "latents": False,
                    "mean_reward": [vanilla["mean_reward"]],
                    "success_rate": [vanilla["success_rate"]]},
        "base+composer": {"label": "Base + Composer (cold-started)", "latents": True,
                          "mean_reward": [cold["mean_reward"]],
                          "success_rate": [cold["success_rate"]]},
        "base+lopd-composer": {"label": "Base + LOPD's final composer", "latents": True,
                               "mean_reward": [t["mean_reward"] for t in trained],
                               "success_rate": [t["success_rate"] for t in trained]},
        "lopd": {"label": "LOPD student", "latents": False,
                 "mean_reward": raw["lopd"]["mean_reward"],
                 "success_rate": raw["lopd"]["success_rate"]}}
    for row in rows.values():
        row["mean_reward_stats"] = _stats(row["mean_reward"])
        row["success_rate_stats"] = _stats(row["success_rate"])
    gain = rows["base+composer"]["mean_reward_stats"][0] - vanilla["mean_reward"]
    kept = rows["lopd"]["mean_reward_stats"][0] - vanilla["mean_reward"]
    report = {"experiment": "internalisation", "seeds": seeds, "config": str(config),
              "overrides": overrides, "split": cfg.train.eval_split,
              "tasks": vanilla["episodes"], "n_ret": cfg.bank.n_ret,
              "composer": str(cfg.lopd.composer), "rows": rows,
              "composer_gain": gain, "student_gain": kept,
              "kept_fraction": kept / gain if gain > 0 else None}
    plot_internalisation(report, out / "internalisation.png")
    return write_report(out, "internalisation", report, internalisation_markdown(report))


def internalisation_markdown(report: dict) -> str:
    lines = ["| agent | retrieval and latents at inference | held-out mean reward (per seed) | "
             "mean ± std | success rate |", "| --- | --- | --- | --- | --- |"]
    for row in report["rows"].values():
        (m, s), (sm, ss) = row["mean_reward_stats"], row["success_rate_stats"]
        latents = f"yes (n_ret {report['n_ret']})" if row["latents"] else "no"
        lines.append(f"| {row['label']} | {latents} | "
                     f"{', '.join(f'{v:.4f}' for v in row['mean_reward'])} | {m:.4f} ± {s:.4f} | "
                     f"{sm:.3f} ± {ss:.3f} |")
    kept = report["kept_fraction"]
    lines += ["", f"Every agent acts greedily on the same {report['tasks']} tasks of the "
              f"{report['split']} split with the same rollout limits. The base gains "
              f"{report['composer_gain']:+.4f} from the cold-started composer's latents; the LOPD "
              f"student, acting alone, gains {report['student_gain']:+.4f} over the base"
              + (f": {kept:.0%} of the composer's gain." if kept is not None else
                 " (the composer gave no gain to keep)."),
              "", f"Config: `{report['config']}` with "
              + (", ".join(f"`{o}`" for o in report["overrides"]) or "no overrides") + "."]
    return "\n".join(lines) + "\n"


def plot_internalisation(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(report["rows"].values())
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for i, row in enumerate(rows):
        ax.bar(i, row["mean_reward_stats"][0], alpha=0.55,
               color="tab:orange" if row["latents"] else "tab:blue")
        ax.scatter([i] * len(row["mean_reward"]), row["mean_reward"], color="k", s=10, zorder=3)
    ax.set_xticks(range(len(rows)), [r["label"] for r in rows], rotation=15, fontsize=8)
    values = [v for r in rows for v in r["mean_reward"]]
    pad = max(0.01, (max(values) - min(values)) * 0.4)
    ax.set_ylim(min(values) - pad, max(values) + pad)
    ax.set_ylabel("held-out mean reward")
    ax.set_title("internalisation (orange: acts with latents; dots: seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
