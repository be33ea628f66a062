"""A training step in 1 and in 2 processes (torchrun, gloo, CPU), side by side.

Runs ``torchrun --nproc_per_node N -m lopd train`` for GRPO and LOPD (the shipped bank and composer)
for ``--steps`` steps of ``--rollouts`` rollouts at N = 1 and 2, and prints the median seconds per
step after the first (warm-up) and the rollouts per second. Each process uses one thread, so on a
2-core machine two processes use both cores.

    python benchmarks/distributed_step.py [--steps 4] [--rollouts 32] [--parallel ddp|fsdp2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))
from lopd.tables import format_table  # noqa: E402

ASSETS = SRC / "lopd" / "assets"


def step_times(algo: str, procs: int, args, folder: Path) -> list[float]:
    run = folder / f"{algo}-{procs}"
    sets = [f"train.max_steps={args.steps}", f"train.rollouts_per_step={args.rollouts}",
            f"train.eval_every={args.steps + 1}", f"train.save_every={args.steps + 1}",
            "train.eval_tasks=2", f"train.parallel={args.parallel}",
            f"lopd.composer={ASSETS / 'toolworld-1m-composer'}",
            f"lopd.bank={ASSETS / 'toolworld-1m-bank'}"]
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs),
                    "--master_port", str(29500 + 7 * procs + len(algo)), "-m", "lopd", "train",
                    "--algo", algo, "--out", str(run), *[x for s in sets for x in ("--set", s)]],
                   check=True, capture_output=True, env=env)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["time/step"] for r in records if r["step"] >= 2]   # rollouts included


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--parallel", default="ddp", choices=["ddp", "fsdp2"])
    parser.add_argument("--json")
    args = parser.parse_args()
    rows, out = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for algo in ("grpo", "lopd"):
            medians = {}
            for procs in (1, 2):
                medians[procs] = statistics.median(step_times(algo, procs, args, Path(tmp)))
            out[algo] = medians
            rows.append([algo, round(medians[1], 2), round(medians[2], 2),
                         round(args.rollouts / medians[1], 1), round(args.rollouts / medians[2], 1),
                         round(medians[1] / medians[2], 2)])
    print(format_table(["method", "1 process s/step", "2 processes s/step", "1 process rollouts/s",
                        "2 processes rollouts/s", "speed-up"], rows,
                       title=f"{args.rollouts} rollouts per step, {args.parallel}, gloo on CPU, "
                       f"median of steps 2-{args.steps}"))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
