"""Sandbox throughput: codeworld reference solutions scored one child at a time vs. in parallel.

    python benchmarks/sandbox_throughput.py --problems 200 --workers 1 2

Prints answers scored per second for each worker count, measured side by side in one run, and the
speed-up over the first.
"""

from __future__ import annotations

import argparse
import json
import time

from lopd.envs.codegen import extract_code
from lopd.envs.codeworld import CodeWorld, assemble, hidden_tests
from lopd.envs.sandbox import run_many


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", type=int, default=200)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    env = CodeWorld(sizes={"eval": args.problems, "train": 0, "pretrain": 0})
    jobs = []
    for task in env.tasks("eval"):
        meta = task.meta
        program = assemble(extract_code(task.oracle_texts()[0]), meta["entry_point"],
                           meta["signature"])
        jobs.append((program, hidden_tests(meta["entry_point"], meta["tests"])))
    figures = {"problems": len(jobs), "runs": []}
    for workers in args.workers:
        start = time.perf_counter()
        reports = run_many(jobs, workers=workers)
        seconds = time.perf_counter() - start
        assert all(r.all_passed for r in reports), "a reference solution failed"
        figures["runs"].append({"workers": workers, "seconds": round(seconds, 2),
                                "answers_per_second": round(len(jobs) / seconds, 1)})
    base = figures["runs"][0]["answers_per_second"]
    for row in figures["runs"]:
        print(f"workers {row['workers']}: {row['answers_per_second']:.1f} answers/s "
              f"({row['seconds']:.1f} s, x{row['answers_per_second'] / base:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
