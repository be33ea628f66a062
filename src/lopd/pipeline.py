"""The stages every entry point shares: engines, policies, held-out evaluation, bank, cold start, train.

The CLI, the quickstart, ``compare`` / ``sweep`` and the benchmarks call these functions; none of
them builds an engine, a policy or an evaluation of its own. Each stage takes a :class:`Config`
and returns plain figures (dicts) that the caller prints or writes. The cold-started composer and
bank shipped in the package are named here too (:data:`EMBEDDED_COMPOSER`, :data:`EMBEDDED_BANK`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

from lopd.config import Config, ConfigError

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


def check_engine(rollout_cfg) -> None:
    """Refuse, at start-up, a ``rollout.engine`` no engine implements (or whose library is
    missing, saying how to install it), and ``rollout.vllm_sleep`` where vLLM has no sleep mode."""
    if rollout_cfg.engine in ENGINES:
        if rollout_cfg.engine == "vllm" and rollout_cfg.vllm_sleep:
            from lopd.rollout.vllm_engine import check_sleep_mode

            check_sleep_mode()
        return
    if rollout_cfg.engine == "vllm":
        from lopd.rollout.vllm_engine import INSTALL_HINT

        raise ConfigError(f"rollout.engine='vllm' needs vLLM, which is not installed here: "
                          f"{INSTALL_HINT}; available: {', '.join(ENGINES)}")
    raise ConfigError(f"rollout.engine={rollout_cfg.engine!r} is not available: lopd has no "
                      f"{rollout_cfg.engine} engine yet; available: {', '.join(ENGINES)}")


def make_engine(rollout_cfg, model, tokenizer, precision: str = "auto", train: bool = False):
    """The rollout engine named by ``rollout.engine`` over ``model`` (kept resident). An engine
    that holds its own copy of the weights (vLLM) must be told of every update of ``model``:
    :func:`sync_engine` after each optimiser step. ``precision``: the run's (``run.precision``),
    which decides vLLM's served dtype; ``train``: ``model`` is the student the caller updates
    (vLLM keeps room for the update, or sleeps through it with ``rollout.vllm_sleep``)."""
    check_engine(rollout_cfg)
    if rollout_cfg.engine == "vllm":
        from lopd import runtime
        from lopd.rollout.vllm_engine import UPDATE_WEIGHT_COPIES, VLLMEngine, serving_dtype

        weights = list(model.parameters())
        resolved = runtime.resolve_precision(precision, weights[0].device)
        sleep = train and rollout_cfg.vllm_sleep
        trainable = sum(p.numel() * p.element_size() for p in weights if p.requires_grad)
        return VLLMEngine(
            model, tokenizer,
            dtype=serving_dtype(rollout_cfg.vllm_dtype, resolved, weights[0].dtype),
            gpu_memory_utilization=rollout_cfg.vllm_gpu_memory_utilization,
            update_bytes=UPDATE_WEIGHT_COPIES * trainable if train and not sleep else 0,
            sleep=sleep)
    from lopd.rollout import TransformersEngine

    return TransformersEngine(model, tokenizer)


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
    model, tokenizer = models.load_model(model_path or cfg.model.name_or_path, device=device,
                                         dtype=runtime.resolve_dtype(cfg.run.dtype, device, cfg.run.precision),
                                         trust_remote_code=cfg.model.trust_remote_code)
    return model.eval(), tokenizer


def model_policy(cfg: Config, model, tokenizer, temperature: float | None = None,
                 seed: int | None = None, engine=None):
    """The model acting through the configured engine (``engine`` reuses one already built)."""
    from lopd.agent import ModelPolicy

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
# Models


def build_and_save(cfg: Config, corpus: list[str], out: str | Path) -> dict:
    """Train a tokenizer on ``corpus``, build the model of ``cfg.model.architecture`` (seeded by
    ``run.seed``) and save both in ``out``; the figures of the new model."""
    from lopd import models, runtime

    runtime.setup(cfg.run)
    start = time.perf_counter()
    tokenizer = models.train_tokenizer(corpus, vocab_size=cfg.model.vocab_size)
    model = models.build_model(tokenizer, preset=cfg.model.architecture, seed=cfg.run.seed,
                               max_position_embeddings=cfg.model.max_position_embeddings)
    models.save_model(model, tokenizer, Path(out))
    return {
        "path": str(out),
        "architecture": cfg.model.architecture,
        "parameters": models.count_parameters(model),
        "vocab_size": len(tokenizer),
        "corpus_texts": len(corpus),
        "seed": cfg.run.seed,
        "seconds": round(time.perf_counter() - start, 2),
    }


def prepare_model(cfg: Config, source: str | Path, out: str | Path) -> dict:
    """Make any Hugging Face causal LM (a local folder or an embedded name) ready for lopd and
    save it, model and tokenizer, in ``out``: ``<|latent|>`` added when absent (a special token;
    embeddings resized and the new row the mean of the existing ones,
    :func:`lopd.models.add_latent_token`), generation stopping at the template's end-of-turn
    token, and the chat template checked (:func:`lopd.agent.check_chat_template`: system message
    with tools, tool-call turn, tool result, an agent episode, the reference block's place). A
    failed required check stops before anything is written. ``model.trust_remote_code`` is honoured; the checkpoint keeps its dtype. Returns
    what was done."""
    from transformers import AutoModelForCausalLM

    from lopd import agent, models, runtime
    from lopd.latent import user_header

    runtime.setup(cfg.run)
    path = models.resolve_model_path(source)
    out = Path(out)
    if Path(path).exists() and out.resolve() == Path(path).resolve():
        raise ValueError(f"--out {out} is the source folder; write the prepared model elsewhere")
    trust = cfg.model.trust_remote_code
    tokenizer = models.load_tokenizer(path, trust_remote_code=trust)
    # dtype "auto": the checkpoint's own (a bf16 model is not saved back as fp32, twice the size).
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto", trust_remote_code=trust)
    vocab, rows = len(tokenizer), model.get_input_embeddings().num_embeddings
    added = models.add_latent_token(model, tokenizer)
    checks = agent.check_chat_template(tokenizer)
    failed = [c for c in checks if c["required"] and not c["ok"]]
    if failed:
        raise ValueError(f"{source}: the chat template does not do what lopd needs: " + "; ".join(
            f"{c['check']}: {c['detail']}" for c in failed) + " (fix the tokenizer's chat template "
            "and prepare again; nothing was written)")
    turn_end = models.add_turn_end_stop(model, tokenizer)
    models.save_model(model, tokenizer, out)
    head = model.get_output_embeddings()
    eos = model.generation_config.eos_token_id
    return {
        "source": path,
        "out": str(out),
        "latent_token": "added" if added else "already present",
        "latent_id": tokenizer.convert_tokens_to_ids(models.LATENT_TOKEN),
        "latent_row": f"mean of {vocab} token rows" if added else "unchanged",
        "vocab_size": f"{vocab} -> {len(tokenizer)}",
        "embedding_rows": f"{rows} -> {model.get_input_embeddings().num_embeddings}",
        "tied_embeddings": head is not None and head.weight is model.get_input_embeddings().weight,
        "turn_end_token": f"{models.turn_end_token(tokenizer)} (id {turn_end})",
        "stop_token_ids": sorted({*([eos] if isinstance(eos, int) else eos or []),
                                  *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None
                                    else [])}),
        "user_header": repr(tokenizer.decode(user_header(tokenizer))),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "trust_remote_code": trust,
        "checks": checks,
    }


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
                   progress: bool = True) -> tuple[dict, list]:
    """(summary, rollouts) of an agent on the first ``limit`` tasks (0 = all) of ``split``, each
    attempted ``samples`` times: ``agent`` (model, oracle, random), or the Base + Composer agent
    when ``composer`` and ``bank`` are given. Code environments add pass@k."""
    from lopd import runtime

    device = runtime.setup(cfg.run)
    model_path = model_path or cfg.model.name_or_path
    env = get_env(cfg)
    tasks = env.tasks(split)[: limit or None]
    policy, tokenizer, opened = agent_policy(cfg, agent, model_path, composer, bank, device)
    start = time.perf_counter()
    try:
        summary, rollouts = evaluate(cfg, env, [t for t in tasks for _ in range(samples)], policy,
                                     tokenizer, progress)
    finally:
        if opened is not None:
            opened.close()
    if cfg.env.name in CODE_ENVS:
        summary.update(pass_at_k(rollouts, samples))
    summary.update({"agent": "base+composer" if composer else agent, "composer": composer,
                    "bank": bank, "model": model_path if agent == "model" else None,
                    "env": cfg.env.name, "split": split, "tasks": len(tasks),
                    "seconds": round(time.perf_counter() - start, 1)})
    return summary, rollouts


# ----------------------------------------------------------------------------------------------
# The experience bank


def open_bank(cfg: Config, folder: str | Path, device=None):
    """The bank in ``folder`` with the config's embedding batch size."""
    from lopd.experience import ExperienceBank

    return ExperienceBank.open(folder, batch_size=cfg.bank.embed_batch_size,
                               device=_device(cfg, device),
                               trust_remote_code=cfg.model.trust_remote_code)


def build_bank(cfg: Config, out: str | Path, model_path: str | None = None, agent: str = "model",
               limit: int = 0, episodes: str | Path | None = None,
               seeds: Sequence[int] | None = None, progress: bool = True) -> dict:
    """Roll ``agent`` (``model`` at ``rollout.temperature``, or ``oracle``) out on the training
    tasks (the first ``limit``; 0 = all), once per sampling seed in ``seeds`` (default
    ``run.seed``), and store the successes in the bank at ``out`` (created with the config's bank
    section, or extended). ``episodes`` also writes every rollout as JSONL. Returns the figures,
    with per-domain counts."""
    import sys

    from lopd import runtime
    from lopd.experience import ExperienceBank, spec_from_config

    if agent not in ("model", "oracle"):
        raise ValueError(f"agent {agent!r}: a bank is filled by the model or the oracle")
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    seeds = [cfg.run.seed] if seeds is None else list(seeds)
    device = runtime.setup(cfg.run)
    model_path = model_path or cfg.model.name_or_path
    env = get_env(cfg)
    # Validation tasks carved out of the training split (train.eval_split) never enter the bank.
    tasks = held_out_tasks(cfg, env)[0][: limit or None]
    # The bank is opened (or created) first, so a wrong folder fails before minutes of rollouts.
    spec = spec_from_config(cfg.bank, model_path)
    bank = ExperienceBank.open_or_create(
        out, spec, cfg.bank.reward_threshold, cfg.bank.max_observation_chars,
        batch_size=cfg.bank.embed_batch_size, device=device,
        trust_remote_code=cfg.model.trust_remote_code)
    if (bank.embedder.spec, bank.reward_threshold, bank.max_observation_chars) != (
            spec, cfg.bank.reward_threshold, cfg.bank.max_observation_chars):
        # Said now, not with the figures: the user may want to stop before the rollouts.
        print(f"note: {out} keeps the embedder ({bank.embedder.spec.describe()}), reward "
              f"threshold ({bank.reward_threshold:g}) and observation cap "
              f"({bank.max_observation_chars}) it was created with", file=sys.stderr)
    with bank:
        before = len(bank)
        if agent == "model":
            model, tokenizer = load_model(cfg, model_path, device)
            engine = make_engine(cfg.rollout, model, tokenizer, cfg.run.precision)
            policies = [model_policy(cfg, model, tokenizer, cfg.rollout.temperature, seed, engine)
                        for seed in seeds]
        else:
            policy, tokenizer = make_policy(cfg, "oracle", model_path, device)
            policies = [policy] * len(seeds)
        source = "oracle" if agent == "oracle" else f"model:{model_path}"
        start = time.perf_counter()
        rollouts = [r for policy in policies
                    for r in run_episodes(cfg, env, tasks, policy, tokenizer, progress)]
        rollout_seconds = time.perf_counter() - start
        if episodes:
            write_episodes(episodes, rollouts)
        start = time.perf_counter()
        result = bank.add_rollouts(rollouts, {t.task_id: t for t in tasks}, source)
        if agent == "model":
            # Every sampled rollout, failures too, is what a method using this bank consumed; the
            # oracle's are not samples of the model.
            bank.charge(len(rollouts))
        add_seconds = time.perf_counter() - start
        per_domain: dict[str, dict] = {}
        for rollout in rollouts:
            d = per_domain.setdefault(rollout.domain, {"rollouts": 0, "successes": 0, "added": 0})
            d["rollouts"] += 1
            d["successes"] += rollout.success
        for entry in result.added:
            per_domain[entry.domain]["added"] += 1
        return {"bank": str(out), "source": source, "split": "train", "tasks": len(tasks),
                "seeds": seeds, "rollouts": len(rollouts),
                "successes": sum(r.success for r in rollouts), **result.counts(),
                "entries_before": before, "entries": len(bank),
                "rollout_seconds": round(rollout_seconds, 1), "embed_seconds": round(add_seconds, 1),
                "per_domain": dict(sorted(per_domain.items())),
                "embedder": bank.embedder.spec.describe(), "reward_threshold": bank.reward_threshold,
                "rollouts_sampled": bank.rollouts_sampled}


def add_to_bank(cfg: Config, bank_dir: str | Path, rollouts_path: str | Path,
                source: str | None = None) -> dict:
    """Store the rollouts of a JSONL file that pass the bank's rules; an eval-split rollout stops
    the whole add (nothing is written). Every rollout of the file (failures too) is charged to the
    bank's ``rollouts_sampled``: the file says nothing of who sampled it, so oracle rollouts added
    this way are charged as well."""
    from lopd import runtime

    device = runtime.setup(cfg.run)
    path = Path(rollouts_path)
    if not path.is_file():
        raise FileNotFoundError(f"no rollouts file {path}")
    rollouts = read_episodes(path)
    env = get_env(cfg)
    # Eval tasks are looked up too, so that the bank itself refuses them by name and split.
    tasks = {t.task_id: t for split in ("eval", "train") for t in env.tasks(split)}
    with open_bank(cfg, bank_dir, device) as bank:
        result = bank.add_rollouts(rollouts, tasks, source=source or str(path))
        bank.charge(len(rollouts))
        return {"bank": str(bank_dir), "rollouts": len(rollouts), **result.counts(),
                "entries": len(bank), "rollouts_sampled": bank.rollouts_sampled}


# ----------------------------------------------------------------------------------------------
# Cold start


def cold_start(cfg: Config, bank_dir: str | Path, out: str | Path, model_path: str | None = None,
               progress: bool = True) -> dict:
    """Fit a new composer on the bank's stored successes (``cold_start`` section) and save it in
    ``out`` with its history.

    When ``cold_start.validation_tasks`` = n > 0, the last n training tasks are a validation
    carve-out: their entries are withheld from the bank for the whole cold start (never trained on,
    never retrieved), the base samples them (``validation_samples`` attempts each, at
    ``rollout.temperature``), and on its successes the frozen teacher's NLL per action token is
    measured under each kind of reference (``nll_per_action_token``; also on coded and plain
    requests apart, ``by_request_kind``) and, after every epoch, with retrieved and with random
    latents (``per_epoch``; each epoch's composer is saved in ``out/epochs/epoch-E``). The eval
    split is never touched. The sampled rollouts are counted (``rollouts_sampled``): a method
    using this composer has consumed them."""
    import tempfile

    from lopd import runtime
    from lopd.experience import ExperienceBank

    device = runtime.setup(cfg.run)
    model_path = model_path or cfg.model.name_or_path
    out = Path(out)
    n_ret = cfg.bank.n_ret
    env = get_env(cfg)
    train_tasks = env.tasks("train")
    n_val = cfg.cold_start.validation_tasks
    if n_val >= len(train_tasks):
        raise ConfigError(f"cold_start.validation_tasks={n_val} leaves no training task of "
                          f"{len(train_tasks)}")
    validation = train_tasks[len(train_tasks) - n_val:] if n_val else []
    model, tokenizer = load_model(cfg, model_path, device)
    with tempfile.TemporaryDirectory(prefix="lopd-cold-start-") as tmp, \
            open_bank(cfg, bank_dir, device) as source:
        # The user's bank is never changed: the carve-out is withheld from a copy, opened with
        # the embedder already loaded.
        bank = ExperienceBank.open(source.snapshot(Path(tmp) / "bank"),
                                   embedder=source.embedder) if validation else source
        try:
            bank.withhold(t.task_id for t in validation)
            return _fit_composer(cfg, bank, bank_dir, out, model, tokenizer, env, validation,
                                 n_ret, progress)
        finally:
            if bank is not source:
                bank.close()


def _fit_composer(cfg: Config, bank, bank_dir, out: Path, model, tokenizer, env, validation: list,
                  n_ret: int, progress: bool) -> dict:
    from lopd import runtime
    from lopd.algorithms import cold_start as cs
    from lopd.composer import Composer
    from lopd.latent import ReferenceFormat

    successes = bank.stored_rollouts()
    if len(successes) <= n_ret:
        raise ValueError(f"{bank_dir} holds {len(successes)} stored successes (outside the "
                         f"validation carve-out); the cold start needs more than "
                         f"bank.n_ret={n_ret} successes: fill it with `lopd bank build` (more "
                         "training tasks, or a stronger base)")
    held_out, attempts = [], []
    if validation:
        # Sampled like the bank's own rollouts (rollout.temperature), not greedy: greedy
        # successes are the base's most confident paths and leave a reference nothing to add.
        policy = model_policy(cfg, model, tokenizer, cfg.rollout.temperature)
        attempts = [t for t in validation for _ in range(cfg.cold_start.validation_samples)]
        held_out = [r for r in run_episodes(cfg, env, attempts, policy, tokenizer, progress)
                    if r.success]
    coded = {t.task_id for t in validation if "code" in t.meta}
    seed = cfg.run.seed

    composer = Composer(model, tokenizer, cfg.composer)
    before = cs.latent_information(composer, bank, held_out, n_ret, seed=seed) if held_out else {}
    per_epoch = []

    def measure(epoch: int) -> None:
        composer.save(out / "epochs" / f"epoch-{epoch}")
        fmt = ReferenceFormat.for_tokenizer(composer.tokenizer)
        row = {"epoch": epoch}
        for name, traces in (("retrieved latents", cs.retrieve_traces(bank, held_out, n_ret)),
                             ("random experiences' latents",
                              cs.random_traces(bank, held_out, n_ret, seed))):
            row[name] = cs.mean_teacher_nll(composer, held_out, fmt, traces, "latent")
        per_epoch.append(row)

    start = time.perf_counter()
    history = cs.cold_start(composer, bank, successes, cfg.cold_start, n_ret, seed=seed,
                            progress=progress,
                            micro_batch_size=cfg.train.per_device_train_batch_size,
                            precision=runtime.resolve_precision(cfg.run.precision, model.device),
                            on_epoch=measure if held_out else None)
    seconds = time.perf_counter() - start
    composer.save(out)
    table, groups = {}, {}
    if held_out:
        after = cs.latent_information(composer, bank, held_out, n_ret, seed=seed)
        table = {"no reference": after["no reference"],
                 "retrieved latents, cold-started composer": after["retrieved latents"],
                 "random experiences' latents, cold-started": after["random experiences' latents"],
                 "retrieved traces as text": after["retrieved traces as text"],
                 "empty reference block (framing only)": after["empty reference block"],
                 "retrieved latents, untrained composer": before["retrieved latents"]}
        for row in per_epoch:
            row["no reference"] = after["no reference"]
        if coded:
            # Coded requests (toolworld) are where experience says what the instruction does
            # not: the same table on each part.
            for name, part in (("coded", [r for r in held_out if r.task_id in coded]),
                               ("plain", [r for r in held_out if r.task_id not in coded])):
                if part:
                    groups[name] = {"successes": len(part), **cs.latent_information(
                        composer, bank, part, n_ret, seed=seed)}
    best = min(per_epoch, key=lambda r: r["retrieved latents"])["epoch"] if per_epoch else None
    figures = {"composer": str(out), "bank": str(bank_dir), "successes": len(successes),
               "steps": len(history), "seconds": round(seconds, 1),
               "first_nll": history[0]["nll"], "final_nll": history[-1]["nll"], "n_ret": n_ret,
               "validation_tasks": len(validation), "rollouts_sampled": len(attempts),
               "held_out_successes": len(held_out), "nll_per_action_token": table,
               "by_request_kind": groups, "per_epoch": per_epoch,
               "best_epoch_by_retrieved_nll": best}
    cs.save_history(history, out, {"config": cfg.to_dict(), "figures": figures})
    for row in per_epoch:
        # An epoch's snapshot is a product of this cold start: it carries the record, so a run
        # using it is charged the same sampled rollouts.
        (out / "epochs" / f"epoch-{row['epoch']}" / "cold_start.json").write_text(json.dumps(
            {"config": cfg.to_dict(), "figures": figures, "snapshot_epoch": row["epoch"]},
            indent=1))
    return figures


# ----------------------------------------------------------------------------------------------
# Training


def train(cfg: Config, run_dir, algorithm: str | None = None, resume: bool = False,
          progress: bool = True) -> dict:
    """Run (or resume) ``algorithm`` (default ``train.algorithm``); the last step's metrics."""
    from lopd import trainer

    return trainer.train(cfg, run_dir, algorithm or cfg.train.algorithm, resume=resume,
                         progress=progress)
