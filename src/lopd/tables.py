"""Readable tables on the console and the same figures as JSON for scripts."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value)
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """A plain-text table with aligned columns (numbers right-aligned)."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [all(isinstance(row[i], (int, float)) and not isinstance(row[i], bool) for row in rows)
               and bool(rows) for i in range(len(headers))]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric)).rstrip()

    out = [title] if title else []
    out += [line(headers), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    return "\n".join(out)


def key_value_table(figures: dict[str, Any], title: str | None = None) -> str:
    return format_table(["field", "value"], [[k, v] for k, v in figures.items()], title=title)


def write_json(path: str | Path | None, figures: Any) -> None:
    """Write ``figures`` as JSON to ``path`` (parent folders created); no-op when path is None."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures, indent=2, default=str) + "\n")


def domain_rows(summary: dict) -> list[list]:
    """Rows of an episode summary (``agent.summarize``): one per domain, then "all"."""
    rows = [[domain, d["episodes"], d["mean_reward"], d["success_rate"]]
            for domain, d in sorted(summary["per_domain"].items())]
    rows.append(["all", summary["episodes"], summary["mean_reward"], summary["success_rate"]])
    return rows
