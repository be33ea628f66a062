"""The shared training loop: sample tasks → student rollouts → ``algorithm.step`` → log / eval / save.

Every on-policy method in lopd (LOPD and the baselines) runs through :func:`train`. What differs
between methods — how the teacher sees a rollout, which loss is applied, what else is learned — lives
in an :class:`Algorithm`; everything else lives here once: seeding, task sampling, batched
rollouts, metrics (JSONL, TensorBoard, progress bar, PNG), held-out evaluation, the count of
generations used, checkpoints and resume.

Resume is exact by construction: the tasks of step s and the sampler's seed are pure functions of
(run.seed, s), so a run resumed from the checkpoint of step c repeats steps c+1, c+2, ... exactly as
an uninterrupted run would (up to floating-point non-determinism of the hardware).

One piece, though longer than the package's other modules: it is the loop, read top to bottom by
whoever wants to know what a step does, and its parts (the step's tasks, rollouts, the update, the
evaluation, the checkpoint) share the run's state; the stages it calls (engines, policies,
held-out evaluation) are in :mod:`lopd.stages`, the methods in :mod:`lopd.algorithms`.
"""

from __future__ import annotations

import json
import os
import random
import re
import resource
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import yaml
from tqdm.auto import tqdm

from lopd import chat, distributed, models, runtime, stages
from lopd.agent import Rollout
from lopd.algorithms import get_algorithm
from lopd.algorithms.base import Panel, StepBatch, Updater
from lopd.config import Config, ConfigError, load_config
from lopd.envs.environment import Task
from lopd.rollout.engine import check_sampling

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"
PLOT_FILE = "training.png"
CHECKPOINTS = "checkpoints"
STATE_FILE = "state.pt"
"""A checkpoint's step, counters, optimiser and algorithm state and RNG states."""
OPTIMIZER_DIR = "student_optimizer"
"""The student's optimiser state of a multi-process run (torch.distributed.checkpoint)."""
RNG_DIR = "rng"
"""Per-rank RNG states of a multi-process run."""
_CHECKPOINT_RE = re.compile(r"^step-(\d{6})$")


class RunError(ValueError):
    """A run folder cannot be started or resumed as asked; the message says why."""


# ----------------------------------------------------------------------------------------------
# What the loop hands an algorithm


@dataclass
class TrainContext:
    """What the loop builds once and hands to the algorithm."""

    cfg: Config
    student: torch.nn.Module
    tokenizer: object
    device: torch.device
    dtype: torch.dtype
    """Storage dtype of frozen weights (run.dtype); the student is float32."""
    env: object
    train_tasks: dict[str, Task]
    run_dir: Path
    student_updater: Updater
    precision: str = "fp32"
    """Concrete training precision: 'fp32' or 'bf16-mixed' (run.precision resolved)."""
    world: distributed.World = distributed.SINGLE
    """The training processes (several under torchrun; see :mod:`lopd.distributed`)."""
    wrapped: distributed.Wrapped | None = None
    """The student's one wrapped scoring module (DDP / FSDP2) when there are several processes."""
    validation_task_ids: frozenset[str] = frozenset()
    """The validation carve-out of a validation-mode run (train.eval_split=validation): tasks no
    method may learn from, retrieve or store (empty when evaluating on the eval split)."""


# ----------------------------------------------------------------------------------------------
# Task sampling and seeds: pure functions of (seed, step), so resume needs no sampler state.


def step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step * 7_919) % (2**63)


def tasks_for_step(tasks: list[Task], seed: int, step: int, n_tasks: int) -> list[Task]:
    """The ``n_tasks`` tasks of ``step`` (1-based): consecutive slices of a fresh permutation of the
    training tasks per epoch, so every task is seen once per epoch."""
    chosen = []
    for i in range((step - 1) * n_tasks, step * n_tasks):
        epoch, position = divmod(i, len(tasks))
        order = list(range(len(tasks)))
        random.Random(seed * 7_919 + epoch).shuffle(order)
        chosen.append(tasks[order[position]])
    return chosen


# ----------------------------------------------------------------------------------------------
# The run folder


def write_config(cfg: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def read_config(run_dir: Path, overrides: list[str] | None = None) -> Config:
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise RunError(f"{run_dir} is not a training run (no {CONFIG_FILE})")
    return load_config(path, overrides or [])


def checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first: a checkpoint is written in a temporary folder
    renamed when complete, so a half-written one is never listed. Whether a listed one's files are
    still intact (a disk that filled, a copy cut short) is :func:`read_checkpoint`'s question,
    which resume asks; listing stays cheap for the callers that only count or locate them."""
    folder = run_dir / CHECKPOINTS
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and _CHECKPOINT_RE.match(p.name))


def _reason(exc: BaseException) -> str:
    """An exception in a few words: its type and the first sentence of its message."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text.split('. ')[0]}" if text else type(exc).__name__


def read_checkpoint(folder: Path) -> dict:
    """The state (``state.pt``) of checkpoint ``folder``, once every file a resume reads from it
    is whole: ``state.pt`` and the RNG files load, the student folder has its config, every
    safetensors file (the student, a LoRA adapter, the composer, an EMA teacher) has its whole
    header and data, every JSON file parses and a sharded model's index names files that exist.
    A RunError names the first file that is not, and why. Only headers are read besides
    ``state.pt``, which the resume needs anyway."""
    from safetensors import safe_open

    path = folder / STATE_FILE
    if not path.is_file():
        raise RunError(f"{path} is missing")
    # Whatever a cut or damaged pickle raises (EOFError, RuntimeError from the zip reader,
    # UnpicklingError, ...) means the same: this checkpoint cannot be resumed from.
    try:
        state = torch.load(path, weights_only=False)
    except Exception as exc:
        raise RunError(f"{path} is unreadable ({_reason(exc)})") from None
    if not isinstance(state, dict) or not {"step", "generations", "student_updater",
                                           "algorithm", "rng"} <= set(state):
        raise RunError(f"{path} is not a checkpoint's state")
    for rng in sorted((folder / RNG_DIR).glob("*.pt")):
        try:
            torch.load(rng, weights_only=False)
        except Exception as exc:
            raise RunError(f"{rng} is unreadable ({_reason(exc)})") from None
    if not (folder / "student" / "config.json").is_file():
        raise RunError(f"{folder / 'student'} has no config.json")
    for weights in sorted(folder.rglob("*.safetensors")):
        try:
            with safe_open(str(weights), "pt"):
                pass
        except Exception as exc:
            raise RunError(f"{weights} is unreadable ({_reason(exc)})") from None
    for record in sorted(folder.rglob("*.json")):
        try:
            data = json.loads(record.read_text())
        except ValueError as exc:
            raise RunError(f"{record} is unreadable ({_reason(exc)})") from None
        if record.name.endswith(".safetensors.index.json"):
            missing = sorted({name for name in data.get("weight_map", {}).values()
                              if not (record.parent / name).is_file()})
            if missing:
                raise RunError(f"{record} names missing files: {', '.join(missing)}")
    return state


def resume_point(run_dir: Path, world: distributed.World = distributed.SINGLE
                 ) -> tuple[Path, dict]:
    """(checkpoint, its state) to resume ``run_dir`` from: the newest checkpoint that
    :func:`read_checkpoint` finds whole. A newer one that is not is skipped, said in one line,
    and left where it is (the resumed run writes that step's checkpoint again when it gets there);
    none whole is a RunError saying why each was refused."""
    import sys

    skipped = []
    for folder in reversed(checkpoints(run_dir)):
        try:
            state = read_checkpoint(folder)
        except RunError as exc:
            skipped.append(f"skipped {folder.name}: {exc}")
            continue
        if skipped and world.is_main:
            print(f"note: resuming {run_dir} from {folder.name}, its newest whole checkpoint; "
                  + "; ".join(skipped), file=sys.stderr)
        return folder, state
    if not skipped:
        raise RunError(f"{run_dir} has no complete checkpoint to resume from")
    raise RunError(f"{run_dir} has no readable checkpoint to resume from: {'; '.join(skipped)}")


def check_start(cfg: Config, algorithm_cls: type, world: distributed.World, fresh: bool) -> None:
    """Refuse, before the run folder is touched, every start the config alone rules out (a
    refused ``lopd train --out DIR`` leaves DIR as it was): how the student is spread over the
    processes, the step's task groups, the folder of the student's starting weights and the
    method's own checks (:meth:`Algorithm.check_config`). The trainer has already checked the
    rollout engine and sampling and made the tasks (which checks the validation carve-out)."""
    fsdp2 = world.enabled and world.parallel == "fsdp2"
    if fsdp2 and cfg.train.student == "lora":
        raise ConfigError("train.parallel=fsdp2 shards a full student; a LoRA student "
                          "(train.student=lora) trains with train.parallel=ddp")
    if fsdp2 and cfg.rollout.engine == "vllm":
        raise ConfigError("rollout.engine=vllm with train.parallel=fsdp2 is not supported: the "
                          "engine needs the full student weights on every rank after each "
                          "update; use train.parallel=ddp")
    group = algorithm_cls.group_size_in(cfg)
    if cfg.train.rollouts_per_step % group:
        raise ConfigError(f"train.rollouts_per_step={cfg.train.rollouts_per_step} must be a "
                          f"multiple of {algorithm_cls.name}'s group size {group}")
    n_tasks = cfg.train.rollouts_per_step // group
    if n_tasks % world.size:
        raise ConfigError(f"train.rollouts_per_step={cfg.train.rollouts_per_step} is {n_tasks} "
                          f"task groups of {group}, which do not split evenly over {world.size} "
                          f"processes: make the groups a multiple of {world.size}")
    if fresh or cfg.train.student == "lora":  # a resumed full student is in its checkpoint
        models.resolve_model_path(cfg.model.name_or_path)
    algorithm_cls.check_config(cfg, world, fresh)


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def read_jsonl(path: Path) -> list[dict]:
    """The records of a run's JSONL file (metrics, evals); [] when it does not exist yet.

    A torn last line — the record of a process killed while writing it, so without its final
    newline — is left out: it is the record of a step after the last checkpoint (a step's records
    are written before its checkpoint), which a resume runs again and whose records it rewrites.
    Any other line that is not a JSON object is a damaged file: a RunError naming file and line."""
    if not path.exists():
        return []
    text = path.read_text(errors="replace")
    lines = text.splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            if number == len(lines) and not text.endswith("\n"):
                break
            raise RunError(f"{path}:{number}: not a JSON record ({exc})") from None
        if not isinstance(record, dict):
            raise RunError(f"{path}:{number}: not a JSON record (a {type(record).__name__})")
        records.append(record)
    return records


def _rewrite_jsonl(path: Path, records: list[dict]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, path)


def peak_memory_mb(device: torch.device) -> dict[str, float]:
    """Peak resident memory of this process (and peak CUDA allocation on a GPU), in MiB."""
    figures = {"memory/peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if device.type == "cuda":
        figures["memory/peak_cuda_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return figures


# ----------------------------------------------------------------------------------------------
# The loop


@dataclass
class Trainer:
    """Owns the student, the run folder and the schedule; delegates updates to the algorithm."""

    cfg: Config
    run_dir: Path
    algorithm_cls: type
    resume: bool = False
    progress: bool = True
    ctx: TrainContext = field(init=False)

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise RunError(f"{self.run_dir} is a file, not a run folder")
        if self.resume and not checkpoints(self.run_dir):
            raise RunError(f"{self.run_dir} has no complete checkpoint to resume from")
        if not self.resume and (self.run_dir / CONFIG_FILE).exists():
            raise RunError(f"{self.run_dir} already holds a run; resume it with --resume "
                           f"{self.run_dir} or choose a new --out")
        cfg = self.cfg
        stages.check_engine(cfg.rollout)
        check_sampling(cfg.rollout)
        self.world, device = distributed.init(runtime.resolve_device(cfg.run.device),
                                              cfg.train.parallel)
        world = self.world
        runtime.setup(cfg.run)
        self.env = stages.get_env(cfg)
        self.train_tasks, self.eval_tasks = stages.held_out_tasks(cfg, self.env)
        train_tasks = self.train_tasks
        # Everything the config decides is refused before the run folder is touched.
        check_start(cfg, self.algorithm_cls, world, fresh=not self.resume)
        checkpoint, state = None, None
        if self.resume:
            checkpoint, state = resume_point(self.run_dir, world)
            for name in (METRICS_FILE, EVAL_FILE):  # a damaged record is named before any load
                read_jsonl(self.run_dir / name)
        # Every rank has looked at the folder before rank 0 writes into it.
        world.barrier()
        if world.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        world.barrier()

        self.device = device
        student, tokenizer = self._load_student(checkpoint)
        self.precision, why = runtime.choose_precision(cfg.run.precision, self.device,
                                                       runtime.hidden_size(student))
        self.dtype = runtime.resolve_dtype(cfg.run.dtype, self.device, self.precision)
        if world.is_main and self.progress:
            print(f"precision: {self.precision} ({why})")
        # One wrapped scoring module for the whole run; the optimiser is built on the parameters
        # it leaves (FSDP2 replaces them by sharded ones).
        self.wrapped = distributed.wrap_student(student, world) if world.enabled else None
        updater = Updater(student.parameters(), cfg.train.learning_rate, cfg.train.max_grad_norm,
                          cfg.train.weight_decay)
        if self.wrapped is not None:
            updater.wrapped = True
            if self.wrapped.parallel == "fsdp2" and self._frozen_rows:
                masks = distributed.row_masks(student, self._frozen_rows)
                updater.grad_filters.append(lambda: distributed.apply_row_masks(masks))
        validation = frozenset(t.task_id for t in self.eval_tasks) \
            if cfg.train.eval_split == "validation" else frozenset()
        self.ctx = TrainContext(cfg, student, tokenizer, self.device, self.dtype, self.env,
                                {t.task_id: t for t in train_tasks}, self.run_dir, updater,
                                self.precision, world, self.wrapped, validation)
        self.algorithm = self.algorithm_cls(self.ctx, checkpoint)
        self.setup_generations = self.algorithm.setup_rollouts()
        fsdp2 = world.enabled and world.parallel == "fsdp2"
        self.engine = stages.make_engine(cfg.rollout, student, tokenizer, self.precision,
                                           train=True, fsdp2=fsdp2)
        if world.is_main and self.progress:
            name, why = stages.engine_name(cfg.rollout, fsdp2)
            weights = ""
            if name == "transformers" and self.precision == "bf16-mixed":
                weights = (", from a bfloat16 copy of the student refreshed after each update"
                           if self.engine.model is not student
                           else ", from the student's weights under bf16 autocast")
                weights += f" (rollout.generation_weights={cfg.rollout.generation_weights})"
            print(f"rollouts: {name} engine ({why}){weights}")
        self.start_step, self.generations = 0, 0
        if checkpoint is not None:
            self._restore(checkpoint, state)
        elif world.is_main:
            # Written last: a folder holds a run only once the run is set up, so a start that
            # fails on the way (a damaged model or composer folder) can be repeated as it was.
            write_config(cfg, self.run_dir / CONFIG_FILE)

    # -- the student --------------------------------------------------------------------------

    def _load_student(self, checkpoint: Path | None):
        cfg = self.cfg
        source = checkpoint / "student" if checkpoint is not None and cfg.train.student == "full" \
            else cfg.model.name_or_path
        # The student trains: float32 weights and optimiser state in every precision mode.
        model, tokenizer = models.load_model(source, device=self.device, dtype=torch.float32,
                                             trust_remote_code=cfg.model.trust_remote_code)
        # <|latent|> only ever appears in the teacher's prompt: the student loss never trains it.
        latent_id = tokenizer.convert_tokens_to_ids(chat.LATENT_TOKEN)
        self._frozen_rows = []
        if latent_id is not None and latent_id != tokenizer.unk_token_id:
            models.freeze_token_rows(model, [latent_id])
            self._frozen_rows = [latent_id]
        if cfg.train.gradient_checkpointing:
            models.enable_activation_checkpointing(model)
        if cfg.train.student == "lora":
            from peft import LoraConfig

            for p in model.parameters():
                p.requires_grad_(False)
            model = models.lora_model(model, LoraConfig(
                r=cfg.train.student_lora_r, lora_alpha=cfg.train.student_lora_alpha,
                lora_dropout=0.0, target_modules=list(cfg.composer.lora_targets)))
            if checkpoint is not None:
                from peft import set_peft_model_state_dict
                from safetensors.torch import load_file

                set_peft_model_state_dict(model, load_file(
                    checkpoint / "student_adapter.safetensors", device=str(self.device)))
        return model, tokenizer

    def _save_student(self, folder: Path) -> None:
        student, tokenizer = self.ctx.student, self.ctx.tokenizer
        if self.wrapped is not None and self.wrapped.parallel == "fsdp2":
            state = distributed.full_state_dict(self.wrapped, self.world)  # collective
            if self.world.is_main:
                with models.quiet_progress():
                    student.save_pretrained(folder / "student", state_dict=state)
                tokenizer.save_pretrained(folder / "student")
            return
        if not self.world.is_main:
            return
        if self.cfg.train.student == "lora":
            import copy

            from peft import get_peft_model_state_dict
            from safetensors.torch import save_file

            save_file({k: v.detach().cpu().contiguous()
                       for k, v in get_peft_model_state_dict(student).items()},
                      folder / "student_adapter.safetensors")
            student = copy.deepcopy(student).merge_and_unload()
        models.save_model(student, tokenizer, folder / "student")

    # -- checkpoints --------------------------------------------------------------------------

    def save_checkpoint(self, step: int) -> Path:
        """Write the checkpoint of ``step`` atomically: a temporary folder renamed when complete.

        With several processes: rank 0 writes the HF student (from the full state dict), the
        algorithm's artefacts and ``state.pt``; every rank writes its RNG state and its part of the
        student's optimiser state (torch.distributed.checkpoint, sharded under FSDP2); the folder
        is renamed by rank 0 after a barrier."""
        world = self.world
        folder = self.run_dir / CHECKPOINTS
        final = folder / f"step-{step:06d}"
        tmp = folder / f".step-{step:06d}.tmp"
        if world.is_main:
            folder.mkdir(exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        world.barrier()
        self._save_student(tmp)
        updater = self.ctx.student_updater
        if world.enabled:
            distributed.save_optimizer(self.wrapped, updater.optimizer, tmp / OPTIMIZER_DIR)
            (tmp / RNG_DIR).mkdir(exist_ok=True)
            torch.save(_rng_state(), tmp / RNG_DIR / f"rank-{world.rank}.pt")
        if world.is_main:
            self.algorithm.save(tmp)
            torch.save({"step": step, "generations": self.generations,
                        "student_updater": updater.state_dict() if not world.enabled
                        else {"skipped": updater.skipped},
                        "algorithm": self.algorithm.state_dict(), "rng": _rng_state(),
                        "world_size": world.size, "parallel": world.parallel},
                       tmp / STATE_FILE)
        world.barrier()
        if world.is_main:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            for old in checkpoints(self.run_dir)[: -self.cfg.train.keep_checkpoints]:
                shutil.rmtree(old)
        world.barrier()
        return final

    def _restore(self, checkpoint: Path, state: dict) -> None:
        """Continue from ``checkpoint``, whose ``state.pt`` :func:`resume_point` has read."""
        import sys

        world = self.world
        saved_world = state.get("world_size", 1)
        updater = self.ctx.student_updater
        if (checkpoint / OPTIMIZER_DIR).is_dir():
            scorer = self.wrapped.scorer if self.wrapped is not None else None
            if scorer is None:
                from lopd.teacher import ActionScorer

                scorer = ActionScorer(self.ctx.student)
            distributed.load_optimizer(scorer, updater.optimizer, checkpoint / OPTIMIZER_DIR)
            updater.skipped = state["student_updater"]["skipped"]
        elif self.wrapped is not None and self.wrapped.parallel == "fsdp2":
            raise RunError(f"{checkpoint} was written by one process (no sharded optimiser state); "
                           "resume it with one process or with train.parallel=ddp")
        else:
            updater.load_state_dict(state["student_updater"])
        self.algorithm.load_state_dict(state["algorithm"])
        rng = checkpoint / RNG_DIR / f"rank-{world.rank}.pt"
        _set_rng_state(torch.load(rng, weights_only=False) if rng.is_file() else state["rng"])
        self.start_step, self.generations = state["step"], state["generations"]
        if saved_world != world.size and world.is_main:
            print(f"note: {checkpoint} was written by {saved_world} process(es) and resumes on "
                  f"{world.size}: weights, optimiser state, β and the bank are restored exactly, "
                  f"but later steps sample their rollouts in {world.size} shard(s) instead of "
                  f"{saved_world}, so they differ from an uninterrupted {saved_world}-process run",
                  file=sys.stderr)
        # Records written after the checkpoint belong to steps that will run again.
        if world.is_main:
            for name in (METRICS_FILE, EVAL_FILE):
                path = self.run_dir / name
                _rewrite_jsonl(path, [r for r in read_jsonl(path) if r["step"] <= self.start_step])
        world.barrier()

    # -- rollouts and evaluation --------------------------------------------------------------

    def _policy(self, temperature: float, seed: int):
        return stages.model_policy(self.cfg, self.ctx.student, self.ctx.tokenizer, temperature,
                                     seed, engine=self.engine)

    def rollouts(self, tasks: list[Task], temperature: float, seed: int | None) -> list[Rollout]:
        self.ctx.student.eval()
        with torch.no_grad(), distributed.generation(self.wrapped), \
                runtime.autocast(self.precision, self.device):
            return stages.run_episodes(self.cfg, self.env, tasks, self._policy(temperature, seed),
                                         self.ctx.tokenizer, progress=False)

    def evaluate(self, step: int) -> dict[str, float]:
        """Greedy (rollout.eval_temperature) episodes on the held-out tasks."""
        start = time.perf_counter()
        self.ctx.student.eval()
        policy = self._policy(self.cfg.rollout.eval_temperature, step_seed(self.cfg.run.seed, -1))
        if not self.world.enabled:
            with runtime.autocast(self.precision, self.device):
                summary, _ = stages.evaluate(self.cfg, self.env, self.eval_tasks, policy,
                                               self.ctx.tokenizer, progress=False)
        else:
            # Each rank plays a contiguous share of the held-out tasks; the summary is of all.
            from lopd.agent import summarize

            with torch.no_grad(), distributed.generation(self.wrapped), \
                    runtime.autocast(self.precision, self.device):
                mine = stages.run_episodes(self.cfg, self.env,
                                             self.world.shard(self.eval_tasks, even=False), policy,
                                             self.ctx.tokenizer, progress=False)
            summary = summarize(self.world.gather(mine))
        record = {"step": step, "generations": self.generations,
                  "setup_generations": self.setup_generations,
                  "seconds": round(time.perf_counter() - start, 2), **summary}
        if self.world.is_main:
            with (self.run_dir / EVAL_FILE).open("a") as f:
                f.write(json.dumps(record) + "\n")
        return {"eval/mean_reward": summary["mean_reward"],
                "eval/success_rate": summary["success_rate"],
                **{f"eval/{d}/success_rate": v["success_rate"]
                   for d, v in summary["per_domain"].items()}}

    # -- the loop -----------------------------------------------------------------------------

    def step_tasks(self, step: int) -> list[Task]:
        """The tasks of ``step``, all processes' together: each task of the step's groups
        ``group_size`` times in a row (the loop shards them over the processes)."""
        group = self.algorithm.group_size
        return [t for t in tasks_for_step(self.train_tasks, self.cfg.run.seed, step,
                                          self.cfg.train.rollouts_per_step // group)
                for _ in range(group)]

    def run(self) -> dict:
        from torch.utils.tensorboard import SummaryWriter

        cfg = self.cfg
        world = self.world
        writer = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=self.start_step + 1
                               if self.start_step else None) if world.is_main else None
        metrics_path = self.run_dir / METRICS_FILE
        if self.start_step == 0 and cfg.train.eval_at_start:
            record = {"step": 0, "generations": 0, **self.evaluate(0)}
            self._log(record, writer, metrics_path)
        bar = tqdm(total=cfg.train.max_steps, initial=self.start_step, desc=f"train {self.algorithm.name}",
                   unit="step", disable=not self.progress or not world.is_main)
        last = {}
        for step in range(self.start_step + 1, cfg.train.max_steps + 1):
            seed = step_seed(cfg.run.seed, step)
            runtime.set_seed(seed)
            # Each rank rolls out its contiguous share of the step's task groups.
            tasks = world.shard(self.step_tasks(step))
            started = time.perf_counter()
            rollouts = self.rollouts(tasks, cfg.rollout.temperature,
                                     distributed.shard_seed(seed, world.rank))
            rollout_seconds = time.perf_counter() - started
            # rollout.vllm_sleep: vLLM's memory is the update's until the sync below wakes it.
            self.engine.sleep()
            self.ctx.student.train()
            figures = self.algorithm.step(StepBatch(step, tasks, rollouts))
            # An engine that keeps its own copy of the weights (vLLM) samples the next step from
            # the updated student.
            stages.sync_engine(self.engine, self.ctx.student)
            self.generations += len(rollouts) * world.size
            shares = world.mean({"train/mean_reward": float(np.mean([r.reward for r in rollouts])),
                                 "train/success_rate": float(np.mean([r.success
                                                                      for r in rollouts]))})
            tokens = sum(r.generated_tokens for r in rollouts)
            if world.enabled:
                tokens = int(round(world.sum({"tokens": tokens})["tokens"]))
            record = {"step": step, "generations": self.generations, **shares,
                      "train/generated_tokens": tokens,
                      "time/rollout": rollout_seconds, **figures,
                      "time/step": time.perf_counter() - started,
                      "student/skipped_updates": self.ctx.student_updater.skipped,
                      **peak_memory_mb(self.device)}
            if step % cfg.train.eval_every == 0 or step == cfg.train.max_steps:
                record.update(self.evaluate(step))
            self._log(record, writer, metrics_path)
            if step % cfg.train.save_every == 0 or step == cfg.train.max_steps:
                self.save_checkpoint(step)
            last = record
            bar.update(1)
            shown = {"train/mean_reward": "reward", "eval/mean_reward": "eval", "kl": "kl",
                     "delta": "delta"}
            bar.set_postfix({name: f"{record[k]:.3f}" for k, name in shown.items() if k in record})
        bar.close()
        if world.is_main:
            writer.close()
            self.plot()
        return last

    def _log(self, record: dict, writer, path: Path) -> None:
        if writer is None:  # not rank 0
            return
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if key not in ("step", "generations") and isinstance(value, (int, float)):
                writer.add_scalar(key, value, record["step"])
        writer.flush()

    def plot(self) -> Path:
        return plot_run(self.run_dir, self.algorithm.panels(), self.algorithm.name)


def plot_run(run_dir: Path, extra: list[Panel], title: str = "") -> Path:
    """``training.png``: held-out and training reward against generations, then ``extra`` panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_jsonl(run_dir / METRICS_FILE)
    panels = [Panel("held-out mean reward", ("eval/mean_reward", "eval/success_rate")),
              Panel("training rollouts", ("train/mean_reward", "train/success_rate")), *extra]
    cols = 3
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        for key in panel.keys:
            points = [(r["generations"], r[key]) for r in records if key in r]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o" if len(points) < 30 else None, ms=3,
                        label=key.split("/")[-1])
        if panel.hline is not None:
            ax.axhline(panel.hline, color="grey", ls="--", lw=1, label=panel.hline_label)
        ax.set_title(panel.title)
        ax.set_xlabel("generations (rollouts)")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"{title} — {run_dir.name}")
    fig.tight_layout()
    path = run_dir / PLOT_FILE
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def train(cfg: Config, run_dir: str | Path, algorithm: str, resume: bool = False,
          progress: bool = True) -> dict:
    """Run (or resume) training with the named algorithm; returns the last step's metrics."""
    trainer = Trainer(cfg, Path(run_dir), get_algorithm(algorithm), resume=resume, progress=progress)
    try:
        return trainer.run()
    finally:
        trainer.world.close(trainer.wrapped)
        # A single process may train run after run (compare, sweep): free this run's engine.
        # Under torchrun the process ends with the run, and vLLM's shutdown would tear down
        # process groups that world.close already destroyed.
        if not trainer.world.enabled:
            trainer.engine.close()
