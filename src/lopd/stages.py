"""The stages a run is made of: the environment, engines, models and policies, held-out
evaluation, episode files and the experience bank.

The trainer, the algorithms and the warm-up build on these; :mod:`lopd.pipeline` composes them
into the entry points (bank building, cold start, training), and the CLI, the quickstart,
``compare`` / ``sweep`` and the benchmarks call the same functions: none of them builds an engine,
a policy or an evaluation of its own. Each takes a :class:`Config` and returns objects or plain
figures. The cold-started composer and bank shipped in the package are named here too
(:data:`EMBEDDED_COMPOSER`, :data:`EMBEDDED_BANK`).

Heavy modules (torch, transformers, FAISS, vLLM) are imported inside the functions that use them,
so that the CLI's parser and the commands that need none of them start without loading them.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from lopd.config import Config, ConfigError

if TYPE_CHECKING:
    import torch

# ----------------------------------------------------------------------------------------------
# Embedded assets

ASSETS = Path(__file__).parent / "assets"
EMBEDDED_COMPOSER = ASSETS / "toolworld-1m-composer"
"""The cold-started composer shipped in the package (a folder written by ``Composer.save``)."""
EMBEDDED_BANK = ASSETS / "toolworld-1m-bank"
"""The experience bank it was cold-started on (never written to: runs work on copies)."""
EMBEDDED_FOR = ("toolworld-1m", "toolworld")
"""(model, environment) the embedded composer and bank were built for."""
PROVENANCE_FILE = "provenance.json"
PROVENANCE_KEYS = ("bank_rollouts", "cold_start_steps", "commands")


def embedded_assets(cfg: Config) -> tuple[Path, Path]:
    """(composer folder, bank folder) shipped in the package, checked to exist and to fit ``cfg``'s
    model and environment."""
    from lopd.composer import Composer
    from lopd.experience import DB_NAME

    model, env = EMBEDDED_FOR
    if cfg.model.name_or_path != model or cfg.env.name != env:
        raise ValueError(f"the embedded composer and bank were built for {model} on {env}, not "
                         f"{cfg.model.name_or_path} on {cfg.env.name}; build both for it with "
                         "--rebuild")
    missing = [str(folder) for folder, marker in ((EMBEDDED_COMPOSER, Composer.CONFIG_FILE),
                                                  (EMBEDDED_BANK, DB_NAME))
               if not (folder / marker).is_file()]
    if missing:
        raise FileNotFoundError(f"the embedded cold-started composer and bank are not in this "
                                f"install (missing {', '.join(missing)}); build both here with "
                                "`lopd quickstart --rebuild`")
    return EMBEDDED_COMPOSER, EMBEDDED_BANK


def read_provenance(*folders: str | Path) -> dict:
    """``bank_rollouts``, ``cold_start_steps`` and ``commands`` as recorded in the folders'
    ``provenance.json`` (the first folder that records a key wins); ``"unknown"`` where none
    does."""
    found: dict = {}
    for folder in folders:
        path = Path(folder) / PROVENANCE_FILE
        if path.is_file():
            try:
                record = json.loads(path.read_text())
            except ValueError:
                continue
            if isinstance(record, dict):
                for key, value in record.items():
                    found.setdefault(key, value)
    return {**found, **{key: found.get(key, "unknown") for key in PROVENANCE_KEYS}}


# ----------------------------------------------------------------------------------------------
# Engines and policies

def _engines() -> tuple[str, ...]:
    from lopd.rollout.vllm_engine import vllm_available

    return ("transformers", "vllm") if vllm_available() else ("transformers",)


ENGINES = _engines()
"""Rollout engines that exist here; ``rollout.engine`` accepts these and refuses any other
("vllm" only where vLLM can be imported)."""


def engine_name(rollout_cfg, fsdp2: bool = False) -> tuple[str, str]:
    """(the engine ``rollout.engine`` names here, why): 'auto' is vllm where vLLM is installed
    and supports the run, else transformers; ``fsdp2``: the student is sharded over several
    processes (train.parallel=fsdp2), which vLLM does not support."""
    choice = rollout_cfg.engine
    if choice != "auto":
        return choice, f"rollout.engine={choice}"
    if "vllm" not in ENGINES:
        return "transformers", "auto: vLLM is not installed here"
    if fsdp2:
        return "transformers", "auto: vLLM does not serve a student sharded by train.parallel=fsdp2"
    if rollout_cfg.generation_weights == "bf16-copy":
        return "transformers", "auto: rollout.generation_weights=bf16-copy is the transformers engine's"
    return "vllm", "auto: vLLM is installed"


def check_engine(rollout_cfg, fsdp2: bool = False) -> None:
    """Refuse, at start-up, a ``rollout.engine`` no engine implements (or whose library is
    missing, saying how to install it), and ``rollout.vllm_sleep`` where vLLM has no sleep mode."""
    engine, _ = engine_name(rollout_cfg, fsdp2)
    if engine == "vllm" and rollout_cfg.generation_weights == "bf16-copy":
        raise ConfigError("rollout.generation_weights=bf16-copy is a transformers-engine setting: "
                          "with rollout.engine=vllm the served dtype is rollout.vllm_dtype")
    if engine in ENGINES:
        if engine == "vllm" and rollout_cfg.vllm_sleep:
            from lopd.rollout.vllm_engine import check_sleep_mode

            check_sleep_mode()
        return
    if engine == "vllm":
        from lopd.rollout.vllm_engine import INSTALL_HINT

        raise ConfigError(f"rollout.engine='vllm' needs vLLM, which is not installed here: "
                          f"{INSTALL_HINT}; available: {', '.join(ENGINES)}")
    raise ConfigError(f"rollout.engine={engine!r} is not available: lopd has no "
                      f"{engine} engine yet; available: {', '.join(ENGINES)}")


def make_engine(rollout_cfg, model, tokenizer, precision: str = "auto", train: bool = False,
                fsdp2: bool = False):
    """The rollout engine ``rollout.engine`` names (:func:`engine_name`) over ``model`` (kept
    resident; ``fsdp2``: sharded over several processes). An engine
    that holds its own copy of the weights (vLLM) must be told of every update of ``model``:
    :func:`sync_engine` after each optimiser step. ``precision``: the run's (``run.precision``),
    which decides vLLM's served dtype; ``train``: ``model`` is the student the caller updates
    (vLLM keeps room for the update, or sleeps through it with ``rollout.vllm_sleep``)."""
    check_engine(rollout_cfg, fsdp2)
    if engine_name(rollout_cfg, fsdp2)[0] == "vllm":
        from vllm.platforms import current_platform

        from lopd import runtime
        from lopd.rollout.vllm_engine import UPDATE_WEIGHT_COPIES, VLLMEngine, serving_dtype

        weights = list(model.parameters())
        resolved = runtime.resolve_precision(precision, weights[0].device,
                                             runtime.hidden_size(model))
        sleep = train and rollout_cfg.vllm_sleep
        trainable = sum(p.numel() * p.element_size() for p in weights if p.requires_grad)
        return VLLMEngine(
            model, tokenizer,
            kv_cache_gb=rollout_cfg.vllm_cpu_kv_cache_gb if current_platform.is_cpu() else None,
            dtype=serving_dtype(rollout_cfg.vllm_dtype, resolved, weights[0].dtype),
            gpu_memory_utilization=rollout_cfg.vllm_gpu_memory_utilization,
            update_bytes=UPDATE_WEIGHT_COPIES * trainable if train and not sleep else 0,
            sleep=sleep)
    from lopd.rollout import TransformersEngine

    return TransformersEngine(model, tokenizer,
                              weights_dtype=generation_dtype(rollout_cfg, model, precision))


def generation_dtype(rollout_cfg, model, precision: str = "auto") -> torch.dtype | None:
    """The dtype of the weight copy the transformers engine generates from
    (``rollout.generation_weights``), None to generate from ``model`` itself. A refused
    'bf16-copy' stops with the reason; 'auto' falls back to the model's own weights."""
    import torch
    from peft.tuners.tuners_utils import BaseTunerLayer
    from torch.distributed.tensor import DTensor

    from lopd import runtime

    choice = rollout_cfg.generation_weights
    if choice == "master":
        return None
    weights = next(model.parameters())
    resolved = runtime.resolve_precision(precision, weights.device, runtime.hidden_size(model))
    refused = []
    if resolved != "bf16-mixed":
        refused.append(f"run.precision resolves to {resolved} (the copy is bf16-mixed's)")
    if any(isinstance(m, BaseTunerLayer) for m in model.modules()):
        refused.append("the model has LoRA adapters, whose on/off state a copy would not follow")
    if isinstance(weights, DTensor):
        refused.append("the model's weights are sharded (train.parallel=fsdp2)")
    if refused and choice == "bf16-copy":
        raise ConfigError(f"rollout.generation_weights=bf16-copy is refused: {'; '.join(refused)}")
    if refused or (choice == "auto" and weights.device.type != "cpu"):
        return None
    return torch.bfloat16


def sync_engine(engine, model) -> None:
    """Make ``engine`` generate with ``model``'s current weights: call after every update of the
    model it serves. A no-op for engines that generate from the model itself (transformers); vLLM
    reloads the weights and clears its prefix cache (~0.03 s on the tiny model)."""
    engine.sync_weights(model)


def sampling(cfg: Config, temperature: float | None = None, seed: int | None = None):
    """Sampling settings of the config's rollout section; ``temperature`` defaults to the
    evaluation temperature and ``seed`` to ``run.seed``."""
    from lopd.rollout import SamplingParams

    temperature = cfg.rollout.eval_temperature if temperature is None else temperature
    return SamplingParams.from_config(cfg.rollout, temperature,
                                      cfg.run.seed if seed is None else seed)


def load_model(cfg: Config, model_path: str | None = None, device=None):
    """(model in eval mode, tokenizer) of ``model_path`` (default ``model.name_or_path``) with the
    run's device and dtype."""
    from lopd import models, runtime

    device = device if device is not None else runtime.resolve_device(cfg.run.device)
    path = model_path or cfg.model.name_or_path
    dtype = runtime.resolve_dtype(cfg.run.dtype, device, cfg.run.precision,
                                  models.hidden_size_of(path))
    model, tokenizer = models.load_model(path, device=device, dtype=dtype,
                                         trust_remote_code=cfg.model.trust_remote_code)
    return model.eval(), tokenizer


def model_policy(cfg: Config, model, tokenizer, temperature: float | None = None,
                 seed: int | None = None, engine=None):
    """The model acting through the configured engine (``engine`` reuses one already built)."""
    from lopd.policies import ModelPolicy

    engine = engine if engine is not None else make_engine(cfg.rollout, model, tokenizer,
                                                           cfg.run.precision)
    return ModelPolicy(engine, tokenizer, sampling(cfg, temperature, seed))


def make_policy(cfg: Config, agent: str = "model", model_path: str | None = None, device=None,
                temperature: float | None = None):
    """(policy, tokenizer) for ``agent``: ``model`` (the model at ``model_path``), ``oracle``
    (the gold solution) or ``random`` (random valid tool calls). The tokenizer counts tokens."""
    from lopd import agent as agents
    from lopd import models

    path = model_path or cfg.model.name_or_path
    if agent in ("oracle", "random"):
        tokenizer = models.load_tokenizer(models.resolve_model_path(path),
                                          trust_remote_code=cfg.model.trust_remote_code)
        if agent == "oracle":
            return agents.OraclePolicy(), tokenizer
        return agents.RandomPolicy(seed=cfg.run.seed), tokenizer
    if agent != "model":
        raise ValueError(f"unknown agent {agent!r}; agents: model, oracle, random")
    model, tokenizer = load_model(cfg, path, device)
    return model_policy(cfg, model, tokenizer, temperature), tokenizer


def composer_policy(cfg: Config, model_path: str | None, composer_dir: str | Path,
                    bank_dir: str | Path, device=None):
    """(policy, tokenizer, bank) of the "Base + Composer" agent: the base acting with latents of
    the ``bank.n_ret`` retrieved experiences in its prompt. The caller closes the bank."""
    from lopd.composer import Composer, ComposerPolicy

    device = _device(cfg, device)
    model, tokenizer = load_model(cfg, model_path, device)
    composer = Composer.load(composer_dir, model, tokenizer).eval()
    engine = make_engine(cfg.rollout, composer.base, tokenizer, cfg.run.precision)
    bank = open_bank(cfg, bank_dir, device)
    return ComposerPolicy(engine, composer, bank, sampling(cfg), cfg.bank.n_ret), tokenizer, bank


def close_policy(policy) -> None:
    """Free the engine of a policy built for one evaluation (never one that shares a trainer's
    engine: the trainer closes its own)."""
    engine = getattr(policy, "engine", None)
    if engine is not None:
        engine.close()


def agent_policy(cfg: Config, agent: str = "model", model_path: str | None = None,
                 composer: str | Path | None = None, bank: str | Path | None = None, device=None):
    """(policy, tokenizer, bank or None): the Base + Composer agent when ``composer`` is given
    (the caller closes the bank), else :func:`make_policy`'s ``agent``."""
    if composer:
        return composer_policy(cfg, model_path, composer, bank, device)
    return (*make_policy(cfg, agent, model_path, device), None)


def _device(cfg: Config, device=None):
    from lopd import runtime

    return device if device is not None else runtime.resolve_device(cfg.run.device)


# ----------------------------------------------------------------------------------------------
# Episode files


def write_episodes(path: str | Path, rollouts) -> None:
    """Every rollout as one JSON line (what ``--episodes`` writes and ``bank add`` reads)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in rollouts:
            f.write(json.dumps(r.to_dict()) + "\n")


def read_episodes(path: str | Path) -> list:
    """Rollouts from a JSONL file written by :func:`write_episodes`; a bad line is named."""
    from lopd.agent import Rollout

    path = Path(path)
    rollouts = []
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rollouts.append(Rollout.from_dict(json.loads(line)))
            except (ValueError, TypeError, KeyError) as exc:
                raise ValueError(f"{path}:{number}: not a rollout record "
                                 f"({type(exc).__name__}: {exc})") from None
    return rollouts


# ----------------------------------------------------------------------------------------------
# Held-out evaluation


def held_out_tasks(cfg: Config, env) -> tuple[list, list]:
    """(training tasks, held-out tasks) as ``train.eval_split`` says: the eval split's first
    ``train.eval_tasks``, or a validation carve-out of the last ``train.eval_tasks`` training tasks
    (then left out of training)."""
    train_tasks = env.tasks("train")
    n = cfg.train.eval_tasks
    if cfg.train.eval_split == "validation":
        n = n or 200
        if n >= len(train_tasks):
            raise ConfigError(f"train.eval_tasks={n} validation tasks leave no training task of "
                              f"{len(train_tasks)}")
        return train_tasks[:-n], train_tasks[-n:]
    return train_tasks, env.tasks("eval")[: n or None]


def run_episodes(cfg: Config, env, tasks: Sequence, policy, tokenizer, progress: bool = True):
    """Every task's episode under ``policy`` with the config's episode limits."""
    from lopd.agent import rollout_episodes

    return rollout_episodes(env, list(tasks), policy, tokenizer, cfg.rollout, progress=progress)


def evaluate(cfg: Config, env, tasks: Sequence, policy, tokenizer, progress: bool = True):
    """(summary, rollouts) of ``policy`` on ``tasks``: mean reward, success rate, per domain.

    The one held-out evaluation of lopd: `lopd eval`, the trainer's periodic evaluation, the
    quickstart and ``compare``'s base row all come through here.
    """
    import torch

    from lopd.agent import summarize

    with torch.no_grad():
        rollouts = run_episodes(cfg, env, tasks, policy, tokenizer, progress)
    return summarize(rollouts), rollouts


def get_env(cfg: Config):
    """The configured environment. A code environment first checks that model-written code can
    be isolated here (:func:`lopd.envs.sandbox.check_isolation`), so a machine without bubblewrap
    is refused at start-up, not at the first answer."""
    from lopd.envs import get_env as build
    from lopd.envs import sandbox

    sandbox.allow_unsafe_fallback(cfg.env.unsafe_sandbox_without_bubblewrap)
    if cfg.env.name in CODE_ENVS:
        sandbox.check_isolation()
    return build(cfg.env.name, **cfg.env.kwargs())


CODE_ENVS = ("codeworld", "humaneval")
"""Environments whose answers are programs: their evaluations also report pass@k."""


def pass_at_k(rollouts, samples: int) -> dict:
    """pass@k (unbiased estimator, all tests passing) over tasks sampled ``samples`` times each."""
    from lopd.envs.codegen import pass_at_k as estimate

    passed: dict[str, list[bool]] = {}
    for r in rollouts:
        passed.setdefault(r.task_id, []).append(r.success)
    ks = [k for k in (1, 5, 10, 100) if k <= samples]
    return {"samples_per_task": samples, "pass_at_k": {
        f"pass@{k}": sum(estimate(len(v), sum(v), k) for v in passed.values()) / len(passed)
        for k in ks}}


def evaluate_agent(cfg: Config, agent: str = "model", model_path: str | None = None,
                   split: str = "eval", limit: int = 0, samples: int = 1,
                   composer: str | None = None, bank: str | None = None,
                   progress: bool = True, record: str | Path | None = None,
                   chunk: int = 40) -> tuple[dict, list]:
    """(summary, rollouts) of an agent on the first ``limit`` tasks (0 = all) of ``split``, each
    attempted ``samples`` times: ``agent`` (model, oracle, random), or the Base + Composer agent
    when ``composer`` and ``bank`` are given. Code environments add pass@k.

    ``record``: a resumable evaluation (:class:`EvalRecord`). The tasks run ``chunk`` at a time,
    each finished chunk's episodes are appended to that JSONL file as one line each (their figures
    and where they ran), tasks the file already holds are not run again, and the summary covers
    every wanted task in the file; the rollouts returned are this call's only."""
    from lopd import runtime

    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    device = runtime.setup(cfg.run)
    model_path = model_path or cfg.model.name_or_path
    env = get_env(cfg)
    tasks = env.tasks(split)[: limit or None]
    wanted = [t for t in tasks for _ in range(samples)]
    what = {"env": cfg.env.name, "split": split, "samples": samples,
            "agent": "base+composer" if composer else agent,
            "model": str(model_path) if agent == "model" else None,
            "composer": str(composer) if composer else None, "bank": str(bank) if bank else None}
    log = EvalRecord(record, what) if record is not None else None
    todo = log.missing(wanted) if log is not None else wanted
    policy, tokenizer, opened = (agent_policy(cfg, agent, model_path, composer, bank, device)
                                 if todo else (None, None, None))
    start = time.perf_counter()
    rollouts: list = []
    try:
        if log is None:
            rollouts = evaluate(cfg, env, todo, policy, tokenizer, progress)[1]
        else:
            where = episode_provenance(policy)
            for first in range(0, len(todo), chunk):
                began = time.perf_counter()
                part = evaluate(cfg, env, todo[first:first + chunk], policy, tokenizer,
                                progress)[1]
                log.append(part, time.perf_counter() - began, where)
                rollouts += part
    finally:
        if policy is not None:
            close_policy(policy)
        if opened is not None:
            opened.close()
    from lopd.agent import summarize

    episodes = log.episodes(wanted) if log is not None else rollouts
    summary = summarize(episodes)
    if cfg.env.name in CODE_ENVS:
        summary.update(pass_at_k(episodes, samples))
    summary.update({key: value for key, value in what.items() if key != "samples"})
    summary.update({"model": model_path if agent == "model" else None, "tasks": len(tasks),
                    "seconds": round(time.perf_counter() - start, 1)})
    if log is not None:
        summary.update(log.provenance(episodes))
    return summary, rollouts


def episode_provenance(policy) -> dict:
    """Where a policy's episodes run: the CPU (its model name and bfloat16 unit), the rollout
    engine and the dtype it serves the weights in (None for the oracle and random agents)."""
    import torch

    from lopd import runtime

    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    unit = runtime.cpu_bf16_units()[0] or "no bfloat16 unit"
    engine = getattr(policy, "engine", None)
    dtype = getattr(engine, "dtype", None)
    if dtype is None and getattr(engine, "model", None) is not None:
        dtype = next(engine.model.parameters()).dtype
    if torch.cuda.is_available():
        cpu = f"{cpu}; GPU {torch.cuda.get_device_name(0)}"
    return {"machine": f"{cpu} ({unit}), {torch.get_num_threads()} threads",
            "engine": type(engine).__name__ if engine is not None else None,
            "dtype": str(dtype).removeprefix("torch.") if dtype is not None else None}


@dataclass
class RecordedEpisode:
    """One episode's line of an :class:`EvalRecord`: what :func:`lopd.agent.summarize` and pass@k
    read, the episode's share of its chunk's wall-clock, and where it ran."""

    task_id: str
    domain: str
    reward: float
    success: bool
    num_turns: int
    generated_tokens: int
    finish_reason: str
    seconds: float
    machine: str
    engine: str | None
    dtype: str | None


class EvalRecord:
    """The JSONL file of a resumable evaluation: a line per finished episode
    (:class:`RecordedEpisode`; where it ran is :func:`episode_provenance`), plus what was evaluated (environment, split, agent, model,
    samples). A file of another evaluation is refused, naming what differs; a line that cannot
    be read is named. Lines are appended a chunk at a time, so an interrupted evaluation loses
    at most its current chunk."""

    def __init__(self, path: str | Path, what: dict):
        self.path, self.what = Path(path), what
        self.lines: list[RecordedEpisode] = []
        if not self.path.exists():
            return
        for number, line in enumerate(self.path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
                other = {key: data[key] for key in what}
                self.lines.append(RecordedEpisode(**{f.name: data[f.name]
                                                     for f in fields(RecordedEpisode)}))
            except (ValueError, TypeError, KeyError) as exc:
                raise ValueError(f"{self.path}:{number}: not a line of a resumable evaluation "
                                 f"({type(exc).__name__}: {exc})") from None
            if other != what:
                differs = ", ".join(f"{key} {other[key]!r} (here {what[key]!r})"
                                    for key in what if other[key] != what[key])
                raise ValueError(f"{self.path}:{number} records another evaluation: {differs}; "
                                 "give another file to start afresh")

    def _split(self, wanted: Sequence) -> tuple[list[RecordedEpisode], list]:
        left: dict[str, list[RecordedEpisode]] = {}
        for line in self.lines:
            left.setdefault(line.task_id, []).append(line)
        done, missing = [], []
        for task in wanted:
            if left.get(task.task_id):
                done.append(left[task.task_id].pop(0))
            else:
                missing.append(task)
        return done, missing

    def missing(self, wanted: Sequence) -> list:
        """The wanted tasks (a task once per sample) the file does not hold yet, in order."""
        return self._split(wanted)[1]

    def episodes(self, wanted: Sequence) -> list[RecordedEpisode]:
        """The file's episodes of the wanted tasks (lines of other tasks are kept, not counted)."""
        return self._split(wanted)[0]

    def append(self, rollouts: Sequence, seconds: float, where: dict) -> None:
        """Append a finished chunk: one line per rollout, the chunk's seconds shared evenly."""
        share = seconds / max(len(rollouts), 1)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lines = []
        for r in rollouts:
            episode = RecordedEpisode(r.task_id, r.domain, r.reward, bool(r.success), r.num_turns,
                                      r.generated_tokens, r.finish_reason, round(share, 2),
                                      **where)
            self.lines.append(episode)
            lines.append(json.dumps({**self.what, **asdict(episode)}) + "\n")
        with self.path.open("a") as f:
            f.writelines(lines)
            f.flush()

    def provenance(self, episodes: Sequence[RecordedEpisode]) -> dict:
        """The record's file, the summed wall-clock of ``episodes`` (:meth:`episodes`) and every
        machine, engine and dtype they ran on, with episode counts."""
        where = Counter(f"{e.machine}; {e.engine}; {e.dtype}" for e in episodes)
        return {"record": str(self.path),
                "record_seconds": round(sum(e.seconds for e in episodes), 1), "ran_on": dict(where)}


# ----------------------------------------------------------------------------------------------
# The experience bank


def open_bank(cfg: Config, folder: str | Path, device=None):
    """The bank in ``folder`` with the config's embedding batch size."""
    from lopd.experience import ExperienceBank

    return ExperienceBank.open(folder, batch_size=cfg.bank.embed_batch_size,
                               device=_device(cfg, device),
                               trust_remote_code=cfg.model.trust_remote_code)
