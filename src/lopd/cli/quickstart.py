"""`lopd quickstart` (`make demo`): the method end to end on the embedded tiny default."""

from __future__ import annotations

from pathlib import Path

from lopd.cli.common import add_command, load
from lopd.tables import write_json


def cmd_quickstart(args) -> int:
    from lopd import __version__
    from lopd.experiments import quickstart

    cfg = load(args)
    if args.bank_tasks is not None and not (args.rebuild or args.build_base):
        raise ValueError("--bank-tasks sets the bank that --rebuild builds; the embedded bank "
                         "is fixed")
    print(f"lopd {__version__} quickstart -> {Path(cfg.run.output_dir) / 'quickstart'}\n")
    figures = quickstart.run(cfg, args.lopd_steps, rebuild=args.rebuild,
                             bank_tasks=args.bank_tasks or 0, fresh=args.fresh,
                             build_base=args.build_base)
    write_json(args.json_path, figures)
    return 0


def register(sub) -> None:
    p = add_command(sub, "quickstart", cmd_quickstart,
                    "run the method end to end on the embedded tiny default",
                    "The method on the tiny default in minutes: harness check, base evaluation, "
                    "the experience bank and cold-started composer shipped in the package (or, "
                    "with --rebuild, both built here), LOPD training with held-out evaluation, and "
                    "a report (report.md, summary.json, reward curve) in "
                    "RUN.output_dir/quickstart. A re-run reuses finished stages.")
    p.add_argument("--lopd-steps", type=int, default=70,
                   help="LOPD steps (train.rollouts_per_step rollouts each; default: %(default)s)")
    p.add_argument("--rebuild", action="store_true",
                   help="build the bank (two sampling passes of the base over the training tasks) "
                   "and cold-start the composer here (the config's cold_start section; cap it with "
                   "--set cold_start.max_steps=N) instead of using the embedded ones")
    p.add_argument("--bank-tasks", type=int, metavar="N",
                   help="with --rebuild: roll the base out on the first N training tasks only "
                   "(default: all)")
    p.add_argument("--fresh", action="store_true", help="redo every stage instead of reusing them")
    p.add_argument("--build-base", action="store_true",
                   help="build the base model here (tokenizer, Qwen3, SFT: ~2 min on a GPU, hours "
                   "on a 2-core CPU) instead of using the embedded one; implies --rebuild (the "
                   "embedded composer and bank belong to the embedded base)")
