"""Does a code change alter a method's training? A few steps of the real trainer, recorded so that
two versions of lopd can be set side by side.

``--out DIR`` runs ``--steps`` steps (default 3) of ``--algo`` on the tiny default (evaluation and
checkpoints off) and writes DIR/parity.json (every logged figure per step, timings left out) and
DIR/student.pt (the final student weights). LOPD gets its inputs built here: a bank of oracle
successes on ``--bank-tasks`` training tasks and an untrained composer (seeded), the same for every
version. Run the same command from two checkouts (the older one with ``PYTHONPATH=OLD/src``), then

    python benchmarks/parity.py --compare runs/parity-old runs/parity-new

prints, per figure, the largest difference over the steps, and the distance between the two final
students relative to the size of the update (‖θ_a − θ_b‖ / ‖θ_a − θ0‖). Two runs of one version
agree exactly (the trainer is seeded), so any difference is the change's.

    python benchmarks/parity.py --algo grpo --out runs/parity-grpo
    python benchmarks/parity.py --algo lopd --out runs/parity-lopd
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch

from lopd import pipeline, stages
from lopd.algorithms import get_algorithm
from lopd.composer import Composer
from lopd.config import load_config
from lopd.tables import format_table
from lopd.trainer import METRICS_FILE, Trainer

SKIPPED = ("time/", "memory/")


def run(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sets = [*args.overrides, f"train.max_steps={args.steps}",
                f"train.eval_every={args.steps + 1}", f"train.save_every={args.steps + 1}",
                "train.eval_tasks=1"]
        cfg = load_config(args.config, sets)
        if args.algo == "lopd":
            pipeline.build_bank(cfg, tmp / "bank", agent="oracle", limit=args.bank_tasks,
                                progress=False)
            model, tokenizer = stages.load_model(cfg)
            torch.manual_seed(0)
            Composer(model, tokenizer, cfg.composer).save(tmp / "composer")
            sets += [f"lopd.bank={tmp / 'bank'}", f"lopd.composer={tmp / 'composer'}"]
            cfg = load_config(args.config, sets)
        trainer = Trainer(cfg, tmp / "run", get_algorithm(args.algo), progress=False)
        trainer.run()
        records = [json.loads(line) for line in (tmp / "run" / METRICS_FILE).read_text().splitlines()]
        torch.save({k: v.detach().cpu() for k, v in trainer.ctx.student.state_dict().items()},
                   out / "student.pt")
    steps = [{k: v for k, v in r.items() if isinstance(v, (int, float))
              and not k.startswith(SKIPPED)} for r in records]
    (out / "parity.json").write_text(json.dumps({"algo": args.algo, "config": args.config,
                                                 "overrides": args.overrides, "steps": steps},
                                                indent=1))
    print(f"{args.algo}: {len(steps)} steps -> {out / 'parity.json'}, {out / 'student.pt'}")


def compare(a_dir: Path, b_dir: Path) -> None:
    a, b = (json.loads((d / "parity.json").read_text()) for d in (a_dir, b_dir))
    if (a["algo"], a["config"], a["overrides"]) != (b["algo"], b["config"], b["overrides"]):
        raise SystemExit(f"{a_dir} and {b_dir} ran different jobs: "
                         f"{a['algo']} {a['config']} {a['overrides']} vs "
                         f"{b['algo']} {b['config']} {b['overrides']}")
    rows = []
    for key in sorted(set().union(*a["steps"], *b["steps"])):
        in_a = [key in x for x in a["steps"]]
        in_b = [key in y for y in b["steps"]]
        if in_a != in_b:
            rows.append([key, f"only in {a_dir.name}" if sum(in_a) > sum(in_b)
                         else f"only in {b_dir.name}", "", ""])
            continue
        pairs = [(x[key], y[key]) for x, y in zip(a["steps"], b["steps"]) if key in x]
        diff = max(abs(x - y) for x, y in pairs)
        scale = max(max(abs(x), abs(y)) for x, y in pairs)
        rows.append([key, f"{diff:.3g}", f"{diff / scale:.3g}" if scale else "0",
                     " ".join(f"{y:.5g}" for _, y in pairs)])
    print(format_table(["figure", "max |a - b|", "relative", f"{b_dir.name} per step"], rows,
                       title=f"{a['algo']}: {a_dir} vs {b_dir}, {len(a['steps'])} steps"))
    wa, wb = (torch.load(d / "student.pt") for d in (a_dir, b_dir))
    model, _ = stages.load_model(load_config(a["config"], a["overrides"]))
    w0 = model.state_dict()
    apart = math.sqrt(sum(float((wa[k].double() - wb[k].double()).pow(2).sum()) for k in wa))
    moved = math.sqrt(sum(float((wa[k].double() - w0[k].double()).pow(2).sum()) for k in wa))
    print(f"\nfinal students: |θ_a - θ_b| = {apart:.3g}, |θ_a - θ0| = {moved:.3g}, "
          f"ratio {apart / moved if moved else float('nan'):.3g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algo", default="lopd")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--bank-tasks", type=int, default=300,
                        help="training tasks whose oracle successes fill LOPD's bank")
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--out", help="folder for parity.json and student.pt")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), type=Path,
                        help="two --out folders of the same job")
    args = parser.parse_args()
    if args.compare:
        compare(*args.compare)
    elif args.out:
        run(args)
    else:
        parser.error("give --out DIR (run) or --compare A B")


if __name__ == "__main__":
    main()
