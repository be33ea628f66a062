"""The paper's method table from two comparisons: one on toolworld, one on codeworld.

Each input is an ``lopd compare`` folder (its ``results.json``). Rows are the methods of either
comparison in the paper's order; columns are toolworld's final held-out mean reward per domain and
overall and its success rate, codeworld's held-out mean reward and pass@1 (success rate, greedy),
and any transfer column of either comparison (HumanEval pass@1 when it was run with ``--transfer
humaneval``, BFCL's mean reward with ``--transfer bfcl``), each as mean ± population std over seeds,
then the rollouts each method was charged per domain.

A method *beats* a reference on a column when its mean exceeds the reference's by more than the sum
of the two spreads (std); the verdicts against the base and against GRPO are written under the
table, including every method that ends below the base.

    python -m lopd.experiments.method_table --toolworld runs/table-tool \\
        --codeworld runs/table-code --out docs/results/method-table
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

ORDER = ["base", "grpo", "sdft", "opsd", "sdpo", "skill_sd", "lopd"]
"""Row order: the untrained model, the RL baseline, the four self-distillation baselines, LOPD."""

NAMES = {"base": "Base (untrained)", "grpo": "GRPO", "sdft": "SDFT", "opsd": "OPSD",
         "sdpo": "SDPO", "skill_sd": "Skill-SD", "lopd": "LOPD"}


def _stats(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.pstdev(values) if len(values) > 1 else 0.0


def read(folder: Path) -> dict:
    """The ``results.json`` of a comparison folder (a clear error when it is not one)."""
    path = Path(folder) / "results.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} is not an lopd compare folder (no results.json)")
    return json.loads(path.read_text())


def columns(tool: dict | None, code: dict | None) -> list[tuple[str, str, str]]:
    """(label, comparison, key) for every column: ``key`` is ``mean_reward``, ``success_rate``,
    ``domain:NAME`` or ``transfer:ENV``. A transfer column reads pass@1 for a code environment and
    the mean reward otherwise (what :func:`lopd.experiments.compare.transfer_score` records)."""
    from lopd.experiments.compare import transfer_metric

    cols = []
    if tool is not None:
        domains = sorted(next(iter(tool["per_seed"].values())).get("per_domain", {}))
        cols += [(f"toolworld {d}", "toolworld", f"domain:{d}") for d in domains]
        cols.append(("toolworld average", "toolworld", "mean_reward"))
        cols.append(("toolworld success", "toolworld", "success_rate"))
    if code is not None:
        cols.append(("codeworld reward", "codeworld", "mean_reward"))
        cols.append(("codeworld pass@1", "codeworld", "success_rate"))
    for source, report in (("toolworld", tool), ("codeworld", code)):
        for env in (report or {}).get("transfer", []):
            label = f"{env} {transfer_metric(env)}"
            if any(c[0] == label for c in cols):
                label = f"{label} ({source} students)"
            cols.append((label, source, f"transfer:{env}"))
    return cols


def values(report: dict, algo: str, key: str) -> list[float] | None:
    """A method's per-seed figures for one column key (None when the method was not run)."""
    row = report["per_seed"].get(algo)
    if row is None:
        return None
    kind, _, name = key.partition(":")
    if kind == "domain":
        return row.get("per_domain", {}).get(name)
    if kind == "transfer":
        return row.get("transfer", {}).get(name)
    return row[key]


def beats(method: tuple[float, float], reference: tuple[float, float]) -> bool:
    """Mean above the reference's by more than the sum of the two spreads."""
    return method[0] - reference[0] > method[1] + reference[1]


def build(tool: dict | None, code: dict | None) -> dict:
    """Every cell as (mean, std) or None, the rollouts charged, and the verdicts."""
    reports = {"toolworld": tool, "codeworld": code}
    cols = columns(tool, code)
    algos = [a for a in ORDER if any(r is not None and a in r["per_seed"]
                                     for r in reports.values())]
    cells = {a: {label: (None if reports[src] is None or values(reports[src], a, key) is None
                         else _stats(values(reports[src], a, key)))
                 for label, src, key in cols} for a in algos}
    charged = {a: {src: r["per_seed"][a]["charged_generations"]
                   for src, r in reports.items() if r is not None and a in r["per_seed"]}
               for a in algos}
    seeds = {src: r["seeds"] for src, r in reports.items() if r is not None}
    verdicts = {}
    for ref in ("base", "grpo"):
        for a in algos:
            if a in (ref, "base") or ref not in cells:
                continue
            for label, _, _ in cols:
                mine, theirs = cells[a][label], cells[ref][label]
                if mine is None or theirs is None:
                    continue
                verdicts.setdefault(ref, {}).setdefault(a, {})[label] = (
                    "above" if beats(mine, theirs) else
                    "below" if beats(theirs, mine) else "within")
    return {"columns": [c[0] for c in cols], "cells": cells, "charged": charged, "seeds": seeds,
            "verdicts": verdicts}


def markdown(table: dict) -> str:
    cols = table["columns"]
    sources = list(table["seeds"])
    head = ["method", *cols, *[f"{s} rollouts charged" for s in sources]]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for algo, row in table["cells"].items():
        cells = ["-" if row[c] is None else f"{row[c][0]:.4f} ± {row[c][1]:.4f}" for c in cols]
        spent = [str(table["charged"][algo].get(s, "-")) for s in sources]
        lines.append("| " + " | ".join([NAMES.get(algo, algo), *cells, *spent]) + " |")
    seeds = ", ".join(f"{s} {n}" for s, n in table["seeds"].items())
    lines += ["", f"Mean ± population std over seeds ({seeds}); the base is greedy, so its spread "
              "is 0. A method is *above* or *below* a reference on a column when the means differ "
              "by more than the sum of the two spreads, otherwise *within*.", ""]
    for ref, per_algo in table["verdicts"].items():
        lines.append(f"Against {NAMES[ref]}:")
        lines.append("")
        for algo, per_col in per_algo.items():
            groups = {v: [c for c, w in per_col.items() if w == v]
                      for v in ("above", "below", "within")}
            text = "; ".join(f"{v}: {', '.join(cs)}" for v, cs in groups.items() if cs)
            lines.append(f"- {NAMES.get(algo, algo)}: {text}")
        lines.append("")
    return "\n".join(lines)


def write(tool_dir: Path | None, code_dir: Path | None, out: Path) -> dict:
    """Write ``OUT/table.md``, ``OUT/table.json`` and each comparison's figure as
    ``OUT/DOMAIN.png``; return the table."""
    if tool_dir is None and code_dir is None:
        raise ValueError("give --toolworld, --codeworld or both")
    tool = read(tool_dir) if tool_dir else None
    code = read(code_dir) if code_dir else None
    table = build(tool, code)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(markdown(table))
    (out / "table.json").write_text(json.dumps(table, indent=1))
    for name, folder in (("toolworld", tool_dir), ("codeworld", code_dir)):
        figure = Path(folder) / "reward_vs_generations.png" if folder else None
        if figure is not None and figure.is_file():
            shutil.copyfile(figure, out / f"{name}.png")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lopd.experiments.method_table",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--toolworld", type=Path, help="lopd compare folder on toolworld")
    parser.add_argument("--codeworld", type=Path, help="lopd compare folder on codeworld")
    parser.add_argument("--out", type=Path, required=True, help="folder for table.md/json, figures")
    args = parser.parse_args(argv)
    write(args.toolworld, args.codeworld, args.out)
    print((args.out / "table.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
