"""The whole pipeline on the embedded tiny default, scaled down to minutes (`lopd quickstart`).

Stages, each written into ``OUT`` (``run.output_dir/quickstart``) and reused when a re-run finds it
finished (``--fresh`` redoes everything):

1. the base model — by default the embedded one, built by ``lopd base`` (its training log ships
   beside it); with ``build_base`` the quickstart builds it here with the config's ``base`` recipe
   (tokenizer, Qwen3, SFT) and uses that instead: ~2 minutes on one GPU, hours on a 2-core CPU;
2. the environment's splits;
3. harness check: the oracle replays the gold solution of every held-out task;
4. the base model on the held-out tasks (greedy);
5. an experience bank from the base's sampled rollouts on the first ``bank_tasks`` training tasks;
6. the composer's cold start on the bank's successes;
7. LOPD for ``lopd_steps`` steps (resumed if interrupted);
8. ``report.md`` with base vs. LOPD and the reward curve ``lopd/training.png``.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

from lopd.config import Config
from lopd.tables import domain_rows, format_table, key_value_table

DONE = ".done"


def _done(folder: Path) -> bool:
    return (folder / DONE).exists()


def _mark_done(folder: Path, figures: dict) -> dict:
    (folder / DONE).write_text(json.dumps(figures, indent=1))
    return figures


def run(cfg: Config, bank_tasks: int = 600, cold_start_steps: int = 60, lopd_steps: int = 8,
        fresh: bool = False, build_base: bool = False) -> dict:
    from lopd import agent, models, runtime, trainer
    from lopd.envs import get_env
    from lopd.experiments.compare import train_or_reuse
    from lopd.rollout import SamplingParams, TransformersEngine

    out = Path(cfg.run.output_dir) / "quickstart"
    if fresh:
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    device = runtime.setup(cfg.run)
    dtype = runtime.resolve_dtype(cfg.run.dtype, device)
    started = time.perf_counter()

    if build_base:
        base_dir = out / "base"
        if not _done(base_dir):
            from lopd.base_model import build_base as build

            shutil.rmtree(base_dir, ignore_errors=True)
            _mark_done(base_dir, build(cfg, base_dir))
        cfg = replace(cfg, model=replace(cfg.model, name_or_path=str(base_dir)))
        title = f"1. base model (built here by the `lopd base` recipe -> {base_dir})"
    else:
        title = "1. base model (the embedded default, built by `lopd base`; --build-base rebuilds it)"
    info = models.model_info(cfg.model.name_or_path)
    print(key_value_table({k: info[k] for k in ("path", "architecture", "parameters", "hidden_size",
                                                "num_hidden_layers", "vocab_size")}, title=title))

    env = get_env(cfg.env.name, **cfg.env.kwargs())
    eval_tasks = env.tasks("eval")[: cfg.train.eval_tasks or None]
    print(f"\n2. {cfg.env.name}: {len(env.tasks('train'))} training tasks, "
          f"{len(env.tasks('eval'))} held-out tasks")

    model, tokenizer = models.load_model(cfg.model.name_or_path, device=device, dtype=dtype)
    model.eval()
    r = cfg.rollout

    def episodes(tasks, policy, progress=True):
        return agent.rollout_episodes(env, tasks, policy, tokenizer, r, progress=progress)

    def model_policy(temperature: float):
        params = SamplingParams.from_config(r, temperature, cfg.run.seed)
        return agent.ModelPolicy(TransformersEngine(model, tokenizer), tokenizer, params)

    oracle = agent.summarize(episodes(eval_tasks, agent.OraclePolicy(), progress=False))
    print(f"\n3. harness check: the oracle scores mean reward {oracle['mean_reward']:.3f}, "
          f"success {oracle['success_rate']:.3f} on the held-out tasks")

    base_path = out / "base_eval.json"
    if base_path.exists():
        base = json.loads(base_path.read_text())
    else:
        base = agent.summarize(episodes(eval_tasks, model_policy(r.eval_temperature)))
        base_path.write_text(json.dumps(base, indent=1))
    print()
    print(format_table(["domain", "episodes", "mean reward", "success rate"], domain_rows(base),
                       title="4. base model on the held-out tasks (greedy)"))

    bank_dir = out / "bank"
    bank_figures = _bank_stage(cfg, env, bank_dir, bank_tasks, episodes, model_policy, device)
    print(f"\n5. experience bank: {bank_figures['entries']} successes of "
          f"{bank_figures['rollouts']} sampled rollouts on training tasks -> {bank_dir}")

    composer_dir = out / "composer"
    cold = _cold_start_stage(cfg, bank_dir, composer_dir, cold_start_steps, device, dtype)
    print(f"\n6. composer cold start: {cold['steps']} steps, teacher NLL {cold['first_nll']:.3f} -> "
          f"{cold['final_nll']:.3f} -> {composer_dir}")

    run_cfg = cfg.with_overrides([f"train.max_steps={lopd_steps}",
                                  f"train.eval_every={max(1, lopd_steps // 2)}",
                                  f"train.save_every={lopd_steps}",
                                  f"lopd.composer={composer_dir}", f"lopd.bank={bank_dir}"])
    train_or_reuse(run_cfg, out / "lopd", "lopd")
    evals = trainer.read_jsonl(out / "lopd" / trainer.EVAL_FILE)
    final = evals[-1]
    rows = [["base", base["mean_reward"], base["success_rate"], 0],
            [f"LOPD, {lopd_steps} steps", final["mean_reward"], final["success_rate"],
             final["generations"]]]
    print()
    print(format_table(["model", "held-out mean reward", "held-out success", "training rollouts"],
                       rows, title="7. LOPD (a scaled-down demo, not a result)"))
    minutes = (time.perf_counter() - started) / 60
    report = _report(cfg, info, oracle, base, bank_figures, cold, rows, evals, out, lopd_steps)
    (out / "report.md").write_text(report)
    figures = {"model": info["path"], "oracle": oracle["success_rate"],
               "base": {"mean_reward": base["mean_reward"], "success_rate": base["success_rate"]},
               "lopd": {"mean_reward": final["mean_reward"], "success_rate": final["success_rate"],
                        "steps": lopd_steps, "generations": final["generations"]},
               "bank": bank_figures, "cold_start": cold, "minutes": round(minutes, 1)}
    (out / "summary.json").write_text(json.dumps(figures, indent=1))
    print(f"\n8. report: {out / 'report.md'} (reward curve {out / 'lopd' / trainer.PLOT_FILE}), "
          f"{minutes:.1f} minutes.\n   held-out mean reward: base {base['mean_reward']:.4f} -> LOPD "
          f"{final['mean_reward']:.4f}; success: base {base['success_rate']:.3f} -> LOPD "
          f"{final['success_rate']:.3f}")
    return figures


def _bank_stage(cfg, env, bank_dir: Path, n_tasks: int, episodes, model_policy, device) -> dict:
    from lopd.experience import ExperienceBank, load_embedder, spec_from_config

    if _done(bank_dir):
        return json.loads((bank_dir / DONE).read_text())
    shutil.rmtree(bank_dir, ignore_errors=True)
    tasks = env.tasks("train")[:n_tasks]
    rollouts = episodes(tasks, model_policy(cfg.rollout.temperature))
    embedder = load_embedder(spec_from_config(cfg.bank, cfg.model.name_or_path),
                             batch_size=cfg.bank.embed_batch_size, device=device)
    with ExperienceBank.create(bank_dir, embedder, cfg.bank.reward_threshold,
                               cfg.bank.max_observation_chars) as bank:
        bank.add_rollouts(rollouts, {t.task_id: t for t in tasks}, source="model:quickstart")
        return _mark_done(bank_dir, {"rollouts": len(rollouts), "entries": len(bank)})


def _cold_start_stage(cfg, bank_dir: Path, composer_dir: Path, steps: int, device, dtype) -> dict:
    from lopd import models
    from lopd.algorithms import cold_start as cs
    from lopd.composer import Composer
    from lopd.experience import ExperienceBank

    if _done(composer_dir):
        return json.loads((composer_dir / DONE).read_text())
    shutil.rmtree(composer_dir, ignore_errors=True)
    base, tokenizer = models.load_model(cfg.model.name_or_path, device=device, dtype=dtype)
    composer = Composer(base.eval(), tokenizer, cfg.composer)
    with ExperienceBank.open(bank_dir, batch_size=cfg.bank.embed_batch_size, device=device) as bank:
        if len(bank) <= cfg.bank.n_ret:
            raise ValueError(f"the base solved {len(bank)} of the training tasks rolled out for the "
                             f"bank; the cold start needs more than bank.n_ret={cfg.bank.n_ret} "
                             "successes. Use a stronger base (a longer `lopd base` run) or more "
                             "--bank-tasks")
        history = cs.cold_start(composer, bank, bank.stored_rollouts(),
                                replace(cfg.cold_start, max_steps=steps), cfg.bank.n_ret,
                                seed=cfg.run.seed)
    composer.save(composer_dir)
    cs.save_history(history, composer_dir, {"config": cfg.to_dict()})
    return _mark_done(composer_dir, {"steps": len(history), "first_nll": history[0]["nll"],
                                     "final_nll": history[-1]["nll"]})


def _report(cfg, info, oracle, base, bank, cold, rows, evals, out: Path, lopd_steps: int) -> str:
    lines = ["# lopd quickstart", "",
             f"Base model: `{info['path']}` ({info['parameters']:,} parameters), environment "
             f"{cfg.env.name}; held-out = the first {base['episodes']} eval-split tasks.", "",
             f"- harness: oracle success {oracle['success_rate']:.3f} (must be 1.000)",
             f"- bank: {bank['entries']} successes of {bank['rollouts']} sampled base rollouts on "
             "training tasks",
             f"- composer cold start: {cold['steps']} steps, teacher NLL {cold['first_nll']:.3f} → "
             f"{cold['final_nll']:.3f}", "",
             "| model | held-out mean reward | held-out success | training rollouts |",
             "| --- | --- | --- | --- |"]
    lines += [f"| {m} | {rw:.4f} | {sr:.4f} | {g} |" for m, rw, sr, g in rows]
    lines += ["", "Held-out mean reward during LOPD:", ""]
    lines += [f"- step {e['step']} ({e['generations']} rollouts): {e['mean_reward']:.4f}"
              for e in evals]
    lines += ["", f"{lopd_steps} LOPD steps is a demonstration of the pipeline, not a result; the "
              "measured comparison (3 seeds, full budget) is in the README.",
              "", "![reward curve](lopd/training.png)", ""]
    return "\n".join(lines)
