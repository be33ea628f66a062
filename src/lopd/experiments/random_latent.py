"""The random-latent control (``lopd experiment random-latent``).

LOPD whose composer reads random bank entries of other tasks (``lopd.retrieval=random``) instead of
the retrieved ones, from the same cold start, against retrieved ones: how much of LOPD's gain over
the base comes from *retrieved* experience. Students are scored greedily on the held-out tasks
without retrieval or latents. Reported in ``docs/results/random-latent.md``.
"""

from __future__ import annotations

from pathlib import Path

from lopd.experiments.common import run_arms


def random_latent(config, overrides: list[str], out: Path, seeds: int = 3,
                  jobs: int = 1) -> dict:
    """Retrieved experiences against random ones in the composer's input (the same cold start)."""
    arms = {"retrieved": ["lopd.retrieval=nearest"], "random": ["lopd.retrieval=random"]}
    labels = {"retrieved": "retrieved experiences", "random": "random experiences"}
    return run_arms("random-latent", config, overrides, arms, seeds, out, jobs, "retrieved",
                    labels)
