"""The entry points' work, composed from :mod:`lopd.stages`: preparing a model, building and
extending an experience bank, the composer's cold start, and a training run (which hands the
loop to :mod:`lopd.trainer`).

The CLI, the quickstart, ``compare`` / ``sweep`` and the benchmarks call these functions. Each
takes a :class:`Config` and returns plain figures (dicts) that the caller prints or writes. As in
:mod:`lopd.stages`, heavy modules are imported inside the functions that use them, so that the
CLI starts without them.
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Sequence
from pathlib import Path

from lopd import chat, runtime, stages
from lopd.config import Config, ConfigError


def build_and_save(cfg: Config, corpus: list[str], out: str | Path) -> dict:
    """Train a tokenizer on ``corpus``, build the model of ``cfg.model.architecture`` (seeded by
    ``run.seed``) and save both in ``out``; the figures of the new model."""
    from lopd import models

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


def _prepared(path: str | Path) -> dict:
    """What `lopd model prepare` recorded in a model folder ({} when it did not prepare it)."""
    from lopd import models

    record = Path(models.resolve_model_path(path)) / PREPARED_FILE
    return json.loads(record.read_text()) if record.is_file() else {}


def model_info(path: str | Path, trust_remote_code: bool = False) -> dict:
    """Facts about a saved model folder, as printed by ``lopd model info``: shape, vocabulary,
    whether ``<|latent|>`` is there, and the verdict of :func:`lopd.agent.check_chat_template`."""
    from lopd import agent, models

    model, tokenizer = models.load_model(path, trust_remote_code=trust_remote_code)
    cfg = model.config
    checks = agent.check_chat_template(tokenizer)
    failed = [c["check"] for c in checks if c["required"] and not c["ok"]]
    try:
        turn_end = chat.turn_end_token(tokenizer)
    except ValueError:
        turn_end = None
    eos = model.generation_config.eos_token_id
    stops = {tokenizer.eos_token_id, *([eos] if isinstance(eos, int) else eos or [])}
    return {
        "path": models.resolve_model_path(path),
        "architecture": (cfg.architectures or [type(model).__name__])[0],
        "parameters": models.count_parameters(model),
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "vocab_size": len(tokenizer),
        "max_position_embeddings": cfg.max_position_embeddings,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "precision_auto_here": "{} ({})".format(*runtime.choose_precision(
            "auto", runtime.resolve_device("auto"), cfg.hidden_size)),
        "special_tokens": list(tokenizer.all_special_tokens),
        "latent_token": chat.LATENT_TOKEN if chat.LATENT_TOKEN in tokenizer.get_vocab() else None,
        "chat_template": tokenizer.chat_template is not None,
        "chat_template_source": _prepared(path).get("chat_template", "the model's own (not "
                                                    "prepared by lopd)"),
        "turn_end_token": turn_end,
        "stops_at_turn_end": (turn_end is not None
                              and tokenizer.convert_tokens_to_ids(turn_end) in stops),
        "chat_template_checks": "failed: " + "; ".join(failed) if failed else "pass",
        "checks": checks,
    }


PREPARED_FILE = "lopd-prepared.json"
"""What `lopd model prepare` wrote into a folder: its source and which chat template it carries."""


DTYPES = ("auto", "float32", "bfloat16")
"""``lopd model prepare --dtype``: the checkpoint's own (float32 for a GGUF file), or one of these."""


def gguf_file(source: str | Path) -> tuple[Path, str] | None:
    """(folder, file name) when ``source`` is a GGUF file or a folder holding one and no Hugging
    Face model; None for anything else. A folder with several GGUF files is refused, naming them."""
    path = Path(source)
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(p.name for p in path.glob("*.gguf"))
    if len(found) > 1:
        raise ValueError(f"{source} holds {len(found)} GGUF files ({', '.join(found)}); name the "
                         "one to prepare")
    return (path, found[0]) if found else None


def _load_gguf(folder: Path, name: str, dtype):
    """(model, tokenizer) of a GGUF file, dequantised to ``dtype``: transformers reads it (the
    ``gguf`` package, ``pip install lopd[gguf]``) into a model flagged as quantised, which it will
    not save, so the weights are moved into a plain model built from the same config."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:  # said here, before transformers says less
        raise ValueError("reading a GGUF file needs the gguf package: pip install 'lopd[gguf]' "
                         "(`make` installs it)")
    from lopd import models

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    with models.quiet_progress():
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, gguf_file=name),
                                             dtype=dtype)
    model.load_state_dict(loaded.state_dict())
    model.tie_weights()
    model.generation_config = loaded.generation_config
    return model.eval(), tokenizer


def prepare_model(cfg: Config, source: str | Path, out: str | Path,
                  chat_template: str | None = None, dtype: str = "auto") -> dict:
    """Make any Hugging Face causal LM (a local folder or an embedded name) ready for lopd and
    save it, model and tokenizer, in ``out``: ``<|latent|>`` added when absent (a special token;
    embeddings resized and the new row the mean of the existing ones,
    :func:`lopd.models.add_latent_token`), generation stopping at the template's end-of-turn
    token, and the chat template checked (:func:`lopd.agent.check_chat_template`: system message
    with tools, tool-call turn, tool result, an agent episode, the reference block's place). A
    failed required check stops before anything is written. ``model.trust_remote_code`` is
    honoured; the checkpoint keeps its dtype. ``chat_template``: a template lopd ships
    (:data:`lopd.chat.TOOL_TEMPLATES`, e.g. ``chatml-tools`` for ChatML tokenizers without tools)
    or a Jinja file, installed in place of the tokenizer's own, only when given; the folder records
    which template it carries (:data:`PREPARED_FILE`). ``source`` may be a GGUF file (or a folder
    holding one): its weights are dequantised to ``dtype`` (float32 under "auto") and written as a
    plain Hugging Face folder with its tokenizer. Returns what was done."""
    import torch
    from transformers import AutoModelForCausalLM

    from lopd import agent, models, runtime
    from lopd.latent import user_header

    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    runtime.setup(cfg.run)
    gguf = gguf_file(source)
    path = str(Path(*gguf)) if gguf else models.resolve_model_path(source)
    out = Path(out)
    folder = gguf[0] if gguf else Path(path)
    if folder.exists() and out.resolve() == folder.resolve():
        raise ValueError(f"--out {out} is the source folder; write the prepared model elsewhere")
    trust = cfg.model.trust_remote_code
    template = "the model's own"
    if chat_template is not None:
        template_text, template = chat.tool_template(chat_template)
    # dtype "auto": the checkpoint's own (a bf16 model is not saved back as fp32, twice the size).
    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    if gguf:
        model, tokenizer = _load_gguf(*gguf, torch.float32 if dtype == "auto" else torch_dtype)
    else:
        tokenizer = models.load_tokenizer(path, trust_remote_code=trust)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype,
                                                     trust_remote_code=trust)
    if chat_template is not None:
        tokenizer.chat_template = template_text
    vocab, rows = len(tokenizer), model.get_input_embeddings().num_embeddings
    added = models.add_latent_token(model, tokenizer)
    checks = agent.check_chat_template(tokenizer)
    failed = [c for c in checks if c["required"] and not c["ok"]]
    if failed:
        remedy = ("give one that does with --chat-template NAME_OR_FILE (lopd ships "
                  f"{', '.join(sorted(chat.TOOL_TEMPLATES))} for ChatML tokenizers) or fix the "
                  "tokenizer's own" if chat_template is None else "fix that template")
        raise ValueError(f"{source}: the chat template ({template}) does not do what lopd needs: "
                         + "; ".join(f"{c['check']}: {c['detail']}" for c in failed)
                         + f" ({remedy}, and prepare again; nothing was written)")
    turn_end = models.add_turn_end_stop(model, tokenizer)
    models.save_model(model, tokenizer, out)
    (out / PREPARED_FILE).write_text(json.dumps({"source": str(path), "chat_template": template,
                                                 "gguf": bool(gguf)}, indent=1) + "\n")
    head = model.get_output_embeddings()
    eos = model.generation_config.eos_token_id
    return {
        "source": path,
        "out": str(out),
        "latent_token": "added" if added else "already present",
        "latent_id": tokenizer.convert_tokens_to_ids(chat.LATENT_TOKEN),
        "latent_row": f"mean of {vocab} token rows" if added else "unchanged",
        "vocab_size": f"{vocab} -> {len(tokenizer)}",
        "embedding_rows": f"{rows} -> {model.get_input_embeddings().num_embeddings}",
        "tied_embeddings": head is not None and head.weight is model.get_input_embeddings().weight,
        "chat_template": template,
        "turn_end_token": f"{chat.turn_end_token(tokenizer)} (id {turn_end})",
        "stop_token_ids": sorted({*([eos] if isinstance(eos, int) else eos or []),
                                  *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None
                                    else [])}),
        "user_header": repr(tokenizer.decode(user_header(tokenizer))),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "trust_remote_code": trust,
        "checks": checks,
    }


# ----------------------------------------------------------------------------------------------
# The experience bank


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
    from lopd.embedding import spec_from_config
    from lopd.experience import ExperienceBank

    if agent not in ("model", "oracle"):
        raise ValueError(f"agent {agent!r}: a bank is filled by the model or the oracle")
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    seeds = [cfg.run.seed] if seeds is None else list(seeds)
    device = runtime.setup(cfg.run)
    model_path = model_path or cfg.model.name_or_path
    env = stages.get_env(cfg)
    # Validation tasks carved out of the training split (train.eval_split) never enter the bank.
    tasks = stages.held_out_tasks(cfg, env)[0][: limit or None]
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
            model, tokenizer = stages.load_model(cfg, model_path, device)
            engine = stages.make_engine(cfg.rollout, model, tokenizer, cfg.run.precision)
            policies = [stages.model_policy(cfg, model, tokenizer, cfg.rollout.temperature, seed,
                                            engine) for seed in seeds]
        else:
            policy, tokenizer = stages.make_policy(cfg, "oracle", model_path, device)
            policies = [policy] * len(seeds)
        source = "oracle" if agent == "oracle" else f"model:{model_path}"
        start = time.perf_counter()
        rollouts = [r for policy in policies
                    for r in stages.run_episodes(cfg, env, tasks, policy, tokenizer, progress)]
        rollout_seconds = time.perf_counter() - start
        if episodes:
            stages.write_episodes(episodes, rollouts)
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
    rollouts = stages.read_episodes(path)
    env = stages.get_env(cfg)
    # Eval tasks are looked up too, so that the bank itself refuses them by name and split.
    tasks = {t.task_id: t for split in ("eval", "train") for t in env.tasks(split)}
    with stages.open_bank(cfg, bank_dir, device) as bank:
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
    env = stages.get_env(cfg)
    train_tasks = env.tasks("train")
    n_val = cfg.cold_start.validation_tasks
    if n_val >= len(train_tasks):
        raise ConfigError(f"cold_start.validation_tasks={n_val} leaves no training task of "
                          f"{len(train_tasks)}")
    validation = train_tasks[len(train_tasks) - n_val:] if n_val else []
    model, tokenizer = stages.load_model(cfg, model_path, device)
    with tempfile.TemporaryDirectory(prefix="lopd-cold-start-") as tmp, \
            stages.open_bank(cfg, bank_dir, device) as source:
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
        policy = stages.model_policy(cfg, model, tokenizer, cfg.rollout.temperature)
        attempts = [t for t in validation for _ in range(cfg.cold_start.validation_samples)]
        held_out = [r for r in stages.run_episodes(cfg, env, attempts, policy, tokenizer, progress)
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
                            precision=runtime.resolve_precision(cfg.run.precision, model.device,
                                                                runtime.hidden_size(model)),
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
