"""Training runs an experiment can resume and reuse: a run folder is trained to its last step once.

``compare``, ``sweep`` and the quickstart call :func:`train_or_reuse`, so an interrupted experiment
continues where it stopped and a finished run is never trained again. A folder made with another
config is refused rather than mixed in.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from lopd import pipeline
from lopd.config import Config, load_config
from lopd.trainer import CONFIG_FILE, EVAL_FILE, checkpoints, read_jsonl


def read_evals(run_dir: Path) -> list[dict]:
    """The run's held-out evaluations, in step order (empty before its first)."""
    return read_jsonl(Path(run_dir) / EVAL_FILE)


def setup_generations(evals: list[dict]) -> int:
    """Rollouts the run's method consumed before training (LOPD: bank building and cold-start
    sampling; GRPO: none), as its eval records state it. Records written before the field existed
    count 0; a run resumed across that change has both kinds, so the largest figure is its own."""
    return max((r.get("setup_generations", 0) for r in evals), default=0)


def finished(run_dir: Path, max_steps: int) -> bool:
    return any(r["step"] == max_steps for r in read_evals(run_dir))


def config_differences(saved: dict, wanted: dict, defaults: dict, prefix: str = "") -> list[str]:
    """Dotted keys where a saved run config and the wanted one disagree. A key the saved config
    lacks (a setting added to lopd after the run was made) counts as agreeing when the wanted value
    is the setting's default: the run behaved as that default does."""
    keys = []
    for key in [*saved, *(k for k in wanted if k not in saved)]:
        name = f"{prefix}{key}"
        default = defaults.get(key)
        if key not in saved and isinstance(wanted[key], dict):
            keys.extend(config_differences({}, wanted[key], default or {}, f"{name}."))
        elif key not in saved:
            if wanted[key] != default:
                keys.append(name)
        elif key not in wanted:
            keys.append(name)
        elif isinstance(saved[key], dict) and isinstance(wanted[key], dict):
            keys.extend(config_differences(saved[key], wanted[key], default or {}, f"{name}."))
        elif saved[key] != wanted[key]:
            keys.append(name)
    return keys


def differing_keys(saved: dict, cfg: Config) -> str:
    """The keys in which a saved config (a run's ``config.yaml``, a cold start's record) differs
    from ``cfg``, settings added to lopd since it was saved taken at their defaults, as a short
    list for an error message ("" when they agree)."""
    import yaml

    def plain(c: Config) -> dict:
        return yaml.safe_load(yaml.safe_dump(c.to_dict(), sort_keys=False))

    differ = config_differences(saved, plain(cfg), plain(load_config(None)))
    return ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")


def check_reusable(cfg: Config, run_dir: Path) -> None:
    """A run folder made with a different config is never reused or resumed: that would mix runs.
    Settings added to lopd since the run was made are taken at their defaults."""
    import yaml

    saved = Path(run_dir) / CONFIG_FILE
    if not saved.exists():
        return
    shown = differing_keys(yaml.safe_load(saved.read_text()), cfg)
    if shown:
        raise ValueError(f"{run_dir} holds a run with a different config than this experiment "
                         f"asks for ({shown}); move it away or use another --out")


def train_or_reuse(cfg: Config, run_dir: Path, algo: str) -> None:
    """Train ``run_dir`` to the end, resuming it from its last checkpoint; a finished run is reused,
    and one stopped before its first checkpoint starts again (it has nothing to resume)."""
    check_reusable(cfg, run_dir)
    if finished(run_dir, cfg.train.max_steps):
        return
    resume = bool(checkpoints(run_dir))
    if not resume:
        shutil.rmtree(run_dir, ignore_errors=True)
    pipeline.train(cfg, run_dir, algo, resume=resume)
