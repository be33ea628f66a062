"""The joint-optimisation experiment (``lopd experiment joint-optimisation``), the paper's ablation.

LOPD with the cold-started composer φ0 frozen (no composer or dual update) against jointly
optimised composers at margins m ∈ {0, 0.01, 0.05, 0.1}: one arm per margin, all from the same
cold start, scored as students (greedy, held-out tasks, no retrieval or latents) and each set
against the frozen arm. Reported in ``docs/results/joint-optimisation.md``.
"""

from __future__ import annotations

from pathlib import Path

from lopd.experiments.common import run_arms

MARGINS = (0.0, 0.01, 0.05, 0.1)


def _number(value: float) -> str:
    return f"{value:g}"


def joint_optimisation(config, overrides: list[str], out: Path, seeds: int = 3, jobs: int = 1,
                       margins=MARGINS) -> dict:
    """φ0 frozen against jointly optimised composers at each margin (see the module docstring)."""
    if not margins:
        raise ValueError("joint-optimisation needs at least one margin")
    arms = {"frozen": ["lopd.update_composer=false"]}
    labels = {"frozen": "frozen φ0"}
    for m in margins:
        arms[f"margin-{_number(m)}"] = [f"lopd.margin={m}"]
        labels[f"margin-{_number(m)}"] = f"joint, m = {_number(m)}"
    return run_arms("joint-optimisation", config, overrides, arms, seeds, out, jobs, "frozen",
                    labels)
