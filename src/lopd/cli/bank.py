"""`lopd bank build|add|query|stats|eval`: the experience bank."""

from __future__ import annotations

from lopd.cli.common import add_command, add_env_arg, config_for_env, load
from lopd.tables import format_table, key_value_table, write_json


def cmd_bank_build(args) -> int:
    from lopd import pipeline

    cfg = config_for_env(args)
    if args.split != "train":
        raise ValueError(f"--split {args.split}: only training-split tasks may enter the "
                         "experience bank")
    figures = pipeline.build_bank(cfg, args.out, args.model, args.agent, args.limit,
                                  args.episodes)
    rows = [[domain, d["rollouts"], d["successes"], d["successes"] / d["rollouts"], d["added"]]
            for domain, d in figures["per_domain"].items()]
    rows.append(["all", figures["rollouts"], figures["successes"],
                 figures["successes"] / max(1, figures["rollouts"]), figures["added"]])
    print(format_table(["domain", "rollouts", "successes", "success rate", "added"], rows,
                       title=f"{figures['source']} on {cfg.env.name}/{args.split} -> {args.out} "
                       f"(rollouts {figures['rollout_seconds']:.0f}s, embedding "
                       f"{figures['embed_seconds']:.0f}s)"))
    print(f"\nbank: {figures['entries']} entries ({figures['duplicates']} duplicates and "
          f"{figures['below_threshold']} below reward {figures['reward_threshold']:g} not stored)")
    write_json(args.json_path, figures)
    return 0


def cmd_bank_add(args) -> int:
    from lopd import pipeline

    cfg = config_for_env(args)
    figures = pipeline.add_to_bank(cfg, args.bank, args.rollouts, args.source)
    print(key_value_table(figures, title=f"added {args.rollouts} to {args.bank}"))
    write_json(args.json_path, figures)
    return 0


def _snippet(trace: str, limit: int) -> str:
    """The actions of a compact trace on one line (the task line is shown apart)."""
    actions = " | ".join(line.split(". ", 1)[-1] for line in trace.splitlines()[1:])
    return actions if len(actions) <= limit else actions[: limit - 3] + "..."


def cmd_bank_query(args) -> int:
    from lopd import runtime, stages

    cfg = load(args)
    device = runtime.setup(cfg.run)
    with stages.open_bank(cfg, args.bank, device) as bank:
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
    from lopd import runtime, stages

    cfg = load(args)
    device = runtime.setup(cfg.run)
    with stages.open_bank(cfg, args.bank, device) as bank:
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
    from lopd import runtime, stages
    from lopd.experience import retrieval_quality

    cfg = config_for_env(args)
    device = runtime.setup(cfg.run)
    tasks = stages.get_env(cfg).tasks(args.split)[: args.limit or None]
    k = args.k or cfg.bank.n_ret
    if args.limit < 0 or k < 1:
        raise ValueError("--limit must be >= 0 and -k >= 1")
    with stages.open_bank(cfg, args.bank, device) as bank:
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


def register(sub) -> None:
    bank = sub.add_parser("bank", help="the experience bank: build, add, query, stats, eval",
                          description="Successful training rollouts, stored with their embeddings "
                          "and searched by task text (leave-one-out). A bank is one folder; its "
                          "embedder and reward threshold are fixed when it is created.")
    bsub = bank.add_subparsers(dest="bank_command", metavar="ACTION", required=True)
    p = add_command(bsub, "build", cmd_bank_build,
                    "roll a model out on training tasks and keep the successes",
                    "Run the model (or the oracle) on the training split, with the sampling of the "
                    "config's rollout section (rollout.temperature), and store the rollouts whose "
                    "reward reaches bank.reward_threshold in BANK (created with the config's bank "
                    "section if it does not exist).")
    p.add_argument("--out", required=True, metavar="BANK", help="bank folder (created or extended)")
    p.add_argument("--model", help="model folder or embedded model; default: the config's "
                   "model.name_or_path")
    p.add_argument("--agent", default="model", choices=["model", "oracle"],
                   help="who acts: the model, or the oracle solution (a reference bank)")
    add_env_arg(p)
    p.add_argument("--split", default="train", choices=["pretrain", "train", "eval"],
                   help="must be train: no other split may enter a bank")
    p.add_argument("--limit", type=int, default=0, help="use only the first N tasks")
    p.add_argument("--episodes", metavar="PATH", help="also write every rollout to this JSONL file")

    p = add_command(bsub, "add", cmd_bank_add, "add the successes of a rollouts JSONL file to a bank",
                    "Store the rollouts of a JSONL file (as written by --episodes) that pass the "
                    "bank's rules: training split, reward threshold, no duplicate. An eval-split "
                    "rollout stops the whole add; nothing is written.")
    p.add_argument("bank", metavar="BANK", help="bank folder")
    p.add_argument("--rollouts", required=True, metavar="FILE.jsonl", help="rollouts to add")
    p.add_argument("--source", help="what produced the rollouts (default: the file name)")
    add_env_arg(p, help="environment the rollouts ran in")

    p = add_command(bsub, "query", cmd_bank_query,
                    "the entries most similar to a task text, with scores",
                    "Embed TEXT as a query (task only) and print the closest entries with their "
                    "cosine similarity.")
    p.add_argument("bank", metavar="BANK", help="bank folder")
    p.add_argument("text", help="the task text to search with")
    p.add_argument("-k", type=int, default=0, help="hits to show (default: bank.n_ret)")
    p.add_argument("--exclude", metavar="TASK_ID", help="leave this task's own entries out")

    p = add_command(bsub, "stats", cmd_bank_stats, "entries per domain, reward threshold, embedder",
                    "Print the bank's entries per domain and source and the settings it was "
                    "created with.")
    p.add_argument("bank", metavar="BANK", help="bank folder")

    p = add_command(bsub, "eval", cmd_bank_eval, "does retrieval find the query's own kind of task?",
                    "Query the bank with every task of a split (leave-one-out) and report how often "
                    "the top hit shares the query's task template, how often one of the top k "
                    "does, and the chance rate.")
    p.add_argument("bank", metavar="BANK", help="bank folder")
    add_env_arg(p)
    p.add_argument("--split", default="eval", choices=["pretrain", "train", "eval"],
                   help="split of the query tasks (default: eval, the held-out tasks)")
    p.add_argument("-k", type=int, default=0, help="hits per query (default: bank.n_ret)")
    p.add_argument("--limit", type=int, default=0, help="use only the first N query tasks")
