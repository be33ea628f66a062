"""The method end to end on the embedded tiny default, in minutes (`lopd quickstart`, `make demo`).

Stages, each written into ``OUT`` (``run.output_dir/quickstart``) and reused when a re-run finds it
finished (``fresh`` redoes everything):

1. the base model — by default the embedded one, built by ``lopd base`` (its training log ships
   beside it); with ``build_base`` the quickstart builds it here with the config's ``base`` recipe
   (tokenizer, Qwen3, SFT) and uses that instead: ~2 minutes on one GPU, hours on a 2-core CPU;
2. the environment's splits;
3. harness check: the oracle replays the gold solution of every held-out task;
4. the base model on the held-out tasks (greedy);
5. the experience bank — by default a copy of the one shipped in the package
   (:data:`lopd.stages.EMBEDDED_BANK`, never written to); with ``rebuild`` a new one from two
   sampling passes of the base (seeds ``run.seed`` and ``run.seed + 1``) over the training tasks;
6. the cold-started composer — by default the one shipped in the package
   (:data:`lopd.stages.EMBEDDED_COMPOSER`); with ``rebuild`` a full cold start on the new bank
   with the config's ``cold_start`` section (no eval-split measurement);
7. LOPD for ``lopd_steps`` steps, evaluated midway and at the end (resumed if interrupted);
8. ``report.md`` and ``summary.json``: base vs. LOPD on the held-out tasks, the training rollouts
   LOPD used, and apart from them the rollouts spent on the bank and the cold start.

The cold start is what takes long (the embedded composer's cost is recorded in the assets'
``provenance.json``); the embedded assets let the demo spend its minutes on LOPD itself.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

from lopd import pipeline, stages
from lopd.config import Config
from lopd.tables import domain_rows, format_table, key_value_table

DONE = ".done"
RESULTS = "docs/results/"


def _stage(folder: Path, origin: str, build) -> tuple[dict, bool]:
    """(figures, whether built now) of the stage in ``folder`` made from ``origin``: a finished
    one is reused; otherwise the folder is cleared, ``build()`` fills it and its figures are
    recorded."""
    marker = folder / DONE
    if marker.exists():
        figures = json.loads(marker.read_text())
        if figures.get("origin") == origin:
            return figures, False
    shutil.rmtree(folder, ignore_errors=True)
    figures = {"origin": origin, **build()}
    folder.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps(figures, indent=1))
    return figures, True


def verdict(base_reward: float, lopd_reward: float, steps: int) -> str:
    """LOPD's final held-out mean reward against the base's, said plainly, with the caveat."""
    diff = lopd_reward - base_reward
    if diff < 0:
        head = (f"LOPD is below the base after {steps} steps: held-out mean reward "
                f"{lopd_reward:.4f} vs {base_reward:.4f} ({diff:+.4f}).")
    elif diff > 0:
        head = (f"LOPD is above the base after {steps} steps by {diff:.4f} held-out mean reward "
                f"({lopd_reward:.4f} vs {base_reward:.4f}).")
    else:
        head = f"LOPD equals the base after {steps} steps: held-out mean reward {lopd_reward:.4f}."
    return (f"{head} This is one seed of a short run, not a measurement; the measured comparison "
            f"(several seeds, the full budget) is in {RESULTS}.")


def _composer_figures(folder: Path) -> dict:
    """Steps and teacher NLL of the cold start recorded beside a composer (``cold_start.json``)."""
    path = folder / "cold_start.json"
    if not path.is_file():
        return {}
    record = json.loads(path.read_text())
    history = record.get("history") or []
    figures = {k: v for k, v in (record.get("figures") or {}).items()
               if k in ("nll_per_action_token", "held_out_successes", "n_ret")}
    if history:
        figures.update(steps=len(history), first_nll=history[0]["nll"],
                       final_nll=history[-1]["nll"])
    return figures


def _known(value) -> str:
    return "an unrecorded number of" if value == "unknown" else str(value)


def _commands(value) -> str:
    return "; ".join(value) if isinstance(value, list) else str(value)


def run(cfg: Config, lopd_steps: int = 70, rebuild: bool = False, bank_tasks: int = 0,
        fresh: bool = False, build_base: bool = False) -> dict:
    """The stages of the module docstring; returns the figures written to ``summary.json``.

    ``build_base`` implies ``rebuild``: the embedded composer and bank belong to the embedded base.
    """
    from lopd import runtime, trainer
    from lopd.experiments.runs import check_reusable, train_or_reuse

    if lopd_steps < 1:
        raise ValueError(f"lopd steps must be >= 1, got {lopd_steps}")
    rebuild = rebuild or build_base
    if not rebuild:
        embedded_composer, embedded_bank = stages.embedded_assets(cfg)
    out = Path(cfg.run.output_dir) / "quickstart"
    if fresh:
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    runtime.setup(cfg.run)
    started = time.perf_counter()

    if build_base:
        base_dir = out / "base"
        if not (base_dir / DONE).exists():
            from lopd.base_model import build_base as build

            shutil.rmtree(base_dir, ignore_errors=True)
            figures = build(cfg, base_dir)
            (base_dir / DONE).write_text(json.dumps(figures, indent=1))
        cfg = replace(cfg, model=replace(cfg.model, name_or_path=str(base_dir)))
        title = f"1. base model (built here by the `lopd base` recipe -> {base_dir})"
    else:
        title = "1. base model (the embedded default, built by `lopd base`; --build-base rebuilds it)"
    info = pipeline.model_info(cfg.model.name_or_path)
    print(key_value_table({k: info[k] for k in ("path", "architecture", "parameters", "hidden_size",
                                                "num_hidden_layers", "vocab_size")}, title=title))

    env = stages.get_env(cfg)
    train_tasks, eval_tasks = stages.held_out_tasks(cfg, env)
    print(f"\n2. {cfg.env.name}: {len(train_tasks)} training tasks, {len(env.tasks('eval'))} "
          f"held-out tasks (the first {len(eval_tasks)} are evaluated)")

    policy, tokenizer = stages.make_policy(cfg, "oracle")
    oracle, _ = stages.evaluate(cfg, env, eval_tasks, policy, tokenizer, progress=False)
    print(f"\n3. harness check: the oracle scores mean reward {oracle['mean_reward']:.3f}, "
          f"success {oracle['success_rate']:.3f} on the held-out tasks")

    # Cached with what it depends on, so a re-run with another model or other tasks evaluates again.
    base_path = out / "base_eval.json"
    key = {"model": cfg.model.name_or_path, "rollout": cfg.to_dict()["rollout"],
           "tasks": [t.task_id for t in eval_tasks]}
    cached = json.loads(base_path.read_text()) if base_path.exists() else {}
    if cached.get("key") == key:
        base = cached["summary"]
    else:
        policy, tokenizer = stages.make_policy(cfg, "model")
        base, _ = stages.evaluate(cfg, env, eval_tasks, policy, tokenizer)
        base_path.write_text(json.dumps({"key": key, "summary": base}, indent=1))
    temperature = cfg.rollout.eval_temperature
    print()
    print(format_table(["domain", "episodes", "mean reward", "success rate"], domain_rows(base),
                       title="4. base model on the held-out tasks ("
                       + ("greedy)" if temperature == 0 else f"temperature {temperature:g})")))

    bank_dir, composer_dir = out / "bank", out / "composer"
    if rebuild:
        seeds = (cfg.run.seed, cfg.run.seed + 1)
        bank, new_bank = _stage(bank_dir, "rebuilt", lambda: pipeline.build_bank(
            cfg, bank_dir, limit=bank_tasks, seeds=seeds))
        if new_bank:  # a composer fitted to another bank is stale
            shutil.rmtree(composer_dir, ignore_errors=True)
        print(f"\n5. experience bank (built here): {bank['entries']} successes of "
              f"{bank['rollouts']} sampled base rollouts ({len(seeds)} passes over "
              f"{bank['tasks']} training tasks) -> {bank_dir}")
        cold_cfg = cfg.with_overrides(["cold_start.validation_tasks=0"])
        cold, new_composer = _stage(composer_dir, "rebuilt",
                                    lambda: pipeline.cold_start(cold_cfg, bank_dir, composer_dir))
        new_inputs = new_bank or new_composer
        provenance = {"bank_rollouts": bank["rollouts"], "cold_start_steps": cold["steps"],
                      "commands": "this quickstart (--rebuild)"}
        print(f"\n6. composer cold start (built here): {cold['steps']} steps on the bank's "
              f"successes, teacher NLL {cold['first_nll']:.4f} -> {cold['final_nll']:.4f} "
              f"-> {composer_dir}")
    else:
        provenance = stages.read_provenance(embedded_composer, embedded_bank)

        def copy_bank() -> dict:
            # The package's bank is never opened in place: opening writes SQLite's WAL files.
            shutil.copytree(embedded_bank, bank_dir)
            with stages.open_bank(cfg, bank_dir) as opened:
                return {"entries": len(opened), "source": str(embedded_bank),
                        "rollouts": provenance["bank_rollouts"]}

        bank, new_inputs = _stage(bank_dir, "embedded", copy_bank)
        composer_dir = embedded_composer
        cold = {"origin": "embedded", "composer": str(composer_dir),
                **_composer_figures(composer_dir)}
        cold["steps"] = (provenance["cold_start_steps"] if provenance["cold_start_steps"] != "unknown"
                         else cold.get("steps", "unknown"))
        print(f"\n5. experience bank (embedded): {bank['entries']} successes of "
              f"{_known(provenance['bank_rollouts'])} base rollouts on training tasks -> copied to "
              f"{bank_dir}\n   provenance: {_commands(provenance['commands'])}")
        print(f"\n6. composer (embedded): cold-started for {_known(cold['steps'])} steps on that "
              f"bank -> {composer_dir}")
    if cold.get("nll_per_action_token"):
        table = cold["nll_per_action_token"]
        plain = table["no reference"]
        print(format_table(["teacher reference", "NLL / action token", "vs no reference"],
                           [[name, nll, nll - plain] for name, nll in table.items()],
                           title=f"   what the latents tell the frozen teacher "
                           f"({cold.get('held_out_successes', '?')} held-out successes)"))

    run_cfg = cfg.with_overrides([f"train.max_steps={lopd_steps}",
                                  f"train.eval_every={max(1, min(10, lopd_steps // 2))}",
                                  f"train.save_every={max(1, lopd_steps // 4)}",
                                  f"lopd.composer={composer_dir}", f"lopd.bank={bank_dir}"])
    run_dir = out / "lopd"
    try:
        check_reusable(run_cfg, run_dir)
    except ValueError:
        new_inputs = True
        print(f"\n   (the LOPD run in {run_dir} had other settings: it starts again)")
    if new_inputs:  # a run on other inputs or settings is not this one to resume
        shutil.rmtree(run_dir, ignore_errors=True)
    train_or_reuse(run_cfg, run_dir, "lopd")
    evals = trainer.read_jsonl(out / "lopd" / trainer.EVAL_FILE)
    final = evals[-1]
    rows = [["base", base["mean_reward"], base["success_rate"], 0],
            [f"LOPD, {lopd_steps} steps", final["mean_reward"], final["success_rate"],
             final["generations"]]]
    print()
    print(format_table(["model", "held-out mean reward", "held-out success", "training rollouts"],
                       rows, title=f"7. LOPD for {lopd_steps} steps "
                       f"({run_cfg.train.rollouts_per_step} rollouts each)"))
    before = (f"before LOPD: {_known(provenance['bank_rollouts'])} base rollouts built the bank "
              f"({bank['entries']} successes stored); the composer's cold start ran "
              f"{_known(cold['steps'])} steps on those successes (no new training rollouts)")
    said = verdict(base["mean_reward"], final["mean_reward"], lopd_steps)
    minutes = (time.perf_counter() - started) / 60
    origin = "rebuilt" if rebuild else "embedded"
    (out / "report.md").write_text(_report(cfg, info, oracle, base, rows, evals, before, said,
                                           origin, provenance))
    figures = {"model": info["path"], "oracle": oracle["success_rate"],
               "base": {"mean_reward": base["mean_reward"], "success_rate": base["success_rate"]},
               "lopd": {"mean_reward": final["mean_reward"], "success_rate": final["success_rate"],
                        "steps": lopd_steps, "generations": final["generations"]},
               "assets": origin, "bank": bank, "cold_start": cold,
               "before_lopd": {k: provenance[k] for k in stages.PROVENANCE_KEYS},
               "verdict": said, "minutes": round(minutes, 1)}
    (out / "summary.json").write_text(json.dumps(figures, indent=1))
    print(f"\n   {before}.")
    print(f"\n8. report: {out / 'report.md'} (reward curve {out / 'lopd' / trainer.PLOT_FILE}), "
          f"{minutes:.1f} minutes.\n   held-out mean reward: base {base['mean_reward']:.4f} -> LOPD "
          f"{final['mean_reward']:.4f}; success: base {base['success_rate']:.3f} -> LOPD "
          f"{final['success_rate']:.3f}\n   {said}")
    return figures


def _report(cfg, info, oracle, base, rows, evals, before: str, said: str, origin: str,
            provenance: dict) -> str:
    assets = ("the composer and bank shipped in the package (`lopd quickstart --rebuild` builds "
              "both here)" if origin == "embedded" else "a bank and composer built by this run")
    lines = ["# lopd quickstart", "",
             f"Base model: `{info['path']}` ({info['parameters']:,} parameters), environment "
             f"{cfg.env.name}; held-out = {base['episodes']} tasks of the "
             f"{cfg.train.eval_split} split. LOPD starts from {assets}.", "",
             f"- harness: oracle success {oracle['success_rate']:.3f} (must be 1.000)",
             f"- {before[0].upper()}{before[1:]}.",
             f"- How they were built: {_commands(provenance['commands'])}", "",
             "| model | held-out mean reward | held-out success | training rollouts |",
             "| --- | --- | --- | --- |"]
    lines += [f"| {m} | {rw:.4f} | {sr:.4f} | {g} |" for m, rw, sr, g in rows]
    lines += ["", "Held-out mean reward during LOPD:", ""]
    lines += [f"- step {e['step']} ({e['generations']} rollouts): {e['mean_reward']:.4f}"
              for e in evals]
    lines += ["", said, "", "![reward curve](lopd/training.png)", ""]
    return "\n".join(lines)
