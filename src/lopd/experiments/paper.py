"""The paper's controlled experiments as commands: ``lopd experiment NAME``.

Each experiment trains (or reuses, or resumes) its runs in ``OUT/ARM/seedS`` with the machinery of
:mod:`lopd.experiments.ablation` and :mod:`lopd.experiments.compare`, so an interrupted experiment
continues where it stopped, and writes ``OUT/NAME.md`` (the table, the settings, the keys in which
the arms' saved configs differ), ``OUT/NAME.json`` (every figure per seed) and ``OUT/NAME.png``.
Every student is scored as deployed: greedy, on the held-out tasks, without retrieval, composer or
latents (the trainer's evaluation); only the internalisation experiment also scores agents that
act with latents, and says so per row.

- ``joint-optimisation``: LOPD with the cold-started composer φ0 frozen (no composer or dual
  update) against jointly optimised composers at margins m ∈ {0, 0.01, 0.05, 0.1}.
- ``random-latent``: LOPD whose composer reads random bank entries of other tasks instead of the
  retrieved ones (the same cold start), against retrieved ones.
- ``sensitivity``: n_ret ∈ {1, 2, 3, 5} with K fixed, and K ∈ {8, 16, 32, 64} latents per
  experience, each K with its own cold start (``OUT/cold-start/K-k``) on the same bank.
- ``internalisation``: the base (Vanilla), the base acting with retrieved latents of the
  cold-started composer (Base + Composer) and of each LOPD run's final composer, and the LOPD
  student acting alone, under one inference setting.
- ``sample-efficiency``: held-out reward against rollouts for LOPD and the chosen baselines (a
  comparison), read off at given rollout counts, by training rollouts and by rollouts charged.
- ``latent-decoding``: no training; the latents of retrieved experiences projected through the LM
  head (the nearest vocabulary tokens per latent), with and without the current task in the
  composer's input, and how much of the retrieved procedure (tool names and argument keys) the
  projections contain, against latents of random experiences and chance.
"""

from __future__ import annotations

import json
import random
import re
import statistics
from pathlib import Path

from lopd.config import load_config
from lopd.experiments.ablation import _mean_std as _stats
from lopd.experiments.ablation import train_arms
from lopd.experiments.method_table import beats

TRACK = ["delta", "beta", "kl"]
"""Per-step LOPD metrics every arm experiment follows: the teacher's privileged margin Δ, the dual
variable β and the student's distillation KL."""

MARGINS = (0.0, 0.01, 0.05, 0.1)
N_RET = (1, 2, 3, 5)
LATENTS = (8, 16, 32, 64)
READ_OFF = (320, 576)


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


def _write(out: Path, name: str, report: dict, text: str) -> dict:
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
    return _write(out, name, report, arms_markdown(report))


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


def _number(value: float) -> str:
    return f"{value:g}"


def joint_optimisation(config, overrides: list[str], out: Path, seeds: int = 3, jobs: int = 1,
                       margins=MARGINS) -> dict:
    """φ0 frozen against jointly optimised composers at each margin (see the module docstring)."""
    if not margins:
        raise ValueError("joint-optimisation needs at least one margin")
    arms = {"frozen": ["lopd.update_composer=false"]}
    labels = {"frozen": "frozen φ0"}
    for m in margins:
        arms[f"margin-{_number(m)}"] = [f"lopd.margin={m}"]
        labels[f"margin-{_number(m)}"] = f"joint, m = {_number(m)}"
    return run_arms("joint-optimisation", config, overrides, arms, seeds, out, jobs, "frozen",
                    labels)


def random_latent(config, overrides: list[str], out: Path, seeds: int = 3,
                  jobs: int = 1) -> dict:
    """Retrieved experiences against random ones in the composer's input (the same cold start)."""
    arms = {"retrieved": ["lopd.retrieval=nearest"], "random": ["lopd.retrieval=random"]}
    labels = {"retrieved": "retrieved experiences", "random": "random experiences"}
    return run_arms("random-latent", config, overrides, arms, seeds, out, jobs, "retrieved",
                    labels)


def configured_latents(cfg) -> int | None:
    """K of the composer folder ``lopd.composer`` (None when none is set)."""
    if not cfg.lopd.composer:
        return None
    from lopd.composer import Composer

    spec = Path(cfg.lopd.composer) / Composer.CONFIG_FILE
    if not spec.exists():
        raise FileNotFoundError(f"{cfg.lopd.composer} is not a composer folder (no "
                                f"{Composer.CONFIG_FILE})")
    return json.loads(spec.read_text())["spec"]["num_latents"]


def cold_start_for(config, sets: list[str], bank: str, folder: Path) -> dict:
    """The cold start in ``folder`` made with ``config`` + ``sets`` on ``bank``: made when missing
    (a cut-off one, without its ``cold_start.json``, which is written last, starts over), reused
    when its saved config is the wanted one, refused otherwise."""
    import shutil

    from lopd import pipeline
    from lopd.experiments.runs import differing_keys

    wanted = load_config(config, sets)
    record = folder / "cold_start.json"
    if not record.exists():
        shutil.rmtree(folder, ignore_errors=True)
        pipeline.cold_start(wanted, bank, folder)
    saved = json.loads(record.read_text())
    shown = differing_keys(saved["config"], wanted)
    if shown:
        raise ValueError(f"{folder} holds a cold start with another config than this experiment "
                         f"asks for ({shown}); move it away or use another --out")
    return saved["figures"]


def sensitivity(config, overrides: list[str], out: Path, seeds: int = 3, jobs: int = 1,
                n_ret=N_RET, latents=(), cold_start_sets: list[str] = ()) -> dict:
    """n_ret arms (K as configured) and K arms (n_ret as configured). Each K has its own cold
    start: the configured composer for its own K, otherwise one made in ``OUT/cold-start/K-k``
    with the config (plus ``cold_start_sets``, which reach the cold starts only) on ``lopd.bank``.
    The K of the configured composer is the n_ret arm of the configured n_ret when there is one
    (the same run), else an arm of its own. Every arm's latent tokens (n_ret · K) are set against
    the model's context."""
    cfg = load_config(config, overrides)
    if not n_ret and not latents:
        raise ValueError("sensitivity needs n_ret or K values")
    if any(n < 1 for n in n_ret) or any(k < 1 for k in latents):
        raise ValueError(f"n_ret and K must be >= 1, got n_ret {list(n_ret)}, K {list(latents)}")
    own = configured_latents(cfg)
    if latents and own is None:
        raise ValueError("the K arms need the configured cold start and its bank: set "
                         "lopd.composer and lopd.bank (--composer, --bank)")
    if latents and not cfg.lopd.bank:
        raise ValueError("the K arms need a bank for their cold starts: set lopd.bank (--bank)")
    if latents and own != cfg.composer.num_latents:
        raise ValueError(f"composer.num_latents={cfg.composer.num_latents} but the composer in "
                         f"{cfg.lopd.composer} has K {own}: set composer.num_latents={own}")
    arms, labels, tokens = {}, {}, {}
    for n in n_ret:
        arms[f"n_ret-{n}"] = [f"bank.n_ret={n}"]
        labels[f"n_ret-{n}"] = f"n_ret = {n}, K = {own or cfg.composer.num_latents}"
        tokens[f"n_ret-{n}"] = n * cfg.composer.num_latents
    cold_starts, shared = {}, None
    for k in latents:
        if k == own and cfg.bank.n_ret in n_ret:
            shared = f"n_ret-{cfg.bank.n_ret}"
            continue
        if k == own:
            arms[f"K-{k}"] = [f"composer.num_latents={k}"]
        else:
            folder = out / "cold-start" / f"K-{k}"
            cold_starts[k] = cold_start_for(config, [*overrides, f"composer.num_latents={k}",
                                                     *cold_start_sets], cfg.lopd.bank, folder)
            arms[f"K-{k}"] = [f"composer.num_latents={k}", f"lopd.composer={folder}"]
        labels[f"K-{k}"] = f"K = {k}, n_ret = {cfg.bank.n_ret}"
        tokens[f"K-{k}"] = k * cfg.bank.n_ret
    context = cfg.model.max_position_embeddings
    configured = [f"n_ret-{cfg.bank.n_ret}", f"K-{cfg.composer.num_latents}"]
    reference = next((a for a in configured if a in arms), next(iter(arms)))
    extra = {"latent_tokens": tokens, "context_positions": context,
             "cold_starts": {str(k): {"steps": f["steps"], "seconds": f["seconds"],
                                      "final_nll": f["final_nll"]}
                             for k, f in cold_starts.items()},
             "cold_start_settings": list(cold_start_sets), "configured_latents": own,
             "shared_arm": shared}
    report = run_arms("sensitivity", config, overrides, arms, seeds, out, jobs, reference, labels,
                      extra)
    text = (out / "sensitivity.md").read_text()
    text += ("\nLatent tokens in the teacher's prompt per arm (n_ret · K), of the model's "
             f"{context} positions: " + ", ".join(f"{labels[a]}: {t}" for a, t in tokens.items())
             + ".\n")
    if shared:
        text += (f"\nK = {own} (the configured composer's) is the arm {labels[shared]}: the same "
                 "run.\n")
    if cold_starts:
        settings = ", ".join(f"`{c}`" for c in cold_start_sets) or "as configured"
        made = ", ".join(f"K = {k}: {f['steps']} steps, {f['seconds']:.0f} s, final NLL "
                         f"{f['final_nll']:.4f}" for k, f in cold_starts.items())
        text += f"\nCold starts of the K arms (settings {settings}): {made}.\n"
    (out / "sensitivity.md").write_text(text)
    return report


# ----------------------------------------------------------------------------------------------
# Internalisation


def _held_out_eval(cfg, cache: Path, composer: str | Path | None = None,
                   bank: str | Path | None = None, model_path: str | None = None) -> dict:
    """Greedy score on the trainer's held-out tasks (``train.eval_split``, ``train.eval_tasks``) of
    the model, or of the model acting with the latents of ``composer`` over ``bank``; cached, and
    scored again when the cache holds another agent (e.g. a run continued to a later step)."""
    from lopd import pipeline, runtime

    agent = {"model": model_path or cfg.model.name_or_path,
             "composer": str(composer) if composer else None, "bank": str(bank) if bank else None}
    if cache.exists():
        cached = json.loads(cache.read_text())
        if all(cached.get(k) == v for k, v in agent.items()):
            return cached
    device = runtime.setup(cfg.run)
    env = pipeline.get_env(cfg)
    policy, tokenizer, opened = pipeline.agent_policy(cfg, "model", model_path, composer, bank,
                                                      device)
    try:
        summary, _ = pipeline.evaluate(cfg, env, pipeline.held_out_tasks(cfg, env)[1], policy,
                                       tokenizer)
    finally:
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
    return _write(out, "internalisation", report, internalisation_markdown(report))


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


# ----------------------------------------------------------------------------------------------
# Sample efficiency


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
    return _write(out, "sample-efficiency", report, sample_efficiency_markdown(report))


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
            line, = ax.plot([x + shift for x in xs], [statistics.fmean(v) for v in values],
                            marker="o", ms=3, label=algo)
            ax.fill_between([x + shift for x in xs], [min(v) for v in values],
                            [max(v) for v in values], alpha=0.2, color=line.get_color())
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


# ----------------------------------------------------------------------------------------------
# Latent decoding

_ACTION = re.compile(r"^\d+\. ([A-Za-z_][\w]*)\((\{.*?\})?\)")


def procedure(trace: str) -> list[str]:
    """The procedure of a compact trace: each action's tool name and its argument keys, in order
    (entity values and results are left out)."""
    words = []
    for line in trace.splitlines():
        match = _ACTION.match(line)
        if not match:
            continue
        words.append(match.group(1))
        if match.group(2):
            try:
                words.extend(json.loads(match.group(2)))
            except ValueError:
                pass
    return words


PROJECTIONS = ("raw", "centred")
"""``raw``: the LM head applied to each latent; ``centred``: the same logits minus their mean over
every latent of the experiment's tasks under the same composer input, so the component all
latents share (which ranks the same frequent tokens first everywhere) is removed."""

CONDITIONS = ("task-conditioned", "unconditioned", "random experiences")
_CONDITION_NAMES = {"task-conditioned": "current task + retrieved experience",
                    "unconditioned": "retrieved experience only",
                    "random experiences": "current task + random experiences (recall of the "
                                          "retrieved procedure)"}


def latent_decoding(config, overrides: list[str], out: Path, tasks: int = 24, top: int = 5,
                    examples: int = 3) -> dict:
    """See the module docstring. Tasks are training tasks whose nearest retrieved experience shares
    their template (a structurally related retrieval), taken in order; the eval split is not
    touched. Both :data:`PROJECTIONS` are reported."""
    import torch

    from lopd import pipeline, runtime
    from lopd.composer import Composer
    from lopd.experience import template_of

    cfg = load_config(config, overrides)
    if not cfg.lopd.composer or not cfg.lopd.bank:
        raise ValueError("latent-decoding needs a composer and its bank: set lopd.composer and "
                         "lopd.bank (--composer, --bank)")
    if tasks < 1 or top < 1:
        raise ValueError(f"tasks and top must be >= 1, got {tasks}, {top}")
    out.mkdir(parents=True, exist_ok=True)
    device = runtime.setup(cfg.run)
    env = pipeline.get_env(cfg)
    model, tokenizer = pipeline.load_model(cfg, None, device)
    composer = Composer.load(cfg.lopd.composer, model, tokenizer).eval()
    head = model.get_output_embeddings()
    k, n_ret = composer.spec.num_latents, cfg.bank.n_ret
    vocab = head.weight.size(0)
    rng = random.Random(cfg.run.seed)

    def ids(words) -> set[int]:
        return {i for w in words for i in tokenizer.encode(w, add_special_tokens=False)}

    chosen, latents = [], {name: [] for name in CONDITIONS}
    with pipeline.open_bank(cfg, cfg.lopd.bank, device) as bank, torch.no_grad():
        entries = bank.entries
        for task in env.tasks("train"):
            if len(chosen) == tasks:
                break
            hits = bank.search([task.instruction], n_ret, exclude_task_ids=[task.task_id])[0]
            if len(hits) < n_ret or "template" not in task.meta or \
                    template_of(hits[0].entry.domain, hits[0].entry.meta) != \
                    template_of(task.domain, task.meta):
                continue
            others = [e for e in entries if e.task_id != task.task_id
                      and e.meta.get("template") != task.meta.get("template")]
            randoms = rng.sample(others, n_ret)
            chosen.append((task, [h.entry for h in hits], randoms))
            traces = [h.entry.trace for h in hits]
            for name, text, inputs in (("task-conditioned", task.instruction, traces),
                                       ("unconditioned", "", traces),
                                       ("random experiences", task.instruction,
                                        [e.trace for e in randoms])):
                latents[name].append(composer.encode([text], [inputs])[0].float())
        if not chosen:
            raise ValueError("no training task has a structurally related retrieval in "
                             f"{cfg.lopd.bank}")
        logits = {name: head(torch.stack(z).to(head.weight.dtype)).float()
                  for name, z in latents.items()}  # (tasks, n_ret·K, vocab)
    per_task = [{"task_id": task.task_id, "task": task.instruction,
                 "retrieved": [e.trace for e in retrieved], "random": [e.trace for e in randoms],
                 "top_tokens": {}, "procedure_recall": {}, "task_token_recall": {}, "chance": {}}
                for task, retrieved, randoms in chosen]
    for projection in PROJECTIONS:
        for name, scores in logits.items():
            if projection == "centred":
                scores = scores - scores.mean(dim=(0, 1), keepdim=True)
            top_ids = scores.topk(top, dim=-1).indices.tolist()
            for row, (task, retrieved, randoms), task_top in zip(per_task, chosen, top_ids):
                recall, specific, union, cover = [], [], set(), []
                for j in range(n_ret):
                    block = {i for latent in task_top[j * k:(j + 1) * k] for i in latent}
                    union |= block
                    cover.append(len(block) / vocab)
                    want = ids(procedure(retrieved[j].trace))
                    recall.append(len(want & block) / len(want) if want else 0.0)
                    # What a procedure of another template does not share with it.
                    own = want - ids(procedure(randoms[j].trace))
                    if own:
                        specific.append(len(own & block) / len(own))
                words = ids(re.findall(r"[A-Za-z0-9_]+", task.instruction))
                key = f"{projection}/{name}"
                row["procedure_recall"][key] = statistics.fmean(recall)
                row.setdefault("specific_recall", {})[key] = (statistics.fmean(specific)
                                                              if specific else 0.0)
                row["task_token_recall"][key] = len(words & union) / len(words) if words else 0.0
                row["chance"][key] = statistics.fmean(cover)
                row["top_tokens"][key] = [[tokenizer.decode([i]) for i in latent]
                                          for latent in task_top]
    summary = {f"{p}/{n}": {
        "procedure_recall": _stats([r["procedure_recall"][f"{p}/{n}"] for r in per_task]),
        "specific_recall": _stats([r["specific_recall"][f"{p}/{n}"] for r in per_task]),
        "task_token_recall": _stats([r["task_token_recall"][f"{p}/{n}"] for r in per_task]),
        "chance": statistics.fmean(r["chance"][f"{p}/{n}"] for r in per_task)}
        for p in PROJECTIONS for n in CONDITIONS}
    report = {"experiment": "latent-decoding", "config": str(config), "overrides": overrides,
              "composer": str(cfg.lopd.composer), "bank": str(cfg.lopd.bank), "n_ret": n_ret,
              "latents_per_experience": k, "top": top, "vocabulary": vocab,
              "tasks": len(per_task), "summary": summary, "per_task": per_task}
    plot_latent_decoding(report, out / "latent-decoding.png")
    return _write(out, "latent-decoding", report, latent_decoding_markdown(report, examples))


def latent_decoding_markdown(report: dict, examples: int) -> str:
    top, k = report["top"], report["latents_per_experience"]
    lines = ["| projection | composer input | procedure recall (mean ± std over tasks) | "
             "specific procedure recall | current-task token recall | chance (the projections' "
             "share of the vocabulary) |", "| --- | --- | --- | --- | --- | --- |"]
    for key, row in report["summary"].items():
        projection, name = key.split("/")
        (pm, ps), (tm, ts) = row["procedure_recall"], row["task_token_recall"]
        qm, qs = row["specific_recall"]
        lines.append(f"| {projection} | {_CONDITION_NAMES[name]} | {pm:.3f} ± {ps:.3f} | "
                     f"{qm:.3f} ± {qs:.3f} | {tm:.3f} ± {ts:.3f} | {row['chance']:.3f} |")
    lines += ["", f"{report['tasks']} training tasks whose nearest retrieval shares their "
              f"template; n_ret {report['n_ret']}, K {k} latents per experience, vocabulary "
              f"{report['vocabulary']}. Each latent is projected through the LM head and its top "
              f"{top} tokens kept; *raw* takes the logits as they are, *centred* subtracts their "
              "mean over all the tasks' latents under the same composer input. *Procedure "
              "recall*: the fraction of the token ids of a retrieved experience's tool names and "
              f"argument keys found among the top-{top} tokens of that experience's {k} latents "
              "(for the random row: the latents of a random experience of another template in "
              "its place, scored against the retrieved one's procedure). *Specific procedure "
              "recall*: the same over the procedure's token ids that the random experience's "
              "procedure lacks (what is particular to the retrieved one). *Current-task token "
              "recall*: the fraction of the current instruction's word tokens among all its "
              "latents' top tokens. *Chance*: the share of the vocabulary one experience's top "
              "tokens cover (the recall a random token set of that size would have on average).",
              "", "## Examples", ""]
    for row in report["per_task"][:examples]:
        lines += [f"### {row['task_id']}", "", f"Task: {row['task']}", "",
                  "Retrieved experience (the first of n_ret):", "", "```", row["retrieved"][0],
                  "```", ""]
        for projection in PROJECTIONS:
            for name in ("task-conditioned", "unconditioned"):
                key = f"{projection}/{name}"
                lines += [f"Top-{top} tokens of that experience's latents, {projection}, "
                          f"{_CONDITION_NAMES[name]} (procedure recall "
                          f"{row['procedure_recall'][key]:.2f}):", ""]
                for j, latent in enumerate(row["top_tokens"][key][:k]):
                    lines.append(f"- z{j + 1}: " + " ".join(
                        "`" + (t.strip() or repr(t)).replace("`", "'") + "`" for t in latent))
                lines.append("")
    lines += [f"Config: `{report['config']}` with "
              + (", ".join(f"`{o}`" for o in report["overrides"]) or "no overrides") + "."]
    return "\n".join(lines) + "\n"


def plot_latent_decoding(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("procedure_recall", "retrieved procedure"),
              ("specific_recall", "its tokens another template lacks"),
              ("task_token_recall", "the current task's tokens"))
    fig, axes = plt.subplots(1, len(panels), figsize=(14, 3.9), sharey=True)
    width = 0.38
    for ax, (key, title) in zip(axes, panels):
        for p, projection in enumerate(PROJECTIONS):
            rows = [report["summary"][f"{projection}/{n}"] for n in CONDITIONS]
            xs = [i + (p - 0.5) * width for i in range(len(CONDITIONS))]
            ax.bar(xs, [r[key][0] for r in rows], width, yerr=[r[key][1] for r in rows],
                   capsize=3, alpha=0.7, label=projection)
            ax.scatter(xs, [r["chance"] for r in rows], marker="_", s=200, color="k",
                       zorder=3, label="chance" if p == 0 else None)
        ax.set_xticks(range(len(CONDITIONS)), CONDITIONS, fontsize=8)
        ax.set_title(f"share of {title}\namong the latents' top tokens", fontsize=9)
        ax.legend(fontsize=7)
    axes[0].set_ylim(bottom=0)
    fig.suptitle(f"latent decoding: top-{report['top']} LM-head tokens per latent, "
                 f"{report['tasks']} tasks (mean ± std over tasks; black: chance)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
