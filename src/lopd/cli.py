"""The ``lopd`` command.

Each subcommand is a thin wrapper: it parses arguments, loads the config and calls library code.
Commands that measure something print a table and, with ``--json PATH``, write the same figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from lopd import __version__
from lopd.algorithms import algorithm_names
from lopd.config import ConfigError, describe, load_config
from lopd.tables import domain_rows, format_table, key_value_table, write_json

def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="tiny",
                   help="preset name (tiny) or path to a YAML config (default: tiny)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value; repeatable, e.g. --set train.learning_rate=3e-4")


def _add_lopd_inputs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--composer", help="cold-started composer folder (LOPD; sets lopd.composer)")
    p.add_argument("--bank", help="experience bank folder (LOPD; sets lopd.bank)")


def _lopd_input_overrides(args) -> list[str]:
    """``--composer`` / ``--bank`` as config overrides, followed by the ``--set`` ones."""
    sets = []
    if args.composer:
        sets.append(f"lopd.composer={args.composer}")
    if args.bank:
        sets.append(f"lopd.bank={args.bank}")
    return sets + list(args.overrides)


def _add_json_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", dest="json_path", metavar="PATH",
                   help="also write the printed figures to PATH as JSON")


# ----------------------------------------------------------------------------------------------
# Commands


def cmd_model_new(args) -> int:
    from lopd import runtime
    from lopd.corpus import read_corpus, synthetic_transcripts

    cfg = load_config(args.config, args.overrides)
    runtime.setup(cfg.run)
    corpus = read_corpus(args.corpus) if args.corpus else synthetic_transcripts(seed=cfg.run.seed)
    figures = build_and_save(cfg, corpus, Path(args.out))
    print(key_value_table(figures, title=f"built {figures['path']}"))
    write_json(args.json_path, figures)
    return 0


def build_and_save(cfg, corpus: list[str], out: Path) -> dict:
    """Train a tokenizer on ``corpus``, build the model of ``cfg.model.architecture`` and save both."""
    from lopd import models

    start = time.perf_counter()
    tokenizer = models.train_tokenizer(corpus, vocab_size=cfg.model.vocab_size)
    model = models.build_model(tokenizer, preset=cfg.model.architecture, seed=cfg.run.seed,
                               max_position_embeddings=cfg.model.max_position_embeddings)
    models.save_model(model, tokenizer, out)
    return {
        "path": str(out),
        "architecture": cfg.model.architecture,
        "parameters": models.count_parameters(model),
        "vocab_size": len(tokenizer),
        "corpus_texts": len(corpus),
        "seed": cfg.run.seed,
        "seconds": round(time.perf_counter() - start, 2),
    }


def cmd_model_info(args) -> int:
    from lopd import models

    info = models.model_info(args.path)
    print(key_value_table(info, title=f"model {info['path']}"))
    write_json(args.json_path, info)
    return 0


def cmd_config(args) -> int:
    cfg = load_config(args.config, args.overrides)
    values = cfg.to_dict()
    rows = []
    for key, default, help_text in describe():
        section, name = key.split(".", 1)
        rows.append([key, repr(values[section][name]), help_text])
    print(format_table(["key", "value", "meaning"], rows, title=f"config {args.config}"))
    write_json(args.json_path, values)
    return 0


def cmd_quickstart(args) -> int:
    from lopd.experiments import quickstart

    cfg = load_config(args.config, args.overrides)
    print(f"lopd {__version__} quickstart -> {Path(cfg.run.output_dir) / 'quickstart'}\n")
    figures = quickstart.run(cfg, args.bank_tasks, args.cold_start_steps, args.lopd_steps,
                             fresh=args.fresh, build_base=args.build_base)
    write_json(args.json_path, figures)
    return 0


CODE_ENVS = ("codeworld", "humaneval")


def _config_for_env(args):
    """The config for ``--env``: the code environments use the tiny-code preset (the code model)
    unless ``--config`` names another."""
    name = "tiny-code" if args.env in CODE_ENVS and args.config == "tiny" else args.config
    env = [f"env.name={args.env}"] if args.env else []
    return load_config(name, [*env, *args.overrides])


def _pass_at_k(rollouts, samples: int) -> dict:
    """pass@k (unbiased estimator, all tests passing) over tasks sampled ``samples`` times each."""
    from lopd.envs.codegen import pass_at_k

    passed: dict[str, list[bool]] = {}
    for r in rollouts:
        passed.setdefault(r.task_id, []).append(r.success)
    ks = [k for k in (1, 5, 10, 100) if k <= samples]
    return {"samples_per_task": samples, "pass_at_k": {
        f"pass@{k}": sum(pass_at_k(len(v), sum(v), k) for v in passed.values()) / len(passed)
        for k in ks}}


def _run(env, tasks, policy, tokenizer, cfg, progress: bool):
    from lopd import agent

    return agent.rollout_episodes(env, tasks, policy, tokenizer, cfg.rollout, progress=progress)


def _write_episodes(path: Path, rollouts) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in rollouts:
            f.write(json.dumps(r.to_dict()) + "\n")


def _read_episodes(path: Path):
    """Rollouts from a JSONL file written by `--episodes`; a bad line is named, not a traceback."""
    from lopd.agent import Rollout

    rollouts = []
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rollouts.append(Rollout.from_dict(json.loads(line)))
            except (ValueError, TypeError, KeyError) as exc:
                raise ValueError(f"{path}:{number}: not a rollout record "
                                 f"({type(exc).__name__}: {exc})") from None
    return rollouts


def cmd_tasks(args) -> int:
    from lopd.envs import get_env

    cfg = _config_for_env(args)
    env = get_env(cfg.env.name, **cfg.env.kwargs())
    tasks = env.tasks(args.split)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w") as f:
            for task in tasks:
                f.write(json.dumps(task.to_dict()) + "\n")
    stats = env.stats(args.split)
    rows = [[domain, n] for domain, n in sorted(stats["domains"].items())]
    rows.append(["all", stats["tasks"]])
    print(format_table(["domain", "tasks"], rows, title=f"{cfg.env.name} / {args.split}"
                       + (f" -> {args.out}" if args.out else "")))
    if "oracle_calls" in stats:
        calls = [[n, count] for n, count in sorted(stats["oracle_calls"].items(),
                                                    key=lambda kv: int(kv[0]))]
        print()
        print(format_table(["oracle tool calls", "tasks"], calls,
                           title=f"{stats['reports']} report tasks; {len(stats['templates'])} "
                           "templates"))
    else:
        print(key_value_table({k: v for k, v in stats.items() if k not in ("tasks", "domains")}))
    write_json(args.json_path, {"env": cfg.env.name, "split": args.split, **stats})
    return 0


def cmd_eval(args) -> int:
    from lopd import agent, runtime
    from lopd.envs import get_env

    cfg = _config_for_env(args)
    args.model = args.model or cfg.model.name_or_path
    if args.subset:
        args.split = "eval" if args.subset == "all" else args.subset
    device = runtime.setup(cfg.run)
    env = get_env(cfg.env.name, **cfg.env.kwargs())
    tasks = env.tasks(args.split)
    if args.limit:
        tasks = tasks[: args.limit]
    if bool(args.composer) != bool(args.bank):
        raise ValueError("--composer and --bank go together (the Base + Composer agent)")
    bank = None
    if args.composer:
        policy, tokenizer, bank = _composer_policy(args, cfg, device)
    else:
        policy, tokenizer = _make_policy(args.agent, args.model, cfg, device)
    code = cfg.env.name in CODE_ENVS
    if args.samples < 1 or (args.samples > 1 and not code):
        raise ValueError(f"--samples must be >= 1, and > 1 only for {', '.join(CODE_ENVS)}")
    if args.samples > 1 and cfg.rollout.eval_temperature <= 0 and args.agent == "model":
        raise ValueError("--samples > 1 needs sampling: add --set rollout.eval_temperature=0.8 "
                         "(greedy samples are all the same)")
    start = time.perf_counter()
    try:
        rollouts = _run(env, [t for t in tasks for _ in range(args.samples)], policy, tokenizer,
                        cfg, progress=True)
    finally:
        if bank is not None:
            bank.close()
    seconds = time.perf_counter() - start
    summary = agent.summarize(rollouts)
    if code:
        summary.update(_pass_at_k(rollouts, args.samples))
    summary.update({"agent": "base+composer" if args.composer else args.agent,
                    "composer": args.composer, "bank": args.bank,
                    "model": args.model if args.agent == "model" else None,
                    "env": cfg.env.name, "split": args.split, "seconds": round(seconds, 1)})
    if args.episodes:
        _write_episodes(Path(args.episodes), rollouts)
    who = f"base {args.model} + composer {args.composer}" if args.composer else args.agent
    title = (f"{who}{' ' + args.model if who == 'model' else ''} on "
             f"{cfg.env.name}/{args.split} ({len(tasks)} tasks, {seconds:.0f}s)")
    print(format_table(["domain", "episodes", "mean reward", "success rate"], domain_rows(summary),
                       title=title))
    if code:
        print("  ".join(f"{k} {v:.4f}" for k, v in summary["pass_at_k"].items()))
    write_json(args.json_path, summary)
    return 0


def _make_policy(kind: str, model_path: str, cfg, device, temperature: float | None = None):
    """The acting policy of `lopd eval` and the tokenizer its tokens are counted with.

    The model samples at ``rollout.eval_temperature`` unless ``temperature`` is given.
    """
    from lopd import agent, models, runtime
    from lopd.rollout import TransformersEngine

    if kind in ("oracle", "random"):
        tokenizer = models.load_tokenizer(models.resolve_model_path(model_path))
        if kind == "oracle":
            return agent.OraclePolicy(), tokenizer
        return agent.RandomPolicy(seed=cfg.run.seed), tokenizer
    model, tokenizer = models.load_model(model_path, device=device,
                                         dtype=runtime.resolve_dtype(cfg.run.dtype, device))
    model.eval()
    params = _sampling(cfg, cfg.rollout.eval_temperature if temperature is None else temperature)
    return agent.ModelPolicy(TransformersEngine(model, tokenizer), tokenizer, params), tokenizer


def _sampling(cfg, temperature: float):
    """Sampling settings of the config's rollout section at ``temperature``, seeded by run.seed."""
    from lopd.rollout import SamplingParams

    return SamplingParams.from_config(cfg.rollout, temperature, cfg.run.seed)


def _composer_policy(args, cfg, device):
    """The "Base + Composer" agent: the base acting with latents of retrieved experiences."""
    from lopd import models, runtime
    from lopd.composer import Composer, ComposerPolicy
    from lopd.experience import ExperienceBank

    if args.agent != "model":
        raise ValueError("--composer needs --agent model")
    model, tokenizer = models.load_model(args.model, device=device,
                                         dtype=runtime.resolve_dtype(cfg.run.dtype, device))
    composer = Composer.load(args.composer, model.eval(), tokenizer).eval()
    bank = ExperienceBank.open(args.bank, batch_size=cfg.bank.embed_batch_size, device=device)
    params = _sampling(cfg, cfg.rollout.eval_temperature)
    return ComposerPolicy(composer, bank, params, cfg.bank.n_ret), tokenizer, bank


def cmd_base(args) -> int:
    from lopd.base_model import build_base

    cfg = _config_for_env(args)
    result = build_base(cfg, args.out, resume=args.resume)
    print(key_value_table(result, title=f"base model -> {args.out}"))
    write_json(args.json_path, result)
    return 0


# ----------------------------------------------------------------------------------------------
# The experience bank


def _open_bank(folder: str, cfg, device):
    from lopd.experience import ExperienceBank

    return ExperienceBank.open(folder, batch_size=cfg.bank.embed_batch_size, device=device)


def cmd_bank_build(args) -> int:
    from lopd import runtime
    from lopd.envs import get_env
    from lopd.experience import ExperienceBank, spec_from_config

    cfg = _config_for_env(args)
    args.model = args.model or cfg.model.name_or_path
    if args.split != "train":
        raise ValueError(f"--split {args.split}: only training-split tasks may enter the "
                         "experience bank")
    if args.limit < 0:
        raise ValueError(f"--limit must be >= 0, got {args.limit}")
    device = runtime.setup(cfg.run)
    env = get_env(cfg.env.name, **cfg.env.kwargs())
    tasks = env.tasks(args.split)[: args.limit or None]
    # The bank is opened (or created) first, so a wrong folder fails before minutes of rollouts.
    spec = spec_from_config(cfg.bank, args.model)
    bank = ExperienceBank.open_or_create(
        args.out, spec, cfg.bank.reward_threshold, cfg.bank.max_observation_chars,
        batch_size=cfg.bank.embed_batch_size, device=device)
    if (bank.embedder.spec, bank.reward_threshold, bank.max_observation_chars) != (
            spec, cfg.bank.reward_threshold, cfg.bank.max_observation_chars):
        print(f"note: {args.out} keeps the embedder ({bank.embedder.spec.describe()}), reward "
              f"threshold ({bank.reward_threshold:g}) and observation cap "
              f"({bank.max_observation_chars}) it was created with", file=sys.stderr)
    with bank:
        before = len(bank)
        policy, tokenizer = _make_policy(args.agent, args.model, cfg, device,
                                         temperature=cfg.rollout.temperature)
        source = "oracle" if args.agent == "oracle" else f"model:{args.model}"
        start = time.perf_counter()
        rollouts = _run(env, tasks, policy, tokenizer, cfg, progress=True)
        rollout_seconds = time.perf_counter() - start
        if args.episodes:
            _write_episodes(Path(args.episodes), rollouts)
        start = time.perf_counter()
        result = bank.add_rollouts(rollouts, {t.task_id: t for t in tasks}, source)
        add_seconds = time.perf_counter() - start
        per_domain: dict[str, dict] = {}
        for rollout in rollouts:
            d = per_domain.setdefault(rollout.domain, {"rollouts": 0, "successes": 0, "added": 0})
            d["rollouts"] += 1
            d["successes"] += rollout.success
        for entry in result.added:
            per_domain[entry.domain]["added"] += 1
        figures = {"bank": str(args.out), "source": source, "split": args.split,
                   "rollouts": len(rollouts), "successes": sum(r.success for r in rollouts),
                   **result.counts(), "entries_before": before, "entries": len(bank),
                   "rollout_seconds": round(rollout_seconds, 1),
                   "embed_seconds": round(add_seconds, 1), "per_domain": per_domain,
                   "embedder": bank.embedder.spec.describe(),
                   "reward_threshold": bank.reward_threshold}
    rows = [[domain, d["rollouts"], d["successes"], d["successes"] / d["rollouts"], d["added"]]
            for domain, d in sorted(per_domain.items())]
    rows.append(["all", figures["rollouts"], figures["successes"],
                 figures["successes"] / max(1, figures["rollouts"]), figures["added"]])
    print(format_table(["domain", "rollouts", "successes", "success rate", "added"], rows,
                       title=f"{source} on {cfg.env.name}/{args.split} -> {args.out} "
                       f"(rollouts {rollout_seconds:.0f}s, embedding {add_seconds:.0f}s)"))
    print(f"\nbank: {figures['entries']} entries ({figures['duplicates']} duplicates and "
          f"{figures['below_threshold']} below reward {bank.reward_threshold:g} not stored)")
    write_json(args.json_path, figures)
    return 0


def cmd_bank_add(args) -> int:
    from lopd import runtime
    from lopd.envs import get_env

    cfg = _config_for_env(args)
    device = runtime.setup(cfg.run)
    path = Path(args.rollouts)
    if not path.is_file():
        raise FileNotFoundError(f"no rollouts file {path}")
    rollouts = _read_episodes(path)
    env = get_env(cfg.env.name, **cfg.env.kwargs())
    # Eval tasks are looked up too, so that the bank itself refuses them by name and split.
    tasks = {t.task_id: t for split in ("eval", "train") for t in env.tasks(split)}
    with _open_bank(args.bank, cfg, device) as bank:
        result = bank.add_rollouts(rollouts, tasks, source=args.source or str(path))
        figures = {"bank": args.bank, "rollouts": len(rollouts), **result.counts(),
                   "entries": len(bank)}
    print(key_value_table(figures, title=f"added {path} to {args.bank}"))
    write_json(args.json_path, figures)
    return 0


def _snippet(trace: str, limit: int) -> str:
    """The actions of a compact trace on one line (the task line is shown apart)."""
    actions = " | ".join(line.split(". ", 1)[-1] for line in trace.splitlines()[1:])
    return actions if len(actions) <= limit else actions[: limit - 3] + "..."


def cmd_bank_query(args) -> int:
    from lopd import runtime

    cfg = load_config(args.config, args.overrides)
    device = runtime.setup(cfg.run)
    with _open_bank(args.bank, cfg, device) as bank:
        (hits,) = bank.search([args.text], args.k or cfg.bank.n_ret,
                              [args.exclude] if args.exclude else None,
                              allow_self_retrieval=cfg.bank.allow_self_retrieval)
    rows = [[rank, round(h.score, 4), h.entry.task_id, h.entry.domain, h.entry.task,
             _snippet(h.entry.trace, 90)] for rank, h in enumerate(hits, 1)]
    print(format_table(["rank", "score", "task id", "domain", "task", "actions"], rows,
                       title=f"{len(hits)} hits for {args.text!r}"))
    write_json(args.json_path, {"query": args.text, "hits": [
        {"rank": rank, "score": h.score, **h.entry.to_dict()} for rank, h in enumerate(hits, 1)]})
    return 0


def cmd_bank_stats(args) -> int:
    from lopd import runtime

    cfg = load_config(args.config, args.overrides)
    device = runtime.setup(cfg.run)
    with _open_bank(args.bank, cfg, device) as bank:
        stats = bank.stats()
    rows = [[domain, n] for domain, n in stats["per_domain"].items()]
    rows.append(["all", stats["entries"]])
    print(format_table(["domain", "entries"], rows, title=f"experience bank {args.bank}"))
    print()
    print(key_value_table({k: stats[k] for k in ("tasks", "reward_threshold",
                                                 "max_observation_chars", "embedder", "dim")}
                          | {f"source {s}": n for s, n in stats["per_source"].items()}))
    write_json(args.json_path, stats)
    return 0


def cmd_bank_eval(args) -> int:
    from lopd import runtime
    from lopd.envs import get_env
    from lopd.experience import retrieval_quality

    cfg = _config_for_env(args)
    device = runtime.setup(cfg.run)
    env = get_env(cfg.env.name, **cfg.env.kwargs())
    tasks = env.tasks(args.split)[: args.limit or None]
    k = args.k or cfg.bank.n_ret
    if args.limit < 0 or k < 1:
        raise ValueError("--limit must be >= 0 and -k >= 1")
    with _open_bank(args.bank, cfg, device) as bank:
        quality = retrieval_quality(bank, tasks, k,
                                    allow_self_retrieval=cfg.bank.allow_self_retrieval)
        quality.update({"bank": args.bank, "entries": len(bank), "split": args.split})
    columns = ["top1_template", f"top{k}_any_template", f"top{k}_precision", "top1_domain",
               "chance_top1_template", "template_in_bank"]
    rows = [[domain, d["queries"], *(d[c] for c in columns)]
            for domain, d in quality["per_domain"].items()]
    rows.append(["all", quality["queries"], *(quality[c] for c in columns)])
    headers = ["domain", "queries", "top-1 template", f"top-{k} any", f"top-{k} precision",
               "top-1 domain", "chance top-1", "template in bank"]
    print(format_table(headers, rows, title=f"retrieval from {args.bank} ({quality['entries']} "
                       f"entries) for {cfg.env.name}/{args.split} queries"))
    write_json(args.json_path, quality)
    return 0


def cmd_cold_start(args) -> int:
    from lopd import models, runtime
    from lopd.algorithms import cold_start as cs
    from lopd.composer import Composer
    from lopd.envs import get_env
    from lopd.experience import ExperienceBank

    cfg = load_config(args.config, args.overrides)
    args.model = args.model or cfg.model.name_or_path
    device = runtime.setup(cfg.run)
    out = Path(args.out)
    model, tokenizer = models.load_model(args.model, device=device,
                                         dtype=runtime.resolve_dtype(cfg.run.dtype, device))
    model.eval()
    with ExperienceBank.open(args.bank, batch_size=cfg.bank.embed_batch_size, device=device) as bank:
        successes = bank.stored_rollouts()
        if not successes:
            raise ValueError(f"{args.bank} holds no stored rollouts to train on; fill it with "
                             "`lopd bank build`")
        n_ret = cfg.bank.n_ret
        # Held-out successes for the measurement: the base acts on eval tasks; they never enter
        # the bank, they only query it.
        env = get_env(cfg.env.name, **cfg.env.kwargs())
        eval_tasks = env.tasks("eval")[: cfg.cold_start.eval_tasks]
        held_out = []
        if eval_tasks:
            # Sampled like the bank's own rollouts (rollout.temperature), not greedy: greedy
            # successes are the base's most confident paths and leave a reference nothing to add.
            policy, _ = _make_policy("model", args.model, cfg, device,
                                     temperature=cfg.rollout.temperature)
            attempts = [t for t in eval_tasks for _ in range(cfg.cold_start.eval_samples)]
            held_out = [r for r in _run(env, attempts, policy, tokenizer, cfg, progress=True)
                        if r.success]
        coded = {t.task_id for t in eval_tasks if "code" in t.meta}

        composer = Composer(model, tokenizer, cfg.composer)
        before = (cs.latent_information(composer, bank, held_out, n_ret, seed=cfg.run.seed)
                  if held_out else {})
        start = time.perf_counter()
        history = cs.cold_start(composer, bank, successes, cfg.cold_start, n_ret, seed=cfg.run.seed)
        seconds = time.perf_counter() - start
        composer.save(out)
        table, groups = {}, {}
        if held_out:
            after = cs.latent_information(composer, bank, held_out, n_ret, seed=cfg.run.seed)
            table = {"no reference": after["no reference"],
                     "retrieved latents, cold-started composer": after["retrieved latents"],
                     "random experiences' latents, cold-started": after["random experiences' latents"],
                     "retrieved traces as text": after["retrieved traces as text"],
                     "empty reference block (framing only)": after["empty reference block"],
                     "retrieved latents, untrained composer": before["retrieved latents"]}
            if coded:
                # Coded requests (toolworld) are where experience says what the instruction does
                # not: the same table on each part.
                for name, part in (("coded", [r for r in held_out if r.task_id in coded]),
                                   ("plain", [r for r in held_out if r.task_id not in coded])):
                    if part:
                        groups[name] = {"successes": len(part), **cs.latent_information(
                            composer, bank, part, n_ret, seed=cfg.run.seed)}
    figures = {"composer": str(out), "bank": str(args.bank), "successes": len(successes),
               "steps": len(history), "seconds": round(seconds, 1),
               "first_nll": history[0]["nll"], "final_nll": history[-1]["nll"],
               "held_out_successes": len(held_out), "nll_per_action_token": table,
               "by_request_kind": groups}
    cs.save_history(history, out, {"config": cfg.to_dict(), "figures": figures})
    print(key_value_table({k: v for k, v in figures.items()
                           if k not in ("nll_per_action_token", "by_request_kind")},
                          title=f"cold start -> {out} (loss curve: {out}/cold_start.png)"))
    if table:
        plain = table["no reference"]
        rows = [[name, nll, nll - plain] for name, nll in table.items()]
        print()
        print(format_table(["teacher reference", "NLL / action token", "vs no reference"], rows,
                           title=f"teacher NLL on {len(held_out)} held-out successes "
                           f"(eval split, n_ret={n_ret})"))
    if groups:
        names = [n for n in next(iter(groups.values())) if n != "successes"]
        print()
        print(format_table(["teacher reference", *(f"{k} ({g['successes']})" for k, g in groups.items())],
                           [[n, *(g[n] for g in groups.values())] for n in names],
                           title="the same, by request kind (NLL / action token)"))
    write_json(args.json_path, figures)
    return 0


def cmd_train(args) -> int:
    from lopd import trainer

    if args.resume:
        if args.out or args.composer or args.bank or args.config != "tiny":
            raise ValueError("--resume continues a run with its saved config; do not combine it "
                             "with --out, --composer, --bank or --config")
        run_dir = Path(args.resume)
        cfg = trainer.read_config(run_dir, args.overrides)
        algo = cfg.train.algorithm
    else:
        if not args.out:
            raise ValueError("lopd train needs --out RUN_DIR (or --resume RUN_DIR)")
        run_dir = Path(args.out)
        sets = [f"train.algorithm={args.algo}", *_lopd_input_overrides(args)]
        cfg = load_config(args.config, sets)
        algo = cfg.train.algorithm
    last = trainer.train(cfg, run_dir, algo, resume=bool(args.resume))
    figures = {k: v for k, v in last.items() if not k.startswith(("time/", "memory/"))}
    print(key_value_table(figures, title=f"{algo} -> {run_dir} (plots: {run_dir / trainer.PLOT_FILE})"))
    write_json(args.json_path, last)
    return 0


def cmd_compare(args) -> int:
    from lopd.experiments.compare import compare

    algos = [a.strip() for a in args.algos.split(",") if a.strip()]
    allowed = {"base", *algorithm_names()}
    if not algos or set(algos) - allowed:
        raise ValueError(f"--algos {args.algos!r}: choose from {sorted(allowed)}")
    if args.seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
    rates = {}
    for item in args.lr:
        algo, _, value = item.partition("=")
        try:
            rates[algo] = float(value)
        except ValueError:
            raise ValueError(f"--lr {item!r}: expected ALGO=RATE, e.g. grpo=1e-4") from None
    overrides = _lopd_input_overrides(args)
    load_config(args.config, overrides)  # fail on a bad key before any run starts
    out = Path(args.out)
    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    report = compare(args.config, overrides, algos, args.seeds, out, rates, jobs=args.jobs)
    print((out / "results.md").read_text())
    print(f"figures: {out / 'reward_vs_generations.png'}; all numbers: {out / 'results.json'}")
    write_json(args.json_path, report)
    return 0


def cmd_sweep(args) -> int:
    from lopd.experiments.compare import sweep

    try:
        rates = [float(x) for x in args.lrs.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--lrs {args.lrs!r}: expected comma-separated numbers") from None
    if not rates:
        raise ValueError("--lrs needs at least one learning rate")
    overrides = _lopd_input_overrides(args)
    load_config(args.config, overrides)
    report = sweep(args.config, overrides, args.algo, rates, args.steps, args.validation_tasks,
                   Path(args.out))
    rows = [[r["learning_rate"], r["validation_mean_reward"], r["validation_success_rate"]]
            for r in report["runs"]]
    print(format_table(["learning rate", "validation mean reward", "validation success"], rows,
                       title=f"{args.algo} sweep ({args.steps} steps, {args.validation_tasks} "
                       f"validation tasks from the training split): best "
                       f"{report['best_learning_rate']:g}"))
    write_json(args.json_path, report)
    return 0


# ----------------------------------------------------------------------------------------------
# Parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lopd", description="Latent On-Policy Self-Distillation of LLM agents.")
    parser.add_argument("--version", action="version", version=f"lopd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("quickstart", help="run the pipeline on the embedded tiny default",
                       description="The whole pipeline on the tiny default model, scaled down to "
                       "minutes: harness check, base evaluation, a bank from the base's rollouts, "
                       "the composer's cold start, a few LOPD steps, and a report (report.md, "
                       "reward curve) in RUN.output_dir/quickstart. A re-run reuses finished "
                       "stages.")
    p.add_argument("--bank-tasks", type=int, default=600,
                   help="training tasks the base rolls out on to fill the demo bank")
    p.add_argument("--cold-start-steps", type=int, default=60, help="composer cold-start steps")
    p.add_argument("--lopd-steps", type=int, default=8, help="LOPD steps (train.rollouts_per_step each)")
    p.add_argument("--fresh", action="store_true", help="redo every stage instead of reusing them")
    p.add_argument("--build-base", action="store_true",
                   help="build the base model here (tokenizer, Qwen3, SFT: ~2 min on a GPU, hours "
                   "on a 2-core CPU) instead of using the embedded one")
    _add_config_args(p)
    _add_json_arg(p)
    p.set_defaults(func=cmd_quickstart)

    p = sub.add_parser("config", help="print the resolved config with the meaning of each key",
                       description="Print every config key, its value after overrides, and its "
                       "meaning.")
    _add_config_args(p)
    _add_json_arg(p)
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("tasks", help="list an environment's tasks (JSONL) with counts per domain",
                       description="Generate the tasks of one split, print counts per domain and "
                       "optionally write them as JSONL.")
    p.add_argument("--env", default="toolworld", help="environment (default: toolworld)")
    p.add_argument("--split", default="train", choices=["pretrain", "train", "eval"])
    p.add_argument("--out", help="write the tasks to this JSONL file")
    _add_config_args(p)
    _add_json_arg(p)
    p.set_defaults(func=cmd_tasks)

    p = sub.add_parser("eval", help="evaluate an agent on an environment split",
                       description="Run an agent on every task of a split and report mean reward "
                       "and success rate per domain. --agent oracle / random check the harness. "
                       "Episodes are greedy unless rollout.eval_temperature > 0.")
    p.add_argument("--model", help="model folder or embedded model (toolworld-1m, codeworld-1m); "
                   "default: the config's model.name_or_path (codeworld-1m for codeworld and "
                   "humaneval)")
    p.add_argument("--env", default="toolworld", help="environment (default: toolworld)")
    p.add_argument("--split", default="eval",
                   help="split: pretrain, train or eval (toolworld); base, miss_func, miss_param, "
                   "long_context or eval = all four (bfcl)")
    p.add_argument("--subset", help="BFCL subset (base, miss_func, miss_param, long_context, all); "
                   "same as --split")
    p.add_argument("--agent", default="model", choices=["model", "oracle", "random"],
                   help="who acts: the model, the oracle solution, or random tool calls")
    p.add_argument("--limit", type=int, default=0, help="evaluate only the first N tasks")
    p.add_argument("--samples", type=int, default=1, help="answers per task for pass@k "
                   "(codeworld, humaneval; > 1 needs rollout.eval_temperature > 0)")
    p.add_argument("--composer", metavar="DIR", help="act as Base + Composer: latents of retrieved "
                   "experiences (from --bank) in the base's prompt")
    p.add_argument("--bank", metavar="BANK", help="experience bank for --composer")
    p.add_argument("--episodes", metavar="PATH", help="write every episode to this JSONL file")
    _add_config_args(p)
    _add_json_arg(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("cold-start", help="fit the latent composer to a bank (teacher NLL)",
                       description="Train the composer (LoRA on the frozen base + compressor) so "
                       "that the frozen teacher, given latents of n_ret other retrieved "
                       "experiences, maximises the likelihood of each stored success; then print "
                       "the teacher's NLL on held-out successes with no reference, retrieved "
                       "latents, random experiences' latents and the raw traces as text.")
    p.add_argument("--model", help="the frozen base (folder or embedded model); default: "
                   "the config's model.name_or_path")
    p.add_argument("--bank", required=True, help="experience bank folder (lopd bank build)")
    p.add_argument("--out", required=True, help="folder to write the composer to")
    _add_config_args(p)
    _add_json_arg(p)
    p.set_defaults(func=cmd_cold_start)

    p = sub.add_parser("train", help="train the student on-policy (LOPD and baselines)",
                       description="Sample training tasks, roll the student out, update it with "
                       "the chosen algorithm; evaluate on held-out tasks every train.eval_every "
                       "steps, checkpoint every train.save_every steps. Writes config.yaml, "
                       "metrics.jsonl, eval.jsonl, TensorBoard events, checkpoints and "
                       "training.png into the run folder.")
    p.add_argument("--algo", default="lopd", choices=algorithm_names(), help="training algorithm")
    p.add_argument("--out", help="new run folder")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    _add_lopd_inputs(p)
    _add_config_args(p)
    _add_json_arg(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("compare", help="algorithms x seeds side by side (table, curves, ratio)",
                       description="Train every algorithm with every seed on the same task stream, "
                       "rollout budget and evaluation schedule; write results.json, results.md and "
                       "reward_vs_generations.png. Finished runs are reused, interrupted ones "
                       "resumed.")
    p.add_argument("--algos", default="base,grpo,lopd", help="comma-separated: base, grpo, lopd")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--jobs", type=int, default=1,
                   help="training runs at once, as separate processes (e.g. one per core)")
    p.add_argument("--out", required=True, help="folder of the comparison")
    p.add_argument("--lr", action="append", default=[], metavar="ALGO=RATE",
                   help="learning rate of one algorithm (its best from the validation sweep)")
    _add_lopd_inputs(p)
    _add_config_args(p)
    _add_json_arg(p)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("sweep", help="learning-rate sweep on a validation split of training tasks",
                       description="One run per learning rate, evaluated on the last "
                       "--validation-tasks training tasks (left out of training), never on the "
                       "eval split; prints the table and the best rate. Give every algorithm of a "
                       "comparison the same grid and steps.")
    p.add_argument("--algo", required=True, choices=algorithm_names())
    p.add_argument("--lrs", default="3e-5,1e-4,3e-4", help="comma-separated learning rates")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--validation-tasks", type=int, default=100)
    p.add_argument("--out", required=True)
    _add_lopd_inputs(p)
    _add_config_args(p)
    _add_json_arg(p)
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("base", help="build the vanilla base model (tokenizer, Qwen3, SFT)",
                       description="Train a tokenizer on environment transcripts, build the Qwen3 "
                       "model and fine-tune it on oracle transcripts of the pre-training pool until "
                       "validation success (on training-split tasks) reaches base.stop_at_success.")
    p.add_argument("--out", required=True, help="folder to write the base model to")
    p.add_argument("--env", help="environment to build it for: toolworld (the default preset "
                   "tiny) or codeworld (preset tiny-code unless --config says otherwise)")
    p.add_argument("--resume", action="store_true",
                   help="continue the training checkpointed in --out (same config; a run stopped "
                   "by base.time_limit_minutes continues where it stopped)")
    _add_config_args(p)
    _add_json_arg(p)
    p.set_defaults(func=cmd_base)

    bank = sub.add_parser("bank", help="the experience bank: build, add, query, stats, eval",
                          description="Successful training rollouts, stored with their embeddings "
                          "and searched by task text (leave-one-out). A bank is one folder; its "
                          "embedder and reward threshold are fixed when it is created.")
    bsub = bank.add_subparsers(dest="bank_command", metavar="ACTION", required=True)
    p = bsub.add_parser("build", help="roll a model out on training tasks and keep the successes",
                        description="Run the model (or the oracle) on the training split, with "
                        "the sampling of the config's rollout section (rollout.temperature), and "
                        "store the rollouts whose reward reaches bank.reward_threshold in BANK "
                        "(created with the config's bank section if it does not exist).")
    p.add_argument("--out", required=True, metavar="BANK", help="bank folder (created or extended)")
    p.add_argument("--model", help="model folder or embedded model; default: the config's "
                   "model.name_or_path")
    p.add_argument("--agent", default="model", choices=["model", "oracle"],
                   help="who acts: the model, or the oracle solution (a reference bank)")
    p.add_argument("--env", default="toolworld", help="environment (default: toolworld)")
    p.add_argument("--split", default="train", choices=["pretrain", "train", "eval"],
                   help="must be train: no other split may enter a bank")
    p.add_argument("--limit", type=int, default=0, help="use only the first N tasks")
    p.add_argument("--episodes", metavar="PATH", help="also write every rollout to this JSONL file")
    _add_config_args(p)
    _add_json_arg(p)
    p.set_defaults(func=cmd_bank_build)

    p = bsub.add_parser("add", help="add the successes of a rollouts JSONL file to a bank",
                        description="Store the rollouts of a JSONL file (as written by --episodes) "
                        "that pass the bank's rules: training split, reward threshold, no "
                        "duplicate. An eval-split rollout stops the whole add; nothing is written.")
    p.add_argument("bank", metavar="BANK", help="bank folder")
    p.add_argument("--rollouts", required=True, metavar="FILE.jsonl", help="rollouts to add")
    p.add_argument("--source", help="what produced the rollouts (default: the file name)")
    p.add_argument("--env", default="toolworld", help="environment the rollouts ran in")
    _add_config_args(p)
    _add_json_arg(p)
    p.set_defaults(func=cmd_bank_add)

    p = bsub.add_parser("query", help="the entries most similar to a task text, with scores",
                        description="Embed TEXT as a query (task only) and print the closest "
                        "entries with their cosine similarity.")
    p.add_argument("bank", metavar="BANK", help="bank folder")
    p.add_argument("text", help="the task text to search with")
    p.add_argument("-k", type=int, default=0, help="hits to show (default: bank.n_ret)")
    p.add_argument("--exclude", metavar="TASK_ID", help="leave this task's own entries out")
    _add_config_args(p)
    _add_json_arg(p)
    p.set_defaults(func=cmd_bank_query)

    p = bsub.add_parser("stats", help="entries per domain, reward threshold, embedder",
                        description="Print the bank's entries per domain and source and the "
                        "settings it was created with.")
    p.add_argument("bank", metavar="BANK", help="bank folder")
    _add_config_args(p)
    _add_json_arg(p)
    p.set_defaults(func=cmd_bank_stats)

    p = bsub.add_parser("eval", help="does retrieval find the query's own kind of task?",
                        description="Query the bank with every task of a split (leave-one-out) "
                        "and report how often the top hit shares the query's task template, "
                        "how often one of the top k does, and the chance rate.")
    p.add_argument("bank", metavar="BANK", help="bank folder")
    p.add_argument("--env", default="toolworld", help="environment (default: toolworld)")
    p.add_argument("--split", default="eval", choices=["pretrain", "train", "eval"],
                   help="split of the query tasks (default: eval, the held-out tasks)")
    p.add_argument("-k", type=int, default=0, help="hits per query (default: bank.n_ret)")
    p.add_argument("--limit", type=int, default=0, help="use only the first N query tasks")
    _add_config_args(p)
    _add_json_arg(p)
    p.set_defaults(func=cmd_bank_eval)

    model = sub.add_parser("model", help="build or inspect models",
                           description="Build the tiny default model or inspect a model folder.")
    msub = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    p = msub.add_parser("new", help="train a tokenizer and build a random-initialised tiny model",
                        description="Train a byte-level BPE tokenizer on a corpus and build a "
                        "Qwen3 model from the config's model.architecture, seeded by "
                        "run.seed; saved in Hugging Face format.")
    p.add_argument("--out", required=True, help="folder to write the model and tokenizer to")
    p.add_argument("--corpus", help="tokenizer corpus: .txt (one text per line) or .jsonl "
                   "('text' field); default: built-in synthetic tool-use transcripts")
    _add_config_args(p)
    _add_json_arg(p)
    p.set_defaults(func=cmd_model_new)

    p = msub.add_parser("info", help="parameters, vocabulary, special tokens of a model folder",
                        description="Print facts about a saved model: parameter count, shape, "
                        "vocabulary, special tokens and whether a chat template is present.")
    p.add_argument("path", help="model folder, or an embedded model name (toolworld-1m, ...)")
    _add_json_arg(p)
    p.set_defaults(func=cmd_model_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"lopd {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
