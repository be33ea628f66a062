"""`lopd train`, `lopd compare`, `lopd sweep`, `lopd ablate`: training runs and the experiments made
of them."""

from __future__ import annotations

import argparse
from pathlib import Path

from lopd.cli.common import CONFIG, JSON, LOPD_INPUTS, add_command, lopd_input_overrides
from lopd.tables import format_table, key_value_table, write_json

SHARED = (LOPD_INPUTS, CONFIG, JSON)


def cmd_train(args) -> int:
    from lopd import pipeline, trainer
    from lopd.config import load_config

    if args.resume:
        if args.out or args.composer or args.bank or args.config != "tiny":
            raise ValueError("--resume continues a run with its saved config; do not combine it "
                             "with --out, --composer, --bank or --config")
        run_dir = Path(args.resume)
        cfg = trainer.read_config(run_dir, args.overrides)
    else:
        if not args.out:
            raise ValueError("lopd train needs --out RUN_DIR (or --resume RUN_DIR)")
        run_dir = Path(args.out)
        cfg = load_config(args.config, [f"train.algorithm={args.algo}", *lopd_input_overrides(args)])
    algo = cfg.train.algorithm
    last = pipeline.train(cfg, run_dir, algo, resume=bool(args.resume))
    import os

    if int(os.environ.get("RANK", "0")) != 0:  # torchrun: rank 0 reports for every process
        return 0
    figures = {k: v for k, v in last.items() if not k.startswith(("time/", "memory/"))}
    print(key_value_table(figures, title=f"{algo} -> {run_dir} (plots: {run_dir / trainer.PLOT_FILE})"))
    write_json(args.json_path, last)
    return 0


def _learning_rates(items: list[str]) -> dict[str, float]:
    rates = {}
    for item in items:
        algo, _, value = item.partition("=")
        try:
            rates[algo] = float(value)
        except ValueError:
            raise ValueError(f"--lr {item!r}: expected ALGO=RATE, e.g. grpo=1e-4") from None
    return rates


def cmd_compare(args) -> int:
    from lopd.experiments.compare import compare

    out = Path(args.out)
    report = compare(args.config, lopd_input_overrides(args), args.algos, args.seeds, out,
                     _learning_rates(args.lr), jobs=args.jobs, transfer=args.transfer,
                     transfer_tasks=args.transfer_tasks, isolate=args.isolate)
    print((out / "results.md").read_text())
    print(f"figures: {out / 'reward_vs_generations.png'}; all numbers: {out / 'results.json'}")
    write_json(args.json_path, report)
    return 0


def cmd_sweep(args) -> int:
    from lopd.experiments.sweep import sweep

    try:
        rates = [float(x) for x in args.lrs.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--lrs {args.lrs!r}: expected comma-separated numbers") from None
    report = sweep(args.config, lopd_input_overrides(args), args.algo, rates, args.steps,
                   args.validation_tasks, Path(args.out))
    rows = [[r["learning_rate"], r["validation_mean_reward"], r["validation_success_rate"]]
            for r in report["runs"]]
    print(format_table(["learning rate", "validation mean reward", "validation success"], rows,
                       title=f"{args.algo} sweep ({args.steps} steps, {args.validation_tasks} "
                       f"validation tasks from the training split): best "
                       f"{report['best_learning_rate']:g}{_tie_note(report)}"))
    write_json(args.json_path, report)
    return 0


def _tie_note(report: dict) -> str:
    tied = report["tied_learning_rates"]
    if not tied:
        return ""
    return f" (tied: {', '.join(f'{rate:g}' for rate in tied)}; the first listed is taken)"


def cmd_ablate(args) -> int:
    from lopd.experiments.ablation import ablation, parse_arm

    arms = dict(parse_arm(a) for a in args.arm)
    if len(arms) != len(args.arm):
        raise ValueError("--arm names must be distinct")
    out = Path(args.out)
    track = [k.strip() for k in args.track.split(",") if k.strip()]
    report = ablation(args.config, lopd_input_overrides(args), args.algo, arms, args.seeds, out,
                      track, jobs=args.jobs, isolate=args.isolate)
    print((out / "results.md").read_text())
    print(f"figure: {out / 'ablation.png'}; all numbers: {out / 'results.json'}")
    write_json(args.json_path, report)
    return 0


def _algo_list(allowed: list[str]):
    """``--algos`` as a list, checked against the methods registered when the parser was built."""
    from lopd.experiments.compare import check_algos

    def parse(text: str) -> list[str]:
        algos = [a.strip() for a in text.split(",") if a.strip()]
        try:
            check_algos(algos, allowed)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return algos

    return parse


def register(sub) -> None:
    from lopd.algorithms import algorithm_names
    from lopd.experiments.compare import BASE

    names = algorithm_names()
    p = add_command(sub, "train", cmd_train, "train the student on-policy (LOPD and baselines)",
                    "Sample training tasks, roll the student out, update it with the chosen "
                    "algorithm; evaluate on held-out tasks every train.eval_every steps, checkpoint "
                    "every train.save_every steps. Writes config.yaml, metrics.jsonl, eval.jsonl, "
                    "TensorBoard events, checkpoints and training.png into the run folder.", SHARED)
    p.add_argument("--algo", default="lopd", choices=names, help="training algorithm")
    p.add_argument("--out", help="new run folder")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")

    p = add_command(sub, "compare", cmd_compare,
                    "algorithms x seeds side by side (table, curves, ratio)",
                    "Train every algorithm with every seed on the same task stream, rollout budget "
                    "and evaluation schedule; write results.json, results.md and "
                    "reward_vs_generations.png. Finished runs are reused, interrupted ones resumed.",
                    SHARED)
    p.add_argument("--algos", default=f"{BASE},grpo,lopd", type=_algo_list([BASE, *names]),
                   help=f"comma-separated, of: {', '.join([BASE, *names])} (default: %(default)s)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--jobs", type=int, default=1,
                   help="training runs at once, as separate processes (e.g. one per core)")
    p.add_argument("--isolate", action="store_true",
                   help="train every run in its own process even with --jobs 1 (a real model's "
                   "runs slow down one after another in one long-lived process)")
    p.add_argument("--out", required=True, help="folder of the comparison")
    p.add_argument("--lr", action="append", default=[], metavar="ALGO=RATE",
                   help="learning rate of one algorithm (its best from the validation sweep)")
    p.add_argument("--transfer", default=[], type=lambda text: [e for e in text.split(",") if e],
                   metavar="ENVS", help="also score the base and every final student, greedy, on "
                   "these environments' eval splits (e.g. humaneval after codeworld): one more "
                   "column each")
    p.add_argument("--transfer-tasks", type=int, default=0, metavar="N",
                   help="score only the first N tasks of each --transfer environment's eval split "
                   "(0 = all; BFCL's split interleaves its four subsets, so N/4 of each)")

    p = add_command(sub, "sweep", cmd_sweep,
                    "learning-rate sweep on a validation split of training tasks",
                    "One run per learning rate, evaluated on the last --validation-tasks training "
                    "tasks (left out of training), never on the eval split; prints the table and "
                    "the best rate. Give every algorithm of a comparison the same grid and steps.",
                    SHARED)
    p.add_argument("--algo", required=True, choices=names)
    p.add_argument("--lrs", default="3e-5,1e-4,3e-4", help="comma-separated learning rates")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--validation-tasks", type=int, default=100)
    p.add_argument("--out", required=True)

    p = add_command(sub, "ablate", cmd_ablate,
                    "arms of one method that differ in named settings, x seeds",
                    "Train one method once per arm and seed, each arm the same config plus its own "
                    "settings; write results.json, results.md (final reward and success, mean ± "
                    "std over seeds; tracked metrics first -> last) and ablation.png. Finished "
                    "runs are reused, interrupted ones resumed. For tuning, set "
                    "train.eval_split=validation so the eval split is never scored.", SHARED)
    p.add_argument("--algo", default="lopd", choices=names)
    p.add_argument("--arm", action="append", required=True, metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                   help="one arm, e.g. success:lopd.margin_weight=success (repeat per arm)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--jobs", type=int, default=1,
                   help="training runs at once, as separate processes (e.g. one per core)")
    p.add_argument("--isolate", action="store_true",
                   help="train every run in its own process even with --jobs 1 (a real model's "
                   "runs slow down one after another in one long-lived process)")
    p.add_argument("--track", default="", metavar="KEY[,KEY]",
                   help="per-step metrics to follow, e.g. delta,beta")
    p.add_argument("--out", required=True, help="folder of the ablation")
