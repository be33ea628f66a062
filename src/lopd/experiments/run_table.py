"""Every training run of an experiment, one row each, from the run's kept records alone.

Reads the run folders under a folder: ``ALGO/seedK`` of ``lopd compare``, ``ARM/seedK`` of an
experiment, or a single run folder. Each row gives the run's held-out mean reward and success rate
at every evaluation, how the episodes of its last evaluation ended (mean turns; final answers,
turn limit, context limit, environment done), its training success (the mean over steps, and on how
many steps any rollout succeeded), the median of its steps' ``time/step`` and ``time/backward``, and
every transfer score cached beside it (``transfer-ENV.json``: the score and its scoring seconds).
A comparison's untrained base (``base/eval.json``) is a row too. Nothing is trained or loaded, so
the records kept in the repository print the same table anywhere.

    python -m lopd.experiments.run_table docs/results/smollm2/avx512-bf16/own-sweep \\
        --out docs/results/smollm2/avx512-bf16/own-sweep
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from lopd.experiments.common import write_report
from lopd.experiments.compare import BASE, transfer_metric
from lopd.experiments.method_table import ORDER
from lopd.trainer import EVAL_FILE, METRICS_FILE, RunError, read_jsonl

ENDINGS = {"answer": "answer{s}", "max_turns": "at the turn limit",
           "max_length": "at the context limit", "env_done": "environment done"}
"""How an episode ended (its ``finish_reason``), in the words of the table, in this order."""


def find_runs(folder: Path) -> list[tuple[str, Path]]:
    """(label, path) of every run under ``folder`` in table order: methods in the method table's
    order (a folder ``ALGO/...`` or ``ALGO-...``; other names alphabetically), then by the numbers
    in the label (seeds). The base of a comparison is the path of its ``eval.json``."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder")
    if (folder / EVAL_FILE).is_file():
        return [(folder.name, folder)]
    found = []
    if (folder / BASE / "eval.json").is_file():
        found.append((BASE, folder / BASE / "eval.json"))
    for path in sorted(folder.glob(f"*/{EVAL_FILE}")) + sorted(folder.glob(f"*/*/{EVAL_FILE}")):
        found.append((path.parent.relative_to(folder).as_posix(), path.parent))
    if not found:
        raise FileNotFoundError(f"{folder} holds no run records (no {EVAL_FILE} in it, "
                                f"in its subfolders or in theirs, and no {BASE}/eval.json)")

    def key(item):
        method = item[0].split("/")[0].split("-")[0]
        rank = ORDER.index(method) if method in ORDER else len(ORDER)
        numbers = [int(n) for n in re.findall(r"\d+", item[0])]
        return rank, method, numbers, item[0]

    return sorted(found, key=key)


def _median(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if key in r]
    return statistics.median(values) if values else None


def _transfers(folder: Path) -> dict[str, dict]:
    scores = {}
    for path in sorted(folder.glob("transfer-*.json")):
        record = json.loads(path.read_text())
        scores[path.stem.removeprefix("transfer-")] = {"score": record["score"],
                                                       "seconds": record.get("seconds")}
    return scores


def _episodes(evaluation: dict) -> dict:
    return {"episodes": evaluation.get("episodes"), "mean_turns": evaluation.get("mean_turns"),
            "finish_reasons": evaluation.get("finish_reasons", {})}


def run_row(label: str, path: Path) -> dict:
    """One run's figures (see the module's doc); ``path`` is a run folder or a base's
    ``eval.json``."""
    if path.name == "eval.json":
        evaluation = json.loads(path.read_text())
        return {"run": label, "trained": False,
                "evaluations": [{"step": 0, "mean_reward": evaluation["mean_reward"],
                                 "success_rate": evaluation["success_rate"]}],
                "last_evaluation": _episodes(evaluation), "training_success": None,
                "steps_with_success": None, "steps": 0, "median_step_seconds": None,
                "median_backward_seconds": None, "transfer": _transfers(path.parent)}
    evals = read_jsonl(path / EVAL_FILE)
    if not evals:
        raise RunError(f"{path / EVAL_FILE}: no evaluation recorded yet")
    metrics = [r for r in read_jsonl(path / METRICS_FILE) if r.get("step", 0) > 0]
    success = [r["train/success_rate"] for r in metrics if "train/success_rate" in r]
    return {
        "run": label, "trained": True,
        "evaluations": [{"step": r["step"], "mean_reward": r["mean_reward"],
                         "success_rate": r["success_rate"]} for r in evals],
        "last_evaluation": _episodes(evals[-1]),
        "training_success": statistics.fmean(success) if success else None,
        "steps_with_success": sum(s > 0 for s in success) if success else None,
        "steps": len(metrics),
        "median_step_seconds": _median(metrics, "time/step"),
        "median_backward_seconds": _median(metrics, "time/backward"),
        "transfer": _transfers(path),
    }


def run_table(folder: Path) -> dict:
    """Every run under ``folder`` (see :func:`find_runs`), one row each."""
    rows = []
    for label, path in find_runs(folder):
        try:
            rows.append(run_row(label, path))
        except KeyError as error:
            raise RunError(f"{path}: a record without {error}") from None
        except json.JSONDecodeError as error:
            raise RunError(f"{path}: not JSON ({error})") from None
    return {"folder": str(folder), "runs": rows}


def _endings(episodes: dict) -> str:
    reasons = dict(episodes["finish_reasons"])
    parts = []
    for name, words in ENDINGS.items():
        if name in reasons:
            count = reasons.pop(name)
            parts.append(f"{count} {words.format(s='' if count == 1 else 's')}")
    parts += [f"{count} {name}" for name, count in sorted(reasons.items())]
    turns = episodes["mean_turns"]
    head = f"{turns:.1f} turns" if turns is not None else "turns not recorded"
    return f"{head}: {', '.join(parts)}" if parts else head


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def table_markdown(report: dict) -> str:
    """The runs as a markdown table; the held-out column names its steps when every trained run
    was evaluated at the same ones, and each cell names them otherwise."""
    rows = report["runs"]
    trained = [r for r in rows if r["trained"]]
    step_lists = {tuple(e["step"] for e in r["evaluations"]) for r in trained}
    shared = next(iter(step_lists)) if len(step_lists) == 1 else None
    envs = sorted({env for r in rows for env in r["transfer"]})

    def held_out(row):
        cells = [f"{e['mean_reward']:.4f} ({e['success_rate']:.2f})" for e in row["evaluations"]]
        if not row["trained"]:
            return f"{cells[0]}, untrained"
        if shared is None:
            cells = [f"{e['step']}: {c}" for e, c in zip(row["evaluations"], cells)]
        cells[-1] = f"**{cells[-1]}**"
        return " / ".join(cells)

    if shared:
        steps = f"step{'s' if len(shared) > 1 else ''} {' / '.join(str(s) for s in shared)}"
    else:
        steps = "each evaluation (step: figure)"
    header = ["run", f"held-out mean reward (success) at {steps}",
              "episodes of the last evaluation", "training success (steps with any)",
              "median step (backward)"]
    header += [f"{env} {transfer_metric(env)} (scoring time)" for env in envs]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for row in rows:
        cells = [row["run"], held_out(row), _endings(row["last_evaluation"])]
        if row["trained"] and row["training_success"] is not None:
            cells.append(f"{row['training_success']:.3f} ({row['steps_with_success']} of "
                         f"{row['steps']})")
        else:
            cells.append("-")
        cells.append("-" if row["median_step_seconds"] is None else
                     f"{_seconds(row['median_step_seconds'])} "
                     f"({_seconds(row['median_backward_seconds'])})")
        for env in envs:
            score = row["transfer"].get(env)
            cells.append("-" if score is None else
                         f"{score['score']:.4f} ({_seconds(score['seconds'])})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lopd.experiments.run_table",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path,
                        help="an lopd compare or experiment folder, or one run folder")
    parser.add_argument("--out", type=Path, help="folder for runs.md and runs.json (optional)")
    args = parser.parse_args(argv)
    try:
        report = run_table(args.folder)
        text = table_markdown(report)
    except (RunError, FileNotFoundError) as error:
        parser.exit(2, f"error: {error}\n")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        write_report(args.out, "runs", report, text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
