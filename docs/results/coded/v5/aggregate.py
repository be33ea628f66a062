"""Held-out reward per evaluation, mean ± population std over seeds, for each method of a
`lopd compare` folder (default runs/v5/compare): python docs/results/coded/v5/aggregate.py [DIR]"""
import json
import statistics as st
import sys
from pathlib import Path

root = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/v5/compare")
print("| rollouts | " + " | ".join(f"{a} reward | {a} success" for a in ("lopd", "grpo")) + " |")
print("| --- |" + " --- |" * 4)
tables = {}
for algo in ("lopd", "grpo"):
    for seed_dir in sorted((root / algo).glob("seed*")):
        for line in open(seed_dir / "eval.jsonl"):
            e = json.loads(line)
            tables.setdefault(algo, {}).setdefault(e["generations"], []).append(
                (e["mean_reward"], e["success_rate"]))
for gens in sorted(tables["lopd"]):
    cells = []
    for algo in ("lopd", "grpo"):
        rw = [r for r, _ in tables[algo][gens]]
        sc = [s for _, s in tables[algo][gens]]
        cells += [f"{st.mean(rw):.4f} ± {st.pstdev(rw):.4f} ({', '.join(f'{x:.4f}' for x in rw)})",
                  f"{st.mean(sc):.3f} ± {st.pstdev(sc):.3f}"]
    print(f"| {gens:,} | " + " | ".join(cells) + " |")
