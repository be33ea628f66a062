"""Sandbox throughput: answers scored per second, under bubblewrap and in the unsafe fallback.

    python benchmarks/sandbox_throughput.py --problems 200 --workers 1 2

codeworld reference solutions (``call`` tests, judged in the parent) and HumanEval canonical
solutions (``check`` tests: the recordings, made when the tasks are loaded, then the answer's
child and a trusted replay) are scored with each worker count, once isolated by
bubblewrap and once in the harness's own weaker confinement (the unsafe fallback), interleaved in
one run. Prints answers/s for each, and bubblewrap's cost as the ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

from lopd.envs import confinement, sandbox
from lopd.envs.codegen import extract_code
from lopd.envs.codeworld import CodeWorld, assemble, hidden_tests
from lopd.envs.humaneval import HumanEval


def jobs_of(problems: int) -> dict[str, tuple[list, sandbox.Limits]]:
    code = CodeWorld(sizes={"eval": problems, "train": 0, "pretrain": 0})
    codeworld = []
    for task in code.tasks("eval"):
        meta = task.meta
        program = assemble(extract_code(task.oracle_texts()[0]), meta["entry_point"],
                           meta["signature"])
        codeworld.append((program, hidden_tests(meta["entry_point"], meta["tests"])))
    human = HumanEval()
    humaneval = [(t.meta["prompt"] + "\n" + t.meta["solution"], human.reset(t).tests)
                 for t in human.tasks("eval")[:problems]]
    return {"codeworld": (codeworld, code.limits), "humaneval": (humaneval, human.limits)}


@contextlib.contextmanager
def isolation_mode(mode: str):
    """Score under bubblewrap, or as if it were unavailable and the unsafe mode were chosen."""
    if mode == "bubblewrap":
        yield
        return
    real = confinement.isolation
    confinement.isolation = lambda: (None, "measuring the fallback")
    sandbox.allow_unsafe_fallback(True)
    try:
        yield
    finally:
        confinement.isolation = real
        sandbox.allow_unsafe_fallback(False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", type=int, default=200)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    jobs = jobs_of(args.problems)
    figures = {"problems": {k: len(v[0]) for k, v in jobs.items()}, "runs": []}
    for workers in args.workers:
        for env, (env_jobs, limits) in jobs.items():
            for mode in ("bubblewrap", "unsafe fallback"):
                with isolation_mode(mode):
                    start = time.perf_counter()
                    reports = sandbox.run_many(env_jobs, limits, workers=workers)
                    seconds = time.perf_counter() - start
                assert all(r.all_passed for r in reports), f"a reference failed ({env}, {mode})"
                assert {r.meta["isolation"] for r in reports} == {mode}
                figures["runs"].append({"env": env, "mode": mode, "workers": workers,
                                        "seconds": round(seconds, 2),
                                        "answers_per_second": round(len(env_jobs) / seconds, 1)})
    print(f"{'env':10} {'workers':>7} {'bubblewrap':>12} {'unsafe fallback':>16} {'ratio':>6}")
    rows = {(r["env"], r["workers"], r["mode"]): r["answers_per_second"] for r in figures["runs"]}
    for workers in args.workers:
        for env in jobs:
            isolated, weak = rows[env, workers, "bubblewrap"], rows[env, workers, "unsafe fallback"]
            print(f"{env:10} {workers:>7} {isolated:>10.1f}/s {weak:>14.1f}/s "
                  f"{isolated / weak:>6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
