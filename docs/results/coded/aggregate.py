"""Held-out reward and success per evaluation, mean ± population std over seeds, as a markdown table.

    python docs/results/coded/aggregate.py lopd=runs/v5/compare/lopd grpo=runs/v5/compare/grpo
    python docs/results/coded/aggregate.py lopd=runs/v4/lopd-s

Each NAME=PREFIX names a method and the run folders of its seeds: every folder whose path starts with
PREFIX and holds an eval.jsonl (a `lopd compare` method folder, or the common prefix of run folders).
"""
import json
import statistics as st
import sys
from pathlib import Path


def seed_runs(prefix: str) -> list[Path]:
    path = Path(prefix)
    if path.is_dir() and not (path / "eval.jsonl").exists():
        return sorted(p for p in path.iterdir() if (p / "eval.jsonl").exists())
    return sorted(p for p in path.parent.glob(path.name + "*") if (p / "eval.jsonl").exists())


methods = dict(arg.split("=", 1) for arg in sys.argv[1:]) or {
    "lopd": "runs/v5/compare/lopd", "grpo": "runs/v5/compare/grpo"}
evals = {}   # method -> rollouts -> [(reward, success) per seed]
for name, prefix in methods.items():
    runs = seed_runs(prefix)
    if not runs:
        sys.exit(f"{name}={prefix}: no run folder with an eval.jsonl")
    for run in runs:
        for line in (run / "eval.jsonl").read_text().splitlines():
            e = json.loads(line)
            evals.setdefault(name, {}).setdefault(e["generations"], []).append(
                (e["mean_reward"], e["success_rate"]))
print("| rollouts | " + " | ".join(f"{m} reward (per seed) | {m} success" for m in methods) + " |")
print("| --- |" + " --- |" * (2 * len(methods)))
for gens in sorted(set.intersection(*(set(v) for v in evals.values()))):
    cells = []
    for name in methods:
        rw = [r for r, _ in evals[name][gens]]
        sc = [s for _, s in evals[name][gens]]
        cells += [f"{st.mean(rw):.4f} ± {st.pstdev(rw):.4f} ({', '.join(f'{x:.4f}' for x in rw)})",
                  f"{st.mean(sc):.3f} ± {st.pstdev(sc):.3f}"]
    print(f"| {gens:,} | " + " | ".join(cells) + " |")
