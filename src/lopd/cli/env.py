"""`lopd tasks` and `lopd eval`: an environment's tasks, and an agent evaluated on them."""

from __future__ import annotations

import json
from pathlib import Path

from lopd import stages
from lopd.cli.common import add_command, add_env_arg, config_for_env
from lopd.stages import CODE_ENVS
from lopd.tables import domain_rows, format_table, key_value_table, write_json


def cmd_tasks(args) -> int:
    from lopd import stages

    cfg = config_for_env(args)
    env = stages.get_env(cfg)
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

    cfg = config_for_env(args)
    split = ("eval" if args.subset == "all" else args.subset) if args.subset else args.split
    if bool(args.composer) != bool(args.bank):
        raise ValueError("--composer and --bank go together (the Base + Composer agent)")
    if args.composer and args.agent != "model":
        raise ValueError("--composer needs --agent model")
    code = cfg.env.name in CODE_ENVS
    if args.samples < 1 or (args.samples > 1 and not code):
        raise ValueError(f"--samples must be >= 1, and > 1 only for {', '.join(CODE_ENVS)}")
    if args.samples > 1 and cfg.rollout.eval_temperature <= 0 and args.agent == "model":
        raise ValueError("--samples > 1 needs sampling: add --set rollout.eval_temperature=0.8 "
                         "(greedy samples are all the same)")
    if args.chunk is not None and not args.record:
        raise ValueError("--chunk sets the tasks per chunk of a resumable evaluation: give --record")
    summary, rollouts = stages.evaluate_agent(cfg, args.agent, args.model, split, args.limit,
                                                args.samples, args.composer, args.bank,
                                                record=args.record, chunk=args.chunk or 40)
    if args.episodes:
        stages.write_episodes(args.episodes, rollouts)
    model = summary["model"] or cfg.model.name_or_path
    who = (f"base {model} + composer {args.composer}" if args.composer
           else f"model {model}" if args.agent == "model" else args.agent)
    print(format_table(["domain", "episodes", "mean reward", "success rate"], domain_rows(summary),
                       title=f"{who} on {cfg.env.name}/{split} ({summary['tasks']} tasks, "
                       f"{summary['seconds']:.0f}s)"))
    if code:
        print("  ".join(f"{k} {v:.4f}" for k, v in summary["pass_at_k"].items()))
    if args.record:
        print(f"{summary['episodes']} episodes in {args.record} ({len(rollouts)} run now), "
              f"{summary['record_seconds']:.0f}s of evaluation in all, on:")
        for where, count in summary["ran_on"].items():
            print(f"  {count:5d}  {where}")
    write_json(args.json_path, summary)
    return 0


def register(sub) -> None:
    p = add_command(sub, "tasks", cmd_tasks,
                    "list an environment's tasks (JSONL) with counts per domain",
                    "Generate the tasks of one split, print counts per domain and optionally "
                    "write them as JSONL.")
    add_env_arg(p)
    p.add_argument("--split", default="train", choices=["pretrain", "train", "eval"])
    p.add_argument("--out", help="write the tasks to this JSONL file")

    p = add_command(sub, "eval", cmd_eval, "evaluate an agent on an environment split",
                    "Run an agent on every task of a split and report mean reward and success rate "
                    "per domain. --agent oracle / random check the harness. Episodes are greedy "
                    "unless rollout.eval_temperature > 0.")
    p.add_argument("--model", help="model folder or embedded model (toolworld-1m, codeworld-1m); "
                   "default: the config's model.name_or_path (codeworld-1m for codeworld and "
                   "humaneval)")
    add_env_arg(p)
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
    p.add_argument("--episodes", metavar="PATH", help="write every episode to this JSONL file "
                   "(with --record: this call's episodes)")
    p.add_argument("--record", metavar="PATH", help="resumable: run the tasks in chunks, append "
                   "each finished chunk's episode figures to this JSONL file, skip the tasks it "
                   "already holds; the figures cover every task in it (a long evaluation stopped "
                   "part-way continues when the same command is given again)")
    p.add_argument("--chunk", type=int, help="tasks per chunk of --record (default 40): an "
                   "interrupted evaluation loses at most one chunk")
